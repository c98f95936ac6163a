"""The runtime load's memory-saving paths give exactly the tensors of the paths they replace:
W4A8 repacked from the packed words (no unpacked layer), a native checkpoint's layers read as
stored (no unpack / pack round trip), q/k/v and gate/up stacked part by part, and the int8
head quantized in place."""

from __future__ import annotations

import pytest
import torch

from quantpipe.core.formats.writers import write_checkpoint
from quantpipe.core.qformat import QuantizedWeight, QuantSpec, pack_int32, unpack_int32
from quantpipe.runtime import fp_head
from quantpipe.runtime.engine.model_runner import fuse_projections
from quantpipe.runtime.kernels import cpu as cpu_kernels
from quantpipe.runtime.kernels import cpu_ext
from quantpipe.runtime.kernels.cpu import block_rows
from quantpipe.runtime.loader import load_quantized_model, read_packed
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.runtime._quant_helpers import random_packed

needs_kernels = pytest.mark.skipif(not cpu_ext.kernel_status()[0],
                                   reason="quantpipe's CPU kernels are not usable here")


def _previous_repack_w4a8(p):
    """The W4A8 repack before the word path: the whole layer unpacked to uint8 [out, in],
    columns permuted for act-order, then packed (and the same scale / mz formulas)."""
    q = p.unpacked_q()  # [out, in] uint8
    perm = None
    if p.g_idx is not None:
        perm = cpu_kernels.act_order_permutation(p)
        q = q[:, perm].contiguous()
    zeros = p.zeros_u8()
    mz = None if bool((zeros == 8).all()) else block_rows(-zeros.float() * p.scales.float())
    return cpu_kernels.pack_w4a8(q.contiguous()), block_rows(p.scales), mz, perm


@pytest.mark.parametrize("out_f,in_f", [(16, 32), (48, 64), (112, 4096), (32, 11008)])
def test_word_repack_equals_packing_the_unpacked_codes(out_f, in_f):
    gen = torch.Generator().manual_seed(out_f + in_f)
    q = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=gen)
    q[0] = 15  # words 0xFFFFFFFF (int32 -1): every shift crosses the sign bit
    q[1, ::8] = 8  # a code 8 in slot 0 and codes in the top slot with bit 31 set
    words = pack_int32(q, 4)  # [out, in / 8] int32
    want = cpu_kernels.pack_w4a8(q)
    assert torch.equal(unpack_int32(words, 4), q)
    for rows in (None, 16, 32):  # the default slices, and slices that split the layer
        got = cpu_kernels.pack_w4a8_words(words, rows)
        assert got.dtype == torch.uint8 and got.shape == want.shape
        assert torch.equal(got, want)
        assert torch.equal(cpu_kernels.unpack_w4a8(got), q)


def test_repack_slices_stay_below_torch_parallel_grain():
    assert cpu_kernels.repack_rows(512) == 48  # 4096 columns of words: 48 rows per slice
    assert cpu_kernels.repack_rows(1376) == 16
    assert cpu_kernels.repack_rows(10**6) == 16  # wider than a slice: 16 rows at a time
    assert all(cpu_kernels.repack_rows(n) * n <= cpu_kernels.REPACK_SLICE
               for n in (8, 100, 512, 1376, 2047))


@needs_kernels
@pytest.mark.parametrize("spec,out_f,in_f", [
    (QuantSpec(4, 128, True), 112, 4096),  # sym: several word slices, the last one short
    (QuantSpec(4, 32, False), 48, 256),  # asym: mz kept
    (QuantSpec(4, 64, True, act_order=True), 64, 4096),  # act-order: the permuted slices
    (QuantSpec(4, 32, False, act_order=True), 32, 128),
])
def test_repack_w4a8_equals_the_previous_repack(spec, out_f, in_f):
    p = random_packed(out_f, in_f, spec, seed=out_f)
    packed, scales, mz, perm = _previous_repack_w4a8(p)
    w = cpu_kernels.repack_w4a8(p)
    assert torch.equal(w.packed, packed) and torch.equal(w.scales, scales)
    assert (w.mz is None) == (mz is None) and (mz is None or torch.equal(w.mz, mz))
    assert (w.perm is None) == (perm is None) and (perm is None or torch.equal(w.perm, perm))


