"""Block-by-block sensitivity against the whole-model measurement, and the plans each buys.

`quantpipe sensitivity` measures each layer's end-to-end KLD with the whole FP model in memory
(exact leave-one-in); for models that do not fit it runs block by block
(calibration/mixed_precision/sensitivity_stream.py: the change of the layer's block output
times the block's measured gain). This script measures both on one calibration, on the same
tokens (no validation split, so both plans are unvalidated greedy plans), and reports:

1. agreement per precision: Spearman rank correlation of the per-layer KLDs, the spread of
   log10(stream / whole), and the overlap of the 10% most sensitive layers;
2. the plans each buys at ``--budgets``, exported and scored against FP16 on text neither
   measurement saw (sotu, 8 x 511 tokens; business-eval), next to uniform INT4;
3. the seconds of each measurement (``--no-whole`` skips the whole-model one: for models
   that do not fit).

    python bench/sensitivity_stream.py --fp16 /tmp/w8/fp16 --calib /tmp/m56/calib \
        --work /tmp/ss --json bench/results/sensitivity_stream_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import subprocess
from pathlib import Path

import torch
from corpora import parse_corpora, score_results  # bench/corpora.py (the script's folder)

from quantpipe.calibration.mixed_precision.sensitivity import (
    SensitivitySpec,
    measure_sensitivity,
    spearman,
)
from quantpipe.core.io import write_json_atomic
from quantpipe.stages.export import ExportSpec, export_quantized

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--fp16", type=Path, required=True)
ap.add_argument("--calib", type=Path, required=True)
ap.add_argument("--work", type=Path, required=True, help="Measurements and exports go here.")
ap.add_argument("--budgets", default="4.25,4.5,5.0")
ap.add_argument("--tokens", type=int, default=1024, help="Measured tokens (both methods).")
ap.add_argument("--probe-tokens", type=int, default=512)
ap.add_argument("--corpora", default="sotu,business-eval")
ap.add_argument("--max-tokens", type=int, default=4096)
ap.add_argument("--ctx", type=int, default=512)
ap.add_argument("--json", type=Path, default=Path("bench/results/sensitivity_stream.json"))


def agreement(whole: dict, stream: dict) -> dict[str, dict]:
    """Per measured tag: rank correlation, log10(stream / whole) quantiles, top-10% overlap."""
    out = {}
    names = list(whole)
    tags = [k[4:] for k in whole[names[0]] if k.startswith("kld_")]
    for tag in tags:
        w = [whole[n][f"kld_{tag}"] for n in names]
        s = [stream[n][f"kld_{tag}"] for n in names]
        logr = sorted(math.log10(max(b, 1e-30) / max(a, 1e-30)) for a, b in zip(w, s))
        k = max(1, len(names) // 10)
        top_w = set(sorted(names, key=lambda n: -whole[n][f"kld_{tag}"])[:k])
        top_s = set(sorted(names, key=lambda n: -stream[n][f"kld_{tag}"])[:k])
        q = lambda f: logr[min(len(logr) - 1, int(f * len(logr)))]  # noqa: E731
        out[tag] = {"layers": len(names), "spearman": spearman(w, s),
                    "log10_stream_over_whole": {"p10": q(0.1), "p50": q(0.5), "p90": q(0.9)},
                    "sum_stream_over_sum_whole": sum(s) / sum(w),
                    f"top_{k}_overlap": len(top_w & top_s)}
    return out


def main() -> None:
    args = ap.parse_args()
    corpora = parse_corpora(args.corpora)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_grad_enabled(False)
    args.work.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.fp16, trust_remote_code=False)
    sens = {}
    for method, stream in (("whole", False), ("stream", True)):
        spec = SensitivitySpec(args.calib, tokens=args.tokens, validate_tokens=0,
                               stream=stream, probe_tokens=args.probe_tokens,
                               out=args.work / f"sensitivity-{method}.json")
        res = measure_sensitivity(spec)
        sens[method] = (spec.path, res.data)
        print(f"{method}: {res.data['seconds']:.0f} s{' (reused)' if res.reused else ''}",
              flush=True)
    agree = agreement(sens["whole"][1]["layers"], sens["stream"][1]["layers"])
    print(json.dumps(agree, indent=1), flush=True)

    configs = {"uniform-w4": {"bits": 4}}
    for b in args.budgets.split(","):
        for method in sens:
            configs[f"{method}-{b}"] = {"budget_bits": float(b), "sensitivity": sens[method][0]}
    results = {}
    for name, cfg in configs.items():
        qdir = args.work / f"q-{name}"
        exp = export_quantized(ExportSpec(args.calib, qdir, bits=cfg.get("bits", 4),
                                          budget_bits=cfg.get("budget_bits"),
                                          sensitivity=cfg.get("sensitivity",
                                                              sens["whole"][0]),
                                          force=True))
        results[name] = {"path": str(qdir), "effective_bits_per_weight":
                         exp.plan.effective_bits(), "entries": exp.plan.entries(),
                         "predicted_damage": exp.plan.predicted_damage, "eval": {}}
    kld = score_results(args.fp16, tok, results, corpora, args.max_tokens, args.ctx)
    for name, r in results.items():
        print(f"{name:14s} {r['effective_bits_per_weight']:.4f} bpw  " + "  ".join(
            f"{c} KLD {kld[c][name]:.5f} ({kld[c][name] / kld[c]['uniform-w4']:.3f}x)"
            for c in corpora), flush=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    write_json_atomic(args.json, {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "flags": next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                                   if ln.startswith("Flags")), ""),
                    "loadavg": list(os.getloadavg())},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "seconds": {m: d["seconds"] for m, (_, d) in sens.items()},
        "gains": sens["stream"][1].get("gains"),
        "agreement": agree,
        "results": results,
        "kld_mean": kld,
    })


if __name__ == "__main__":
    main()
