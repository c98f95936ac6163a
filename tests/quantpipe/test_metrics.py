"""The one KL divergence (quantpipe.core.metrics) against a float64 log-softmax reference."""

import math

import pytest
import torch

from quantpipe.core.metrics import mean_kld, token_kld


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    lp, lq = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)  # [T] fp64


@pytest.mark.parametrize("eps", [1e-1, 1e-3, 1e-5])
def test_token_kld_matches_float64_reference(eps):
    """Float32 dz-form KL == float64 log-softmax KL within 1e-3 relative, down to tiny
    (INT8-size, ~1e-11 nats) differences, where a float32 log-softmax is off by ~1e-6."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 4000, generator=g) * 4 + 10  # [T, V] logits of a realistic size
    b = a + eps * torch.randn(6, 4000, generator=g)
    want = _reference(a, b)  # ~eps**2 / 2 * Var(dz)
    got = token_kld(a, b)  # p_ref computed in float64, stored float32
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-12)
    assert float(token_kld(a, a).abs().max()) == 0.0


@pytest.mark.parametrize("eps", [1e-1, 1e-3, 1e-5])
def test_float32_p_ref_keeps_the_tolerance(eps):
    """p_ref from a float32 log-softmax (eval's) changes the KL by a relative ~1e-6 only."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(6, 4000, generator=g) * 4 + 10
    b = a + eps * torch.randn(6, 4000, generator=g)
    p32 = torch.log_softmax(a, -1).exp()  # [T, V] fp32
    torch.testing.assert_close(token_kld(a, b, p_ref=p32).double(), _reference(a, b),
                               rtol=1e-3, atol=1e-12)


def test_large_differences_and_shapes():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(5, 50, generator=g) * 3
    b = torch.randn(5, 50, generator=g) * 3  # unrelated distributions: KL of order 1
    torch.testing.assert_close(token_kld(a, b).double(), _reference(a, b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        token_kld(a, b[:4])


def test_mean_kld_weights_every_token():
    chunks = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])]
    assert math.isclose(mean_kld(chunks), 16.0 / 4, rel_tol=0, abs_tol=0)
    with pytest.raises(ValueError, match="no tokens"):
        mean_kld([])


def test_token_kld_of_shifted_logits_is_finite_and_right():
    """A candidate whose logits sit ~14 nats below the reference's everywhere (softmax ignores
    the offset) gave NaN or a wrong value (sum p expm1(-dz) is -1 + e^-14, within float32
    rounding of p's sum): here 0.25 or negative instead of ~0.001. Centring dz keeps it the
    float64 value."""
    from quantpipe.core.metrics import token_kld

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 49152, generator=g) * 3  # [T, V] peaked like an LM's logits
    cand = ref - 14.4 + 0.05 * torch.randn(6, 49152, generator=g)  # a shift, small noise
    got = token_kld(ref, cand)
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(cand.double(), -1)
    want = (lp.exp() * (lp - lq)).sum(-1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