def _random_weight(out_f: int, in_f: int, spec: QuantSpec, gen) -> QuantizedWeight:
    gs = spec.group_size_for(in_f)
    q = torch.randint(0, 2**spec.bits, (out_f, in_f), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(out_f, in_f // gs, generator=gen) * 0.05 + 0.005).half()
    zeros = (torch.full_like(scales, spec.sym_zero, dtype=torch.uint8) if spec.sym else
             torch.randint(0, 2**spec.bits, scales.shape, dtype=torch.uint8, generator=gen))
    g_idx = None
    if spec.act_order:
        g_idx = (torch.arange(in_f) // gs)[torch.randperm(in_f, generator=gen)].to(torch.int32)
    return QuantizedWeight(spec, q, scales, zeros, g_idx)


@pytest.fixture(scope="module")
def mixed_native_dir(tiny_model_dir, tmp_path_factory):
    """A native folder of the tiny model (Llama; Qwen2 has q/k/v biases) whose linears cycle
    through sym, asym, act-order and 8-bit specs."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("native")
    export_fp16(Fp16ExportSpec(str(tiny_model_dir), tmp / "fp16"))
    model = AutoModelForCausalLM.from_pretrained(tmp / "fp16", dtype=torch.float32)
    specs = [QuantSpec(4, 32, True), QuantSpec(4, 32, False),
             QuantSpec(4, 32, True, act_order=True), QuantSpec(8, 32, False, act_order=True),
             QuantSpec(8, -1, True)]
    gen = torch.Generator().manual_seed(0)
    linears = [(n, m) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    weights = {name: _random_weight(*m.weight.shape, specs[i % len(specs)], gen)
               for i, (name, m) in enumerate(linears)}
    write_checkpoint("native", tmp / "q", tmp / "fp16", weights)
    return tmp / "q"


def test_native_layers_read_as_stored_equal_the_unpacked_and_packed_layers(mixed_native_dir):
    ckpt = read_packed(mixed_native_dir)
    assert ckpt.source.checkpoint_format == "native"
    names = []
    for name, got in ckpt.packed_layers():
        want = ckpt._converted(name)  # the previous path: verify's unpack, then pack_int32
        names.append(name)
        assert got.spec == want.spec and got.in_features == want.in_features, name
        for field in ("qweight", "scales", "qzeros", "g_idx", "bias"):
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None) == (b is None), (name, field)
            assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), (name, field)
    assert names == ckpt.layer_names()
    specs = {ckpt.source.plan[n] for n in names}
    assert any(s.act_order for s in specs) and any(not s.sym for s in specs)


@needs_kernels
def test_fused_stack_equals_the_concatenated_parts(tiny_llama_dir, tmp_path):
    from tests.runtime._quant_helpers import quantize_folder

    export_fp16(Fp16ExportSpec(str(tiny_llama_dir), tmp_path / "fp16"))
    quantize_folder(tmp_path / "fp16", tmp_path / "q",
                    [QuantSpec(4, 32, True), QuantSpec(4, 32, False)])  # sym and asym parts
    model = load_quantized_model(tmp_path / "q")
    layer = model.model.layers[0]
    groups = [[layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
              [layer.mlp.gate_proj, layer.mlp.up_proj]]
    before = [[m._w for m in mods] for mods in groups]
    fused = fuse_projections(layer, "silu")
    for stack, mods, parts in zip((fused.qkv, fused.gate_up), groups, before):
        assert torch.equal(stack.packed, torch.cat([w.packed for w in parts]))
        assert torch.equal(stack.scales, torch.cat([w.scales for w in parts]))
        if all(w.mz is None for w in parts):
            assert stack.mz is None
        else:
            assert torch.equal(stack.mz, torch.cat([cpu_kernels.w4a8_mz(w) for w in parts]))
        for mod, w in zip(mods, parts):  # each part runs from a view of the stack, unchanged
            assert mod._w.packed.untyped_storage().data_ptr() == \
                stack.packed.untyped_storage().data_ptr()
            assert torch.equal(mod._w.packed, w.packed) and torch.equal(mod._w.scales, w.scales)


@needs_kernels
def test_stacked_at_load_then_fused_without_a_copy(tiny_llama_dir, tmp_path):
    from quantpipe.runtime.engine import load_model_for_serving
    from quantpipe.runtime.engine.model_runner import ModelRunner, stack_projections
    from tests.runtime._quant_helpers import quantize_folder

    export_fp16(Fp16ExportSpec(str(tiny_llama_dir), tmp_path / "fp16"))
    quantize_folder(tmp_path / "fp16", tmp_path / "q", [QuantSpec(4, 32, True)])
    plain = load_quantized_model(tmp_path / "q")  # parts in their own tensors
    model, _ = load_model_for_serving(tmp_path / "q", "cpu", torch.float32)  # stacked
    for layer, ref in zip(model.model.layers, plain.model.layers):
        mods = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
        refs = [ref.self_attn.q_proj, ref.self_attn.k_proj, ref.self_attn.v_proj]
        ptrs = {m._w.packed.untyped_storage().data_ptr() for m in mods}
        assert len(ptrs) == 1  # one stack
        for m, r in zip(mods, refs):
            assert torch.equal(m._w.packed, r._w.packed) and torch.equal(m._w.scales, r._w.scales)
    before = [m._w.packed.data_ptr() for m in model.model.layers[0].mlp.children()
              if hasattr(m, "_w")]
    stack_projections(model)  # again: already stacked, nothing moves
    assert before == [m._w.packed.data_ptr() for m in model.model.layers[0].mlp.children()
                      if hasattr(m, "_w")]
    runner = ModelRunner(model, block_size=4, num_blocks=4)
    qkv = runner.projections[0].qkv
    layer0 = model.model.layers[0]
    assert qkv.packed.data_ptr() == layer0.self_attn.q_proj._w.packed.data_ptr()
    ref0 = plain.model.layers[0]
    assert torch.equal(qkv.packed, torch.cat([ref0.self_attn.q_proj._w.packed,
                                              ref0.self_attn.k_proj._w.packed,
                                              ref0.self_attn.v_proj._w.packed]))


@needs_kernels
def test_joined_needs_consecutive_rows_of_one_stack():
    parts = [cpu_kernels.repack_w4a8(random_packed(out_f, 64, QuantSpec(4, 32, False), out_f))
             for out_f in (32, 16, 48)]
    stack = cpu_kernels.concat_w4a8(parts)
    views, start = [], 0
    for w in parts:
        views.append(cpu_kernels.w4a8_rows(stack, start, w.packed.shape[0]))
        start += w.packed.shape[0]
    joined = cpu_kernels.w4a8_joined(views)
    assert joined.packed.data_ptr() == stack.packed.data_ptr()
    for field in ("packed", "scales", "mz"):
        assert torch.equal(getattr(joined, field), getattr(stack, field))
    assert cpu_kernels.w4a8_joined(parts) is None  # separate tensors
    assert cpu_kernels.w4a8_joined([views[1], views[0], views[2]]) is None  # out of order
    assert cpu_kernels.w4a8_joined([views[0], views[2]]) is None  # a gap


def test_zero_pool_is_zeros_that_keep_what_is_written():
    from quantpipe.runtime.engine.model_runner import zero_pool

    pool = zero_pool((3, 16, 2, 8), torch.float32, torch.device("cpu"))
    assert pool.shape == (3, 16, 2, 8) and pool.dtype == torch.float32
    assert torch.equal(pool, torch.zeros(3, 16, 2, 8))
    pool.view(-1, 2, 8)[torch.tensor([5, 17])] = 1.5
    assert float(pool.sum()) == 1.5 * 2 * 2 * 8
    assert zero_pool((0, 16, 2, 8), torch.bfloat16, torch.device("cpu")).numel() == 0


def _previous_int8_head(w: torch.Tensor):
    """quantize_head_int8 before its in-place form."""
    n, k = w.shape
    wb = w.float().view(n, -1, 32)
    scales = (wb.abs().amax(-1) / 127).half()
    s = scales.float().clamp_min(torch.finfo(torch.float16).tiny)[..., None]
    return torch.round(wb / s).clamp(-127, 127).to(torch.int8).view(n, k), scales


@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 0.05, 30.0, 6e4])
def test_int8_head_in_place_equals_the_previous_formulas(magnitude):
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 128, generator=gen) * magnitude).half()
    w[0, :32] = 0.0  # an all-zero block
    w[1, :32] = -0.0  # negative zeros: the scale's sign bit must match too
    w[2, :32] = 6e-8  # fp16 subnormals
    w[3, 32:64] = torch.tensor([-1.0, 1.0] * 16).half() * magnitude  # halves at ties
    q, s = fp_head.quantize_head_int8(w)
    want_q, want_s = _previous_int8_head(w)
    assert torch.equal(q, want_q)
    assert torch.equal(s.view(torch.int16), want_s.view(torch.int16))  # bit patterns
