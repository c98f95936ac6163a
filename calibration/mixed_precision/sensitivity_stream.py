"""`quantpipe sensitivity` block by block: for models the whole-model measurement cannot hold.

The whole-model measurement (:mod:`.sensitivity`) keeps the FP model in fp32 and, for each
linear and precision, runs every block from the linear's to the last: the memory of the whole
model (28 GB for a 7B) and O(blocks^2) block passes on every token (about 7,000 for a 7B: days
on two cores). Here the FP16 model is a meta-device skeleton
(:class:`quantpipe.blocks.stream.ModelStream`) whose blocks are read once each, in order, and a
layer's damage is measured where it happens, then carried to the output by a measured gain:

1. **local change**: block i runs on its FP input with one linear replaced by its dequantized
   calibrated weight (each precision and entry measured), and

       e(layer, tag) = mean over tokens of ||y'_t - y_t||^2 / ||y_t||^2

   is the relative squared change of the block's output (the residual stream leaving block
   i), token by token: the next block normalises each token's hidden state (RMSNorm) before
   using it, so a change counts relative to that token's size. (The absolute squared change
   let a few tokens with huge hidden states, attention sinks, set a block's gain: on
   SmolLM2 it underrated one block's layers 2.8x.)
2. **gain of block i**: a probe, block i with every one of its linears at the lowest measured
   precision, runs on the first ``probe_tokens`` tokens, and its output is carried through the
   FP blocks after it (all probes move forward together, block by block) to the FP16 head:

       g_i = KLD(probe_i) / e(probe_i)

   the end-to-end KLD per unit of relative change of block i's output;
3. ``kld_<tag>(layer) = g_i * e(layer, tag)``: the same KLD scale as the whole-model
   measurement (the planner sums it), with the depth dependence measured, not assumed. Both
   e and KLD are quadratic in small weight errors, so g_i does not depend on their size.

What it leaves out: a layer's error points in another direction of the residual stream than
its block's probe, and the gain along that direction may differ (the whole-model measurement
has no such approximation). The file says ``method: stream``; its agreement with the
whole-model measurement is in docs/mixed-precision.md.

Cost: per block, one FP pass and one pass per (layer, tag) on that block alone, plus every
earlier block's probe on ``probe_tokens``: O(blocks) passes of the measured tokens and
O(blocks^2 / 2) probe passes. Memory: one block in fp32, the block's input and output, the
probes' hidden states (blocks x probe_tokens x hidden floats), and at the end the final norm
and head (scored in row chunks). No validation split: its whole-model checkpoints would cost
O(checkpoints x blocks) passes, so plans from this file are marked not validated.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from tqdm.auto import tqdm

from quantpipe.blocks.execute import embed_inputs, run_block
from quantpipe.blocks.stream import ModelStream, output_head
from quantpipe.calibration.artifact import Calibration
from quantpipe.calibration.menu import tag_of
from quantpipe.calibration.mixed_precision.scoring import Scorer, output_energy_hooks, proxies
from quantpipe.calibration.mixed_precision.stream_progress import StreamProgress, StreamState
from quantpipe.core.experts import split_experts
from quantpipe.core.families import family_for, get_path

log = logging.getLogger(__name__)


class _FoldedStream(ModelStream):
    """The FP16 folder's model with the tensors calibration changed (AWQ folding) in place of
    the stored ones: the function whose linears the calibration quantized."""

    def __init__(self, calib: Calibration) -> None:
        super().__init__(calib.fp16_dir)
        self.overrides = calib.fp_tensors()
        unknown = [k for k in self.overrides if k not in self._where]
        if unknown:
            raise ValueError(f"{calib.folder} changes tensors the model lacks: {unknown[:3]}; "
                             "was it calibrated from another FP16 folder?")

    def _module_tensors(self, module_name, names):
        for name, tensor in super()._module_tensors(module_name, names):
            full = f"{module_name}.{name}"
            yield name, self.overrides[full] if full in self.overrides else tensor


@contextlib.contextmanager
def _replaced(qweights: dict, block, block_name: str, choice: dict[str, str]):
    """``block``'s linears named in ``choice`` (full name -> entry tag) hold their dequantized
    calibrated weights (``qweights[tag][name]``, read on access) for the ``with`` body, their
    FP weights again afterwards."""
    linears = {n: block.get_submodule(n[len(block_name) + 1:]) for n in choice}
    originals = {n: lin.weight.data for n, lin in linears.items()}
    try:
        for n, lin in linears.items():
            lin.weight.data = qweights[choice[n]][n].dequantize(originals[n].dtype)  # [out, in]
        yield
    finally:
        for n, lin in linears.items():
            lin.weight.data = originals[n]


def _block_changes(spec, qweights: dict, block, block_name: str,
                   tags: dict[str, list[str]], hidden: torch.Tensor, out: torch.Tensor, bctx,
                   bar) -> dict[str, dict[str, float]]:
    """layer -> tag -> e: the change of ``block``'s output ``out`` with that layer alone at
    that entry (the block run on its FP input ``hidden``)."""
    change: dict[str, dict[str, float]] = {}
    for n, ts in tags.items():
        change[n] = {}
        for t in ts:
            with _replaced(qweights, block, block_name, {n: t}):
                change[n][t] = _change(run_block(block, hidden, bctx, spec.batch_size), out)
            bar.update()
    return change


def _change(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over tokens of the relative squared change ||y_t - ref_t||^2 / ||ref_t||^2
    ([n, L, d] each), in float64."""
    ref = ref.double().reshape(-1, ref.shape[-1])
    d = y.double().reshape(-1, y.shape[-1]) - ref
    return float((d.pow(2).sum(dim=-1) / ref.pow(2).sum(dim=-1).clamp_min(1e-30)).mean())


