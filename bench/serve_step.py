"""What one engine step of `quantpipe serve` costs, in process: a prompt's prefill, the decode
step at 1 / 4 / 16 sequences, and where a 16-sequence decode step spends its time.

    OMP_NUM_THREADS=2 python bench/serve_step.py --w4 QDIR --out bench/results/serve_step.json

The engine is built as ``serve`` builds it (its default int8 head, ``--kv-dtype`` as given,
prefix caching off); prompts are random token ids (the model's speed does not depend on them).
Decode steps are timed after every sequence's prefill, over ``--new-tokens`` steps from a
``--context``-token prompt; the profile is torch's over ``--profile-steps`` 16-sequence steps
(quantpipe's whole-layer op, the head and the rest). It names the costs that the serving
benchmark (bench/vs_vllm.py) only shows as TPOT and TTFT.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu_flags() -> list[str]:
    """The CPU's flags as lscpu lists them (Linux), else none."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return []
    line = next((ln for ln in info.read_text().splitlines() if ln.startswith("flags")), "")
    return sorted(line.partition(":")[2].split())


def _show(res: dict) -> None:
    for n, v in res["prefill_ms"].items():
        print(f"prefill of {n} tokens: {v:.1f} ms")
    for what, v in res["decode_step_ms_median"].items():
        print(f"decode step, {what}: {v:.1f} ms (median)")
    print("16-sequence step, self CPU ms per step:")
    for k, v in res["profile_16_seqs_ms_per_step_self"].items():
        print(f"  {v:8.3f}  {k}")


def main() -> None:
    from quantpipe.runtime.config import DEFAULTS
    from quantpipe.runtime.engine import EngineConfig, LLMEngine, SamplingParams
    from quantpipe.runtime.engine.loading import load_model_for_serving

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--w4", type=Path, required=True, help="a quantpipe native export")
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--prompt-tokens", type=int, default=155, help="the prefill timed")
    ap.add_argument("--context", type=int, default=300, help="each decoding sequence's prompt")
    ap.add_argument("--new-tokens", type=int, default=60)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    model, tok = load_model_for_serving(args.w4, head_dtype=DEFAULTS.serve_head_dtype)
    gen = torch.Generator().manual_seed(0)

    def engine() -> LLMEngine:
        return LLMEngine(model, tok, EngineConfig(
            block_size=DEFAULTS.block_size, max_num_seqs=32, kv_dtype=args.kv_dtype,
            enable_prefix_caching=False, kv_cache_memory=2**30))

    def prompt(n: int) -> list[int]:
        return torch.randint(100, model.config.vocab_size - 1, (n,), generator=gen).tolist()

    def run(eng: LLMEngine, n: int, length: int, new: int) -> list[float]:
        for _ in range(n):
            eng.add_request(prompt(length), SamplingParams(max_tokens=new, ignore_eos=True))
        steps = []
        while eng.has_work():
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
        return steps

    eng = engine()
    run(eng, 1, args.prompt_tokens, 1)  # warm-up
    prefill_ms = 1000 * sum(run(eng, 1, args.prompt_tokens, 1))
    decode = {}
    for n in (1, 4, 16):
        # the first step holds every prefill (2,048 tokens a step): decode steps follow
        steps = run(engine(), n, args.context, args.new_tokens)[1 + n * args.context // 2048:]
        decode[n] = round(1000 * statistics.median(steps), 2)
    eng = engine()
    for _ in range(16):
        eng.add_request(prompt(args.context), SamplingParams(
            max_tokens=args.profile_steps + 10, ignore_eos=True))
    for _ in range(5):
        eng.step()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            eng.step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    per_step = {e.key: round(e.self_cpu_time_total / 1000 / args.profile_steps, 3)
                for e in ops[:8]}
    res = {"host": {"machine": platform.machine(), "flags": _cpu_flags()},
           "threads": torch.get_num_threads(), "w4": str(args.w4), "kv_dtype": args.kv_dtype,
           "head_dtype": DEFAULTS.serve_head_dtype,
           "prefill_ms": {args.prompt_tokens: round(prefill_ms, 1)},
           "decode_step_ms_median": {f"{n} seqs at {args.context}+ ctx": v
                                     for n, v in decode.items()},
           "profile_16_seqs_ms_per_step_self": per_step}
    _show(res)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
