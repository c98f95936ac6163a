"""AWQ: activation-aware per-channel scaling and weight clipping.

Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration",
arXiv 2306.00978; follows llm-awq ``auto_scale`` / ``auto_clip`` and AutoAWQ.

- maths on tensors: :func:`awq_search_scales`, :func:`fold_scales`, :func:`awq_clip_search`;
- one decoder block: :func:`scale_block` searches and folds the scales of each input group
  into the block's modules (in place; llm-awq ``run_awq`` + ``apply_scale``), and
  :func:`awq_quantize` quantizes one linear with its clip search. No hooks or file I/O here:
  the caller (calibration.pipeline) captures the statistics and writes the artifact.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quantpipe.calibration.capture import GroupStats
from quantpipe.calibration.grid import (
    group_size_checked,
    params_for_groups,
    quantize_to_grid,
    to_groups,
)
from quantpipe.calibration.result import QuantResult
from quantpipe.calibration.rtn import check_weight, rtn
from quantpipe.core.families import NO_FOLD, InputGroup
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
    best_loss, best_ratio, best_s = math.inf, 0.0, torch.ones(in_f, device=x_absmean.device)
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


def awq_clip_search(W: torch.Tensor, x: torch.Tensor, spec: QuantSpec, n_grid: int = 20,
                    max_shrink: float = 0.5, n_sample_tokens: int = 512,
                    row_batch: int = 256) -> torch.Tensor:
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
    best = torch.empty(out_f, in_f // gs, device=W.device)  # [out, G] fp32
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


# ---------------------------------------------------------------------------------------
# one decoder block (modules in, modules changed in place)

# llm-awq does not clip q/k: attention scores are sensitive to their range
NO_CLIP_SUFFIXES = ("q_proj", "k_proj")


def awq_quantize(name: str, W: torch.Tensor, spec: QuantSpec, x: torch.Tensor,
                 H: torch.Tensor | None = None) -> QuantResult:
    """One linear of an AWQ-scaled block: RTN with each group's range from the clip search.

    name: the linear's name (q/k are not clipped); W: [out, in]; x: [rows, in] its inputs
    (already divided by the folded scales). INT8's grid is fine enough that clipping buys
    nothing measurable and its search costs as much: plain RTN there.
    """
    if name.endswith(NO_CLIP_SUFFIXES) or spec.bits == 8:
        return rtn(W, spec, H=H)
    return rtn(W, spec, H=H, clip=awq_clip_search(W, x, spec))


def inspect_output(module: torch.nn.Module, x: torch.Tensor, block_kwargs: dict) -> torch.Tensor:
    """The inspected module's output on x [n, L, d]: attention (whose forward takes the
    positions) needs the block's positions and mask (``block_kwargs``), a linear or an MLP
    only x."""
    if "position_embeddings" not in inspect.signature(module.forward).parameters:
        out = module(x)
    else:
        out = module(hidden_states=x, **block_kwargs)
    return out[0] if isinstance(out, tuple) else out


def _module_loss(module: torch.nn.Module, linears: list[torch.nn.Linear], x_in: torch.Tensor,
                 block_kwargs: dict) -> Callable[[list[torch.Tensor]], float]:
    """Mean squared change of ``module``'s output when ``linears`` get candidate weights."""
    with torch.no_grad():
        ref = inspect_output(module, x_in, block_kwargs)  # [n, L, d]

    def loss_fn(candidates: list[torch.Tensor]) -> float:
        saved = [lin.weight.data for lin in linears]
        try:
            for lin, w in zip(linears, candidates):
                lin.weight.data = w.to(saved[0].dtype)
            with torch.no_grad():
                out = inspect_output(module, x_in, block_kwargs)
        finally:
            for lin, w in zip(linears, saved):
                lin.weight.data = w
        return float((out - ref).float().pow(2).mean())

    return loss_fn


def _linear_loss(x: torch.Tensor, W: torch.Tensor) -> Callable[[list[torch.Tensor]], float]:
    """Mean squared change of x @ W^T (x: [rows, in], W: [out, in]) with a candidate W."""
    ref = x @ W.T  # [rows, out]

    def loss_fn(candidates: list[torch.Tensor]) -> float:
        return float((x @ candidates[0].T - ref).pow(2).mean())

    return loss_fn


def _fold_into(prev: torch.nn.Module, prev_kind: str, linears: list[torch.nn.Linear],
               weights: list[torch.Tensor], s: torch.Tensor) -> None:
    """Apply :func:`fold_scales` to the modules, keeping each parameter's dtype."""
    prev_b = prev.bias.data.float() if getattr(prev, "bias", None) is not None else None
    folded = fold_scales(prev.weight.data.float(), prev_kind, weights, s, prev_b)
    prev.weight.data = folded.prev_weight.to(prev.weight.dtype)
    if prev_b is not None:
        prev.bias.data = folded.prev_bias.to(prev.bias.dtype)
    for lin, w in zip(linears, folded.weights):
        lin.weight.data = w.to(lin.weight.dtype)


def _rescale_inputs(st: GroupStats, recorded: list[torch.Tensor] | None, s: torch.Tensor) -> None:
    """After folding, the group's input is x / s: keep its statistics in the new coordinates
    (the Hessian X^T X, mean |x|, the clip-search sample and the recorded module inputs)."""
    st.scale_inputs(s)  # X^T X / (s s^T) [in, in], sum |x| / s [in], in place
    st.sample = [t / s for t in st.sample]  # [rows, in] each
    if recorded is not None:
        recorded[:] = [t / s for t in recorded]  # [n, L, in] each


