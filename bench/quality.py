"""Quality of quantpipe's algorithms on one model, side by side in one run.

For each configuration: `calibrate` (128 x 512 tokens of the shipped calibration prompts by
default) and `export --bits 4` (plus `--bits 8` for the first configuration); then every
quantized model is scored against the FP16 reference on each evaluation corpus in ONE pass
per corpus (one reference forward per window): the held-out prompts (business-eval, the same
kind of text as the calibration prompts) and text unrelated to them (sotu: 4,088 scored
tokens of State of the Union addresses, see bench/corpora.py). Prints a table per corpus and
saves every number.

    python bench/quality.py --fp16 work/smollm2/fp16 --work work/bench-quality \
        --configs gptq-sym,awq-sym,rtn-sym --json bench/results/quality.json

Configurations are ALGO-sym or ALGO-asym (ALGO: any `calibrate --algo` — gptq, gptaq, awq,
awq+gptq, rtn — or gptqrefine: GPTQ then ``calibration.refine.refine_result`` on every linear,
registered by this script only, to measure the refinement before the pipeline offers it; or
gptaqALPHA, e.g. gptaq0.5: GPTAQ with another scaling of its correction).
``--clip-grid N`` and ``--clip-sym-top on|off`` set the clip search's settings
(``calibration.grid``) for every calibration of the run; ``--clip-grid 20 --clip-sym-top off``
is the search before issue #18's measurement. Give each setting its own --work.
Configurations calibrate one after the other in the order given, so their calibration times
(``calibrate_seconds``) are comparable as ratios within one run on a quiet machine only.
Calibrations and exports already finished in --work are reused (delete the folder to
recompute); a calibration whose manifest records another clip search is an error.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from corpora import parse_corpora, score_folders  # bench/corpora.py (the script's folder)

from quantpipe.calibration.artifact import read_calibration
from quantpipe.calibration.grid import clip_search_settings
from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
from quantpipe.core.io import write_json_atomic
from quantpipe.stages.export import ExportSpec, export_quantized


def register_refined_gptq() -> None:
    """The bench-only algorithm ``gptqrefine``: calibrate's GPTQ row with every result (INT4
    and INT8) passed through least-squares scale/zero refinement on the same Hessian."""
    import dataclasses

    from quantpipe.calibration.algorithms import ALGORITHMS
    from quantpipe.calibration.refine import refine_result

    base = ALGORITHMS["gptq"]

    def quantize(spec, name, W, H, qspec, x):
        return refine_result(W, H, base.quantize(spec, name, W, H, qspec, x))

    _register("gptqrefine", dataclasses.replace(base, quantize=quantize), "gptq")


def _register(name: str, row, options_of: str) -> None:
    """Add a bench-only algorithm: its row, and the options (defaults) of ``options_of``."""
    from quantpipe.calibration.algorithms import ALGORITHMS
    from quantpipe.calibration.config import ALGO_OPTIONS

    ALGORITHMS[name] = row
    ALGO_OPTIONS[name] = ALGO_OPTIONS[options_of]


def register_gptaq_alphas(configs: list[str]) -> None:
    """Bench-only ``gptaq<ALPHA>`` algorithms (e.g. ``gptaq0.5-sym``): calibrate's GPTAQ row
    with another scaling of the asymmetric correction than the default
    (``calibration.gptq.GPTAQ_ALPHA``)."""
    import dataclasses
    import functools
    import re

    from quantpipe.calibration import block_step
    from quantpipe.calibration.algorithms import ALGORITHMS

    for config in configs:
        algo = config.split("-")[0]
        m = re.fullmatch(r"gptaq(\d*\.?\d+)", algo)
        if m:
            _register(algo, dataclasses.replace(
                ALGORITHMS["gptaq"],
                quantize=functools.partial(block_step.quantize_gptaq, alpha=float(m[1]))),
                "gptaq")


def set_clip_search(steps: int | None, sym_top: str | None) -> tuple[int, str]:
    """Set the clip search's settings for this process (None: leave the library's); returns
    the settings in effect. ValueError for steps below 1 (before anything is calibrated)."""
    from quantpipe.calibration import grid

    if steps is not None and steps < 1:
        raise ValueError(f"--clip-grid {steps}: the clip search needs at least 1 step")
    if steps is not None:
        grid.CLIP_GRID = steps
    if sym_top is not None:
        grid.CLIP_SYM_TOP_CODE = sym_top == "on"
    return grid.CLIP_GRID, "on" if grid.CLIP_SYM_TOP_CODE else "off"


def calibrate_and_export(fp16: Path, work: Path, name: str, bits: list[int], args) -> dict:
    algo, sym = name.split("-")
    calib_dir = work / f"calib-{name}"
    if not (calib_dir / "quantpipe.json").is_file():
        calibrate(CalibrateSpec(
            fp16, calib_dir, algo=algo, group_size=args.group_size, sym=(sym == "sym"),
            samples=args.samples, seq_len=args.seq_len, seed=args.seed,
            int8_group_size=args.int8_group_size,
        ))
    m = read_calibration(calib_dir).manifest
    if m.get("clip_search") != clip_search_settings():
        raise SystemExit(
            f"{calib_dir} was calibrated with the clip search {m.get('clip_search')} (None: "
            f"before the manifest recorded it), this run's is {clip_search_settings()}: give "
            "each setting its own --work")
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
    ap.add_argument("--int8-group-size", type=int, default=CalibrateSpec.int8_group_size,
                    help="calibrate --int8-group-size (the W8 candidate's groups; -1: per "
                         "channel)")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpora", default="business-eval,sotu",
                    help="evaluation texts, comma list (bench/corpora.py)")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="business-eval token limit (0: all; sotu is always 8 windows)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--no-w8", action="store_true",
                    help="skip the first configuration's W8 export and eval")
    ap.add_argument("--clip-grid", type=int, default=None,
                    help="the clip search's steps (default: calibration.grid.CLIP_GRID)")
    ap.add_argument("--clip-sym-top", choices=("on", "off"), default=None,
                    help="the symmetric clip search's top-code candidate (default: on)")
    ap.add_argument("--json", type=Path, default=Path("bench/results/quality.json"))
    args = ap.parse_args()
    try:  # the settings in effect, recorded in the JSON
        args.clip_grid, args.clip_sym_top = set_clip_search(args.clip_grid, args.clip_sym_top)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        corpora = parse_corpora(args.corpora)
    except ValueError as exc:
        ap.error(str(exc))
    args.work.mkdir(parents=True, exist_ok=True)
    register_refined_gptq()
    t0 = time.time()
    configs = args.configs.split(",")
    register_gptaq_alphas(configs)
    results = [calibrate_and_export(args.fp16, args.work, c,
                                    [4, 8] if i == 0 and not args.no_w8 else [4], args)
               for i, c in enumerate(configs)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.fp16, trust_remote_code=False)
    labels = [(r, k) for r in results for k in r["models"]]
    paths = [r["models"][k]["path"] for r, k in labels]
    scored = score_folders(args.fp16, tokenizer, {p: p for p in paths}, corpora,
                           args.max_tokens, args.ctx)
    for corpus in corpora:
        evals = [scored[corpus][p] for p in paths]
        print(f"\n{corpus}: {'model':16s} {'bpw':>6s} {'KLD mean':>9s} {'median':>8s} "
              f"{'p99':>7s} {'same-top':>8s} {'PPL':>7s}")
        for (r, k), ev in zip(labels, evals):
            r["models"][k].setdefault("eval", {})[corpus] = ev.to_dict()
            print(f"{corpus}: {r['config'] + ' ' + k.upper():16s} "
                  f"{r['models'][k]['bits_per_weight']:6.3f} {ev.kld['mean']:9.5f} "
                  f"{ev.kld['median']:8.5f} {ev.kld['p99']:7.4f} "
                  f"{100 * ev.same_top_rate:7.2f}% {ev.ppl_candidate:7.3f}")
        print(f"{corpus}: FP16 PPL {evals[0].ppl_reference:.3f} on {evals[0].tokens} tokens")
    write_json_atomic(args.json, {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "python": platform.python_version()},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "results": results, "seconds": time.time() - t0,
    })


if __name__ == "__main__":
    main()
