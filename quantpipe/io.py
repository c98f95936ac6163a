"""Atomic folder and file writes, hashing, sharded safetensors and manifests.

Every stage writes its output folder through :func:`atomic_output_dir`: files go into a hidden
temporary folder beside the target, the manifest (``quantpipe.json``) is written last, and the
folder is renamed into place only when everything succeeded. A killed run therefore never leaves
a folder at the target path that looks valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

MANIFEST_NAME = "quantpipe.json"
MANIFEST_VERSION = 1


class OutputExistsError(ValueError):
    pass


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str | os.PathLike, obj: object) -> None:
    """Write JSON to ``path`` via a temp file + rename (never a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=False, ensure_ascii=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; outputs are ordinary readable files
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save_safetensors_atomic(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None
) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def check_output_dir(out: str | os.PathLike, force: bool) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputExistsError(
            f"{out} exists and is not empty; pass --force to replace it or choose another --out"
        )
    return out


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temp folder beside ``out``; rename it to ``out`` on success, delete on failure."""
    out = check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700 folders
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        # --force: move the old folder aside first so that a crash here loses nothing.
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def parse_size(text: str | int) -> int:
    """'2GB' -> 2_000_000_000, '500MiB' -> 524_288_000, 1024 -> 1024."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().replace(" ", "")
    units = {
        "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
        "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1,
    }
    for unit, mult in units.items():
        if s.endswith(unit):
            num = s[: -len(unit)]
            break
    else:
        num, mult = s, 1
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"cannot read size {text!r}; write it like 2GB, 500MB or 1GiB") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return int(value * mult)


def save_sharded(
    state_dict: dict[str, torch.Tensor],
    out_dir: str | os.PathLike,
    max_shard_size: int | str = "2GB",
    prefix: str = "model",
) -> list[dict]:
    """Write ``state_dict`` as HF-style shards + ``{prefix}.safetensors.index.json``.

    Returns one entry per shard: ``{"file", "sha256", "bytes", "tensors"}``. Shards are always
    named ``model-0000i-of-0000n.safetensors`` (also for a single shard) so loaders and the
    manifest see one layout.
    """
    out_dir = Path(out_dir)
    limit = parse_size(max_shard_size)
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    weight_map: dict[str, str] = {}
    entries = []
    total = 0
    for i, names in enumerate(shards, start=1):
        fname = f"{prefix}-{i:05d}-of-{n:05d}.safetensors"
        save_safetensors_atomic(
            {k: state_dict[k] for k in names}, out_dir / fname, metadata={"format": "pt"}
        )
        for k in names:
            weight_map[k] = fname
        nbytes = (out_dir / fname).stat().st_size
        total += sum(state_dict[k].numel() * state_dict[k].element_size() for k in names)
        entries.append(
            {"file": fname, "sha256": sha256_file(out_dir / fname), "bytes": nbytes,
             "tensors": len(names)}
        )
    write_json_atomic(
        out_dir / f"{prefix}.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )
    return entries


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for pkg in ("quantpipe", "torch", "transformers", "safetensors", "accelerate", "gguf"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def write_manifest(out_dir: str | os.PathLike, stage: str, **fields: object) -> dict:
    """Write the versioned ``quantpipe.json`` manifest (last file of every stage)."""
    manifest = {
        "format": "quantpipe",
        "version": MANIFEST_VERSION,
        "stage": stage,
        **fields,
        "packages": package_versions(),
    }
    write_json_atomic(Path(out_dir) / MANIFEST_NAME, manifest)
    return manifest


def read_manifest(folder: str | os.PathLike, expect_stage: str | None = None) -> dict:
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise ValueError(
            f"{folder} has no {MANIFEST_NAME}: it is not a finished quantpipe output "
            "(or the run that wrote it was interrupted); re-run the stage that makes it"
        )
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format") != "quantpipe" or manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(
            f"{path}: unsupported manifest (format={manifest.get('format')!r}, "
            f"version={manifest.get('version')!r}); this quantpipe reads version "
            f"{MANIFEST_VERSION}"
        )
    if expect_stage is not None and manifest.get("stage") != expect_stage:
        raise ValueError(
            f"{folder} holds the output of stage {manifest.get('stage')!r}, "
            f"expected {expect_stage!r}"
        )
    return manifest


def verify_shard_hashes(folder: str | os.PathLike, shards: list[dict]) -> None:
    """Raise ValueError naming the first shard whose size or sha256 differs from the manifest."""
    folder = Path(folder)
    for entry in shards:
        path = folder / entry["file"]
        if not path.is_file():
            raise ValueError(f"{path}: missing shard listed in {MANIFEST_NAME}")
        if path.stat().st_size != entry["bytes"]:
            raise ValueError(
                f"{path}: {path.stat().st_size} bytes, manifest says {entry['bytes']} "
                "(truncated or replaced file)"
            )
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise ValueError(
                f"{path}: sha256 {digest[:16]}... does not match the manifest's "
                f"{entry['sha256'][:16]}... (corrupted file)"
            )
