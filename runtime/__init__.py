"""Runtime: quantized kernels, QuantLinear, model loader, engine and server.

Reads checkpoints through ``quantpipe``; never imports ``calibration`` or ``reports``.
"""
