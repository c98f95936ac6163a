"""Speed records from every benchmark's JSON (the files under bench/results are real outputs)."""

import json
from pathlib import Path

import pytest

from quantpipe.reports.speed import read_speed_file

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_decode_kernels_and_serve_files_are_read():
    decode = read_speed_file(RESULTS / "decode-cpu.json")
    assert any(r.metric == "decode tokens_per_s" and r.unit == "tok/s" for r in decode)
    kernels = read_speed_file(RESULTS / "kernels-cpu-quick.json")
    assert all(r.unit == "us" and r.value > 0 for r in kernels)
    serve = read_speed_file(RESULTS / "serving_cpu_smollm2_fp16_concurrency.json")
    ttft = [r for r in serve if r.metric == "ttft_ms"]
    assert ttft and {"p50", "p95", "p99"} <= set(ttft[0].extra)


def test_values_are_converted_not_invented(tmp_path):
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({"device": "cpu", "results": {
        "runtime_int4": {"decode_tokens_per_s": 12.5, "prefill_s": 0.25}}}))
    recs = {r.metric: r for r in read_speed_file(path)}
    assert recs["decode tokens_per_s"].value == 12.5
    assert recs["prefill_ms"].value == 250.0


def test_unknown_file_is_a_clear_error(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a speed result"):
        read_speed_file(path)
