"""GPTQ: one-shot weight quantization with second-order error feedback.

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", arXiv 2210.17323; follows IST-DASLab ``gptq.py`` (``fasterquant``) and GPTQModel.
Pure maths: the caller accumulates H = 2 X^T X / n over the calibration inputs of one linear.

Every linear that reads the same input (q/k/v; gate/up) and both bit widths share one H, and
the work that depends on H alone (act-order permutation, damping, Cholesky factor of H^-1) is
the same for all of them: :func:`hessian_factor` does it once, and :func:`gptq` reuses the
factor of the H object it was last given (see :func:`_shared_factor`).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from quantpipe.calibration.grid import (
    group_size_checked,
    params_for_groups,
    quantize_to_grid,
    to_groups,
)
from quantpipe.calibration.result import QuantResult, proxy_loss
from quantpipe.calibration.rtn import check_weight
from quantpipe.core.qformat import QuantizedWeight, QuantSpec

logger = logging.getLogger(__name__)


def damped_inverse_cholesky(
    H: torch.Tensor, percdamp: float, max_damp_raises: int
) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor of (H + damp I)^-1, raising damp tenfold while it fails.

    H: [in, in] f64 -> (Hinv [in, in] f64 upper-triangular, percdamp used, raises).
    damp = percdamp * mean(diag(H)) (sec. 3, "Step 3: Cholesky reformulation": dampening keeps
    the inverse well-conditioned; a Cholesky failure means H + damp I is not numerically
    positive definite, so more dampening is the standard remedy).
    """
    mean_diag = float(torch.diagonal(H).mean())
    raises = 0
    while True:
        damp = percdamp * mean_diag
        H_damped = H.clone()
        H_damped.diagonal().add_(damp)
        L, info = torch.linalg.cholesky_ex(H_damped)  # [in, in] lower
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)  # (H + damp I)^-1, [in, in]
            Hinv, info = torch.linalg.cholesky_ex(Hinv, upper=True)  # [in, in] upper
            if int(info) == 0 and bool(torch.isfinite(Hinv).all()):
                return Hinv, percdamp, raises
        if raises >= max_damp_raises:
            raise ValueError(
                f"GPTQ: Cholesky of H + damp*I failed even with percdamp={percdamp:.3g} "
                f"(damp={damp:.3g}, mean diag(H)={mean_diag:.3g}) after {raises} raises; "
                "H is far from positive semi-definite: check the calibration inputs for "
                "NaN/inf or overflow, use more calibration tokens, or raise percdamp"
            )
        logger.warning(
            "GPTQ: Cholesky failed with percdamp=%.3g (damp=%.3g, mean diag(H)=%.3g, "
            "in=%d); retrying with percdamp=%.3g",
            percdamp, damp, mean_diag, H.shape[0], percdamp * 10,
        )
        percdamp *= 10
        raises += 1


@dataclass(frozen=True)
class HessianFactor:
    """What GPTQ needs from H, for every linear that reads the same input."""

    act_order: bool  # columns by decreasing diag(H) (else in their own order)
    percdamp: float  # relative dampening finally used (after any raises)
    damp_raises: int  # times the dampening was raised after a failed Cholesky
    dead: torch.Tensor  # [in] bool: inputs never active in calibration (H_ii = 0)
    perm: torch.Tensor  # [in] int64: the order in which the columns are quantized
    diag_H: torch.Tensor  # [in] fp32 diag(H), dead inputs set to 1, original column order
    Hinv: torch.Tensor  # [in, in] fp32 upper Cholesky factor of (H + damp I)^-1, permuted


