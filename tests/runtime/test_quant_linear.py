"""CPU kernels and QuantLinear vs a float64 dequantized reference, every layout option."""

import zlib

import pytest
import torch

from quantpipe.core.qformat import QuantSpec, pack_int32
from quantpipe.runtime.kernels import cpu as cpu_kernels
from quantpipe.runtime.kernels import cpu_ext
from quantpipe.runtime.kernels.layout import (
    PackedLinear,
    dequantize_reference,
    repack_for_triton,
    widen_to_int8,
)
from quantpipe.runtime.quant_linear import BACKENDS, QuantLinear
from tests.runtime._quant_helpers import random_packed

OUT, IN = 96, 256
LAYOUTS = [
    QuantSpec(bits, gs, sym, act)
    for bits in (4, 5, 6, 8) for gs in (32, 64, 128, -1) for sym in (True, False)
    for act in (False, True) if not (act and gs == -1)
]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("spec", LAYOUTS, ids=lambda s: s.label())
@pytest.mark.parametrize("m", [1, 3, 33])
def test_quant_linear_cpu_all_layouts(spec, m):
    p = random_packed(OUT, IN, spec, seed=zlib.crc32(f"{spec.label()}{m}".encode()), bias=True)
    ql = QuantLinear(p, "cpu")
    x = torch.randn(2, m, IN)  # [batch, seq, in]
    w64 = dequantize_reference(p)  # [out, in] float64
    want = x.double() @ w64.T + p.bias.double()
    got = ql(x)
    assert got.shape == (2, m, OUT) and got.dtype == torch.float32
    bits = 4 if spec.bits == 4 else 8  # INT5 / INT6 run as symmetric INT8 (widen_to_int8)
    if cpu_ext.kernel_status()[0]:  # quantpipe's kernels take every layout here (96 x 256)
        isa = cpu_ext.active_isa()
        expected = {4: f"w4a8_{isa}", 8: f"w8a32_{isa}"}[bits]
    else:
        # torch's: per-channel int4 at in=256 is one group of 256, a size int4pack takes
        fast = (bits == 4 and spec.group_size_for(IN) in (32, 64, 128, 256)) or (
            bits == 8 and spec.group_size == -1 and (spec.sym or spec.bits != 8))
        expected = ({4: "int4pack", 8: "int8pack"}[bits] if fast else "dequant")
    assert ql.backend == expected, ql.reason
    assert ql.spec == spec  # what the checkpoint stores, whatever the kernel runs
    # bf16 activations in int4pack / w4a16_avx512 and int8pack: relative error ~2**-8; int8
    # activations per 32 columns (W4A8): ~2**-7; w8a32_avx512 / w8a32_avx2 (exact int8, fp32
    # activations) and the fallback: fp32 sums only
    assert _rel(got, want) < TOLERANCE.get(ql.backend, 1e-2)


# relative error vs float64 (see above); others (bf16 activations): 1e-2
TOLERANCE = {"w8a32_avx512": 1e-5, "w8a32_avx2": 1e-5, "dequant": 1e-6, "w4a8_avx512": 2e-2,
             "w4a8_avx2": 2e-2}
REQUESTED = [QuantSpec(4, 64, True), QuantSpec(4, 32, False, True), QuantSpec(4, 16, True),
             QuantSpec(8, -1, True), QuantSpec(8, 32, False, True)]


def test_backend_registry_names():
    assert all(b.name == name for name, b in BACKENDS.items())
    assert set(BACKENDS) >= {"triton", "int4pack", "int8pack", "dequant"}
    import quantpipe.runtime.quant_linear as ql_module

    # the module docstring's table lists every backend
    assert all(f"``{name}``" in ql_module.__doc__ for name in BACKENDS)


