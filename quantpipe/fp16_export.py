"""Stage 1: export the reference FP16 (or BF16) checkpoint that every later stage reads."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantpipe.io import (
    atomic_output_dir,
    save_sharded,
    sha256_file,
    write_manifest,
)
from quantpipe.sources import DTYPES, load_model, load_tokenizer, resolve_source

log = logging.getLogger(__name__)

FP16_MAX = torch.finfo(torch.float16).max  # 65504


@dataclass(frozen=True)
class Fp16ExportSpec:
    source: str  # folder, .gguf file or "smollm2-135m"
    out: Path  # output folder (must not exist or be empty unless force)
    dtype: str = "fp16"  # "fp16" or "bf16"
    max_shard_size: str = "2GB"  # per-shard byte limit, e.g. "2GB", "500MB"
    force: bool = False  # replace a non-empty output folder
    trust_remote_code: bool = False  # never on unless asked

    def __post_init__(self) -> None:
        if self.dtype not in ("fp16", "bf16"):
            raise ValueError(f"dtype {self.dtype!r} is not supported; use fp16 or bf16")


@dataclass(frozen=True)
class Fp16ExportResult:
    out: Path
    num_parameters: int
    shards: list[dict]
    seconds: float


def _convert_in_place(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters one by one (never two full copies), refusing fp16 overflow."""
    for name, p in tqdm(list(model.named_parameters()), desc="casting", unit="tensor",
                        leave=False):
        if dtype == torch.float16 and p.dtype != torch.float16 and p.numel():
            amax = p.detach().abs().max().item()
            if not amax <= FP16_MAX:  # also catches NaN
                raise ValueError(
                    f"tensor {name} has |value| up to {amax:.4g}, beyond the fp16 range "
                    f"({FP16_MAX:.0f}); export with --dtype bf16 instead"
                )
        p.data = p.data.to(dtype)
    for name, b in model.named_buffers():
        if b.is_floating_point():
            b.data = b.data.to(dtype)


def unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without tied duplicates (``lm_head.weight`` when tied to the embeddings)."""
    seen: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = t.data_ptr()
        if t.numel() and key in seen:
            continue
        seen[key] = name
        out[name] = t
    return out


def export_fp16(spec: Fp16ExportSpec) -> Fp16ExportResult:
    """Write the FP16 folder; bad input fails before ``spec.out`` is touched, and the whole
    export runs under the output lock inside a hidden temp folder (see quantpipe.io)."""
    t0 = time.perf_counter()
    src = resolve_source(spec.source)
    dtype = DTYPES[spec.dtype]
    # checks --out (not the source, not inside or around it; empty unless --force) and takes
    # the output lock before the slow load; SOURCE is the model folder or the .gguf file
    with atomic_output_dir(spec.out, spec.force, inputs={"SOURCE": src.path}) as tmp:
        log.info("loading %s (%s)", src.path, src.kind)
        tokenizer = load_tokenizer(src, spec.trust_remote_code)
        model = load_model(src, "auto", spec.trust_remote_code)
        _convert_in_place(model, dtype)
        model.config.dtype = dtype
        state = unique_state_dict(model)
        n_params = sum(t.numel() for t in state.values())
        src_hash_file = src.hash_target()
        log.info("hashing source %s", src_hash_file)
        src_sha = sha256_file(src_hash_file) if src_hash_file else None
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        log.info("writing %d tensors (%d parameters)", len(state), n_params)
        shards = save_sharded(state, tmp, spec.max_shard_size)
        write_manifest(
            tmp,
            stage="fp16",
            source={"name": spec.source, "kind": src.kind, "path": str(src.path),
                    "sha256": src_sha,
                    "sha256_of": src_hash_file.name if src_hash_file else None},
            dtype=spec.dtype,
            model_type=model.config.model_type,
            num_parameters=n_params,
            tie_word_embeddings=bool(getattr(model.config, "tie_word_embeddings", False)),
            shards=shards,
        )
    seconds = time.perf_counter() - t0
    log.info("wrote %s in %.1fs", spec.out, seconds)
    return Fp16ExportResult(Path(spec.out), n_params, shards, seconds)
