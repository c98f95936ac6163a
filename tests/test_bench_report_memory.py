"""bench/report_memory.py on the smoke shape: the report's answering step in a child process,
its dtype choice, peak RSS and answers recorded."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_report_memory_smoke(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "report_memory.py"), "--shape",
                        "smoke", "--work", str(tmp_path), "--prompts", "2", "--new-tokens", "3",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["shape"] == "smoke" and res["dtype"] == "float32" and res["why"] == ""
    assert len(res["answer_tokens"]) == 2 and all(0 < n <= 3 for n in res["answer_tokens"])
    # the child holds the model it answers with: more than its weights, far less than 1 GiB
    # above torch's baseline for a 1 MB model
    # the shards on disk: the tensors' bytes and the safetensors headers
    assert 0 <= res["weight_bytes"] - res["weight_bytes_fp16"] < 0.01 * res["weight_bytes_fp16"]
    assert 100 < res["peak_rss_mb"] < 2000
    assert set(res["by_concurrency"]) == {"1", "8"}
