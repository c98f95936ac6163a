"""The resume point of the block-by-block sensitivity measurement (:mod:`.sensitivity_stream`).

On a 7B model the measurement takes over half an hour and its file is written only at the end.
After each block, a hidden folder beside that file (``.sensitivity.json.partial``) holds what
the next block needs, so a killed run continues at its first unfinished block:

- ``state-<k>.safetensors``: the FP hidden states leaving block k-1 (the next block's input)
  and every probe carried through the first k blocks, written a tensor at a time;
- ``progress.json`` (written after the state it names, both atomically): ``k``, the numbers
  measured so far (each layer's changes, its output energy, each probe's change) and the
  ``key`` they belong to: the settings, the calibration's identity and the hash of the measured
  tokens (and the batch size, which sets the float summation order).

A folder whose key differs from the run's (other settings, a new calibration, other tokens), or
that cannot be read, is removed and the measurement starts over; ``--force`` starts over too.
The resumed numbers are those of an uninterrupted run (the same tensors, bit for bit).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from quantpipe.core.io import StreamingShard, write_json_atomic

log = logging.getLogger(__name__)

PROGRESS_VERSION = 1


def tokens_sha256(input_ids: torch.Tensor) -> str:
    """Hash of the measured token ids ([n, L] int64) and their shape."""
    ids = input_ids.detach().to(torch.int64).contiguous()
    h = hashlib.sha256(json.dumps(list(ids.shape)).encode())
    h.update(ids.numpy().tobytes())
    return h.hexdigest()


@dataclass
class StreamState:
    """Everything measured before block ``blocks_done`` and the next block's inputs."""

    blocks_done: int = 0
    hidden: torch.Tensor | None = None  # [n, L, d] fp32: FP input of block blocks_done
    probes: list[torch.Tensor] = field(default_factory=list)  # each [n_probe, L, d] fp32
    probe_change: list[float] = field(default_factory=list)  # one per finished block
    energy: dict[str, tuple[float, int]] = field(default_factory=dict)  # layer -> (sum, count)
    change: dict[str, dict[str, float]] = field(default_factory=dict)  # layer -> tag -> e
    by_block: list[list[str]] = field(default_factory=list)  # finished blocks' layer names
    seconds: float = 0.0  # spent on the finished blocks, by every run so far

    def numbers(self) -> dict:
        return {"blocks_done": self.blocks_done, "probe_change": self.probe_change,
                "energy": {n: list(v) for n, v in self.energy.items()},
                "change": self.change, "by_block": self.by_block, "seconds": self.seconds}


class StreamProgress:
    """The hidden resume folder of the measurement written to ``out`` (its key: see module)."""

    def __init__(self, out: Path, key: dict) -> None:
        out = Path(out)
        self.dir = out.parent / f".{out.name}.partial"
        self.key = {"version": PROGRESS_VERSION, **key}

    def load(self) -> StreamState | None:
        """The saved state when it belongs to this run's key; else None (the folder, if
        any, removed)."""
        progress = self.dir / "progress.json"
        if not progress.is_file():
            self.discard()
            return None
        try:
            data = json.loads(progress.read_text(encoding="utf-8"))
            if data.get("key") != self.key:
                log.info("sensitivity: %s was made with other settings, tokens or calibration;"
                         " starting over", self.dir)
                self.discard()
                return None
            k = int(data["blocks_done"])
            tensors = load_file(str(self.dir / f"state-{k}.safetensors"))
            state = StreamState(
                blocks_done=k, hidden=tensors["hidden"],
                probes=[tensors[f"probe.{j}"] for j in range(k)],
                probe_change=[float(c) for c in data["probe_change"]],
                energy={n: (float(s), int(c)) for n, (s, c) in data["energy"].items()},
                change=data["change"], by_block=data["by_block"],
                seconds=float(data["seconds"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("sensitivity: cannot resume from %s (%s); starting over", self.dir, exc)
            self.discard()
            return None
        if len(state.probe_change) != k or len(state.by_block) != k:
            log.warning("sensitivity: %s is inconsistent; starting over", self.dir)
            self.discard()
            return None
        return state

    def save(self, state: StreamState) -> None:
        """Make ``state`` the resume point: its tensors, then progress.json naming them, then
        the previous state file removed (a kill at any point leaves one readable pair)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        k = state.blocks_done
        shard = StreamingShard(self.dir / f"state-{k}.safetensors")
        shard.add("hidden", state.hidden)
        for j, probe in enumerate(state.probes):
            shard.add(f"probe.{j}", probe)
        shard.finish({"format": "pt"})
        write_json_atomic(self.dir / "progress.json", {"key": self.key, **state.numbers()})
        for old in self.dir.glob("state-*.safetensors"):
            if old.name != f"state-{k}.safetensors":
                old.unlink(missing_ok=True)

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
