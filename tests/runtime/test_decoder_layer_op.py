"""quantpipe_cpu::decoder_layer, one C++ call per decoder layer of a short step, against the same
step run op by op from Python (each op its own call), on each ISA build this CPU runs.

The layer op calls the same kernels in the same order on the same tensors, so the logits must
be *equal*, not close: the tests compare with torch.equal. Covered: asymmetric and symmetric
layers (a symmetric layer stores no mz: the kernel forms -8 * scale), q/k/v biases (Qwen2),
Gemma 3's layer (per-head q/k norms, the sandwich norms around both sublayers, (1 + w) gains,
gelu_pytorch_tanh, query_pre_attn_scalar, sliding and global layers with a window shorter than
the sequence), act-order column orders, fp32 and bf16 KV caches, prefill chunks and mixed
decode steps."""

from __future__ import annotations

import pytest
import torch

from quantpipe.core.qformat import QuantSpec
from quantpipe.runtime.engine import load_model_for_serving, model_runner
from quantpipe.runtime.engine.model_runner import LAYER_OP_ENV, ModelRunner, SeqChunk
from quantpipe.runtime.kernels import cpu as cpu_kernels
from quantpipe.runtime.kernels import cpu_ext
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.runtime._quant_helpers import quantize_folder, random_packed
from tests.tiny_models import make_family_model, make_model, save_model

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not cpu_ext.cpu_can_run(isa),
                                                   reason=f"the CPU cannot run the {isa} build"))
        for isa in cpu_ext.ISAS]


@pytest.fixture
def isa_env(request, monkeypatch):
    isa = request.node.callspec.params["isa"]
    for name in (cpu_ext.ENV, "QUANTPIPE_CPU_INT4_ACT", LAYER_OP_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(cpu_ext.ISA_ENV, isa)
    cpu_ext.reset()
    usable, why = cpu_ext.build_status(isa)
    assert usable, why
    yield isa
    monkeypatch.undo()
    cpu_ext.reset()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(family, symmetric) -> a quantized tiny model folder (every linear W4 g32); (family,
    "fp16") -> its FP16 export."""
    out = {}
    for family in ("llama", "qwen2", "gemma3_text"):
        # gemma3_text: sliding window 8 on layer 0, full attention on layer 1 (FAMILY_CONFIGS)
        model, tok = make_family_model(family) if family == "gemma3_text" else make_model(family)
        src = save_model(model, tok, tmp_path_factory.mktemp(f"src-{family}"))
        fp16 = tmp_path_factory.mktemp(f"fp16-{family}") / "fp16"
        export_fp16(Fp16ExportSpec(str(src), fp16))
        out[family, "fp16"] = fp16
        for sym in (False, True) if family != "gemma3_text" else (False,):
            q = tmp_path_factory.mktemp(f"q-{family}-{sym}") / "q"
            quantize_folder(fp16, q, [QuantSpec(4, 32, sym)])
            out[family, sym] = q
        if family == "llama":  # q, k, v, o, gate, up, down: o_proj 8-bit in every layer
            q = tmp_path_factory.mktemp("q-mixed") / "q"
            w4 = QuantSpec(4, 32, False)
            quantize_folder(fp16, q, [w4, w4, w4, QuantSpec(8, -1, True), w4, w4, w4])
            out["mixed"] = q
    return out


class CountingOps:
    """An op namespace that counts decoder_layer calls."""

    def __init__(self, ops) -> None:
        self._ops, self.calls = ops, 0

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def decoder_layer(self, *args):
        self.calls += 1
        return self._ops.decoder_layer(*args)


def _steps(prompts):
    """Prefill chunks (one longer than a block), a mixed step, then decode steps: the contexts
    grow to 13 and 10 tokens, past the gemma3_text model's sliding window of 8."""
    a, b = prompts
    A = [0, 1, 2, 6]  # a's blocks
    return [
        [SeqChunk(a, 0, A)],
        [SeqChunk(b[:5], 0, [3, 4, 5]), SeqChunk([7], len(a), A)],
        [SeqChunk(b[5:], 5, [3, 4, 5]), SeqChunk([9], len(a) + 1, A)],
        [SeqChunk([4], len(b), [3, 4, 5]), SeqChunk([5], len(a) + 2, A)],
        [SeqChunk([6], len(b) + 1, [3, 4, 5]), SeqChunk([8], len(a) + 3, A)],
        [SeqChunk([3], len(b) + 2, [3, 4, 5])],
    ]


@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16], ids=["kv-fp32", "kv-bf16"])
@pytest.mark.parametrize("family,sym", [("llama", False), ("llama", True), ("qwen2", False),
                                        ("gemma3_text", False)])
