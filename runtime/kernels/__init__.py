"""Quantized matmul kernels: Triton (CUDA) and torch's CPU int4pack / int8pack, plus layouts.

``layout`` (packed inputs and repacks, no GPU needed), ``cpu`` (CPU kernels and fallback),
``triton_kernels`` and ``autotune`` (import triton; used on CUDA and by interpreter tests).
"""
