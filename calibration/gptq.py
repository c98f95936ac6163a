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
import mmap
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
from quantpipe.core.heap import mapped_zeros
from quantpipe.core.qformat import QuantizedWeight, QuantSpec

logger = logging.getLogger(__name__)


# Rows (or columns) per step of the factor's passes over [in, in] float64 matrices: the
# temporaries stay a few [in, 256] panels while the matrix itself is the size of a 7B MLP's
# Hessian in float64.
FACTOR_PANEL = 256


def lower_triangular_inverse_(L: torch.Tensor, panel: int = FACTOR_PANEL) -> torch.Tensor:
    """L: [n, n] lower-triangular, non-singular (zero upper triangle) -> L^-1, in place.

    LAPACK trtri's blocked backward sweep (torch has no trtri): the trailing part T is already
    its inverse when the panel [[D, 0], [P, T]] is reached, and the panel becomes
    -T^-1 P D^-1, so every matrix product reads the trailing inverse as it is (n^3 / 3 flops in
    all: the products skip T^-1's zero upper part a row block at a time). The temporaries are
    an [n, panel] block, not triangular copies of half the matrix.
    """
    n = L.shape[0]
    for j in reversed(range(0, n, panel)):
        e = min(j + panel, n)
        D = L[j:e, j:e]  # [b, b] diagonal block
        Dinv = torch.linalg.solve_triangular(
            D, torch.eye(e - j, dtype=L.dtype, device=L.device), upper=False)
        if e < n:
            P = L[e:, j:e]  # [m, b] panel below D
            TP = torch.empty_like(P)  # [m, b] T^-1 P: row block r reads T^-1's columns < r1
            for r0 in range(0, n - e, panel):
                r1 = min(r0 + panel, n - e)
                torch.mm(L[e + r0:e + r1, e:e + r1], P[:r1], out=TP[r0:r1])
            torch.mm(TP, Dinv, out=P).neg_()
        D.copy_(Dinv)
    return L


def _float64_workspace(n: int, device: torch.device) -> tuple[torch.Tensor, object]:
    """[n, n] float64 for the factor. On the CPU it is an anonymous memory map, so that the
    half the fp32 factor does not use can be handed back to the OS (:func:`_release_tail`)
    while the factor lives in the other half; -> (tensor, the map or None)."""
    if device.type != "cpu":
        return torch.empty(n, n, dtype=torch.float64, device=device), None
    return mapped_zeros((n, n), torch.float64)


