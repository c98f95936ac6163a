"""Run a decoder of any family in :mod:`quantpipe.core.families` over the paged KV cache.

We call the Hugging Face module's own submodules (embeddings, norms, q/k/v/o projections, rotary
embedding, MLP, lm_head), so any ``nn.Linear`` replaced by a QuantLinear runs unchanged. Only
attention is ours: new K/V are written into their paged slots, then each sequence's blocks are
gathered (whole blocks, one copy per block) into a dense, padded ``[B, blocks_max * block_size,
kv_heads, head_dim]`` tensor and fed to
``torch.nn.functional.scaled_dot_product_attention`` with a boolean mask that is causal *and*
hides padding. Prefill chunks and decode tokens share one step; a chunk longer than
``KERNEL_ATTENTION_MAX_Q`` attends alone, so no sequence's queries are padded to its length.
Family differences come from the registry as data: (1 + w) norms, norms around the attention
and MLP outputs, per-head q/k norms, fused qkv / gate_up projections, the query scale, logit
soft-capping (attention scores: an explicit softmax instead of SDPA) and sliding-window layers
(the mask also hides keys at or beyond ``window`` positions back).
The same gather + SDPA path runs on CPU and on CUDA (there SDPA picks its fused kernel); on
CUDA there is no paged-attention kernel of quantpipe's, on CPU there is one (below).

On CPU with fp32 activations, when quantpipe's C++ kernels are usable
(``runtime.kernels.cpu_ext``), the norms (with the residual add folded in; the per-head q/k
norms and the norms around the sublayer outputs too) and RoPE run as one C++ call each instead
of ~8 small torch ops, and attention runs in ``quantpipe_cpu::paged_attention``, which reads
each sequence's K/V from its paged blocks (no gather, no padding, no mask; a sliding-window
layer's keys at or beyond ``window`` positions back are skipped, the rule of
:func:`window_mask`): the same formulas in fp32 (:func:`fused_ops_status` says whether and why
not). The kernel takes decode tokens and short chunks query by query, and chunks of 16+
queries (prompts) in flash-style tiles (over a bf16 cache on AVX-512, with bf16 dot products:
queries and softmax weights rounded to bf16, as SDPA computes on a bf16 cache);
``QUANTPIPE_CPU_PREFILL_ATTENTION`` (:data:`PREFILL_ATTENTION_ENV`) can send long chunks to
SDPA instead, which "auto" does for a whole prompt on an AMX CPU with a bf16 cache. Layers
with score soft-capping (the kernel has none) keep the gather + SDPA path. The C++ norm takes
the gain as a weight, so a (1 + w) norm passes (1 + w), computed once.

Where a layer's parts are all W4A8 (q/k/v and gate/up stacked, o and down) with a gated MLP of
:data:`GATED_ACTS` (silu, Gemma's gelu_pytorch_tanh) and no score soft-capping, a step the
paged kernel takes runs that whole layer as one C++ call (``decoder_layer``: q/k norms, sandwich
norms and sliding windows included; the same kernels in the same order, bit-identical results),
so no Python runs between its ops (``ModelRunner.layer_ops``; ``QUANTPIPE_CPU_LAYER_OP=0``
turns it off).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quantpipe.core.families import (  # runtime.generate reads FAMILIES from here
    FAMILIES,
    Family,
    config_value,
    family_for,
    get_path,
    layer_windows,
)
from quantpipe.core.heap import mapped_zeros, release_freed_memory
from quantpipe.runtime.engine.kv_cache import KVCacheSpec, slot_mapping
from quantpipe.runtime.fp_head import BLOCK, HalfLinear
from quantpipe.runtime.kernels import cpu_ext
from quantpipe.runtime.kernels.cpu import (
    CpuW4A8,
    copy_w4a8_,
    empty_w4a8_stack,
    joined_rows,
    w4a8_joined,
    w4a8_matmul,
    w4a8_rows,
    w4a8_stackable,
)

# "0" runs a step layer by layer in Python (each op its own call) even where the whole-layer
# C++ op (quantpipe_cpu::decoder_layer) could run it: side-by-side comparisons and tests
LAYER_OP_ENV = "QUANTPIPE_CPU_LAYER_OP"

# the gated MLPs whose act(gate) * up is one C++ op (transformers' activation name -> op name):
# their gate/up projections are stacked, and decoder_layer runs their layers
GATED_ACTS = {"silu": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}

# longest query chunk of a step that the whole-layer C++ op runs (decode steps, short prefill
# chunks; a mixed step of 7 decodes and one 16-token prefill: 14 ms of SDPA + gathers -> ~1 ms)
KERNEL_ATTENTION_MAX_Q = 32

# where long prefill chunks attend on CPU: "kernel" (quantpipe_cpu::paged_attention, which runs
# chunks of 16+ queries in flash-style tiles), "sdpa" (torch's SDPA: causal on a chunk's own
# keys, else the gather + mask path), or "auto" (the default: the kernel, except that a chunk
# starting its sequence goes to SDPA in bf16 where the KV cache is bf16 and the CPU has AMX,
# whose bf16 GEMMs oneDNN uses there)
PREFILL_ATTENTION_ENV = "QUANTPIPE_CPU_PREFILL_ATTENTION"


@dataclass(frozen=True)
class SeqChunk:
    """The tokens of one sequence computed in this step."""

    token_ids: list[int]  # new tokens (a prefill chunk, or the one decode token)
    start: int  # position of token_ids[0] == tokens already in the KV cache
    block_table: list[int]  # blocks covering positions 0 .. start + len(token_ids) - 1


@dataclass(frozen=True)
class BatchMeta:
    """Index tensors shared by every layer of one step (built once by :func:`prepare_batch`)."""

    input_ids: torch.Tensor  # [T] int64, all chunks concatenated
    positions: torch.Tensor  # [T] int64
    write_slots: torch.Tensor  # [T] int64 flat slot (block * block_size + offset) per new token
    q_index: torch.Tensor  # [T] int64 row in the padded [B * q_max] query layout
    gather_blocks: torch.Tensor  # [B, blocks_max] int64 block table of each context (0 = pad)
    last_index: torch.Tensor  # [B] int64 index into T of each chunk's last token
    ctx_lens: torch.Tensor  # [B] int64 tokens in each context after this step
    q_lens: torch.Tensor  # [B] int64 new tokens of each sequence in this step
    q_max: int
    ctx_max: int  # blocks_max * block_size

    @functools.cached_property
    def attn_mask(self) -> torch.Tensor:
        """[B, 1, q_max, ctx_max] bool: the padded (SDPA) path's mask, made on first use (a
        step the C++ paged kernel runs whole never needs it).

        Query row i of sequence b sits at position start_b + i and may see keys j <= that
        position (causal); that also hides the unused tail of its last block and the padding
        blocks, all at j >= ctx_len_b. Padded query rows (i >= n_b) would see nothing and give
        NaN from softmax over all -inf, so they see key 0; they are dropped later."""
        device = self.ctx_lens.device
        starts = (self.ctx_lens - self.q_lens).view(-1, 1, 1)  # [B, 1, 1]
        rows = torch.arange(self.q_max, device=device).view(1, -1, 1)  # [1, q_max, 1]
        kpos = torch.arange(self.ctx_max, device=device).view(1, 1, -1)  # [1, 1, ctx_max]
        mask = kpos <= starts + rows  # [B, q_max, ctx_max]
        mask |= (rows >= self.q_lens.view(-1, 1, 1)) & (kpos == 0)
        return mask.unsqueeze(1)


def prepare_batch(chunks: list[SeqChunk], block_size: int, device: torch.device) -> BatchMeta:
    if not chunks:
        raise ValueError("prepare_batch needs at least one sequence chunk")
    q_max = max(len(c.token_ids) for c in chunks)
    ctx_lens = [c.start + len(c.token_ids) for c in chunks]
    blocks_max = max(-(-n // block_size) for n in ctx_lens)
    ids, pos, slots, q_index, last, gather = [], [], [], [], [], []
    for b, c in enumerate(chunks):
        n = len(c.token_ids)
        ids += c.token_ids
        pos += range(c.start, c.start + n)
        slots += slot_mapping(c.block_table, c.start, c.start + n, block_size)
        q_index += range(b * q_max, b * q_max + n)
        last.append(len(ids) - 1)
        used = -(-ctx_lens[b] // block_size)
        gather.append(list(c.block_table[:used]) + [0] * (blocks_max - used))

    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return BatchMeta(
        input_ids=tensor(ids), positions=tensor(pos), write_slots=tensor(slots),
        q_index=tensor(q_index), gather_blocks=tensor(gather), last_index=tensor(last),
        ctx_lens=tensor(ctx_lens), q_lens=tensor([len(c.token_ids) for c in chunks]),
        q_max=q_max, ctx_max=blocks_max * block_size,
    )


@dataclass
class AttentionGroup:
    """Sequences of one step that attend together (:meth:`ModelRunner._attention_groups`)."""

    rows: torch.Tensor | slice | None  # their rows of the step's [T, ...] tensors; None: all
    meta: BatchMeta  # prepare_batch of their chunks alone
    kernel: bool  # the C++ paged kernel (no soft-capping) or padded SDPA
    masks: dict = field(default_factory=dict)  # the padded path's, one per window size
    # one chunk that starts its sequence (a whole prompt, or its first prefill chunk): its
    # keys are exactly this step's, so it attends causally to them with no gather or mask
    fresh: bool = False


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1), the HF/Llama RoPE convention."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D], cos/sin: [T, R] -> [T, heads, D]; R < D (partial rotary, Phi-3 style):
    the first R dims rotate, the rest pass through."""
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :R], cos, sin), x[..., R:]), dim=-1)
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)




