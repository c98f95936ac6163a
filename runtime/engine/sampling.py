"""Sampling parameters, the token sampler (greedy, temperature, top-k, top-p, seed) and the
log-probabilities reported with each sampled token (OpenAI's ``logprobs``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantpipe.runtime.config import DEFAULTS

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # torch.Generator.manual_seed takes a 64-bit integer
MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's chat top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULTS.completion_max_tokens  # new tokens to generate at most
    temperature: float = 0.0  # 0 -> greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 -> all
    seed: int | None = None  # per-request generator seed (reproducible sampling)
    stop: tuple[str, ...] = ()  # stop strings (not included in the output text)
    ignore_eos: bool = False  # keep generating after EOS (benchmarks)
    logprobs: int | None = None  # report each token's logprob and this many alternatives

    def __post_init__(self) -> None:
        self._check_sampling()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS} alternatives, got "
                             f"{self.logprobs}")

    def _check_sampling(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                             f"{self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a count, got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}], got "
                             f"{self.seed}")

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
        # ... also when top_p is below fp32's range (5e-324 compares as 0.0 >= 0.0): the most
        # likely token is never dropped, so the distribution is never empty (nan).
        drop_sorted[0] = False
        out[order[drop_sorted]] = float("-inf")
    return out


def scale_logits(logits32: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` shifted so the largest is 0, finite for any temperature > 0.

    logits32: [vocab] fp32 -> [vocab] fp32 (max 0; the others <= 0, possibly -inf).
    Dividing first overflows for tiny temperatures (1e-40: every logit becomes +-inf and the
    softmax is nan); after subtracting the max every value is <= 0, so the quotient can only
    go to -inf, i.e. probability 0, which is the greedy limit. The division runs in float64
    because a temperature below fp32's smallest subnormal (1.4e-45) rounds to 0 in fp32.
    """
    shifted = logits32 - logits32.max()  # [vocab] fp32, <= 0 (softmax is shift-invariant)
    return (shifted.double() / temperature).float()  # [vocab] fp64 -> fp32


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution: ``logits: [vocab]`` (any float dtype) -> [vocab] fp32."""
    assert not params.greedy, "greedy decoding takes the argmax; there is no distribution"
    scaled = filter_logits(scale_logits(logits.float(), params.temperature), params.top_k,
                           params.top_p)
    return torch.softmax(scaled, dim=-1)  # [vocab] fp32


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """One token id from ``logits: [vocab]`` (any float dtype; computed in fp32)."""
    if params.greedy:
        return int(torch.argmax(logits.float()))
    probs = token_probs(logits, params)  # [vocab] fp32
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the ``k`` most likely tokens' (ids, no text)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...]  # most likely first
    top_logprobs: tuple[float, ...]


def token_logprobs(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprobs:
    """Log-probabilities of the model's own distribution, ``log_softmax(logits)``: before the
    temperature and top-k / top-p (what vLLM reports by default), so they do not depend on how
    the token was drawn. ``logits: [vocab]`` (any float dtype; computed in fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [vocab] fp32
    top = torch.topk(logp, k) if k > 0 else None  # values/indices: [k], sorted descending
    return TokenLogprobs(
        token_id, float(logp[token_id]),
        tuple(top.indices.tolist()) if top is not None else (),
        tuple(top.values.tolist()) if top is not None else (),
    )
