"""The checkpoint formats quantpipe writes and reads: one line per format.

A new format is one module of this package defining ``FORMAT = CheckpointFormat(...)``
(:mod:`quantpipe.core.formats.base`) plus one entry below; the exporter, the verifier, the
loaders and the CLI's ``--format`` choices all read this dict.
"""

from __future__ import annotations

from quantpipe.core.formats import compressed_tensors, gptq, native
from quantpipe.core.formats.base import CheckpointFormat

# --format name -> format, in the order the CLI lists them (the first is the default)
FORMATS: dict[str, CheckpointFormat] = {
    native.FORMAT.name: native.FORMAT,
    gptq.FORMAT.name: gptq.FORMAT,
    compressed_tensors.FORMAT.name: compressed_tensors.FORMAT,
}
FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)
# config.json quantization_config.quant_method -> format
FORMAT_OF_METHOD: dict[str, CheckpointFormat] = {f.quant_method: f for f in FORMATS.values()}
assert len(FORMAT_OF_METHOD) == len(FORMATS), "two formats claim the same quant_method"


def format_named(name: str) -> CheckpointFormat:
    """The format called ``name``; ValueError listing the known names otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"format {name!r} is not supported; use one of {FORMAT_NAMES}") from None