@pytest.mark.parametrize("name", [n for n, b in BACKENDS.items() if b.device_type != "cuda"])
def test_every_cpu_backend_is_the_reference_where_usable_and_refused_elsewhere(name):
    """A requested backend runs only layers it computes (its reason otherwise), and then
    matches the float64 reference like the chosen one does."""
    for i, spec in enumerate(REQUESTED):
        p = random_packed(OUT, IN, spec, seed=40 + i, bias=True)
        usable, why = BACKENDS[name].usable(p, torch.device("cpu"))
        if not usable:
            with pytest.raises(ValueError, match=f"backend {name} is not usable here: "):
                QuantLinear(p, "cpu", backend=name)
            continue
        ql = QuantLinear(p, "cpu", backend=name)
        assert ql.backend == name and why in ql.reason
        x = torch.randn(5, IN)
        want = x.double() @ dequantize_reference(p).T + p.bias.double()
        assert _rel(ql(x), want) < TOLERANCE.get(name, 1e-2), spec.label()
    # the fallback takes everything; torch's int8 kernel no asymmetric or group-wise layer
    assert BACKENDS["dequant"].usable(p, torch.device("cpu"))[0]
    assert BACKENDS["int8pack"].usable(p, torch.device("cpu")) == (
        False, "int8pack is symmetric only")


@pytest.mark.parametrize("spec", [QuantSpec(4, 32, False), QuantSpec(4, 64, True),
                                  QuantSpec(4, 128, False, True)], ids=lambda s: s.label())
def test_int4pack_packing_and_zero_point_exact_in_fp32(spec):
    """With fp32 activations and scales the int4pack op reproduces (q - z) * s exactly:
    checks the packing, the [G, out, 2] layout and zero_fp = (8 - z) * scale."""
    p = random_packed(OUT, IN, spec, seed=3)
    w = cpu_kernels.repack_int4pack(p, act_dtype=torch.float32)
    x = torch.randn(5, IN)
    want = x.double() @ dequantize_reference(p).T
    got = cpu_kernels.int4pack_matmul(x, w)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("out_f", [64, 192, 96])
def test_int4pack_blob_unpacks_exactly_where_the_layout_is_known(out_f):
    p = random_packed(out_f, IN, QuantSpec(4, 64, False), seed=out_f)
    w = cpu_kernels.repack_int4pack(p)
    # torch's AVX-512 kernels block 64 rows, its AVX2 ones 32: either reads 64-multiples back;
    # 96 rows only the AVX2 layout (elsewhere int4pack runs at every M)
    if out_f % 64 == 0:
        assert w.unpackable
    if w.unpackable:
        assert torch.equal(cpu_kernels.unpack_int4pack(w.packed, out_f, w.block_rows),
                           p.unpacked_q())


@pytest.mark.parametrize("spec", [QuantSpec(4, 32, False), QuantSpec(4, 64, True),
                                  QuantSpec(4, 128, False, True)], ids=lambda s: s.label())
def test_int4_prefill_path_matches_reference_and_decode_path(spec):
    """M >= PREFILL_ROWS: dequantize once to bf16 + dense matmul; same result as int4pack up to
    bf16 rounding of the weights (2**-9 relative), both near the float64 reference."""
    p = random_packed(128, IN, spec, seed=5)
    w = cpu_kernels.repack_int4pack(p)
    assert w.unpackable
    m = cpu_kernels.PREFILL_ROWS + 7
    x = torch.randn(m, IN)
    want = x.double() @ dequantize_reference(p).T
    got = cpu_kernels.int4pack_matmul(x, w)  # the prefill path
    # row by row (M = 1 each) is the int4pack kernel
    rows = torch.cat([cpu_kernels.int4pack_matmul(x[i:i + 1], w) for i in range(0, m, 45)])
    assert _rel(got, want) < 1e-2
    assert _rel(rows, want[::45]) < 1e-2
    assert _rel(got[::45], rows.double()) < 1e-2
    # the dequantized weight itself: (q - z) * s in the repacked order, up to the bf16 rounding
    # of scale and zero point (int4pack's own) and of the result: unit roundoff 2**-8 each
    wd = cpu_kernels.dequantize_int4pack(w).double()
    ref = dequantize_reference(p)
    s = p.scales.double()[:, p.group_index()]  # [out, in]
    if w.perm is not None:
        ref, s = ref[:, w.perm], s[:, w.perm]
    # |q - 8| * s and |zero_fp| = |8 - z| * s are each <= 8 s
    assert ((wd - ref).abs() <= 2.0**-8 * (ref.abs() + 16 * s)).all()


