"""bench/quality.py's bench-only algorithms: calibrate accepts them and they do what they name."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
quality = pytest.importorskip("quality")


@pytest.fixture
def algorithm_tables():
    """The algorithm tables as they were, back after the test."""
    from quantpipe.calibration.algorithms import ALGORITHMS
    from quantpipe.calibration.config import ALGO_OPTIONS

    saved = [(table, dict(table)) for table in (ALGORITHMS, ALGO_OPTIONS)]
    yield ALGORITHMS, ALGO_OPTIONS
    for table, before in saved:
        table.clear()
        table.update(before)


def test_bench_only_algorithms(algorithm_tables):
    from quantpipe.calibration import block_step
    from quantpipe.calibration.config import ALGOS
    from quantpipe.calibration.gptq import gptaq
    from quantpipe.calibration.spec import CalibrateSpec
    from quantpipe.core.qformat import QuantSpec

    algorithms, options = algorithm_tables
    quality.register_refined_gptq()
    quality.register_gptaq_alphas(["gptaq0.5-sym", "gptq-asym"])
    assert set(algorithms) - set(ALGOS) == {"gptqrefine", "gptaq0.5"} == set(options) - set(ALGOS)
    for algo in ("gptqrefine", "gptaq0.5"):  # accepted, with GPTQ's defaults
        spec = CalibrateSpec(Path("f"), Path("o"), algo=algo).resolved()
        assert spec.act_order and spec.mse_clip
    g = torch.Generator().manual_seed(0)
    W = torch.randn(16, 64, generator=g)  # [out, in]
    X = torch.randn(512, 64, generator=g)  # [tokens, in] the quantized model's inputs
    dX = 0.2 * torch.randn(512, 64, generator=g)  # X_fp - X_q
    H, dXXT = 2 * X.T @ X / 512, 2 * dX.T @ X / 512  # [in, in] each
    qspec = QuantSpec(4, 32, False)
    got = algorithms["gptaq0.5"].quantize(spec, "l", W, H, qspec, X[:0],
                                        asym=block_step.AsymInputs(dXXT))
    for alpha, same in ((0.5, True), (0.25, False)):
        ref = gptaq(W, H, qspec, dXXT, alpha=alpha, mse_clip=spec.mse_clip,
                    static_groups=spec.static_groups, percdamp=spec.percdamp)
        assert torch.equal(got.weight.q, ref.weight.q) == same, alpha


def test_clip_search_settings(monkeypatch):
    from quantpipe.calibration import grid

    monkeypatch.setattr(grid, "CLIP_GRID", grid.CLIP_GRID)  # restored after the test
    monkeypatch.setattr(grid, "CLIP_SYM_TOP_CODE", grid.CLIP_SYM_TOP_CODE)
    assert quality.set_clip_search(None, None) == (100, "on")  # the library's
    assert quality.set_clip_search(20, "off") == (20, "off")
    assert (grid.CLIP_GRID, grid.CLIP_SYM_TOP_CODE) == (20, False)
    with pytest.raises(ValueError, match="at least 1 step"):
        quality.set_clip_search(0, None)
    assert grid.CLIP_GRID == 20  # unchanged by the refused value


def test_reused_calibration_must_share_the_clip_search(tmp_path, monkeypatch):
    """A finished calibration in --work made with another clip search is an error, not a
    silent reuse (each setting needs its own --work)."""
    import argparse
    import json

    from quantpipe.calibration import grid

    calib = tmp_path / "calib-gptaq-sym"
    calib.mkdir()
    manifest = {"stage": "calibration", "seconds": 1.0, "peak_rss_mb": 1.0, "damp_raises": 0,
                "clip_search": {"grid": 20, "max_shrink": 0.8, "sym_top_code": False}}
    (calib / "quantpipe.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(quality, "read_calibration",
                        lambda d: argparse.Namespace(manifest=json.loads(
                            (Path(d) / "quantpipe.json").read_text())))
    monkeypatch.setattr(grid, "CLIP_GRID", 100)
    monkeypatch.setattr(grid, "CLIP_SYM_TOP_CODE", True)
    with pytest.raises(SystemExit, match="its own --work"):
        quality.calibrate_and_export(Path("fp16"), tmp_path, "gptaq-sym", [], None)
    monkeypatch.setattr(grid, "CLIP_GRID", 20)  # the same search: reused
    monkeypatch.setattr(grid, "CLIP_SYM_TOP_CODE", False)
    out = quality.calibrate_and_export(Path("fp16"), tmp_path, "gptaq-sym", [], None)
    assert out["config"] == "gptaq-sym" and out["models"] == {}