def scale_group(block: torch.nn.Module, group: InputGroup, st: GroupStats,
                recorded: dict[str, list[torch.Tensor]], block_kwargs: dict, spec: QuantSpec,
                norm_kind: str) -> dict:
    """Search the scale of one input group (sec. 3.2), fold it into the block (in place) and
    rescale the captured statistics; returns what the artifact records for the group.

    The loss is the inspected module's output error (``group.inspect``, on its ``recorded``
    inputs) or, without one, the group's single linear's output error on the stats' sample.
    A previous linear whose outputs do not match the group's inputs (grouped-query attention:
    v_proj -> o_proj) cannot carry the scale: the group is skipped, and the reason recorded.
    """
    if group.prev_op == NO_FOLD:
        # MoE: a group of several reading one norm (scale_shared_input scales them together)
        return {"skipped": f"{group.linears} share their input with other groups: scaled "
                           "with them (scale_shared_input), not alone"}
    linears = [block.get_submodule(n) for n in group.linears]
    prev = block.get_submodule(group.prev_op)
    is_norm = not isinstance(prev, torch.nn.Linear)
    if not is_norm and prev.out_features != linears[0].in_features:
        return {"skipped": f"{group.prev_op} -> {group.linears} shapes differ "
                           "(grouped-query attention)"}
    weights = [lin.weight.data.float() for lin in linears]  # [out_i, in] each
    if group.inspect:
        x_in = torch.cat(recorded[group.inspect])  # [n, L, d]
        loss_fn = _module_loss(block.get_submodule(group.inspect), linears, x_in, block_kwargs)
    else:
        loss_fn = _linear_loss(st.x_sample(), weights[0])
    res = awq_search_scales(st.x_absmean, weights, spec, loss_fn)
    _fold_into(prev, norm_kind if is_norm else "linear", linears, weights, res.scales)
    _rescale_inputs(st, recorded.get(group.inspect) if group.inspect else None, res.scales)
    return {"ratio": res.ratio, "loss_s1": res.losses[0], "loss_best": min(res.losses)}


def scale_shared_input(block: torch.nn.Module, linears: list[str], prev_op: str,
                       compensate: list[str], inspect: str, stats: list[GroupStats],
                       recorded: dict[str, list[torch.Tensor]], block_kwargs: dict,
                       spec: QuantSpec, norm_kind: str) -> dict:
    """One scale for linears that read one norm's output in several input groups (a MoE
    block's experts: each sees only its routed rows), folded into that norm, with the columns
    of the unquantized modules reading the same output (``compensate``: the router,
    Qwen2-MoE's shared_expert_gate) multiplied by it too, so their outputs do not change.

    x_absmean is over all the groups' rows: with every token routed to k experts and seen
    once by a shared expert, that is the mean over the tokens. The loss is ``inspect``'s
    output error (the MoE block, on its ``recorded`` inputs); the compensated modules keep
    their FP weights in every candidate, as they do after the fold.
    """
    mods = [block.get_submodule(n) for n in linears]
    extra = [block.get_submodule(n) for n in compensate]
    tokens = sum(st.tokens for st in stats)
    x_absmean = (sum(st.abs_sum for st in stats) / max(tokens, 1)).float()  # [in]
    weights = [m.weight.data.float() for m in mods]  # [out_i, in] each
    loss_fn = _module_loss(block.get_submodule(inspect), mods, torch.cat(recorded[inspect]),
                           block_kwargs)
    res = awq_search_scales(x_absmean, weights, spec, loss_fn)
    prev = block.get_submodule(prev_op)
    # the compensated modules' [out, in] weights get the same column scaling as the linears
    _fold_into(prev, norm_kind, mods + extra, weights + [m.weight.data.float() for m in extra],
               res.scales)
    for st in stats:
        _rescale_inputs(st, None, res.scales)
    _rescale_inputs_recorded(recorded[inspect], res.scales)
    return {"ratio": res.ratio, "loss_s1": res.losses[0], "loss_best": min(res.losses),
            "linears": len(mods), "compensated": list(compensate)}


def _rescale_inputs_recorded(recorded: list[torch.Tensor], s: torch.Tensor) -> None:
    recorded[:] = [t / s for t in recorded]  # [n, L, in] each


def scale_block(block: torch.nn.Module, groups: tuple[InputGroup, ...],
                stats: dict[InputGroup, GroupStats], recorded: dict[str, list[torch.Tensor]],
                block_kwargs: dict, spec_for: Callable[[int], QuantSpec],
                norm_kind: str) -> dict[str, dict]:
    """:func:`scale_group` for every input group of one block, in execution order.

    stats: the captured statistics per group (rescaled in place); recorded: the inspected
    modules' inputs [n, L, d] by module name; spec_for(in_features): the INT4 spec the scales
    are searched for; norm_kind: "norm" or "one_plus_norm" (how the block's norms apply
    their gain). Returns {first linear of the group: record}.
    """
    info = {}
    for group in groups:  # a group with prev_op NO_FOLD is recorded as skipped
        in_features = block.get_submodule(group.linears[0]).in_features
        info[group.linears[0]] = scale_group(block, group, stats[group], recorded, block_kwargs,
                                             spec_for(in_features), norm_kind)
    return info