def _release_tail(buf, used_bytes: int) -> None:
    """Hand back the workspace's pages past ``used_bytes`` (they are never read again)."""
    start = -(-used_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    if buf is not None and start < len(buf):
        buf.madvise(mmap.MADV_DONTNEED, start, len(buf) - start)


def _reversed_float32_(A: torch.Tensor, panel: int = FACTOR_PANEL) -> torch.Tensor | None:
    """A: [n, n] float64, C-contiguous -> J A J in float32, written over the first half of
    A's own memory (no second matrix); None if any entry is not finite.

    Row r's fp32 copy lands in bytes that held rows r / 2 .. (r + 1) / 2, which are read
    before (rows are converted in increasing order, a panel at a time); then the flat array
    is reversed in place, which reverses both the rows and the columns.
    """
    n = A.shape[0]
    flat = A.view(-1).view(torch.float32)[:n * n]  # [n * n] fp32 view of the first half
    for r0 in range(0, n, panel):
        r1 = min(r0 + panel, n)
        rows = A[r0:r1].float()  # [rows, n]: read before the write below covers them
        if not bool(torch.isfinite(rows).all()):
            return None
        flat[r0 * n:r1 * n] = rows.view(-1)
    half, step = (n * n) // 2, panel * n
    for a in range(0, half, step):
        e = min(a + step, half)
        front, back = flat[a:e], flat[n * n - e:n * n - a]  # disjoint: e <= half
        keep = front.flip(0)
        front.copy_(back.flip(0))
        back.copy_(keep)
    return flat.view(n, n)


def damped_inverse_cholesky(
    H: torch.Tensor, order: torch.Tensor, percdamp: float, max_damp_raises: int
) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor of (H_p + damp I)^-1, H_p = H in column order ``order`` with the
    diagonal of dead inputs (H_ii = 0) set to 1; damp is raised tenfold while it fails.

    H: [in, in] any float dtype, order: [in] int64 -> (Hinv [in, in] fp32 upper-triangular
    in ``order``, percdamp used, raises). damp = percdamp * mean(diag(H_p)) (sec. 3, "Step 3:
    Cholesky reformulation": dampening keeps the inverse well-conditioned; a Cholesky failure
    means H + damp I is not numerically positive definite, so more dampening is the standard
    remedy). The factorization runs in float64.

    One Cholesky and one triangular inverse give the factor: with J the order-reversing
    permutation, if J (H_p + damp I) J = L L^T then (H_p + damp I)^-1 = U^T U with
    U = J L^-1 J, upper-triangular with a positive diagonal, i.e. the Cholesky factor of the
    inverse (the reference code forms the inverse and factors it again: twice the work).

    Memory: one [in, in] float64 matrix besides H, a few panels, and nothing else: the matrix
    is gathered a panel of rows at a time, factored in place (as a column-major matrix, which
    LAPACK factors without a copy: the upper factor of a column-major symmetric matrix is
    the lower one, L, of the row-major memory), inverted in place, and the fp32 factor is
    written over its first half, the second half handed back to the OS.
    """
    n = H.shape[0]
    diag_p = torch.diagonal(H)[order].double()  # [in] f64
    diag_p[diag_p == 0] = 1.0  # dead inputs (see hessian_factor)
    mean_diag = float(diag_p.mean())
    rev = order.flip(0)  # [in] J applied to the order
    info = torch.empty((), dtype=torch.int32, device=H.device)
    raises = 0
    while True:
        damp = percdamp * mean_diag
        A, buf = _float64_workspace(n, H.device)  # [in, in] f64
        for r0 in range(0, n, FACTOR_PANEL):  # J H_p J, a panel of rows at a time
            r1 = min(r0 + FACTOR_PANEL, n)
            A[r0:r1] = H[rev[r0:r1, None], rev]
        A.diagonal().copy_(diag_p.flip(0)).add_(damp)
        At = A.t()  # column-major view of the symmetric matrix: factored in place
        _, info = torch.linalg.cholesky_ex(At, upper=True, out=(At, info))
        if int(info) == 0:
            Hinv = _reversed_float32_(lower_triangular_inverse_(A))  # J L^-1 J, upper
            if Hinv is not None:
                _release_tail(buf, 4 * n * n)
                return (Hinv if buf is not None else Hinv.clone()), percdamp, raises
        del A, At, buf
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
    damp: float  # the absolute dampening added to diag(H): percdamp * mean(diag(H))
    dead: torch.Tensor  # [in] bool: inputs never active in calibration (H_ii = 0)
    perm: torch.Tensor  # [in] int64: the order in which the columns are quantized
    diag_H: torch.Tensor  # [in] fp32 diag(H), dead inputs set to 1, original column order
    Hinv: torch.Tensor  # [in, in] fp32 upper Cholesky factor of (H + damp I)^-1, permuted


def hessian_factor(
    H: torch.Tensor, act_order: bool, percdamp: float = 0.01, max_damp_raises: int = 8
) -> HessianFactor:
    """H: [in, in] (any float dtype) -> its :class:`HessianFactor` (dead inputs, act-order
    permutation, damped inverse Cholesky factor computed in float64, stored as fp32)."""
    if H.dim() != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"H must be square [in, in], got shape {tuple(H.shape)}")
    if not torch.isfinite(H).all():
        raise ValueError("H contains NaN/inf; check the calibration activations")
    if percdamp <= 0 or max_damp_raises < 0:
        raise ValueError(
            f"need percdamp > 0 and max_damp_raises >= 0; got {percdamp}, {max_damp_raises}"
        )
    diag = torch.diagonal(H).to(torch.float64, copy=True)  # [in] f64
    # Dead inputs (never active in calibration): H_ii = 0 gives no information; the diagonal
    # is taken as 1 so H stays invertible and those columns are quantized to 0 (IST gptq.py).
    dead = diag == 0  # [in] bool
    diag[dead] = 1.0
    # act-order (IST repo's --act-order heuristic, not in the paper): quantize the columns
    # with the largest Hessian diagonal first, while most columns remain to absorb errors.
    if act_order:
        perm = torch.argsort(diag, descending=True)  # [in] int64
    else:
        perm = torch.arange(H.shape[0], device=H.device)
    diag_H = diag.float()  # [in] weights for the mse_clip search
    # [in, in] fp32 upper, permuted; the updates run in fp32 like the reference code
    Hinv, percdamp_used, raises = damped_inverse_cholesky(H, perm, percdamp, max_damp_raises)
    damp = percdamp_used * float(diag.mean())
    return HessianFactor(act_order, percdamp_used, raises, damp, dead, perm, diag_H, Hinv)


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
    W_t: torch.Tensor,
    Hinv: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    col_group: torch.Tensor,
    maxq: int,
    block_size: int,
    group_params=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GPTQ column loop on permuted columns (sec. 3, steps 1-3), on W transposed.

    W_t: [in, out] fp32, W^T with its rows (W's columns) in the permuted order, updated in
    place; Hinv: [in, in] fp32 upper Cholesky factor of the permuted (H + damp I)^-1; scales /
    zeros: [out, G] fp32; col_group: [in] int64 group of every permuted column. Every column
    is a contiguous row of W_t, so the per-column steps and the lazy batch updates read and
    write contiguous memory. ``group_params(cols, rest, j)`` (dynamic groups) gives the scale
    and zero [out] of the group entered at permuted column j from its current columns, and the
    caller's ``scales``, ``zeros`` and ``col_group`` are filled in as groups are entered.
    -> (Q_t [in, out] fp32 dequantized, q_t [in, out] uint8, Losses [out] f64 per-row OBS
    loss), rows in the permuted order.
    """
    n_cols, out_f = W_t.shape
    Q_t = torch.empty_like(W_t)  # [in, out] dequantized, permuted order
    q_t = torch.empty(n_cols, out_f, dtype=torch.uint8, device=W_t.device)  # [in, out] permuted
    # [out] per-row OBS loss (as IST code)
    Losses = torch.zeros(out_f, dtype=torch.float64, device=W_t.device)
    # sec. 3, "Step 2: lazy batch-updates": quantize a block of columns with rank-1 updates
    # inside the block, then apply the block's accumulated error to the rest of W at once.
    for i1 in range(0, n_cols, block_size):
        i2 = min(i1 + block_size, n_cols)
        count = i2 - i1
        W1 = W_t[i1:i2]  # [count, out] view: row i is column i1 + i
        Q1 = Q_t[i1:i2]  # [count, out] view, dequantized
        q1 = torch.empty_like(W1)  # [count, out] integers (fp32 until the block is done)
        Err1 = torch.empty_like(W1)  # [count, out]
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
                s, z = group_params(W1[i:].t(), W_t[i2:].t(), j)
            q1[i] = qj = quantize_to_grid(w, s, z, maxq)  # [out] integers
            Q1[i] = (qj - z) * s  # same fp32 ops as QuantizedWeight.dequantize
            # sec. 2, OBQ update (sec. 3 Step 1: any fixed column order works):
            # delta_F = -(w - q) / [H_F^-1]_qq * (H_F^-1)_{:,q}; column j itself is done
            Err1[i] = err1 = (w - Q1[i]) / d  # [out]
            # [count - i - 1, 1] x [1, out] -> [count - i - 1, out] (an outer product)
            W1[i + 1:] -= torch.outer(Hinv1[i, i + 1:], err1)
        q_t[i1:i2] = q1  # exact: integers in [0, maxq]
        Losses += (Err1 * Err1).sum(dim=0).double() / 2  # (w - q)^2 / d^2 per column
        # lazy batch update of all later columns, in place:
        # [in - i2, out] -= [in - i2, count] @ [count, out]
        W_t[i2:].addmm_(Hinv[i1:i2, i2:].t(), Err1, alpha=-1)
    return Q_t, q_t, Losses


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

    scales = W.new_zeros(out_f, n_groups)  # [out, G] fp32 (fp16-representable)
    zeros = W.new_zeros(out_f, n_groups)  # [out, G] fp32 integers
    # group of each *permuted* column
    col_group = torch.empty(n_cols, dtype=torch.long, device=W.device)
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

        def group_params(W1_rest, W_rest, j):  # [out, *] views of W_t's rows
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

    W_t = W.t()[perm]  # [in, out] fp32: W's columns as rows, in the permuted order
    Q_t, q_t, Losses = gptq_columns(W_t, factor.Hinv, scales, zeros, col_group, spec.maxq,
                                    block_size, group_params)
    del W_t

    invperm = torch.argsort(perm)
    g_idx = col_group[invperm].to(torch.int32)  # [in] group of every original column
    stored = spec
    if torch.equal(g_idx.long(), torch.arange(n_cols, device=g_idx.device) // gs):
        # trivial: sequential groups. No g_idx is stored and the layer is recorded without
        # act-order (the spec describes the stored layout), so every format and kernel takes
        # its plain path (GPTQ desc_act false: vLLM's Marlin needs no g_idx sort)
        g_idx = None
        stored = QuantSpec(spec.bits, spec.group_size, spec.sym, act_order=False)
    weight = QuantizedWeight(
        spec=stored,
        q=q_t[invperm].t().contiguous(),  # [in, out] -> [out, in] uint8, original order
        scales=scales.half(),  # exact: fp16-representable by construction
        zeros=zeros.to(torch.uint8),
        g_idx=g_idx,
    )
    W_hat = weight.dequantize()  # [out, in] fp32
    assert torch.equal(W_hat, Q_t[invperm].t()), "stored tensors must reproduce W_hat exactly"
    return QuantResult(
        weight=weight,
        loss=_loss(W_in, W, W_hat, H, Losses, factor.damp),
        damp=factor.percdamp,
        damp_raises=factor.damp_raises,
    )


def _loss(W_in: torch.Tensor, W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor,
          Losses: torch.Tensor, damp: float) -> float:
    """The proxy loss tr(dW H dW^T) on the caller's H (undamped, unpermuted), dW = W - W_hat.

    GPTQ's own errors give it without the [out, in] @ [in, in] matmul: with Hinv = U, the
    loop's scaled errors E (Err1, [out, in]) satisfy W - W_hat = E U, so the damped loss is
    tr(dW (H + damp I) dW^T) = ||E||^2 = 2 * sum(Losses) (sec. 3: each step's OBS error), and
    the undamped one is that minus damp * ||dW||^2. Dead inputs drop out of both (their W
    columns are 0 here and their rows of H are 0). When the dampening term is a large part
    of the damped loss (after damping raises) the difference would lose digits, and the trace
    is formed directly instead.
    W_in: [out, in] caller's weights, W: [out, in] fp32 with dead columns zeroed, W_hat:
    [out, in] fp32, H: [in, in], Losses: [out] f64 -> float.
    """
    dW = W - W_hat  # [out, in] fp32
    damped = 2.0 * float(Losses.sum())  # tr(dW (H + damp I) dW^T)
    damp_part = damp * float(dW.square_().double().sum())
    if damp_part > 0.5 * damped:
        logger.debug("GPTQ: loss formed directly (damping %.3g of the damped loss)",
                     damp_part / max(damped, 1e-300))
        return proxy_loss(W_in, W_hat, H)
    return damped - damp_part


# GPTAQ's scaling of the asymmetric correction: the value of the authors' reference code
# (GPTAQ, a.k.a. GPTQv2); alpha = 1 is the undamped closed form
GPTAQ_ALPHA = 0.25


def gptaq_correction(dXXT: torch.Tensor, factor: HessianFactor,
                     alpha: float = GPTAQ_ALPHA) -> torch.Tensor:
    """GPTAQ's asymmetric term as a right factor: the target GPTQ then quantizes is W + W @ M.

    GPTAQ (Li et al. 2025, "GPTAQ: Efficient Finetuning-Free Quantization for Asymmetric
    Calibration", ICML 2025, sec. 3) calibrates each linear on
    ||W X_fp - Q X_q||^2: X_q are its inputs in the partly quantized model, X_fp those of the
    FP model, dX = X_fp - X_q. With H = 2 X_q X_q^T / n and dXXT = 2 dX X_q^T / n
    (both [in, in], same normalisation), the OBS step of column q gains, on every later
    column j, + w_q P_qj with P = alpha * triu(dXXT_p U^T, 1) U, where U (upper) is the
    Cholesky factor of (H_p + damp I)^-1 in GPTQ's column order p (sec. 3.3, "Cholesky
    reformulation"; P is strictly upper triangular: column q's input mismatch is absorbed by
    the columns quantized after it). Here w_q is column q of the *FP* weights (the mismatch
    term of the objective is W dX); the authors' code reads the error-updated column instead.
    With the FP weights every correction is known before the column loop, so they are added
    up front: in p-order, W_p += W_p P, i.e. W += W M with M = Pi P Pi^T; the column loop is
    GPTQ's unchanged.

    dXXT: [in, in] (any float dtype; rows index dX's feature, columns X_q's), factor: the
    :func:`hessian_factor` of H -> M [in, in] fp32, original column order. dXXT = 0 gives
    M = 0 (GPTAQ is GPTQ when the two models' inputs agree).
    """
    n = factor.Hinv.shape[0]
    if dXXT.shape != (n, n):
        raise ValueError(f"dXXT must be [in, in] = [{n}, {n}], got {tuple(dXXT.shape)}")
    if not torch.isfinite(dXXT).all():
        raise ValueError("dXXT contains NaN/inf; check the calibration activations")
    perm, U = factor.perm, factor.Hinv  # [in] int64, [in, in] fp32 upper (p-order)
    D_p = dXXT[perm[:, None], perm].float()  # [in, in] fp32 in p-order
    D_p[:, factor.dead[perm]] = 0.0  # dead X_q inputs carry nothing (their H_ii was set to 1)
    P = _strict_upper_product(D_p, U).mul_(alpha)  # [in, in] fp32, p-order
    M = torch.empty_like(P)
    M[perm[:, None], perm] = P  # back to the original column order: M = Pi P Pi^T
    return M


def _strict_upper_product(D: torch.Tensor, U: torch.Tensor,
                          rows: int = FACTOR_PANEL) -> torch.Tensor:
    """triu(D U^T, 1) U for U upper triangular: D, U [n, n] -> [n, n] (D's dtype).

    A block of rows i0..i1 needs only the trailing square U[i0:, i0:]: (D U^T)[i, j] for
    j >= i0 sums over k >= j (U[j, k] is zero below the diagonal), and the product with U
    reads the strictly upper part (k > i >= i0), whose rows of U are zero left of column i0,
    so the block's columns < i0 are zero. Skipping only exact zeros, this is the full product
    in 4 n^3 / 3 flops instead of 4 n^3 (n = 8960, a 1.5B model's MLP down_proj: 1 TFLOP
    instead of 2.9, per linear group).
    """
    n = U.shape[0]
    P = torch.zeros(n, n, dtype=D.dtype, device=D.device)
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)
        U_t = U[i0:, i0:]  # [n - i0, n - i0] upper
        # [b, n - i0] @ [n - i0, n - i0]^T, then its strictly upper part (row r is i0 + r)
        A = torch.triu(D[i0:i1, i0:] @ U_t.t(), diagonal=1)
        torch.mm(A, U_t, out=P[i0:i1, i0:])  # [b, n - i0] @ [n - i0, n - i0]
    return P


def gptaq(W: torch.Tensor, H: torch.Tensor, spec: QuantSpec, dXXT: torch.Tensor,
          alpha: float = GPTAQ_ALPHA, percdamp: float = 0.01, max_damp_raises: int = 8,
          corrections: dict | None = None, **gptq_kwargs) -> QuantResult:
    """GPTQ on the asymmetric target W + W M (:func:`gptaq_correction`).

    W: [out, in], H = 2 X_q X_q^T / n, dXXT = 2 (X_fp - X_q) X_q^T / n: [in, in] ->
    QuantResult whose loss is tr((T - W_hat) H (T - W_hat)^T) for the target T = W + W M.
    ``corrections``: a dict the caller keeps per (H, dXXT) pair, caching M per act_order and
    damping (the linears sharing an input and both bit widths share it); other keyword
    arguments go to :func:`gptq` (block_size, mse_clip, static_groups). Group parameters
    (static or dynamic) come from the target.
    """
    W_in = check_weight(W)
    if H.shape != (W_in.shape[1], W_in.shape[1]):
        raise ValueError(f"H must be [in, in] = [{W_in.shape[1]}, {W_in.shape[1]}], got "
                         f"{tuple(H.shape)}; accumulate it from the inputs of this linear")
    factor = _shared_factor(H, spec.act_order, percdamp, max_damp_raises)
    key = (spec.act_order, percdamp, max_damp_raises, alpha)
    M = None if corrections is None else corrections.get(key)
    if M is None:
        M = gptaq_correction(dXXT, factor, alpha)  # [in, in] fp32
        if corrections is not None:
            corrections[key] = M
    target = torch.addmm(W_in, W_in, M)  # [out, in] + [out, in] @ [in, in]
    return gptq(target, H, spec, percdamp=percdamp, max_damp_raises=max_damp_raises,
                factor=factor, **gptq_kwargs)