@pytest.mark.parametrize("isa", ISAS)
def test_layer_op_logits_equal_the_op_by_op_run(isa, isa_env, folders, family, sym, kv_dtype,
                                                monkeypatch):
    model, tok = load_model_for_serving(folders[family, sym], "cpu", torch.float32)
    whole = ModelRunner(model, 4, 16, kv_dtype)
    assert whole.fused, whole.fused_reason
    assert all(args is not None for args in whole.layer_ops)  # every layer is one call
    qkv = whole.projections[0].qkv
    assert (qkv.mz is None) == sym  # symmetric layers hold no mz tensor
    assert (whole.projections[0].qkv_bias is not None) == (family == "qwen2")
    if family == "gemma3_text":  # the layer op runs a sliding and a global layer
        assert [p.window for p in whole.plans] == [8, None]
        assert whole.act == "gelu_pytorch_tanh" and whole.scale == 32**-0.5
        assert all(w is not None for w in whole.layer_ops[0][0][3:7])  # q/k and sandwich norms
    monkeypatch.setenv(LAYER_OP_ENV, "0")
    _check_equal_to_op_by_op(whole, ModelRunner(model, 4, 16, kv_dtype), len(tok), seed=5)


def _check_equal_to_op_by_op(whole: ModelRunner, by_op: ModelRunner, vocab: int, seed: int):
    """``whole`` (every layer one decoder_layer call) and ``by_op`` (the layer op turned off)
    give equal logits at every step of :func:`_steps` and hold equal KV caches after them."""
    assert all(args is None for args in by_op.layer_ops)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 7)]
    whole.ops = counting = CountingOps(whole.ops)
    for chunks in _steps(prompts):
        got, want = whole.forward(chunks), by_op.forward(chunks)
        assert torch.equal(got, want), float((got - want).abs().max())
    for i in range(len(whole.layers)):  # the caches hold the same keys and values
        assert torch.equal(whole.k_pools[i], by_op.k_pools[i])
        assert torch.equal(whole.v_pools[i], by_op.v_pools[i])
    assert counting.calls == len(_steps(prompts)) * len(whole.layers)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
@pytest.mark.parametrize("isa", ISAS)
def test_fp16_folder_layers_run_as_one_call_equal_to_their_ops(isa, isa_env, folders, family,
                                                                monkeypatch):
    """An FP16 folder's linears run on fp16_mm (runtime.fp_head.set_half_linears): q/k/v and
    gate/up are stacked (the parts' weights become views of the stack: held once), the layer
    op takes the blocked fp16 weights, and a short step's logits and caches equal the op-by-op
    run's; the stacked logits equal the unstacked HF modules' within fp32 rounding."""
    model, tok = load_model_for_serving(folders[family, "fp16"], "cpu", torch.float32,
                                        head_dtype="fp16")
    attn = model.model.layers[0].self_attn
    with torch.no_grad():  # the modules themselves, before any stacking
        x = torch.randn(3, attn.q_proj.in_features, generator=torch.Generator().manual_seed(1))
        parts = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    whole = ModelRunner(model, 4, 16)
    qkv = whole.projections[0].qkv
    assert isinstance(qkv, torch.Tensor) and qkv.dtype == torch.float16  # blocked fp16 stack
    assert attn.q_proj.w16.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert (whole.projections[0].qkv_bias is not None) == (family == "qwen2")
    assert all(args is not None and args[1] == [0, 0, 0, 0] for args in whole.layer_ops)
    with torch.no_grad():  # the parts, now views of the stack, give the same outputs
        assert all(torch.equal(a, b) for a, b in zip(
            parts, [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]))
    monkeypatch.setenv(LAYER_OP_ENV, "0")
    _check_equal_to_op_by_op(whole, ModelRunner(model, 4, 16), len(tok), seed=7)


