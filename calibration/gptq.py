"""GPTQ: one-shot weight quantization with second-order error feedback.

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", arXiv 2210.17323; follows IST-DASLab ``gptq.py`` (``fasterquant``) and GPTQModel.
Pure maths: the caller accumulates H = 2 X^T X / n over the calibration inputs of one linear.
"""

from __future__ import annotations

import logging

import torch

from quantpipe.calibration.grid import group_size_checked, params_for_groups, quantize_to_grid
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


def gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    spec: QuantSpec,
    block_size: int = 128,
    percdamp: float = 0.01,
    mse_clip: bool = False,
    static_groups: bool | None = None,
    max_damp_raises: int = 8,
) -> QuantResult:
    """Quantize W column by column, spreading each column's error over the later columns.

    W: [out, in] (any float dtype), H: [in, in] -> QuantResult (loss = tr(dW H dW^T), f64).
    With ``spec.act_order`` columns go by decreasing diag(H). Group params are either
    *dynamic*, computed when a group is entered on its error-updated columns (IST gptq.py), or
    *static*, computed up front from the original weights on the original groups, so g_idx
    stays i // group_size (GPTQModel ``static_groups``; llm-compressor always does this).
    ``static_groups=None`` means static with act-order and dynamic without.
    """
    W_in = check_weight(W, H)
    if block_size < 1 or percdamp <= 0 or max_damp_raises < 0:
        raise ValueError(
            f"need block_size >= 1, percdamp > 0, max_damp_raises >= 0; got {block_size}, "
            f"{percdamp}, {max_damp_raises}"
        )
    out_f, n_cols = W_in.shape
    gs = group_size_checked(spec, n_cols)
    n_groups = n_cols // gs
    H_in = H
    W = W_in.clone()  # [out, in] fp32, updated in place by the error feedback
    H = H.double().clone()  # [in, in] f64: the inverse and Cholesky are done in float64

    # Dead inputs (never active in calibration): H_ii = 0 gives no information; fix the
    # diagonal to 1 so H stays invertible and quantize those columns to 0 (IST gptq.py).
    dead = torch.diagonal(H) == 0  # [in] bool
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    # act-order (IST repo's --act-order heuristic, not in the paper): quantize the columns
    # with the largest Hessian diagonal first, while most columns remain to absorb errors.
    if spec.act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True)  # [in] int64
    else:
        perm = torch.arange(n_cols)
    invperm = torch.argsort(perm)
    diag_H = torch.diagonal(H).float()  # [in] weights for the mse_clip search

    def params(cols: torch.Tensor, col_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # cols: [out, k] fp32, col_weight: [k] -> scale, zero [out] (one group)
        s, z = params_for_groups(
            cols.unsqueeze(1), spec, mse_clip=mse_clip,
            col_weight=col_weight.unsqueeze(0) if mse_clip else None,
        )  # [out, 1]
        return s[:, 0], z[:, 0]

    scales = torch.zeros(out_f, n_groups)  # [out, G] fp32 (fp16-representable)
    zeros = torch.zeros(out_f, n_groups)  # [out, G] fp32 integers
    col_group = torch.empty(n_cols, dtype=torch.long)  # group of each *permuted* column
    # Up-front params: per output channel, or static groups on the original (un-permuted)
    # groups, which keeps g_idx = i // group_size (GPTQModel static_groups).
    if static_groups is None:
        static_groups = spec.act_order
    upfront = n_groups == 1 or static_groups
    if upfront:
        for g in range(n_groups):
            cols = slice(g * gs, (g + 1) * gs)
            scales[:, g], zeros[:, g] = params(W[:, cols], diag_H[cols])
        col_group = perm // gs

    W = W[:, perm]  # [out, in] permuted
    H = H[perm][:, perm]  # [in, in] permuted
    diag_H = diag_H[perm]

    Hinv, percdamp_used, raises = damped_inverse_cholesky(H, percdamp, max_damp_raises)
    Hinv = Hinv.float()  # [in, in] upper; updates run in fp32 like the reference code

    Q = torch.zeros_like(W)  # [out, in] dequantized, permuted order
    q_int = torch.zeros(out_f, n_cols, dtype=torch.uint8)  # [out, in] permuted order
    Losses = torch.zeros(out_f, dtype=torch.float64)  # [out] per-row OBS loss (as IST code)
    # sec. 3, "Step 2: lazy batch-updates": quantize a block of columns with rank-1 updates inside
    # the block, then apply the block's accumulated error to the rest of W at once.
    for i1 in range(0, n_cols, block_size):
        i2 = min(i1 + block_size, n_cols)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()  # [out, count]
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Losses1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]  # [count, count]
        for i in range(count):
            j = i1 + i
            w = W1[:, i]  # [out]
            d = Hinv1[i, i]
            if not upfront:
                g = j // gs
                if j % gs == 0:
                    # params from the group's *current* columns: those inside this block
                    # already carry the in-block updates (W1), later ones come from W
                    cols = torch.cat([W1[:, i:i + gs], W[:, i2:j + gs]], dim=1)  # [out, gs]
                    scales[:, g], zeros[:, g] = params(cols, diag_H[j:j + gs])
                col_group[j] = g
            g = int(col_group[j])
            s, z = scales[:, g], zeros[:, g]  # [out] each
            qj = quantize_to_grid(w, s, z, spec.maxq)  # [out] integers
            q_int[:, j] = qj.to(torch.uint8)
            Q1[:, i] = (qj - z) * s  # same fp32 ops as QuantizedWeight.dequantize
            Losses1[:, i] = (w - Q1[:, i]) ** 2 / d**2
            # sec. 2, OBQ update (sec. 3 Step 1: any fixed column order works):
            # delta_F = -(w - q) / [H_F^-1]_qq * (H_F^-1)_{:,q}
            err1 = (w - Q1[:, i]) / d  # [out]
            # [out, 1] @ [1, count - i] -> [out, count - i]
            W1[:, i:] -= err1.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        Losses += Losses1.sum(dim=1).double() / 2
        # lazy batch update of all later columns: [out, count] @ [count, in - i2]
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

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
        loss=proxy_loss(W_in, W_hat, H_in),  # on the caller's H: undamped, unpermuted
        damp=percdamp_used,
        damp_raises=raises,
    )
