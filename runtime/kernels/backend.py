"""What one QuantLinear backend is: a repack done once at load, the matmul that reads it, and the
checks that say whether it can run a given layer here (with the reason kept for the logs).

The backends themselves are registered in :data:`quantpipe.runtime.quant_linear.BACKENDS`
(the CPU ones are defined in :mod:`quantpipe.runtime.kernels.cpu`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from quantpipe.runtime.kernels.layout import PackedLinear


def always_available() -> tuple[bool, str]:
    return True, "torch"


@dataclass(frozen=True)
class Backend:
    """One kernel family for quantized linears (see the table in ``quant_linear``)."""

    name: str  # QuantLinear.backend, the loader's per-backend counts, bench/ result rows
    device_type: str | None  # "cpu" or "cuda" where it runs; None: any device
    repack: Callable[[PackedLinear, torch.device], Any]  # once, at load: the layout it reads
    matmul: Callable[[torch.Tensor, Any], torch.Tensor]  # (x2d [M, in], repacked) -> [M, out]
    # why this kernel cannot compute layer ``p`` (bits, group size, shape, act-order), or None
    unfit: Callable[[PackedLinear], str | None]
    # (runs on this machine, why): the kernel build, the CPU's ISA, triton installed
    available: Callable[[], tuple[bool, str]] = always_available

    def usable(self, p: PackedLinear, device: torch.device) -> tuple[bool, str]:
        """(this backend runs layer ``p`` on ``device``, the reason)."""
        if self.device_type is not None and device.type != self.device_type:
            return False, f"{self.name} runs on {self.device_type}, not {device.type}"
        ok, why = self.available()
        if not ok:
            return False, why
        unfit = self.unfit(p)
        return (False, unfit) if unfit else (True, why)
