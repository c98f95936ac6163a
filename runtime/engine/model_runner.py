"""Run a Llama/Qwen2/Mistral decoder over the paged KV cache, one batched step at a time.

We call the Hugging Face module's own submodules (embeddings, norms, q/k/v/o projections, rotary
embedding, MLP, lm_head), so any ``nn.Linear`` replaced by a QuantLinear runs unchanged. Only
attention is ours: new K/V are written into their paged slots, then each sequence's blocks are
gathered (whole blocks, one copy per block) into a dense, padded ``[B, blocks_max * block_size,
kv_heads, head_dim]`` tensor and fed to
``torch.nn.functional.scaled_dot_product_attention`` with a boolean mask that is causal *and*
hides padding. Prefill chunks and decode tokens share one step (queries padded per sequence).
The same gather + SDPA path runs on CPU and on CUDA (there SDPA picks its fused kernel); there
is no custom paged-attention kernel.

On CPU with fp32 activations, when quantpipe's C++ kernels are usable
(``runtime.kernels.cpu_ext``), the norms (with the residual add folded in) and RoPE run as one
C++ call each instead of ~8 small torch ops, and a step whose chunks are all short (decode
tokens, prefill chunks of at most ``KERNEL_ATTENTION_MAX_Q`` tokens) attends with
``quantpipe_cpu::paged_attention``, which reads each sequence's K/V straight from its paged
blocks (no gather, no padding, no mask): the same formulas in fp32 (:func:`fused_ops_status`
says whether and why not). Longer prefill chunks keep the gather + SDPA path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantpipe.runtime.engine.kv_cache import KVCacheSpec, slot_mapping
from quantpipe.runtime.kernels import cpu_ext
from quantpipe.runtime.kernels.cpu import CpuA8W4, a8w4_matmul, concat_a8w4

# Model families whose decoder layers follow the Llama layout (data, not isinstance chains):
# model_type -> attribute names of (decoder, layers, final norm). All three use
# input_layernorm / self_attn.{q,k,v,o}_proj / post_attention_layernorm / mlp inside a layer.
FAMILIES: dict[str, tuple[str, str, str]] = {
    "llama": ("model", "layers", "norm"),
    "qwen2": ("model", "layers", "norm"),
    "mistral": ("model", "layers", "norm"),
}


# longest query chunk for the kernel attention path (its cost is O(q_len * ctx) per sequence;
# a mixed step of 7 decodes and one 16-token prefill: 14 ms of SDPA + gathers -> ~1 ms)
KERNEL_ATTENTION_MAX_Q = 32


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
    attn_mask: torch.Tensor  # [B, 1, q_max, ctx_max] bool, ctx_max = blocks_max * block_size
    last_index: torch.Tensor  # [B] int64 index into T of each chunk's last token
    ctx_lens: torch.Tensor  # [B] int64 tokens in each context after this step
    q_lens: torch.Tensor  # [B] int64 new tokens of each sequence in this step
    q_max: int


def prepare_batch(chunks: list[SeqChunk], block_size: int, device: torch.device) -> BatchMeta:
    if not chunks:
        raise ValueError("prepare_batch needs at least one sequence chunk")
    q_max = max(len(c.token_ids) for c in chunks)
    ctx_lens = [c.start + len(c.token_ids) for c in chunks]
    blocks_max = max(-(-n // block_size) for n in ctx_lens)
    ctx_max = blocks_max * block_size
    ids, pos, slots, q_index, last = [], [], [], [], []
    gather = torch.zeros(len(chunks), blocks_max, dtype=torch.int64)
    for b, c in enumerate(chunks):
        n = len(c.token_ids)
        ids += c.token_ids
        pos += range(c.start, c.start + n)
        slots += slot_mapping(c.block_table, c.start, c.start + n, block_size)
        q_index += range(b * q_max, b * q_max + n)
        last.append(len(ids) - 1)
        used = -(-ctx_lens[b] // block_size)
        gather[b, :used] = torch.tensor(c.block_table[:used])
    # Mask: query row i of sequence b sits at position start_b + i and may see keys j <= that
    # position (causal); that also hides the unused tail of its last block and the padding
    # blocks, all at j >= ctx_len_b. Padded query rows (i >= n_b) would see nothing and give
    # NaN from softmax over all -inf, so they see key 0; they are dropped later.
    starts = torch.tensor([c.start for c in chunks]).view(-1, 1, 1)  # [B, 1, 1]
    qpos = starts + torch.arange(q_max).view(1, -1, 1)  # [B, q_max, 1]
    kpos = torch.arange(ctx_max).view(1, 1, -1)  # [1, 1, ctx_max]
    mask = kpos <= qpos  # [B, q_max, ctx_max]
    n_q = torch.tensor([len(c.token_ids) for c in chunks]).view(-1, 1, 1)
    mask |= (torch.arange(q_max).view(1, -1, 1) >= n_q) & (kpos == 0)
    return BatchMeta(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(pos, dtype=torch.int64, device=device),
        write_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        q_index=torch.tensor(q_index, dtype=torch.int64, device=device),
        gather_blocks=gather.to(device),
        attn_mask=mask.unsqueeze(1).to(device),
        last_index=torch.tensor(last, dtype=torch.int64, device=device),
        ctx_lens=torch.tensor(ctx_lens, dtype=torch.int64, device=device),
        q_lens=torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int64, device=device),
        q_max=q_max,
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1), the HF/Llama RoPE convention."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D], cos/sin: [T, D] -> [T, heads, D]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: BatchMeta,
    grouped_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of the step's queries over each sequence's paged context.

    q: [T, H, D]; k_pool/v_pool: [num_blocks, block_size, KV, D];
    grouped_mask: [B, 1, G * q_max, ctx_max] bool (see :func:`group_mask`) -> out [T, H, D].

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
    out = F.scaled_dot_product_attention(q_g, k, v, attn_mask=grouped_mask, scale=scale)
    # [B, KV, G*q_max, D] -> [B, KV, G, q_max, D] -> [B, q_max, KV, G, D] -> [B * q_max, H, D]
    out = out.view(B, KV, G, meta.q_max, D).permute(0, 3, 1, 2, 4).reshape(B * meta.q_max, H, D)
    return out[meta.q_index]  # [T, H, D]


def group_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, 1, q_max, ctx] -> [B, 1, groups * q_max, ctx]: the same mask for each folded head."""
    B, _, q_max, ctx = mask.shape
    return mask.unsqueeze(2).expand(B, 1, groups, q_max, ctx).reshape(B, 1, groups * q_max, ctx)