def hessian_factor(
    H: torch.Tensor, act_order: bool, percdamp: float = 0.01, max_damp_raises: int = 8
) -> HessianFactor:
    """H: [in, in] (any float dtype) -> its :class:`HessianFactor` (dead inputs, act-order
    permutation, damped inverse Cholesky factor in float64, stored as fp32)."""
    if H.dim() != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"H must be square [in, in], got shape {tuple(H.shape)}")
    if not torch.isfinite(H).all():
        raise ValueError("H contains NaN/inf; check the calibration activations")
    if percdamp <= 0 or max_damp_raises < 0:
        raise ValueError(
            f"need percdamp > 0 and max_damp_raises >= 0; got {percdamp}, {max_damp_raises}"
        )
    H = H.double().clone()  # [in, in] f64: the inverse and Cholesky are done in float64
    # Dead inputs (never active in calibration): H_ii = 0 gives no information; fix the
    # diagonal to 1 so H stays invertible and quantize those columns to 0 (IST gptq.py).
    dead = torch.diagonal(H) == 0  # [in] bool
    H[dead, dead] = 1.0
    # act-order (IST repo's --act-order heuristic, not in the paper): quantize the columns
    # with the largest Hessian diagonal first, while most columns remain to absorb errors.
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True)  # [in] int64
    else:
        perm = torch.arange(H.shape[0])
    diag_H = torch.diagonal(H).float()  # [in] weights for the mse_clip search
    H = H[perm][:, perm]  # [in, in] f64 permuted
    Hinv, percdamp_used, raises = damped_inverse_cholesky(H, percdamp, max_damp_raises)
    # [in, in] upper; the updates run in fp32 like the reference code
    return HessianFactor(act_order, percdamp_used, raises, dead, perm, diag_H, Hinv.float())


# The factor of the H object gptq() was last given, per act_order: (weak reference to H,
# H's version counter, percdamp, max_damp_raises) -> factor. The pipeline passes one H object
# for all the linears of an input group and for both bit widths; a weak reference drops the
# entry (and its [in, in] factor) as soon as the caller lets go of H, and the version counter
# notices an H modified in place.
_SHARED: dict[bool, tuple[weakref.ref, tuple, HessianFactor]] = {}


def _shared_factor(H: torch.Tensor, act_order: bool, percdamp: float,
                   max_damp_raises: int) -> HessianFactor:
    key = (H._version, percdamp, max_damp_raises)
    hit = _SHARED.get(act_order)
    if hit is not None and hit[0]() is H and hit[1] == key:
        return hit[2]
    factor = hessian_factor(H, act_order, percdamp, max_damp_raises)

    def drop(ref: weakref.ref, act_order: bool = act_order) -> None:
        if act_order in _SHARED and _SHARED[act_order][0] is ref:
            del _SHARED[act_order]

    _SHARED[act_order] = (weakref.ref(H, drop), key, factor)
    return factor


