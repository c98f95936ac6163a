"""Integer grids: scales and zeros from value ranges, and rounding onto the grid.

Convention (``quantpipe.core.qformat``): ``w_hat = (q - zero) * scale`` with unsigned ``q``.
Scales are rounded to fp16 *before* ``q`` is computed, so stored tensors reproduce exactly
the weights that were evaluated during calibration.
"""

from __future__ import annotations

import torch

from quantpipe.core.qformat import QuantSpec

# smallest scale allowed: keeps 1/scale finite and the fp16 scale a normal number
MIN_SCALE = 1e-5
# elements of W per chunk of rows in the MSE clip search (a chunk and its error stay in the L2
# cache while the candidates are evaluated)
CLIP_CHUNK = 1 << 17
# The clip search's candidates (params_for_groups), read when it runs: CLIP_GRID steps of the
# range down to (1 - CLIP_MAX_SHRINK) of it and, for symmetric grids, the top-code candidate.
# Until issue #18's measurement (docs/algorithms.md) they were 20 steps and no top-code
# candidate; bench/quality.py's --clip-grid / --clip-sym-top set them to reproduce that.
CLIP_GRID = 100  # steps of 0.01, as GPTQ's reference quantizer
CLIP_MAX_SHRINK = 0.8
CLIP_SYM_TOP_CODE = True


def clip_search_settings() -> dict:
    """The clip search's settings in effect (recorded by a calibration: results made with
    other settings differ, so a run must not resume across them)."""
    return {"grid": CLIP_GRID, "max_shrink": CLIP_MAX_SHRINK, "sym_top_code": CLIP_SYM_TOP_CODE}


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


# ---- per-group helpers shared by RTN, GPTQ and AWQ ------------------------------------------


def group_size_checked(spec: QuantSpec, in_features: int) -> int:
    """The group size used for a layer; ValueError with a remedy when it does not divide."""
    gs = spec.group_size_for(in_features)
    if in_features % gs != 0:
        raise ValueError(
            f"group_size {spec.group_size} does not divide in_features {in_features}; pick one "
            "with quantpipe.core.qformat.resolve_group_size (e.g. 32, 64 or -1) before quantizing"
        )
    return gs


def to_groups(W: torch.Tensor, gs: int) -> torch.Tensor:
    """W: [out, in] -> [out, G, gs] (a view; G = in // gs)."""
    out_f, in_f = W.shape
    return W.reshape(out_f, in_f // gs, gs)


def params_for_groups(
    Wg: torch.Tensor,
    spec: QuantSpec,
    max_val: torch.Tensor | None = None,
    mse_clip: bool = False,
    col_weight: torch.Tensor | None = None,
    grid: int | None = None,
    max_shrink: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero of every group.

    Wg: [out, G, gs] fp32 -> scale [out, G] fp32 (fp16-representable), zero [out, G] fp32.

    - plain: min-max of each group;
    - ``max_val`` [out, G]: the range is first clipped to ``[-max_val, max_val]`` (AWQ auto_clip);
    - ``mse_clip``: the range is shrunk by ``p = 1 - i / grid`` for ``i < max_shrink * grid``
      (GPTQ's quantizer ``mse`` option) and each group keeps the ``p`` with the smallest squared
      error, weighted per column by ``col_weight`` [G, gs] (e.g. diag(H)) when given. Min-max is
      evaluated first and only a strictly smaller error replaces it, so the search never loses
      to min-max. Symmetric grids also try, last, the scale that puts the largest positive
      value exactly on the top code, ``max / (maxq - zero)`` (``max / 7`` at INT4: min-max's
      ``absmax / 7.5`` clamps it half a step short; the one candidate above min-max), kept
      where its error is smaller (CLIP_SYM_TOP_CODE). ``grid`` and ``max_shrink`` default to
      CLIP_GRID and CLIP_MAX_SHRINK.
    """
    xmin = Wg.amin(dim=-1)  # [out, G]
    xmax = Wg.amax(dim=-1)  # [out, G]
    if max_val is not None:
        assert max_val.shape == xmin.shape, (max_val.shape, xmin.shape)
        xmin = torch.maximum(xmin, -max_val)
        xmax = torch.minimum(xmax, max_val)
    scale, zero = scale_zero_from_range(xmin, xmax, spec)
    if not mse_clip:
        return scale, zero
    grid = CLIP_GRID if grid is None else grid
    max_shrink = CLIP_MAX_SHRINK if max_shrink is None else max_shrink
    if grid < 1 or not 0.0 < max_shrink <= 1.0:
        raise ValueError(
            f"mse_clip needs grid >= 1 and 0 < max_shrink <= 1, got grid={grid}, "
            f"max_shrink={max_shrink}; the defaults are {CLIP_GRID} and {CLIP_MAX_SHRINK}"
        )
    col_weight = None if col_weight is None else col_weight.expand(Wg.shape[1:])  # [G, gs]
    # Rows are searched in chunks of about CLIP_CHUNK elements: each candidate's error passes
    # then stay in cache instead of streaming the whole error through memory.
    rows = max(1, CLIP_CHUNK // (Wg.shape[1] * Wg.shape[2]))
    for r in range(0, Wg.shape[0], rows):
        chunk = slice(r, r + rows)
        scale[chunk], zero[chunk] = _mse_clip_rows(
            Wg[chunk], xmin[chunk], xmax[chunk], scale[chunk], zero[chunk], spec, col_weight,
            grid, max_shrink,
        )
    return scale, zero



def _mse_clip_rows(
    Wg: torch.Tensor,
    xmin: torch.Tensor,
    xmax: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    spec: QuantSpec,
    col_weight: torch.Tensor | None,
    grid: int,
    max_shrink: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shrink search of :func:`params_for_groups` on some rows.

    Wg: [rows, G, gs] fp32, xmin / xmax / scale / zero: [rows, G] (min-max params),
    col_weight: [G, gs] or None -> the best scale, zero [rows, G].
    """

    sym_lo, sym_hi = -float(spec.sym_zero), float(spec.maxq - spec.sym_zero)

    def err_of(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        # fake_quantize's values, in place in fp32: [rows, G, gs]
        s, z = s.unsqueeze(-1), z.unsqueeze(-1)  # [rows, G, 1]
        if spec.sym:  # zero is sym_zero everywhere: clamp(round(x) + z, 0, maxq) - z in one
            d = torch.div(Wg, s).round_().clamp_(sym_lo, sym_hi).mul_(s)
        else:
            d = torch.div(Wg, s).round_().add_(z).clamp_(0, spec.maxq).sub_(z).mul_(s)
        # squared error in fp32: a candidate within fp32 rounding of the best one is as good
        d.sub_(Wg).square_()  # [rows, G, gs]
        if col_weight is not None:
            d.mul_(col_weight)
        return d.sum(dim=-1)  # [rows, G]

    best_err = err_of(scale, zero)
    shrinks = [1.0 - i / grid for i in range(1, int(max_shrink * grid))]
    # symmetric, last: the range grown by (maxq / 2) / sym_hi (7.5 / 7 at INT4), which puts a
    # positive extreme exactly on the top code; where the largest |value| is negative it is
    # only a coarser grid, which the error turns down like any other candidate
    top = [spec.maxq / 2 / sym_hi] if spec.sym and CLIP_SYM_TOP_CODE else []
    for p in shrinks + top:
        s, z = scale_zero_from_range(p * xmin, p * xmax, spec)
        err = err_of(s, z)
        better = err < best_err  # [rows, G] bool
        best_err = torch.where(better, err, best_err)
        scale = torch.where(better, s, scale)
        zero = torch.where(better, z, zero)
    return scale, zero
