"""bench/mixed_precision_menu.py: the check of the menu-entry damage rule and the allocation
table per layer type."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
mpm = pytest.importorskip("mixed_precision_menu")

from quantpipe.core.qformat import INT8_PER_CHANNEL, QuantSpec  # noqa: E402


def _layers(kld8_of):
    infos, layers = {}, {}
    for k in range(6):
        n = f"model.layers.{k // 2}.{'mlp.down_proj' if k % 2 else 'self_attn.q_proj'}"
        l4, l8, kld4 = 1.0 + k, 0.01 * (1 + k * k), 0.1 * (k + 1)
        infos[n] = {"w4": {"loss": l4}, "w8": {"loss": l8}}
        layers[n] = {"kld_w4": kld4, "kld_w8": kld8_of(kld4, l4, l8)}
    return infos, layers


def test_scaling_check_is_exact_where_the_rule_holds_and_measures_where_it_does_not():
    infos, layers = _layers(lambda kld4, l4, l8: kld4 * l8 / l4)
    got = mpm.scaling_check(infos, layers)
    assert got["layers"] == 6 and got["spearman"] == pytest.approx(1.0)
    assert got["sum_pred_over_sum_measured"] == pytest.approx(1.0)
    assert all(abs(v) < 1e-12 for v in got["log10_pred_over_measured"].values())
    infos, layers = _layers(lambda kld4, l4, l8: 2 * kld4 * l8 / l4)  # twice the rule
    got = mpm.scaling_check(infos, layers)
    assert got["log10_pred_over_measured"]["p50"] == pytest.approx(-math.log10(2))
    assert got["sum_pred_over_sum_measured"] == pytest.approx(0.5)


def test_allocation_counts_entries_per_layer_type():
    g32 = QuantSpec(4, 32, True)
    specs_of = {n: {4: QuantSpec(4, 64, True), "w4g32": g32, 8: INT8_PER_CHANNEL, None: None}
                for n in ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj",
                          "model.layers.0.self_attn.k_proj")}
    bits = dict(zip(specs_of, ("w4g32", None, 8)))
    assert mpm.allocation(bits, specs_of) == {"mlp.down_proj": {"w4g32": 1, "fp16": 1},
                                              "self_attn.k_proj": {"w8pc": 1}}


from tests.calibration.test_pipeline import _spec, fp16_dir, prompt_file  # noqa: E402,F401


@pytest.mark.parametrize("legacy", [True, False])
def test_proxy_damage_plans_without_a_sensitivity_measurement(fp16_dir, prompt_file,  # noqa: F811
                                                              tmp_path, monkeypatch, legacy):
    """--damage proxy: no sensitivity file is written or read, every plan is made on the
    calibration losses, exported and scored; --no-legacy leaves out the INT4/INT8/FP16-only
    plans."""
    import json

    from quantpipe.calibration.pipeline import calibrate

    calib = tmp_path / "calib"
    calibrate(_spec(fp16_dir, prompt_file, calib, algo="gptq", group_size=64,
                    menu=("w4g32", "w4g64-asym")))
    out = tmp_path / "menu.json"
    monkeypatch.setattr(sys, "argv", [
        "mixed_precision_menu.py", "--fp16", str(fp16_dir), "--calib", str(calib), "--work",
        str(tmp_path / "work"), "--budgets", "same,5.0", "--uniform", "w4g64-asym",
        "--damage", "proxy", "--corpora", "business-eval", "--max-tokens", "64", "--ctx", "32",
        "--json", str(out)] + ([] if legacy else ["--no-legacy"]))
    mpm.main()
    data = json.loads(out.read_text())
    assert data["sensitivity"] is None and not list(tmp_path.rglob("sensitivity*.json"))
    res = data["results"]
    assert set(res) == {"uniform-w4", "uniform-w4g64-asym", "uniform-w8", "menu-same",
                        "menu-5.0"} | ({"int4-8-16-same", "int4-8-16-5.0"} if legacy else set())
    assert res["uniform-w4g64-asym"]["entries"] == {"w4g64-asym": sum(
        res["uniform-w4"]["entries"].values())}
    assert res["menu-5.0"]["effective_bits_per_weight"] <= 5.0 + 1e-6
    assert res["menu-5.0"]["effective_bits_per_weight"] > res["uniform-w4"][
        "effective_bits_per_weight"]
    kld = data["kld_mean"]["business-eval"]
    assert kld["uniform-w8"] < kld["uniform-w4"]
