"""The format-neutral view of one stored quantized linear, used by every reader."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class UnpackedLayer:
    """One linear's tensors after unpacking, before the value checks of ``verify``.

    Zeros are kept as int32 so that an out-of-range stored zero (e.g. a GPTQ v1 nibble 15,
    i.e. zero 16 for INT4) can be reported instead of silently wrapping in uint8.
    """

    q: torch.Tensor  # uint8 [out, in], values in [0, 2**bits - 1]
    scales: torch.Tensor  # fp16 [out, G]
    zeros: torch.Tensor  # int32 [out, G], unsigned convention (sym: 2**(bits-1))
    g_idx: torch.Tensor | None  # int32 [in] or None (sequential groups)


# (shape, dtypes allowed) of every tensor a layer must have; shape entries are ints
Expected = dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]