@dataclass(frozen=True)
class FusedProjections:
    """A layer's projections that share an input, as one W4A8 matmul each (None: not fused).

    The q/k/v projections (and gate/up) read the same normed input, so one kernel call
    quantizes it once and streams the stacked weights once; the MLP's silu(gate) * up is then
    one op as well. Built only where every part is a bias-free W4A8 layer of the same build.
    """

    qkv: CpuA8W4 | None  # [(H + 2 KV) * D, hidden]
    gate_up: CpuA8W4 | None  # [2 * intermediate, hidden]


def _a8_parts(mods) -> list[CpuA8W4] | None:
    ws = [getattr(m, "_w", None) for m in mods]
    if all(isinstance(w, CpuA8W4) for w in ws) and all(m.bias is None for m in mods):
        return ws
    return None


def _fuse(mods) -> CpuA8W4 | None:
    """The stacked layer, the parts rebound to views into it (the weights held once)."""
    parts = _a8_parts(mods)
    fused = parts and concat_a8w4(parts)
    if fused is None:
        return None
    start = 0
    for mod, w in zip(mods, parts):
        n = w.packed.shape[0]  # blocks of 16 output rows
        mod.use_weights(CpuA8W4(fused.packed[start:start + n], fused.scales[start:start + n],
                                fused.mz[start:start + n], w.perm, w.group_size, w.op, w.vnni))
        start += n
    return fused


def fuse_projections(layer, hidden_act: str) -> FusedProjections:
    attn, mlp = layer.self_attn, layer.mlp
    gate_up = _fuse([mlp.gate_proj, mlp.up_proj]) if hidden_act == "silu" else None
    return FusedProjections(_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), gate_up)


