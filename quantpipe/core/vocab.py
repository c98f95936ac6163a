"""The vocabulary tables: the input embedding table and the output head (``lm_head``).

A small model with a large vocabulary spends most of its bytes here (Gemma-3-270M: 168 M of
268 M parameters in one tied 262,144 x 640 table), so ``quantpipe export --vocab-weights``
can store them quantized, as llama.cpp does (Q8_0 / Q6_K output, Q4_K token table):

| ``--vocab-weights`` | stored as                                 | bits per weight (hidden K) |
|---------------------|-------------------------------------------|----------------------------|
| ``fp16`` (default)  | the FP16 export's tensors, unchanged      | 16                         |
| ``int8``            | INT8 symmetric, one fp16 scale per row    | 8 + 16 / K                 |
|                     | (``--vocab-group-size`` G: per G columns) | 8 + 16 / G                 |
| ``int4``            | INT4 symmetric, one fp16 scale per 32     | 4.5 (G = 32)               |
|                     | columns (``--vocab-group-size``)          |                            |

Both use quantpipe's one integer convention (:mod:`quantpipe.core.qformat`): a table is a
:class:`~quantpipe.core.qformat.QuantizedWeight` ``[vocab, hidden]`` with a symmetric
:class:`~quantpipe.core.qformat.QuantSpec`, computed at export time by round-to-nearest
(min-max scales, no calibration data: ``quantpipe.calibration.vocab``). A tied head is stored
once (the embedding table's tensors) and stays tied. What each checkpoint format can hold is
the format's own (:attr:`quantpipe.core.formats.base.CheckpointFormat.vocab_support`).
"""

from __future__ import annotations

from dataclasses import dataclass

from quantpipe.core.families import FAMILIES
from quantpipe.core.qformat import QuantSpec

VOCAB_WEIGHTS = ("fp16", "int8", "int4")  # --vocab-weights choices; the first is the default
# --vocab-group-size when not given: int8 one scale per row (-1), int4 per 32 columns
# (llama.cpp's Q4_0 / Q8_0 block)
DEFAULT_GROUP_SIZE = {"int8": -1, "int4": 32}
BITS = {"int8": 8, "int4": 4}
HEAD = "lm_head"  # the output head's module name in every family quantpipe reads
VOCAB_SPEC_VERSION = 1  # of the manifest's "vocab" record


@dataclass(frozen=True)
class VocabSpec:
    """How ``export`` stores the embedding table and the output head."""

    weights: str = VOCAB_WEIGHTS[0]  # one of VOCAB_WEIGHTS
    group_size: int | None = None  # columns per scale; None: DEFAULT_GROUP_SIZE; -1 per row

    def __post_init__(self) -> None:
        if self.weights not in VOCAB_WEIGHTS:
            raise ValueError(f"--vocab-weights {self.weights!r} is not supported; use one of "
                             f"{VOCAB_WEIGHTS}")
        if self.group_size is None:
            return
        if self.weights == "fp16":
            raise ValueError("--vocab-group-size needs --vocab-weights int8 or int4 (fp16 "
                             "tables have no groups)")
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % 16):
            raise ValueError(f"--vocab-group-size {self.group_size} is not supported; use a "
                             "positive multiple of 16 (e.g. 32, 64, 128) or -1 (one per row)")

    @property
    def quantized(self) -> bool:
        return self.weights != "fp16"

    def quant_spec(self, hidden: int) -> QuantSpec | None:
        """The tables' spec for a hidden size (None: fp16); ValueError when the group size
        does not divide it."""
        if not self.quantized:
            return None
        gs = DEFAULT_GROUP_SIZE[self.weights] if self.group_size is None else self.group_size
        if gs != -1 and hidden % gs:
            ok = [str(g) for g in (32, 64, 128) if hidden % g == 0] + ["-1"]
            raise ValueError(f"--vocab-group-size {gs} does not divide the hidden size {hidden}; "
                             f"use {', '.join(ok)}")
        return QuantSpec(BITS[self.weights], gs, sym=True)


@dataclass(frozen=True)
class VocabTables:
    """Where a model's vocabulary tables are (module names, no ``.weight``)."""

    embedding: str  # e.g. "model.embed_tokens"
    head: str  # "lm_head"
    tied: bool  # the head is the embedding table (stored once)


def vocab_tables(config: dict) -> VocabTables:
    """The tables of a model config.json (family table + ``tie_word_embeddings`` as
    transformers reads it, its per-family default included); ValueError for a family
    quantpipe has no entry for."""
    from transformers import AutoConfig

    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"--vocab-weights: model_type {model_type!r} has no family entry "
                         f"(known: {sorted(FAMILIES)}); export with --vocab-weights fp16")
    hf = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
    return VocabTables(f"{family.decoder}.embed_tokens", HEAD,
                       bool(getattr(hf, "tie_word_embeddings", False)))
