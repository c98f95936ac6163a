"""Quality of quantpipe's algorithms on one model, side by side in one run.

For each configuration: `calibrate` (128 x 512 tokens of the shipped calibration prompts by
default) and `export --bits 4` (plus `--bits 8` for the first configuration); then every
quantized model is scored against the FP16 reference on the held-out prompts (business-eval)
in ONE pass (one reference forward per window). Prints a table and saves every number.

    python bench/quality.py --fp16 work/smollm2/fp16 --work work/bench-quality \
        --configs gptq-sym,awq-sym,rtn-sym --json bench/results/quality.json

Configurations are ALGO-sym or ALGO-asym (ALGO in gptq, awq, rtn). Calibrations and exports
already finished in --work are reused (delete the folder to recompute).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from quantpipe.calibration.artifact import read_calibration
from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
from quantpipe.core.io import write_json_atomic
from quantpipe.reports.eval import EvalSpec, evaluate_many, load_eval_model, load_texts
from quantpipe.stages.export import ExportSpec, export_quantized


def calibrate_and_export(fp16: Path, work: Path, name: str, bits: list[int], args) -> dict:
    algo, sym = name.split("-")
    calib_dir = work / f"calib-{name}"
    if not (calib_dir / "quantpipe.json").is_file():
        calibrate(CalibrateSpec(
            fp16, calib_dir, algo=algo, group_size=args.group_size, sym=(sym == "sym"),
            samples=args.samples, seq_len=args.seq_len, seed=args.seed,
        ))
    m = read_calibration(calib_dir).manifest
    out = {"config": name, "calibrate_seconds": m["seconds"],
           "calibrate_peak_rss_mb": m["peak_rss_mb"], "damp_raises": m["damp_raises"],
           "models": {}}
    for b in bits:
        qdir = work / f"q{b}-{name}"
        if not (qdir / "quantpipe.json").is_file():
            exp = export_quantized(ExportSpec(calib_dir, qdir, bits=b, force=True))
            bpw = exp.plan.effective_bits()
        else:
            import json

            bpw = json.loads((qdir / "quantpipe.json").read_text())["plan"][
                "effective_bits_per_weight"]
        size = sum(p.stat().st_size for p in qdir.glob("*.safetensors"))
        out["models"][f"w{b}"] = {"path": str(qdir), "bytes": size, "bits_per_weight": bpw}
    print(f"{name}: calibrated in {m['seconds']:.0f}s (peak RSS {m['peak_rss_mb']:.0f} MB)",
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--configs", default="gptq-sym,awq-sym,rtn-sym")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", default="business-eval")
    ap.add_argument("--max-tokens", type=int, default=0, help="eval token limit (0: all)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json", type=Path, default=Path("bench/results/quality.json"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    configs = args.configs.split(",")
    results = [calibrate_and_export(args.fp16, args.work, c, [4, 8] if i == 0 else [4], args)
               for i, c in enumerate(configs)]
    texts = load_texts(args.fp16, None, args.prompts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.fp16)
    labels = [(r, k) for r in results for k in r["models"]]
    cands = [load_eval_model(r["models"][k]["path"]) for r, k in labels]
    evals = evaluate_many(load_eval_model(args.fp16), cands, tokenizer,
                          EvalSpec(args.fp16, args.fp16, texts, args.max_tokens, args.ctx),
                          names=[r["models"][k]["path"] for r, k in labels])
    print(f"\n{'model':16s} {'bpw':>6s} {'KLD mean':>9s} {'median':>8s} {'p99':>7s} "
          f"{'same-top':>8s} {'PPL':>7s}")
    for (r, k), ev in zip(labels, evals):
        r["models"][k]["eval"] = ev.to_dict()
        print(f"{r['config'] + ' ' + k.upper():16s} {r['models'][k]['bits_per_weight']:6.3f} "
              f"{ev.kld['mean']:9.5f} {ev.kld['median']:8.5f} {ev.kld['p99']:7.4f} "
              f"{100 * ev.same_top_rate:7.2f}% {ev.ppl_candidate:7.3f}")
    print(f"FP16 PPL {evals[0].ppl_reference:.3f} on {evals[0].tokens} held-out tokens")
    write_json_atomic(args.json, {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "python": platform.python_version()},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "results": results, "seconds": time.time() - t0,
    })


if __name__ == "__main__":
    main()
