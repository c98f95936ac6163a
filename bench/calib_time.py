"""Whole-calibration time of README command 1's calibrate, run back to back through the CLI,
for this checkout and for other installed quantpipe versions (e.g. the code of an earlier
commit, installed as a wheel in its own venv); prints each run's seconds and each system's
ratio to the first one's (medians), and saves JSON with the host's CPU flags.

    python bench/calib_time.py --fp16 /tmp/qp/fp16 \
        --system old:gptq:/tmp/old-venv/bin/quantpipe:/tmp/old-fp16 \
        --system new:auto --system new:gptq --rounds 2

A system is NAME:ALGO[:QUANTPIPE[:FP16_DIR]] (QUANTPIPE default: this venv's, FP16_DIR default
--fp16; an older release may need an FP16 folder exported by itself).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quantpipe.core.io import write_json_atomic

# README command 1's calibration (quantpipe run's defaults)
RUN_ARGS = ["--samples", "32", "--seq-len", "512", "--group-size", "128", "--sym"]


def cpu_info() -> dict:
    """bench/scale.py's lscpu summary (model, cores, flags), its file loaded by path: bench/ on
    sys.path could shadow packages transformers imports (bench/kernels.py once shadowed
    `kernels`)."""
    spec = importlib.util.spec_from_file_location("_bench_scale",
                                                  Path(__file__).with_name("scale.py"))
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    return scale.cpu_info()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", type=Path, required=True)
    ap.add_argument("--system", action="append", required=True,
                    help="NAME:ALGO[:QUANTPIPE[:FP16_DIR]] (repeatable; the first is the base)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", type=Path, default=Path("bench/results/calib_time.json"))
    args = ap.parse_args()
    here = str(Path(sys.executable).with_name("quantpipe"))
    systems = []
    for s in args.system:
        parts = s.split(":")
        if not 2 <= len(parts) <= 4 or not all(parts[:2]):
            ap.error(f"--system {s!r}: use NAME:ALGO[:QUANTPIPE[:FP16_DIR]], e.g. new:auto")
        name, algo, *rest = parts
        exe = rest[0] if rest and rest[0] else here
        fp16 = Path(rest[1]) if len(rest) > 1 else args.fp16
        systems.append((f"{name}-{algo}", algo, exe, fp16))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    seconds: dict[str, list[float]] = {key: [] for key, *_ in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for key, algo, exe, fp16 in systems:  # interleaved: load drifts hit all alike
                out = Path(tmp) / key
                shutil.rmtree(out, ignore_errors=True)
                cmd = [exe, "calibrate", str(fp16), "--out", str(out), "--algo", algo, *RUN_ARGS]
                t = time.perf_counter()
                run = subprocess.run(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
                seconds[key].append(time.perf_counter() - t)
                if run.returncode != 0:  # nothing is saved; say why
                    sys.exit(f"{' '.join(cmd)} failed (exit {run.returncode}):\n"
                             f"{run.stderr[-3000:]}")
                print(f"round {rnd} {key}: {seconds[key][-1]:.1f}s "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    base = systems[0][0]
    ratios = {k: med[k] / med[base] for k in med}
    for k in med:
        print(f"{k}: median {med[k]:.1f}s, {ratios[k]:.2f}x {base}")
    write_json_atomic(args.json, {
        "what": "README command 1's calibrate (" + " ".join(RUN_ARGS) + "), back to back",
        "machine": cpu_info(),
        "systems": {k: {"algo": a, "quantpipe": e, "fp16": str(f)} for k, a, e, f in systems},
        "seconds": seconds, "median_seconds": med, "ratio_to_first": ratios,
    })


if __name__ == "__main__":
    main()
