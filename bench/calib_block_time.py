"""Calibration time of one decoder block, algorithms interleaved in one process.

Runs calibrate's stages 4a-4e (``pipeline.calibrate_block``) on one block of an FP16 folder,
its inputs the embedded calibration tokens, for each algorithm in turn, ``--reps`` times
interleaved, so a loaded machine slows every algorithm alike; prints and saves the seconds and
each algorithm's ratio to the first one's (medians).

    python bench/calib_block_time.py --fp16 work/smollm2/fp16 --algos gptq,gptaq \
        --json bench/results/calib_block_time.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

from quantpipe.blocks.activations import Activations, ActivationSpace
from quantpipe.blocks.execute import embed_inputs
from quantpipe.blocks.stream import ModelStream
from quantpipe.calibration import pipeline as p
from quantpipe.calibration import resume
from quantpipe.core.families import family_for
from quantpipe.core.io import write_json_atomic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", type=Path, required=True)
    ap.add_argument("--algos", default="gptq,gptaq")
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--sym", action="store_true")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json", type=Path, default=Path("bench/results/calib_block_time.json"))
    args = ap.parse_args()
    algos = args.algos.split(",")

    def spec(algo: str) -> p.CalibrateSpec:
        return p.CalibrateSpec(args.fp16, Path(tempfile.gettempdir()) / "unused", algo=algo,
                               group_size=args.group_size, sym=args.sym,
                               samples=args.samples, seq_len=args.seq_len).resolved()

    inputs = resume.check_inputs(spec(algos[0]))
    stream = ModelStream(args.fp16)
    model = stream.model
    family = family_for(model.config.model_type)
    with stream.load(stream.embeddings_name):
        hidden, ctx = embed_inputs(model, inputs.input_ids)  # [n, L, d]
    seconds: dict[str, list[float]] = {a: [] for a in algos}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for algo in algos:
                work = Path(tmp) / f"{algo}-{rep}"
                (work / "blocks").mkdir(parents=True)
                keys = ("hidden", "hidden_fp") if p.ALGORITHMS[algo].asymmetric else ("hidden",)
                hiddens = {k: Activations.of(hidden.clone()) for k in keys}
                space = ActivationSpace(work / "state", tuple(hidden.shape), spill=False)
                with stream.load(f"{family.blocks}.{args.block}") as block:
                    t = time.perf_counter()
                    p.calibrate_block(resume.Run(spec(algo), work, {}), block, args.block,
                                      family, model.config.model_type, hiddens,
                                      ctx.for_layer(args.block), space)
                    seconds[algo].append(time.perf_counter() - t)
                print(f"rep {rep} {algo}: {seconds[algo][-1]:.1f}s", flush=True)
    med = {a: statistics.median(s) for a, s in seconds.items()}
    ratios = {a: med[a] / med[algos[0]] for a in algos}
    for a in algos:
        print(f"{a}: median {med[a]:.1f}s, {ratios[a]:.2f}x {algos[0]}")
    write_json_atomic(args.json, {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "python": platform.python_version()},
        "settings": {k: str(v) for k, v in vars(args).items()},
        "seconds": seconds, "median_seconds": med, "ratio_to_first": ratios,
    })


if __name__ == "__main__":
    main()
