"""Continuous-batching scheduler: which tokens of which sequences run in the next step.

Every step the running sequences (oldest first) get their next tokens (one decode token, or the
rest of a prefill chunk), then waiting sequences are admitted FIFO while the limits allow:
``max_num_seqs`` running sequences and ``max_num_batched_tokens`` tokens per step (a prompt
longer than the remaining budget is prefilled in chunks over several steps). When the KV pool
has no block left for a running sequence, the *newest* running sequence is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed later (its full blocks
usually survive in the prefix cache, so the recompute is cheap).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import torch

from quantpipe.runtime.config import DEFAULTS
from quantpipe.runtime.engine.kv_cache import BlockPool, block_hash, prefix_block_hashes
from quantpipe.runtime.engine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # keys of the full, computed blocks
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache (first admit)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = DEFAULTS.max_num_seqs  # sequences in the running batch
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens  # tokens per step
    block_size: int = DEFAULTS.block_size  # tokens per KV block

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens of seq.all_ids[seq.num_computed:] computed this step


class Scheduler:
    def __init__(self, limits: SchedulerLimits, pool: BlockPool) -> None:
        self.limits = limits
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- block helpers ----------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, upto: int) -> int:
        bs = self.limits.block_size
        return max(0, -(-upto // bs) - len(seq.block_table))

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the KV, requeue at the front."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # --- the step plan ----------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.limits.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = self._blocks_needed(seq, seq.num_computed + n)
            while self.pool.num_free < need:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.block_table += [self.pool.allocate() for _ in range(need)]
            out.append(ScheduledChunk(seq, n))
            budget -= n
        if preempted:
            return out  # memory is short: let the running batch drain before admitting more
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            if not self._admit(self.waiting[0], budget, out):
                break
            seq = self.waiting.popleft()
            budget -= out[-1].num_tokens
        return out

    def _admit(self, seq: Sequence, budget: int, out: list[ScheduledChunk]) -> bool:
        bs = self.limits.block_size
        ids = seq.all_ids
        # Reuse cached full blocks, but always compute >= 1 token: its logits are sampled.
        hashes = prefix_block_hashes(ids[: len(ids) - 1], bs)
        cached = self.pool.match_prefix(hashes)
        seq.block_table = cached
        seq.block_hashes = hashes[: len(cached)]
        seq.num_computed = len(cached) * bs
        n = min(seq.num_tokens - seq.num_computed, budget)
        need = self._blocks_needed(seq, seq.num_computed + n)
        if self.pool.num_free < need:
            self._release(seq)
            return False
        seq.block_table += [self.pool.allocate() for _ in range(need)]
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = seq.num_computed
            self.pool.record_lookup(len(seq.prompt_ids), seq.num_computed)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        out.append(ScheduledChunk(seq, n))
        return True

    def after_forward(self, chunks: list[ScheduledChunk]) -> None:
        """Advance computed counts and publish newly full blocks to the prefix cache."""
        bs = self.limits.block_size
        for c in chunks:
            seq = c.seq
            seq.num_computed += c.num_tokens
            ids = seq.all_ids
            while len(seq.block_hashes) < seq.num_computed // bs:
                i = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                key = block_hash(parent, tuple(ids[i * bs : (i + 1) * bs]))
                seq.block_hashes.append(key)
                self.pool.register_full_block(seq.block_table[i], key)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
