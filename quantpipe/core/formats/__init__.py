"""Quantized checkpoint formats beyond the native one: GPTQ and compressed-tensors writers,
the validating ``verify_checkpoint`` and the format-neutral ``load_quantized``."""

from quantpipe.core.formats.loader import QuantizedCheckpoint, load_quantized
from quantpipe.core.formats.verify import VerifyReport, verify_checkpoint
from quantpipe.core.formats.writers import convert_native, write_compressed_tensors, write_gptq

__all__ = [
    "QuantizedCheckpoint", "VerifyReport", "convert_native", "load_quantized",
    "verify_checkpoint", "write_compressed_tensors", "write_gptq",
]