@torch.no_grad()
def measure_streamed(spec, calib: Calibration, infos: dict, input_ids: torch.Tensor,
                     menu: dict[str, list[str]],
                     progress: StreamProgress | None = None) -> tuple[dict, dict]:
    """(layers, extra) for sensitivity.json (``spec``: the SensitivitySpec of
    :mod:`.sensitivity`, which calls this): each layer's ``kld_<tag>`` estimated as in the
    module docstring (and ``change_<tag>``, e), with the whole-model path's proxies; ``extra``:
    the method, each block's gain and the token counts (and ``resumed``: the block a previous
    run's saved state was taken up at, with the seconds it had spent). ``input_ids``
    [n, seq_len]: the measured tokens (the probes take the first sequences); ``menu``: layer
    -> menu tags; ``progress``: where the state is saved after each block and resumed from."""
    t0 = time.perf_counter()
    stream = _FoldedStream(calib)
    model = stream.model
    family = family_for(model.config.model_type)
    prefix = family.blocks
    # the skeleton's blocks as the FP16 folder stores them (a MoE block's experts are split
    # into per-expert linears once its weights are loaded: the names calibration gave them)
    blocks = get_path(model, prefix)
    if len(blocks) != calib.num_blocks:
        raise ValueError(f"the model has {len(blocks)} blocks, the calibration "
                         f"{calib.num_blocks}; use the FP16 folder it was calibrated from")
    probe_tag = tag_of(min(spec.bits))
    n_probe = max(1, min(input_ids.shape[0], -(-spec.probe_tokens // input_ids.shape[1])))
    with stream.load(stream.embeddings_name):
        hidden, ctx = embed_inputs(model, input_ids)  # [n, L, d] fp32

    state = progress.load() if progress is not None else None
    resumed = None
    if state is not None:
        if state.blocks_done > len(blocks) or tuple(state.hidden.shape) != tuple(hidden.shape):
            raise ValueError(f"{progress.dir} does not fit this model; remove it or pass "
                             "--force")
        resumed = {"at_block": state.blocks_done, "seconds_before": round(state.seconds, 1)}
        log.info("sensitivity: resuming at block %d/%d (%.0fs spent before)",
                 state.blocks_done, len(blocks), state.seconds)
        hidden = state.hidden
    else:
        state = StreamState()
    # probes: probe of block j, [n_probe, L, d], carried forward
    probes, probe_change, energy = state.probes, state.probe_change, state.energy
    change, by_block = state.change, state.by_block
    runs = {n: len(spec.bits) + len(menu[n]) for n in infos}
    done_names = {n for names in by_block for n in names}
    bar = tqdm(total=sum(runs.values()), desc="sensitivity", unit="run",
               initial=sum(runs[n] for n in done_names if n in runs))
    seconds_before = state.seconds
    for i in range(state.blocks_done, len(blocks)):
        block_name = f"{prefix}.{i}"
        names = [n for n in infos if n.startswith(f"{block_name}.")]
        by_block.append(names)
        bctx = ctx.for_layer(i)
        with stream.load(block_name) as block:
            if family.moe is not None:
                split_experts(block, family.moe)
            short = {n[len(block_name) + 1:]: n for n in names}
            handles = output_energy_hooks(block, short, energy)
            try:
                out = run_block(block, hidden, bctx, spec.batch_size)  # FP [n, L, d]
            finally:
                for h in handles:
                    h.remove()
            # the earlier probes through this FP block
            probes = [run_block(block, p, bctx, spec.batch_size) for p in probes]
            tags = {n: [tag_of(b) for b in spec.bits] + menu[n] for n in names}
            # each entry's weights of the block, read from its block file as they are used
            # (one lookup of the calibration's layer records per entry, not per run)
            qweights = {t: calib.weights({n: t for n in names if t in tags[n]})
                        for t in dict.fromkeys(t for ts in tags.values() for t in ts)}
            change.update(_block_changes(spec, qweights, block, block_name, tags, hidden, out,
                                         bctx, bar))
            # this block's probe: every linear at the probe precision
            with _replaced(qweights, block, block_name, dict.fromkeys(names, probe_tag)):
                probe = run_block(block, hidden[:n_probe], bctx, spec.batch_size)
            probe_change.append(_change(probe, out[:n_probe]))
            probes.append(probe)
        hidden = out
        if progress is not None:
            state.blocks_done, state.hidden, state.probes = i + 1, hidden, probes
            state.seconds = seconds_before + time.perf_counter() - t0
            progress.save(state)
        log.info("block %d/%d measured (%.0fs)", i + 1, len(blocks), time.perf_counter() - t0)
    bar.close()

    with output_head(stream) as head:
        scorer = Scorer(head, hidden[:n_probe], spec.chunk_rows)
        probe_kld = [scorer.mean_kld(p) for p in probes]
    gains = [k / c if c > 0 else 0.0 for k, c in zip(probe_kld, probe_change)]
    layers = {}
    for i, names in enumerate(by_block):
        for n in names:
            entry = proxies(infos[n], energy[n])
            for t, e in change[n].items():
                entry[f"kld_{t}"] = gains[i] * e
                entry[f"change_{t}"] = e
            layers[n] = entry
    extra = {
        "method": "stream",
        "tokens_measured": int(input_ids.numel()),
        "tokens_scored": scorer.tokens,
        "gains": [{"block": i, "probe": probe_tag, "change": c, "kld": k, "gain": g}
                  for i, (c, k, g) in enumerate(zip(probe_change, probe_kld, gains))],
    }
    if resumed is not None:
        extra["resumed"] = resumed
    return layers, extra
