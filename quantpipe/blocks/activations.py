"""Block activations of the calibration set, in RAM or in a file when they exceed the budget.

Calibration carries every sample's hidden states from block to block: ``[samples, seq_len,
hidden]`` fp32, 64 MB for 128 x 512 tokens of a 135M model but 17 GB for 128 x 4096 tokens of
a 70B one (hidden 8192), and a block's inputs and outputs are alive together (GPTAQ: the FP
model's too). :class:`Activations` holds one such set either as a tensor or, when the sets
would exceed ``--max-memory``, as a raw fp32 file in the calibration's work folder that is read
and written a batch of samples at a time (``run_block`` only ever needs one batch), so resident
memory stays one batch whatever the calibration set's size. Reads go through the page cache,
which the kernel gives back under pressure; no mapping of the file is kept.

The sets live on the CPU whatever ``--device`` is (quantpipe.blocks.device): a block on a GPU
reads them a batch at a time and its outputs come back through :meth:`Activations.write`.

A spilled set is written to ``<name>.f32.tmp`` and becomes ``<name>.f32`` only when
:meth:`Activations.commit` renames it, after every batch was written: a killed run never leaves
a half-written file under the final name (resume reads only committed files).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from quantpipe.blocks.device import HOST, to_host

# default --max-memory for the activations: this fraction of the memory available at start
DEFAULT_MEMORY_FRACTION = 0.25
_FP32 = 4


class Activations:
    """``[n, L, d]`` fp32 activations: a tensor, or a file read and written by sample ranges."""

    def __init__(self, shape: tuple[int, int, int], tensor: torch.Tensor | None = None,
                 path: Path | None = None) -> None:
        if (tensor is None) == (path is None):
            raise ValueError("Activations hold either a tensor or a file")
        self.shape = tuple(int(s) for s in shape)
        self.tensor = tensor
        self.path = path  # the committed file (written to path.tmp until commit)
        self._row = self.shape[1] * self.shape[2]  # values per sample

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def of(cls, tensor: torch.Tensor) -> Activations:
        return cls(tuple(tensor.shape), tensor=tensor.float().contiguous())

    @classmethod
    def new(cls, shape: tuple[int, int, int], spill: Path | None) -> Activations:
        """An empty set to be filled with :meth:`write`: in RAM, or (``spill`` a path without
        suffix) in ``spill.f32.tmp``, sized up front (a full disk fails here, not mid-block)."""
        if spill is None:
            return cls(shape, tensor=torch.empty(shape, dtype=torch.float32, device=HOST))
        path = spill.with_suffix(".f32")
        tmp = _tmp(path)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        size = shape[0] * shape[1] * shape[2] * _FP32
        with open(tmp, "wb") as f:
            f.truncate(size)
            if size and hasattr(os, "posix_fallocate"):  # blocks reserved: a full disk fails now
                os.posix_fallocate(f.fileno(), 0, size)
        return cls(shape, path=path)

    @classmethod
    def open(cls, path: Path, shape: tuple[int, int, int]) -> Activations:
        """A committed file of ``shape`` (resume); its size is checked against the shape."""
        size = shape[0] * shape[1] * shape[2] * _FP32
        if not path.is_file() or path.stat().st_size != size:
            raise ValueError(f"{path}: not the {shape} fp32 activations this run saved "
                             "(missing or truncated); delete the calibration's work folder "
                             "to start again")
        return cls(shape, path=path)

    # --- access ---------------------------------------------------------------------------
    @property
    def in_memory(self) -> bool:
        return self.tensor is not None

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self._row * _FP32

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Samples ``start:stop`` as a [stop - start, L, d] fp32 tensor."""
        stop = min(stop, self.shape[0])
        if self.tensor is not None:
            return self.tensor[start:stop]
        out = torch.empty((stop - start, *self.shape[1:]), dtype=torch.float32, device=HOST)
        path = self.path if self.path.is_file() else _tmp(self.path)
        with open(path, "rb") as f:
            f.seek(start * self._row * _FP32)
            n = f.readinto(memoryview(out.numpy()).cast("B"))
        if n != out.numel() * _FP32:
            raise ValueError(f"{path}: short read at sample {start} (file truncated?)")
        return out

    def write(self, start: int, values: torch.Tensor) -> None:
        """Samples ``start : start + len(values)`` = values ([k, L, d], on any device: the
        set keeps a CPU copy)."""
        if tuple(values.shape[1:]) != self.shape[1:] or start + values.shape[0] > self.shape[0]:
            raise ValueError(f"cannot write {tuple(values.shape)} at sample {start} into "
                             f"{self.shape}")
        values = to_host(values.detach())
        if self.tensor is not None:
            self.tensor[start:start + values.shape[0]] = values
            return
        data = values.to(torch.float32).contiguous()
        with open(_tmp(self.path), "r+b") as f:
            f.seek(start * self._row * _FP32)
            f.write(memoryview(data.numpy()).cast("B"))

    def commit(self) -> None:
        """A spilled set's file takes its final name (durably); no-op in RAM."""
        if self.tensor is None and _tmp(self.path).is_file():
            with open(_tmp(self.path), "r+b") as f:
                os.fsync(f.fileno())
            os.replace(_tmp(self.path), self.path)

    def materialize(self) -> torch.Tensor:
        """The whole set as a tensor (reads a spilled file whole: only for small sets)."""
        return self.tensor if self.tensor is not None else self.read(0, self.shape[0])


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def activation_budget(max_memory: int | None) -> int:
    """Bytes the calibration's activations may hold in RAM: ``max_memory``, or
    ``DEFAULT_MEMORY_FRACTION`` of the memory available now."""
    if max_memory is not None:
        return int(max_memory)
    import psutil

    return int(DEFAULT_MEMORY_FRACTION * psutil.virtual_memory().available)


