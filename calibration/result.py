"""What every quantization algorithm returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantpipe.core.qformat import QuantizedWeight


@dataclass
class QuantResult:
    """One quantized linear plus the numbers the report shows for it."""

    weight: QuantizedWeight  # dequantize() is exactly the W_hat the loss was computed on
    loss: float  # proxy loss tr(dW H dW^T) when H was given, else sum((W - W_hat)**2)
    damp: float = 0.0  # relative dampening finally used (GPTQ: percdamp after any raises)
    damp_raises: int = 0  # times damping was raised after a failed Cholesky (GPTQ)


def proxy_loss(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor | None) -> float:
    """tr(dW H dW^T) with dW = W - W_hat, or sum(dW**2) without H.

    W, W_hat: [out, in], H: [in, in] -> float. The matmul runs in fp32 (a float64 matmul
    costs ~10x more on CPU and this is a report number, not an input to the maths); the
    reduction runs in float64 so that summing ~1e6 terms loses nothing.
    """
    dW = W.float() - W_hat.float()  # [out, in] fp32
    if H is None:
        return float((dW * dW).double().sum())
    # tr(dW H dW^T) = sum_o (dW H)[o] . dW[o]: [out, in] @ [in, in] -> [out, in]
    return float(((dW @ H.float()) * dW).double().sum())
