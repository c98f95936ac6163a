"""Quantized checkpoint formats: one module per format (``native``, ``gptq``,
``compressed_tensors``), registered in :data:`~quantpipe.core.formats.registry.FORMATS`; one
writer (``write_checkpoint``), one converter, the validating ``verify_checkpoint`` and the
format-neutral ``load_quantized``."""

from quantpipe.core.formats.base import CheckpointFormat
from quantpipe.core.formats.loader import (
    QuantizedCheckpoint,
    load_dequantized_model,
    load_quantized,
)
from quantpipe.core.formats.registry import FORMAT_NAMES, FORMATS, format_named
from quantpipe.core.formats.verify import VerifyReport, verify_checkpoint
from quantpipe.core.formats.writers import convert_checkpoint, write_checkpoint

__all__ = [
    "FORMATS", "FORMAT_NAMES", "CheckpointFormat", "QuantizedCheckpoint", "VerifyReport",
    "convert_checkpoint", "format_named", "load_dequantized_model", "load_quantized",
    "verify_checkpoint", "write_checkpoint",
]
