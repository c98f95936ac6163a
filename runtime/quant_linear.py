"""``QuantLinear``: an ``nn.Linear`` replacement that runs from packed INT4/INT8 weights.

Backend per layer, chosen once at construction from the device and the layer's layout
(visible dispatch in :func:`choose_backend`):

| device | backend            | kernel                                                       |
|--------|--------------------|--------------------------------------------------------------|
| cuda   | ``triton``         | ``kernels/triton_kernels.py`` (autotuned GEMV / tl.dot)      |
| cpu    | ``w4a8_avx512``    | ``csrc/cpu_ops.cpp`` ``w4a8_mm`` (ours; VNNI, AMX >= 32 rows) |
| cpu    | ``w4a8_avx2``      | ``kernels/csrc/cpu_ops_avx2.cpp`` ``w4a8_mm`` (ours; AVX2)   |
| cpu    | ``w4a16_avx512``   | ``kernels/csrc/cpu_ops.cpp`` ``w4a16_mm`` (ours; bf16 activations) |
| cpu    | ``int4pack``       | ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (bf16)        |
| cpu    | ``w8a32_avx512``   | ``w8a32_mm``, AVX-512 build (exact int8 weights, fp32 activations) |
| cpu    | ``w8a32_avx2``     | ``w8a32_mm``, AVX2 build (the same numerics)                 |
| cpu    | ``int8pack``       | ``torch.ops.aten._weight_int8pack_mm`` (bf16 activations)    |
| any    | ``dequant``        | dequantize in fp32 + matmul per call (layouts the above reject) |

Our kernels are built on first use, one library per instruction set
(``kernels/cpu_ext.py``: the best the CPU has, or ``QUANTPIPE_CPU_ISA``). One name per kernel:
``wXaY`` (X-bit weights, Y-bit activations) is the backend (``wXaY_<isa>``), its C++ op
(``wXaY_mm``), its Python layout (``CpuWXAY``, ``repack_wXaY``, ``wXaY_matmul``) and the
docs' label (WXAY); torch's kernels keep torch's names (``int4pack``, ``int8pack``).

The repacked tensors are built on the target device at construction; no dequantized copy of
the weight outlives a forward call.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from quantpipe.runtime.kernels import cpu as cpu_kernels
from quantpipe.runtime.kernels.backend import Backend
from quantpipe.runtime.kernels.layout import PackedLinear, repack_for_triton, widen_to_int8

log = logging.getLogger(__name__)


def _triton_available() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed (pip install triton)"
    return True, "CUDA device"


def _triton_matmul(x2d: torch.Tensor, w) -> torch.Tensor:
    from quantpipe.runtime.kernels import autotune

    return autotune.run(x2d.contiguous(), w)


TRITON = Backend("triton", "cuda", repack_for_triton, _triton_matmul, lambda p: None,
                 _triton_available)
# Every backend by name (the module docstring's table): a new kernel is one Backend and one
# entry here, plus its place in choose_backend's order for its device.
BACKENDS: dict[str, Backend] = {b.name: b for b in (TRITON, *cpu_kernels.CPU_BACKENDS)}


def choose_backend(p: PackedLinear, device: torch.device) -> tuple[str, str]:
    """(backend name, reason) for layer ``p`` on ``device``."""
    if device.type == "cuda":
        ok, why = TRITON.usable(p, device)
        return (TRITON.name, why) if ok else (cpu_kernels.DEQUANT.name, why)
    if device.type == "cpu":
        return cpu_kernels.cpu_backend_for(p)
    return cpu_kernels.DEQUANT.name, f"no fast kernel for device type {device.type!r}"


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W held packed (see the module docstring for the backends)."""

    def __init__(self, packed: PackedLinear, device: torch.device | str = "cpu",
                 backend: str | None = None, bias_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        device = torch.device(device)
        self.in_features = packed.in_features
        self.out_features = packed.out_features
        self.spec = packed.spec  # as stored (INT5 / INT6 run as INT8: layout.widen_to_int8)
        packed = widen_to_int8(packed)
        if backend is None:
            backend, reason = choose_backend(packed, device)
        elif backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} unknown; use one of {tuple(BACKENDS)}")
        else:
            usable, why = BACKENDS[backend].usable(packed, device)
            if not usable:
                raise ValueError(f"backend {backend} is not usable here: {why}")
            reason = f"requested ({why})"
        self.backend = backend
        self.reason = reason
        kernel = BACKENDS[backend]
        self._w = kernel.repack(packed, device)
        self._expose_weights()
        bias = packed.bias
        if bias is not None:
            bias = bias.to(device=device, dtype=bias_dtype or bias.dtype)
        self.register_buffer("bias", bias, persistent=False)
        self.device_ = device
        self._on_cuda = device.type == "cuda"
        self._matmul = kernel.matmul

    def _expose_weights(self) -> None:
        """The repacked tensors as buffers (memory accounting, state inspection)."""
        for field, value in vars(self._w).items():
            if isinstance(value, torch.Tensor):
                self.register_buffer(f"w_{field}", value, persistent=False)
            else:  # e.g. a symmetric layer's absent mz: no stale buffer keeps old weights alive
                self._buffers.pop(f"w_{field}", None)

    def use_weights(self, w) -> None:
        """Run from ``w``, the same weights in the same layout (e.g. views into a fused tensor
        several layers share), so that the memory is held once."""
        assert type(w) is type(self._w)
        self._w = w
        self._expose_weights()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"spec={self.spec.label()}, backend={self.backend}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda != self._on_cuda:
            raise ValueError(
                f"input on {x.device} but QuantLinear was built for {self.device_}; load the "
                "model with device= the device of the inputs (packed weights are not moved)"
            )
        if x.dim() == 2:  # [M, in] (the engine's layout): no reshapes
            y = self._matmul(x, self._w)
        else:  # [..., in] -> [M, in] -> [M, out] -> [..., out]
            y = self._matmul(x.reshape(-1, self.in_features), self._w)
            y = y.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

