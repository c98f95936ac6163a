"""Quantized matmul kernels: Triton (CUDA), our C++ CPU kernels, torch's int4pack / int8pack,
plus layouts.

``backend`` (what a QuantLinear backend is: repack, matmul, usable checks), ``layout`` (packed
inputs and repacks, no GPU needed), ``cpu`` (the CPU backends, their layouts and the choice
between them), ``cpu_ext`` (builds and loads ``csrc/cpu_ops*.cpp``), ``triton_kernels`` and
``autotune`` (import triton; used on CUDA and by interpreter tests). Every backend is
registered by name in ``quantpipe.runtime.quant_linear.BACKENDS``.
"""
