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
    """The reference: [in, in] fp64 += each batch's fp32 x^T x (not symmetric bit for bit
    on every BLAS: compare its upper triangle)."""
    xtx = torch.zeros(xs[0].shape[1], xs[0].shape[1], dtype=torch.float64)
    for x in xs:
        xtx.add_(x.T @ x)
    return xtx


@pytest.mark.parametrize("n_in", [7, 64, 100])  # one strip, exact strips, a short last strip
def test_strips_give_the_full_sum(n_in, monkeypatch):
    monkeypatch.setattr(capture, "XTX_STRIP_ROWS", 16)
    xs = batches(n_in, seed=n_in)
    st = GroupStats(n_in)
    for x in xs:
        st.add_xtx(x)
        st.tokens += x.shape[0]
    ref = full_sum(xs)
    tokens = sum(x.shape[0] for x in xs)
    # each strip is its own fp32 product (the upper triangle only), so the sums round as a
    # full fp32 x^T x would to within fp32's rounding of the products, not bit for bit; below
    # the strips their values are mirrored
    exact = sum(x.double().T @ x.double() for x in xs)  # [in, in] fp64
    torch.testing.assert_close(st.xtx, exact, rtol=0, atol=2e-6 * exact.abs().max().item())
    torch.testing.assert_close(st.xtx, ref, rtol=0, atol=2e-6 * exact.abs().max().item())
    H = st.H  # [in, in] fp32: 2 X^T X / tokens, scaled in fp64 and rounded once
    assert torch.equal(H, (2.0 * st.xtx / tokens).float())
    assert torch.equal(st.H, H)  # H does not consume the sum
    assert torch.equal(st.take_hessian(), H)
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


def test_a_stopped_pass_sums_the_same_statistics_and_skips_the_rest():
    """GPTAQ's per-group passes end at the group's linears (StopForward): each group's X^T X,
    |x| sums and dXXT are bitwise those of a whole pass, and nothing after the group runs."""
    from quantpipe.blocks.execute import StopForward, embed_inputs, run_block
    from quantpipe.calibration.capture import GroupInputRecorder, StatsCollector
    from quantpipe.core.families import block_groups, family_for, get_blocks
    from tests.tiny_models import make_family_model

    model, _ = make_family_model("llama")
    fam = family_for("llama")
    block = get_blocks(model, fam)[0]
    ids = torch.randint(3, 300, (4, 24), generator=torch.Generator().manual_seed(0))
    hidden, ctx = embed_inputs(model, ids)
    ctx = ctx.for_layer(0)
    groups = block_groups(fam, block)
    down_calls: list[int] = []
    block.mlp.down_proj.register_forward_pre_hook(lambda *_: down_calls.append(1))
    for group in groups:
        runs = {}
        for stop in (False, True):
            recorder = GroupInputRecorder(block, (group,))
            run_block(block, hidden, ctx, batch_size=2, keep=False)  # the "FP" inputs
            recorder.remove()
            collector = StatsCollector(block, (group,), sample_rows=0,
                                       fp_inputs=recorder.inputs, stop=stop)
            down_calls.clear()
            run_block(block, hidden * 1.01, ctx, batch_size=2, keep=False)
            collector.remove()
            runs[stop] = (collector.stats[group], len(down_calls))
        (whole, whole_calls), (stopped, stopped_calls) = runs[False], runs[True]
        assert stopped.tokens == whole.tokens == 4 * 24
        assert torch.equal(stopped.xtx, whole.xtx)
        assert torch.equal(stopped.abs_sum, whole.abs_sum)
        assert torch.equal(stopped.take_dxxt(), whole.take_dxxt())
        assert whole_calls == 2  # one per batch
        assert stopped_calls == (2 if "mlp.down_proj" in group.linears else 0)
    collector = StatsCollector(block, groups[:1], sample_rows=0, stop=True)
    with pytest.raises(RuntimeError, match="outputs are used"):
        run_block(block, hidden, ctx, batch_size=2)  # outputs wanted: a stop is a bug
    collector.remove()
    with pytest.raises(ValueError, match="one group"):
        StatsCollector(block, groups[:2], stop=True)
    assert issubclass(StopForward, Exception)
