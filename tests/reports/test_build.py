"""`quantpipe report` end to end on a tiny model (calibrate -> export -> report)."""

import json
import os

import pytest
from click.testing import CliRunner

from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
from quantpipe.cli import main
from quantpipe.stages.export import ExportSpec, export_quantized
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.calibration.test_pipeline import PROMPTS


def test_report_cli(tiny_llama_dir, tmp_path):
    fp16 = tmp_path / "fp16"
    export_fp16(Fp16ExportSpec(str(tiny_llama_dir), fp16))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"{p} <script>alert({i})</script>"})
                                 for i, p in enumerate(PROMPTS * 3)) + "\n")
    calib = calibrate(CalibrateSpec(fp16, tmp_path / "calib", str(prompts), algo="rtn",
                                    group_size=32, samples=4, seq_len=32, min_tokens=4)).out
    export_quantized(ExportSpec(calib, tmp_path / "int4", bits=4))
    out = tmp_path / "r" / "report.html"
    r = CliRunner().invoke(main, [
        "report", "--reference", str(fp16), "--candidate", str(tmp_path / "int4"),
        "--prompts", str(prompts), "--max-prompts", "4", "--max-new-tokens", "8",
        "--memory-budget", "1GB", "--out", str(out)])
    assert r.exit_code == 0, r.output
    for who in ("FP16", "int4"):  # progress of the answers (the slow part of a report)
        assert f"report: {who} answers: 100%" in r.stderr and "4/4" in r.stderr
    page = out.read_text()
    data = json.loads(out.with_suffix(".json").read_text())
    cand = data["candidates"][0]
    assert cand["verdict"]["status"] in ("pass", "warn", "fail")
    assert cand["distribution"]["kld"]["mean"] > 0
    assert cand["calibration"]["algorithm"] == "rtn"
    assert len(data["outputs"]["reference"]) == 4
    assert "<script>alert" not in page and "&lt;script&gt;alert" in page
    # speed and memory measured by default, each model alone, through the engine
    speed = {m["name"]: m for m in data["model_speed"]}
    assert list(speed) == ["FP16", "int4"]
    for m in speed.values():
        assert set(m["by_concurrency"]) == {"1", "8"}
        batch = m["by_concurrency"]["8"]
        assert batch["requests"] == 4 and batch["output_tokens_per_s"] > 0
        assert 0 < batch["ttft_ms"]["p50"] <= batch["ttft_ms"]["p99"]
        assert m["peak_rss_bytes"] > m["weight_bytes"] > 0
        assert m["kv_tokens_in_budget"] == (10**9 - m["weight_bytes"]) // m["kv_bytes_per_token"]
    assert speed["int4"]["weight_bytes"] < speed["FP16"]["weight_bytes"]
    assert data["memory_budget"] == 10**9 and data["machine"]["cpu"]
    assert 'id="speed"' in page and 'id="candidates"' in page


# ---- checks before any model loads ---------------------------------------------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from tests.quantpipe.test_cli_errors import make_folders

    return make_folders(tmp_path_factory.mktemp("report-checks"))


@pytest.fixture
def no_model_load(monkeypatch):
    from tests.quantpipe.test_cli_errors import ModelLoaded

    def refuse(*_a, **_k):
        raise ModelLoaded

    # every model load of a report: the evaluation and the answers
    monkeypatch.setattr("quantpipe.reports.build.run_eval", refuse)
    monkeypatch.setattr("quantpipe.reports.build.answer_prompts", refuse)


def _report(dirs, out, *extra):
    return CliRunner().invoke(main, [
        "report", "--reference", str(dirs["fp16"]), "--candidate", str(dirs["int4"]),
        "--prompts", str(dirs["prompts"]), "--out", str(out), *map(str, extra)])


def _speed_file(path, content: str):
    path.write_text(content)
    return path


@pytest.mark.parametrize("case", ["out_folder", "out_under_file", "out_read_only",
                                  "speed_not_json", "speed_unknown", "speed_bad_record",
                                  "eval_max_tokens"])
def test_report_checks_fail_before_loading(dirs, tmp_path, monkeypatch, no_model_load, case):
    from tests.quantpipe.test_cli_errors import assert_one_line_error

    out, extra, needles = tmp_path / "r" / "report.html", [], []
    if case == "out_folder":
        out.mkdir(parents=True)
        needles = ["--out", str(out), "existing folder"]
    elif case == "out_under_file":
        (tmp_path / "r").write_text("")
        needles = ["--out", "is a file, not a folder"]
    elif case == "out_read_only":
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if mode & os.W_OK
                            else access(p, mode))
        needles = ["--out", str(tmp_path), "not writable"]
    elif case == "eval_max_tokens":
        extra, needles = ["--eval-max-tokens", "-1"], ["--eval-max-tokens -1"]
    else:
        content = {"speed_not_json": "{oops",
                   "speed_unknown": json.dumps({"hello": 1}),
                   "speed_bad_record": json.dumps({"rows": [{"kernel": "x"}]})}[case]
        speed = _speed_file(tmp_path / "speed.json", content)
        extra, needles = ["--speed", speed], [str(speed)]
    r = _report(dirs, out, *extra)
    assert_one_line_error(r, *needles)


def test_report_refuses_a_candidate_of_another_model(dirs, tmp_path, no_model_load):
    from tests.quantpipe.test_cli_errors import ModelLoaded, assert_one_line_error

    args = ["report", "--reference", str(dirs["other"]), "--candidate", str(dirs["int4"]),
            "--prompts", str(dirs["prompts"]), "--out", str(tmp_path / "r.html")]
    r = CliRunner().invoke(main, args)
    assert_one_line_error(r, str(dirs["int4"]), str(dirs["other"]), "--allow-other-source")
    r = CliRunner().invoke(main, [*args, "--allow-other-source"])
    assert isinstance(r.exception, ModelLoaded)


def test_reused_eval_result_is_checked_first(dirs, tmp_path, no_model_load):
    from quantpipe.reports.build import ReportSpec, build_report
    from tests.quantpipe.test_cli_errors import ModelLoaded

    good = {"candidate": str(dirs["int4"]), "tokens": 10, "same_top_rate": 0.5,
            "kld": {k: 0.1 for k in ("mean", "median", "p90", "p99", "p999", "max")},
            "top_prob_delta": {k: 0.0 for k in ("rms", "p1", "p5", "p50", "p95", "p99")},
            "ppl_reference": 2.0, "ppl_candidate": 2.1, "ppl_ratio": 1.05}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({**good, "kld": 3}))
    spec = ReportSpec(dirs["fp16"], (dirs["int4"],), tmp_path / "r.html", str(dirs["prompts"]),
                      evals=(path,))
    with pytest.raises(ValueError, match=f"{path}: not a `quantpipe eval --json` result"):
        build_report(spec)
    path.write_text(json.dumps(good))
    with pytest.raises(ModelLoaded):
        build_report(spec)
