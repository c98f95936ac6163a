"""A prompt's attention on CPU: quantpipe's tiled kernel vs torch's SDPA, side by side.

    OMP_WAIT_POLICY=PASSIVE python bench/prefill_attention.py [--w4 QDIR]
        # writes bench/results/prefill_attention.json

Part 1, one layer's attention for a whole prompt of T tokens: ``quantpipe_cpu::paged_attention``
(chunks of 16+ queries in flash-style tiles over the paged cache) on a bf16 cache (``kernel``:
bf16 dot products where the build has them, AVX-512) and on an fp32 cache (``kernel_fp32_cache``:
fp32 FMAs) against ``scaled_dot_product_attention`` causal on the same bf16 keys (fp32, and bf16
as the runner calls it on a bf16 cache), for each head layout and thread count; median ms and
the largest difference from a float64 SDPA. Random queries, keys and values (the speed does not
depend on them).

Part 2 (with ``--w4``): the whole prefill of a T-token prompt in the serving engine (bf16 KV
cache, int8 head, as ``quantpipe serve`` runs), with long chunks in the kernel
(``QUANTPIPE_CPU_PREFILL_ATTENTION=kernel``) and in SDPA (``sdpa``), alternating, median ms
over ``--repeats`` prompts each. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernel_speed import timeit as _timeit  # noqa: E402
from bench.vs_llamacpp import lscpu  # noqa: E402
from quantpipe.runtime.kernels import cpu_ext  # noqa: E402

# name -> (query heads, KV heads, head dim)
LAYOUTS = {"smollm2-135m": (9, 3, 64), "qwen2.5-coder-1.5b": (12, 2, 128),
           "gemma-3-270m": (4, 1, 256)}


def one_layer(ops, heads: int, kv: int, d: int, tokens: int, min_s: float) -> dict:
    """ms per call of each path for one layer's attention over a whole prompt."""
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, heads, d, generator=g)
    k, v = (torch.randn(tokens, kv, d, generator=g) for _ in range(2))
    bs = 16
    nb = -(-tokens // bs)
    pools = []
    for t in (k, v):
        p = torch.zeros(nb * bs, kv, d, dtype=torch.bfloat16)
        p[:tokens] = t.bfloat16()
        pools.append(p.view(nb, bs, kv, d))
    table, lens = torch.arange(nb).view(1, -1), torch.tensor([tokens])
    qh = q.transpose(0, 1)[None]
    kh, vh = (p.view(-1, kv, d)[:tokens].transpose(0, 1)[None] for p in pools)  # bf16
    scale = d ** -0.5

    def kernel():
        return ops.paged_attention(q, *pools, table, lens, lens, scale, 0)

    pools32 = [p.float() for p in pools]  # the same values in an fp32 cache

    def kernel_fp32_cache():
        return ops.paged_attention(q, *pools32, table, lens, lens, scale, 0)

    def sdpa(dt):
        return lambda: F.scaled_dot_product_attention(
            qh.to(dt), kh.to(dt), vh.to(dt), is_causal=True, scale=scale,
            enable_gqa=True)[0].transpose(0, 1)

    ref = sdpa(torch.float64)()
    out = {}
    for name, fn in (("kernel", kernel), ("kernel_fp32_cache", kernel_fp32_cache),
                     ("sdpa_fp32", sdpa(torch.float32)),
                     ("sdpa_bf16", sdpa(torch.bfloat16))):
        out[name] = {"ms": round(1000 * _timeit(fn, torch.device("cpu"), min_s), 3),
                     "max_abs_diff_vs_float64": float((fn().double() - ref).abs().max())}
    out["sdpa_fp32_over_kernel"] = round(out["sdpa_fp32"]["ms"] / out["kernel"]["ms"], 3)
    return out


def whole_prefill(w4: Path, tokens: list[int], repeats: int) -> dict:
    """Median ms of a prompt's prefill step in the engine, kernel vs SDPA for long chunks."""
    from quantpipe.runtime.engine import (
        EngineConfig,
        LLMEngine,
        SamplingParams,
        load_model_for_serving,
    )
    from quantpipe.runtime.engine.model_runner import PREFILL_ATTENTION_ENV

    model, tok = load_model_for_serving(w4, head_dtype="int8")
    engines = {}
    for choice in ("kernel", "sdpa"):
        os.environ[PREFILL_ATTENTION_ENV] = choice
        engines[choice] = LLMEngine(model, tok, EngineConfig(
            block_size=16, max_num_seqs=4, kv_dtype="bf16", enable_prefix_caching=False,
            kv_cache_memory=2**30))
    os.environ.pop(PREFILL_ATTENTION_ENV)
    gen = torch.Generator().manual_seed(0)
    res = {}
    for n in tokens:
        times = {c: [] for c in engines}
        for i in range(repeats + 1):  # the first round warms up
            prompt = torch.randint(100, model.config.vocab_size - 1, (n,), generator=gen).tolist()
            for c, eng in engines.items():
                eng.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
                t = time.perf_counter()
                while eng.has_work():
                    eng.step()
                if i:
                    times[c].append(1000 * (time.perf_counter() - t))
        med = {c: round(statistics.median(v), 1) for c, v in times.items()}
        res[str(n)] = {"ms_median": med, "ms_all": times,
                       "sdpa_over_kernel": round(med["sdpa"] / med["kernel"], 3)}
        print(f"prefill {n} tokens: kernel {med['kernel']} ms, SDPA {med['sdpa']} ms", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--tokens", default="155,600,1266")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--min-s", type=float, default=0.5, help="seconds timed per case")
    ap.add_argument("--w4", type=Path, help="a quantpipe native export: whole prefills too")
    ap.add_argument("--prefill-tokens", default="155,1000")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path,
                    default=ROOT / "bench" / "results" / "prefill_attention.json")
    args = ap.parse_args()
    usable, why = cpu_ext.kernel_status()
    if not usable:
        raise SystemExit(f"quantpipe's CPU kernels are not usable here: {why}")
    ops = cpu_ext.ops()
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name in args.layouts.split(","):
            heads, kv, d = LAYOUTS[name]
            for n in (int(t) for t in args.tokens.split(",")):
                r = one_layer(ops, heads, kv, d, n, args.min_s)
                rows.append({"layout": name, "heads": heads, "kv_heads": kv, "head_dim": d,
                             "tokens": n, "threads": threads, **r})
                print(f"t{threads} {name} {n}: kernel {r['kernel']['ms']} ms (fp32 cache "
                      f"{r['kernel_fp32_cache']['ms']}), SDPA fp32 "
                      f"{r['sdpa_fp32']['ms']}, bf16 {r['sdpa_bf16']['ms']} "
                      f"({r['sdpa_fp32_over_kernel']}x)", flush=True)
    res = {"host": lscpu(), "isa": cpu_ext.active_isa(), "torch": torch.__version__,
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "one_layer": rows}
    if args.w4:
        torch.set_num_threads(max(int(t) for t in args.threads.split(",")))
        res["whole_prefill"] = {"w4": str(args.w4), "threads": torch.get_num_threads(),
                                "kv_dtype": "bf16",
                                "by_tokens": whole_prefill(
                                    args.w4, [int(t) for t in args.prefill_tokens.split(",")],
                                    args.repeats)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
