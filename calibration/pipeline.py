"""`quantpipe calibrate`: layer-sequential calibration of every decoder block.

The stages, in order (``calibrate`` and ``calibrate_block`` read as this list), and where each
lives, by data flow: 1-2 ``calibration.resume`` (inputs, the work folder, the resume point),
4a-4d ``calibration.block_step`` (the algorithms as data) and ``calibration.two_stream``
(GPTAQ's paired streams), 5 ``calibration.finish`` (the manifest); this module holds the spec
and drives the blocks (3, 4e):

1. check every option and input, before CALIB_DIR is touched (FP16 manifest, config and shard
   hashes, group size against every layer, prompts and their token count);
2. take CALIB_DIR's output lock (quantpipe.core.io) and find the resume point in the hidden
   work folder beside it (calibration.artifact.work_dir);
3. open the model as a stream (calibration.stream: one block's weights in memory at a time)
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

Stage 4 runs on ``--device`` (calibration.device): the block's weights, its context, the
batches of its inputs and its statistics are there; the activations stay on the CPU and every
result comes back to the CPU before 4e. With "cpu" the moves are no-ops: one code path.

What differs between algorithms is data: one ``block_step.Algorithm`` per name in
``ALGORITHMS``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantpipe.calibration import resume
from quantpipe.calibration.activations import (
    Activations,
    ActivationSpace,
    activation_budget,
    spills,
)
from quantpipe.calibration.algorithms import ALGORITHMS, AUTO_OPTIONS
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
from quantpipe.calibration.capture import (
    BlockContext,
    embed_inputs,
    run_block,
)
from quantpipe.calibration.config import (
    ALGOS,
    AUTO,
    AUTO_GROUP_SIZE,
    DEFAULTS,
    GROUP_SIZES,
)
from quantpipe.calibration.device import check_device
from quantpipe.calibration.finish import CalibrateResult, finish
from quantpipe.calibration.prompts import SHIPPED_SETS
from quantpipe.calibration.resume import CalibInputs, Run, read_config
from quantpipe.calibration.stream import ModelStream
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
from quantpipe.core.qformat import QuantSpec, resolve_group_size

log = logging.getLogger(__name__)

def _fitting_sizes(in_features: int) -> str:
    ok = [str(g) for g in GROUP_SIZES if g != -1 and in_features % g == 0]
    return ", ".join(ok + ["-1 (per channel)"])


def check_group_size(group_size: int | None) -> None:
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size {group_size} is not supported; use one of "
                         f"{', '.join(map(str, GROUP_SIZES))} (-1: per output channel)")


@dataclass(frozen=True)
class CalibrateSpec:
    fp16_dir: Path  # output of export-fp16
    out: Path  # CALIB_DIR
    prompts: str = DEFAULTS.prompts  # prompt file, or a shipped set name
    column: str | None = None  # text column for CSV/TSV/parquet prompt files
    # gptq | gptaq | awq | awq+gptq | rtn, or "auto" (the default): gptaq for dense models,
    # gptq for mixture-of-experts ones (resolved() reads FP16_DIR's config)
    algo: str = DEFAULTS.algo
    # INT4 group size requested (falls back per layer, see layer_group_size); None: auto,
    # AUTO_GROUP_SIZE or the largest divisor below it, planned per layer
    group_size: int | None = DEFAULTS.group_size
    sym: bool = DEFAULTS.sym  # INT4 symmetric (mid-point zero) or asymmetric
    # GPTQ: process columns by decreasing Hessian diagonal; None = GPTQ_ACT_ORDER_DEFAULT
    act_order: bool | None = None
    # RTN/GPTQ: search a clipping range per group (weighted by diag(H) for GPTQ);
    # None = GPTQ_MSE_CLIP_DEFAULT for GPTQ, off for RTN (the plain min-max baseline)
    mse_clip: bool | None = None
    strict_group_size: bool = False  # error instead of falling back to a smaller group size
    samples: int = DEFAULTS.samples  # calibration sequences
    seq_len: int = DEFAULTS.seq_len  # tokens per sequence
    min_tokens: int = DEFAULTS.min_tokens  # drop prompts shorter than this
    seed: int = DEFAULTS.seed
    # sequences per block forward. Not part of the resume settings (a run killed for memory
    # resumes with a smaller one): results differ between batch sizes by float rounding only
    # (per-batch fp32 X^T X products); each block's JSON records it, the manifest every size.
    batch_size: int = DEFAULTS.batch_size
    awq_samples: int = DEFAULTS.awq_samples  # sequences of AWQ's scale search
    # GPTQ group params: True = up front from the original weights, False = when GPTQ enters
    # the group (on error-updated columns), None = static with act-order, dynamic without
    # (static act-order groups keep g_idx sequential: no g_idx is stored)
    static_groups: bool | None = None
    # replace a finished CALIB_DIR (once the new one is complete) and discard an unfinished
    # calibration with other settings; one with the same settings is resumed
    force: bool = False
    # a layer whose in_features is below group_size: quantize it per channel (-1) instead of
    # failing (the per-layer choice is recorded like any group-size fallback)
    per_channel_if_larger: bool = False
    # MoE: an expert routed fewer calibration tokens than this is quantized with plain RTN
    # (recorded per linear as an expert fallback); dense models ignore it
    min_expert_tokens: int = DEFAULTS.min_expert_tokens
    # bytes the block activations may hold in RAM; beyond it they are spilled to files in the
    # work folder (calibration.activations). None: a fraction of the memory available at start.
    # Changes where activations live, not the results: not part of the resume settings.
    max_memory: int | None = None
    # where each block's maths runs: "cpu", "cuda" or "cuda:N" (calibration.device); the
    # activations stay on the CPU. Not part of the resume settings: results differ between
    # devices by float rounding only, so a run may resume on another device; each block's
    # JSON records the device it ran on, the manifest every device used.
    device: str = DEFAULTS.device

    def __post_init__(self) -> None:
        if self.algo != AUTO and self.algo not in ALGORITHMS:  # (bench scripts may add rows)
            raise ValueError(f"--algo {self.algo!r} is not supported; use one of {ALGOS}")
        check_group_size(self.group_size)
        check_device(self.device)
        algo = ALGORITHMS[AUTO_OPTIONS if self.algo == AUTO else self.algo]
        if self.act_order and algo.act_order_default is None:
            raise ValueError("--act-order applies to GPTQ only; drop it or use --algo gptq")
        if self.mse_clip and algo.mse_clip_default is None:
            raise ValueError("--mse-clip applies to RTN and GPTQ; AWQ runs its own clip search")
        if self.static_groups is not None and not algo.takes_static_groups:
            raise ValueError("--static-groups/--dynamic-groups apply to GPTQ only; drop it or "
                             "use --algo gptq")
        lowest = {"samples": 1, "seq_len": 2, "min_tokens": 1, "seed": 0, "batch_size": 1,
                  "awq_samples": 1, "min_expert_tokens": 1}
        if self.max_memory is not None and self.max_memory < 0:
            raise ValueError(f"--max-memory must be >= 0 bytes (got {self.max_memory})")
        for name, low in lowest.items():
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low} "
                                 f"(got {getattr(self, name)})")

    def resolved(self) -> CalibrateSpec:
        """The same spec with every default (None) replaced by the value it stands for, and
        the input paths resolved (so a relative and an absolute path resume the same run), and
        ``auto`` replaced by the algorithm it stands for with this model."""
        if self.algo == AUTO:
            return replace(self, algo=auto_algo(self.fp16_dir)).resolved()
        algo = ALGORITHMS[self.algo]
        act_order = self.act_order if self.act_order is not None else bool(
            algo.act_order_default)
        static = self.static_groups if self.static_groups is not None else (
            act_order if algo.takes_static_groups else None)
        mse = self.mse_clip if self.mse_clip is not None else bool(algo.mse_clip_default)
        prompts = self.prompts
        if prompts not in SHIPPED_SETS and Path(prompts).expanduser().exists():
            prompts = str(Path(prompts).expanduser().resolve())
        return replace(self, fp16_dir=Path(self.fp16_dir).expanduser().resolve(),
                       prompts=prompts, act_order=act_order, static_groups=static, mse_clip=mse)

    @property
    def int4(self) -> QuantSpec:
        gs = AUTO_GROUP_SIZE if self.group_size is None else self.group_size
        return QuantSpec(4, gs, self.sym, bool(self.resolved().act_order))

    def resume_settings(self) -> dict[str, str]:
        """The settings that must match for a partial run to resume (paths resolved)."""
        return {k: str(v) for k, v in asdict(self.resolved()).items()
                if k not in ("out", "force", "max_memory", "device", "batch_size")}

    def fingerprint(self) -> str:
        """Identifies the settings a partial run was started with (resume must match)."""
        keep = self.resume_settings()
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]

    def layer_group_size(self, name: str, in_features: int) -> int:
        """The INT4 group size used for one linear.

        A request that does not divide ``in_features`` falls back to the largest divisor below it
        (576 with 128 -> 64; an error with ``strict_group_size``); a request above ``in_features``
        is an error unless ``per_channel_if_larger``, which quantizes that layer per channel.
        The default (``group_size`` None) makes the same choice as a request for
        AUTO_GROUP_SIZE, planned: never an error, never a fallback.
        """
        gs = self.group_size
        if gs is None:
            return resolve_group_size(AUTO_GROUP_SIZE, in_features)
        if gs != -1 and gs > in_features:
            if self.per_channel_if_larger:
                return -1
            raise ValueError(
                f"--group-size {gs} is larger than in_features {in_features} of {name}; use "
                f"{_fitting_sizes(in_features)}, or --per-channel-if-larger to quantize such "
                "layers per channel"
            )
        try:
            return resolve_group_size(gs, in_features, self.strict_group_size)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None

    def layer_spec(self, name: str, in_features: int) -> QuantSpec:
        """The INT4 spec of one linear (its group size after any fallback; the block files record
        it, and finish counts the fallbacks from them)."""
        return self.int4.with_group_size(self.layer_group_size(name, in_features))


def auto_algo(fp16_dir: Path) -> str:
    """What ``--algo auto`` runs for the model in ``fp16_dir``."""
    model_type = read_config(Path(fp16_dir).expanduser()).get("model_type")
    return "gptq" if family_for(model_type).moe else "gptaq"


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

    The model is a meta-device skeleton (calibration.stream): the embeddings are read only to
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
