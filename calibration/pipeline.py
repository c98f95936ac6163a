"""`quantpipe calibrate`: layer-sequential calibration of every decoder block.

The stages, in order (``calibrate`` and ``calibrate_block`` read as this list), and where each
lives, by data flow: 1-2 ``calibration.resume`` (inputs, the work folder, the resume point),
4a-4d ``calibration.block_step`` (the algorithms as data) and ``calibration.two_stream``
(GPTAQ's paired streams), 5 ``calibration.finish`` (the manifest), the spec in
``calibration.spec``; this module drives the blocks (3, 4e):

1. check every option and input, before CALIB_DIR is touched (FP16 manifest, config and shard
   hashes, group size against every layer, prompts and their token count);
2. take CALIB_DIR's output lock (quantpipe.core.io) and find the resume point in the hidden
   work folder beside it (calibration.artifact.work_dir);
3. open the model as a stream (quantpipe.blocks.stream: one block's weights in memory at a time)
   and embed the calibration tokens (on the CPU);
4. for each block:
   a. capture: run it over the cached block inputs with hooks that gather each input group's
      statistics (GPTQ Hessian, mean |x|, a token sample) and, where the algorithm needs them,
      the inputs of the inspected modules;
   b. algorithm step on the FP block (AWQ: search and fold the per-channel scales group by
      group, arXiv 2306.00978, sec. 3.2; calibration.awq.scale_block);
   c. quantize every linear at INT4 (the requested spec) and INT8 (per channel) with the
      algorithm's per-layer function; record losses and numerical fallbacks;
   d. the next block's inputs: through the INT4-quantized block for GPTQ (the original
      ``llama_sequential`` propagates quantized outputs), through the FP block otherwise;
      GPTAQ carries both (the quantized model's and the FP model's), and replaces a-c by:
      the FP block's pass recording every group's inputs, then per input group in execution
      order a pass through the partly quantized block pairing its inputs with the FP ones
      (H and dXXT), then that group's quantization;
   e. write the block's results and the next inputs, so a killed run resumes from here;
5. write the manifest (it marks the artifact valid) and replace CALIB_DIR with the work folder.

Stage 4 runs on ``--device`` (quantpipe.blocks.device): the block's weights, its context, the
batches of its inputs and its statistics are there; the activations stay on the CPU and every
result comes back to the CPU before 4e. With "cpu" the moves are no-ops: one code path.

What differs between algorithms is data: one ``block_step.Algorithm`` per name in
``ALGORITHMS``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time

import torch
from tqdm.auto import tqdm

from quantpipe.blocks.activations import (
    Activations,
    ActivationSpace,
    activation_budget,
    spills,
)
from quantpipe.blocks.execute import BlockContext, embed_inputs, run_block
from quantpipe.blocks.stream import ModelStream
from quantpipe.calibration import resume
from quantpipe.calibration.algorithms import ALGORITHMS
from quantpipe.calibration.artifact import (
    WORK_MARKER,
    save_block,
    work_dir,
)
from quantpipe.calibration.block_step import (
    NO_STEP,
    capture,
    quantize_block,
    set_quantized_weights,
)
from quantpipe.calibration.finish import CalibrateResult, finish
from quantpipe.calibration.resume import CalibInputs, Run
from quantpipe.calibration.spec import CalibrateSpec
from quantpipe.core.families import (
    Family,
    family_for,
    get_path,
)
from quantpipe.core.io import (
    check_output_dir,
    clean_stale_temps,
    output_lock,
    replace_dir,
)

log = logging.getLogger(__name__)

def calibrate(spec: CalibrateSpec) -> CalibrateResult:
    """Calibrate ``spec.fp16_dir`` into ``spec.out``: the stages of the module docstring."""
    t0 = time.perf_counter()
    spec = spec.resolved()  # the manifest and the resume fingerprint record concrete values
    inputs = resume.check_inputs(spec)  # 1
    run = resume.Run(spec, work_dir(spec.out), resume.resume_settings(spec, inputs.fp16_manifest))
    with output_lock(spec.out):  # 2
        clean_stale_temps(spec.out)
        check_output_dir(spec.out, spec.force)  # again: another run may have finished
        start = resume.prepare_work(run, inputs.num_blocks)
        try:
            data_summary, earlier_seconds = resume.earlier_progress(run, inputs, start)
            if start < inputs.num_blocks:
                _run_blocks(run, inputs, start, t0, earlier_seconds, data_summary)  # 3, 4
            result = finish(run, inputs, data_summary,  # 5: the manifest
                             earlier_seconds + time.perf_counter() - t0, start)
        except BaseException:
            if not (run.work / "progress.json").is_file():  # nothing to resume from
                shutil.rmtree(run.work, ignore_errors=True)  # (made by resume.prepare_work)
            raise
        replace_dir(run.work, spec.out)  # 5: the finished folder replaces CALIB_DIR
        with contextlib.suppress(FileNotFoundError):  # the resume point, kept as a record
            os.replace(spec.out / "progress.json", spec.out / "blocks" / "progress-final.json")
        (spec.out / WORK_MARKER).unlink(missing_ok=True)  # a finished CALIB_DIR, no work folder
    return result


def _run_blocks(run: Run, inputs: CalibInputs, start: int, t0: float, earlier_seconds: float,
                data_summary: dict) -> None:
    """Blocks ``start..`` one by one; after each, its results and the next inputs are saved.

    The model is a meta-device skeleton (quantpipe.blocks.stream): the embeddings are read only to
    compute the first inputs, then each block's weights are read, used and released in turn.
    """
    spec = run.spec
    stream = ModelStream(spec.fp16_dir)
    model = stream.model
    family = family_for(model.config.model_type)
    # the skeleton's blocks as the FP16 folder stores them (a MoE block is split into
    # per-expert linears only once its weights are loaded, in capture)
    blocks = get_path(model, family.blocks)
    if len(blocks) != inputs.num_blocks:
        raise ValueError(f"{spec.fp16_dir}: config.json describes {len(blocks)} blocks, the "
                         f"shards hold {inputs.num_blocks}; re-run export-fp16")
    keys = ("hidden", "hidden_fp") if ALGORITHMS[spec.algo].asymmetric else ("hidden",)
    embed_name = stream.embeddings_name
    n, L = inputs.input_ids.shape
    shape = (n, L, model.config.hidden_size)
    # the block inputs and outputs of every key are alive at once
    space = ActivationSpace(run.work / "state", shape,
                            spills(shape, 2 * len(keys), activation_budget(spec.max_memory)))
    if space.spill:
        log.info("calibration activations (%d x %.0f MiB) spill to %s", 2 * len(keys),
                 n * L * shape[2] * 4 / 2**20, space.folder)
    with stream.load(embed_name):
        if start == 0:
            input_ids = inputs.input_ids  # [n, L] int64
            # the block inputs carried along: "hidden" (the quantized model's, for GPTQ) and,
            # for GPTAQ, "hidden_fp" (the FP model's), each [n, L, d]
            hiddens, ctx = _first_inputs(model, input_ids, space, keys, spec.batch_size)
        else:
            hiddens, input_ids = space.load(start, keys)
            _, ctx = embed_inputs(model, input_ids[:1])  # the shared context only
    if start == 0:
        space.save(0, hiddens, input_ids)
        resume.save_progress(run, 0, {"data": data_summary})
    for i in tqdm(range(start, len(blocks)), desc="calibrate", unit="block",
                  initial=start, total=len(blocks)):
        with stream.load(f"{family.blocks}.{i}", device=spec.device) as block:
            hiddens = calibrate_block(run, block, i, family, model.config.model_type, hiddens,
                                       ctx.for_layer(i).to(spec.device), space)
        space.save(i + 1, hiddens, input_ids)
        resume.save_progress(run, i + 1, {"data": data_summary,
                                    "seconds": earlier_seconds + time.perf_counter() - t0})


def _first_inputs(model, input_ids: torch.Tensor, space: ActivationSpace, keys: tuple[str, ...],
                  batch_size: int) -> tuple[dict[str, Activations], BlockContext]:
    """Block 0's inputs of every key (the embeddings, a batch of samples at a time when
    spilled) and the shared context."""
    if not space.spill:
        hidden, ctx = embed_inputs(model, input_ids)  # [n, L, d]
        return {k: Activations.of(hidden.clone() if j else hidden)
                for j, k in enumerate(keys)}, ctx
    sets = {k: space.new(k, 0) for k in keys}
    ctx = None
    for a in range(0, input_ids.shape[0], batch_size):
        hidden, ctx = embed_inputs(model, input_ids[a:a + batch_size])
        for acts in sets.values():
            acts.write(a, hidden)
    for acts in sets.values():
        acts.commit()
    return sets, ctx


def calibrate_block(run: Run, block, i: int, family: Family, model_type: str,
                     hiddens: dict[str, Activations], ctx: BlockContext, space: ActivationSpace
                     ) -> dict[str, Activations]:
    """Stages 4a-4e of the module docstring for block ``i``; returns the next block's inputs
    (``hiddens``' keys: "hidden", and "hidden_fp" for GPTAQ; each [n, L, d])."""
    spec, algo = run.spec, ALGORITHMS[run.spec.algo]
    tb = time.perf_counter()
    name = f"{family.blocks}.{i}"
    if algo.whole_block is not None:  # 4a-4d in a data flow of the algorithm's own
        results, raises, nxt = algo.whole_block(spec, algo, block, name, model_type, family,
                                                hiddens, ctx, seed=spec.seed + i,
                                                out=lambda key: space.new(key, i + 1))
        step, expert_info = NO_STEP, {}
    else:
        hidden = hiddens["hidden"]
        # the FP outputs are the next inputs unless the quantized block makes them (4d)
        fp_out = None if algo.quantized_forward else space.new("hidden", i + 1)
        work = capture(spec, algo, block, name, model_type, family, hidden, ctx,
                        seed=spec.seed + i, out=fp_out)  # 4a
        step = algo.block_step(spec, work) if algo.block_step is not None else NO_STEP  # 4b
        results, raises, expert_info = quantize_block(spec, algo, work)  # 4c
        if algo.quantized_forward:
            set_quantized_weights(block, name, results)
        nxt = {"hidden": run_block(block, hidden, ctx, spec.batch_size,
                                   out=space.new("hidden", i + 1))
               if algo.quantized_forward else work.fp_out}  # 4d
    save_block(run.work, i, results, step.fp_changed, {  # 4e (the caller saves nxt)
        "seconds": time.perf_counter() - tb, "awq": step.info, "damp_raises": raises,
        "device": spec.device, "batch_size": spec.batch_size, **expert_info,
    })
    return nxt
