r"""llm-compressor's GPTQ on exactly quantpipe's calibration tokens (runs in llm-compressor's venv).

Started by ``bench/vs_llmcompressor.py`` with the llm-compressor interpreter, never imported by
quantpipe (it needs ``llmcompressor``, which lives in its own virtualenv because its pins differ
from the project's):

    /work/llmc-venv/bin/python bench/llmc_worker.py --fp16 FP16_DIR \
        --tokens calib_tokens.safetensors --out OUT_DIR --scheme sym --group-size 64 \
        --report OUT.json

Recipe: one ``GPTQModifier`` with an explicit config group (W4A16 equivalent):
``QuantizationArgs(num_bits=4, type="int", symmetric=..., strategy="group", group_size=64)``
on every ``Linear`` except ``lm_head``; default dampening (0.01) and block size (128),
activation ordering ``--actorder none`` (default here) or ``static`` (llm-compressor's own
default), the sequential pipeline (one decoder layer at a time,
the next layer's inputs computed through the already-quantized layers). The model is loaded in
float32, as quantpipe calibrates, so both tools' Hessians see the same activations; scales are
rounded to fp16 as they are computed (``scale_dtype``), and the model is cast to fp16 and saved
compressed (``pack-quantized``) by ``save_pretrained(save_compressed=True)``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

# Python puts this script's folder (bench/) first on sys.path, where a script named like a
# package transformers imports would shadow it (bench/kernels.py did, for `kernels`: hence
# bench/kernel_speed.py); the worker needs nothing from bench/.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

SCHEMES = {"sym": True, "asym": False}  # scheme name -> QuantizationArgs.symmetric


def build_modifier(symmetric: bool, group_size: int, actorder: str | None = None):
    """The GPTQ recipe, spelled out instead of the "W4A16" preset so every knob is visible."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier

    # scale_dtype fp16: scales rounded to fp16 when computed (quantpipe stores fp16 scales too),
    # so the checkpoint cast to fp16 before saving holds exactly the scales GPTQ used
    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size,
        scale_dtype=torch.float16,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    # actorder: GPTQModifier's default is "static" (columns by decreasing Hessian diagonal, group
    # params from the original weights: quantpipe's --act-order --static-groups); None keeps the
    # columns in their natural order (quantpipe without --act-order)
    return GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], actorder=actorder)


def calibration_dataset(tokens_path: Path):
    """The token ids the main script wrote: input_ids [n, L] int64 -> a tokenized Dataset."""
    from datasets import Dataset

    input_ids = load_file(str(tokens_path))["input_ids"]  # [n, L] int64
    if input_ids.ndim != 2 or input_ids.dtype != torch.int64:
        raise ValueError(f"{tokens_path}: input_ids must be [n, L] int64, got "
                         f"{tuple(input_ids.shape)} {input_ids.dtype}; rewrite it with "
                         "bench/vs_llmcompressor.py")
    ids = input_ids.tolist()
    # every window is full (pack mode), so the mask is all ones; a pre-tokenized Dataset is used
    # as is by llm-compressor (no re-tokenization, no truncation below max_seq_length)
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]}), \
        tuple(input_ids.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", type=Path, required=True, help="FP16 model folder")
    ap.add_argument("--tokens", type=Path, required=True, help="safetensors with input_ids")
    ap.add_argument("--out", type=Path, required=True, help="compressed output folder")
    ap.add_argument("--scheme", choices=sorted(SCHEMES), required=True)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1, help="oneshot calibration batch")
    ap.add_argument("--actorder", choices=["none", "static"], default="none",
                    help="GPTQModifier actorder (llm-compressor's own default is static)")
    ap.add_argument("--report", type=Path, required=True, help="JSON with times and versions")
    args = ap.parse_args()

    import compressed_tensors
    import llmcompressor
    import transformers
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dataset, shape = calibration_dataset(args.tokens)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.fp16, dtype=torch.float32,
                                                 use_safetensors=True, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(args.fp16, trust_remote_code=False)
    t_load = time.perf_counter()
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=build_modifier(SCHEMES[args.scheme], args.group_size,
                              None if args.actorder == "none" else args.actorder),
        num_calibration_samples=shape[0],
        max_seq_length=shape[1],
        shuffle_calibration_samples=False,  # order does not change the Hessian sums
        batch_size=args.batch_size,
        pipeline="sequential",
    )
    t_oneshot = time.perf_counter()
    # fp16 on disk, like a checkpoint llm-compressor makes from an fp16 model: the fake-quantized
    # weights are (q - z) * s with |q - z| <= 15 and an fp16 s, so rounding them to fp16 errs by
    # at most 15 * 2**-11 * s and the compressor's round(w / s) recovers the same q
    model.to(torch.float16)
    # write next to the target and rename, so a killed run never leaves a half folder behind
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, save_compressed=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(args.out, ignore_errors=True)
    os.replace(tmp, args.out)
    t_save = time.perf_counter()
    report = {
        "scheme": args.scheme, "group_size": args.group_size, "tokens_shape": list(shape),
        "actorder": args.actorder,
        "batch_size": args.batch_size,
        "seconds": {"load": t_load - t0, "oneshot": t_oneshot - t_load, "save": t_save - t_oneshot,
                    "total": t_save - t0},
        "versions": {"llmcompressor": llmcompressor.__version__,
                     "compressed_tensors": compressed_tensors.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
    }
    tmp_report = args.report.with_name(args.report.name + ".tmp")
    tmp_report.write_text(json.dumps(report, indent=2))
    os.replace(tmp_report, args.report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
