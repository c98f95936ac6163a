"""quantpipe's C++ CPU ops (runtime/kernels/csrc/cpu_ops.cpp) vs float64 references.

The int4 kernel rounds the activations to bf16 and accumulates in fp32; everything else is exact
(q - 8 in bf16, fp16 scales, zf = (8 - z) * s in fp32). So the reference is the float64
product of the *bf16-rounded* activations with the float64 dequantized weight, and the only
tolerance is fp32 accumulation: relative 1e-5 of the row's absolute sum of products. The int8
kernel keeps fp32 activations (no rounding at all); the other ops (head matmuls, add +
RMSNorm, RoPE, paged attention) are checked the same way at the end.
"""

import os
import zlib

import pytest
import torch

from quantpipe.qformat import QuantSpec
from runtime.kernels import cpu as cpu_kernels
from runtime.kernels import cpu_ext
from runtime.kernels.layout import dequantize_reference
from runtime.quant_linear import QuantLinear
from tests.runtime._quant_helpers import random_packed

CAPABLE = cpu_ext._cpu_flags() is not None and set(cpu_ext.CPU_FLAGS) <= cpu_ext._cpu_flags()


@pytest.fixture(scope="module")
def built():
    """Build and load the ops even when QUANTPIPE_CPU_KERNELS=torch runs the rest of the suite
    on torch's kernels (the ops stay registered; the status is recomputed afterwards)."""
    saved = os.environ.pop(cpu_ext.ENV, None)
    cpu_ext.kernel_status.cache_clear()
    try:
        yield cpu_ext.kernel_status()
    finally:
        if saved is not None:
            os.environ[cpu_ext.ENV] = saved
        cpu_ext.kernel_status.cache_clear()


def needs_kernel(test):
    """Skip on CPUs without AVX-512 BF16; elsewhere run with the ops built and loaded."""
    test = pytest.mark.usefixtures("built")(test)
    return pytest.mark.skipif(not CAPABLE, reason="the CPU lacks AVX-512 BF16")(test)


