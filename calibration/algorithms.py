"""The calibration algorithms as data: one :class:`~quantpipe.calibration.block_step.Algorithm`
row per ``--algo`` name (docs/algorithms.md has the table).

A new algorithm is its maths (a module of pure functions on tensors), a per-linear quantizer
(``block_step``) and one row here, plus the row of its options in
``calibration.config.ALGO_OPTIONS``; one with a data flow of its own also gives its
``whole_block`` function (``two_stream`` is GPTAQ's).
"""

from __future__ import annotations

from dataclasses import replace

from quantpipe.calibration.block_step import (
    Algorithm,
    awq_step,
    quantize_awq,
    quantize_gptaq,
    quantize_gptq,
    quantize_rtn,
)
from quantpipe.calibration.two_stream import asymmetric_block

_GPTQ = Algorithm(records_inputs=False, samples_rows=False, block_step=None,
                  quantize=quantize_gptq, one_thread=True, quantized_forward=True,
                  asymmetric=False)
ALGORITHMS: dict[str, Algorithm] = {
    "gptq": _GPTQ,
    # GPTQ on ||W X_fp - Q X_q||^2 (calibration.gptq.gptaq): dense families only
    "gptaq": replace(_GPTQ, quantize=quantize_gptaq, asymmetric=True,
                     whole_block=asymmetric_block),
    "awq": Algorithm(records_inputs=True, samples_rows=True,
                     block_step=awq_step, quantize=quantize_awq,
                     one_thread=False, quantized_forward=False,
                     asymmetric=False),
    # AWQ's scales searched and folded, then GPTQ on the scaled weights, with the Hessians of
    # the scaled inputs (scale_block rescales the statistics it folds)
    "awq+gptq": replace(_GPTQ, records_inputs=True, samples_rows=True, block_step=awq_step),
    "rtn": Algorithm(records_inputs=False, samples_rows=False,
                     block_step=None, quantize=quantize_rtn,
                     one_thread=False, quantized_forward=False,
                     asymmetric=False),
}
# --algo's default (config.AUTO): GPTAQ, the best measured on held-out text
# (docs/algorithms.md), where it applies (dense models); GPTQ for mixture-of-experts models,
# which GPTAQ cannot pair. config.ALGO_OPTIONS has the same names (a test checks it).