def spills(shape: tuple[int, int, int], live_sets: int, budget: int) -> bool:
    """Whether ``live_sets`` sets of ``shape`` fp32 activations exceed ``budget`` bytes."""
    return live_sets * shape[0] * shape[1] * shape[2] * _FP32 > budget


STATE_FILE = "hidden.safetensors"  # in-RAM sets and the token ids, saved after each block
IDS_FILE = "input_ids.safetensors"  # the token ids of a spilled run
BLOCK_KEY = "block"  # metadata of either file: the block whose inputs the state holds


class ActivationSpace:
    """Where one calibration run keeps its block activations, and the resume state.

    In RAM (``spill`` False) the sets are tensors and, after each block, the next block's
    inputs are saved with the token ids in ``folder/hidden.safetensors`` (atomically). Spilled,
    each set is ``folder/<key>-<block>.f32`` (the inputs of ``block``), already on disk when the
    block that made it finishes; saving rewrites the token ids (atomically) and then deletes
    the previous block's files. A resume reads either layout, whichever this run uses.

    The state names the block whose inputs it holds (``block`` in the metadata of the file
    written last, :func:`saved_block`): a run killed after saving but before its progress file
    moved on resumes from the state's block, never from another block's inputs."""

    def __init__(self, folder: Path, shape: tuple[int, int, int], spill: bool) -> None:
        self.folder = folder
        self.shape = tuple(int(s) for s in shape)
        self.spill = spill

    def new(self, key: str, block: int) -> Activations:
        """An empty set for the inputs of ``block`` under ``key`` ("hidden", "hidden_fp")."""
        return Activations.new(self.shape, self.folder / f"{key}-{block}" if self.spill
                               else None)

    def wrap(self, key: str, block: int, tensor: torch.Tensor) -> Activations:
        """``tensor`` [n, L, d] as this space holds sets (written out when spilled)."""
        if not self.spill:
            return Activations.of(tensor)
        acts = self.new(key, block)
        acts.write(0, tensor)
        acts.commit()
        return acts

    def save(self, block: int, hiddens: dict[str, Activations],
             input_ids: torch.Tensor) -> None:
        """Make ``hiddens`` (the inputs of ``block``) the resume state."""
        from quantpipe.core.io import save_safetensors_atomic

        self.folder.mkdir(parents=True, exist_ok=True)
        # the rename of this one file moves the state to ``block`` (its sets are on disk by
        # now); only then are the files of the earlier state removed
        meta = {BLOCK_KEY: str(block)}
        if not self.spill:
            save_safetensors_atomic({**{k: a.materialize() for k, a in hiddens.items()},
                                     "input_ids": input_ids}, self.folder / STATE_FILE, meta)
        else:
            save_safetensors_atomic({"input_ids": input_ids}, self.folder / IDS_FILE, meta)
        keep = {a.path.name for a in hiddens.values() if not a.in_memory}
        for f in self.folder.glob("*.f32*"):  # earlier blocks' sets, unfinished temporaries
            if f.name not in keep:
                f.unlink()
        # the other layout's file (a run resumed with another --max-memory) is stale now
        (self.folder / (STATE_FILE if self.spill else IDS_FILE)).unlink(missing_ok=True)

    @staticmethod
    def saved_block(folder: Path) -> int | None:
        """The block whose inputs ``folder``'s resume state holds (either layout; the in-RAM
        file first, as :meth:`load` reads it), or None: no state, or one written before
        states named their block (it cannot be matched to a block, so it is not resumed)."""
        from safetensors import safe_open

        for name in (STATE_FILE, IDS_FILE):
            if (folder / name).is_file():
                with safe_open(str(folder / name), framework="pt") as f:
                    block = (f.metadata() or {}).get(BLOCK_KEY)
                return int(block) if block is not None else None
        return None

    def load(self, block: int, keys: tuple[str, ...]
             ) -> tuple[dict[str, Activations], torch.Tensor]:
        """The saved inputs of ``block`` (either layout) as this space holds sets, and the ids."""
        from safetensors.torch import load_file

        saved = self.saved_block(self.folder)
        if saved != block:
            raise ValueError(f"{self.folder}: the saved calibration state holds the inputs of "
                             f"block {saved}, not of block {block}; delete the calibration's "
                             "work folder to start again")
        if (self.folder / STATE_FILE).is_file():
            saved = load_file(str(self.folder / STATE_FILE))
            ids = saved.pop("input_ids")
            return {k: self.wrap(k, block, saved[k]) for k in keys}, ids
        ids = load_file(str(self.folder / IDS_FILE))["input_ids"]
        sets = {k: Activations.open(self.folder / f"{k}-{block}.f32", self.shape) for k in keys}
        if not self.spill:  # this run keeps them in RAM
            sets = {k: Activations.of(a.materialize()) for k, a in sets.items()}
        return sets, ids
