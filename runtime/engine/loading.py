"""Model folders -> (model, tokenizer) ready for the engine: FP16 exports and quantpipe folders."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from quantpipe.core.config_check import check_folder_config
from quantpipe.core.heap import release_freed_memory
from quantpipe.runtime.engine.model_runner import stack_projections
from quantpipe.runtime.fp_head import set_half_head, set_half_linears
from quantpipe.runtime.kernels import cpu_ext

log = logging.getLogger(__name__)


def load_model_for_serving(model_dir: str | Path, device: str = "cpu",
                           dtype: torch.dtype | None = None, head_dtype: str = "fp32",
                           verify: bool = True):
    """(model, tokenizer) from an FP16 export or a quantpipe quantized folder.

    An FP16 export on CPU is built tensor by tensor (:func:`_fp16_model`); with a half head
    (``head_dtype`` other than fp32) and fp32 activations its linear layers keep the
    checkpoint's fp16 weights and run on quantpipe's ``fp16_mm`` (``runtime.fp_head.
    set_half_linears``: the same products, fp32 sums, half the memory of an fp32 copy).

    ``head_dtype``: precision of the embedding table and output head on CPU
    (``runtime.fp_head``; fp32 = the model's dtype, unchanged). On CUDA the whole model already
    runs in fp16 and ``head_dtype`` is ignored. ``verify=False``: a quantized folder's
    hashes and values are not checked (``runtime.loader.read_packed``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

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
        if device == "cpu":
            model = _fp16_model(folder, cfg, dtype, half=head_dtype != "fp32")
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=dtype, use_safetensors=True, trust_remote_code=False
            ).to(device)
    if (folder / "generation_config.json").is_file():  # its EOS ids end answers (detokenize)
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    set_half_head(model, head_dtype if device == "cpu" else "fp32", act_dtype=dtype)
    release_freed_memory()  # the load's temporaries and a replaced fp32 table
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    return model.eval(), tok


def _fp16_model(folder: Path, cfg: dict, dtype: torch.dtype, half: bool) -> torch.nn.Module:
    """An FP16 export on CPU in ``dtype``, built tensor by tensor (each read with its file
    mapped for that read only: ``from_pretrained`` also kept the mapped shards resident, the
    Llama-2-7B shape in bf16 peaked at 23.0 GB of RSS that way, 13.7 GB this way;
    bench/report_memory.py). ``half``: the embedding table and head stay fp16 (``set_half_head``
    reads them), and so do the linear layers where they can run as stored (fp32 activations
    and the kernels: :func:`set_half_linears`)."""
    from quantpipe.core.formats.loader import model_tensors
    from quantpipe.core.hf_model import build_causal_lm
    from quantpipe.core.io import LazyTensors

    linears = half and dtype == torch.float32 and cpu_ext.kernel_status()[0]
    lazy = LazyTensors.of_folder(folder)
    model = build_causal_lm(cfg, model_tensors(cfg, ((k, lazy[k]) for k in lazy)), dtype,
                            where=folder, keep_fp16_embeddings=half, keep_fp16_linears=linears)
    if linears:
        n = set_half_linears(model)
        log.info("%s: %d linear layers run on their fp16 weights (fp16_mm, fp32 sums)", folder, n)
    return model
