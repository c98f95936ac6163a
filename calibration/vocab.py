"""Round-to-nearest quantization of a vocabulary table (embedding table or output head).

No calibration data: each row's groups get min-max symmetric scales
(:func:`quantpipe.calibration.grid.scale_zero_from_range`, the fp16 scale rounded before q)
and every weight its nearest grid point, as llama.cpp's Q8_0 / Q4_0 do. Rows are independent,
so a table of 262,144 rows is quantized ``CHUNK_ROWS`` rows at a time: the fp32 temporaries
are one chunk's, not the table's.
"""

from __future__ import annotations

import torch

from quantpipe.calibration.grid import quantize_to_grid, scale_zero_from_range, to_groups
from quantpipe.core.qformat import QuantizedWeight, QuantSpec

CHUNK_ROWS = 8192  # rows per step: 8192 x 1536 fp32 is 50 MB per temporary


def quantize_table(table: torch.Tensor, spec: QuantSpec) -> QuantizedWeight:
    """table [vocab, hidden] (fp16/bf16/fp32) -> QuantizedWeight [vocab, hidden] (RTN).

    ``spec`` must be symmetric (a stored zero per group would cost more than it saves on
    tables whose rows are centred on zero)."""
    if table.dim() != 2:
        raise ValueError(f"a vocabulary table is 2-D [vocab, hidden], got {tuple(table.shape)}")
    assert spec.sym, "vocabulary tables are quantized symmetric"
    vocab, hidden = table.shape
    gs = spec.group_size_for(hidden)
    n_groups = spec.n_groups(hidden)
    q = torch.empty(vocab, hidden, dtype=torch.uint8)
    scales = torch.empty(vocab, n_groups, dtype=torch.float16)
    for r0 in range(0, vocab, CHUNK_ROWS):
        W = table[r0:r0 + CHUNK_ROWS].float()  # [rows, hidden] fp32
        if not torch.isfinite(W).all():
            raise ValueError(f"rows {r0}..{r0 + W.shape[0] - 1} of the table hold NaN/inf; "
                             "check the source checkpoint")
        Wg = to_groups(W, gs)  # [rows, G, gs]
        # min-max symmetric: scale = absmax / (maxq / 2), fp16-rounded first; zero = 2**(b-1)
        scale, zero = scale_zero_from_range(Wg.amin(-1), Wg.amax(-1), spec)  # [rows, G]
        qg = quantize_to_grid(Wg, scale[..., None], zero[..., None], spec.maxq)  # [rows, G, gs]
        q[r0:r0 + W.shape[0]] = qg.reshape(W.shape).to(torch.uint8)
        scales[r0:r0 + W.shape[0]] = scale.half()  # exact: already fp16-representable
    zeros = torch.full((vocab, n_groups), spec.sym_zero, dtype=torch.uint8)
    return QuantizedWeight(spec, q, scales, zeros)
