"""Scale / zero refinement after quantization: least squares on the calibration Hessian.

GPTQ (or RTN, AWQ) picks each group's scale and zero first and the integer codes ``q`` after;
once the codes are fixed, the scales (and, asymmetric, the zeros) that minimise the layer's
proxy loss

    tr(dW H dW^T),  dW = W - W_hat,  W_hat[r, j] = (q[r, j] - z[r, g(j)]) * s[r, g(j)]

are a linear least-squares problem per output row r: ``W_hat[r]`` is linear in the row's
scales for fixed zeros, and linear in (scale, offset b = -z s) jointly. ``H`` couples the
groups of a row, so the row's groups are solved together (normal equations, G x G or
2G x 2G, G = groups per row), in float64.

Asymmetric: the joint (s, b) solution gives a real zero ``z = -b / s``; zeros are stored as
integers, so z is rounded and clamped to [0, 2**bits - 1] and the scales are solved again
with those zeros fixed. Symmetric: the zero is the fixed mid-point, only the scales move.
The stored scales are fp16, so the loss is finally evaluated on the fp16-rounded scales, and
a row keeps its original scales and zeros unless the refined ones give a strictly smaller
loss (and are finite, positive and within fp16 range): refinement never increases any row's
proxy loss (tested). The codes ``q`` and ``g_idx`` never change, so the result dequantizes to
exactly the ``W_hat`` its loss was computed on, like every algorithm here.

A tiny ridge toward the current parameters (``RIDGE`` x the mean diagonal of each row's
system) keeps unidentifiable parameters where they were: a group whose codes are all equal
cannot tell its scale from its offset, and a dead input (``H_jj = 0``) carries no information.
"""

from __future__ import annotations

import torch

from quantpipe.calibration.result import QuantResult, proxy_loss
from quantpipe.core.qformat import QuantizedWeight

RIDGE = 1e-10  # relative to the mean diagonal of each row's normal matrix
FP16_MAX = 65504.0


def _grouped_sum(x: torch.Tensor, gi: torch.Tensor, n_groups: int) -> torch.Tensor:
    """x [rows, in] -> [rows, G]: sums of each row's entries per group (gi [in] long)."""
    return torch.zeros(x.shape[0], n_groups, dtype=x.dtype, device=x.device).index_add_(1, gi, x)


def _solve(M: torch.Tensor, c: torch.Tensor, theta0: torch.Tensor) -> torch.Tensor:
    """Rows of (M + lam I) theta = c + lam theta0; M [rows, k, k], c and theta0 [rows, k]."""
    k = M.shape[-1]
    diag = M.diagonal(dim1=-2, dim2=-1)  # [rows, k]
    lam = RIDGE * diag.abs().mean(-1, keepdim=True).clamp_min(1e-300)  # [rows, 1]
    A = M + lam[..., None] * torch.eye(k, dtype=M.dtype, device=M.device)
    return torch.linalg.solve(A, (c + lam * theta0)[..., None])[..., 0]


def solve_scales(W: torch.Tensor, H: torch.Tensor, u: torch.Tensor, gi: torch.Tensor,
                 n_groups: int, s0: torch.Tensor) -> torch.Tensor:
    """The scales s [rows, G] minimising sum_r (W_r - u_r * s_r[gi]) H (...)^T, float64.

    W, u: [rows, in] (u = q - z, the centred codes); H [in, in]; gi [in] long group of each
    column; s0 [rows, G] the current scales (the ridge's anchor). Normal equations per row:
    M[g, h] = sum_{j in g, k in h} u_j H_jk u_k, c[g] = sum_{j in g} u_j (H W_r)_j.
    """
    W, H, u = W.double(), H.double(), u.double()
    rows = W.shape[0]
    M = torch.empty(rows, n_groups, n_groups, dtype=torch.float64, device=W.device)
    for g in range(n_groups):
        cols = (gi == g).nonzero().squeeze(1)
        T = u[:, cols] @ H[cols, :]  # [rows, in]: sum_{j in g} u_j H_jk
        M[:, g, :] = _grouped_sum(T * u, gi, n_groups)
    c = _grouped_sum(u * (W @ H), gi, n_groups)  # H symmetric: (H W_r)_j = (W H)_rj
    return _solve(M, c, s0.double())


