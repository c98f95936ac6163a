"""AWQ: activation-aware per-channel scaling and weight clipping.

Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration",
arXiv 2306.00978; follows llm-awq ``auto_scale`` / ``auto_clip`` and AutoAWQ. Pure maths: the
caller captures inputs, runs the inspected module inside ``loss_fn`` and applies the results
(compute an artifact, apply it in a separate step, as llm-awq ``run_awq`` -> ``apply_awq``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quantpipe.calibration.grid import (
    group_size_checked,
    params_for_groups,
    quantize_to_grid,
    to_groups,
)
from quantpipe.calibration.result import QuantResult
from quantpipe.calibration.rtn import check_weight, rtn
from quantpipe.core.qformat import QuantSpec


@dataclass
class AwqScaleResult:
    scales: torch.Tensor  # fp32 [in]: divide the previous op by s, multiply the linears' inputs
    ratio: float  # chosen exponent alpha in s = x_absmean**alpha (0 = no scaling)
    losses: list[float]  # loss_fn value of every candidate ratio, in grid order


@dataclass
class FoldResult:
    prev_weight: torch.Tensor  # the previous op's weight with s folded in
    prev_bias: torch.Tensor | None  # its bias divided by s (None when it has none)
    weights: list[torch.Tensor]  # the linears' weights [out_i, in] with inputs scaled by s


def candidate_scales(
    x_absmean: torch.Tensor, weights: Sequence[torch.Tensor], ratio: float, spec: QuantSpec,
    duo_scaling: bool,
) -> torch.Tensor:
    """s for one ratio, normalized so that sqrt(max(s) * min(s)) = 1 (llm-awq auto_scale).

    x_absmean: [in] -> s: [in] fp32. ratio 0 is exactly s = 1 in both modes.
    """
    if ratio == 0.0:
        return torch.ones_like(x_absmean, dtype=torch.float32)
    x = x_absmean.float()
    if duo_scaling:
        # AutoAWQ: s = x_mean^a / w_mean^(1 - a), w_mean = mean over rows of |W| normalized
        # by each group's max |W| (so every group contributes on the same scale)
        W = torch.cat([w.float() for w in weights], dim=0)  # [sum out_i, in]
        gs = group_size_checked(spec, W.shape[1])
        Wg = to_groups(W.abs(), gs)  # [sum out_i, G, gs]
        w_scale = Wg / Wg.amax(dim=-1, keepdim=True).clamp(min=1e-12)
        w_mean = w_scale.reshape(W.shape).mean(dim=0)  # [in]
        s = (x.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        s = x.pow(ratio).clamp(min=1e-4)  # 1e-4: channels that were never active stay finite
    return s / (s.max() * s.min()).sqrt()


def awq_search_scales(
    x_absmean: torch.Tensor,
    weights: Sequence[torch.Tensor],
    spec: QuantSpec,
    loss_fn: Callable[[list[torch.Tensor]], float],
    n_grid: int = 20,
    duo_scaling: bool = False,
) -> AwqScaleResult:
    """Grid search of the per-input-channel scale of linears sharing one input (sec. 3.2).

    x_absmean: [in] mean |x| per input channel; weights: [out_i, in] each. For every ratio
    a = k / n_grid the candidate effective weights are Q(W * s) / s (groups of the *scaled*
    weight) and ``loss_fn`` returns the inspected module's output error with them. Ratio 0
    (s = 1, plain RTN) is always evaluated first and only a strictly smaller loss replaces it.
    """
    if not weights:
        raise ValueError("awq_search_scales needs at least one linear weight")
    in_f = x_absmean.numel()
    for w in weights:
        if w.dim() != 2 or w.shape[1] != in_f:
            raise ValueError(
                f"weight of shape {tuple(w.shape)} does not read an input of {in_f} channels; "
                "pass the linears that share the input x_absmean was measured on"
            )
    if n_grid < 1:
        raise ValueError(f"n_grid must be >= 1, got {n_grid}")
    if not torch.isfinite(x_absmean).all() or (x_absmean < 0).any():
        raise ValueError("x_absmean must be finite and >= 0 (mean |x| per input channel)")
    Ws = [check_weight(w) for w in weights]
    losses: list[float] = []
    best_loss, best_ratio, best_s = math.inf, 0.0, torch.ones(in_f)
    for k in range(n_grid):
        ratio = k / n_grid
        s = candidate_scales(x_absmean, Ws, ratio, spec, duo_scaling)  # [in]
        # [out_i, in] * [1, in] -> quantize -> / s: the weights the scaled model would see
        effective = [rtn(W * s, spec).weight.dequantize() / s for W in Ws]
        loss = float(loss_fn(effective))
        losses.append(loss)
        if k == 0 and not math.isfinite(loss):
            raise ValueError(
                "loss_fn returned a non-finite loss for the unscaled weights (s = 1); check "
                "the captured inputs and the inspected module"
            )
        if math.isfinite(loss) and loss < best_loss:
            best_loss, best_ratio, best_s = loss, ratio, s
    return AwqScaleResult(scales=best_s, ratio=best_ratio, losses=losses)


def fold_scales(
    prev_weight: torch.Tensor,
    prev_kind: str,
    weights: Sequence[torch.Tensor],
    scales: torch.Tensor,
    prev_bias: torch.Tensor | None = None,
) -> FoldResult:
    """Fold s into the model without changing its function: prev op / s, linears' inputs * s.

    prev_kind: "norm" (weight [in] -> w / s), "one_plus_norm" (Gemma, gain (1 + w) ->
    (1 + w) / s - 1) or "linear" (previous linear [in, *]: its output rows / s, bias / s).
    Computed in float64 and cast back to each tensor's dtype.
    """
    s = scales.double()  # [in]
    in_f = s.numel()
    if prev_kind in ("norm", "one_plus_norm"):
        if prev_weight.shape != (in_f,):
            raise ValueError(
                f"norm weight has shape {tuple(prev_weight.shape)}, scales have {in_f} channels"
            )
    elif prev_kind == "linear":
        if prev_weight.dim() != 2 or prev_weight.shape[0] != in_f:
            raise ValueError(
                f"previous linear has {tuple(prev_weight.shape)[0]} output rows but the scaled "
                f"linears read {in_f} inputs (e.g. GQA v_proj -> o_proj); skip this pair"
            )
    else:
        raise ValueError(
            f"prev_kind {prev_kind!r} unknown; use 'norm', 'one_plus_norm' or 'linear'"
        )
    if prev_bias is not None and prev_bias.shape != (in_f,):
        raise ValueError(f"bias has shape {tuple(prev_bias.shape)}, scales have {in_f} channels")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != in_f:
            raise ValueError(f"linear weight {tuple(w.shape)} does not read {in_f} inputs")

    pw = prev_weight.double()
    if prev_kind == "norm":
        new_prev = pw / s  # [in]
    elif prev_kind == "one_plus_norm":
        new_prev = (1.0 + pw) / s - 1.0  # [in]
    else:
        new_prev = pw / s.unsqueeze(1)  # [in, *] rows / s
    new_bias = None if prev_bias is None else (prev_bias.double() / s).to(prev_bias.dtype)
    new_weights = [(w.double() * s.unsqueeze(0)).to(w.dtype) for w in weights]  # [out_i, in]
    return FoldResult(new_prev.to(prev_weight.dtype), new_bias, new_weights)


def awq_clip_search(
    W: torch.Tensor,
    x: torch.Tensor,
    spec: QuantSpec,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    n_sample_tokens: int = 512,
    row_batch: int = 256,
) -> torch.Tensor:
    """Max |value| per (row, group) minimizing each group's output error (llm-awq auto_clip).

    W: [out, in], x: [tokens, in] -> max_val [out, G] fp32. For shrink p = 1 - k / n_grid,
    k < max_shrink * n_grid, the group's range is clipped to +-p * max|W| and the error
    mean_t (x_g . w_g - x_g . Q(w_g))^2 of its partial output is compared; p = 1 (no clip) is
    the starting point and only a strictly smaller error replaces it.
    """
    W = check_weight(W)
    out_f, in_f = W.shape
    if x.dim() != 2 or x.shape[1] != in_f:
        raise ValueError(f"x must be [tokens, {in_f}], got {tuple(x.shape)}")
    gs = group_size_checked(spec, in_f)
    step = max(1, x.shape[0] // n_sample_tokens)
    xg = to_groups(x[::step].float(), gs)  # [tokens', in] -> [tokens', G, gs]
    Wg = to_groups(W, gs)  # [out, G, gs]
    best = torch.empty(out_f, in_f // gs)
    for r0 in range(0, out_f, row_batch):  # bounds memory at row_batch * tokens * G floats
        w = Wg[r0:r0 + row_batch]  # [rb, G, gs]
        org_max = w.abs().amax(dim=-1)  # [rb, G]
        org_out = torch.einsum("tgk,ogk->otg", xg, w)  # [rb, tokens', G]
        best_max, min_err = org_max.clone(), torch.full_like(org_max, math.inf)
        for k in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - k / n_grid)  # [rb, G]
            s, z = params_for_groups(w, spec, max_val=max_val)  # [rb, G]
            q_w = (quantize_to_grid(w, s.unsqueeze(-1), z.unsqueeze(-1), spec.maxq)
                   - z.unsqueeze(-1)) * s.unsqueeze(-1)  # [rb, G, gs]
            cur_out = torch.einsum("tgk,ogk->otg", xg, q_w)  # [rb, tokens', G]
            err = (cur_out - org_out).double().pow(2).mean(dim=1)  # [rb, G]
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best_max = torch.where(better, max_val, best_max)
        best[r0:r0 + row_batch] = best_max
    return best


def quantize_with_clip(W: torch.Tensor, spec: QuantSpec, max_val: torch.Tensor,
                       H: torch.Tensor | None = None) -> QuantResult:
    """RTN with each group's range clipped to +-max_val [out, G] (from awq_clip_search)."""
    return rtn(W, spec, H=H, clip=max_val)