def window_mask(meta: BatchMeta, window: int) -> torch.Tensor:
    """The step's causal mask, also hiding keys ``window`` or more positions back:
    [B, 1, q_max, ctx_max] bool (a query at position p sees keys at positions > p - window)."""
    B, _, q_max, ctx_max = meta.attn_mask.shape
    device = meta.attn_mask.device
    starts = (meta.ctx_lens - meta.q_lens).view(-1, 1, 1)  # [B, 1, 1]
    rows = torch.arange(q_max, device=device).view(1, -1, 1)  # [1, q_max, 1]
    kpos = torch.arange(ctx_max, device=device).view(1, 1, -1)  # [1, 1, ctx_max]
    mask = meta.attn_mask[:, 0] & (kpos > starts + rows - window)  # [B, q_max, ctx_max]
    # padded query rows keep seeing key 0 (no all -inf softmax row); they are dropped later
    mask |= (rows >= meta.q_lens.view(-1, 1, 1)) & (kpos == 0)
    return mask.unsqueeze(1)


def _attend(q_g: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float, softcap: float | None) -> torch.Tensor:
    """q_g: [B, KV, Q, D], k/v: [B, KV, C, D], mask: [B, 1, Q, C] bool -> [B, KV, Q, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q_g, k, v, attn_mask=mask, scale=scale)
    # soft-capping acts between the scaled scores and the softmax, where SDPA has no hook
    scores = (q_g @ k.transpose(-1, -2)).float() * scale  # [B, KV, Q, C] fp32
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q_g.dtype)  # [B, KV, Q, D]


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: BatchMeta,
    grouped_mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the step's queries over each sequence's paged context.

    q: [T, H, D]; k_pool/v_pool: [num_blocks, block_size, KV, D];
    grouped_mask: [B, 1, G * q_max, ctx_max] bool (see :func:`group_mask`) -> out [T, H, D].
    ``softcap`` c: scores -> c * tanh(scores / c) before the softmax (Gemma 2).

    GQA without copying K/V per query head: query head h uses KV head h // G (HF repeat_kv
    order), so the G query heads of one KV head are folded into the query length and attend to
    that KV head once; mathematically identical to repeating K/V G times.
    """
    T, H, D = q.shape
    KV = k_pool.shape[2]
    G = H // KV
    B, blocks_max = meta.gather_blocks.shape
    ctx_max = blocks_max * k_pool.shape[1]
    idx = meta.gather_blocks.view(-1)  # [B * blocks_max]
    # Gather each sequence's blocks (whole blocks: one contiguous copy each) into a dense padded
    # context: [B * blocks_max, bs, KV, D] -> [B, ctx_max, KV, D] -> [B, KV, ctx_max, D]
    # (a bf16 KV cache is read back in q's dtype)
    k = k_pool.index_select(0, idx).to(q.dtype).view(B, ctx_max, KV, D).transpose(1, 2)
    v = v_pool.index_select(0, idx).to(q.dtype).view(B, ctx_max, KV, D).transpose(1, 2)
    q_pad = q.new_zeros(B * meta.q_max, H, D)
    q_pad[meta.q_index] = q
    # [B * q_max, H, D] -> [B, q_max, KV, G, D] -> [B, KV, G, q_max, D] -> [B, KV, G*q_max, D]
    q_g = q_pad.view(B, meta.q_max, KV, G, D).permute(0, 2, 3, 1, 4).reshape(
        B, KV, G * meta.q_max, D)
    out = _attend(q_g, k, v, grouped_mask, scale, softcap)
    # [B, KV, G*q_max, D] -> [B, KV, G, q_max, D] -> [B, q_max, KV, G, D] -> [B * q_max, H, D]
    out = out.view(B, KV, G, meta.q_max, D).permute(0, 3, 1, 2, 4).reshape(B * meta.q_max, H, D)
    return out[meta.q_index]  # [T, H, D]