def test_backend_dispatch_reasons():
    uneven = random_packed(OUT, IN, QuantSpec(4, 32, True, True), 1, act_group_sizes_equal=False)
    assert cpu_kernels.cpu_backend_for(uneven)[0] == "dequant"
    assert cpu_kernels.cpu_backend_for(random_packed(24, IN, QuantSpec(4, 32, True), 1))[0] == \
        "dequant"  # out % 16 != 0
    int8_groupwise = f"w8a32_{cpu_ext.active_isa()}" if cpu_ext.kernel_status()[0] else "dequant"
    assert cpu_kernels.cpu_backend_for(random_packed(OUT, IN, QuantSpec(8, 32, True), 1))[0] == \
        int8_groupwise  # int8pack is per channel only
    with pytest.raises(ValueError, match="backend"):
        QuantLinear(random_packed(OUT, IN, QuantSpec(4, 32, True), 1), "cpu", backend="marlin")


@pytest.mark.parametrize("spec", [QuantSpec(5, 32, False, True), QuantSpec(6, -1, False),
                                  QuantSpec(5, 128, True), QuantSpec(6, 64, True, True)],
                         ids=lambda s: s.label())
def test_int5_int6_widen_to_the_exact_int8_layer(spec):
    p = random_packed(OUT, IN, spec, seed=7, bias=True)
    # extreme codes and zeros: |q - zero| reaches 2**bits - 1, the most int8 must hold
    q = p.unpacked_q()
    q[0], q[1] = 0, spec.maxq
    zeros = None if spec.sym else torch.full_like(p.qzeros, spec.maxq)
    if zeros is not None:
        zeros[1] = 0
    p = PackedLinear(spec, pack_int32(q, spec.bits), p.scales, zeros, p.g_idx, p.bias, IN)
    w = widen_to_int8(p)
    assert (w.spec.bits, w.spec.sym, w.spec.group_size, w.spec.act_order) == (
        8, True, spec.group_size, spec.act_order)
    assert w.qzeros is None and torch.equal(w.scales, p.scales)
    assert torch.equal(dequantize_reference(w), dequantize_reference(p))  # bit for bit
    assert widen_to_int8(w) is w  # 4 and 8 bits pass through


def test_uneven_act_order_fallback_is_correct():
    p = random_packed(OUT, IN, QuantSpec(4, 32, False, True), 2, act_group_sizes_equal=False)
    ql = QuantLinear(p, "cpu")
    x = torch.randn(4, IN)
    assert ql.backend == "dequant"
    assert _rel(ql(x), x.double() @ dequantize_reference(p).T) < 1e-6


def test_triton_repack_is_a_transpose_of_the_native_words():
    p = random_packed(OUT, IN, QuantSpec(4, 64, False, True), 4)
    tw = repack_for_triton(p, "cpu")
    assert torch.equal(tw.qweight_t, p.qweight.T)  # [in/8, out] int32
    assert torch.equal(tw.scales_t, p.scales.T) and torch.equal(tw.zeros_t, p.qzeros.T)
    assert torch.equal(tw.g_idx, p.g_idx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", [QuantSpec(4, 128, True), QuantSpec(8, -1, True),
                                  QuantSpec(4, 64, False, True)], ids=lambda s: s.label())
def test_quant_linear_cuda_triton(spec):
    p = random_packed(256, 256, spec, seed=5, bias=True)
    ql = QuantLinear(p, "cuda", bias_dtype=torch.float16)
    assert ql.backend == "triton"
    for m in (1, 16, 64, 200):
        x = torch.randn(m, 256, device="cuda", dtype=torch.float16)
        want = x.double().cpu() @ dequantize_reference(p).T + p.bias.double()
        assert _rel(ql(x).cpu(), want) < 2e-3
