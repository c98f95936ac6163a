"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p, seed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # new tokens to generate at most
    temperature: float = 0.0  # 0 -> greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 -> all
    seed: int | None = None  # per-request generator seed (reproducible sampling)
    stop: tuple[str, ...] = ()  # stop strings (not included in the output text)
    ignore_eos: bool = False  # keep generating after EOS (benchmarks)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a count, got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k and outside the top-p nucleus.

    logits: [vocab] fp32 (already divided by the temperature) -> [vocab] fp32.
    """
    out = logits.clone()
    if top_k > 0 and top_k < out.numel():
        kth = torch.topk(out, top_k).values[-1]  # [] the k-th largest logit
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)  # [vocab], [vocab] int64
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass *before* it already reaches top_p, so the first token
        # always survives and the kept set is the smallest one with mass >= top_p.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        out[order[drop_sorted]] = float("-inf")
    return out


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """One token id from ``logits: [vocab]`` (any float dtype; computed in fp32)."""
    logits32 = logits.float()
    if params.greedy:
        return int(torch.argmax(logits32))
    scaled = filter_logits(logits32 / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)  # [vocab] fp32
    return int(torch.multinomial(probs, 1, generator=generator))