def group_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, 1, q_max, ctx] -> [B, 1, groups * q_max, ctx]: the same mask for each folded head."""
    B, _, q_max, ctx = mask.shape
    return mask.unsqueeze(2).expand(B, 1, groups, q_max, ctx).reshape(B, 1, groups * q_max, ctx)


def zero_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A KV pool of zeros. On CPU it is an anonymous memory map: the OS hands out zero pages
    and makes a page resident when it is first written, so a pool holds memory for the slots
    written so far, not for its capacity (torch.zeros writes every page: a request's unfilled
    blocks, and the padding block, would be resident for nothing). The values are the same
    zeros either way."""
    if device.type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return mapped_zeros(shape, dtype)[0]


@dataclass(frozen=True)
class FusedProjections:
    """A layer's projections that share an input, as one matmul each (None: not fused).

    The q/k/v projections (and gate/up) read the same normed input, so one kernel call
    quantizes it once and streams the stacked weights once; the MLP's act(gate) * up is then
    one op as well (:data:`GATED_ACTS`). Built only where every part is a bias-free W4A8 layer
    of the same build, or every part an fp16 layer run by ``fp16_mm`` (an FP16 folder's,
    ``runtime.fp_head.set_half_linears``): the stack is then the parts' blocked fp16 weights
    one after another, ``[sum(out) / 16, hidden, 16]`` (q/k/v: or every part has a bias).
    """

    qkv: CpuW4A8 | torch.Tensor | None  # [(H + 2 KV) * D, hidden] (fp16: blocked)
    gate_up: CpuW4A8 | torch.Tensor | None  # [2 * intermediate, hidden] (fp16: blocked)
    qkv_bias: torch.Tensor | None = None  # fp32 [(H + 2 KV) * D]: q/k/v biases (Qwen2)


