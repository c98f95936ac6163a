"""Round-to-nearest quantization (min-max, optional MSE clip search or fixed clip values)."""

from __future__ import annotations

import torch

from quantpipe.calibration.grid import (
    group_size_checked,
    params_for_groups,
    quantize_to_grid,
    to_groups,
)
from quantpipe.calibration.result import QuantResult, proxy_loss
from quantpipe.core.qformat import QuantizedWeight, QuantSpec


def check_weight(W: torch.Tensor, H: torch.Tensor | None = None) -> torch.Tensor:
    """Validate W [out, in] (and H [in, in]); return W as fp32."""
    if W.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(W.shape)}")
    if not torch.isfinite(W).all():
        raise ValueError("weight contains NaN/inf; check the source checkpoint")
    if H is not None:
        if H.shape != (W.shape[1], W.shape[1]):
            raise ValueError(
                f"H must be [in, in] = [{W.shape[1]}, {W.shape[1]}], got {tuple(H.shape)}; "
                "accumulate it from the inputs of this linear"
            )
        if not torch.isfinite(H).all():
            raise ValueError("H contains NaN/inf; check the calibration activations")
    return W.float()


def rtn(
    W: torch.Tensor,
    spec: QuantSpec,
    mse_clip: bool = False,
    H: torch.Tensor | None = None,
    grid: int | None = None,
    max_shrink: float | None = None,
    clip: torch.Tensor | None = None,
) -> QuantResult:
    """Round each group of W onto its own grid.

    W: [out, in] -> QuantResult with q [out, in] uint8, scales/zeros [out, G].
    ``mse_clip`` searches a shrink factor of each group's range minimizing the squared error,
    weighted by diag(H) when H is given (:func:`calibration.grid.params_for_groups`; ``grid``
    and ``max_shrink`` None take its settings); ``clip`` [out, G] fixes each group's
    max |value| (from :func:`calibration.awq.awq_clip_search`). The loss is tr(dW H dW^T)
    with H, else sum(dW**2).
    """
    W = check_weight(W, H)
    out_f, in_f = W.shape
    gs = group_size_checked(spec, in_f)
    Wg = to_groups(W, gs)  # [out, G, gs]
    col_weight = None
    if mse_clip and H is not None:
        col_weight = torch.diagonal(H).float().reshape(in_f // gs, gs)  # [G, gs]
    if clip is not None and clip.shape != Wg.shape[:2]:
        raise ValueError(f"clip must be [out, G] = {tuple(Wg.shape[:2])}, got {tuple(clip.shape)}")
    scale, zero = params_for_groups(
        Wg, spec, max_val=clip, mse_clip=mse_clip, col_weight=col_weight, grid=grid,
        max_shrink=max_shrink,
    )  # [out, G] each
    q = quantize_to_grid(Wg, scale.unsqueeze(-1), zero.unsqueeze(-1), spec.maxq)  # [out, G, gs]
    weight = QuantizedWeight(
        spec=spec,
        q=q.reshape(out_f, in_f).to(torch.uint8),  # [out, G, gs] -> [out, in] uint8
        scales=scale.half(),  # exact: scale is already fp16-representable
        zeros=zero.to(torch.uint8),
    )
    return QuantResult(weight=weight, loss=proxy_loss(W, weight.dequantize(), H))