@pytest.mark.parametrize("isa", ISAS)
def test_layers_with_an_8bit_part_run_op_by_op(isa, isa_env, folders):
    """A mixed plan's 8-bit o_proj: the layer op does not take it; those layers run op by op
    and give the same logits as with the layer op turned off."""
    model, tok = load_model_for_serving(folders["mixed"], "cpu", torch.float32)
    runner = ModelRunner(model, 4, 16)
    assert runner.fused and all(args is None for args in runner.layer_ops)
    ids = list(range(3, 12))
    got = runner.forward([SeqChunk(ids, 0, [0, 1, 2])])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LAYER_OP_ENV, "0")
        want = ModelRunner(model, 4, 16).forward([SeqChunk(ids, 0, [0, 1, 2])])
    assert torch.equal(got, want)


@pytest.mark.parametrize("isa", ISAS)
def test_sym_layer_without_mz_equals_explicit_mz(isa, isa_env):
    """A symmetric layer's absent mz is -8 * scale formed in the kernel: the same fp32 values
    as the stored tensor, so the outputs are equal; act-order column orders included."""
    for act in (False, True):
        p = random_packed(48, 256, QuantSpec(4, 64, True, act), seed=11)
        w = cpu_kernels.repack_w4a8(p, isa)
        assert w.mz is None
        explicit = cpu_kernels.CpuW4A8(w.packed, w.scales, cpu_kernels.w4a8_mz(w), w.perm,
                                       w.group_size, w.op, w.vnni)
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
        assert torch.equal(cpu_kernels.w4a8_matmul(x, w), cpu_kernels.w4a8_matmul(x, explicit))


def _random_layer_op_args(isa, gemma: bool):
    """decoder_layer's weights, group sizes, vnni, eps and window/activation for random W4A8
    layers with act-order column orders and mixed mz / no mz; ``gemma``: with q/k norms, the
    sandwich norms, a sliding window of 5 and gelu_pytorch_tanh."""
    hidden, inter, H, KV, D = 64, 96, 4, 2, 16
    specs = [QuantSpec(4, 32, False, True), QuantSpec(4, 32, True, True),
             QuantSpec(4, 32, False, False), QuantSpec(4, 32, True, True)]
    shapes = [((H + 2 * KV) * D, hidden), (hidden, H * D), (2 * inter, hidden), (hidden, inter)]
    ws = [cpu_kernels.repack_w4a8(random_packed(o, i, s, seed=20 + n), isa)
          for n, ((o, i), s) in enumerate(zip(shapes, specs))]
    g = torch.Generator().manual_seed(4)
    # gains of input, mlp-in, q, k, attention-out and mlp-out norms
    gains = [torch.rand(n, generator=g) + 0.5 for n in (hidden, hidden, D, D, hidden, hidden)]
    if not gemma:
        gains[2:] = [None] * 4
    bias = torch.randn((H + 2 * KV) * D, generator=g)
    weights = gains[:2] + [bias] + gains[2:]
    for w in ws:
        weights += [w.packed, w.scales, w.mz, w.perm]
    eps = [1e-5, 1e-6, 2e-6, 3e-6, 4e-6, 5e-6]
    extra = (5, "gelu_pytorch_tanh") if gemma else (0, "silu")
    return ws, gains, bias, weights, eps, extra, (H, KV, D)


