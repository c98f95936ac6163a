"""quantpipe's C++ CPU ops (runtime/kernels/csrc/) vs float64 references, on each ISA build.

Every op runs on every ISA build this CPU can run (``avx512``: cpu_ops.cpp, ``avx2``:
cpu_ops_avx2.cpp; an AVX-512 host runs both), at every activation-row tile (M = 1..17 covers
tiles of 1..8 rows and the remainders after full tiles).

The W4A16 int4 kernel (AVX-512) rounds the activations to bf16 and accumulates in fp32;
everything else is exact (q - 8 in bf16, fp16 scales, zf = (8 - z) * s in fp32). So the
reference is the float64 product of the *bf16-rounded* activations with the float64 dequantized
weight, and the only tolerance is fp32 accumulation: relative 1e-5 of the row's absolute sum of
products. The W4A8 kernel quantizes the activations to int8 per 32 columns: the quantizer is
checked bit-exactly against the same fp32 arithmetic in torch, and the matmul against the
float64 product of the dequantized int8 activations. On CPUs with AMX, w4a8_mm hands 32
rows and more to a bf16 tile kernel: checked against the float64 product of the bf16-rounded
activations and weights. The int8 kernel keeps fp32 activations (no rounding at all); the other
ops (head matmuls, add + RMSNorm, RoPE, paged attention) are checked the same way at the end.
"""

import zlib

import pytest
import torch

from quantpipe.core.qformat import QuantSpec
from quantpipe.runtime.kernels import cpu as cpu_kernels
from quantpipe.runtime.kernels import cpu_ext
from quantpipe.runtime.kernels.layout import dequantize_reference
from quantpipe.runtime.quant_linear import QuantLinear
from tests.runtime._quant_helpers import random_packed

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not cpu_ext.cpu_can_run(isa),
                                                   reason=f"the CPU cannot run the {isa} build"))
        for isa in cpu_ext.ISAS]
CAPABLE_512 = cpu_ext.cpu_can_run("avx512")


@pytest.fixture
def ops(request):
    """The op namespace of the test's ISA, built and loaded even when QUANTPIPE_CPU_KERNELS=torch
    runs the rest of the suite on torch's kernels (builds do not depend on that variable)."""
    isa = request.node.callspec.params["isa"]
    usable, why = cpu_ext.build_status(isa)
    assert usable, why  # a broken source fails here instead of silently falling back
    return cpu_ext.ops(isa)


def _a8_variants(isa):
    """w4a8_mm's instruction choices on this ISA build: AVX2 runs pmaddubsw, and AVX-VNNI
    where the CPU has it; AVX-512 always VNNI."""
    if isa == "avx512":
        return [True]
    return [False, True] if cpu_ext.w4a8_uses_vnni("avx2") else [False]


