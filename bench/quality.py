"""Quality of quantpipe's algorithms on one model, side by side in one run.

For each configuration: `calibrate` (128 x 512 tokens of the shipped calibration prompts by
default), `export --bits 4` (and `--bits 8` once), then `eval` on the held-out prompts
(business-eval) against the FP16 reference. Prints a table of mean KLD and saves every number.

    python bench/quality.py --fp16 work/smollm2/fp16 --work work/bench-quality \
        --configs gptq-sym,awq-sym,rtn-sym --json bench/results/quality.json

Configurations are ALGO-sym or ALGO-asym (ALGO in gptq, awq, rtn). Calibrations already
finished in --work are reused (delete the folder to recompute).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from calibration.artifact import read_calibration
from calibration.pipeline import CalibrateSpec, calibrate
from quantpipe.export import ExportSpec, export_quantized
from quantpipe.io import write_json_atomic
from reports.eval import EvalSpec, load_texts, run_eval


def run_config(fp16: Path, work: Path, name: str, args, texts) -> dict:
    algo, sym = name.split("-")
    calib_dir = work / f"calib-{name}"
    if not (calib_dir / "quantpipe.json").is_file():
        res = calibrate(CalibrateSpec(
            fp16, calib_dir, algo=algo, group_size=args.group_size, sym=(sym == "sym"),
            samples=args.samples, seq_len=args.seq_len, seed=args.seed,
        ))
        calib_seconds, peak = res.seconds, res.peak_rss_mb
    else:
        m = read_calibration(calib_dir).manifest
        calib_seconds, peak = m["seconds"], m["peak_rss_mb"]
    out = {"config": name, "calibrate_seconds": calib_seconds, "calibrate_peak_rss_mb": peak}
    for bits in args.bits:
        qdir = work / f"q{bits}-{name}"
        exp = export_quantized(ExportSpec(calib_dir, qdir, bits=bits, force=True))
        ev = run_eval(EvalSpec(fp16, qdir, texts, args.max_tokens, args.ctx))
        out[f"w{bits}"] = {"eval": ev.to_dict(), "bytes": exp.bytes_on_disk,
                          "bits_per_weight": exp.plan.effective_bits()}
        print(f"{name:10s} W{bits}: KLD mean {ev.kld['mean']:.5f}  p99 {ev.kld['p99']:.4f}  "
              f"same-top {100 * ev.same_top_rate:.2f}%  PPL {ev.ppl_candidate:.3f} "
              f"(FP16 {ev.ppl_reference:.3f})  calib {calib_seconds:.0f}s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--configs", default="gptq-sym,awq-sym,rtn-sym")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", default="business-eval")
    ap.add_argument("--max-tokens", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json", type=Path, default=Path("bench/results/quality.json"))
    args = ap.parse_args()
    args.bits = [int(b) for b in args.bits.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    texts = load_texts(args.fp16, None, args.prompts)
    t0 = time.time()
    results = []
    for config in args.configs.split(","):
        results.append(run_config(args.fp16, args.work, config, args, texts))
        # saved after every configuration: a long run that is stopped keeps what it measured
        write_json_atomic(args.json, {
            "machine": {"cpu": platform.processor() or platform.machine(),
                        "python": platform.python_version()},
            "settings": {k: str(v) for k, v in vars(args).items()},
            "results": results, "seconds": time.time() - t0,
        })
    print(json.dumps({r["config"]: {k: v["eval"]["kld"]["mean"] for k, v in r.items()
                                    if k.startswith("w")} for r in results}, indent=1))


if __name__ == "__main__":
    main()
