"""X^T X summed as float64 strips of its upper triangle: the same Hessian, bit for bit, as a
full float64 sum of the batches' fp32 products, in about half the memory."""

from __future__ import annotations

import pytest
import torch

from quantpipe.calibration import capture
from quantpipe.calibration.capture import GroupStats


def batches(n_in: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n_in, generator=g) * 3  # uneven input channels, like activations
    return [torch.randn(tokens, n_in, generator=g) * scale for tokens in (37, 64, 5)]


def full_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """The reference: [in, in] fp64 += each batch's fp32 x^T x."""
    xtx = torch.zeros(xs[0].shape[1], xs[0].shape[1], dtype=torch.float64)
    for x in xs:
        xtx.add_(x.T @ x)
    return xtx


@pytest.mark.parametrize("n_in", [7, 64, 100])  # one strip, exact strips, a short last strip
def test_strips_give_the_full_sum_bit_for_bit(n_in, monkeypatch):
    monkeypatch.setattr(capture, "XTX_STRIP_ROWS", 16)
    xs = batches(n_in, seed=n_in)
    st = GroupStats(n_in)
    for x in xs:
        st.add_xtx(x)
        st.tokens += x.shape[0]
    ref = full_sum(xs)
    assert torch.equal(ref, ref.T)  # the fp32 products are symmetric, so are their sums
    assert torch.equal(st.xtx, ref)
    tokens = sum(x.shape[0] for x in xs)
    H_ref = (2.0 * ref / tokens).float()
    assert torch.equal(st.H, H_ref)
    assert torch.equal(st.H, H_ref)  # H does not consume the sum
    assert torch.equal(st.take_hessian(), H_ref)
    with pytest.raises(ValueError, match="already taken"):
        st.take_hessian()


def test_strips_hold_about_half_of_the_full_matrix(monkeypatch):
    monkeypatch.setattr(capture, "XTX_STRIP_ROWS", 16)
    st = GroupStats(256)
    stored = sum(s.numel() for s in st._strips)
    assert stored <= 0.54 * 256 * 256  # upper triangle + half a strip's square per strip


def test_set_and_rescale_as_a_full_matrix(monkeypatch):
    """The xtx setter keeps the upper triangle; scale_inputs divides like X^T X / (s s^T)."""
    monkeypatch.setattr(capture, "XTX_STRIP_ROWS", 16)
    xs = batches(40, seed=1)
    ref = full_sum(xs)
    st = GroupStats(40)
    st.xtx = ref
    st.abs_sum = torch.rand(40, dtype=torch.float64)
    abs_ref = st.abs_sum.clone()
    assert torch.equal(st.xtx, ref)
    s = torch.rand(40, generator=torch.Generator().manual_seed(2)) + 0.5
    st.scale_inputs(s)
    assert torch.equal(st.xtx, ref / (s[:, None] * s[None, :]).double())
    assert torch.equal(st.abs_sum, abs_ref / s.double())
    st.xtx /= 2.0  # in-place arithmetic on the property writes back through the setter
    assert torch.equal(st.xtx, ref / (s[:, None] * s[None, :]).double() / 2.0)