@pytest.mark.parametrize("out_f,in_f", [(16, 16), (48, 64), (96, 256), (64, 1536)])
def test_pack_unpack_exact_round_trip(out_f, in_f):
    q = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(out_f * in_f))
    packed = cpu_kernels.pack_w4a16(q)
    assert packed.shape == (out_f // 16, in_f // 4, 32) and packed.dtype == torch.uint8
    assert torch.equal(cpu_kernels.unpack_w4a16(packed), q)
    # one element by hand: q[16 b + r, 4 c + 2 + e] is the high nibble of byte 2 r + e
    b, c, r, e = out_f // 16 - 1, in_f // 4 - 1, 5, 1
    assert packed[b, c, 2 * r + e] >> 4 == q[16 * b + r, 4 * c + 2 + e]


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_builds_and_loads_on_this_cpu(isa, ops):
    """On a CPU with the ISA's features and a compiler the build must be usable."""
    assert ops.supported()


@pytest.mark.parametrize("out_f,in_f", [(16, 8), (48, 64), (96, 256), (64, 1536)])
def test_w4a8_pack_unpack_exact_round_trip(out_f, in_f):
    q = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(out_f + in_f))
    packed = cpu_kernels.pack_w4a8(q)
    assert packed.shape == (out_f // 16, in_f // 8, 64) and packed.dtype == torch.uint8
    assert torch.equal(cpu_kernels.unpack_w4a8(packed), q)
    # one element by hand: q[16 b + r, 8 c + 4 + e] is the high nibble of byte 4 r + e
    b, c, r, e = out_f // 16 - 1, in_f // 8 - 1, 13, 3
    assert packed[b, c, 4 * r + e] >> 4 == q[16 * b + r, 8 * c + 4 + e]
    assert packed[b, c, 4 * r + e] & 15 == q[16 * b + r, 8 * c + e]


LAYOUTS = [QuantSpec(4, gs, sym, act) for gs in (16, 32, 64, 128, 256, -1)
           for sym in (True, False) for act in (False, True) if not (act and gs == -1)]


needs_512 = pytest.mark.skipif(not CAPABLE_512, reason="the CPU cannot run the avx512 build")


@pytest.fixture
def avx512():
    usable, why = cpu_ext.build_status("avx512")
    assert usable, why


@needs_512
@pytest.mark.parametrize("spec", LAYOUTS, ids=lambda s: s.label())
def test_kernel_matches_float64_reference_every_tile(spec, avx512):
    """W4A16 (AVX-512 only). M = 1..17 covers every row tile (1..8) and the remainders."""
    out_f, in_f = 48, 256
    p = random_packed(out_f, in_f, spec, seed=zlib.crc32(spec.label().encode()))
    w = cpu_kernels.repack_w4a16(p)
    assert (w.zf is None) == spec.sym
    w64 = dequantize_reference(p)  # [out, in] float64
    gen = torch.Generator().manual_seed(7)
    for m in range(1, 18):
        x = torch.randn(m, in_f, generator=gen) * 3  # fresh inputs per M
        got = cpu_kernels.w4a16_matmul(x, w)  # [m, out] fp32
        xb = x.bfloat16().double()
        want = xb @ w64.T
        bound = 1e-5 * (xb.abs() @ w64.abs().T) + 1e-30
        assert got.dtype == torch.float32 and got.shape == (m, out_f)
        assert ((got.double() - want).abs() <= bound).all(), (m, (got.double() - want).abs().max())


def _quantize_a8_reference(x: torch.Tensor, group_size: int):
    """The W4A8 activation quantizer in torch's fp32 arithmetic (the kernels' exact steps)."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)  # [M, blocks, 32]
    amax = xb.abs().amax(-1)  # [M, blocks] fp32
    dx = amax / 127  # fp32 division, as a / 127.0f
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))  # fp32
    xq = torch.round(xb * inv[..., None])  # fp32 product, rounded half to even
    return xq.view(m, k).to(torch.int8), dx


@pytest.mark.parametrize("isa", ISAS)
def test_a8_quantizer_is_bit_exact_and_sums_per_group(isa, ops):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 256, generator=gen) * 5
    x[1, :32] = 0  # an all-zero block: scale 0, xq 0
    x[2, 40] = 1e4  # one outlier: the rest of its block rounds to (nearly) 0
    x[3, :64] = torch.arange(64) - 31.5  # exact .5 ties after scaling
    xq, dx, qsum = ops.quantize_a8(x, 64)
    want_q, want_d = _quantize_a8_reference(x, 64)
    assert torch.equal(xq, want_q) and torch.equal(dx, want_d)
    assert int(xq.abs().max()) <= 127 and float(dx[1, 0]) == 0.0
    # qsum: per group of 64 (two blocks), sum of d * sum(xq), fp32
    want_qsum = (want_d.double() * want_q.double().view(7, 8, 32).sum(-1)).view(7, 4, 2).sum(-1)
    torch.testing.assert_close(qsum.double(), want_qsum, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.quantize_a8(x, 48)


A8_LAYOUTS = [QuantSpec(4, gs, sym, act) for gs in (32, 64, 128, -1)
              for sym in (True, False) for act in (False, True) if not (act and gs == -1)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("spec", A8_LAYOUTS, ids=lambda s: s.label())
def test_w4a8_kernel_matches_float64_reference_every_tile(isa, spec, ops):
    """W4A8: the float64 product of the kernel's int8 activations (dequantized, bit-exact per
    the test above) with the float64 weight; only fp32 accumulation differs: relative 1e-5 of
    the absolute sum of products. M = 1..17: every tile (1..8 rows AVX-512, 1..4 AVX2) and
    remainders; every instruction choice of the ISA."""
    out_f, in_f = 48, 256
    p = random_packed(out_f, in_f, spec, seed=zlib.crc32(spec.label().encode()))
    w = cpu_kernels.repack_w4a8(p, isa)
    w64 = dequantize_reference(p)  # [out, in] float64
    gen = torch.Generator().manual_seed(9)
    for vnni in _a8_variants(isa):
        w = cpu_kernels.CpuW4A8(w.packed, w.scales, w.mz, w.perm, w.group_size, w.op, vnni)
        for m in range(1, 18):
            x = torch.randn(m, in_f, generator=gen) * 3
            got = cpu_kernels.w4a8_matmul(x, w)  # [m, out] fp32
            xp = x if w.perm is None else x[:, w.perm]  # the kernel quantizes permuted columns
            xq, dx = _quantize_a8_reference(xp.contiguous(), w.group_size)
            xhat = (xq.double().view(m, -1, 32) * dx.double()[..., None]).view(m, in_f)
            w64p = w64 if w.perm is None else w64[:, w.perm]
            want = xhat @ w64p.T
            bound = 1e-5 * (xhat.abs() @ w64p.abs().T) + 1e-30
            assert got.dtype == torch.float32 and got.shape == (m, out_f)
            err = (got.double() - want).abs()
            assert (err <= bound).all(), (vnni, m, float(err.max()))
            # and the int8 activations' own error stays at the scale of int8 rounding
            exact = x.double() @ w64.T
            assert float((got.double() - exact).norm() / exact.norm()) < 2e-2


def _amx_usable() -> bool:
    if not CAPABLE_512 or not cpu_ext.build_status("avx512")[0]:
        return False
    return bool(cpu_ext.ops("avx512").amx_supported())


needs_amx = pytest.mark.skipif(not _amx_usable(),
                               reason="the CPU has no AMX-BF16 (or Linux does not grant it)")


def _amx_reference(x: torch.Tensor, p, w) -> tuple[torch.Tensor, torch.Tensor]:
    """(want, bound) for the AMX kernel: the float64 product of the bf16-rounded activations
    with the bf16-rounded weights bf16(fp32(q * scale + mz)) (one fma in the kernel: the exact
    value rounded once to fp32), in the kernel's column order; tolerance fp32 accumulation."""
    q = p.unpacked_q().double()  # [out, in]
    g = p.group_index()
    s = p.scales.double()[:, g]
    mz = (-p.zeros_u8().double() * p.scales.double())[:, g]  # exact: fp16 * small integer
    wb = (q * s + mz).float().bfloat16().double()  # [out, in]
    if w.perm is not None:
        x, wb = x[:, w.perm], wb[:, w.perm]
    xb = x.bfloat16().double()
    return xb @ wb.T, 1e-5 * (xb.abs() @ wb.abs().T) + 1e-30


