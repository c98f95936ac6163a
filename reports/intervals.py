"""95% confidence intervals for the report's numbers, over the units that are independent.

Tokens of one window are not independent samples (a quantization error that derails one
sentence moves all its tokens), so the distribution metrics are resampled by evaluation window
and the generation metrics by prompt:

- a mean or a ratio of sums over units (mean KLD = sum of token KLDs / tokens, same-top rate,
  the perplexity ratio exp(sum(nll_cand - nll_ref) / tokens), mean ROUGE-L): percentile
  bootstrap, ``RESAMPLES`` resamples of the units with replacement, a fixed seed (a report is
  reproducible);
- a rate of prompts (JSON agreement): the Wilson score interval, which stays honest for a
  handful of prompts (1 prompt out of 1: [0.21, 1.00]; a bootstrap of one unit is a point);
- a difference of two rates on the same prompts (the garbage rate above FP16's): Newcombe's
  paired score interval (a bootstrap is a point when no prompt is flagged).

Fewer than ``MIN_UNITS`` units give no interval: the verdict then reads the number alone and
says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
MIN_UNITS = 2
_Z = 1.959963984540054  # the standard normal's 97.5% quantile


@dataclass(frozen=True)
class Interval:
    """A two-sided ``CONFIDENCE`` interval of one number, from ``n`` units of ``unit``."""

    low: float
    high: float
    n: int
    unit: str  # "window" or "prompt"

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def more_units(self, value: float, threshold: float) -> int | None:
        """Units to add (same kind, same spread) until the interval around ``value`` no longer
        contains ``threshold``: its half-width shrinks as 1 / sqrt(n). None where the value
        sits on the threshold (no sample size decides it)."""
        gap = abs(value - threshold)
        if gap == 0.0:
            return None
        half = max(value - self.low, self.high - value)
        needed = math.ceil(self.n * (half / gap) ** 2 - 1e-9)  # (float noise above k)
        return max(1, needed - self.n)

    def label(self, fmt: str) -> str:
        return f"[{self.low:{fmt}}, {self.high:{fmt}}]"


def bootstrap_ratio(numerators: Sequence[float], denominators: Sequence[float], unit: str,
                    transform: Callable[[np.ndarray], np.ndarray] | None = None
                    ) -> Interval | None:
    """Percentile bootstrap interval of ``transform(sum(numerators) / sum(denominators))``,
    resampling the units (one numerator and denominator each); None below ``MIN_UNITS``."""
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    n = len(num)
    assert den.shape == num.shape, "one denominator per unit"
    if n < MIN_UNITS:
        return None
    counts = np.random.default_rng(SEED).multinomial(n, np.full(n, 1.0 / n), size=RESAMPLES)
    stats = (counts @ num) / (counts @ den)  # [RESAMPLES]
    if transform is not None:
        stats = transform(stats)
    alpha = (1.0 - CONFIDENCE) / 2
    low, high = np.quantile(stats, [alpha, 1.0 - alpha])
    return Interval(float(low), float(high), n, unit)


def bootstrap_mean(values: Sequence[float], unit: str) -> Interval | None:
    """Percentile bootstrap interval of the mean of ``values`` (one per unit)."""
    return bootstrap_ratio(values, [1.0] * len(values), unit)


def wilson(successes: int, n: int, unit: str) -> Interval | None:
    """Wilson score interval of the rate ``successes / n``: any n >= 1 gets one (a handful of
    prompts is the case it exists for)."""
    if n < 1:
        return None
    p = successes / n
    z2 = _Z * _Z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = _Z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return Interval(max(0.0, centre - half), min(1.0, centre + half), n, unit)


def paired_difference(first: Sequence[bool], second: Sequence[bool], unit: str
                      ) -> Interval | None:
    """Interval of ``rate(first) - rate(second)`` where both flags belong to the same units
    (a candidate's and FP16's answer to one prompt): Newcombe's hybrid score interval for paired
    proportions (his method 10, Statistics in Medicine 1998), built from each rate's Wilson
    interval and the pairs' correlation. Unlike a bootstrap of the paired differences it is
    not a point when no unit is flagged (0 of 80: [-0.046, 0.046]), so a rare event is never
    ruled out by a small sample."""
    n = len(first)
    assert len(second) == n, "one pair of flags per unit"
    if n < MIN_UNITS:
        return None
    both = sum(1 for a, b in zip(first, second) if a and b)
    only1 = sum(1 for a, b in zip(first, second) if a and not b)
    only2 = sum(1 for a, b in zip(first, second) if b and not a)
    neither = n - both - only1 - only2
    p1, p2 = (both + only1) / n, (both + only2) / n
    w1, w2 = wilson(both + only1, n, unit), wilson(both + only2, n, unit)
    margins = (both + only1) * (only2 + neither) * (both + only2) * (only1 + neither)
    phi = (both * neither - only1 * only2) / math.sqrt(margins) if margins else 0.0
    d1_low, d1_high = p1 - w1.low, w1.high - p1
    d2_low, d2_high = p2 - w2.low, w2.high - p2
    low = p1 - p2 - math.sqrt(max(0.0, d1_low**2 - 2 * phi * d1_low * d2_high + d2_high**2))
    high = p1 - p2 + math.sqrt(max(0.0, d1_high**2 - 2 * phi * d1_high * d2_low + d2_low**2))
    return Interval(max(-1.0, low), min(1.0, high), n, unit)