def _w4a8_parts(mods, with_bias: bool = False) -> list[CpuW4A8] | None:
    """The parts' W4A8 weights; None unless every part is W4A8 and bias-free (``with_bias``:
    or every part has a bias)."""
    ws = [getattr(m, "_w", None) for m in mods]
    biased = [m.bias is not None for m in mods]
    if all(isinstance(w, CpuW4A8) for w in ws) and (
            not any(biased) or (with_bias and all(biased))):
        return ws
    return None


def _fuse(mods, with_bias: bool = False) -> CpuW4A8 | None:
    """The stacked layer, the parts rebound to views into it (the weights held once).

    Each part is copied into its rows of the stack and rebound, and its own tensors are
    handed back to the OS, before the next part is copied: the stack's pages become resident
    as they are written, so the load holds one part twice at most, not the whole group."""
    parts = _w4a8_parts(mods, with_bias)
    if parts is None or not w4a8_stackable(parts):
        return None
    joined = w4a8_joined(parts)  # stacked already (stack_projections, at load)
    if joined is not None:
        return joined
    fused = empty_w4a8_stack(parts)
    del parts  # no reference to a part's own tensors beyond its module's
    start = 0
    for mod in mods:
        n = mod._w.packed.shape[0]  # blocks of 16 output rows
        rows = w4a8_rows(fused, start, n)
        copy_w4a8_(rows, mod._w)
        mod.use_weights(rows)
        release_freed_memory()  # the part's own tensors, freed by the rebinding
        start += n
    return fused


def _half_parts(mods, with_bias: bool = False) -> list[HalfLinear] | None:
    """The parts when each is an fp16 layer that ``fp16_mm`` runs at every row count (mode
    fp16, the kernels) with whole blocks of 16 output rows (no padded outputs; a stack has
    none between parts), bias-free (``with_bias``: or each has a bias); else None."""
    if not all(isinstance(m, HalfLinear) and m.kernel and m.mode == "fp16"
               and m.out_features % BLOCK == 0 for m in mods):
        return None
    biased = [m.bias is not None for m in mods]
    if any(biased) and not (with_bias and all(biased)):
        return None
    return list(mods)


def _fuse_half(mods, with_bias: bool = False) -> torch.Tensor | None:
    """The parts' blocked fp16 weights stacked, [sum(out) / 16, in, 16], each part's ``w16``
    rebound to its rows of the stack (held once; written and released part by part as
    :func:`_fuse` does); None where :func:`_half_parts` says no."""
    parts = _half_parts(mods, with_bias)
    if parts is None or len({m.in_features for m in parts}) != 1:
        return None
    joined = joined_rows([m.w16 for m in parts])  # stacked by an earlier runner
    if joined is not None:
        return joined
    first = parts[0].w16  # [out / 16, in, 16] fp16
    stack = torch.empty(sum(m.w16.shape[0] for m in parts), *first.shape[1:], dtype=first.dtype)
    start = 0
    for m in parts:
        n = m.w16.shape[0]
        stack[start:start + n].copy_(m.w16)
        m.w16 = stack[start:start + n]  # the buffer rebound: the part's own tensor is freed
        release_freed_memory()
        start += n
    return stack


def fuse_projections(layer, hidden_act: str | None,
                     family: Family | None = None) -> FusedProjections:
    """Stack separate q/k/v (and gate/up of a :data:`GATED_ACTS` MLP) W4A8 layers; a family
    whose checkpoint already has one qkv_proj / gate_up_proj linear (Phi-3) runs that linear as
    it is."""
    attn, mlp = layer.self_attn, layer.mlp
    family = family or FAMILIES["llama"]
    qkv = bias = None
    if not family.qkv_proj:
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        qkv = _fuse(parts, with_bias=True)
        if qkv is None:
            qkv = _fuse_half(parts, with_bias=True)
        if qkv is not None and parts[0].bias is not None:
            bias = torch.cat([m.bias.float() for m in parts])
    gate_up = None
    if hidden_act in GATED_ACTS and not family.gate_up_proj and family.moe is None:
        parts = [mlp.gate_proj, mlp.up_proj]
        gate_up = _fuse(parts)
        if gate_up is None:
            gate_up = _fuse_half(parts)
    return FusedProjections(qkv, gate_up, bias)


def stack_projections(model: torch.nn.Module) -> None:
    """Stack each decoder layer's q/k/v and gate/up W4A8 parts as :func:`fuse_projections`
    does, the parts rebound to views of the stacks; a ModelRunner then finds them stacked and
    copies nothing. Loaders call it before the output head is made, so that a part's copy is
    not made on top of everything else (a model of a family the engine does not run, or
    without such parts, is left as it is)."""
    cfg = model.config
    family = FAMILIES.get(cfg.model_type)
    if family is None:
        return
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    for layer in get_path(model, family.blocks):
        fuse_projections(layer, act, family)


def _norm_eps(norm: torch.nn.Module, family: Family) -> float | None:
    eps = getattr(norm, family.norm_eps, None)
    w = getattr(norm, "weight", None)
    if eps is None or w is None or w.dtype != torch.float32 or w.dim() != 1:
        return None
    return float(eps)