def solve_scales_offsets(W: torch.Tensor, H: torch.Tensor, q: torch.Tensor, gi: torch.Tensor,
                         n_groups: int, s0: torch.Tensor, b0: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales s and offsets b [rows, G] minimising the loss of W_hat = q * s[gi] + b[gi],
    float64 (the asymmetric grid with a real zero: b = -z s). Normal equations per row in
    (s_1..s_G, b_1..b_G)."""
    W, H, q = W.double(), H.double(), q.double()
    rows, G = W.shape[0], n_groups
    M = torch.empty(rows, 2 * G, 2 * G, dtype=torch.float64, device=W.device)
    for g in range(G):
        cols = (gi == g).nonzero().squeeze(1)
        T = q[:, cols] @ H[cols, :]  # [rows, in]: sum_{j in g} q_j H_jk
        M[:, g, :G] = _grouped_sum(T * q, gi, G)  # scale-scale
        M[:, g, G:] = _grouped_sum(T, gi, G)  # scale-offset
        # offset-offset: sum_{j in g, k in h} H_jk, the same for every row
        M[:, G + g, G:] = _grouped_sum(H[cols, :].sum(0, keepdim=True), gi, G)
    M[:, G:, :G] = M[:, :G, G:].transpose(1, 2)
    WH = W @ H  # [rows, in]
    c = torch.cat([_grouped_sum(q * WH, gi, G), _grouped_sum(WH, gi, G)], dim=1)
    theta = _solve(M, c, torch.cat([s0.double(), b0.double()], dim=1))
    return theta[:, :G], theta[:, G:]


def _row_losses(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    dW = (W.double() - W_hat.double())  # [rows, in]
    return ((dW @ H.double()) * dW).sum(1)  # [rows]


def refine_scales(W: torch.Tensor, H: torch.Tensor, weight: QuantizedWeight,
                  chunk_rows: int = 256) -> QuantizedWeight:
    """The same codes with least-squares scales (and zeros, asymmetric) per row; see the
    module docstring. W [out, in] (the weights the codes quantize), H [in, in] the caller's
    undamped Hessian (2 X^T X / n). Rows are solved ``chunk_rows`` at a time (memory
    chunk x G^2 and chunk x in, float64)."""
    if W.shape != weight.q.shape or H.shape != (W.shape[1], W.shape[1]):
        raise ValueError(f"shapes: W {tuple(W.shape)}, q {tuple(weight.q.shape)}, "
                         f"H {tuple(H.shape)}; H must be [in, in]")
    if not (torch.isfinite(W).all() and torch.isfinite(H).all()):
        raise ValueError("W or H holds NaN/inf")
    spec = weight.spec
    gi = weight.group_index().long().to(W.device)  # [in] (made on the CPU by qformat)
    G = weight.scales.shape[1]
    qmax = 2**spec.bits - 1
    scales, zeros = weight.scales.clone(), weight.zeros.clone()
    for r0 in range(0, W.shape[0], chunk_rows):
        rs = slice(r0, r0 + chunk_rows)
        Wc, qc = W[rs].double(), weight.q[rs].double()
        s0, z0 = weight.scales[rs].double(), weight.zeros[rs].double()
        if spec.sym:
            z = z0
        else:
            s_ab, b = solve_scales_offsets(Wc, H, qc, gi, G, s0, -z0 * s0)
            ok = torch.isfinite(s_ab) & (s_ab.abs() > 0)
            z = torch.where(ok, (-b / torch.where(ok, s_ab, 1.0)).round(), z0).clamp(0, qmax)
        s = solve_scales(Wc, H, qc - z[:, gi], gi, G, s0)
        s16 = s.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        new_hat = (qc - z[:, gi]) * s16.double()[:, gi]
        old_hat = (qc - z0[:, gi]) * s0[:, gi]
        better = _row_losses(Wc, new_hat, H) < _row_losses(Wc, old_hat, H)  # [rows]
        better &= (torch.isfinite(s) & (s > 0) & (s < FP16_MAX) & (s16 > 0)).all(1)
        scales[rs] = torch.where(better[:, None], s16, weight.scales[rs])
        zeros[rs] = torch.where(better[:, None], z.to(torch.uint8), weight.zeros[rs])
    return QuantizedWeight(spec, weight.q, scales, zeros, weight.g_idx)


def refine_result(W: torch.Tensor, H: torch.Tensor, result: QuantResult) -> QuantResult:
    """``result`` with :func:`refine_scales` applied and its proxy loss recomputed."""
    weight = refine_scales(W, H, result.weight)
    return QuantResult(weight, proxy_loss(W, weight.dequantize(), H), result.damp,
                       result.damp_raises)