@pytest.mark.parametrize("out_f,in_f", [(16, 16), (48, 64), (96, 256), (64, 1536)])
def test_pack_unpack_exact_round_trip(out_f, in_f):
    q = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(out_f * in_f))
    packed = cpu_kernels.pack_qp4(q)
    assert packed.shape == (out_f // 16, in_f // 4, 32) and packed.dtype == torch.uint8
    assert torch.equal(cpu_kernels.unpack_qp4(packed), q)
    # one element by hand: q[16 b + r, 4 c + 2 + e] is the high nibble of byte 2 r + e
    b, c, r, e = out_f // 16 - 1, in_f // 4 - 1, 5, 1
    assert packed[b, c, 2 * r + e] >> 4 == q[16 * b + r, 4 * c + 2 + e]


@needs_kernel
def test_kernel_builds_and_loads_on_this_cpu(built):
    """On an AVX-512 BF16 CPU with a compiler the kernel must be usable (a broken source fails
    here instead of silently falling back to int4pack)."""
    usable, why = built
    assert usable, why
    assert torch.ops.quantpipe_cpu.int4_supported()


LAYOUTS = [QuantSpec(4, gs, sym, act) for gs in (16, 32, 64, 128, 256, -1)
           for sym in (True, False) for act in (False, True) if not (act and gs == -1)]


@needs_kernel
@pytest.mark.parametrize("spec", LAYOUTS, ids=lambda s: s.label())
def test_kernel_matches_float64_reference_every_tile(spec):
    """M = 1..17 covers every row tile (1..8) and the remainders after full tiles of 8."""
    out_f, in_f = 48, 256
    p = random_packed(out_f, in_f, spec, seed=zlib.crc32(spec.label().encode()))
    w = cpu_kernels.repack_qp4(p)
    assert (w.zf is None) == spec.sym
    w64 = dequantize_reference(p)  # [out, in] float64
    gen = torch.Generator().manual_seed(7)
    for m in range(1, 18):
        x = torch.randn(m, in_f, generator=gen) * 3  # fresh inputs per M
        got = cpu_kernels.qp4_matmul(x, w)  # [m, out] fp32
        xb = x.bfloat16().double()
        want = xb @ w64.T
        bound = 1e-5 * (xb.abs() @ w64.abs().T) + 1e-30
        assert got.dtype == torch.float32 and got.shape == (m, out_f)
        assert ((got.double() - want).abs() <= bound).all(), (m, (got.double() - want).abs().max())


@needs_kernel
@pytest.mark.parametrize("spec", [QuantSpec(8, gs, sym, act) for gs in (16, 64, -1)
                                  for sym in (True, False) for act in (False, True)
                                  if not (act and gs == -1)], ids=lambda s: s.label())
def test_int8_kernel_matches_float64_reference_every_tile(spec):
    """int8_mm: exact int8 weights, fp32 activations: only fp32 accumulation differs."""
    out_f, in_f = 48, 128
    p = random_packed(out_f, in_f, spec, seed=zlib.crc32(spec.label().encode()))
    w = cpu_kernels.repack_q8(p)
    assert (w.zf is None) == spec.sym and w.q8.shape == (3, in_f, 16)
    w64 = dequantize_reference(p)
    gen = torch.Generator().manual_seed(8)
    for m in range(1, 18):
        x = torch.randn(m, in_f, generator=gen) * 3
        got = cpu_kernels.q8_matmul(x, w)
        want = x.double() @ w64.T
        bound = 1e-5 * (x.double().abs() @ w64.abs().T) + 1e-30
        assert ((got.double() - want).abs() <= bound).all(), (m, (got.double() - want).abs().max())


@needs_kernel
def test_kernel_takes_bf16_input_and_empty_batches():
    p = random_packed(32, 128, QuantSpec(4, 32, False), seed=11)
    w = cpu_kernels.repack_qp4(p)
    x = torch.randn(5, 128)
    y32 = cpu_kernels.qp4_matmul(x, w)
    y16 = cpu_kernels.qp4_matmul(x.bfloat16(), w)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16, y32.bfloat16(), rtol=0, atol=0)  # same bf16 x, same sums
    assert cpu_kernels.qp4_matmul(torch.empty(0, 128), w).shape == (0, 32)


