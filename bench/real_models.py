"""Every stage on a packaged real model, each as its own `quantpipe` process: seconds and peak RSS.

    python bench/real_models.py gemma-3-270m --work /tmp/qp-real \
        --json bench/results/real_models_gemma-3-270m.json

SOURCE is a packaged source (``quantpipe/core/packaged.py``: ``gemma-3-270m``,
``qwen2.5-coder-1.5b``) or any source ``export-fp16`` takes. The stages, in order:

``export-fp16`` -> ``calibrate`` with each ``--algos`` entry (``auto`` is the CLI default) ->
``sensitivity`` + ``plan --budget-bits`` on the first algorithm's calibration -> ``export`` of it
in the native, GPTQ and compressed-tensors formats (W4) and as a ``--budget-bits`` plan ->
``verify`` of each export -> ``generate`` (32 greedy tokens) -> ``serve`` (start, ``/health``,
one completion, stop) -> ``eval`` (KLD on the held-out prompts) -> ``report``
-> finally ``quantpipe run`` on the same source in a fresh WORKDIR (the whole pipeline in one
process).

Peak RSS is the stage process's own ``VmHWM`` (bench/scale.py's ``run_stage``), which counts
mmapped shards it touched. Every command line is recorded; the JSON is rewritten after each
stage, so a long run keeps what it has. Seconds are only comparable on an idle machine: the
JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from quantpipe.core.io import write_json_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import _PEAK_WRAPPER, _vmhwm_kb, cpu_info, run_stage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def _get(url: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def serve_stage(qdir: Path, log_path: Path, port: int, timeout_s: float = 900.0) -> dict:
    """`quantpipe serve QDIR`: seconds until /health answers, one chat completion, then SIGINT;
    peak RSS polled while it runs (and written by the process at exit)."""
    peak_file = log_path.with_suffix(".peak")
    peak_file.unlink(missing_ok=True)
    args = ["serve", str(qdir), "--port", str(port)]
    cmd = [sys.executable, "-c", _PEAK_WRAPPER, str(peak_file), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    base = f"http://127.0.0.1:{port}"
    rec: dict = {"cmd": " ".join(["quantpipe", *args])}
    t0 = time.perf_counter()
    sampled_kb = 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None and time.perf_counter() - t0 < timeout_s:
                sampled_kb = max(sampled_kb, _vmhwm_kb(proc.pid))
                try:
                    _get(base + "/health", timeout=2)
                    break
                except OSError:
                    time.sleep(0.5)
            rec["seconds_to_health"] = round(time.perf_counter() - t0, 2)
            model = _get(base + "/v1/models")["data"][0]["id"]
            t1 = time.perf_counter()
            out = _get(base + "/v1/completions", {  # a base model has no chat template
                "model": model, "max_tokens": 32, "temperature": 0, "prompt": PROMPT})
            rec["completion_seconds"] = round(time.perf_counter() - t1, 2)
            rec["completion"] = out["choices"][0]["text"]
            rec["rc"] = 0
        except (OSError, KeyError, ValueError) as exc:
            rec["rc"], rec["error"] = 1, f"{type(exc).__name__}: {exc}"
        finally:
            sampled_kb = max(sampled_kb, _vmhwm_kb(proc.pid))
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    peak_kb = int(peak_file.read_text()) if peak_file.is_file() else sampled_kb
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    rec["peak_rss_mb"] = round(max(peak_kb, sampled_kb) / 1024, 1)
    print(f"  serve        rc={rec['rc']} {rec['seconds_to_health']:8.1f}s to /health, peak RSS "
          f"{rec['peak_rss_mb']:8.0f} MB" + (f"  {rec.get('error', '')}" if rec["rc"] else ""),
          flush=True)
    return rec


def run_stage_lines(log_path: Path) -> dict[str, dict]:
    """`quantpipe run`'s own per-stage record from its "stages: ..." line: {stage: {seconds,
    peak_rss_mib}} (the peak is the process's high-water mark over that stage alone)."""
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    line = next((x for x in text.splitlines() if x.startswith("stages: ")), "")
    out = {}
    for m in re.finditer(r"([^,:]+?) (\d+)s(?: \(peak RSS ([\d,]+) MiB\))?(?:,|$)",
                         line.removeprefix("stages: ")):
        out[m.group(1).strip()] = {
            "seconds": int(m.group(2)),
            "peak_rss_mib": int(m.group(3).replace(",", "")) if m.group(3) else None}
    return out


def stage_plan(source: str, work: Path, algos: list[str], samples: int,
               budget: float, eval_tokens: int) -> list[tuple[str, list[str]]]:
    """(name, quantpipe argv) of every stage, in order; later stages read earlier outputs."""
    fp16, calib = work / "fp16", work / f"calib-{algos[0]}"
    q = {fmt: work / f"w4-{fmt}" for fmt in ("native", "gptq", "compressed-tensors")}
    plan_dir = work / f"plan-{budget}"
    stages = [("export-fp16", ["export-fp16", source, "--out", str(fp16)])]
    for algo in algos:
        stages.append((f"calibrate-{algo}", [
            "calibrate", str(fp16), "--out", str(work / f"calib-{algo}"), "--algo", algo,
            "--samples", str(samples)]))
    stages += [
        ("sensitivity", ["sensitivity", str(calib)]),
        ("plan", ["plan", str(calib), "--budget-bits", str(budget)]),
    ]
    for fmt, qdir in q.items():
        stages.append((f"export-{fmt}", ["export", str(calib), "--bits", "4", "--format", fmt,
                                         "--out", str(qdir)]))
    stages.append(("export-plan", ["export", str(calib), "--budget-bits", str(budget),
                                   "--out", str(plan_dir)]))
    for name, qdir in [*q.items(), ("plan", plan_dir)]:
        stages.append((f"verify-{name}", ["verify", str(qdir)]))
    stages += [
        ("generate", ["generate", str(q["native"]), "--prompt", PROMPT,
                      "--max-new-tokens", "32"]),
        ("serve", []),  # serve_stage
        ("eval", ["eval", "--reference", str(fp16), "--candidate", str(q["native"]),
                  "--prompts", "business-eval", "--max-tokens", str(eval_tokens),
                  "--json", str(work / "eval.json")]),
        ("report", ["report", "--reference", str(fp16), "--candidate", str(q["native"]),
                    "--out", str(work / "report.html")]),
        ("run", ["run", source, "--out", str(work / "run")]),
    ]
    return stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qp-real"))
    ap.add_argument("--algos", default="auto,gptq,awq,rtn",
                    help="comma-separated calibrate --algo values; the first feeds the rest")
    ap.add_argument("--samples", type=int, default=32,
                    help="calibration sequences (32: quantpipe run's default)")
    ap.add_argument("--budget-bits", type=float, default=4.5)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--skip", default="", help="comma-separated stage names to leave out")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    algos = [a for a in args.algos.split(",") if a]
    work = args.work / args.source.replace("/", "_")
    work.mkdir(parents=True, exist_ok=True)
    out_json = args.json or ROOT / "bench" / "results" / f"real_models_{work.name}.json"
    skip = {s for s in args.skip.split(",") if s}
    res = {"source": args.source, "cpu": cpu_info(), "torch": torch.__version__,
           "samples": args.samples, "loadavg_before": os.getloadavg(), "stages": {}}
    for name, argv in stage_plan(args.source, work, algos, args.samples, args.budget_bits,
                                 args.eval_tokens):
        if name in skip:
            continue
        print(f"[{name}]", flush=True)
        if name == "serve":
            rec = serve_stage(work / "w4-native", work / "serve.log", args.port)
        else:
            rec = run_stage(argv, work / f"{name}.log")
        if name == "run":
            rec["run_stages"] = run_stage_lines(work / "run.log")
        res["stages"][name] = rec
        res["loadavg_after"] = os.getloadavg()
        write_json_atomic(out_json, res)
    failed = [n for n, r in res["stages"].items() if r.get("rc")]
    print(f"wrote {out_json}" + (f"; failed: {failed}" if failed else "; every stage rc 0"))


if __name__ == "__main__":
    main()
