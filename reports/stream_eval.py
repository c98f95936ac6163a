"""`quantpipe eval` for models that do not fit in memory twice: both models run block by block.

The whole-model path (:func:`quantpipe.reports.eval.evaluate_many`) holds the FP reference
and the dequantized candidate in fp32 at once: 54 GB for a 7B model. Here each model is a
meta-device skeleton (:class:`quantpipe.blocks.stream.ModelStream`) whose weights are
read one decoder block at a time, and every evaluation window goes through block ``i`` before
block ``i + 1`` is read (the pattern of layer-wise calibration):

1. the windows to score are cut by the caller exactly as the whole-model path cuts them (same
   ``ctx``, same ``max_tokens`` truncation: ``reports.eval.scored_windows``);
2. the reference: embeddings (and each window's positions and masks), then each block over
   every window, keeping only the final hidden states ([window tokens, hidden] fp32 per
   window);
3. the candidate the same way, its blocks dequantized from the verified checkpoint one at a
   time (``QuantizedCheckpoint.layers[name].dequantize``; a MoE block's experts are stacked
   as transformers holds them by ``model_tensors``), on the reference's skeleton (the same
   architecture: ``check_candidate`` has compared their sources);
4. the final norm and output head of both (the tied embedding table where the head is tied,
   the family's logit soft-cap) turn each window's hidden states into logits, scored by the
   same accumulator as the whole-model path.

Peak memory: one block of one model in fp32, both output heads, and the final hidden states of
the scored windows (tokens x hidden x 4 bytes per model), instead of both whole models. The
results are the whole-model path's up to floating-point summation order (tested on tiny
models of every family).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantpipe.blocks.execute import embed_inputs, run_block
from quantpipe.blocks.stream import ModelStream, output_head
from quantpipe.core.families import family_for, get_path
from quantpipe.core.formats.loader import QuantizedCheckpoint, load_quantized, model_tensors


class CheckpointStream(ModelStream):
    """The reference's skeleton with a quantized checkpoint's weights: FP tensors as stored,
    quantized linears dequantized to ``dtype`` when their module is loaded."""

    def __init__(self, reference: str | Path, ckpt: QuantizedCheckpoint,
                 dtype: torch.dtype = torch.float32) -> None:
        self.ckpt = ckpt
        super().__init__(reference, dtype)

    def _weight_map(self) -> dict[str, str]:
        return {}  # tensors come from the checkpoint, not from shards

    def _hub_tensors(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        return self.ckpt.dequantized_tensors(self.dtype, prefix)

    def _module_tensors(self, module_name: str, names: list[str]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        prefix = f"{module_name}."
        want = set(names)
        # hub names -> transformers' (a MoE block's experts stacked into 3-D tensors)
        for full, t in model_tensors(self.ckpt.config, self._hub_tensors(prefix)):
            name = full[len(prefix):] if full.startswith(prefix) else None
            if name in want:
                want.discard(name)
                yield name, t
        if want:
            raise ValueError(f"{self.ckpt.folder}: no tensors for {module_name}: "
                             f"{', '.join(sorted(want))}")


@torch.no_grad()
def final_hidden(stream: ModelStream, wins: list[list[int]], desc: str) -> list[torch.Tensor]:
    """Each window's last block output [T, hidden] fp32, the model read one block at a time."""
    model = stream.model
    family = family_for(model.config.model_type)
    with stream.load(stream.embeddings_name):
        # [1, T, d] each, and the window's positions and masks
        hidden, ctxs = zip(*(embed_inputs(model, torch.tensor([w])) for w in wins))
    blocks = get_path(model, family.blocks)
    for i in tqdm(range(len(blocks)), desc=desc, unit="block", leave=False):
        with stream.load(f"{family.blocks}.{i}") as block:
            hidden = [run_block(block, h, c.for_layer(i), 1) for h, c in zip(hidden, ctxs)]
    return [h[0] for h in hidden]


def stream_evaluate(reference: Path, candidate: Path, quantized: bool, wins: list[list[int]],
                    accumulator) -> float:
    """Score ``candidate`` (a quantized checkpoint where ``quantized``, else a model folder)
    against ``reference`` on every window of ``wins`` into ``accumulator`` (the whole-model
    path's ``_Accumulator``); returns the seconds taken."""
    t0 = time.perf_counter()
    ref = ModelStream(reference)
    ref_hidden = final_hidden(ref, wins, "eval: reference")
    cand = (CheckpointStream(reference, load_quantized(candidate)) if quantized
            else ModelStream(candidate))
    cand_hidden = final_hidden(cand, wins, "eval: candidate")
    with output_head(ref) as ref_logits, output_head(cand) as cand_logits:
        for w, hr, hc in zip(wins, ref_hidden, cand_hidden):
            ids = torch.tensor(w)
            accumulator.add(ref_logits(hr[:-1]), cand_logits(hc[:-1]), ids[1:])
    return time.perf_counter() - t0
