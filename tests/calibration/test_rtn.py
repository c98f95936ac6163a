"""RTN: grid correctness against an independent float64 reference, MSE clip search."""

from __future__ import annotations

import pytest
import torch

from quantpipe.calibration.result import proxy_loss
from quantpipe.calibration.rtn import rtn
from quantpipe.core.qformat import QuantSpec

SPECS = [
    QuantSpec(4, 32, True), QuantSpec(4, 32, False), QuantSpec(4, 64, True),
    QuantSpec(4, -1, False), QuantSpec(8, -1, True), QuantSpec(8, 32, False),
]


def reference_rtn(W: torch.Tensor, bits: int, gs: int, sym: bool):
    """Textbook min-max RTN in float64 (written apart from calibration/grid.py)."""
    W = W.double()
    out_f, in_f = W.shape
    gs = in_f if gs == -1 else gs
    maxq = 2**bits - 1
    Wg = W.reshape(out_f, in_f // gs, gs)
    if sym:
        absmax = Wg.abs().amax(dim=-1, keepdim=True)
        scale = absmax / (maxq / 2)
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        lo = Wg.amin(dim=-1, keepdim=True).clamp(max=0)
        hi = Wg.amax(dim=-1, keepdim=True).clamp(min=0)
        scale = (hi - lo) / maxq
    scale = scale.clamp(min=1e-5).half().double()
    if not sym:
        zero = (-lo / scale).round().clamp(0, maxq)
    q = ((Wg / scale).round() + zero).clamp(0, maxq)
    W_hat = ((q - zero) * scale).reshape(out_f, in_f)
    return q.reshape(out_f, in_f), scale.squeeze(-1), zero.squeeze(-1), W_hat


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_rtn_matches_float64_reference(spec):
    torch.manual_seed(0)
    W = torch.randn(48, 128) * 0.05
    W[3, 5] = 0.9  # an outlier group
    res = rtn(W, spec)
    q_ref, scale_ref, zero_ref, W_hat_ref = reference_rtn(W, spec.bits, spec.group_size, spec.sym)
    assert torch.equal(res.weight.q.double(), q_ref)
    assert torch.equal(res.weight.scales.double(), scale_ref)
    assert torch.equal(res.weight.zeros.double(), zero_ref)
    W_hat = res.weight.dequantize()
    torch.testing.assert_close(W_hat.double(), W_hat_ref, rtol=0, atol=1e-7)
    assert res.weight.q.dtype == torch.uint8 and int(res.weight.q.max()) <= spec.maxq
    assert res.weight.scales.dtype == torch.float16 and (res.weight.scales > 0).all()
    # proxy_loss forms dW in fp32 and sums in fp64: agreement to ~1e-7 relative
    expected = float(((W.double() - W_hat.double()) ** 2).sum())
    assert res.loss == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
@pytest.mark.parametrize("with_h", [False, True])
def test_mse_clip_never_worse_than_minmax(spec, with_h):
    torch.manual_seed(1)
    W = torch.distributions.StudentT(3.0).sample((32, 128)) * 0.02  # heavy tails: clip helps
    H = None
    if with_h:
        X = torch.randn(256, 128) * torch.linspace(0.1, 3.0, 128)
        H = X.T @ X / 256
    plain = rtn(W, spec, H=H)
    clipped = rtn(W, spec, H=H, mse_clip=True)
    # per group error (H-diagonal weighted when H is given), float64
    d = torch.ones(128, dtype=torch.float64) if H is None else torch.diagonal(H).double()
    gs = spec.group_size_for(128)

    def group_err(res):
        e = (W.double() - res.weight.dequantize().double()) ** 2 * d
        return e.reshape(32, 128 // gs, gs).sum(-1)

    assert (group_err(clipped) <= group_err(plain)).all()
    if spec.bits == 4:  # INT8's fine grid rarely gains from a 5 % shrink step
        assert group_err(clipped).sum() < group_err(plain).sum()  # it actually clips somewhere
    assert clipped.loss == pytest.approx(proxy_loss(W, clipped.weight.dequantize(), H), rel=1e-12)


def test_rtn_rejects_bad_input():
    with pytest.raises(ValueError, match="does not divide"):
        rtn(torch.randn(8, 96), QuantSpec(4, 64, True))
    with pytest.raises(ValueError, match="NaN"):
        rtn(torch.full((8, 64), float("nan")), QuantSpec(4, 32, True))
    with pytest.raises(ValueError, match=r"\[in, in\]"):
        rtn(torch.randn(8, 64), QuantSpec(4, 32, True), H=torch.eye(32))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
@pytest.mark.parametrize("steps,top", [(100, True), (20, False)])
@pytest.mark.parametrize("with_h", [True, False])
def test_clip_search_takes_the_best_of_its_candidates(spec, steps, top, with_h, monkeypatch):
    """Every group gets the smallest diag(H)-weighted (no H: plain) error among min-max, the
    shrinks
    p = 0.99, 0.98, ..., 0.21 of its range and, symmetric, the scale max / 7 that puts the
    largest positive value on the top code (codes -8..7), each candidate scored here in
    float64 from scales built apart from calibration/grid.py. With the settings of before
    issue #18 (steps of 0.05, no top-code candidate) the candidates are those."""
    from quantpipe.calibration import grid

    monkeypatch.setattr(grid, "CLIP_GRID", steps)
    monkeypatch.setattr(grid, "CLIP_SYM_TOP_CODE", top)
    shrinks = [1 - i / steps for i in range(int(0.8 * steps))]  # p = 1: min-max
    torch.manual_seed(2)
    W = torch.distributions.StudentT(3.0).sample((16, 128)) * 0.02
    X = torch.randn(256, 128) * torch.linspace(0.1, 3.0, 128)
    H = X.T @ X / 256
    gs = spec.group_size_for(128)
    Wg = W.double().reshape(16, 128 // gs, gs)
    d = torch.diagonal(H).double().reshape(128 // gs, gs) if with_h else \
        torch.ones(128 // gs, gs, dtype=torch.float64)
    maxq, mid = 2**spec.bits - 1, 2 ** (spec.bits - 1)
    lo, hi = Wg.amin(-1), Wg.amax(-1)

    def fp16(x):
        return x.clamp(min=1e-5).half().double()

    def err(scale, zero):  # [16, G] each -> [16, G]
        s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
        q = torch.clamp(torch.round(Wg / s) + z, 0, maxq)
        return (((q - z) * s - Wg) ** 2 * d).sum(-1)

    if spec.sym:
        zero = torch.full_like(lo, mid)
        absmax = torch.maximum(lo.abs(), hi.abs())
        cands = [(fp16(p * absmax / (maxq / 2)), zero) for p in shrinks]
        if top:
            cands.append((fp16(absmax / (maxq - mid)), zero))
    else:
        cands = []
        for p in shrinks:
            a, b = (p * lo).clamp(max=0), (p * hi).clamp(min=0)
            scale = fp16((b - a) / maxq)
            cands.append((scale, torch.clamp(torch.round(-a / scale), 0, maxq)))
    best = torch.stack([err(s, z) for s, z in cands]).amin(0)
    res = rtn(W, spec, H=H if with_h else None, mse_clip=True)
    got = (((W.double() - res.weight.dequantize().double()) ** 2).reshape(Wg.shape) * d).sum(-1)
    # the search ranks candidates by fp32 errors: a near-tie may go either way
    assert got == pytest.approx(best, rel=1e-5, abs=1e-12)


@pytest.mark.parametrize("group_size", [64, -1])
def test_symmetric_clip_search_puts_the_positive_extreme_on_the_top_code(group_size):
    """Integers in [-6, 7] with 7 in every group are exact on the grid of scale 1 = 7 / 7
    (codes q - 8 in [-8, 7]); min-max's absmax / 7.5 misses them and every shrink clips 7:
    only the top-code candidate is exact, and the search takes it."""
    torch.manual_seed(3)
    W = torch.randint(-6, 8, (16, 128)).float()
    W[:, ::64] = 7.0  # every group's largest |value|, positive
    spec = QuantSpec(4, group_size, True)
    res = rtn(W, spec, mse_clip=True)
    assert (res.weight.scales == 1.0).all()
    assert torch.equal(res.weight.dequantize(), W)
    assert not torch.equal(rtn(W, spec).weight.dequantize(), W)  # min-max is not exact
