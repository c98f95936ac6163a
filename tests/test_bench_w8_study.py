"""bench/w8_study.py: the per-row refinement of the smoothing scales, and the variant checks."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
w8 = pytest.importorskip("w8_study")


def massive_input_case():
    """A consumer [32, 48] whose input column 5 carries a massive activation."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(32, 48, generator=g)
    x = torch.randn(400, 48, generator=g) * 0.1
    x[:, 5] *= 300.0
    H = 2 * x.T @ x / x.shape[0]  # [48, 48]
    return W, H


def test_refined_scale_lowers_the_proxy_and_moves_only_the_top_rows():
    W, H = massive_input_case()
    rows = torch.arange(48)  # a producer row per column (e.g. up_proj -> down_proj)
    s = torch.ones(48)
    start = w8.rtn_proxy([W], H, s[rows], sym=True)
    r = w8.refined_scale([W], H, rows, s, top=2, sym=True)
    assert torch.equal(s, torch.ones(48))  # the input is not changed
    moved = (r != s).nonzero().flatten().tolist()
    assert set(moved) <= set(torch.diagonal(H).argsort(descending=True)[:2].tolist())
    assert 5 in moved  # the massive input's weights are scaled up ...
    assert r[5] > 1
    # ... and the proxy drops well below the unscaled one (the search keeps only improvements)
    assert w8.rtn_proxy([W], H, r[rows], sym=True) < 0.5 * start


def test_variant_checks():
    with pytest.raises(ValueError, match="give smooth too"):
        w8.Variant(refine=4)
    with pytest.raises(ValueError, match="fp 'mlp'"):
        w8.Variant(fp="mlp")
    label, v = w8.parse_variant("x:smooth=down;refine=4;fp=down_proj+v_proj")
    assert (label, v.refine, v.fp) == ("x", 4, "down_proj+v_proj")
    assert w8.in_fp("model.layers.3.mlp.down_proj", v)
    assert not w8.in_fp("model.layers.3.mlp.up_proj", v)
