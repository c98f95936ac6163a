"""Atomic folder and file writes, output locks, hashing, sharded safetensors and manifests.

Every stage writes its output folder through :func:`atomic_output_dir`: files go into a hidden
temporary folder beside the target, the manifest (``quantpipe.json``) is written last, and the
folder is renamed into place only when everything succeeded. A killed run therefore never leaves
a folder at the target path that looks valid.

Around every write of an output folder ``DIR`` (and of files inside it, e.g. sensitivity.json)
the writer holds :func:`output_lock`: an exclusive ``flock`` on ``.DIR.lock`` beside it. The OS
drops the lock when the process dies, so a SIGKILL never leaves a stale lock; a second writer
fails at once with the holder's pid. Under the lock, hidden ``.DIR.partial-*`` / ``.DIR.old-*``
folders left by killed runs are removed (or, for an interrupted swap, put back).

Failed writes (disk full, permission denied) raise ``OSError`` naming the file and remove their
temporary files.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)

MANIFEST_NAME = "quantpipe.json"
MANIFEST_VERSION = 1


class OutputExistsError(ValueError):
    pass


class OutputLockedError(ValueError):
    """Another process holds the output lock of the folder."""


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22,
                progress: Callable[[int], object] | None = None) -> str:
    """Hex sha256 of a file; ``progress(n)`` is called with each chunk's byte count."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if progress is not None:
                progress(len(block))
    return h.hexdigest()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text (UTF-8) to ``path`` via a temp file + rename (never a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; outputs are ordinary readable files
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        _raise_write_error(exc, path)


def write_json_atomic(path: str | os.PathLike, obj: object) -> None:
    """Write JSON to ``path`` via a temp file + rename (never a half-written file)."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False)
                      + "\n")


def save_safetensors_atomic(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None
) -> None:
    """Write a safetensors file via a temp file + rename; on failure remove the temp file and
    raise ``OSError`` naming ``path`` (safetensors reports I/O errors as ``SafetensorError``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        _raise_write_error(exc, path)


def _raise_write_error(exc: BaseException, path: Path) -> None:
    """Re-raise a failed write of ``path`` as an ``OSError`` that names it (when it is one)."""
    if isinstance(exc, OSError):
        if exc.filename:
            raise exc
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    # safetensors' Rust writer: "Error while serializing: I/O error: ... (os error 28)"
    m = re.search(r"os error (\d+)", str(exc)) if isinstance(exc, Exception) else None
    if m:
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc
    raise exc


def check_output_path(out: str | os.PathLike, option: str = "--out") -> None:
    """Refuse an output that is empty ('' reaches here as '.'), the current folder, a folder
    above it, the home folder or the root: a stage builds its output beside the target and
    renames it into place, so such a target fails late, or with --force would replace the
    folder the user is working in."""
    raw = os.fspath(out)
    if not raw.strip():
        raise ValueError(f"{option} is empty; give the path of a new folder or file")
    real = Path(raw).resolve()
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        what = "the current folder" if real == cwd else "a folder that holds the current folder"
    elif real == Path.home().resolve():
        what = "the home folder"
    elif real.parent == real:
        what = "the root folder"
    else:
        return
    raise ValueError(f"{option} {raw!r} names {what} ({real}); give a path inside it, such as "
                     f"{option} {Path(raw) / 'out'}")


def check_output_file(path: str | os.PathLike, option: str,
                      inputs: Mapping[str, str | os.PathLike | None] | None = None) -> None:
    """Before any slow work: ``path`` is not a folder, not one of ``inputs`` nor inside one
    (label -> path, see :func:`check_not_overlapping`), and its folder is (or can be made)
    writable, so that results are not lost at the end."""
    check_output_path(path, option)
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option} {path} is an existing folder; give a file path inside it")
    check_not_overlapping(path, inputs or {}, option)
    parent = path.parent
    while not parent.exists():  # the first existing ancestor: folders below it get created
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: {parent} is a file, not a folder; choose another "
                         "path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: {parent} is not writable (read-only file system or "
                         "no permission); choose a writable location")


def check_output_dir(out: str | os.PathLike, force: bool) -> Path:
    check_output_path(out)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputExistsError(
            f"{out} exists and is not empty; pass --force to replace it or choose another --out"
        )
    return out


