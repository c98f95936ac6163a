"""Load any quantized folder quantpipe reads (any registered format) into one
format-neutral structure, after :mod:`quantpipe.core.formats.verify` has passed."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantpipe.core.experts import config_ints, fused_tensors
from quantpipe.core.families import FAMILIES
from quantpipe.core.formats.verify import VerifyReport, inspect_checkpoint
from quantpipe.core.hf_model import build_causal_lm
from quantpipe.core.qformat import QuantizedWeight, QuantSpec


@dataclass
class QuantizedCheckpoint:
    """A verified quantized checkpoint, unpacked.

    ``layers`` are unpacked :class:`~quantpipe.core.qformat.QuantizedWeight` (uint8 q, fp16 scales,
    uint8 zeros, int32 g_idx or None) in quantpipe's convention whatever the format on disk;
    ``fp_tensors`` hold every other tensor under its Hugging Face name (embeddings, norms,
    biases ``P.bias`` of quantized linears, linears kept in FP16). Both are read from the
    mmapped files on access, one tensor or layer at a time: a caller that converts and drops
    each layer holds one unpacked layer, never the whole model.
    """

    folder: Path
    checkpoint_format: str  # a name of quantpipe.core.formats.registry.FORMATS
    config: dict  # config.json, quantization_config included
    plan: dict[str, QuantSpec]  # quantized linear name -> spec (group size actually used)
    layers: Mapping[str, QuantizedWeight]  # same keys as plan
    fp_tensors: Mapping[str, torch.Tensor]
    manifest: dict | None  # quantpipe.json; None for folders made by other tools
    report: VerifyReport
    # quantized input embedding tables [vocab, hidden] by module name (``export
    # --vocab-weights``; a tied head is the table), unpacked on access
    embeddings: Mapping[str, QuantizedWeight] = field(default_factory=dict)

    def model_config(self) -> dict:
        """config.json without its quantization_config (to build the FP model skeleton)."""
        return {k: v for k, v in self.config.items() if k != "quantization_config"}

    def dequantized_tensors(self, dtype: torch.dtype = torch.float16, prefix: str = ""
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, tensor)`` of every FP tensor, then of every quantized linear's weight
        and embedding table dequantized to ``dtype`` (the reference weights), each read when
        it is asked for; only names starting with ``prefix``."""
        for k in self.fp_tensors:
            if k.startswith(prefix):
                yield k, self.fp_tensors[k]
        for quantized in (self.layers, self.embeddings):
            for name in quantized:
                if f"{name}.weight".startswith(prefix):
                    yield f"{name}.weight", quantized[name].dequantize(dtype)  # [out, in]

    def dequantized_state_dict(self, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
        """HF state dict with every quantized linear dequantized (the reference weights)."""
        return dict(self.dequantized_tensors(dtype))


def load_quantized(folder: str | Path, hashes: str = "stamp") -> QuantizedCheckpoint:
    """Verify then unpack a quantized folder; ValueError listing every problem otherwise.

    ``hashes``: how much is re-read (:data:`quantpipe.core.formats.verify.HASH_MODES`): by
    default every byte unless a verified stamp shows that these unchanged files passed."""
    ins = inspect_checkpoint(folder, hashes)
    return QuantizedCheckpoint(
        folder=Path(folder),
        checkpoint_format=ins.report.checkpoint_format,
        config=ins.config,
        plan=ins.plan,
        layers=ins.layers,
        fp_tensors=ins.fp_tensors,
        manifest=ins.manifest,
        report=ins.report,
        embeddings=ins.embeddings,
    )


def load_dequantized_model(folder: str | Path, dtype: torch.dtype = torch.float32):
    """Verify any quantized folder, then build a transformers model with dequantized weights
    (the reference model of `eval` and `report`); one layer is dequantized at a time and
    becomes the model's parameter (no second copy)."""
    ckpt = load_quantized(folder)
    tensors = model_tensors(ckpt.config, ckpt.dequantized_tensors(dtype))
    return build_causal_lm(ckpt.config, tensors, dtype, where=folder)


def model_tensors(config: dict, tensors: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hub name, tensor)`` pairs -> transformers' names: a MoE model's per-expert weights
    stacked into its 3-D ``gate_up_proj`` / ``down_proj`` (one block's experts held at a
    time) and Mixtral's ``block_sparse_moe`` renamed ``mlp``; dense models as they are."""
    family = FAMILIES.get(config.get("model_type"))
    if family is None or family.moe is None:
        yield from tensors
        return
    (num_experts,) = config_ints(config, family.moe.num_experts)
    yield from fused_tensors(tensors, family.blocks, family.moe, num_experts)
