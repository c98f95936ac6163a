"""What the menu of formats buys: plans over INT4 g32/g64/g128 (sym, asym), INT8 and FP16
against uniform INT4 at the same size, on text nothing was tuned on (issue #30).

Given a calibration made with ``calibrate --menu`` (e.g. ``--menu default``), this script
1. measures its sensitivity into WORK/sensitivity.json (reused when present; ``quantpipe
   sensitivity`` defaults, with ``--sens-entries``: every menu entry measured like INT4 by
   default): per layer on one half of the calibration prompts, the menu-aware upgrade path
   validated on the other half; ``--oracle`` measures on sotu and validates on sotu-dev
   instead (the text the plans are scored on: the bound no measurement can beat);
2. checks the rule the planner uses for unmeasured menu entries (a layer's KLD scales with its
   calibration loss) where both sides are known: INT8's and each measured entry's KLD against
   INT4's scaled by loss(entry) / loss(INT4), per layer;
3. exports and scores against FP16 on sotu (8 x 511 tokens) and the first ``--max-tokens``
   of business-eval: uniform INT4 (the calibrated spec: g128, or g64 where 128 does not
   divide), uniform INT4 g32 (``--uniform``: any menu entries), uniform INT8, and plans at
   ``--budgets`` (``same`` = the bits of uniform INT4) with the menu, and the same budgets
   planned with INT4 / INT8 / FP16 only
   (the previous planner, unvalidated: an override per layer);
   ``--damage proxy`` skips step 1 and 2: every plan minimises the layers' calibration losses
   (``quantpipe plan --damage proxy``), for models whose sensitivity takes hours;
4. prints the KLD ratio of each plan to uniform INT4 and the entries chosen per layer type,
   and writes everything to ``--json``.

    python bench/mixed_precision_menu.py --fp16 /tmp/menu/fp16 --calib /tmp/menu/calib \
        --work /tmp/menu/work --json bench/results/mixed_precision_menu_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import re
import subprocess
import time
from pathlib import Path

import torch
from corpora import parse_corpora, score_results  # bench/corpora.py (the script's folder)
from mixed_precision import corpus_ids, oracle_calibration  # bench/mixed_precision.py

from quantpipe.calibration.artifact import read_calibration
from quantpipe.calibration.mixed_precision.budget import (
    greedy_budget_plan,
    layer_specs,
    primary_entries,
)
from quantpipe.calibration.mixed_precision.plan import PlanSpec, damage_table, make_plan
from quantpipe.calibration.mixed_precision.sensitivity import SensitivitySpec, measure_sensitivity
from quantpipe.core.io import write_json_atomic
from quantpipe.stages.export import ExportSpec, export_quantized


def spearman(a: list[float], b: list[float]) -> float:
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def scaling_check(infos: dict, layers: dict) -> dict:
    """INT8's measured KLD vs INT4's scaled by the loss ratio (the menu-entry rule)."""
    meas, pred = [], []
    for n, info in infos.items():
        l4, l8 = float(info["w4"]["loss"]), float(info["w8"]["loss"])
        if l4 > 0 and layers[n]["kld_w8"] > 0:
            meas.append(layers[n]["kld_w8"])
            pred.append(layers[n]["kld_w4"] * l8 / l4)
    logr = sorted(math.log10(p / m) for p, m in zip(pred, meas))
    q = lambda f: logr[min(len(logr) - 1, int(f * len(logr)))]  # noqa: E731
    return {"layers": len(meas), "spearman": spearman(pred, meas),
            "log10_pred_over_measured": {"p10": q(0.1), "p50": q(0.5), "p90": q(0.9)},
            "sum_pred_over_sum_measured": sum(pred) / sum(meas)}


def entry_check(infos: dict, layers: dict) -> dict[str, dict]:
    """Per menu entry measured directly: its KLD against the rule's prediction, INT4's KLD
    scaled by loss(entry) / loss(INT4)."""
    out = {}
    tags = sorted({k[4:] for v in layers.values() for k in v
                   if k.startswith("kld_") and k not in ("kld_w4", "kld_w8")})
    for tag in tags:
        meas, pred = [], []
        for n, v in layers.items():
            if f"kld_{tag}" in v and float(infos[n]["w4"]["loss"]) > 0:
                meas.append(v[f"kld_{tag}"])
                pred.append(v["kld_w4"] * float(infos[n][tag]["loss"])
                            / float(infos[n]["w4"]["loss"]))
        logr = sorted(math.log10(max(p, 1e-30) / max(m, 1e-30)) for p, m in zip(pred, meas))
        out[tag] = {"layers": len(meas), "spearman": spearman(pred, meas),
                    "log10_pred_over_measured_p50": logr[len(logr) // 2],
                    "sum_pred_over_sum_measured": sum(pred) / max(sum(meas), 1e-30),
                    "sum_measured_over_sum_w4": sum(meas) / sum(
                        layers[n]["kld_w4"] for n, v in layers.items() if f"kld_{tag}" in v)}
    return out


def layer_type(name: str) -> str:
    return re.sub(r"^.*\.\d+\.", "", name)


def allocation(bits: dict, specs_of: dict) -> dict[str, dict[str, int]]:
    """layer type -> entry label -> layers."""
    out: dict[str, dict[str, int]] = {}
    for n, e in bits.items():
        spec = specs_of[n][e]
        label = "fp16" if spec is None else spec.label()
        row = out.setdefault(layer_type(n), {})
        row[label] = row.get(label, 0) + 1
    return out


def legacy_plan(calib, budget: float, sens_path: Path, damage_kind: str = "auto") -> dict:
    """The budget plan with INT4 / INT8 / FP16 only (no menu entries), unvalidated."""
    infos = calib.layer_infos()
    names = list(infos)
    shapes = {n: tuple(infos[n]["w4"]["shape"]) for n in names}
    specs = primary_entries(layer_specs(infos))
    damage, _ = damage_table(calib, PlanSpec(budget_bits=budget, sensitivity=sens_path,
                                             damage=damage_kind))
    return greedy_budget_plan(names, shapes, specs, damage, {}, budget)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True, help="CALIB_DIR made with --menu.")
    ap.add_argument("--work", type=Path, required=True, help="Exports go here.")
    ap.add_argument("--budgets", default="same,4.25,4.5,4.75,5.0,5.5,6.0")
    ap.add_argument("--oracle", action="store_true",
                    help="Measure sensitivity on sotu, validate on sotu-dev (an upper bound).")
    ap.add_argument("--sens-entries", default="all",
                    help="Menu entries the sensitivity measures directly ('all', a comma "
                         "list, or 'none': the planner's loss-ratio rule for all of them).")
    ap.add_argument("--uniform", default="w4g32",
                    help="Menu entries also scored as uniform settings (every layer), beside "
                         "uniform INT4 and INT8: a comma list, e.g. w4g32,w5g64,w6g64.")
    ap.add_argument("--sens-tokens", type=int, default=1024)
    ap.add_argument("--damage", choices=("kld", "proxy"), default="kld",
                    help="What the plans minimise: kld (measure sensitivity first) or proxy "
                         "(each layer's calibration loss, no measurement: `plan --damage "
                         "proxy`, for models whose sensitivity takes hours here).")
    ap.add_argument("--no-legacy", action="store_true",
                    help="Skip the plans with INT4 / INT8 / FP16 only (one export and score "
                         "fewer per budget).")
    ap.add_argument("--corpora", default="sotu,business-eval")
    ap.add_argument("--max-tokens", type=int, default=4096,
                    help="Scored business-eval tokens (0: all); sotu is always 8 x 511.")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json", type=Path, default=Path("bench/results/mixed_precision_menu.json"))
    args = ap.parse_args()
    corpora = parse_corpora(args.corpora)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_grad_enabled(False)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.fp16, trust_remote_code=False)
    ids = {}
    if args.oracle:
        args.calib = oracle_calibration(args.calib, args.work)
    entries = {"all": ("all",), "none": ()}.get(args.sens_entries,
                                                tuple(args.sens_entries.split(",")))
    sens_path = args.work / f"sensitivity{'-oracle' if args.oracle else ''}.json"
    spec = SensitivitySpec(args.calib, tokens=args.sens_tokens, entries=entries, out=sens_path)
    if args.oracle:
        ids = {"input_ids": corpus_ids(tok, args.fp16, "sotu", spec.tokens, spec.seq_len),
               "validate_ids": corpus_ids(tok, args.fp16, "sotu-dev", spec.validate_tokens,
                                          spec.seq_len)}
    sens = measure_sensitivity(spec, **ids) if args.damage == "kld" else None
    calib = read_calibration(args.calib)
    infos = calib.layer_infos()
    specs_of = layer_specs(infos)
    check, per_entry = None, {}
    if sens is None:
        sens_path = None  # the plans read no measurement (PlanSpec.damage "proxy")
    else:
        check = scaling_check(infos, sens.data["layers"])
        print("menu-entry rule on INT8:", json.dumps(check), flush=True)
        per_entry = entry_check(infos, sens.data["layers"])
        for tag, row in per_entry.items():
            print(f"menu-entry rule on {tag}: {json.dumps(row)}", flush=True)

    uniform = make_plan(calib, PlanSpec(bits=4, sensitivity=sens_path, damage=args.damage))
    configs: dict[str, dict] = {
        "uniform-w4": {"bits": 4},
        **{f"uniform-{t}": {"overrides": (f"re:.*={t}",)} for t in args.uniform.split(",") if t},
        "uniform-w8": {"bits": 8},
    }
    for b in args.budgets.split(","):
        budget = uniform.effective_bits() + 1e-9 if b == "same" else float(b)
        configs[f"menu-{b}"] = {"budget_bits": budget}
        if args.no_legacy:
            continue
        legacy = legacy_plan(calib, budget, sens_path, args.damage)
        configs[f"int4-8-16-{b}"] = {"overrides": tuple(
            f"{n}={'fp16' if e is None else e}" for n, e in legacy.items())}
    results = {}
    for name, cfg in configs.items():
        qdir = args.work / f"q-{name}"
        exp = export_quantized(ExportSpec(args.calib, qdir, bits=cfg.get("bits", 4),
                                          budget_bits=cfg.get("budget_bits"),
                                          overrides=cfg.get("overrides", ()),
                                          sensitivity=sens_path, damage=args.damage,
                                          force=True))
        results[name] = {
            "budget_bits": cfg.get("budget_bits"),
            "path": str(qdir),
            "effective_bits_per_weight": exp.plan.effective_bits(),
            "entries": exp.plan.entries(),
            "by_layer_type": allocation(exp.plan.bits, specs_of),
            "bytes": exp.bytes_on_disk,
            "predicted_damage": exp.plan.predicted_damage,
            "validated_damage": exp.plan.validated_damage,
            "validation": exp.plan.validation,
            "eval": {},
        }
        print(f"{name:18s} {exp.plan.effective_bits():.4f} bpw  {exp.plan.entries()}  "
              f"{exp.plan.validation}", flush=True)
    kld = score_results(args.fp16, tok, results, corpora, args.max_tokens, args.ctx)
    ratios = {c: {k: v / kld[c]["uniform-w4"] for k, v in kld[c].items()} for c in corpora}
    for name, r in results.items():
        print(f"{name:18s} {r['effective_bits_per_weight']:.4f} bpw  " + "  ".join(
            f"{c} KLD {kld[c][name]:.5f} ({ratios[c][name]:.3f}x)" for c in corpora), flush=True)
    targets = {c: {"same_size_le_0.8x": ratios[c].get("menu-same", math.inf) <= 0.8,
                   "4.5_le_0.55x": ratios[c].get("menu-4.5", math.inf) <= 0.55,
                   "5.0_le_0.35x": ratios[c].get("menu-5.0", math.inf) <= 0.35}
               for c in corpora}
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    summary = {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "flags": next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                                   if ln.startswith("Flags")), ""),
                    "torch": torch.__version__},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "calibration": {"path": str(args.calib), "algo": calib.manifest["algo"],
                        "int4": calib.manifest["int4"],
                        "menu": calib.manifest["settings"].get("menu"),
                        "samples": calib.manifest["settings"]["samples"],
                        "seconds": calib.manifest.get("seconds")},
        "sensitivity": None if sens is None else {
            k: sens.data.get(k) for k in ("settings", "tokens_scored", "seconds", "spearman",
                                          "validation")},
        "menu_rule_on_int8": check,
        "menu_rule_per_entry": per_entry,
        "results": results,
        "kld_mean": kld,
        "kld_ratio_to_uniform_w4": ratios,
        "targets": targets,
        "seconds": time.time() - t0,
    }
    write_json_atomic(args.json, summary)
    print(json.dumps({"ratios": ratios, "targets": targets}, indent=1))


if __name__ == "__main__":
    main()