@needs_kernel
def test_kernel_rejects_bad_shapes_with_a_message():
    p = random_packed(32, 128, QuantSpec(4, 32, True), seed=1)
    w = cpu_kernels.repack_qp4(p)
    op = torch.ops.quantpipe_cpu.int4_mm
    with pytest.raises(RuntimeError, match="packed holds K = 128"):
        op(torch.randn(2, 64), w.packed, w.scales, None, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        op(torch.randn(2, 128), w.packed, w.scales, None, 24)
    with pytest.raises(RuntimeError, match="scales"):
        op(torch.randn(2, 128), w.packed, w.scales.float(), None, 32)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        op(torch.randn(2, 128).half(), w.packed, w.scales, None, 32)


@needs_kernel
def test_dispatch_prefers_the_kernel_and_the_env_turns_it_off(monkeypatch):
    p = random_packed(96, 256, QuantSpec(4, 64, True), seed=2)
    try:
        monkeypatch.delenv(cpu_ext.ENV, raising=False)
        cpu_ext.kernel_status.cache_clear()
        assert cpu_kernels.cpu_backend_for(p)[0] == "int4avx512"
        # out % 16 != 0 (and group sizes int4pack takes) keep int4pack / dequant
        assert cpu_kernels.cpu_backend_for(
            random_packed(24, 256, QuantSpec(4, 64, True), 1))[0] == "dequant"
        monkeypatch.setenv(cpu_ext.ENV, "torch")
        cpu_ext.kernel_status.cache_clear()
        backend, why = cpu_kernels.cpu_backend_for(p)
        assert backend == "int4pack" and cpu_ext.ENV in why
        with pytest.raises(ValueError, match="not usable here"):
            QuantLinear(p, "cpu", backend="int4avx512")
        monkeypatch.setenv(cpu_ext.ENV, "off")  # a typo is an error, not a silent choice
        cpu_ext.kernel_status.cache_clear()
        with pytest.raises(ValueError, match="QUANTPIPE_CPU_KERNELS='off'"):
            cpu_ext.kernel_status()
    finally:
        monkeypatch.undo()  # the environment as the suite runs it, then a fresh status
        cpu_ext.kernel_status.cache_clear()


def test_unusable_build_falls_back_to_int4pack(monkeypatch):
    """A failing build (no compiler, say) is a logged fallback, not an error."""
    def fail(**kwargs):
        raise RuntimeError("Error building extension 'quantpipe_cpu_x'\nmore lines")

    monkeypatch.delenv(cpu_ext.ENV, raising=False)
    monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda: set(cpu_ext.CPU_FLAGS))
    monkeypatch.setattr(cpu_ext.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr("torch.utils.cpp_extension.load", fail)
    cpu_ext.kernel_status.cache_clear()
    try:
        usable, why = cpu_ext.kernel_status()
        assert not usable and "Error building extension" in why and "more lines" not in why
        p = random_packed(96, 256, QuantSpec(4, 64, True), seed=2)
        assert cpu_kernels.cpu_backend_for(p) == ("int4pack", f"torch int4pack ({why})")
    finally:
        monkeypatch.undo()
        cpu_ext.kernel_status.cache_clear()


# --- the other ops of csrc/cpu_ops.cpp ------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 11])
def test_head_matmuls_match_float64_reference(m):
    """fp16_mm: exact fp16 weights, fp32 x; bf16_mm: bf16 weights and x; fp32 sums."""
    from runtime.fp_head import block_row_pairs, block_rows

    gen = torch.Generator().manual_seed(m)
    w16 = (torch.randn(80, 72, generator=gen) * 0.2).half()  # [N, K]
    x = torch.randn(m, 72, generator=gen)
    got16 = torch.ops.quantpipe_cpu.fp16_mm(x, block_rows(w16))
    want16 = x.double() @ w16.double().T
    bound16 = 1e-6 * (x.double().abs() @ w16.double().abs().T)
    assert ((got16.double() - want16).abs() <= bound16).all()
    wb = w16.to(torch.bfloat16)
    got_bf = torch.ops.quantpipe_cpu.bf16_mm(x, block_row_pairs(wb))
    want_bf = x.bfloat16().double() @ wb.double().T
    bound_bf = 1e-6 * (x.bfloat16().double().abs() @ wb.double().abs().T)
    assert ((got_bf.double() - want_bf).abs() <= bound_bf).all()


@needs_kernel
@pytest.mark.parametrize("d", [64, 40])  # 40: a tail after the 16-wide vectors
def test_add_rms_norm_and_rope_match_float64_reference(d):
    gen = torch.Generator().manual_seed(d)
    h = torch.randn(5, d, generator=gen) * 3
    delta = torch.randn(5, d, generator=gen)
    w = torch.randn(d, generator=gen)
    h64 = h.double() + delta.double()
    want = w.double() * h64 / (h64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    got = torch.ops.quantpipe_cpu.add_rms_norm_(h, delta, w, 1e-6)
    torch.testing.assert_close(h.double(), h64, rtol=0, atol=1e-6)  # h += delta in place
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    got2 = torch.ops.quantpipe_cpu.add_rms_norm_(h, None, w, 1e-6)  # no delta: h unchanged
    torch.testing.assert_close(got2, got, rtol=0, atol=0)

    from runtime.engine.model_runner import apply_rope

    q, k = torch.randn(5, 3, d, generator=gen), torch.randn(5, 2, d, generator=gen)
    ang = torch.rand(5, d // 2, generator=gen) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # HF layout
    want_q = apply_rope(q.double(), cos.double(), sin.double())
    want_k = apply_rope(k.double(), cos.double(), sin.double())
    torch.ops.quantpipe_cpu.rope_(q, k, cos, sin)
    torch.testing.assert_close(q.double(), want_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(k.double(), want_k, rtol=0, atol=1e-5)


def _attention_reference(q, k_pool, v_pool, tables, ctx_lens, q_lens, scale):
    """float64, one sequence and one query at a time, keys gathered slot by slot."""
    _, bs, kv, d = k_pool.shape
    heads = q.shape[1]
    out, row = [], 0
    for b, (n_ctx, n_q) in enumerate(zip(ctx_lens, q_lens)):
        slots = [tables[b][j // bs] * bs + j % bs for j in range(n_ctx)]
        k = k_pool.reshape(-1, kv, d)[slots].double().repeat_interleave(heads // kv, 1)
        v = v_pool.reshape(-1, kv, d)[slots].double().repeat_interleave(heads // kv, 1)
        for t in range(n_q):
            visible = n_ctx - n_q + 1 + t  # causal: keys up to this query's position
            s = torch.einsum("hd,nhd->hn", q[row].double(), k[:visible]) * scale
            out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v[:visible]))
            row += 1
    return torch.stack(out)


@needs_kernel
def test_paged_attention_matches_float64_reference_decode_and_chunks():
    gen = torch.Generator().manual_seed(0)
    heads, kv, d, bs = 6, 2, 64, 4
    k_pool = torch.randn(30, bs, kv, d, generator=gen)
    v_pool = torch.randn(30, bs, kv, d, generator=gen)
    ctx_lens, q_lens = [1, 9, 4, 17, 6], [1, 1, 4, 5, 2]  # decodes, a whole prompt, chunks
    blocks = torch.randperm(29, generator=gen) + 1  # scattered blocks, 0 left unused
    tables, used = torch.zeros(5, 5, dtype=torch.int64), 0
    for b, n in enumerate(ctx_lens):
        nb = -(-n // bs)
        tables[b, :nb] = blocks[used:used + nb]
        used += nb
    q = torch.randn(sum(q_lens), heads, d, generator=gen)
    got = torch.ops.quantpipe_cpu.paged_attention(q, k_pool, v_pool, tables,
                                                  torch.tensor(ctx_lens), torch.tensor(q_lens),
                                                  0.125)
    want = _attention_reference(q, k_pool, v_pool, tables.tolist(), ctx_lens, q_lens, 0.125)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    # a bf16 KV cache: the same attention over the bf16 values (read back exactly as fp32)
    k16, v16 = k_pool.bfloat16(), v_pool.bfloat16()
    got16 = torch.ops.quantpipe_cpu.paged_attention(q, k16, v16, tables, torch.tensor(ctx_lens),
                                                    torch.tensor(q_lens), 0.125)
    want16 = _attention_reference(q, k16.double(), v16.double(), tables.tolist(), ctx_lens,
                                  q_lens, 0.125)
    torch.testing.assert_close(got16.double(), want16, rtol=0, atol=2e-6)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.quantpipe_cpu.paged_attention(q, k16, v_pool, tables, torch.tensor(ctx_lens),
                                                torch.tensor(q_lens), 0.125)
    with pytest.raises(RuntimeError, match="q_len"):
        torch.ops.quantpipe_cpu.paged_attention(q, k_pool, v_pool, tables,
                                                torch.tensor(ctx_lens), torch.tensor([2] * 5),
                                                0.125)
    bad = tables.clone()
    bad[0, 0] = 99
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.quantpipe_cpu.paged_attention(q, k_pool, v_pool, bad, torch.tensor(ctx_lens),
                                                torch.tensor(q_lens), 0.125)
