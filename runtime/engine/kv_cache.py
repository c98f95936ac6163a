"""Paged KV cache: fixed-size blocks, per-sequence block tables and a hashed prefix cache.

The KV tensors live in one pool per layer, ``k_cache[layer]: [num_blocks, block_size,
kv_heads, head_dim]`` (same for ``v``). A sequence owns a *block table*: the list of block ids
holding its tokens in order, so token ``t`` sits in block ``table[t // block_size]`` at slot
``t % block_size``. Nothing is sized per request; a sequence grows one block at a time.

Prefix caching (vLLM "automatic prefix caching"): a *full* block is keyed by
``hash((parent_block_hash, token_ids_of_block))`` so a key identifies the whole prefix up to and
including that block. Blocks whose reference count drops to zero keep their key and sit in an
LRU list; a later request with the same prefix takes them back (a hit) and allocation evicts the
least recently freed one only when no never-used block is left.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from quantpipe.runtime.config import DEFAULTS


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int  # decoder layers
    num_kv_heads: int  # key/value heads (GQA: fewer than query heads)
    head_dim: int  # channels per head
    dtype: torch.dtype  # KV element type (the model's compute dtype)
    block_size: int = DEFAULTS.block_size  # tokens per block

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x element bytes."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, kv_cache_memory: int) -> int:
        n = kv_cache_memory // self.bytes_per_block
        if n < 2:
            raise ValueError(
                f"kv_cache_memory {kv_cache_memory:,} B holds {n} block(s) of "
                f"{self.bytes_per_block:,} B; give at least {2 * self.bytes_per_block:,} B "
                "(--kv-cache-memory) or a smaller --block-size"
            )
        return int(n)


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """Key of a full block: depends on every token before it through ``parent``."""
    return hash((parent, token_ids))


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Hashes of every *full* block of ``token_ids``, chained from the first block."""
    out: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, tuple(token_ids[start : start + block_size]))
        out.append(parent)
    return out


class BlockPool:
    """Block ids, reference counts, the hash -> block map and the LRU of cached free blocks.

    Pure bookkeeping (no tensors), so it is unit-testable and shared by the scheduler.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_key: list[int | None] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # never-keyed blocks (stack)
        self._lru: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced; oldest first
        self._by_key: dict[int, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens served from cached blocks

    # --- accounting -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (never used + evictable cached)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # --- allocation -------------------------------------------------------------------------
    def allocate(self) -> int:
        if self._free:
            b = self._free.pop()
        elif self._lru:
            b, _ = self._lru.popitem(last=False)  # evict the least recently freed cached block
            key = self.block_key[b]
            assert key is not None and self._by_key.get(key) == b
            del self._by_key[key]
            self.block_key[b] = None
        else:
            raise RuntimeError("no free KV block; the scheduler must check num_free first")
        assert self.ref_count[b] == 0
        self.ref_count[b] = 1
        return b

    def free(self, blocks: list[int]) -> None:
        # Free in reverse so the tail of a sequence (least likely shared) is evicted first.
        for b in reversed(blocks):
            assert self.ref_count[b] > 0, f"double free of block {b}"
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_key[b] is not None:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    # --- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, hashes: list[int]) -> list[int]:
        """Take a reference on the longest run of cached blocks matching ``hashes``."""
        if not self.enable_prefix_caching:
            return []
        got: list[int] = []
        for h in hashes:
            b = self._by_key.get(h)
            if b is None:
                break
            if self.ref_count[b] == 0:
                del self._lru[b]
            self.ref_count[b] += 1
            got.append(b)
        return got

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's prompt lookup (for the exported hit rate)."""
        self.prefix_queries += query_tokens
        self.prefix_hits += hit_tokens

    def register_full_block(self, b: int, key: int) -> None:
        """Publish a block whose KV is now computed; a duplicate key keeps the older block."""
        if not self.enable_prefix_caching or self.block_key[b] is not None:
            return
        if key in self._by_key:
            return  # another sequence computed the same prefix concurrently
        self.block_key[b] = key
        self._by_key[key] = b


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat slot ids (block * block_size + offset) of token positions ``start..end-1``."""
    return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end)]
