"""GPTQ seconds per decoder block at TinyLlama-1.1B widths: baseline commit vs working tree.

Builds one TinyLlama-width block with random weights (LlamaConfig, num_hidden_layers=1, no
download), feeds it ``--samples x --seq-len`` random tokens, and times the per-block GPTQ work
of ``quantpipe calibrate --algo gptq`` with its defaults (INT4 g128 symmetric, act-order with
static groups, MSE clip search weighted by diag(H), percdamp 0.01; INT8 per channel with
act-order order), as ``calibration.pipeline.calibrate_block`` /
``calibration.block_step.quantize_block`` / ``quantize_gptq`` do it: forward with the
statistics hooks (Hessian accumulation), GPTQ of every linear at 4 and 8 bits on one thread,
then the forward on the quantized weights.

The baseline is the code at ``--base`` (``git show``: calibration/{grid,result,rtn,gptq,
capture}.py loaded as a temporary package); baseline and working tree alternate in one run
and every phase is reported as a median over ``--reps``. Both must give the same q / scales /
zeros / g_idx (differences are counted and reported) and the same proxy losses.

    python bench/gptq_block.py --reps 3 --out bench/results/gptq_block.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from quantpipe.core.families import family_for, get_blocks
from quantpipe.core.qformat import INT8_PER_CHANNEL, QuantizedWeight, QuantSpec

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("grid", "result", "rtn", "gptq", "capture")  # the files this bench compares
# calibrate's GPTQ defaults (calibration.config: GPTQ_ACT_ORDER_DEFAULT, GPTQ_MSE_CLIP_DEFAULT,
# static groups with act-order, group size 128, --sym, --batch-size 8)
GROUP_SIZE, SYM, ACT_ORDER, MSE_CLIP, STATIC_GROUPS, BATCH_SIZE = 128, True, True, True, True, 8


def load_baseline(commit: str) -> dict:
    """calibration/{MODULES}.py at ``commit`` as modules of a temporary package."""
    pkg = f"_gptq_base_{commit[:8]}"
    root = Path(tempfile.mkdtemp(prefix="gptq_base_"))
    (root / pkg).mkdir()
    (root / pkg / "__init__.py").write_text("")
    for name in MODULES:
        src = subprocess.run(["git", "show", f"{commit}:calibration/{name}.py"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        for other in MODULES:  # the baseline's own helpers, not the working tree's
            src = src.replace(f"quantpipe.calibration.{other} ", f"{pkg}.{other} ")
        # the family registry moved to quantpipe.core (commit 18a8a84)
        src = src.replace("quantpipe.calibration.families ", "quantpipe.core.families ")
        # block execution, activations and devices moved to quantpipe.blocks
        for moved in ("activations", "device"):
            src = src.replace(f"quantpipe.calibration.{moved} ", f"quantpipe.blocks.{moved} ")
        (root / pkg / f"{name}.py").write_text(src)
    sys.path.insert(0, str(root))
    return {name: importlib.import_module(f"{pkg}.{name}") for name in MODULES}


def load_current() -> dict:
    return {name: importlib.import_module(f"quantpipe.calibration.{name}") for name in MODULES}


class PhaseTimer:
    """Wraps module-level functions of one implementation and sums their seconds per phase.

    Nested phases are counted in each wrapper (a phase listed here never calls another one).
    """

    def __init__(self, module, phases: dict[str, str]):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for attr, phase in phases.items():
            if hasattr(module, attr):
                setattr(module, attr, self._wrap(getattr(module, attr), phase))

    def _wrap(self, fn, phase: str):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t
                self.calls[phase] += 1

        return timed

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


# module attribute -> phase; attributes an implementation lacks are skipped
GPTQ_PHASES = {
    "check_weight": "input checks (isfinite W, H)",
    "damped_inverse_cholesky": "Cholesky / inverse (+ damping)",
    "hessian_factor": "H prep: dead cols, act-order permutation, Cholesky / inverse",
    "params_for_groups": "clip / scale search",
    "gptq_columns": "column loop (OBS updates + lazy batch updates)",
    "proxy_loss": "proxy loss tr(dW H dW^T)",
}


def build_block(hidden: int, inter: int, heads: int, kv_heads: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=32000,
                      max_position_embeddings=2048)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # calibrate reads FP16 shards into fp32 blocks (calibration.stream): same values here
    model = model.half().float().eval()
    return model


def quantize_linear(impl: dict, W: torch.Tensor, H: torch.Tensor, qspec: QuantSpec):
    """calibration.block_step.quantize_gptq (same calls, same options)."""
    gptq = impl["gptq"].gptq
    if qspec.group_size == -1 and not qspec.act_order:
        res = gptq(W, H, QuantSpec(qspec.bits, -1, qspec.sym, act_order=True), mse_clip=MSE_CLIP)
        w = res.weight
        assert w.g_idx is None
        res.weight = QuantizedWeight(qspec, w.q, w.scales, w.zeros, None)
        return res
    return gptq(W, H, qspec, mse_clip=MSE_CLIP, static_groups=STATIC_GROUPS)


def run_once(impl: dict, timer: PhaseTimer, model, block, family, hidden, ctx, state) -> tuple:
    """One block of calibrate --algo gptq; returns (phase seconds, results by linear)."""
    capture = impl["capture"]
    # block execution moved from calibration/capture.py to quantpipe/blocks/execute.py
    run_block = getattr(capture, "run_block", None) or importlib.import_module(
        "quantpipe.blocks.execute").run_block
    block.load_state_dict(state)
    phases: dict[str, float] = {}
    with torch.no_grad():
        t = time.perf_counter()
        run_block(block, hidden, ctx, BATCH_SIZE)
        phases["forward without hooks"] = time.perf_counter() - t
        t = time.perf_counter()
        collector = capture.StatsCollector(block, family.groups, seed=0)
        run_block(block, hidden, ctx, BATCH_SIZE)
        collector.remove()
        phases["forward with statistics hooks"] = time.perf_counter() - t
    phases["Hessian accumulation (hooks)"] = (phases["forward with statistics hooks"]
                                              - phases["forward without hooks"])
    spec4 = QuantSpec(4, GROUP_SIZE, SYM, ACT_ORDER)
    results = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as block_step.quantize_block does for GPTQ
    t = time.perf_counter()
    try:
        for group in family.groups:
            H = collector.stats[group].H  # [in, in] fp32
            collector.stats[group].x_sample()  # taken by the pipeline for AWQ's clip only
            for name in group.linears:
                lin = block.get_submodule(name)
                W = lin.weight.data.float()  # [out, in]
                r4 = quantize_linear(impl, W, H, spec4)
                r8 = quantize_linear(impl, W, H, INT8_PER_CHANNEL)
                results[name] = {4: r4, 8: r8}
                lin.weight.data = r4.weight.dequantize(lin.weight.dtype)
    finally:
        torch.set_num_threads(threads)
    phases["GPTQ total (14 calls)"] = time.perf_counter() - t
    inner = timer.take()
    phases.update(inner)
    nested = {GPTQ_PHASES["damped_inverse_cholesky"]} if GPTQ_PHASES["hessian_factor"] in inner \
        else set()  # the working tree calls it inside hessian_factor
    phases["GPTQ rest (body outside the phases above)"] = (
        phases["GPTQ total (14 calls)"] - sum(v for k, v in inner.items() if k not in nested))
    with torch.no_grad():
        t = time.perf_counter()
        run_block(block, hidden, ctx, BATCH_SIZE)
        phases["forward on quantized weights"] = time.perf_counter() - t
    phases["block total"] = (phases["forward with statistics hooks"]
                             + phases["GPTQ total (14 calls)"]
                             + phases["forward on quantized weights"])
    return phases, results


def compare(base: dict, new: dict) -> dict:
    """Per linear and bit width: how many q / scales / zeros differ, and the proxy losses."""
    out = {}
    for name in base:
        for bits in (4, 8):
            a, b = base[name][bits], new[name][bits]
            wa, wb = a.weight, b.weight
            out[f"{name}@{bits}"] = {
                "q_differ": int((wa.q != wb.q).sum()), "q_total": wa.q.numel(),
                "scales_differ": int((wa.scales != wb.scales).sum()),
                "scales_total": wa.scales.numel(),
                "zeros_differ": int((wa.zeros != wb.zeros).sum()),
                "g_idx_same": (wa.g_idx is None and wb.g_idx is None)
                or (wa.g_idx is not None and wb.g_idx is not None
                    and bool(torch.equal(wa.g_idx, wb.g_idx))),
                "spec_same": wa.spec == wb.spec,
                "loss_base": a.loss, "loss_new": b.loss,
                "loss_rel_diff": (b.loss - a.loss) / a.loss if a.loss else 0.0,
                "damp_raises": [a.damp_raises, b.damp_raises],
            }
    return out


def cpu_flags() -> list[str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    for line in text.splitlines():
        if line.startswith("Flags:"):
            return line.split(":", 1)[1].split()
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=None, help="baseline commit (default: HEAD)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/gptq_block.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base_commit = args.base or subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    impls = {"base": load_baseline(base_commit), "new": load_current()}
    timers = {k: PhaseTimer(m["gptq"], GPTQ_PHASES) for k, m in impls.items()}

    from quantpipe.blocks.execute import embed_inputs

    model = build_block(args.hidden, args.intermediate, args.heads, args.kv_heads, seed=0)
    family = family_for(model.config.model_type)
    block = get_blocks(model, family)[0]
    state = {k: v.clone() for k, v in block.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (args.samples, args.seq_len),
                        generator=torch.Generator().manual_seed(0))  # [n, L] int64
    with torch.no_grad():
        hidden, ctx = embed_inputs(model, ids)  # [n, L, d] fp32

    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    last: dict[str, dict] = {}
    for rep in range(args.reps):
        order = ("base", "new") if rep % 2 == 0 else ("new", "base")  # interleaved
        for name in order:
            phases, results = run_once(impls[name], timers[name], model, block, family, hidden,
                                       ctx, state)
            phases["loadavg_1min_after"] = os.getloadavg()[0]
            runs[name].append(phases)
            last[name] = results
            print(f"rep {rep} {name}: block {phases['block total']:.1f} s, GPTQ "
                  f"{phases['GPTQ total (14 calls)']:.1f} s, load {phases['loadavg_1min_after']}",
                  flush=True)
            # every phase of this run, so that a run stopped early still leaves its numbers
            print(json.dumps({"rep": rep, "impl": name, "phases": phases}), flush=True)

    def medians(rows: list[dict]) -> dict:
        keys = sorted({k for r in rows for k in r})
        return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}

    med = {k: medians(v) for k, v in runs.items()}
    ratio = {k: med["base"][k] / med["new"][k] for k in med["base"]
             if k in med["new"] and med["new"][k] > 0 and not k.startswith("loadavg")}
    diff = compare(last["base"], last["new"])
    report = {
        "what": "per-block GPTQ work of calibrate --algo gptq (defaults) at TinyLlama widths, "
                "baseline commit vs working tree, interleaved in one run; medians in seconds",
        "base_commit": base_commit,
        "new": "working tree at " + subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip() + " (+ uncommitted edits, if any)",
        "shape": {"hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads,
                  "kv_heads": args.kv_heads, "samples": args.samples, "seq_len": args.seq_len},
        "defaults": {"group_size": GROUP_SIZE, "sym": SYM, "act_order": ACT_ORDER,
                     "mse_clip": MSE_CLIP, "static_groups": STATIC_GROUPS,
                     "int8": "per channel, act-order order", "percdamp": 0.01,
                     "gptq_threads": 1, "forward_threads": args.threads},
        "reps": args.reps,
        "median_seconds": med,
        "ratio_base_over_new": ratio,
        "runs": runs,
        "equality": diff,
        "all_q_equal": all(d["q_differ"] == 0 for d in diff.values()),
        "max_abs_loss_rel_diff": max(abs(d["loss_rel_diff"]) for d in diff.values()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "lscpu_flags": cpu_flags(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "note": "shared machine: other agents were using the CPUs"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"median_block_s": {k: v["block total"] for k, v in med.items()},
                      "median_gptq_s": {k: v["GPTQ total (14 calls)"] for k, v in med.items()},
                      "ratio_gptq": ratio.get("GPTQ total (14 calls)"),
                      "ratio_block": ratio.get("block total"),
                      "all_q_equal": report["all_q_equal"],
                      "max_abs_loss_rel_diff": report["max_abs_loss_rel_diff"]}, indent=1))


if __name__ == "__main__":
    main()
