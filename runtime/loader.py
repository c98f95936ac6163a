"""Build a runnable transformers model from a quantized folder, with ``QuantLinear`` layers.

``load_quantized_model(qdir, device, dtype)``:
1. verify and read the checkpoint (native, GPTQ or compressed-tensors, also made by other
   tools) into :class:`PackedCheckpoint`;
2. build the model with :func:`quantpipe.core.hf_model.build_causal_lm` (parameters on the
   meta device, so no FP16 copy of a quantized weight is ever allocated), which
3. puts a ``QuantLinear`` (repacked on ``device``) in place of every quantized ``nn.Linear``,
   one layer at a time: each is read from the mmapped files, unpacked, repacked and dropped
   before the next, so the peak is the packed model plus one layer;
4. and assigns the FP tensors (embeddings, norms, kept-FP linears) cast to ``dtype``, tying
   embeddings.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpipe.core.formats.loader import QuantizedCheckpoint, load_quantized
from quantpipe.core.formats.native import quantized_tensors
from quantpipe.core.heap import release_freed_memory
from quantpipe.core.hf_model import build_causal_lm
from quantpipe.runtime.kernels.layout import PackedLinear
from quantpipe.runtime.quant_linear import QuantLinear

log = logging.getLogger(__name__)


@dataclass
class PackedCheckpoint:
    """Any quantized checkpoint, converted to the runtime's inputs layer by layer."""

    config: dict  # HF config.json without quantization_config
    source: QuantizedCheckpoint  # verified; layers and FP tensors read on access

    def layer_names(self) -> list[str]:
        return list(self.source.layers)

    def packed_layers(self) -> Iterator[tuple[str, PackedLinear]]:
        """(name, packed inputs) of each quantized linear, unpacked and packed one at a time."""
        fp = self.source.fp_tensors
        for name in self.source.layers:
            qw = self.source.layers[name]  # unpacked from the mmapped file now
            t = quantized_tensors(name, qw)  # native layout: qweight [out, in*bits/32] int32
            yield name, PackedLinear(
                spec=qw.spec,
                qweight=t[f"{name}.qweight"],
                scales=t[f"{name}.scales"],
                qzeros=t.get(f"{name}.qzeros"),
                g_idx=t.get(f"{name}.g_idx"),
                bias=fp[f"{name}.bias"] if f"{name}.bias" in fp else None,
                in_features=qw.shape[1],
            )

    def fp_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor that is not part of a quantized linear (biases belong to the linear)."""
        biases = {f"{name}.bias" for name in self.source.layers}
        for k in self.source.fp_tensors:
            if k not in biases:
                yield k, self.source.fp_tensors[k]


def read_packed(qdir: str | Path) -> PackedCheckpoint:
    """Any quantized folder (native, GPTQ, compressed-tensors) as the runtime's packed inputs.

    ``quantpipe.core.formats.loader.load_quantized`` verifies the folder first (manifest and shard
    hashes, tensor shapes and dtypes, finite positive scales, zeros in range) and unpacks it
    to quantpipe's convention; :meth:`PackedCheckpoint.packed_layers` then packs each layer in
    the native layout the kernels take, as it is needed.
    """
    ckpt = load_quantized(qdir)
    return PackedCheckpoint(ckpt.model_config(), ckpt)


def default_dtype(device: torch.device) -> torch.dtype:
    # CPU: fp32 for the FP layers (fp16/bf16 dense matmuls are several times slower on these
    # CPUs; quantized layers still run with bf16 activations). CUDA: fp16.
    return torch.float32 if device.type == "cpu" else torch.float16


def load_quantized_model(qdir: str | Path, device: str | torch.device = "cpu",
                         dtype: torch.dtype | None = None, backend: str | None = None):
    """A transformers causal LM running from the packed weights of ``qdir`` (eval mode)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch.cuda.is_available() is False; "
                         "use --device cpu")
    dtype = dtype or default_dtype(device)
    ckpt = read_packed(qdir)
    # each QuantLinear is built (repacked on device) as build_causal_lm asks for the next one
    quant_linears = ((name, QuantLinear(packed, device, backend=backend, bias_dtype=dtype))
                     for name, packed in ckpt.packed_layers())
    model = build_causal_lm(ckpt.config, ckpt.fp_tensors(), dtype, device=device,
                            modules=quant_linears, where=qdir)
    del ckpt, quant_linears
    release_freed_memory()
    counts = Counter(m.backend for m in model.modules() if isinstance(m, QuantLinear))
    log.info("loaded %s on %s: %d QuantLinear layers %s", qdir, device, sum(counts.values()),
             dict(counts))
    model.quantpipe_backends = dict(counts)
    return model