def fused_ops_status(layers, final_norm, dtype: torch.dtype, device: torch.device,
                     family: Family | None = None) -> tuple[bool, str]:
    """(use quantpipe's fused CPU norm / RoPE / paged-attention ops, reason)."""
    family = family or FAMILIES["llama"]
    if device.type != "cpu" or dtype != torch.float32:
        return False, "fused ops are for fp32 activations on CPU"
    norms = [final_norm] + [n for layer in layers for n in
                            (layer.input_layernorm, layer.get_submodule(family.mlp_in_norm))]
    for norm in norms:  # an RMSNorm: gain * x / rms(x), gain = weight or (1 + weight)
        if _norm_eps(norm, family) is None:
            return False, (f"{type(norm).__name__} is not an fp32 RMSNorm with "
                           f"{family.norm_eps}")
    usable, why = cpu_ext.kernel_status()
    return usable, why


@dataclass(frozen=True)
class LayerPlan:
    """What one decoder layer needs beyond its modules (from the family and the config)."""

    window: int | None  # sliding window (None: full attention)
    rope_key: str | None  # which RoPE table (Gemma 3: the layer type; None: the only one)
    mlp_in_norm: torch.nn.Module
    attn_out_norm: torch.nn.Module | None
    mlp_out_norm: torch.nn.Module | None
    q_norm: torch.nn.Module | None  # per-head RMSNorms of q and k before RoPE (Gemma 3, Qwen3)
    k_norm: torch.nn.Module | None

    def optional_norms(self) -> tuple[torch.nn.Module | None, ...]:
        """The norms a layer may lack, in decoder_layer's order (q, k, attention out, MLP out)."""
        return (self.q_norm, self.k_norm, self.attn_out_norm, self.mlp_out_norm)


