"""The FP embedding table and output head (lm_head) in half precision on CPU.

The output head of a small model is its largest matmul (SmolLM2-135M: 49152 x 576, 28 M
weights; in fp32 113 MB are read for every generated token). The checkpoint stores it in fp16,
so keeping it in fp16 loses nothing, and on these CPUs the kernels differ a lot by dtype and by
the number of rows M (measured by ``bench/decode.py``; torch 2.13, AVX-512 BF16, one thread):
fp16 is the fastest for M = 1 (a GEMV that streams the weights once) and several times slower
than bf16 for M > 1; bf16 is flat in M; fp32 is the slowest at every M.

Where quantpipe's C++ kernels are usable (``runtime.kernels.cpu_ext``: its AVX-512 or AVX2
build and a compiler), the head runs as ``fp16_mm`` (fp16 weights kept blocked as
``[vocab / 16, hidden, 16]``, converted to fp32 once per tile of 8 rows, fp32 activations: exact
products, fp32 sums) or ``quantpipe_cpu::bf16_mm`` (bf16 weights blocked as
``[vocab / 16, hidden / 2, 16, 2]``, activations rounded to bf16, ``vdpbf16ps``: half the
instructions per row on AVX-512; the same FMAs as fp16 on AVX2, where ``auto`` keeps fp16) of
the active build. Measured on SmolLM2's head (49152 x 576), AVX-512 build, one thread:

| rows M | kernel fp16 | kernel bf16 | torch fp16 | torch bf16 |
|--------|-------------|-------------|------------|------------|
| 1      | 1.9 ms      | 2.2 ms      | 4.5 ms     | 7.8 ms     |
| 4      | 3.6 ms      | 2.4 ms      | 11.9 ms    | 9.8 ms     |
| 8      | 7.6 ms      | 4.1 ms      | 24.1 ms    | 10.3 ms    |

Modes of :class:`HalfHead` (``head_dtype`` of the runtime's loaders):

| mode | weights kept            | used for                                  | numerics          |
|------|-------------------------|-------------------------------------------|-------------------|
| fp16 | fp16 (the checkpoint's) | every M                                   | exact weights     |
| bf16 | bf16 copy               | every M                                   | weights, inputs   |
|      |                         |                                           | rounded to bf16   |
| auto | fp16 and a bf16 copy    | fp16 for M <= ``fp16_rows`` (2 with the   | depends on M      |
|      |                         | kernels, else 1), bf16 above              |                   |

Mode ``int8`` (:class:`Int8Head`) quantizes the head at load time to int8 per row and 32
columns with fp16 scales (llama.cpp's Q8_0 precision) and runs it with ``int8_mm`` (exact int8
weights, fp32 activations): half the bytes of fp16 per generated token; the embedding table
stays fp16. Without the kernels it falls back to fp16 with a warning.

Without the kernels, torch's matmul runs with the inputs cast to the weight dtype (its fp16
matmul is fast only for M = 1). Logits come back in the model's activation dtype. The
embedding table is kept in fp16 too (exact) and its rows are cast to the activation dtype, so
the residual stream keeps its precision; a tied fp16 head shares that tensor (blocked or not:
:class:`CastEmbedding` reads either).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from quantpipe.runtime.kernels import cpu_ext
from quantpipe.runtime.kernels.cpu import block_rows

log = logging.getLogger(__name__)

HEAD_DTYPES = ("fp32", "fp16", "bf16", "auto", "int8")
INT8_HEAD_GROUP = 32  # int8 head: one fp16 scale per row and block of 32 columns
BLOCK = 16  # vocabulary rows per block of the kernels' layouts (cpu.block_rows)
# auto: rows up to which the fp16 head beats the bf16 one (measured in docs/runtime.md, "The
# output head on CPU": the fp16 kernel reads exact weights but bf16's dot product wins once a
# few rows share each weight load)
AUTO_FP16_ROWS_KERNEL, AUTO_FP16_ROWS_TORCH = 2, 1


def block_row_pairs(w: torch.Tensor) -> torch.Tensor:
    """[N, K] (K even) -> [ceil(N / 16), K / 2, 16, 2]: bf16_mm's (w[k], w[k + 1]) pairs."""
    b = block_rows(w)  # [N / 16, K, 16]
    return b.view(b.shape[0], -1, 2, BLOCK).transpose(2, 3).contiguous()  # [N/16, K/2, 16, 2]


