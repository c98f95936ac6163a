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

Modes of :class:`HalfLinear` (``head_dtype`` of the runtime's loaders):

| mode | weights kept            | used for                                  | numerics          |
|------|-------------------------|-------------------------------------------|-------------------|
| fp16 | fp16 (the checkpoint's) | every M                                   | exact weights     |
| bf16 | bf16 copy               | every M                                   | weights, inputs   |
|      |                         |                                           | rounded to bf16   |
| auto | fp16 and a bf16 copy    | fp16 for M <= ``fp16_rows`` (2 with the   | depends on M      |
|      |                         | kernels, else 1), bf16 above              |                   |

Mode ``int8`` (:class:`Int8Head`) quantizes the head at load time to int8 per row and 32
columns with fp16 scales (llama.cpp's Q8_0 precision) and runs it with ``w8a8_mm`` (the
activations quantized to int8 per 32 columns as for the W4A8 linears, exact integer dot
products, fp32 scaling: llama.cpp's Q8_0 x Q8_0 dot): half the bytes of fp16 per generated
token, and one int8 dot-product instruction per 64 weights instead of an FMA per 16, so the
head of a large vocabulary (Gemma 3's 262,144 x 640) runs at the speed its weights stream from
memory, and a few rows cost little more than one. The embedding table stays fp16. Without the
kernels it falls back to fp16 with a warning.

Without the kernels, torch's matmul runs with the inputs cast to the weight dtype (its fp16
matmul is fast only for M = 1). Logits come back in the model's activation dtype. The
embedding table is kept in fp16 too (exact) and its rows are cast to the activation dtype, so
the residual stream keeps its precision; a tied fp16 head shares that tensor (blocked or not:
:class:`CastEmbedding` reads either). An untied table loaded by ``runtime.loader`` may be a
read-only memory map of the checkpoint file (``map_embeddings``): it is used as it is (no
copy), so only the rows looked up are read, and nothing here writes into it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys

import torch
from torch import nn

from quantpipe.core.heap import release_freed_memory
from quantpipe.runtime.kernels import cpu_ext
from quantpipe.runtime.kernels.cpu import block_rows
from quantpipe.runtime.quant_embedding import QuantEmbedding
from quantpipe.runtime.quant_linear import QuantLinear

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


# rows of the head re-laid out at a time (a multiple of BLOCK): the copy is made one chunk at
# a time, and a source read from a file mapping is handed back after each chunk
HEAD_CHUNK_ROWS = 4096
# the int8 head's chunk: quantizing makes several fp32 temporaries of a chunk (a multiple of 16)
INT8_HEAD_CHUNK_ROWS = 512
_MADV_PAGEOUT = 21  # linux/mman.h (Linux 5.4+)


@functools.cache
def _madvise():
    """libc's madvise (Linux), looked up once; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def _file_backed(t: torch.Tensor) -> bool:
    """Whether t's bytes lie in a mapping of a file (/proc/self/maps), e.g. a tensor that
    safetensors returns: a view of the shard mapped copy-on-write."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    addr = t.data_ptr()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= addr < hi:
                    return len(fields) > 5 and fields[5].startswith("/")
    except OSError:
        pass
    return False


def page_out(t: torch.Tensor) -> None:
    """Ask the kernel to reclaim the whole pages of t's bytes now (MADV_PAGEOUT). Only for a
    file-backed source that is about to be dropped: its clean pages are released (read again
    from the file if touched), so they are not resident beside the copy made from them. A
    hint that changes no value; ignored where it is not supported."""
    madvise = _madvise()
    if madvise is None or not t.is_contiguous():
        return
    page = mmap.PAGESIZE
    lo = -(-t.data_ptr() // page) * page  # inward: never a page of another tensor
    hi = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if hi > lo:
        madvise(lo, hi - lo, _MADV_PAGEOUT)


def _blocked(src: torch.Tensor) -> torch.Tensor:
    """[16 n, K] -> a [n, K, 16] view: block_rows' layout, without its copy."""
    return src.view(-1, BLOCK, src.shape[1]).transpose(1, 2)


def _blocked_pairs(src: torch.Tensor) -> torch.Tensor:
    """[16 n, K] -> a [n, K / 2, 16, 2] view: block_row_pairs' layout, without its copy."""
    return src.view(-1, BLOCK, src.shape[1] // 2, 2).permute(0, 2, 1, 3)


def _rows(src: torch.Tensor) -> torch.Tensor:
    return src


def relayout_rows(w: torch.Tensor, layouts: list, release: bool = True) -> list[torch.Tensor]:
    """A copy of the [N, K] weight ``w`` per ``(arrange, rows, dtype)`` of ``layouts``: rows of
    ``w`` per output row (16 for the blocked layouts, zero-padded, 1 for a plain cast) and
    ``arrange(w[16 i: 16 j])`` the view of those rows in the output's layout (``_blocked``,
    ``_blocked_pairs``, ``_rows``), copied in (and cast to ``dtype``) HEAD_CHUNK_ROWS rows at a
    time: no temporary of the whole weight. With ``release`` (the caller drops ``w`` once it
    has its copies), where ``w`` is a view of a file mapping (the checkpoint's head) each
    chunk's pages are released once read: the peak is the copies plus one chunk, not the
    copies plus ``w``.
    """
    n, k = w.shape
    release = release and w.is_contiguous() and _file_backed(w)
    pad = torch.zeros(BLOCK, k, dtype=w.dtype, device=w.device)
    outs = [torch.empty((-(-n // rows), *arrange(pad[:rows]).shape[1:]), dtype=dtype,
                        device=w.device) for arrange, rows, dtype in layouts]
    for r0 in range(0, n, HEAD_CHUNK_ROWS):
        src = w[r0:r0 + HEAD_CHUNK_ROWS]
        for out, (arrange, rows, _) in zip(outs, layouts):
            full = src.shape[0] // rows * rows
            out[r0 // rows:(r0 + full) // rows].copy_(arrange(src[:full]))
            if full < src.shape[0]:  # the last block's rows, zero-padded to 16
                pad[:src.shape[0] - full] = src[full:]
                out[-1:].copy_(arrange(pad))
        if release:
            page_out(src)
    return outs


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


class HalfLinear(nn.Module):
    """y = x @ W^T (+ b) with W in fp16 and/or bf16, chosen by mode and rows (module doc)."""

    def __init__(self, weight_fp16: torch.Tensor, bias: torch.Tensor | None, mode: str,
                 out_dtype: torch.dtype) -> None:
        super().__init__()
        if mode not in ("fp16", "bf16", "auto"):
            raise ValueError(f"head dtype {mode!r}: HalfLinear takes fp16, bf16 or auto")
        if weight_fp16.dtype != torch.float16:
            raise ValueError(f"HalfLinear needs the fp16 weight, got {weight_fp16.dtype}")
        self.mode = mode
        self.out_dtype = out_dtype
        self.out_features, self.in_features = weight_fp16.shape
        # our kernels take fp32 activations (bf16_mm: an even K)
        self.kernel = (weight_fp16.device.type == "cpu" and out_dtype == torch.float32
                       and (self.in_features % 2 == 0 or mode == "fp16")
                       and cpu_ext.kernel_status()[0])
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
        layouts = []  # (arrange, rows of the weight per output row, dtype) of each copy
        if mode != "bf16" and self.kernel:  # fp16 blocked [out / 16, in, 16] for fp16_mm
            layouts.append((_blocked, BLOCK, torch.float16))
        if mode != "fp16":  # bf16 [out, in], or blocked [out / 16, in / 2, 16, 2] for bf16_mm
            layouts.append((_blocked_pairs, BLOCK, torch.bfloat16) if self.kernel
                           else (_rows, 1, torch.bfloat16))
        # one pass over the fp16 weight for every copy (the source released as it goes)
        keeps_source = mode != "bf16" and not self.kernel  # w16 is weight_fp16 itself
        copies = relayout_rows(weight_fp16, layouts, release=not keeps_source) if layouts else []
        w16 = None if mode == "bf16" else (copies.pop(0) if self.kernel else weight_fp16)
        w_bf16 = copies.pop(0) if mode != "fp16" else None
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
    times 127 / 2**11 (q is clamped to [-127, 127]). It makes one fp32 temporary of the whole
    input: :func:`int8_head_blocked` calls it on ``INT8_HEAD_CHUNK_ROWS`` rows at a time.
    """
    n, k = weight_fp16.shape
    # one fp32 temporary of the input (widening is exact); |w| and its max are taken on it,
    # the same values as in fp16, where torch's CPU reductions are several times slower
    wb = weight_fp16.view(n, k // INT8_HEAD_GROUP, INT8_HEAD_GROUP).float()  # [N, K/32, 32]
    scales = (wb.abs().amax(-1) / 127).half()  # [N, K/32] fp16
    s = scales.float().clamp_min(torch.finfo(torch.float16).tiny)[..., None]  # no 0 division
    # divided, rounded and clamped in place (the same operations as
    # round(w / s).clamp(-127, 127), so the same values)
    wb = wb.div_(s).round_().clamp_(-127, 127)  # [N, K/32, 32] fp32
    return wb.to(torch.int8).view(n, k), scales  # [N, K] int8


def block_row_quads(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] (K % 4 == 0) -> [ceil(N / 16), K / 4, 64]: w8a8_mm's layout, byte
    4r + e of chunk (b, c) = q[16b + r, 4c + e] (16 rows x 4 columns, rows zero-padded)."""
    b = block_rows(q)  # [N / 16, K, 16]
    nb, k, _ = b.shape
    # [N/16, K, 16] -> [N/16, K/4, 4, 16] -> [N/16, K/4, 16, 4] -> [N/16, K/4, 64]
    return b.view(nb, k // 4, 4, BLOCK).transpose(2, 3).reshape(nb, k // 4, 4 * BLOCK)


def int8_head_blocked(weight_fp16: torch.Tensor, release: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 [N, K] -> w8a8_mm's operands: q8 int8 [N / 16, K / 4, 64] (:func:`block_row_quads`)
    and scales fp16 [N / 16, K / 32, 16] (:func:`quantize_head_int8`'s values, rows zero-padded
    to 16), made
    ``INT8_HEAD_CHUNK_ROWS`` rows at a time. With ``release``, where the weight is a view of a file
    mapping (the checkpoint's head), each chunk's pages are handed back once read (as
    :func:`relayout_rows` does): the peak is the int8 copy plus one chunk, not the copy plus
    the fp16 head and a second, unblocked int8 copy."""
    n, k = weight_fp16.shape
    release = release and weight_fp16.is_contiguous() and _file_backed(weight_fp16)
    nb = -(-n // BLOCK)
    q8 = torch.empty(nb, k // 4, 4 * BLOCK, dtype=torch.int8)
    scales = torch.empty(nb, k // INT8_HEAD_GROUP, BLOCK, dtype=torch.float16)
    for r0 in range(0, n, INT8_HEAD_CHUNK_ROWS):
        src = weight_fp16[r0:r0 + INT8_HEAD_CHUNK_ROWS]
        q, s = quantize_head_int8(src)  # [rows, K], [rows, K / 32]
        b0, b1 = r0 // BLOCK, -(-(r0 + src.shape[0]) // BLOCK)
        q8[b0:b1] = block_row_quads(q)
        scales[b0:b1] = block_rows(s)
        del q, s
        if release:
            page_out(src)
        # the chunk's temporaries: handed back before the next chunk, so that the heap does
        # not keep a chunk's worth of them per chunk beside the growing copy
        release_freed_memory()
    return q8, scales


class Int8Head(nn.Module):
    """y = x_q @ (q * scale)^T (+ b): the head quantized to int8 at load time (``head_dtype
    int8``), run by the active ISA build's ``w8a8_mm`` (x_q: x quantized to int8 per row and
    32 columns; exact integer dots, fp32 scaling and sums): half the bytes of the fp16 head per
    generated token. Needs the kernels."""

    def __init__(self, weight_fp16: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_fp16.shape
        if self.in_features % INT8_HEAD_GROUP:
            raise ValueError(f"head dtype int8 needs hidden size % {INT8_HEAD_GROUP} == 0, "
                             f"not {self.in_features}; use fp16")
        self.out_dtype = out_dtype
        # [N / 16, K / 4, 64] and [N / 16, K / 32, 16] (w8a8_mm's layout)
        q8, scales = int8_head_blocked(weight_fp16)
        self.register_buffer("q8", q8, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(),
                             persistent=False)
        self._w8a8_mm = cpu_ext.ops().w8a8_mm.default

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode=int8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        x2d = x.reshape(rows, self.in_features).float().contiguous()  # [M, in] fp32
        y = self._w8a8_mm(x2d, self.q8, self.scales)  # [M, padded out]
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
    return HalfLinear(head_w, bias, mode, act_dtype)


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
    if isinstance(emb, QuantEmbedding) or isinstance(head, QuantLinear):
        _keep_quantized_tables(model, mode, act_dtype)
        return
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


def set_half_linears(model: nn.Module) -> int:
    """Run every ``nn.Linear`` holding an fp16 weight (but the output head: ``set_half_head``
    makes it) as a :class:`HalfLinear` in mode fp16: the checkpoint's fp16 weights kept, blocked
    for ``fp16_mm``, fp32 activations, exact products and fp32 sums. For an FP16 export built
    with ``build_causal_lm(keep_fp16_linears=True)`` on CPU with fp32 activations: the same
    model as its fp32 copy (only the order of the sums differs) in half the memory, and faster
    at every number of rows M measured (bench/fp16_linears.py). Each layer is re-laid out and
    its fp16 source released before the next; returns how many layers were replaced.
    Needs the kernels (``cpu_ext.kernel_status()``); a caller without them keeps fp32 layers."""
    if not cpu_ext.kernel_status()[0]:
        raise RuntimeError(f"set_half_linears needs quantpipe's CPU kernels: "
                           f"{cpu_ext.kernel_status()[1]}")
    head = model.get_output_embeddings()
    names = [name for name, m in model.named_modules()  # names only: no module kept alive
             if isinstance(m, nn.Linear) and m is not head
             and m.weight.dtype == torch.float16 and m.weight.device.type == "cpu"]
    for name in names:
        parent, _, child = name.rpartition(".")
        old = model.get_submodule(name)
        setattr(model.get_submodule(parent), child,
                HalfLinear(old.weight.detach(), old.bias, "fp16", torch.float32))
        del old
        release_freed_memory()  # the fp16 source, dropped with the module
    return len(names)


def _keep_quantized_tables(model: nn.Module, mode: str, act_dtype: torch.dtype | None) -> None:
    """A checkpoint that stores its vocabulary tables quantized (``export --vocab-weights``)
    runs them as stored; an FP input table beside a quantized head is cast as fp32 mode
    does."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    log.info("the embedding table / head are stored quantized (%s, %s): head dtype %s does "
             "not apply", type(emb).__name__, type(head).__name__, mode)
    if isinstance(emb, nn.Embedding) and act_dtype is not None and emb.weight.dtype != act_dtype:
        model.set_input_embeddings(CastEmbedding(emb.weight.detach(), act_dtype,
                                                 emb.num_embeddings,
                                                 getattr(emb, "embed_scale", None)))


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
