"""What every quantization algorithm returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantpipe.blocks.device import to_host
from quantpipe.core.qformat import QuantizedWeight


@dataclass
class QuantResult:
    """One quantized linear plus the numbers the report shows for it."""

    weight: QuantizedWeight  # dequantize() is exactly the W_hat the loss was computed on
    loss: float  # proxy loss tr(dW H dW^T) when H was given, else sum((W - W_hat)**2)
    damp: float = 0.0  # relative dampening finally used (GPTQ: percdamp after any raises)
    damp_raises: int = 0  # times damping was raised after a failed Cholesky (GPTQ)


# elements of dW per chunk of rows in proxy_loss: the chunk's temporaries (dW H, its product
# with dW and the float64 copy) stay small instead of three more [out, in] matrices
PROXY_CHUNK = 1 << 20


def proxy_loss(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor | None) -> float:
    """tr(dW H dW^T) with dW = W - W_hat, or sum(dW**2) without H.

    W, W_hat: [out, in], H: [in, in] -> float. The matmul runs in fp32 (a float64 matmul
    costs far more on CPU and this is a report number, not an input to the maths); the
    reduction runs in float64 so that summing ~1e6 terms loses nothing. Rows go in chunks
    (:data:`PROXY_CHUNK`), so the temporaries stay small next to a large W.
    """
    dW = W.float() - W_hat.float()  # [out, in] fp32
    Hf = None if H is None else H.float()  # [in, in] fp32
    rows = max(1, PROXY_CHUNK // max(dW.shape[1], 1))
    total = 0.0
    for r in range(0, dW.shape[0], rows):
        d = dW[r:r + rows]  # [rows, in]
        # tr(dW H dW^T) = sum_o (dW H)[o] . dW[o]: [rows, in] @ [in, in] -> [rows, in]
        prod = d * d if Hf is None else (d @ Hf).mul_(d)
        total += float(prod.double().sum())
    return total


def result_to_host(res: QuantResult) -> QuantResult:
    """``res`` with its codes, scales, zeros and g_idx on the CPU (the loss is a float)."""
    w = res.weight
    weight = QuantizedWeight(w.spec, to_host(w.q), to_host(w.scales), to_host(w.zeros),
                             None if w.g_idx is None else to_host(w.g_idx))
    return QuantResult(weight, res.loss, res.damp, res.damp_raises)