def check_not_overlapping(
    out: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None], option: str = "--out",
    remedy: str | None = None,
) -> None:
    """Refuse an output (folder or file, given as ``option``) that is, is inside, or contains
    one of ``inputs``.

    ``inputs``: label shown to the user (e.g. "FP16_DIR") -> an input file or folder (None:
    skipped). Symlinks are resolved, so two spellings of one folder are caught. ``remedy``
    replaces "choose another OPTION" (for a folder the command writes beside ``--out``).
    """
    out_real = Path(out).resolve()
    for label, inp in inputs.items():
        if inp is None:
            continue
        in_real = Path(inp).resolve()
        if out_real == in_real:
            relation = "is"
        elif in_real in out_real.parents:
            relation = "is inside"
        elif out_real in in_real.parents:
            relation = "contains"
        else:
            continue
        raise ValueError(
            f"{option} {out} {relation} the input {label} ({inp}); writing it would overwrite "
            f"or delete that input: {remedy or 'choose another ' + option.split()[0]}"
        )


def _absolute(path: str | os.PathLike) -> Path:
    return Path(os.path.abspath(os.fspath(path)))  # normalises "..", keeps a symlinked leaf


def lock_file_for(out: str | os.PathLike) -> Path:
    """The lock file of output folder ``out``: ``.NAME.lock`` beside it."""
    out = _absolute(out)
    return out.parent.resolve() / f".{out.name}.lock"


_held_locks: dict[tuple[int, str], int] = {}  # (pid, lock file) -> nesting depth
_held_guard = threading.Lock()


@contextlib.contextmanager
def output_lock(out: str | os.PathLike) -> Iterator[None]:
    """Hold the exclusive write lock of output folder ``out`` (see the module docstring).

    Re-entrant within one process (a stage that locks ``out`` may call a writer that locks it
    again); raises :class:`OutputLockedError` at once when another process holds it.
    """
    path = lock_file_for(out)
    key = (os.getpid(), str(path))
    with _held_guard:
        depth = _held_locks.get(key, 0)
        _held_locks[key] = depth + 1
    fd = None
    try:
        if depth == 0:
            fd = _acquire_lock(path, out)
        yield
    finally:
        with _held_guard:
            _held_locks[key] -= 1
            if not _held_locks[key]:
                del _held_locks[key]
        if fd is not None:
            # unlink while still holding the lock: a process that opened the old file before
            # this sees on acquiring it that the path names another file, and retries
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)


