"""Block-by-block execution of a decoder: the embeddings once, then one decoder block at a
time over a set of block inputs (the pattern of the original GPTQ ``llama_sequential``), so peak
memory is one block plus the activations, never the whole model twice.

Calibration runs it to capture statistics and the next block's inputs, sensitivity to measure
a layer quantized alone, and the report's streamed evaluation to score a checkpoint larger
than memory: this package sits below all three.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from quantpipe.blocks.activations import Activations
from quantpipe.blocks.device import module_device, to_device, to_host
from quantpipe.core.families import Family, layer_types


@dataclass
class BlockContext:
    """What a decoder block needs besides its hidden states (shared by all samples)."""

    position_ids: torch.Tensor  # [1, L] int64
    position_embeddings: tuple[torch.Tensor, torch.Tensor]  # cos, sin: [1, L, head_dim]
    attention_mask: torch.Tensor | None  # None: SDPA's causal path
    # per attention type (full / sliding window): (cos, sin) and mask, and each layer's type
    # (Gemma 2/3, Mistral, Qwen2 with sliding layers); empty: every layer uses the fields above
    by_type: dict = field(default_factory=dict)
    layer_types: tuple[str, ...] = ()

    def kwargs(self) -> dict:
        return {
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
            "position_embeddings": self.position_embeddings,
        }

    def for_layer(self, i: int) -> BlockContext:
        """The context of decoder block i (its attention type's positions and mask)."""
        if not self.layer_types:
            return self
        pos_emb, mask = self.by_type[self.layer_types[i]]
        return BlockContext(self.position_ids, pos_emb, mask)

    def to(self, device: str | torch.device) -> BlockContext:
        """The fields a block reads (positions, cos/sin, mask) on ``device``, for one layer's
        context (``for_layer(i)``; the per-type table is not carried)."""
        assert not self.by_type, "move for_layer(i)'s context, not the shared one"
        cos, sin = self.position_embeddings
        mask = self.attention_mask
        return BlockContext(to_device(self.position_ids, device),
                            (to_device(cos, device), to_device(sin, device)),
                            None if mask is None else to_device(mask, device))


@torch.no_grad()
def embed_inputs(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, BlockContext]:
    """input_ids [n, L] int64 -> block-0 hidden states [n, L, d] fp32 and the shared context
    (``ctx.for_layer(i)`` is block i's). The embedding module applies the family's own scale
    (Gemma's sqrt(hidden) is inside transformers' scaled embedding)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    inner = model.model
    hidden = inner.embed_tokens(input_ids).float()  # [n, L, d]
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # [1, L]
    masks = {"full_attention": create_causal_mask, "sliding_attention":
             create_sliding_window_causal_mask}
    per_layer_rope = "layer_type" in inspect.signature(inner.rotary_emb.forward).parameters
    types = layer_types(inner.config)  # one per decoder layer
    by_type = {}
    for kind in sorted(set(types)):
        extra = {"layer_type": kind} if per_layer_rope else {}
        cos, sin = inner.rotary_emb(hidden[:1], position_ids=position_ids, **extra)
        mask = masks[kind](config=inner.config, inputs_embeds=hidden[:1], attention_mask=None,
                           cache=None, position_ids=position_ids)
        by_type[kind] = ((cos.float(), sin.float()), mask)
    pos_emb, mask = by_type[types[0]]
    return hidden, BlockContext(position_ids, pos_emb, mask, by_type, types)


class StopForward(Exception):
    """Raised by a hook of a pass run only for its hooks (``run_block(keep=False)``) once it
    has what it needs: the rest of that batch's block forward is skipped."""


def batches(hidden: torch.Tensor | Activations, batch_size: int, device: torch.device
            ) -> Iterator[tuple[int, torch.Tensor]]:
    """(first sample, hidden[first:first + batch_size] on ``device``) for every batch of
    ``hidden`` [n, L, d] (a tensor, or an :class:`Activations` set read a batch at a time)."""
    read = hidden.read if isinstance(hidden, Activations) else (lambda a, b: hidden[a:b])
    for start in range(0, hidden.shape[0], batch_size):
        yield start, to_device(read(start, start + batch_size), device)


@torch.no_grad()
def run_until_stopped(module: torch.nn.Module, *args) -> None:
    """``module(*args)`` run for its hooks, one of which must end it (:class:`StopForward`):
    GPTAQ's passes that start inside a block."""
    try:
        module(*args)
    except StopForward:
        return
    raise AssertionError(f"no hook stopped the pass through {type(module).__name__}")


def attention_residual(block, family: Family, hidden: torch.Tensor, attn_out: torch.Tensor
                       ) -> torch.Tensor:
    """The decoder layer's first residual add: its input hidden [b, L, d] plus the attention's
    output [b, L, d] (through the family's attn_out_norm where it has one), as transformers'
    decoder layers add them (the same operations, so the same values)."""
    if family.attn_out_norm is not None:
        attn_out = block.get_submodule(family.attn_out_norm)(attn_out)
    return hidden + attn_out


def mlp_residual(block, family: Family, hidden: torch.Tensor, mlp_out: torch.Tensor
                 ) -> torch.Tensor:
    """The decoder layer's second residual add: the first one's result [b, L, d] plus the
    MLP's output [b, L, d] (through the family's mlp_out_norm where it has one) -> the
    block's output."""
    if family.mlp_out_norm is not None:
        mlp_out = block.get_submodule(family.mlp_out_norm)(mlp_out)
    return hidden + mlp_out


@torch.no_grad()
def run_block(block, hidden: torch.Tensor | Activations, ctx: BlockContext, batch_size: int,
              out: Activations | None = None, keep: bool = True
              ) -> torch.Tensor | Activations | None:
    """hidden [n, L, d] -> block output [n, L, d], ``batch_size`` samples at a time.

    ``hidden`` may be a tensor or an :class:`Activations` set (read a batch at a time). The
    output is a tensor, or written into ``out`` batch by batch (committed and returned), or,
    with ``keep=False``, dropped (a pass run only for its hooks, which may then end each
    batch's forward early by raising :class:`StopForward`). Each batch goes to the
    device of the block's weights and its output comes back to the CPU (calibration.device);
    ``ctx`` must already be there (:meth:`BlockContext.to`)."""
    device = module_device(block)
    outs = []
    for start, batch in batches(hidden, batch_size, device):
        try:
            y = block(batch, **ctx.kwargs())
        except StopForward:
            if keep or out is not None:
                raise RuntimeError("a hook stopped a block pass whose outputs are used") from None
            continue  # a pass for its hooks only: the rest of the block is not needed
        y = y[0] if isinstance(y, tuple) else y
        if out is not None:
            out.write(start, y)  # back to the CPU (Activations.write)
        elif keep:
            outs.append(to_host(y))
    if out is not None:
        out.commit()
        return out
    return torch.cat(outs) if keep else None
