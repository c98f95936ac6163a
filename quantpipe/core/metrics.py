"""Distribution metrics shared by `sensitivity` (calibration) and `eval` (reports).

One KL divergence, one precision policy:

- per token, KL(P_ref || P_cand) in float32, computed from the logit difference (below), so
  every rounding error is relative to dz = z_ref - z_cand rather than to a log-probability;
- P_ref may come from a float32 log-softmax (eval has it already) or a float64 softmax
  stored in float32 (sensitivity caches it): a relative error e in P_ref changes the result
  by a relative ~e, because both terms of the formula share P_ref;
- sums and means over tokens in float64 (:func:`mean_kld`; callers that keep per-token values
  for percentiles cast them to float64 before reducing).

Tested against a float64 log-softmax reference (tests/quantpipe/test_metrics.py).
"""

from __future__ import annotations

import torch


def token_kld(logits_ref: torch.Tensor, logits_cand: torch.Tensor,
              p_ref: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL(P_ref || P_cand), nats: logits [T, V] -> [T] fp32.

    With dz = z_ref - z_cand, log q = log p - dz - log sum_v p_v exp(-dz_v), so

        KL = sum_v p_v dz_v + log1p(sum_v p_v expm1(-dz_v)).

    Both terms are first order in dz and cancel to second order; written this way float32
    resolves per-layer INT8 KLDs of 1e-7, which a float32 log-softmax cannot (its logsumexp
    alone is off by float32 rounding of a ~20-nat value), without a float64 pass over the
    vocabulary. ``p_ref`` [T, V] = softmax(logits_ref), computed here (float64, stored float32)
    when not given. Clamped at 0: the true value is >= 0, rounding may leave -1e-12.

    KL does not change when a constant is added to dz, so dz is first centred on its p-weighted
    mean: a candidate whose logits are all shifted (a softmax-invariant offset of several nats)
    would otherwise put sum_v p_v expm1(-dz_v) at -1 + e^-shift, where float32 rounding of
    p (summing to 1 + a few 1e-6) can take it below -1 and log1p to NaN.
    """
    if logits_ref.shape != logits_cand.shape or logits_ref.dim() != 2:
        raise ValueError(f"logits must both be [T, V]; got {tuple(logits_ref.shape)} and "
                         f"{tuple(logits_cand.shape)}")
    if p_ref is None:
        p_ref = torch.softmax(logits_ref.double(), dim=-1).float()  # [T, V] fp32
    dz = logits_ref.float() - logits_cand.float()  # [T, V] fp32
    dz -= (p_ref * dz).sum(-1, keepdim=True)  # centred: sum_v p_v dz_v ~ 0
    first = (p_ref * dz).sum(-1)  # [T]
    return (first + torch.log1p((p_ref * torch.expm1(-dz)).sum(-1))).clamp_min(0.0)


def mean_kld(kld_per_token: list[torch.Tensor]) -> float:
    """Mean over every token of per-token KLDs ([T_i] each), accumulated in float64."""
    tokens = sum(int(k.numel()) for k in kld_per_token)
    if tokens == 0:
        raise ValueError("no tokens to average")
    return sum(float(k.double().sum()) for k in kld_per_token) / tokens
