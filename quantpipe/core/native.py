"""quantpipe's native checkpoint under the names callers have imported from here.

The format itself lives in :mod:`quantpipe.core.formats.native` (one module per format, see
:mod:`quantpipe.core.formats.registry`); the FP16-source helpers in
:mod:`quantpipe.core.formats.common`; building a model from tensors in
:mod:`quantpipe.core.hf_model`. New code imports from those modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from quantpipe.core.formats.common import read_fp_state
from quantpipe.core.formats.loader import load_dequantized_model
from quantpipe.core.formats.native import (
    NATIVE_FORMAT_VERSION,
    QUANT_METHOD,
    NativeCheckpoint,
    quantized_tensors,
    read_native,
)
from quantpipe.core.formats.writers import write_checkpoint
from quantpipe.core.qformat import QuantizedWeight

__all__ = [
    "NATIVE_FORMAT_VERSION", "QUANT_METHOD", "NativeCheckpoint", "load_dequantized_model",
    "quantized_tensors", "read_fp_state", "read_native", "write_native",
]


def write_native(out: str | Path, fp16_dir: str | Path, weights: Mapping[str, QuantizedWeight],
                 **kwargs) -> dict:
    """Write a native quantized checkpoint: ``write_checkpoint("native", ...)`` (same keyword
    arguments: fp_overrides, manifest_fields, max_shard_size, force, fp16_shards,
    recorded_by); returns the manifest."""
    return write_checkpoint("native", out, fp16_dir, weights, **kwargs)
