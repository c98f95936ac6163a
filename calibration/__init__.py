"""Calibration: prompt sets, activation capture, RTN / GPTQ / AWQ, layer sensitivity.

Works on the FP16 model alone; never imports ``runtime`` or ``reports``.
"""
