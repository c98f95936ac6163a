"""``QuantEmbedding``: an ``nn.Embedding`` replacement that looks rows up in a packed quantized
table (``export --vocab-weights int8|int4``, :mod:`quantpipe.core.vocab`).

The table stays as stored (``qweight`` int32 ``[vocab, hidden * bits / 32]``, unsigned q packed
LSB-first along hidden, ``scales`` fp16 ``[vocab, G]``, symmetric: zero ``2**(bits-1)``); a
lookup unpacks and dequantizes only the rows asked for, ``w = (q - zero) * scale`` in fp32 as
:func:`quantpipe.core.qformat.dequantize` computes it (so the rows equal the reference model's
bit for bit), then casts to the activation dtype. On CPU the loader hands it a read-only
memory map of the checkpoint's shard (``runtime.loader``): only the pages of rows looked up
become resident. Works on any device (torch ops only).
"""

from __future__ import annotations

import torch
from torch import nn

from quantpipe.core.qformat import QuantSpec, dequantize, unpack_int32


class QuantEmbedding(nn.Module):
    """Row lookups from a packed symmetric or asymmetric quantized table (module docstring).

    ``embed_scale``: the scale of the embedding it replaces (Gemma's sqrt(hidden), a buffer of
    transformers' scaled embeddings), applied to the rows in ``out_dtype``, as
    :class:`quantpipe.runtime.fp_head.CastEmbedding` does.
    """

    def __init__(self, spec: QuantSpec, qweight: torch.Tensor, scales: torch.Tensor,
                 qzeros: torch.Tensor | None, out_dtype: torch.dtype,
                 num_embeddings: int | None = None,
                 embed_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        vocab, words = qweight.shape
        self.spec = spec
        self.embedding_dim = words * 32 // spec.bits
        self.num_embeddings = num_embeddings or vocab
        n_groups = spec.n_groups(self.embedding_dim)
        assert qweight.dtype == torch.int32, qweight.dtype
        assert scales.shape == (vocab, n_groups) and scales.dtype == torch.float16
        assert qzeros is None or qzeros.shape == scales.shape
        self.out_dtype = out_dtype
        self.group_size = spec.group_size_for(self.embedding_dim)
        self.register_buffer("qweight", qweight, persistent=False)  # [vocab, hidden*bits/32]
        self.register_buffer("scales", scales, persistent=False)  # [vocab, G] fp16
        self.register_buffer("qzeros", qzeros, persistent=False)  # [vocab, G] uint8 or None
        if embed_scale is not None:  # only then: code tells a scaled embedding by this buffer
            self.register_buffer("embed_scale", embed_scale.detach().clone(), persistent=False)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, spec={self.spec.label()}, "
                f"out_dtype={self.out_dtype}")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> the dequantized rows [..., hidden] fp32 (only these are unpacked)."""
        flat = ids.reshape(-1).to(self.qweight.device)
        # [T, hidden * bits / 32] int32 -> q [T, hidden] uint8, exact
        q = unpack_int32(self.qweight[flat], self.spec.bits, self.embedding_dim)
        s = self.scales[flat]  # [T, G] fp16
        z = (torch.full_like(s, self.spec.sym_zero, dtype=torch.uint8) if self.qzeros is None
             else self.qzeros[flat])  # [T, G] uint8
        g = torch.arange(self.embedding_dim, device=q.device) // self.group_size  # [hidden]
        w = dequantize(q, s, z, g)  # [T, hidden] fp32
        return w.view(*ids.shape, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows(ids).to(self.out_dtype)  # [..., hidden]
        scale = getattr(self, "embed_scale", None)
        return rows if scale is None else rows * scale.to(self.out_dtype)
