"""bench/rate_distortion_chart.py: which results become curves and points, and the SVG."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
rdc = pytest.importorskip("rate_distortion_chart")


def _result(bits: float, sotu: float | None) -> dict:
    return {"effective_bits_per_weight": bits,
            "eval": {} if sotu is None else {"sotu": {"kld": {"mean": sotu}}}}


RESULTS = {
    "uniform-w4": _result(4.22, 0.15), "uniform-w4g32": _result(4.5, 0.14),
    "uniform-w8": _result(8.02, 0.002),
    "menu-5.0": _result(5.0, 0.07), "menu-4.5": _result(4.5, 0.11),
    "menu-same": _result(4.22, 0.15),
    "int4-8-16-4.5": _result(4.49, 0.115), "int4-8-16-5.0": _result(4.99, None),  # unscored
}


def test_chart_data_groups_plans_by_planner_in_bits_order():
    curves, points = rdc.chart_data(RESULTS, "sotu", max_bits=6.5)
    assert curves == {"plans over the menu": [(4.22, 0.15), (4.5, 0.11), (5.0, 0.07)],
                      "plans over INT4 / INT8 / FP16": [(4.49, 0.115)]}
    assert points == {"uniform INT4": (4.22, 0.15), "uniform INT4 g32": (4.5, 0.14)}
    assert "uniform INT8" in rdc.chart_data(RESULTS, "sotu", max_bits=9.0)[1]
    assert rdc.chart_data(RESULTS, "business-eval", 6.5) == ({}, {})


def test_script_writes_one_standalone_svg(tmp_path):
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"results": RESULTS}))
    out = tmp_path / "c.svg"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "rate_distortion_chart.py"),
                          str(src), "--out", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    svg = out.read_text()
    assert svg.startswith("<svg ") and 'xmlns="http://www.w3.org/2000/svg"' in svg
    assert 'aria-label="Size against quality on sotu' in svg
    # two curves: matplotlib draws each line as one path with an id of its own
    assert len(re.findall(r'<g id="line2d_\d+">', svg)) >= 2
    missing = subprocess.run([sys.executable, str(ROOT / "bench" / "rate_distortion_chart.py"),
                              str(src), "--corpus", "wikitext", "--out", str(tmp_path / "x.svg")],
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "no result scored on 'wikitext'" in missing.stderr
    assert not (tmp_path / "x.svg").exists()
