"""A budget plan over the menu, exported for vLLM, loaded by vLLM's CPU build: greedy tokens
against quantpipe's runtime on the native export of the same plan (issue #30).

    python bench/vllm_mixed_plan.py --calib CALIB_DIR --budget 4.5 --work /tmp/vm \
        --json bench/results/vllm_mixed_plan_smollm2.json

The plan is made once per format (``export --format gptq|compressed-tensors --budget-bits B
--menu ...``; the default ``--menu`` leaves out 8-bit entries, which vLLM's CPU build cannot
load) and once natively with the same layers' specs (``--override`` per layer, so the two
hold the same integer weights). Prompts: the first ``--prompts`` business-eval prompts,
chat-rendered to token ids. vLLM (``tests/vllm_worker.py`` in the vLLM venv,
``$QUANTPIPE_VLLM_PYTHON``) generates 32 greedy tokens per prompt, EOS ignored; quantpipe's
serving engine does the same on the native folder; tests/vllm_cases.py's rule compares them
(identical tokens with logprobs within 0.15, or a divergence at a near tie of quantpipe's
own distribution), and both against the same weights dequantized into a float64
transformers model, teacher-forced on vLLM's tokens (a loading error is far from it, rounding
is not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/vllm_cases.py: the comparison the vLLM tests use

from quantpipe.core.io import write_json_atomic  # noqa: E402
from quantpipe.prompts.sets import load_prompt_records  # noqa: E402
from quantpipe.reports.answers import render_prompts  # noqa: E402
from quantpipe.stages.export import ExportSpec, export_quantized  # noqa: E402
from tests.vllm_cases import NEW_TOKENS, compare, runtime_greedy  # noqa: E402

NO_INT8 = ("w4,w4g32,w4g64,w4g128,w4pc,w4g32-asym,w4g64-asym,w4g128-asym,w4pc-asym,fp16",)


def reference_check(native, ids, ours, theirs) -> dict:
    """Both runtimes against the same integer weights dequantized into a float64 transformers
    model, teacher-forced on vLLM's tokens (one forward per prompt): the largest |logprob -
    reference logprob| of vLLM's chosen tokens, and of quantpipe's while its greedy tokens
    equal vLLM's. Tells a loading error (far from the reference) from rounding."""
    import torch

    from quantpipe.core.formats.loader import load_dequantized_model

    model = load_dequantized_model(native, dtype=torch.float64).eval()
    worst_v, worst_q = 0.0, 0.0
    with torch.no_grad():
        for prompt, o, t in zip(ids, ours, theirs):
            seq = torch.tensor([prompt + t["tokens"]])
            lp = torch.log_softmax(model(seq).logits[0, len(prompt) - 1:-1], dim=-1)
            ref = lp[torch.arange(len(t["tokens"])), torch.tensor(t["tokens"])].tolist()
            worst_v = max(worst_v, *(abs(a - b) for a, b in zip(t["logprobs"], ref)))
            k = next((i for i, (a, b) in enumerate(zip(o.tokens, t["tokens"])) if a != b),
                     len(ref))
            worst_q = max(worst_q, *(abs(a - b) for a, b in zip(o.logprobs[:k], ref[:k])))
    return {"vllm_max_abs_logprob_diff": worst_v, "quantpipe_max_abs_logprob_diff": worst_q}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=4.5)
    ap.add_argument("--menu", default=NO_INT8[0])
    ap.add_argument("--sensitivity", type=Path, default=None,
                    help="The measurement to plan on [default: CALIB_DIR/sensitivity.json].")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--vllm-python", default=os.environ.get("QUANTPIPE_VLLM_PYTHON",
                                                              str(REPO / ".venv-vllm/bin/python")))
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    t0 = time.time()
    from transformers import AutoTokenizer

    calib_manifest = json.loads((args.calib / "quantpipe.json").read_text())
    tok = AutoTokenizer.from_pretrained(calib_manifest["fp16_dir"], trust_remote_code=False)
    ids = render_prompts(tok, load_prompt_records("business-eval")[: args.prompts])
    out: dict = {"budget": args.budget, "menu": args.menu, "prompts": len(ids), "formats": {}}
    jobs, natives = [], {}
    for fmt in ("gptq", "compressed-tensors"):
        qdir = args.work / fmt
        res = export_quantized(ExportSpec(args.calib, qdir, fmt=fmt, budget_bits=args.budget,
                                          menu=(args.menu,), sensitivity=args.sensitivity,
                                          force=True))
        rules = tuple(f"{n}={'fp16' if e is None else e}" for n, e in res.plan.bits.items())
        natives[fmt] = args.work / f"native-{fmt}"
        export_quantized(ExportSpec(args.calib, natives[fmt], overrides=rules, force=True))
        out["formats"][fmt] = {"effective_bits": res.plan.effective_bits(),
                               "entries": res.plan.entries(), "validation": res.plan.validation}
        jobs.append({"path": str(qdir), "prompts": ids})
        print(fmt, f"{res.plan.effective_bits():.4f} bpw", res.plan.entries(), flush=True)
    job = args.work / "job.json"
    job.write_text(json.dumps({"checkpoints": jobs, "max_tokens": NEW_TOKENS,
                               "max_model_len": max(map(len, ids)) + NEW_TOKENS + 16}))
    proc = subprocess.run([args.vllm_python, str(REPO / "tests/vllm_worker.py"), str(job),
                           str(args.work / "res.json")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"vLLM worker failed: {proc.stderr[-3000:]}")
    results = json.loads((args.work / "res.json").read_text())["results"]
    for fmt, r in zip(("gptq", "compressed-tensors"), results):
        row = out["formats"][fmt]
        row["vllm_loaded"] = r["ok"]
        if not r["ok"]:
            row["error"] = r["error"][-2000:]
            print(fmt, "vLLM refused:", r["error"][-500:], flush=True)
            continue
        ours, eng = runtime_greedy(natives[fmt], ids, kv_cache_memory=2**28)
        checks = [compare(eng, p, o, t) for p, o, t in zip(ids, ours, r["outputs"])]
        row["identical"] = sum(o.tokens == t["tokens"] for o, t in zip(ours, r["outputs"]))
        row["ok"] = all(ok for ok, _ in checks)
        row["per_prompt"] = [what for _, what in checks]
        row["vllm_seconds"] = r["seconds"]
        row["vs_fp64_reference"] = reference_check(natives[fmt], ids, ours, r["outputs"])
        print(fmt, f"identical {row['identical']}/{len(ids)}, all within the rule: {row['ok']}, "
              f"against the fp64 reference: {row['vs_fp64_reference']}", flush=True)
    out["seconds"] = time.time() - t0
    write_json_atomic(args.json, out)


if __name__ == "__main__":
    main()
