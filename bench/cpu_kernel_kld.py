"""How much quantpipe's CPU builds differ in rounding: KLD between the kernel paths on one
quantized checkpoint.

    python bench/cpu_kernel_kld.py QDIR [--prompts 16] [--tokens 128] [--json OUT]

Runs the held-out ``business-eval`` prompts (the first ``--prompts``, each cut to ``--tokens``)
through Hugging Face's forward of three models built from the same QDIR, and reports the mean
per-token KL divergence and top-1 agreement of each pair:

- ``reference``: every quantized layer dequantized to fp32 (``load_dequantized_model``);
- ``torch``: ``QUANTPIPE_CPU_KERNELS=torch`` (torch's int4pack / int8pack, bf16 activations);
- ``ours``: the best build this CPU runs (``QUANTPIPE_CPU_ISA`` forces one), e.g. AVX2 W4A8.

The head is fp32 in all three (``runtime.fp_head`` is left out), so only the linears' kernels
differ.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch

from quantpipe.core.formats.loader import load_dequantized_model
from quantpipe.core.io import write_json_atomic
from quantpipe.core.metrics import mean_kld, token_kld
from quantpipe.runtime.kernels import cpu_ext
from quantpipe.runtime.loader import load_quantized_model

EVAL = (Path(__file__).resolve().parents[1] / "quantpipe" / "prompts" / "data"
        / "business_eval.jsonl")


def prompt_ids(qdir: Path, n: int, tokens: int) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qdir), trust_remote_code=False)
    rows = [json.loads(line) for line in EVAL.read_text(encoding="utf-8").splitlines()[:n]]
    return [tok(r["prompt"], return_tensors="pt").input_ids[:, :tokens] for r in rows]  # [1, T]


@torch.inference_mode()
def logits_of(model, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    return [model(x).logits[0].float() for x in ids]  # [T, V] each


def quantized_logits(qdir: Path, ids: list[torch.Tensor], kernels: str) -> tuple[list, dict]:
    """Logits with ``QUANTPIPE_CPU_KERNELS=kernels`` and the backends the layers got."""
    old = os.environ.get(cpu_ext.ENV)
    os.environ[cpu_ext.ENV] = kernels
    cpu_ext.reset()
    try:
        model = load_quantized_model(qdir, "cpu", torch.float32)
        return logits_of(model, ids), dict(model.quantpipe_backends)
    finally:
        if old is None:
            os.environ.pop(cpu_ext.ENV, None)
        else:
            os.environ[cpu_ext.ENV] = old
        cpu_ext.reset()


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    kld = [token_kld(x, y) for x, y in zip(a, b)]
    same = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b))
    n = sum(x.shape[0] for x in a)
    return {"kld_mean": mean_kld(kld), "kld_max": max(float(k.max()) for k in kld),
            "same_top1": same / n, "tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("qdir", type=Path)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ids = prompt_ids(args.qdir, args.prompts, args.tokens)
    ref = logits_of(load_dequantized_model(args.qdir, torch.float32), ids)
    torch_l, torch_b = quantized_logits(args.qdir, ids, "torch")
    ours_l, ours_b = quantized_logits(args.qdir, ids, "quantpipe")
    out = {
        "qdir": str(args.qdir), "cpu": platform.processor() or platform.machine(),
        "isa": cpu_ext.active_isa(), "backends": {"torch": torch_b, "ours": ours_b},
        "reference_vs_torch": compare(ref, torch_l),
        "reference_vs_ours": compare(ref, ours_l),
        "torch_vs_ours": compare(torch_l, ours_l),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        write_json_atomic(args.json, out)


if __name__ == "__main__":
    main()