def fused_ops_status(layers, final_norm, dtype: torch.dtype,
                     device: torch.device) -> tuple[bool, str]:
    """(use quantpipe's fused CPU norm / RoPE / paged-attention ops, reason)."""
    if device.type != "cpu" or dtype != torch.float32:
        return False, "fused ops are for fp32 activations on CPU"
    norms = [final_norm] + [n for layer in layers
                            for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    for norm in norms:  # RMSNorm as Llama / Qwen2 / Mistral define it: weight * x / rms(x)
        w = getattr(norm, "weight", None)
        if (not hasattr(norm, "variance_epsilon") or w is None or w.dtype != torch.float32
                or w.dim() != 1):
            return False, f"{type(norm).__name__} is not an fp32 RMSNorm with variance_epsilon"
    usable, why = cpu_ext.kernel_status()
    return usable, why


class ModelRunner:
    """Owns the HF module and the KV pools; ``forward(chunks) -> logits [B, vocab]``."""

    def __init__(self, model: torch.nn.Module, block_size: int, num_blocks: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        cfg = model.config
        if cfg.model_type not in FAMILIES:
            raise ValueError(
                f"model_type {cfg.model_type!r} is not supported by the serving engine; "
                f"supported: {sorted(FAMILIES)}"
            )
        decoder_name, layers_name, norm_name = FAMILIES[cfg.model_type]
        self.model = model
        self.decoder = getattr(model, decoder_name)
        self.layers = getattr(self.decoder, layers_name)
        self.final_norm = getattr(self.decoder, norm_name)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.device = next(model.parameters()).device
        embed = self.decoder.embed_tokens
        # activation (and KV) dtype; runtime.fp_head's CastEmbedding stores fp16, returns this
        self.dtype = getattr(embed, "out_dtype", embed.weight.dtype)
        # KV cache element type: the activation dtype, or bf16 (half the bytes of fp32; keys and
        # values rounded once when written)
        self.kv_dtype = kv_dtype or self.dtype
        self.kv_spec = KVCacheSpec(len(self.layers), self.num_kv_heads, self.head_dim,
                                   self.kv_dtype, block_size)
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.fused, self.fused_reason = fused_ops_status(self.layers, self.final_norm,
                                                         self.dtype, self.device)
        self.ops = cpu_ext.ops() if self.fused else None  # the active ISA build's ops
        act = getattr(cfg, "hidden_act", None)
        self.projections = [fuse_projections(layer, act) if self.fused
                            else FusedProjections(None, None) for layer in self.layers]
        self.k_pools = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                        for _ in self.layers]
        self.v_pools = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                        for _ in self.layers]

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        meta = prepare_batch(chunks, self.kv_spec.block_size, self.device)
        T = meta.input_ids.numel()
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        h = self.decoder.embed_tokens(meta.input_ids)  # [T, hidden]
        # The model's own rotary module (handles rope_type / scaling); cos, sin: [1, T, D].
        cos, sin = self.decoder.rotary_emb(h.unsqueeze(0), meta.positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]  # [T, D]
        # short chunks only (decode, small prefills): the kernel's work is O(q_len * ctx)
        attn_kernel = self.fused and meta.q_max <= KERNEL_ATTENTION_MAX_Q
        # the padded path's mask: built once, shared by every layer
        mask = None if attn_kernel else group_mask(meta.attn_mask, H // KV)
        delta = None  # the last sublayer's output, not yet added to the residual stream h
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            fp = self.projections[i]
            x = self._add_norm(h, delta, layer.input_layernorm)  # [T, hidden]
            if fp.qkv is not None:  # one matmul: [T, hidden] -> [T, (H + 2 KV) * D]
                q, k, v = a8w4_matmul(x, fp.qkv).split([H * D, KV * D, KV * D], dim=1)
                # column slices of a [T, ...] tensor: contiguous copies unless T == 1
                q, k, v = (t.reshape(T, -1, D).contiguous() for t in (q, k, v))
            else:
                q = attn.q_proj(x).view(T, H, D)  # [T, H * D] -> [T, H, D]
                k = attn.k_proj(x).view(T, KV, D)  # [T, KV * D] -> [T, KV, D]
                v = attn.v_proj(x).view(T, KV, D)
            if self.fused:
                self.ops.rope_(q, k, cos, sin)  # in place
            else:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            # write into the paged slots (rounded to the KV dtype when it is narrower)
            self.k_pools[i].view(-1, KV, D)[meta.write_slots] = k.to(self.kv_dtype)
            self.v_pools[i].view(-1, KV, D)[meta.write_slots] = v.to(self.kv_dtype)
            if attn_kernel:  # read the paged blocks directly
                o = self.ops.paged_attention.default(
                    q, self.k_pools[i], self.v_pools[i], meta.gather_blocks, meta.ctx_lens,
                    meta.q_lens, self.scale)  # [T, H, D]
            else:
                o = paged_attention(q, self.k_pools[i], self.v_pools[i], meta, mask,
                                    self.scale)
            o = attn.o_proj(o.reshape(T, H * D))  # [T, H, D] -> [T, hidden]
            x = self._add_norm(h, o, layer.post_attention_layernorm)
            if fp.gate_up is not None:  # [T, hidden] -> [T, 2 I] -> silu(gate) * up [T, I]
                delta = layer.mlp.down_proj(self.ops.silu_mul(a8w4_matmul(x, fp.gate_up)))
            else:
                delta = layer.mlp(x)
        h_last = h[meta.last_index] + delta[meta.last_index]  # [B, hidden]: rows we sample
        last = self._add_norm(h_last, None, self.final_norm)
        return self.model.lm_head(last).float()  # [B, vocab] fp32 logits

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None,
                  norm: torch.nn.Module) -> torch.Tensor:
        """h += delta (in place: h is this step's residual stream), then norm(h)."""
        if self.fused:
            return self.ops.add_rms_norm_(h, delta, norm.weight, norm.variance_epsilon)
        if delta is not None:
            h += delta
        return norm(h)