@needs_amx
@pytest.mark.parametrize("spec", A8_LAYOUTS + [QuantSpec(4, 256, False)],
                         ids=lambda s: s.label())
def test_amx_kernel_matches_bf16_rounded_float64_reference(spec, avx512):
    """w4a8_mm_amx (AVX-512 build, AMX-BF16 CPUs): the W4A8 layout's weights expanded to
    bf16 on the tile unit. 48 output rows: a pair of 16-row blocks and a lone one; M around the
    16-row tiles and the 32-row pairs, the prefill sizes w4a8_mm hands it and more than one
    pass of rows."""
    out_f, in_f = 48, 256
    p = random_packed(out_f, in_f, spec, seed=zlib.crc32(spec.label().encode()) + 1)
    w = cpu_kernels.repack_w4a8(p, "avx512")
    op = cpu_ext.ops("avx512").w4a8_mm_amx
    gen = torch.Generator().manual_seed(11)
    for m in (1, 15, 16, 17, 31, 32, 33, 48, 64, 100, 600):  # 600: two passes of 512
        x = torch.randn(m, in_f, generator=gen) * 3
        xp = x if w.perm is None else x[:, w.perm].contiguous()
        got = op(xp, w.packed, w.scales, w.mz, w.group_size)
        want, bound = _amx_reference(x, p, w)
        assert got.dtype == torch.float32 and got.shape == (m, out_f)
        err = (got.double() - want).abs()
        assert (err <= bound).all(), (m, float(err.max()))
        # bf16 weights and activations stay well within the int8 activations' error
        exact = x.double() @ dequantize_reference(p).T
        assert float((got.double() - exact).norm() / exact.norm()) < 1e-2
    assert op(torch.empty(0, in_f), w.packed, w.scales, w.mz, w.group_size).shape == (0, out_f)


@needs_amx
def test_w4a8_op_hands_32_rows_and_more_to_amx_unless_turned_off(avx512, monkeypatch):
    """w4a8_mm runs the AMX kernel from 32 rows (bit for bit its result) and the VNNI tiles
    below (each row's result independent of the others); QUANTPIPE_CPU_AMX=0, read at every
    call, keeps the VNNI tiles at every row count."""
    p = random_packed(64, 256, QuantSpec(4, 64, False), seed=5)
    w = cpu_kernels.repack_w4a8(p, "avx512")
    ops = cpu_ext.ops("avx512")
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(4))
    args = (w.packed, w.scales, w.mz, w.group_size)
    vnni = torch.cat([ops.w4a8_mm(x[i:i + 8].contiguous(), *args, True)
                      for i in range(0, 40, 8)])
    amx = ops.w4a8_mm_amx(x, *args)
    assert not torch.equal(vnni, amx)  # the two arithmetics differ, so the checks below mean it
    monkeypatch.delenv("QUANTPIPE_CPU_AMX", raising=False)
    assert torch.equal(ops.w4a8_mm(x, *args, True), amx)
    assert torch.equal(ops.w4a8_mm(x[:31].contiguous(), *args, True), vnni[:31])
    monkeypatch.setenv("QUANTPIPE_CPU_AMX", "0")
    assert torch.equal(ops.w4a8_mm(x, *args, True), vnni)
    monkeypatch.setenv("QUANTPIPE_CPU_AMX", "1")
    assert torch.equal(ops.w4a8_mm(x, *args, True), amx)
    monkeypatch.setenv("QUANTPIPE_CPU_AMX", "off")  # a typo is an error, not a silent choice
    with pytest.raises(RuntimeError, match="QUANTPIPE_CPU_AMX='off'"):
        ops.w4a8_mm(x, *args, True)


@pytest.mark.parametrize("isa", ISAS)
def test_w4a8_kernel_rejects_bad_inputs_with_a_message(isa, ops):
    p = random_packed(32, 128, QuantSpec(4, 32, False), seed=1)
    w = cpu_kernels.repack_w4a8(p, isa)
    op = ops.w4a8_mm
    vnni = _a8_variants(isa)[-1]
    with pytest.raises(RuntimeError, match="packed holds K = 128"):
        op(torch.randn(2, 64), w.packed, w.scales, w.mz, 32, vnni)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 128), w.packed, w.scales, w.mz, 16, vnni)
    with pytest.raises(RuntimeError, match="scales"):
        op(torch.randn(2, 128), w.packed, w.scales.float(), w.mz, 32, vnni)
    with pytest.raises(RuntimeError, match="fp32"):
        op(torch.randn(2, 128).bfloat16(), w.packed, w.scales, w.mz, 32, vnni)
    assert op(torch.empty(0, 128), w.packed, w.scales, w.mz, 32, vnni).shape == (0, 32)
    if isa == "avx512":
        with pytest.raises(RuntimeError, match="vnni=True"):
            op(torch.randn(2, 128), w.packed, w.scales, w.mz, 32, False)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("spec", [QuantSpec(8, gs, sym, act) for gs in (16, 64, -1)
                                  for sym in (True, False) for act in (False, True)
                                  if not (act and gs == -1)], ids=lambda s: s.label())