def gptq_columns(
    W: torch.Tensor,
    Hinv: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    col_group: torch.Tensor,
    maxq: int,
    block_size: int,
    group_params=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GPTQ column loop on permuted columns (sec. 3, steps 1-3).

    W: [out, in] fp32 permuted (updated in place), Hinv: [in, in] fp32 upper Cholesky factor of
    the permuted (H + damp I)^-1, scales / zeros: [out, G] fp32, col_group: [in] int64 group of
    every permuted column. ``group_params(cols, j)`` (dynamic groups) gives the scale and zero
    [out] of the group entered at permuted column j from its current columns [out, gs], and
    the caller's ``scales``, ``zeros`` and ``col_group`` are filled in as groups are entered.
    -> (Q [out, in] fp32 dequantized, q [out, in] uint8, Losses [out] f64 per-row OBS loss).
    """
    out_f, n_cols = W.shape
    Q = torch.zeros_like(W)  # [out, in] dequantized, permuted order
    q_int = torch.zeros(out_f, n_cols, dtype=torch.uint8)  # [out, in] permuted order
    Losses = torch.zeros(out_f, dtype=torch.float64)  # [out] per-row OBS loss (as IST code)
    # sec. 3, "Step 2: lazy batch-updates": quantize a block of columns with rank-1 updates
    # inside the block, then apply the block's accumulated error to the rest of W at once.
    # Inside a block the columns are rows of transposed copies ([count, out]): every
    # per-column step then reads and writes contiguous memory (same values, same fp32 ops).
    for i1 in range(0, n_cols, block_size):
        i2 = min(i1 + block_size, n_cols)
        count = i2 - i1
        W1 = W[:, i1:i2].t().contiguous()  # [count, out]: row i is column i1 + i of W
        Q1 = torch.zeros_like(W1)  # [count, out] dequantized
        q1 = torch.zeros_like(W1)  # [count, out] integers (fp32 until the block is done)
        Err1 = torch.zeros_like(W1)  # [count, out]
        Hinv1 = Hinv[i1:i2, i1:i2]  # [count, count]
        if group_params is None:  # every column's group is known: gather its params once
            S1 = scales[:, col_group[i1:i2]].t().contiguous()  # [count, out]
            Z1 = zeros[:, col_group[i1:i2]].t().contiguous()  # [count, out]
        for i in range(count):
            j = i1 + i
            w = W1[i]  # [out]
            d = Hinv1[i, i]
            if group_params is None:
                s, z = S1[i], Z1[i]  # [out] each
            else:
                s, z = group_params(W1[i:].t(), W[:, i2:], j)
            q1[i] = qj = quantize_to_grid(w, s, z, maxq)  # [out] integers
            Q1[i] = (qj - z) * s  # same fp32 ops as QuantizedWeight.dequantize
            # sec. 2, OBQ update (sec. 3 Step 1: any fixed column order works):
            # delta_F = -(w - q) / [H_F^-1]_qq * (H_F^-1)_{:,q}
            Err1[i] = err1 = (w - Q1[i]) / d  # [out]
            # [count - i, 1] x [1, out] -> [count - i, out] (an outer product)
            W1[i:] -= torch.outer(Hinv1[i, i:], err1)
        Q[:, i1:i2] = Q1.t()
        q_int[:, i1:i2] = q1.t().to(torch.uint8)
        Losses += (Err1 * Err1).sum(dim=0).double() / 2  # (w - q)^2 / d^2 per column
        # lazy batch update of all later columns: [out, count] @ [count, in - i2]
        W[:, i2:] -= Err1.t() @ Hinv[i1:i2, i2:]
    return Q, q_int, Losses


def gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    spec: QuantSpec,
    block_size: int = 128,
    percdamp: float = 0.01,
    mse_clip: bool = False,
    static_groups: bool | None = None,
    max_damp_raises: int = 8,
    factor: HessianFactor | None = None,
) -> QuantResult:
    """Quantize W column by column, spreading each column's error over the later columns.

    W: [out, in] (any float dtype), H: [in, in] -> QuantResult (loss = tr(dW H dW^T), f64).
    With ``spec.act_order`` columns go by decreasing diag(H). Group params are either
    *dynamic*, computed when a group is entered on its error-updated columns (IST gptq.py), or
    *static*, computed up front from the original weights on the original groups, so g_idx
    stays i // group_size (GPTQModel ``static_groups``; llm-compressor always does this).
    ``static_groups=None`` means static with act-order and dynamic without.
    ``factor``: :func:`hessian_factor` of this H (same act_order, percdamp, max_damp_raises);
    when None, the factor of the last H object given is reused if this is the same one.
    """
    W_in = check_weight(W)
    if H.shape != (W_in.shape[1], W_in.shape[1]):
        raise ValueError(
            f"H must be [in, in] = [{W_in.shape[1]}, {W_in.shape[1]}], got {tuple(H.shape)}; "
            "accumulate it from the inputs of this linear"
        )
    if block_size < 1 or percdamp <= 0 or max_damp_raises < 0:
        raise ValueError(
            f"need block_size >= 1, percdamp > 0, max_damp_raises >= 0; got {block_size}, "
            f"{percdamp}, {max_damp_raises}"
        )
    if factor is None:
        factor = _shared_factor(H, spec.act_order, percdamp, max_damp_raises)
    elif factor.act_order != spec.act_order or factor.Hinv.shape != H.shape:
        raise ValueError("factor was made for another H or act_order; use hessian_factor(H, "
                         "spec.act_order, percdamp, max_damp_raises)")
    out_f, n_cols = W_in.shape
    gs = group_size_checked(spec, n_cols)
    n_groups = n_cols // gs
    perm, diag_H = factor.perm, factor.diag_H
    W = W_in.clone()  # [out, in] fp32, updated in place by the error feedback
    W[:, factor.dead] = 0.0  # dead inputs are quantized to 0

    scales = torch.zeros(out_f, n_groups)  # [out, G] fp32 (fp16-representable)
    zeros = torch.zeros(out_f, n_groups)  # [out, G] fp32 integers
    col_group = torch.empty(n_cols, dtype=torch.long)  # group of each *permuted* column
    # Up-front params: per output channel, or static groups on the original (un-permuted)
    # groups, which keeps g_idx = i // group_size (GPTQModel static_groups).
    if static_groups is None:
        static_groups = spec.act_order
    upfront = n_groups == 1 or static_groups
    group_params = None
    if upfront:
        # W: [out, in] -> [out, G, gs]; diag(H): [in] -> [G, gs] column weights
        scales, zeros = params_for_groups(
            to_groups(W, gs), spec, mse_clip=mse_clip,
            col_weight=diag_H.reshape(n_groups, gs) if mse_clip else None,
        )  # [out, G] each
        col_group = perm // gs
    else:
        diag_perm = diag_H[perm]  # [in] permuted

        def group_params(W1_rest, W_rest, j):
            # params of the group entered at permuted column j from its *current* columns:
            # those inside this block already carry the in-block updates (W1), later ones
            # come from W. Returns the scale and zero [out] of group j // gs.
            g = j // gs
            if j % gs == 0:
                in_block = W1_rest[:, :gs]  # [out, <= gs]
                cols = torch.cat([in_block, W_rest[:, :gs - in_block.shape[1]]], dim=1)
                s, z = params_for_groups(
                    cols.unsqueeze(1), spec, mse_clip=mse_clip,
                    col_weight=diag_perm[j:j + gs].unsqueeze(0) if mse_clip else None,
                )  # [out, 1] each, cols: [out, gs]
                scales[:, g], zeros[:, g] = s[:, 0], z[:, 0]
            col_group[j] = g
            return scales[:, g], zeros[:, g]

    Q, q_int, Losses = gptq_columns(W[:, perm], factor.Hinv, scales, zeros, col_group,
                                    spec.maxq, block_size, group_params)

    invperm = torch.argsort(perm)
    g_idx = col_group[invperm].to(torch.int32)  # [in] group of every original column
    stored = spec
    if torch.equal(g_idx.long(), torch.arange(n_cols) // gs):
        # trivial: sequential groups. No g_idx is stored and the layer is recorded without
        # act-order (the spec describes the stored layout), so every format and kernel takes
        # its plain path (GPTQ desc_act false: vLLM's Marlin needs no g_idx sort)
        g_idx = None
        stored = QuantSpec(spec.bits, spec.group_size, spec.sym, act_order=False)
    weight = QuantizedWeight(
        spec=stored,
        q=q_int[:, invperm].contiguous(),  # [out, in] uint8, original column order
        scales=scales.half(),  # exact: fp16-representable by construction
        zeros=zeros.to(torch.uint8),
        g_idx=g_idx,
    )
    W_hat = weight.dequantize()  # [out, in] fp32
    assert torch.equal(W_hat, Q[:, invperm]), "stored tensors must reproduce W_hat exactly"
    logger.debug("GPTQ: sum of per-row Losses %.6g", float(Losses.sum()))
    return QuantResult(
        weight=weight,
        loss=proxy_loss(W_in, W_hat, H),  # on the caller's H: undamped, unpermuted
        damp=factor.percdamp,
        damp_raises=factor.damp_raises,
    )
