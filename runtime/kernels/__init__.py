"""Quantized matmul kernels: Triton (CUDA), our C++ int4 CPU kernel, torch's int4pack /
int8pack, plus layouts.

``layout`` (packed inputs and repacks, no GPU needed), ``cpu`` (CPU kernels and fallback),
``cpu_ext`` (builds and loads ``csrc/cpu_ops.cpp``),
``triton_kernels`` and ``autotune`` (import triton; used on CUDA and by interpreter tests).
"""
