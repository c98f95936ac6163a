"""Integer grids: scales and zeros from value ranges, and rounding onto the grid.

Convention (``quantpipe.qformat``): ``w_hat = (q - zero) * scale`` with unsigned ``q``.
Scales are rounded to fp16 *before* ``q`` is computed, so stored tensors reproduce exactly
the weights that were evaluated during calibration.
"""

from __future__ import annotations

import torch

from quantpipe.qformat import QuantSpec

# smallest scale allowed: keeps 1/scale finite and the fp16 scale a normal number
MIN_SCALE = 1e-5


def scale_zero_from_range(
    xmin: torch.Tensor, xmax: torch.Tensor, spec: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid parameters for per-group ranges.

    xmin, xmax: [...] fp32 (min and max of each group) -> scale [...] fp32 (fp16-representable),
    zero [...] fp32 holding integers in [0, maxq].
    """
    maxq = spec.maxq
    if spec.sym:
        absmax = torch.maximum(xmin.abs(), xmax.abs())
        # GPTQ / compressed-tensors symmetric grid: [-2^(b-1), 2^(b-1)-1] * scale
        scale = absmax / (maxq / 2)
        zero = torch.full_like(scale, float(spec.sym_zero))
    else:
        xmin = torch.minimum(xmin, torch.zeros_like(xmin))  # the grid must contain 0
        xmax = torch.maximum(xmax, torch.zeros_like(xmax))
        scale = (xmax - xmin) / maxq
    scale = scale.clamp(min=MIN_SCALE).half().float()  # round to fp16 first
    if not spec.sym:
        zero = torch.round(-xmin / scale).clamp(0, maxq)
    return scale, zero


def quantize_to_grid(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int
) -> torch.Tensor:
    """w, scale, zero broadcastable fp32 -> q fp32 integers in [0, maxq]."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def fake_quantize(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int
) -> torch.Tensor:
    """Quantize then dequantize (same broadcasting as :func:`quantize_to_grid`)."""
    return (quantize_to_grid(w, scale, zero, maxq) - zero) * scale
