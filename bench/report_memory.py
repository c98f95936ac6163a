"""The report's answering step on a random-weight model of a real shape: peak RSS and seconds.

    python bench/report_memory.py --shape llama2-7b --work /tmp/qp-report-mem \
        --prompts 2 --new-tokens 4 --json bench/results/report-answers-llama2-7b.json

`quantpipe report` answers the held-out prompts with one model loaded at a time
(``reports.answers``), in fp32, or in bf16 where the reference in fp32 would take more than
60% of the available memory (``reports.build.answer_precision``). This writes the shape's random
FP16 source (``bench/scale.py``'s ``make_source``, tensor by tensor), then answers ``--prompts``
shipped held-out prompts with it in a child process exactly as the report does, and records
the dtype chosen, the child's peak RSS (``VmHWM``), load and answer seconds and the engine's
speed. The candidate's half of a report is the quantized model's runtime peak, measured by
``bench/scale.py``'s generate stage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

_CHILD = """
import json, sys, time
from pathlib import Path
from quantpipe.core.heap import peak_rss
from quantpipe.prompts.sets import load_prompt_records
from quantpipe.reports.answers import answer_prompts
from quantpipe.reports.build import answer_precision, spread
folder, n, new = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
precision = answer_precision(folder, new)
t0 = time.perf_counter()
ans = answer_prompts(folder, "FP16", spread(load_prompt_records("business-eval"), n), new,
                     precision, json_new_tokens=new)
sp = ans.speed
print(json.dumps({"dtype": str(precision.activations).removeprefix("torch."),
                  "kv_dtype": precision.kv_dtype, "why": precision.note,
                  "seconds": round(time.perf_counter() - t0, 1), "load_s": round(sp.load_s, 1),
                  "answer_tokens": list(ans.tokens), "weight_bytes": sp.weight_bytes,
                  "peak_rss_mb": round(peak_rss() / 2**20, 1),
                  "by_concurrency": sp.by_concurrency}))
"""


def main() -> None:
    from scale import SHAPES, cpu_info, make_source

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smoke", choices=sorted(SHAPES))
    ap.add_argument("--work", type=Path, required=True, help="where the source is written")
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts answered")
    ap.add_argument("--new-tokens", type=int, default=4, help="greedy tokens per answer")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args()
    source = args.work / args.shape / "source"
    t0 = time.perf_counter()
    weight_bytes = make_source(args.shape, source)
    made_s = time.perf_counter() - t0
    child = subprocess.run([sys.executable, "-c", _CHILD, str(source), str(args.prompts),
                            str(args.new_tokens)], capture_output=True, text=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1",
                                "TOKENIZERS_PARALLELISM": "false"})
    if child.returncode != 0:
        sys.exit(f"the answering child failed:\n{child.stderr[-3000:]}")
    result = {"shape": args.shape, "shape_config": SHAPES[args.shape],
              "weight_bytes_fp16": weight_bytes, "source_seconds": round(made_s, 1),
              "prompts": args.prompts, "new_tokens": args.new_tokens, "cpu": cpu_info(),
              **json.loads(child.stdout.strip().splitlines()[-1])}
    print(json.dumps({k: v for k, v in result.items() if k not in ("cpu", "shape_config")},
                     indent=1))
    if args.json:
        from quantpipe.core.io import write_json_atomic

        write_json_atomic(args.json, result)


if __name__ == "__main__":
    main()