class CastEmbedding(nn.Module):
    """``nn.Embedding`` lookups from a stored table, returned in ``out_dtype``.

    ``weight`` is [vocab, hidden], or the fp16 head kernel's blocked [vocab / 16, hidden, 16]
    (a tied head's tensor, shared): row n is then ``weight[n // 16, :, n % 16]``.
    ``embed_scale``: the scale of the embedding it replaces (Gemma's sqrt(hidden), a buffer of
    transformers' scaled embeddings), applied to the rows in ``out_dtype``.
    """

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype,
                 num_embeddings: int | None = None,
                 embed_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.out_dtype = out_dtype
        self.embedding_dim = weight.shape[1]
        self.num_embeddings = num_embeddings or weight.shape[0]
        if embed_scale is not None:  # only then: code tells a scaled embedding by this buffer
            self.register_buffer("embed_scale", embed_scale.detach().clone(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() == 3:  # blocked: gather [..., hidden] rows across the 16 lanes
            rows = self.weight[ids // BLOCK, :, ids % BLOCK]
        else:
            rows = nn.functional.embedding(ids, self.weight)
        rows = rows.to(self.out_dtype)  # [..., hidden]
        scale = getattr(self, "embed_scale", None)
        return rows if scale is None else rows * scale.to(self.out_dtype)


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
        # our kernels take fp32 activations (bf16_mm: an even K)
        self.kernel = (weight_fp16.device.type == "cpu" and out_dtype == torch.float32
                       and self.in_features % 2 == 0 and cpu_ext.kernel_status()[0])
        if not self.kernel:
            limit = AUTO_FP16_ROWS_TORCH
        elif cpu_ext.active_isa() == "avx2":
            # no bf16 dot product on AVX2: both heads cost one FMA per weight, fp16 is exact
            limit = float("inf")
        else:
            limit = AUTO_FP16_ROWS_KERNEL
        # the active ISA build's ops, looked up once (the head runs once per step)
        ops = cpu_ext.ops() if self.kernel else None
        self._fp16_mm = ops.fp16_mm.default if ops is not None else None
        self._bf16_mm = ops.bf16_mm.default if ops is not None else None
        # fp16 for rows <= this, bf16 above
        self.fp16_rows = {"fp16": float("inf"), "bf16": 0, "auto": limit}[mode]
        w16 = w_bf16 = None
        if mode != "bf16":  # fp16 [out, in], or blocked [out / 16, in, 16] for fp16_mm
            w16 = block_rows(weight_fp16) if self.kernel else weight_fp16
        if mode != "fp16":  # bf16 [out, in], or blocked [out / 16, in / 2, 16, 2] for bf16_mm
            w_bf16 = weight_fp16.to(torch.bfloat16)
            w_bf16 = block_row_pairs(w_bf16) if self.kernel else w_bf16
        # Non-persistent buffers: they follow .to(device) and count in memory accounting, but
        # are not state_dict keys.
        self.register_buffer("w16", w16, persistent=False)
        self.register_buffer("w_bf16", w_bf16, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(),
                             persistent=False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"mode={self.mode}, kernel={self.kernel}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        use16 = rows <= self.fp16_rows
        if self.kernel:
            x2d = x.reshape(rows, self.in_features).float().contiguous()  # [M, in] fp32
            if use16:
                y = self._fp16_mm(x2d, self.w16)  # [M, padded out]
            else:
                y = self._bf16_mm(x2d, self.w_bf16)
            if y.shape[1] != self.out_features:
                y = y[:, :self.out_features].contiguous()
            y = y.view(*x.shape[:-1], self.out_features)
        else:
            w = self.w16 if use16 else self.w_bf16
            y = nn.functional.linear(x.to(w.dtype), w)  # [..., out]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(self.out_dtype)


def quantize_head_int8(weight_fp16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 [N, K] -> (q int8 [N, K], scales fp16 [N, K / 32]): symmetric, per row and block.

    The scale is rounded to fp16 *before* rounding q, so ``q * scale`` (fp16 scale exact in
    fp32) is the weight the kernel multiplies: |w - q * s| <= s / 2 + the fp16 rounding of s
    times 127 / 2**11 (q is clamped to [-127, 127]).
    """
    n, k = weight_fp16.shape
    wb = weight_fp16.float().view(n, k // INT8_HEAD_GROUP, INT8_HEAD_GROUP)  # [N, K/32, 32]
    scales = (wb.abs().amax(-1) / 127).half()  # [N, K/32] fp16
    s = scales.float().clamp_min(torch.finfo(torch.float16).tiny)[..., None]  # no 0 division
    q = torch.round(wb / s).clamp(-127, 127).to(torch.int8).view(n, k)  # [N, K]
    return q, scales


class Int8Head(nn.Module):
    """y = x @ (q * scale)^T (+ b): the head quantized to int8 at load time (``head_dtype
    int8``), run by the active ISA build's ``int8_mm`` (exact int8 weights, fp32 activations
    and sums): half the bytes of the fp16 head per generated token. Needs the kernels."""

    def __init__(self, weight_fp16: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_fp16.shape
        if self.in_features % INT8_HEAD_GROUP:
            raise ValueError(f"head dtype int8 needs hidden size % {INT8_HEAD_GROUP} == 0, "
                             f"not {self.in_features}; use fp16")
        self.out_dtype = out_dtype
        q, scales = quantize_head_int8(weight_fp16)
        # [N, K] -> [N / 16, K, 16] and [N, K / 32] -> [N / 16, K / 32, 16] (int8_mm's layout)
        self.register_buffer("q8", block_rows(q), persistent=False)
        self.register_buffer("scales", block_rows(scales), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(),
                             persistent=False)
        self._int8_mm = cpu_ext.ops().int8_mm.default

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode=int8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        x2d = x.reshape(rows, self.in_features).float().contiguous()  # [M, in] fp32
        y = self._int8_mm(x2d, self.q8, self.scales, None, INT8_HEAD_GROUP)  # [M, padded out]
        if y.shape[1] != self.out_features:
            y = y[:, :self.out_features].contiguous()
        y = y.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.to(self.out_dtype)


def _new_head(head_w: torch.Tensor, bias: torch.Tensor | None, mode: str,
              act_dtype: torch.dtype) -> nn.Module:
    """The head module for ``mode``; int8 without usable kernels falls back to fp16 (logged)."""
    if mode == "int8":
        usable, why = cpu_ext.kernel_status()
        if usable and head_w.device.type == "cpu" and act_dtype == torch.float32:
            return Int8Head(head_w, bias, act_dtype)
        log.warning("head dtype int8 needs quantpipe's CPU kernels and fp32 activations on CPU "
                    "(%s); using the fp16 head instead", why if not usable else act_dtype)
        mode = "fp16"
    return HalfHead(head_w, bias, mode, act_dtype)


def set_half_head(model: nn.Module, mode: str, act_dtype: torch.dtype | None = None) -> None:
    """Replace the FP embedding table and lm_head of an HF causal LM (see the module doc).

    ``act_dtype``: the model's activation dtype (default: the embedding table's). A table or
    head already in fp16 (``build_causal_lm(keep_fp16_embeddings=True)``) is used as it is.
    ``mode="fp32"`` leaves the model as it is, and so does a model whose table or head is not
    fp16-representable (a bf16 or fp32 checkpoint: rounding would change it; logged).
    """
    if mode not in HEAD_DTYPES:
        raise ValueError(f"head dtype {mode!r}: use one of {HEAD_DTYPES}")
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    act_dtype = act_dtype or emb.weight.dtype
    if mode == "fp32":
        _cast_tables(model, act_dtype)
        return
    if not isinstance(head, nn.Linear) or not isinstance(emb, nn.Embedding):
        raise ValueError(f"{type(model).__name__}: head dtype {mode} needs an nn.Embedding input "
                         f"and an nn.Linear output head, found {type(emb).__name__} and "
                         f"{type(head).__name__}")
    tied = head.weight is emb.weight

    def to_fp16(w: torch.Tensor) -> torch.Tensor | None:
        w = w.detach()
        if w.dtype == torch.float16:
            return w
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
        _cast_tables(model, act_dtype)
        return
    new_head = _new_head(head_w, head.bias, mode, act_dtype)
    if tied and getattr(new_head, "w16", None) is not None:
        table = new_head.w16  # one fp16 tensor, as [vocab, hidden] or blocked
    model.set_input_embeddings(CastEmbedding(table, act_dtype, emb.num_embeddings,
                                             getattr(emb, "embed_scale", None)))
    model.set_output_embeddings(new_head)


def _cast_tables(model: nn.Module, act_dtype: torch.dtype) -> None:
    """The embedding table and head in ``act_dtype``, where a loader kept them in fp16."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    if emb.weight.dtype != act_dtype:
        emb.weight = nn.Parameter(emb.weight.detach().to(act_dtype), requires_grad=False)
    if tied:
        head.weight = emb.weight
    elif head is not None and head.weight.dtype != act_dtype:
        head.weight = nn.Parameter(head.weight.detach().to(act_dtype), requires_grad=False)