@pytest.mark.parametrize("gemma", [False, True], ids=["llama-layer", "gemma3-layer"])
@pytest.mark.parametrize("isa", ISAS)
def test_layer_op_with_act_order_equals_its_ops(isa, isa_env, gemma):
    """The op on random layers with act-order column orders and mixed mz / no mz (and Gemma
    3's norms, window and activation), against the same ops called one by one (the engine's
    checkpoints above have no column orders)."""
    ops = cpu_ext.ops(isa)
    ws, gains, bias, weights, eps, (window, act), (H, KV, D) = _random_layer_op_args(isa, gemma)
    g = torch.Generator().manual_seed(5)
    T, hidden = 3, gains[0].numel()
    h0 = torch.randn(T, hidden, generator=g)
    delta = torch.randn(T, hidden, generator=g)
    cos, sin = torch.rand(T, D, generator=g), torch.rand(T, D, generator=g)
    pools = [torch.randn(4, 4, KV, D, generator=g) for _ in range(2)]
    slots = torch.tensor([5, 6, 7])
    tables, ctx, qlen = torch.tensor([[0, 1]]), torch.tensor([8]), torch.tensor([3])

    h1, kp1, vp1 = h0.clone(), pools[0].clone(), pools[1].clone()
    got = ops.decoder_layer(h1, delta, weights, [32] * 4, ws[0].vnni, eps, 0.25, window, act,
                            cos, sin, kp1, vp1, slots, tables, ctx, qlen)

    def norm(x, i):  # the optional norm i (2: q, 3: k, 4: attention out, 5: MLP out)
        return x if gains[i] is None else ops.add_rms_norm_(x, None, gains[i], eps[i])

    h2, kp2, vp2 = h0.clone(), pools[0].clone(), pools[1].clone()
    x = ops.add_rms_norm_(h2, delta, gains[0], eps[0])
    qkv = cpu_kernels.w4a8_matmul(x, ws[0]) + bias
    q, k, v = (t.reshape(-1, D).contiguous() for t in qkv.split([H * D, KV * D, KV * D], 1))
    q, k, v = norm(q, 2).view(T, H, D), norm(k, 3).view(T, KV, D), v.view(T, KV, D)
    ops.rope_(q, k, cos, sin)
    kp2.view(-1, KV, D)[slots] = k
    vp2.view(-1, KV, D)[slots] = v
    o = ops.paged_attention(q, kp2, vp2, tables, ctx, qlen, 0.25, window)
    o = norm(cpu_kernels.w4a8_matmul(o.reshape(T, -1), ws[1]), 4)
    x = ops.add_rms_norm_(h2, o, gains[1], eps[1])
    gated = ops.gelu_tanh_mul if gemma else ops.silu_mul
    want = norm(cpu_kernels.w4a8_matmul(gated(cpu_kernels.w4a8_matmul(x, ws[2])), ws[3]), 5)
    assert torch.equal(got, want) and torch.equal(h1, h2)
    assert torch.equal(kp1, kp2) and torch.equal(vp1, vp2)
    with pytest.raises(RuntimeError, match="23 weights"):
        ops.decoder_layer(h1, None, weights[:-1], [32] * 4, ws[0].vnni, eps, 0.25, window, act,
                          cos, sin, kp1, vp1, slots, tables, ctx, qlen)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.decoder_layer(h1, None, weights, [32] * 4, ws[0].vnni, eps, 0.25, window, act,
                          cos, sin, kp1, vp1, torch.tensor([5, 6, 99]), tables, ctx, qlen)
    with pytest.raises(RuntimeError, match="activation 'relu'"):
        ops.decoder_layer(h1, None, weights, [32] * 4, ws[0].vnni, eps, 0.25, window, "relu",
                          cos, sin, kp1, vp1, slots, tables, ctx, qlen)


@pytest.mark.parametrize("isa", ISAS)
def test_gemma3_layer_op_matches_the_torch_modules(isa, isa_env, folders, monkeypatch):
    """Gemma 3's layer op against the runner without quantpipe's fused ops (transformers' norms
    and gelu, SDPA under window_mask; the same W4A8 linears): close, as only the rounding of
    the norms, the activation and the attention sums differs."""
    model, tok = load_model_for_serving(folders["gemma3_text", False], "cpu", torch.float32)
    whole = ModelRunner(model, 4, 16)
    assert all(args is not None for args in whole.layer_ops)
    monkeypatch.setattr(model_runner, "fused_ops_status", lambda *a: (False, "test"))
    plain = ModelRunner(model, 4, 16)
    assert not plain.fused
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (9, 7)]
    for chunks in _steps(prompts):
        got, want = whole.forward(chunks), plain.forward(chunks)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