class ModelRunner:
    """Owns the HF module and the KV pools; ``forward(chunks) -> logits [B, vocab]``."""

    def __init__(self, model: torch.nn.Module, block_size: int, num_blocks: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        cfg = model.config
        try:
            self.family = family = family_for(cfg.model_type)
        except ValueError as e:
            raise ValueError(f"the serving engine cannot run this model: {e}") from None
        self.model = model
        self.decoder = get_path(model, family.decoder)
        self.layers = get_path(model, family.blocks)
        self.final_norm = get_path(self.decoder, family.final_norm)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        query_scalar = config_value(cfg, family.query_scale) or self.head_dim
        self.scale = query_scalar**-0.5
        self.attn_softcap = config_value(cfg, family.attn_softcap)
        self.final_softcap = config_value(cfg, family.final_softcap)
        types = getattr(cfg, "layer_types", None) if family.rope_per_layer_type else None
        self.plans = [self._plan(layer, w, types[i] if types else None, family)
                      for i, (layer, w) in enumerate(zip(self.layers, layer_windows(cfg)))]
        self.device = next(model.parameters()).device
        # activation (and KV) dtype; runtime.fp_head's CastEmbedding stores fp16, returns this
        embed = self.decoder.embed_tokens
        # fp_head.CastEmbedding and QuantEmbedding (no .weight) say their output dtype
        self.dtype = embed.out_dtype if hasattr(embed, "out_dtype") else embed.weight.dtype
        # KV cache element type: the activation dtype, or bf16 (half the bytes of fp32; keys and
        # values rounded once when written)
        self.kv_dtype = kv_dtype or self.dtype
        self.kv_spec = KVCacheSpec(len(self.layers), self.num_kv_heads, self.head_dim,
                                   self.kv_dtype, block_size)
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.fused, self.fused_reason = fused_ops_status(self.layers, self.final_norm,
                                                         self.dtype, self.device, family)
        self.ops = cpu_ext.ops() if self.fused else None  # the active ISA build's ops
        self.long_kernel, self.fresh_sdpa = self._prefill_attention()
        # the C++ norm's (gain, eps), one per norm module that is an fp32 RMSNorm (the residual
        # norms all are, fused_ops_status checked): weight, or (1 + weight) computed once
        self.gains = {id(n): self._gain(n) for n in self._c_norms()} if self.fused else {}
        self.act = act = (getattr(cfg, "hidden_activation", None)
                          or getattr(cfg, "hidden_act", None))
        # stacked at load (stack_projections): the fused layers are views of those stacks
        self.projections = [self._fused(layer, act, family) for layer in self.layers]
        # the layers a short step runs as one C++ call each (None: layer by layer)
        self.layer_ops = [self._layer_op(layer, plan, proj) for layer, plan, proj
                          in zip(self.layers, self.plans, self.projections)]
        self.k_pools = [zero_pool(shape, self.kv_dtype, self.device) for _ in self.layers]
        self.v_pools = [zero_pool(shape, self.kv_dtype, self.device) for _ in self.layers]

    def _prefill_attention(self) -> tuple[bool, bool]:
        """(long chunks attend in the C++ kernel, a chunk that starts its sequence attends with
        SDPA instead) from ``QUANTPIPE_CPU_PREFILL_ATTENTION`` (see
        :data:`PREFILL_ATTENTION_ENV`)."""
        choice = os.environ.get(PREFILL_ATTENTION_ENV, "auto")
        if choice not in ("auto", "kernel", "sdpa"):
            raise ValueError(f"{PREFILL_ATTENTION_ENV}={choice!r}: expected auto, kernel or sdpa")
        if not self.fused or self.attn_softcap is not None or choice == "sdpa":
            return False, False
        amx = (choice == "auto" and self.kv_dtype == torch.bfloat16
               and hasattr(self.ops, "amx_supported") and bool(self.ops.amx_supported()))
        return True, amx

    def _fused(self, layer, act: str | None, family: Family) -> FusedProjections:
        if not self.fused:
            return FusedProjections(None, None)
        return fuse_projections(layer, act, family)  # each part's own memory handed back

    def _layer_op(self, layer, plan: LayerPlan, proj: FusedProjections) -> tuple | None:
        """decoder_layer's per-layer arguments (weights, group sizes, vnni, eps, window,
        activation), or None where the layer needs anything that op does not do: score
        soft-capping, parts that are not all W4A8 or all fp16 (8-bit or FP layers of a mixed
        plan), an MLP other than a :data:`GATED_ACTS` one, a norm that is not an fp32
        RMSNorm."""
        if (not self.fused or os.environ.get(LAYER_OP_ENV, "1") == "0"
                or self.attn_softcap is not None or self.act not in GATED_ACTS
                or proj.qkv is None or proj.gate_up is None):
            return None
        operands = self._layer_linears(layer, proj)
        if operands is None:
            return None
        norms = [layer.input_layernorm, plan.mlp_in_norm, *plan.optional_norms()]
        if any(n is not None and id(n) not in self.gains for n in norms):
            return None  # a norm the C++ op cannot run (the layer's modules run it)
        gains = [None if n is None else self.gains[id(n)] for n in norms]
        weights = [gains[0][0], gains[1][0], proj.qkv_bias] + [None if g is None else g[0]
                                                               for g in gains[2:]]
        for w in operands[0]:
            weights += w
        eps = [0.0 if g is None else g[1] for g in gains]
        return (weights, *operands[1:], eps, self.scale, plan.window or 0, self.act)

    @staticmethod
    def _layer_linears(layer, proj: FusedProjections
                       ) -> tuple[list[list], list[int], bool] | None:
        """decoder_layer's operands of the layer's qkv, o, gate_up and down (packed, scales,
        mz, perm each; an fp16 layer: its blocked weight and three None), their group sizes
        (0 for fp16) and vnni; None unless all four are W4A8 of one build or all fp16."""
        o, down = layer.self_attn.o_proj, layer.mlp.down_proj
        if isinstance(proj.qkv, CpuW4A8) and isinstance(proj.gate_up, CpuW4A8):
            if _w4a8_parts([o, down]) is None:
                return None
            linears = [proj.qkv, o._w, proj.gate_up, down._w]
            if len({w.vnni for w in linears}) != 1 or len({w.op for w in linears}) != 1:
                return None
            return ([[w.packed, w.scales, w.mz, w.perm] for w in linears],
                    [w.group_size for w in linears], linears[0].vnni)
        if (isinstance(proj.qkv, torch.Tensor) and isinstance(proj.gate_up, torch.Tensor)
                and _half_parts([o, down]) is not None):
            stacks = [proj.qkv, o.w16, proj.gate_up, down.w16]
            return [[w, None, None, None] for w in stacks], [0, 0, 0, 0], False
        return None

    def _stacked_matmul(self, x: torch.Tensor, w: CpuW4A8 | torch.Tensor) -> torch.Tensor:
        """x [T, in] fp32 @ a stacked projection (W4A8, or blocked fp16: fp16_mm) -> [T, out]."""
        if isinstance(w, CpuW4A8):
            return w4a8_matmul(x, w)
        return self.ops.fp16_mm(x.contiguous(), w)

    @staticmethod
    def _plan(layer, window: int | None, rope_key: str | None, family: Family) -> LayerPlan:
        def part(name):
            return None if name is None else layer.get_submodule(name)

        attn = layer.self_attn
        return LayerPlan(window, rope_key, part(family.mlp_in_norm), part(family.attn_out_norm),
                         part(family.mlp_out_norm), attn.q_norm if family.qk_norm else None,
                         attn.k_norm if family.qk_norm else None)

    def _c_norms(self) -> list[torch.nn.Module]:
        """The norms the C++ add_rms_norm_ runs: those fused with a residual add, and the
        optional ones (q/k, sublayer outputs) that are fp32 RMSNorms (others run as modules)."""
        residual = [self.final_norm] + [n for layer, plan in zip(self.layers, self.plans)
                                        for n in (layer.input_layernorm, plan.mlp_in_norm)]
        optional = [n for plan in self.plans for n in plan.optional_norms()
                    if n is not None and _norm_eps(n, self.family) is not None]
        return residual + optional

    def _gain(self, norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
        w = norm.weight.detach()
        return (1.0 + w if self.family.one_plus_norm else w), _norm_eps(norm, self.family)

    def _rope_tables(self, h: torch.Tensor, positions: torch.Tensor) -> dict:
        """{rope_key: (cos, sin) [T, R]}: the model's own rotary module (rope_type, scaling)."""
        pos = positions.unsqueeze(0)  # [1, T]
        x = h.unsqueeze(0)  # [1, T, hidden]
        tables = {}
        for key in {p.rope_key for p in self.plans}:
            if key is None:
                cos, sin = self.decoder.rotary_emb(x, pos)  # [1, T, R]
            else:
                cos, sin = self.decoder.rotary_emb(x, pos, key)
            tables[key] = (cos[0], sin[0])
        return tables

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        meta = prepare_batch(chunks, self.kv_spec.block_size, self.device)
        # [T, hidden]; Gemma's sqrt(hidden) scale is the embedding module's own (HF's scaled
        # embedding, or fp_head.CastEmbedding carrying its embed_scale)
        h = self.decoder.embed_tokens(meta.input_ids)
        rope = self._rope_tables(h, meta.positions)
        # short chunks only (decode, small prefills) run the whole-layer op
        attn_kernel = self.fused and meta.q_max <= KERNEL_ATTENTION_MAX_Q
        # the kernel takes each sequence on its own (long chunks in tiles): one group
        groups = [AttentionGroup(None, meta, (attn_kernel or self.long_kernel)
                                 and self.attn_softcap is None,
                                 fresh=len(chunks) == 1 and chunks[0].start == 0)]
        if not attn_kernel and not self.long_kernel and len(chunks) > 1:
            groups = self._attention_groups(chunks)
        delta = None  # the last sublayer's output, not yet added to the residual stream h
        for i, layer in enumerate(self.layers):
            plan = self.plans[i]
            op_args = self.layer_ops[i] if attn_kernel else None
            cos, sin = rope[plan.rope_key]
            if op_args is not None and cos.shape[-1] == self.head_dim:  # one C++ call
                delta = self.ops.decoder_layer(
                    h, delta, *op_args, cos, sin, self.k_pools[i], self.v_pools[i],
                    meta.write_slots, meta.gather_blocks, meta.ctx_lens, meta.q_lens)
                continue
            x = self._add_norm(h, delta, layer.input_layernorm)  # [T, hidden]
            o = self._attention(i, layer, x, meta, rope[plan.rope_key], groups)
            o = self._norm(o, plan.attn_out_norm)
            x = self._add_norm(h, o, plan.mlp_in_norm)
            delta = self._norm(self._mlp(i, layer, x), plan.mlp_out_norm)
        h_last = h[meta.last_index] + delta[meta.last_index]  # [B, hidden]: rows we sample
        last = self._add_norm(h_last, None, self.final_norm)
        logits = self.model.lm_head(last).float()  # [B, vocab] fp32 logits
        if self.final_softcap is not None:
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits

    def _attention_groups(self, chunks: list[SeqChunk]) -> list[AttentionGroup]:
        """A step with a chunk longer than ``KERNEL_ATTENTION_MAX_Q`` tokens, split so that no
        sequence's queries are padded to another's length: the short chunks (decode tokens)
        attend together (the C++ kernel where usable), each long chunk alone. Padding them all
        to the longest (one [B, q_max, ctx_max] SDPA) made a decode step that met a
        1,000-token prompt cost as if all B sequences were that prompt."""
        bs = self.kv_spec.block_size
        ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))
        rows = [range(end - len(c.token_ids), end) for c, end in zip(chunks, ends)]
        short = [b for b, c in enumerate(chunks) if len(c.token_ids) <= KERNEL_ATTENTION_MAX_Q]
        groups = []
        if short:
            index = torch.tensor([r for b in short for r in rows[b]], dtype=torch.int64,
                                 device=self.device)
            groups.append(AttentionGroup(
                index, prepare_batch([chunks[b] for b in short], bs, self.device),
                self.fused and self.attn_softcap is None))
        for b, c in enumerate(chunks):
            if len(c.token_ids) > KERNEL_ATTENTION_MAX_Q:
                groups.append(AttentionGroup(slice(rows[b].start, rows[b].stop),
                                             prepare_batch([c], bs, self.device), False,
                                             fresh=c.start == 0))
        return groups

    def _mask(self, group: AttentionGroup, window: int | None) -> torch.Tensor:
        """The padded path's grouped mask of ``group`` for ``window``: made once per step,
        shared by the layers."""
        if window not in group.masks:
            meta = group.meta
            base = meta.attn_mask if window is None else window_mask(meta, window)
            group.masks[window] = group_mask(base, self.num_heads // self.num_kv_heads)
        return group.masks[window]

    def _qkv(self, i: int, attn, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> q [T, H, D], k and v [T, KV, D]."""
        T = x.shape[0]
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        fused = self.projections[i].qkv
        if fused is not None or self.family.qkv_proj:  # one matmul: [T, (H + 2 KV) * D]
            qkv = self._stacked_matmul(x, fused) if fused is not None else attn.qkv_proj(x)
            if self.projections[i].qkv_bias is not None:
                qkv = qkv + self.projections[i].qkv_bias
            q, k, v = qkv.split([H * D, KV * D, KV * D], dim=1)
            # column slices of a [T, ...] tensor: contiguous copies unless T == 1
            return tuple(t.reshape(T, -1, D).contiguous() for t in (q, k, v))
        q = attn.q_proj(x).view(T, H, D)  # [T, H * D] -> [T, H, D]
        k = attn.k_proj(x).view(T, KV, D)  # [T, KV * D] -> [T, KV, D]
        v = attn.v_proj(x).view(T, KV, D)
        return q, k, v

    def _attention(self, i: int, layer, x: torch.Tensor, meta: BatchMeta,
                   cos_sin: tuple[torch.Tensor, torch.Tensor],
                   groups: list[AttentionGroup]) -> torch.Tensor:
        """x [T, hidden] -> o_proj output [T, hidden]; each group of the step's sequences
        attends on its own (:meth:`_attention_groups`)."""
        attn = layer.self_attn
        T = x.shape[0]
        q, k, v = self._qkv(i, attn, x)
        plan = self.plans[i]
        if plan.q_norm is not None:  # RMSNorm over D of each head, before RoPE
            q, k = self._head_norm(q, plan.q_norm), self._head_norm(k, plan.k_norm)
        cos, sin = cos_sin
        if self.fused and cos.shape[-1] == self.head_dim:
            self.ops.rope_(q, k, cos, sin)  # in place
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # write into the paged slots (rounded to the KV dtype when it is narrower)
        KV, D = self.num_kv_heads, self.head_dim
        self.k_pools[i].view(-1, KV, D)[meta.write_slots] = k.to(self.kv_dtype)
        self.v_pools[i].view(-1, KV, D)[meta.write_slots] = v.to(self.kv_dtype)
        if len(groups) == 1:
            o = self._attend_group(i, q, k, v, groups[0])  # [T, H, D]
        else:
            o = torch.empty_like(q)
            for g in groups:
                rows = g.rows
                if isinstance(rows, slice):
                    o[rows] = self._attend_group(i, q[rows], k[rows], v[rows], g)
                else:
                    o.index_copy_(0, rows, self._attend_group(i, q.index_select(0, rows), None,
                                                              None, g))
        return attn.o_proj(o.reshape(T, -1))  # [T, H, D] -> [T, hidden]

    def _attend_group(self, i: int, q: torch.Tensor, k: torch.Tensor | None,
                      v: torch.Tensor | None, group: AttentionGroup) -> torch.Tensor:
        """q [T_g, H, D] of the group's sequences (k / v [T_g, KV, D]: their keys and values
        of this step) -> their attention output [T_g, H, D]."""
        meta, window = group.meta, self.plans[i].window
        T = q.shape[0]
        if (group.fresh and k is not None and self.attn_softcap is None
                and (window is None or window >= T)
                and (not group.kernel or (self.fresh_sdpa and T > KERNEL_ATTENTION_MAX_Q))):
            # the whole context is this step's T keys: causal SDPA on them as the cache holds
            # them (rounded to the KV dtype); with a bf16 cache the attention runs in bf16
            # (oneDNN's AMX / AVX-512 bf16 GEMMs inside: 2.5x fp32 at 1,266 tokens here)
            dt = torch.bfloat16 if self.kv_dtype == torch.bfloat16 else q.dtype
            qh = q.to(dt).transpose(0, 1)[None]  # [1, H, T, D]
            kh, vh = (t.to(self.kv_dtype).to(dt).transpose(0, 1)[None] for t in (k, v))
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale,
                                               enable_gqa=True).to(q.dtype)
            return o[0].transpose(0, 1)  # [H, T, D] -> [T, H, D]
        if group.kernel:  # read the paged blocks directly
            return self.ops.paged_attention.default(
                q, self.k_pools[i], self.v_pools[i], meta.gather_blocks, meta.ctx_lens,
                meta.q_lens, self.scale, window or 0)
        return paged_attention(q, self.k_pools[i], self.v_pools[i], meta,
                               self._mask(group, window), self.scale, self.attn_softcap)

    def _mlp(self, i: int, layer, x: torch.Tensor) -> torch.Tensor:
        fp = self.projections[i]
        if fp.gate_up is not None:  # [T, hidden] -> [T, 2 I] -> act(gate) * up [T, I]
            gated = getattr(self.ops, GATED_ACTS[self.act])
            return layer.mlp.down_proj(gated(self._stacked_matmul(x, fp.gate_up)))
        if self.family.moe is not None:  # transformers' MoE blocks take [batch, seq, hidden]
            return layer.mlp(x[None])[0]
        return layer.mlp(x)

    def _norm(self, x: torch.Tensor, norm: torch.nn.Module | None) -> torch.Tensor:
        """norm(x) [T, hidden] (x itself where the layer has no such norm): the C++ RMSNorm
        where it runs this norm (the layer op's arithmetic), else the module."""
        if norm is None:
            return x
        if id(norm) in self.gains:
            gain, eps = self.gains[id(norm)]
            return self.ops.add_rms_norm_(x, None, gain, eps)
        return norm(x)

    def _head_norm(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        """x [T, heads, D] -> norm over D of each head, [T, heads, D]."""
        if id(norm) not in self.gains:
            return norm(x)
        T, n, D = x.shape
        return self._norm(x.reshape(T * n, D), norm).view(T, n, D)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None,
                  norm: torch.nn.Module) -> torch.Tensor:
        """h += delta (in place: h is this step's residual stream), then norm(h)."""
        if self.fused:
            gain, eps = self.gains[id(norm)]
            return self.ops.add_rms_norm_(h, delta, gain, eps)
        if delta is not None:
            h += delta
        return norm(h)
