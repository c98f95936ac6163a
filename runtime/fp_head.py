"""The FP embedding table and output head (lm_head) in half precision on CPU.

The output head of a small model is its largest matmul (SmolLM2-135M: 49152 x 576, 28 M
weights; in fp32 113 MB are read for every generated token). The checkpoint stores it in fp16,
so keeping it in fp16 loses nothing, and on these CPUs the kernels differ a lot by dtype and by
the number of rows M (measured by ``bench/decode.py``; torch 2.13, AVX-512 BF16, one thread):
fp16 is the fastest for M = 1 (a GEMV that streams the weights once) and several times slower
than bf16 for M > 1; bf16 is flat in M; fp32 is the slowest at every M.

Modes of :class:`HalfHead` (``head_dtype`` of the runtime's loaders):

| mode   | weights kept               | M = 1 | M > 1 | numerics                           |
|--------|----------------------------|-------|-------|------------------------------------|
| fp16   | fp16 (the checkpoint's)    | fp16  | fp16  | exact weights, one path for all M  |
| bf16   | bf16 copy                  | bf16  | bf16  | weights rounded to bf16 (2**-9)    |
| auto   | fp16 and a bf16 copy       | fp16  | bf16  | depends on M (batch composition)   |

Inputs are cast to the weight dtype and logits back to the model's activation dtype. The
embedding table is kept in fp16 too (exact) and its rows are cast to the activation dtype, so the
residual stream keeps its precision; a tied head shares that fp16 tensor.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

HEAD_DTYPES = ("fp32", "fp16", "bf16", "auto")


class CastEmbedding(nn.Module):
    """``nn.Embedding`` lookups from a stored table, returned in ``out_dtype``."""

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [vocab, hidden]
        self.out_dtype = out_dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight).to(self.out_dtype)  # [..., hidden]


class HalfHead(nn.Module):
    """y = x @ W^T (+ b) with W in fp16 and/or bf16, chosen by mode and rows (module doc)."""

    def __init__(self, weight_fp16: torch.Tensor, bias: torch.Tensor | None, mode: str,
                 out_dtype: torch.dtype) -> None:
        super().__init__()
        if mode not in ("fp16", "bf16", "auto"):
            raise ValueError(f"head dtype {mode!r}: HalfHead takes fp16, bf16 or auto")
        if weight_fp16.dtype != torch.float16:
            raise ValueError(f"HalfHead needs the fp16 weight, got {weight_fp16.dtype}")
        self.mode = mode
        self.out_dtype = out_dtype
        self.out_features, self.in_features = weight_fp16.shape
        # [out, in] each; None where the mode does not use that dtype. Non-persistent buffers:
        # they follow .to(device) and count in memory accounting, but are not state_dict keys.
        self.register_buffer("w16", weight_fp16 if mode in ("fp16", "auto") else None,
                             persistent=False)
        self.register_buffer("w_bf16", weight_fp16.to(torch.bfloat16)
                             if mode in ("bf16", "auto") else None, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(),
                             persistent=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        # fp16 when it is the only copy, or (auto) for a single row; bf16 otherwise
        use16 = self.w16 is not None and (self.w_bf16 is None or rows == 1)
        w = self.w16 if use16 else self.w_bf16
        y = nn.functional.linear(x.to(w.dtype), w)  # [..., out]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(self.out_dtype)


def set_half_head(model: nn.Module, mode: str) -> None:
    """Replace the FP embedding table and lm_head of an HF causal LM (see the module doc).

    ``mode="fp32"`` leaves the model as it is, and so does a model whose table or head is not
    fp16-representable (a bf16 or fp32 checkpoint: rounding would change it; logged).
    """
    if mode not in HEAD_DTYPES:
        raise ValueError(f"head dtype {mode!r}: use one of {HEAD_DTYPES}")
    if mode == "fp32":
        return
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or not isinstance(emb, nn.Embedding):
        raise ValueError(f"{type(model).__name__}: head dtype {mode} needs an nn.Embedding input "
                         f"and an nn.Linear output head, found {type(emb).__name__} and "
                         f"{type(head).__name__}")
    act_dtype = emb.weight.dtype
    tied = head.weight is emb.weight

    def to_fp16(w: torch.Tensor) -> torch.Tensor | None:
        w = w.detach()
        w16 = w.to(torch.float16)
        # exactness check in row chunks: no full-size temporary next to the fp32 table
        for i in range(0, w.shape[0], 4096):
            if not torch.equal(w16[i:i + 4096].to(w.dtype), w[i:i + 4096]):
                return None
        return w16

    table = to_fp16(emb.weight)
    head_w = table if tied else to_fp16(head.weight)
    if table is None or head_w is None:
        # bf16 / fp32 checkpoints: rounding to fp16 would change the model; keep it as it is
        log.warning("head dtype %s: the embedding table or lm_head is not fp16-representable "
                    "(not an fp16 checkpoint); keeping them in %s", mode, act_dtype)
        return
    model.set_input_embeddings(CastEmbedding(table, act_dtype))
    model.set_output_embeddings(HalfHead(head_w, head.bias, mode, act_dtype))
