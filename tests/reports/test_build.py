"""`quantpipe report` end to end on a tiny model (calibrate -> export -> report)."""

import json

from click.testing import CliRunner

from calibration.pipeline import CalibrateSpec, calibrate
from quantpipe.cli import main
from quantpipe.export import ExportSpec, export_quantized
from quantpipe.fp16_export import Fp16ExportSpec, export_fp16
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
        "--speed-bench", "--out", str(out)])
    assert r.exit_code == 0, r.output
    page = out.read_text()
    data = json.loads(out.with_suffix(".json").read_text())
    cand = data["candidates"][0]
    assert cand["verdict"]["status"] in ("pass", "warn", "fail")
    assert cand["distribution"]["kld"]["mean"] > 0
    assert cand["calibration"]["algorithm"] == "rtn"
    assert len(data["outputs"]["reference"]) == 4
    assert "<script>alert" not in page and "&lt;script&gt;alert" in page
    speed = {r["name"]: r for r in data["speed"]}
    assert speed["int4 decode"]["value"] > 0 and "FP16 reference decode" in speed
    assert data["machine"]["cpu"]