def _acquire_lock(path: Path, out: str | os.PathLike) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputLockedError(
                f"{out} is being written by another quantpipe process (pid {holder}); wait for "
                "it to finish or choose another --out"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        st = os.fstat(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            break
        os.close(fd)  # the previous holder removed this file as we opened it: lock the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def clean_stale_temps(out: str | os.PathLike) -> None:
    """Remove ``.NAME.partial-*`` / ``.NAME.old-*`` folders of killed runs (hold the lock).

    Only a run holding the lock has such folders, so under the lock they are stale. If ``out``
    is missing and an ``.old-*`` folder exists, a run died between moving the old folder aside
    and renaming the new one into place: the old folder is put back, so nothing is lost.
    """
    out = _absolute(out)
    if not out.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(partial-[a-z0-9_]{{8}}|old-\d+)")
    stale = [p for p in out.parent.iterdir() if pattern.fullmatch(p.name)]
    olds = sorted((p for p in stale if ".old-" in p.name), key=lambda p: p.stat().st_mtime)
    if olds and not (out.exists() or out.is_symlink()):
        log.warning("restoring %s from %s (a replace was interrupted)", out, olds[-1].name)
        os.replace(olds[-1], out)
        stale.remove(olds[-1])
    for p in stale:
        log.info("removing %s, left by a killed run", p)
        _remove(p)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def replace_dir(tmp: str | os.PathLike, out: str | os.PathLike) -> None:
    """Rename the finished folder ``tmp`` to ``out``. An existing ``out`` is moved aside first
    and removed after, so a crash in between loses nothing (see :func:`clean_stale_temps`)."""
    tmp, out = Path(tmp), Path(out)
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        try:
            _remove(old)
        except OSError as exc:  # the new folder is in place; only the old copy is left over
            log.warning("could not remove %s (%s); delete it by hand", old, exc)
    else:
        os.replace(tmp, out)


@contextlib.contextmanager
def atomic_output_dir(
    out: str | os.PathLike,
    force: bool = False,
    inputs: Mapping[str, str | os.PathLike | None] | None = None,
) -> Iterator[Path]:
    """Yield a temp folder beside ``out``; rename it to ``out`` on success, delete on failure.

    Holds :func:`output_lock` throughout; refuses an ``out`` overlapping any of ``inputs``
    (label -> path, see :func:`check_not_overlapping`) before touching anything.
    """
    check_not_overlapping(out, inputs or {})
    out = check_output_dir(out, force)
    with output_lock(out):
        clean_stale_temps(out)
        check_output_dir(out, force)  # again: another run may have finished before the lock
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes 0700 folders
            yield tmp
            replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a model-sized folder: never left behind
            raise


def parse_size(text: str | int, option: str | None = None) -> int:
    """'2GB' -> 2_000_000_000, '500MiB' -> 524_288_000, 1024 -> 1024; errors name ``option``."""
    if isinstance(text, int):
        return text
    named = f"{option}: " if option else ""
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
        raise ValueError(f"{named}cannot read size {text!r}; write it like 2GB, 500MB or "
                         "1GiB") from None
    if not math.isfinite(value) or value * mult >= 2**63:  # inf, nan, 1e400GB
        raise ValueError(f"{named}size {text!r} is not a finite number of bytes; write it like "
                         "2GB, 500MB or 1GiB")
    if value <= 0:
        raise ValueError(f"{named}size {text!r} must be positive")
    return int(value * mult)


def save_sharded(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    max_shard_size: int | str = "2GB",
    prefix: str = "model",
) -> list[dict]:
    """Write ``state_dict`` as HF-style shards + ``{prefix}.safetensors.index.json``.

    Returns one entry per shard: ``{"file", "sha256", "bytes", "tensors"}``. Shards are always
    named ``model-0000i-of-0000n.safetensors`` (also for a single shard) so loaders and the
    manifest see one layout. Values are read one at a time (a lazy mapping such as
    :class:`LazyTensors` is never held whole).
    """
    return write_shards(((k, state_dict[k]) for k in state_dict), out_dir, max_shard_size,
                        prefix)


def write_shards(
    tensors: Iterable[tuple[str, torch.Tensor | ChunkedTensor]],
    out_dir: str | os.PathLike,
    max_shard_size: int | str = "2GB",
    prefix: str = "model",
) -> list[dict]:
    """:func:`save_sharded` for ``(name, tensor)`` pairs made on demand (a generator). Each
    tensor's bytes go to disk as it arrives (:class:`StreamingShard`), so one tensor is in
    memory at a time, whatever ``max_shard_size`` (a :class:`ChunkedTensor`: one of its
    chunks); a new shard starts when the next tensor would take the current one past
    ``max_shard_size``. Shards get their final ``-of-N`` names at the end."""
    out_dir = Path(out_dir)
    limit = parse_size(max_shard_size)
    written: list[tuple[Path, list[str], int]] = []  # finished file, names, tensor bytes

    def new_shard() -> StreamingShard:
        # the shard count is known only at the end: renamed to model-0000i-of-0000n then
        return StreamingShard(out_dir / f"{prefix}-{len(written) + 1:05d}.safetensors.partial")

    shard = new_shard()
    for name, t in tensors:
        nbytes = tensor_nbytes(t)
        if shard.names and shard.nbytes + nbytes > limit:
            written.append((shard.finish({"format": "pt"}), shard.names, shard.nbytes))
            shard = new_shard()
        shard.add(name, t)
        del t  # the bytes are on disk: nothing of this tensor stays in memory
    # the last shard (an empty state dict still gets one, as loaders expect)
    written.append((shard.finish({"format": "pt"}), shard.names, shard.nbytes))
    n = len(written)
    weight_map: dict[str, str] = {}
    entries = []
    for i, (tmp, names, _) in enumerate(written, start=1):
        fname = f"{prefix}-{i:05d}-of-{n:05d}.safetensors"
        os.replace(tmp, out_dir / fname)
        weight_map.update({k: fname for k in names})
        entries.append(
            {"file": fname, "sha256": sha256_file(out_dir / fname),
             "bytes": (out_dir / fname).stat().st_size, "tensors": len(names)}
        )
    write_json_atomic(
        out_dir / f"{prefix}.safetensors.index.json",
        {"metadata": {"total_size": sum(b for _, _, b in written)}, "weight_map": weight_map},
    )
    return entries


@dataclass(frozen=True)
class ChunkedTensor:
    """A tensor written to a shard in consecutive row-major chunks, never whole: the chunks'
    bytes, in order, are the tensor's (e.g. a MoE block's fused experts ``[E, 2I, H]``
    assembled from each expert's gate and up ``[I, H]``, one expert in memory at a time)."""

    shape: tuple[int, ...]  # of the whole tensor
    dtype: torch.dtype  # of every chunk
    chunks: Callable[[], Iterator[torch.Tensor]]  # made on demand, one at a time

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize


def tensor_nbytes(t: torch.Tensor | ChunkedTensor) -> int:
    return t.numel() * t.element_size()


_ST_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
              torch.float64: "F64", torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16",
              torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}


class StreamingShard:
    """One safetensors file written a tensor at a time.

    The format puts the JSON header (names, dtypes, shapes, byte offsets) before the data, and
    the header is known only when the last tensor has arrived; so each tensor's bytes are
    appended to a data file beside ``path`` as it arrives, and :meth:`finish` writes the
    8-byte header length, the header (padded with spaces to 8 bytes) and then copies the data
    file behind it. Memory: one tensor; disk: the shard twice while it is finished.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.names: list[str] = []
        self.nbytes = 0
        self._header: dict[str, dict] = {}
        self._data_path = path.with_name(f".{path.name}.data")
        self._data = open(self._data_path, "wb")  # noqa: SIM115  (closed in finish/abort)

    def add(self, name: str, t: torch.Tensor | ChunkedTensor) -> None:
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
        chunks = t.chunks() if isinstance(t, ChunkedTensor) else iter((t,))
        written = 0
        try:
            for chunk in chunks:
                assert chunk.dtype == t.dtype, f"{name}: {chunk.dtype} chunk of a {t.dtype} tensor"
                flat = chunk.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes] raw
                write_bytes(self._data, flat.numpy())
                written += flat.numel()
                del chunk, flat  # on disk: the next chunk is made only now
        except BaseException as exc:
            self.abort()
            _raise_write_error(exc, self.path)
        assert written == tensor_nbytes(t), f"{name}: {written} bytes for shape {t.shape}"
        end = self.nbytes + written
        self._header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.nbytes, end]}
        self.names.append(name)
        self.nbytes = end

    def finish(self, metadata: dict[str, str]) -> Path:
        """Write the shard file (temp + rename); returns its path."""
        header = json.dumps({"__metadata__": metadata, **self._header},
                            separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self._data.close()
            with open(tmp, "wb") as out, open(self._data_path, "rb") as data:
                write_bytes(out, len(header).to_bytes(8, "little") + header)
                shutil.copyfileobj(data, out, 1 << 24)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            self.abort()
            _raise_write_error(exc, self.path)
        os.unlink(self._data_path)
        return self.path

    def abort(self) -> None:
        self._data.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._data_path)


def write_bytes(f, data) -> None:
    """``f.write(data)``: one place for tests to simulate a full disk."""
    f.write(data)


# bytes per element of each safetensors dtype (header strings)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
                "F64": 8}


def safetensors_files(folder: str | os.PathLike) -> list[str]:
    """The shard files of a folder: from its index when there is one, else every file."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [p.name for p in sorted(folder.glob("*.safetensors"))]


def weights_bytes(folder: str | os.PathLike) -> int:
    """Bytes of a folder's ``*.safetensors`` files: a checkpoint's size on disk."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


class LazyTensors(Mapping):
    """The tensors of a folder's safetensors files, each read from the mmapped file on access.

    Nothing is held in memory between accesses, so checking, converting or writing a model
    tensor by tensor needs one tensor (or one layer) at a time, not the whole checkpoint.
    """

    def __init__(self, folder: str | os.PathLike, where: dict[str, str],
                 keys: set[str] | None = None, prefix: str = ""):
        """``where``: stored tensor name -> file; ``prefix`` is dropped from the names this
        mapping shows (a block file's ``fp.NAME`` is ``NAME`` here)."""
        self._folder = Path(folder)
        self._prefix = prefix
        self._where = {k[len(prefix):]: f for k, f in where.items() if k.startswith(prefix)}
        self._keys = set(self._where) if keys is None else keys

    @classmethod
    def of_folder(cls, folder: str | os.PathLike) -> LazyTensors:
        where: dict[str, str] = {}
        for fname in safetensors_files(folder):
            with safe_open(str(Path(folder) / fname), framework="pt") as f:
                where.update({k: fname for k in f.keys()})
        return cls(folder, where)

    def _header(self, key: str, fn):
        """``fn(open file)`` for ``key``'s file. The file is opened (mmapped) for this call
        only: a handle kept open would keep every page read so far mapped, and the process's
        RSS would grow to the whole checkpoint as it is streamed."""
        with safe_open(str(self._folder / self._where[key]), framework="pt") as f:
            return fn(f)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._header(key, lambda f: f.get_tensor(self._prefix + key))

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._where if k in self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's shape from the file header (nothing is read)."""
        return tuple(self._header(key, lambda f: f.get_slice(self._prefix + key).get_shape()))

    def nbytes(self, key: str) -> int:
        """Stored bytes of one tensor, from the file header (nothing is read)."""
        shape, dtype = self._header(key, lambda f: (f.get_slice(self._prefix + key).get_shape(),
                                                    f.get_slice(self._prefix + key).get_dtype()))
        return math.prod(shape) * _DTYPE_BYTES[dtype]

    def without(self, drop: set[str]) -> LazyTensors:
        stored = {self._prefix + k: f for k, f in self._where.items()}
        return LazyTensors(self._folder, stored, self._keys - drop, self._prefix)

    def mapped(self, key: str) -> torch.Tensor | None:
        """``key`` as a read-only memory map of its file (:func:`map_safetensors_tensor`):
        no copy is made, and only the pages read become resident. None where the bytes cannot
        be viewed in place (unaligned, empty)."""
        if key not in self._keys:
            raise KeyError(key)
        return map_safetensors_tensor(self._folder / self._where[key], self._prefix + key)


# safetensors header dtype -> torch dtype (the inverse of _ST_DTYPES)
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}
ST_TORCH_DTYPES = _ST_TORCH  # public: the verifier reads dtypes from headers
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def _tensor_entry(path: Path, name: str) -> tuple[torch.dtype | None, list[int], int, int]:
    """(dtype, shape, first byte, end byte) of ``name`` in the file, from its header (dtype
    None: one torch has no name for here); a ValueError naming the file when the header is
    unreadable or does not fit the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or n > min(size - 8, _MAX_HEADER):
            raise ValueError(f"{path}: not a safetensors file or truncated ({size} bytes; "
                             f"header length field {n})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable safetensors header ({exc})") from None
    entry = header.get(name) if isinstance(header, dict) else None
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: no tensor {name!r} in its header")
    try:
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(o) for o in entry["data_offsets"])
        itemsize = _DTYPE_BYTES[entry["dtype"]]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: {name}: malformed header entry {entry}") from None
    need = math.prod(shape) * itemsize
    if begin < 0 or end - begin != need or min(shape, default=1) < 0:
        raise ValueError(f"{path}: {name}: data_offsets [{begin}, {end}] do not hold its "
                         f"{entry['dtype']} shape {shape} ({need} bytes)")
    first = 8 + n + begin
    if first + need > size:
        raise ValueError(f"{path}: {name} ends at byte {first + need} but the file has "
                         f"{size} bytes (truncated)")
    return _ST_TORCH.get(entry["dtype"]), shape, first, first + need


def map_safetensors_tensor(path: str | os.PathLike, name: str) -> torch.Tensor | None:
    """Tensor ``name`` of a safetensors file, viewing the file's bytes through a read-only
    memory map (no copy): a page becomes resident when it is read, as a clean file page the
    kernel may drop again. For tables of which each step reads a few rows.

    The header is checked against the file first (a truncated or malformed file is a
    ValueError naming it). The mapping is read-only: writing into the tensor is a crash, not
    a change of the file. The file must not be truncated in place while it is mapped (stages
    replace files by rename, which keeps the mapped one). None where the bytes cannot be
    viewed in place: an empty tensor, data not aligned to its element size, or a dtype
    without a torch counterpart here.
    """
    import warnings

    import numpy as np

    path = Path(path)
    dtype, shape, first, end = _tensor_entry(path, name)
    if dtype is None or first == end or first % dtype.itemsize:
        return None
    words = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    mm = np.memmap(path, dtype=words, mode="r", offset=first, shape=tuple(shape))
    with warnings.catch_warnings():  # torch warns that it cannot mark the tensor read-only
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(mm)  # shares the mapping; keeps it alive
    return raw.view(dtype)


class KeyedView(Mapping):
    """A read-on-access Mapping whose keys, order and length are those of ``self._keys_of``
    (set by the subclass); the subclass reads the values."""

    _keys_of: Mapping

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys_of)

    def __len__(self) -> int:
        return len(self._keys_of)

    def __contains__(self, key: object) -> bool:
        return key in self._keys_of


class Overlay(KeyedView):
    """``base`` with some tensors replaced by ``overrides`` (cast to the base tensor's dtype),
    in ``base``'s order; both are read on access."""

    def __init__(self, base: Mapping[str, torch.Tensor], overrides: Mapping[str, torch.Tensor],
                 dtype: torch.dtype) -> None:
        unknown = [k for k in overrides if k not in base]
        assert not unknown, f"overrides of tensors the base does not have: {unknown[:3]}"
        self._base, self._overrides, self._dtype = base, overrides, dtype
        self._keys_of = base

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self._overrides:
            return self._overrides[key].to(self._dtype)
        return self._base[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tensor_shape(self._base, key)


def tensor_shape(state: Mapping[str, torch.Tensor], key: str) -> tuple[int, ...]:
    """Shape of ``state[key]``, read from the file header when ``state`` is lazy."""
    if isinstance(state, (LazyTensors, Overlay)):
        return state.shape(key)
    return tuple(state[key].shape)


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


def verify_shard_hashes(
    folder: str | os.PathLike, shards: list[dict], recorded_by: str | None = None,
    progress: Callable[[int], object] | None = None,
) -> None:
    """Raise ValueError naming the first shard whose size or sha256 differs from ``shards``.

    ``shards``: entries ``{"file", "sha256"[, "bytes"]}`` from the folder's manifest, or the
    hashes another stage recorded (``recorded_by`` names it in the error). Hashing reads every
    byte (I/O-bound); the time is logged at info level. ``progress``: see :func:`sha256_file`.
    """
    folder = Path(folder)
    t0 = time.perf_counter()
    total = 0
    for entry in shards:
        path = folder / entry["file"]
        if not path.is_file():
            raise ValueError(f"{path}: missing shard listed in {recorded_by or MANIFEST_NAME}")
        size = path.stat().st_size
        if "bytes" in entry and size != entry["bytes"]:
            raise ValueError(
                f"{path}: {size} bytes, {recorded_by or 'manifest'} says {entry['bytes']} "
                "(truncated or replaced file)"
            )
        digest = sha256_file(path, progress=progress)
        if digest != entry["sha256"] and recorded_by is None:
            raise ValueError(
                f"{path}: sha256 {digest[:16]}... does not match the manifest's "
                f"{entry['sha256'][:16]}... (corrupted file)"
            )
        if digest != entry["sha256"]:
            raise ValueError(
                f"{path}: sha256 {digest[:16]}... does not match {entry['sha256'][:16]}... "
                f"recorded in {recorded_by} (the file changed since); restore it or redo that "
                "stage from this folder"
            )
        total += size
    log.info("checked sha256 of %d shard(s) in %s (%.1f MB) in %.2f s", len(shards), folder,
             total / 1e6, time.perf_counter() - t0)