def test_int8_kernel_matches_float64_reference_every_tile(isa, spec, ops):
    """w8a32_mm: exact int8 weights, fp32 activations: only fp32 accumulation differs."""
    out_f, in_f = 48, 128
    p = random_packed(out_f, in_f, spec, seed=zlib.crc32(spec.label().encode()))
    w = cpu_kernels.repack_w8a32(p, isa)
    assert (w.zf is None) == spec.sym and w.q8.shape == (3, in_f, 16)
    w64 = dequantize_reference(p)
    gen = torch.Generator().manual_seed(8)
    for m in range(1, 18):
        x = torch.randn(m, in_f, generator=gen) * 3
        got = cpu_kernels.w8a32_matmul(x, w)
        want = x.double() @ w64.T
        bound = 1e-5 * (x.double().abs() @ w64.abs().T) + 1e-30
        assert ((got.double() - want).abs() <= bound).all(), (m, (got.double() - want).abs().max())


def _w8a8_reference(x, q, scales, ops):
    """float64 y [M, N] of w8a8_mm: x quantized by the kernels' own quantize_a8 (tested
    bit-exact above), exact integer dots per block of 32, scaled by scale * dx; and the bound
    on fp32's rounding of the scaling and the sums."""
    n, k = q.shape
    xq, dx, _ = ops.quantize_a8(x, 32)
    dots = (q.double().view(1, n, k // 32, 32)
            * xq.double().view(-1, 1, k // 32, 32)).sum(-1)  # [M, N, K/32] exact
    terms = dots * scales.double()[None] * dx.double()[:, None, :]  # [M, N, K/32]
    return terms.sum(-1), 1e-6 * terms.abs().sum(-1) + 1e-30


@pytest.mark.parametrize("isa", ISAS)
def test_w8a8_kernel_matches_float64_reference_every_tile(isa, ops):
    """w8a8_mm (the int8 head): int8 weights (the extremes -127 / 127, and -128, included)
    times int8 activations per 32 columns; every tile size, rows padded to 16."""
    from quantpipe.runtime.fp_head import block_row_quads
    from quantpipe.runtime.kernels.cpu import block_rows

    gen = torch.Generator().manual_seed(9)
    n, k = 40, 160
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    q[0, :32], q[1, :32], q[2, :8] = -127, 127, -128
    scales = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).half()
    q8, s8 = block_row_quads(q), block_rows(scales)
    assert q8.shape == (3, k // 4, 64) and s8.shape == (3, k // 32, 16)
    for m in range(1, 18):
        x = torch.randn(m, k, generator=gen) * 3
        x[0, 32:64] = 0  # an all-zero activation block
        got = ops.w8a8_mm(x, q8, s8)
        assert got.shape == (m, 48) and not got[:, n:].any()  # padded rows: zero weights
        want, bound = _w8a8_reference(x, q, scales, ops)
        assert ((got[:, :n].double() - want).abs() <= bound).all(), m
    with pytest.raises(RuntimeError, match="q8 must be contiguous int8"):
        ops.w8a8_mm(x, q8.view(3, k // 2, 32), s8)
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        ops.w8a8_mm(torch.randn(2, k - 32), q8, s8)


@needs_512
def test_kernel_takes_bf16_input_and_empty_batches(avx512):
    p = random_packed(32, 128, QuantSpec(4, 32, False), seed=11)
    w = cpu_kernels.repack_w4a16(p)
    x = torch.randn(5, 128)
    y32 = cpu_kernels.w4a16_matmul(x, w)
    y16 = cpu_kernels.w4a16_matmul(x.bfloat16(), w)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16, y32.bfloat16(), rtol=0, atol=0)  # same bf16 x, same sums
    assert cpu_kernels.w4a16_matmul(torch.empty(0, 128), w).shape == (0, 32)


@needs_512
def test_kernel_rejects_bad_shapes_with_a_message(avx512):
    p = random_packed(32, 128, QuantSpec(4, 32, True), seed=1)
    w = cpu_kernels.repack_w4a16(p)
    op = torch.ops.quantpipe_cpu.w4a16_mm
    with pytest.raises(RuntimeError, match="packed holds K = 128"):
        op(torch.randn(2, 64), w.packed, w.scales, None, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        op(torch.randn(2, 128), w.packed, w.scales, None, 24)
    with pytest.raises(RuntimeError, match="scales"):
        op(torch.randn(2, 128), w.packed, w.scales.float(), None, 32)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        op(torch.randn(2, 128).half(), w.packed, w.scales, None, 32)


@pytest.fixture
def fresh_status(monkeypatch):
    """The kernel environment variables unset and the cached choice forgotten; restored after."""
    for name in (cpu_ext.ENV, cpu_ext.ISA_ENV, cpu_kernels.INT4_ACT_ENV):
        monkeypatch.delenv(name, raising=False)
    cpu_ext.reset()
    yield monkeypatch
    monkeypatch.undo()  # the environment as the suite runs it, then a fresh status
    cpu_ext.reset()


@pytest.mark.parametrize("isa", ISAS)
def test_dispatch_takes_the_forced_isa_and_the_env_turns_it_off(isa, fresh_status):
    monkeypatch = fresh_status
    p = random_packed(96, 256, QuantSpec(4, 64, True), seed=2)
    p8 = random_packed(96, 256, QuantSpec(8, 64, False), seed=3)
    monkeypatch.setenv(cpu_ext.ISA_ENV, isa)
    cpu_ext.reset()
    assert cpu_ext.active_isa() == isa
    backend, why = cpu_kernels.cpu_backend_for(p)
    assert backend == f"w4a8_{isa}" and f"{cpu_ext.ISA_ENV}={isa}" in why and "W4A8" in why
    assert cpu_kernels.cpu_backend_for(p8)[0] == f"w8a32_{isa}"
    layer = QuantLinear(p, "cpu")
    assert layer.backend == f"w4a8_{isa}" and isa in layer.reason
    # W4A16 where asked for: AVX-512 has it; AVX2 keeps W4A8
    monkeypatch.setenv(cpu_kernels.INT4_ACT_ENV, "bf16")
    want16 = "w4a16_avx512" if isa == "avx512" else "w4a8_avx2"
    assert cpu_kernels.cpu_backend_for(p)[0] == want16
    monkeypatch.setenv(cpu_kernels.INT4_ACT_ENV, "fp8")
    with pytest.raises(ValueError, match="QUANTPIPE_CPU_INT4_ACT='fp8'"):
        cpu_kernels.cpu_backend_for(p)
    monkeypatch.delenv(cpu_kernels.INT4_ACT_ENV)
    # out % 16 != 0 keeps torch's kernels / dequant
    assert cpu_kernels.cpu_backend_for(
        random_packed(24, 256, QuantSpec(4, 64, True), 1))[0] == "dequant"
    monkeypatch.setenv(cpu_ext.ENV, "torch")
    cpu_ext.reset()
    backend, why = cpu_kernels.cpu_backend_for(p)
    assert backend == "int4pack" and cpu_ext.ENV in why
    with pytest.raises(ValueError, match="not usable here"):
        QuantLinear(p, "cpu", backend=f"w4a8_{isa}")
    monkeypatch.setenv(cpu_ext.ENV, "off")  # a typo is an error, not a silent choice
    cpu_ext.reset()
    with pytest.raises(ValueError, match="QUANTPIPE_CPU_KERNELS='off'"):
        cpu_ext.kernel_status()


def test_forced_isa_the_cpu_lacks_is_an_error_naming_the_fix(fresh_status):
    monkeypatch = fresh_status
    avx2_only = {"avx", "avx2", "fma", "f16c", "sse4_2"}  # an AVX2-only CPU (no AVX-512)
    monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda: avx2_only)
    monkeypatch.setattr(cpu_ext.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(cpu_ext.ISA_ENV, "avx512")
    cpu_ext.reset()
    with pytest.raises(ValueError, match=r"QUANTPIPE_CPU_ISA=avx512 but this CPU lacks "
                                         r"avx512_bf16.*use avx2 or unset QUANTPIPE_CPU_ISA"):
        cpu_ext.kernel_status()
    monkeypatch.setenv(cpu_ext.ISA_ENV, "neon")
    cpu_ext.reset()
    with pytest.raises(ValueError, match="QUANTPIPE_CPU_ISA='neon': use one of"):
        cpu_ext.kernel_status()
    monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda: {"sse4_2", "avx"})  # neither build
    monkeypatch.delenv(cpu_ext.ISA_ENV)
    cpu_ext.reset()
    usable, why = cpu_ext.kernel_status()
    assert not usable and "AVX2" in why and cpu_ext.active_isa() is None


@pytest.mark.skipif(not cpu_ext.cpu_can_run("avx2"), reason="the CPU cannot run the avx2 build")
def test_auto_choice_is_the_best_build_the_cpu_runs(fresh_status):
    monkeypatch = fresh_status
    assert cpu_ext.active_isa() == ("avx512" if CAPABLE_512 else "avx2")
    assert "QUANTPIPE_CPU_ISA" not in cpu_ext.kernel_status()[1]  # auto-detected
    flags = cpu_ext._cpu_flags() - {"avx512_bf16"}  # the same CPU without AVX-512 BF16
    monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda: flags)
    cpu_ext.reset()
    assert cpu_ext.active_isa() == "avx2"


def test_unusable_build_falls_back_to_int4pack(fresh_status):
    """A failing build (no compiler, say) is a logged fallback, not an error."""
    def fail(**kwargs):
        raise RuntimeError("Error building extension 'quantpipe_cpu_x'\nmore lines")

    monkeypatch = fresh_status
    flags = set(cpu_ext.ISAS["avx512"].cpu_flags) | set(cpu_ext.ISAS["avx2"].cpu_flags)
    monkeypatch.setattr(cpu_ext, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_ext.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr("torch.utils.cpp_extension.load", fail)
    cpu_ext.reset()
    usable, why = cpu_ext.kernel_status()
    assert not usable and "Error building extension" in why and "more lines" not in why
    p = random_packed(96, 256, QuantSpec(4, 64, True), seed=2)
    assert cpu_kernels.cpu_backend_for(p) == ("int4pack", f"torch int4pack ({why})")


# --- the other ops of each build ---------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 11, 17])
def test_head_matmuls_match_float64_reference(isa, m, ops):
    """fp16_mm: exact fp16 weights, fp32 x; bf16_mm: bf16 weights and x; fp32 sums."""
    from quantpipe.runtime.fp_head import block_row_pairs, block_rows

    gen = torch.Generator().manual_seed(m)
    w16 = (torch.randn(80, 72, generator=gen) * 0.2).half()  # [N, K]
    x = torch.randn(m, 72, generator=gen)
    got16 = ops.fp16_mm(x, block_rows(w16))
    want16 = x.double() @ w16.double().T
    bound16 = 1e-6 * (x.double().abs() @ w16.double().abs().T)
    assert ((got16.double() - want16).abs() <= bound16).all()
    wb = w16.to(torch.bfloat16)
    got_bf = ops.bf16_mm(x, block_row_pairs(wb))
    want_bf = x.bfloat16().double() @ wb.double().T
    bound_bf = 1e-6 * (x.bfloat16().double().abs() @ wb.double().abs().T)
    assert ((got_bf.double() - want_bf).abs() <= bound_bf).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d", [64, 40, 36])  # 40, 36: tails after the 16- / 8-wide vectors
def test_add_rms_norm_and_rope_match_float64_reference(isa, d, ops):
    gen = torch.Generator().manual_seed(d)
    h = torch.randn(5, d, generator=gen) * 3
    delta = torch.randn(5, d, generator=gen)
    w = torch.randn(d, generator=gen)
    h64 = h.double() + delta.double()
    want = w.double() * h64 / (h64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    got = ops.add_rms_norm_(h, delta, w, 1e-6)
    torch.testing.assert_close(h.double(), h64, rtol=0, atol=1e-6)  # h += delta in place
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    got2 = ops.add_rms_norm_(h, None, w, 1e-6)  # no delta: h unchanged
    torch.testing.assert_close(got2, got, rtol=0, atol=0)

    from quantpipe.runtime.engine.model_runner import apply_rope

    q, k = torch.randn(5, 3, d, generator=gen), torch.randn(5, 2, d, generator=gen)
    ang = torch.rand(5, d // 2, generator=gen) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # HF layout
    want_q = apply_rope(q.double(), cos.double(), sin.double())
    want_k = apply_rope(k.double(), cos.double(), sin.double())
    ops.rope_(q, k, cos, sin)
    torch.testing.assert_close(q.double(), want_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(k.double(), want_k, rtol=0, atol=1e-5)


def _attention_reference(q, k_pool, v_pool, tables, ctx_lens, q_lens, scale, window=0,
                         bf16_weights=False):
    """float64, one sequence and one query at a time, keys gathered slot by slot; ``window`` > 0:
    the query at position p sees the keys at positions j with p - window < j <= p;
    ``bf16_weights``: the softmax weights rounded to bf16 before they weigh the values."""
    _, bs, kv, d = k_pool.shape
    heads = q.shape[1]
    out, row = [], 0
    for b, (n_ctx, n_q) in enumerate(zip(ctx_lens, q_lens)):
        slots = [tables[b][j // bs] * bs + j % bs for j in range(n_ctx)]
        k = k_pool.reshape(-1, kv, d)[slots].double().repeat_interleave(heads // kv, 1)
        v = v_pool.reshape(-1, kv, d)[slots].double().repeat_interleave(heads // kv, 1)
        for t in range(n_q):
            p = n_ctx - n_q + t  # this query's position; causal: keys j <= p
            j = torch.arange(p + 1)
            seen = j > p - window if window else j >= 0
            s = torch.einsum("hd,nhd->hn", q[row].double(), k[:p + 1][seen]) * scale
            w = s.softmax(-1)
            if bf16_weights:
                w = w.bfloat16().double()
            out.append(torch.einsum("hn,nhd->hd", w, v[:p + 1][seen]))
            row += 1
    return torch.stack(out)


def _bf16_dot(isa, d):
    """the AVX-512 build's per-query path over a bf16 cache takes bf16 dot products (queries
    and softmax weights rounded to bf16) where d is a multiple of 32"""
    return isa == "avx512" and d % 32 == 0


# a flip of one weight's bf16 rounding between the fp32 kernel and the float64 reference costs
# up to w * 2^-8 * |v|, a few 1e-3 at most here; the kernel's other errors are ~1e-7
BF16_DOT_ATOL = 5e-3


@pytest.mark.parametrize("isa", ISAS)
# d 36: the path for head sizes not a multiple of 16 / 8; 64, 96, 128, 256 with 3 or 6 query
# heads per KV head: the outputs held in registers for 4, 6, 8 or 16 vectors per head, in one or
# several groups of heads (a last group part full), and 32 AVX2 vectors: the per-key path
@pytest.mark.parametrize("d,heads", [(64, 6), (36, 6), (64, 12), (96, 6), (128, 12), (256, 12)])
def test_paged_attention_matches_float64_reference_decode_and_chunks(isa, d, heads, ops):
    gen = torch.Generator().manual_seed(0)
    kv, bs = 2, 4
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
    got = ops.paged_attention(q, k_pool, v_pool, tables,
                                                  torch.tensor(ctx_lens), torch.tensor(q_lens),
                                                  0.125)
    want = _attention_reference(q, k_pool, v_pool, tables.tolist(), ctx_lens, q_lens, 0.125)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    # a bf16 KV cache: the same attention over the bf16 values (read back exactly as fp32), or
    # with bf16 dot products
    k16, v16 = k_pool.bfloat16(), v_pool.bfloat16()
    got16 = ops.paged_attention(q, k16, v16, tables, torch.tensor(ctx_lens),
                                                    torch.tensor(q_lens), 0.125)
    b16 = _bf16_dot(isa, d)
    want16 = _attention_reference(q.bfloat16() if b16 else q, k16.double(), v16.double(),
                                  tables.tolist(), ctx_lens, q_lens, 0.125, bf16_weights=b16)
    torch.testing.assert_close(got16.double(), want16, rtol=0,
                               atol=BF16_DOT_ATOL if b16 else 2e-6)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ops.paged_attention(q, k16, v_pool, tables, torch.tensor(ctx_lens),
                                                torch.tensor(q_lens), 0.125)
    with pytest.raises(RuntimeError, match="q_len"):
        ops.paged_attention(q, k_pool, v_pool, tables,
                                                torch.tensor(ctx_lens), torch.tensor([2] * 5),
                                                0.125)
    bad = tables.clone()
    bad[0, 0] = 99
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_attention(q, k_pool, v_pool, bad, torch.tensor(ctx_lens),
                                                torch.tensor(q_lens), 0.125)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d", [64, 36])
def test_paged_attention_sliding_window_matches_float64_reference(isa, d, ops):
    """window w > 0: a query at position p sees keys p - w < j <= p (transformers' sliding
    window); windows shorter than, equal to and longer than the contexts, block boundaries
    inside the window, fp32 and bf16 pools; window 0 is full attention."""
    gen = torch.Generator().manual_seed(1)
    heads, kv, bs = 4, 2, 4
    k_pool = torch.randn(30, bs, kv, d, generator=gen)
    v_pool = torch.randn(30, bs, kv, d, generator=gen)
    ctx_lens, q_lens = [1, 9, 6, 17, 13], [1, 1, 4, 5, 3]
    tables = (torch.randperm(29, generator=gen)[:25] + 1).view(5, 5)  # scattered blocks
    q = torch.randn(sum(q_lens), heads, d, generator=gen)
    args = (tables, torch.tensor(ctx_lens), torch.tensor(q_lens), 0.125)
    for pools in ((k_pool, v_pool), (k_pool.bfloat16(), v_pool.bfloat16())):
        b16 = pools[0].dtype == torch.bfloat16 and _bf16_dot(isa, d)
        for window in (1, 3, 5, 8, 17, 40):
            got = ops.paged_attention(q, *pools, *args, window)
            want = _attention_reference(q.bfloat16() if b16 else q, pools[0].double(),
                                        pools[1].double(), tables.tolist(), ctx_lens, q_lens,
                                        0.125, window, bf16_weights=b16)
            torch.testing.assert_close(got.double(), want, rtol=0,
                                       atol=BF16_DOT_ATOL if b16 else 2e-6)
        full = ops.paged_attention(q, *pools, *args)
        assert torch.equal(ops.paged_attention(q, *pools, *args, 0), full)
        assert torch.equal(ops.paged_attention(q, *pools, *args, 17), full)  # covers every ctx
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ops.paged_attention(q, k_pool, v_pool, *args, -1)


@pytest.mark.parametrize("isa", ISAS)
# 64, 128, 256: the tiled path (chunks of 16+ queries); 48: not a multiple of two AVX-512
# vectors, so even long chunks take the per-query path there (a multiple of 16 on AVX2)
@pytest.mark.parametrize("d,heads", [(64, 6), (128, 4), (256, 2), (48, 6)])
def test_paged_attention_long_chunks_match_float64_reference(isa, d, heads, ops):
    """Chunks of kTiledMinQ (16) queries or more run in flash-style tiles: whole prompts and
    chunks after a cached prefix, lengths around the tiles' 6 / 8 rows and 16 / 32 keys, beside
    decode tokens and short chunks of the same call; sliding windows shorter and longer than the
    chunks; fp32 and bf16 pools (bf16 dot products on AVX-512)."""
    gen = torch.Generator().manual_seed(d)
    kv, bs = 2, 16
    ctx_lens, q_lens = [16, 1, 57, 40, 3, 100], [16, 1, 17, 33, 2, 100]
    k_pool = torch.randn(40, bs, kv, d, generator=gen)
    v_pool = torch.randn(40, bs, kv, d, generator=gen)
    blocks = torch.randperm(39, generator=gen) + 1  # scattered blocks, 0 left unused
    tables, used = torch.zeros(len(ctx_lens), 7, dtype=torch.int64), 0
    for b, n in enumerate(ctx_lens):
        nb = -(-n // bs)
        tables[b, :nb] = blocks[used:used + nb]
        used += nb
    q = torch.randn(sum(q_lens), heads, d, generator=gen) * 3  # peaked softmaxes too
    args = (tables, torch.tensor(ctx_lens), torch.tensor(q_lens), d ** -0.5)
    for pools in ((k_pool, v_pool), (k_pool.bfloat16(), v_pool.bfloat16())):
        # the AVX-512 build's tiles over a bf16 cache take bf16 dot products (vdpbf16ps): the
        # queries rounded to bf16 (the reference's too) and the softmax weights (2^-9 relative:
        # up to ~1e-2 of these outputs, whose values reach ~3); else fp32 throughout, queries x3:
        # scores up to ~15, whose fp32 rounding (~1e-6) moves the weights (the per-query path's
        # tolerance, 2e-6, is with unit-scale queries)
        b16 = pools[0].dtype == torch.bfloat16 and isa == "avx512" and d != 48
        qref = q.bfloat16() if b16 else q
        for window in (0, 5, 20, 64):
            got = ops.paged_attention(q, *pools, *args, window)
            want = _attention_reference(qref, pools[0].double(), pools[1].double(),
                                        tables.tolist(), ctx_lens, q_lens, d ** -0.5, window)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2 if b16 else 4e-6,
                                       msg=f"window {window}, {pools[0].dtype}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", [64, 37])  # 37: the tail after the 16- / 8-wide vectors
def test_gated_activations_match_float64_reference(isa, width, ops):
    """silu_mul and gelu_tanh_mul (gelu_pytorch_tanh) on gu = [gate | up], including gates far
    out in both tails (exp clamped) and zeros."""
    gen = torch.Generator().manual_seed(width)
    gate = torch.randn(6, width, generator=gen) * 4
    gate[0, :6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 120.0, -120.0])
    up = torch.randn(6, width, generator=gen)
    gu = torch.cat([gate, up], 1)
    g64, u64 = gate.double(), up.double()
    want = {"silu_mul": torch.nn.functional.silu(g64) * u64,
            "gelu_tanh_mul": torch.nn.functional.gelu(g64, approximate="tanh") * u64}
    for name, ref in want.items():
        got = getattr(ops, name)(gu)
        torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=1e-7, msg=name)


# --- the kernels' thread pool (csrc/thread_pool.h) ---------------------------------------------


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _split_cases(isa, ops):
    """(name, call) of ops big enough to be split over several threads: every output row block
    is computed by exactly one thread, so the results must not depend on the thread count."""
    gen = torch.Generator().manual_seed(3)
    p4 = random_packed(576, 576, QuantSpec(4, 64, False), seed=4)
    w4 = cpu_kernels.repack_w4a8(p4, isa)
    w4 = cpu_kernels.CpuW4A8(w4.packed, w4.scales, w4.mz, w4.perm, w4.group_size, w4.op,
                             _a8_variants(isa)[-1])
    w8 = cpu_kernels.repack_w8a32(random_packed(576, 576, QuantSpec(8, 64, False), seed=5), isa)
    wh = (torch.randn(2048 // 16, 576, 16, generator=gen) * 0.1).half()
    k_pool, v_pool = torch.randn(2, 16, 16, 3, 64, generator=gen).unbind(0)  # [blocks, 16, KV, D]
    kv_args = (torch.arange(16).view(1, 16), torch.tensor([250]), torch.tensor([1]), 0.125)
    q = torch.randn(1, 9, 64, generator=gen)
    cases = []
    for m in (1, 3, 9):
        x = torch.randn(m, 576, generator=gen)
        cases += [(f"w4a8_mm m={m}", lambda x=x: cpu_kernels.w4a8_matmul(x, w4)),
                  (f"w8a32_mm m={m}", lambda x=x: cpu_kernels.w8a32_matmul(x, w8)),
                  (f"fp16_mm m={m}", lambda x=x: ops.fp16_mm(x, wh))]
    head_q8 = torch.randint(-127, 128, (8192 // 16, 576 // 4, 64), generator=gen,
                            dtype=torch.int8)
    head_s = (torch.rand(8192 // 16, 576 // 32, 16, generator=gen) * 0.01).half()
    for m in (1, 3):
        x = torch.randn(m, 576, generator=gen)
        cases.append((f"w8a8_mm m={m}", lambda x=x: ops.w8a8_mm(x, head_q8, head_s)))
    cases.append(("paged_attention", lambda: ops.paged_attention(q, k_pool, v_pool, *kv_args)))
    return cases


@pytest.mark.parametrize("isa", ISAS)
def test_results_do_not_depend_on_the_thread_count(isa, ops, threads):
    """Decode-sized matmuls (one row of a 576 x 576 layer) and attention are split over the
    pool's threads; 2 and 5 threads (more than this machine may have) give the bytes of 1."""
    cases = _split_cases(isa, ops)
    threads(1)
    want = [fn() for _, fn in cases]
    for n in (2, 5):
        threads(n)
        for (name, fn), w in zip(cases, want):
            for _ in range(3):  # a worker may join late or not at all: any split is exact
                assert torch.equal(fn(), w), (name, n)


@pytest.mark.parametrize("isa", ISAS)
def test_callers_on_several_threads_share_the_pool(isa, ops, threads):
    """Ops called at once from several Python threads (a server's workers): one caller uses the
    pool, the others run on their own thread, all results exact."""
    from concurrent.futures import ThreadPoolExecutor

    cases = _split_cases(isa, ops)
    threads(1)
    want = [fn() for _, fn in cases]
    threads(2)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: cases[i % len(cases)][1](), range(8 * len(cases))))
    for i, g in enumerate(got):
        assert torch.equal(g, want[i % len(cases)]), cases[i % len(cases)][0]
