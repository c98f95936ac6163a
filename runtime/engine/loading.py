"""Model folders -> (model, tokenizer) ready for the engine: FP16 exports and quantpipe folders."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quantpipe.core.config_check import check_folder_config
from quantpipe.core.heap import release_freed_memory
from quantpipe.runtime.engine.model_runner import stack_projections
from quantpipe.runtime.fp_head import set_half_head


def load_model_for_serving(model_dir: str | Path, device: str = "cpu",
                           dtype: torch.dtype | None = None, head_dtype: str = "fp32",
                           verify: bool = True):
    """(model, tokenizer) from an FP16 export or a quantpipe quantized folder.

    ``head_dtype``: precision of the embedding table and output head on CPU
    (``runtime.fp_head``; fp32 = the model's dtype, unchanged). On CUDA the whole model already
    runs in fp16 and ``head_dtype`` is ignored. ``verify=False``: a quantized folder's
    hashes and values are not checked (``runtime.loader.read_packed``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(model_dir)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{folder} has no config.json; pass a folder written by export-fp16 "
                         "or export")
    cfg = json.loads(cfg_path.read_text())
    # fp32 on CPU: fp16 matmuls there are slow and less exact; fp16 on CUDA.
    dtype = dtype or (torch.float16 if device.startswith("cuda") else torch.float32)
    qcfg = cfg.get("quantization_config") or {}
    if qcfg.get("quant_method") == "quantpipe":
        try:
            from quantpipe.runtime.loader import load_quantized_model
        except ImportError as exc:
            raise ValueError(
                f"{folder} is a quantpipe quantized folder but runtime.loader is not available "
                f"({exc}); serve the FP16 folder instead"
            ) from exc
        # a half head on CPU reads the checkpoint's fp16 table as it is: loading it as fp32
        # first would double the largest tensors at the peak
        model = load_quantized_model(folder, device, dtype, keep_fp16_embeddings=(
            device == "cpu" and head_dtype != "fp32"), verify=verify)
        if device == "cpu":
            # the engine's stacked q/k/v and gate/up, made now: before the head is made, a
            # part's copy is not on top of the whole model
            stack_projections(model)
    elif qcfg:
        raise ValueError(f"{folder} uses quant_method {qcfg.get('quant_method')!r}; the engine "
                         "serves FP16 folders and quantpipe-native quantized folders")
    else:
        check_folder_config(folder)  # an absurd size would be built for minutes first
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, use_safetensors=True, trust_remote_code=False
        ).to(device)
    set_half_head(model, head_dtype if device == "cpu" else "fp32", act_dtype=dtype)
    release_freed_memory()  # the load's temporaries and a replaced fp32 table
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    return model.eval(), tok
