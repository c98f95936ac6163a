"""`quantpipe calibrate`: layer-sequential calibration of every decoder block.

The stages, in order (``calibrate`` and ``_calibrate_block`` read as this list):

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

What differs between algorithms is data: one :class:`Algorithm` per name in ``ALGORITHMS``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from quantpipe.calibration.activations import (
    Activations,
    ActivationSpace,
    activation_budget,
    spills,
)
from quantpipe.calibration.artifact import (
    WORK_MARKER,
    block_file,
    check_work_dir,
    save_block,
    work_dir,
)
from quantpipe.calibration.awq import awq_quantize, scale_block, scale_shared_input
from quantpipe.calibration.capture import (
    BlockContext,
    GroupInputRecorder,
    GroupStats,
    InputRecorder,
    StatsCollector,
    attention_residual,
    batches,
    embed_inputs,
    mlp_residual,
    run_block,
    run_until_stopped,
)
from quantpipe.calibration.config import (
    ALGOS,
    AUTO,
    AUTO_GROUP_SIZE,
    DEFAULTS,
    GPTQ_ACT_ORDER_DEFAULT,
    GPTQ_MSE_CLIP_DEFAULT,
    GROUP_SIZES,
)
from quantpipe.calibration.device import (
    check_device,
    is_cpu,
    module_device,
    result_to_host,
    to_device,
    to_host,
)
from quantpipe.calibration.gptq import GPTAQ_ALPHA, gptaq, gptq
from quantpipe.calibration.grid import clip_search_settings
from quantpipe.calibration.moe import (
    FALLBACK,
    expert_linears_in,
    fallback_quantize,
    fused_block_state,
    is_expert_group,
    moe_shared_input,
)
from quantpipe.calibration.prompts import SHIPPED_SETS
from quantpipe.calibration.result import QuantResult
from quantpipe.calibration.rtn import rtn
from quantpipe.calibration.stream import ModelStream
from quantpipe.core.config_check import check_folder_config
from quantpipe.core.families import (
    ONE_PLUS_NORM_FAMILIES,
    Family,
    InputGroup,
    block_groups,
    family_for,
    family_linear_names,
    get_path,
)
from quantpipe.core.io import (
    check_not_overlapping,
    check_output_dir,
    clean_stale_temps,
    output_lock,
    read_manifest,
    replace_dir,
    verify_shard_hashes,
    write_json_atomic,
    write_manifest,
)
from quantpipe.core.qformat import INT8_PER_CHANNEL, QuantizedWeight, QuantSpec, resolve_group_size

log = logging.getLogger(__name__)

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
        algo = ALGORITHMS[_AUTO_OPTIONS if self.algo == AUTO else self.algo]
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


@dataclass(frozen=True)
class CalibrateResult:
    out: Path
    seconds: float
    peak_rss_mb: float
    group_size_fallbacks: dict[str, int]
    damp_raises: int
    resumed_from: int
    # MoE: expert linear -> the tokens routed to it, for experts below min_expert_tokens
    expert_fallbacks: dict[str, int] = field(default_factory=dict)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass(frozen=True)
class _Inputs:
    """What calibrate read and checked before touching CALIB_DIR."""

    fp16_manifest: dict
    model_type: str
    num_blocks: int
    input_ids: torch.Tensor  # [samples, seq_len] int64: the packed calibration windows
    data_summary: dict  # calibration.prompts.CalibSummary as a dict


@dataclass(frozen=True)
class _Run:
    """One calibrate run: the resolved spec, where it builds CALIB_DIR, what resume matches."""

    spec: CalibrateSpec
    work: Path  # hidden folder beside spec.out (calibration.artifact.work_dir)
    settings: dict[str, str]  # spec.resume_settings() + the FP16 shards' hashes


def _read_config(fp16_dir: Path) -> dict:
    path = fp16_dir / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing; re-run export-fp16 to rebuild FP16_DIR") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); re-run export-fp16") from None


def _linear_in_features(fp16_dir: Path, manifest: dict, family: Family) -> tuple[dict, int]:
    """``({linear name: in_features}, number of blocks)`` from the shard headers alone, in
    model order (block by block, linears in the family's order)."""
    names = family_linear_names(family)
    moe_first = family.moe.gate_up if family.moe else ""
    pattern = re.compile(rf"{re.escape(family.blocks)}\.(\d+)\.(.+)\.weight")
    found: dict[tuple[int, int], tuple[str, int]] = {}  # (block, linear) -> (name, in)
    for entry in manifest["shards"]:
        with safe_open(str(fp16_dir / entry["file"]), framework="pt") as f:
            for key in f.keys():
                m = pattern.fullmatch(key)
                if m and m.group(2) in names:
                    in_f = int(f.get_slice(key).get_shape()[1])  # weight: [out, in]
                    found[int(m.group(1)), names.index(m.group(2))] = (key[: -len(".weight")], in_f)
                # MoE: each expert's linears (ordered after the block's other linears)
                for j, (name, in_f) in enumerate(expert_linears_in(
                        family, key, f.get_slice(key).get_shape()).items()):
                    block = int(name[len(family.blocks) + 1:].split(".", 1)[0])
                    found[block, len(names) + j + (0 if key.endswith(moe_first) else 10**6)] = (
                        name, in_f)
    if not found:
        raise ValueError(f"{fp16_dir}: its shards hold no {family.blocks}.N.* linears; "
                         "re-run export-fp16")
    return dict(found[k] for k in sorted(found)), len({b for b, _ in found})


def _fitting_sizes(in_features: int) -> str:
    ok = [str(g) for g in GROUP_SIZES if g != -1 and in_features % g == 0]
    return ", ".join(ok + ["-1 (per channel)"])


def layer_group_size(spec: CalibrateSpec, name: str, in_features: int) -> int:
    """The INT4 group size used for one linear.

    A request that does not divide ``in_features`` falls back to the largest divisor below it
    (576 with 128 -> 64; an error with ``strict_group_size``); a request above ``in_features``
    is an error unless ``per_channel_if_larger``, which quantizes that layer per channel.
    The default (``group_size`` None) makes the same choice as a request for
    AUTO_GROUP_SIZE, planned: never an error, never a fallback.
    """
    gs = spec.group_size
    if gs is None:
        return resolve_group_size(AUTO_GROUP_SIZE, in_features)
    if gs != -1 and gs > in_features:
        if spec.per_channel_if_larger:
            return -1
        raise ValueError(
            f"--group-size {gs} is larger than in_features {in_features} of {name}; use "
            f"{_fitting_sizes(in_features)}, or --per-channel-if-larger to quantize such "
            "layers per channel"
        )
    try:
        return resolve_group_size(gs, in_features, spec.strict_group_size)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _check_inputs(spec: CalibrateSpec) -> _Inputs:
    """Every check on the options and inputs, before CALIB_DIR (or its lock) is touched."""
    from quantpipe.calibration.prompts import (
        CalibDataSpec,
        build_calibration_set,
        load_prompt_records,
    )
    from quantpipe.core.sources import load_folder_tokenizer

    prompts_path = None if spec.prompts in SHIPPED_SETS else spec.prompts
    inputs = {"FP16_DIR": spec.fp16_dir, "--prompts": prompts_path}
    check_not_overlapping(spec.out, inputs)
    # the work folder is written and removed like CALIB_DIR itself
    check_not_overlapping(work_dir(spec.out), inputs,
                          option=f"the work folder of --out {spec.out},",
                          remedy="choose another --out")
    check_work_dir(work_dir(spec.out), spec.out)
    check_output_dir(spec.out, spec.force)
    records = load_prompt_records(spec.prompts, column=spec.column)
    manifest = read_manifest(spec.fp16_dir, "fp16")
    config = _read_config(spec.fp16_dir)
    family = family_for(config.get("model_type"))
    if ALGORITHMS[spec.algo].asymmetric and family.moe:
        raise ValueError(f"--algo {spec.algo} does not support mixture-of-experts models "
                         "(an expert's routed tokens differ between the FP and the quantized "
                         "model, so its inputs cannot be paired); use --algo gptq")
    verify_shard_hashes(spec.fp16_dir, manifest["shards"])  # reads every byte: logged at -v
    check_folder_config(spec.fp16_dir)  # an absurd config.json size would be built first
    in_features, num_blocks = _linear_in_features(spec.fp16_dir, manifest, family)
    for name, in_f in in_features.items():
        layer_group_size(spec, name, in_f)
    max_pos = config.get("max_position_embeddings")
    if max_pos and spec.seq_len > max_pos:
        raise ValueError(f"--seq-len {spec.seq_len} is above the model's "
                         f"max_position_embeddings {max_pos}; use at most {max_pos}")
    calib = build_calibration_set(
        load_folder_tokenizer(spec.fp16_dir), records,
        CalibDataSpec(n_samples=spec.samples, seq_len=spec.seq_len,
                      min_tokens=spec.min_tokens, seed=spec.seed),
    )
    assert torch.is_tensor(calib.input_ids), "pack mode returns one [n, seq_len] tensor"
    return _Inputs(manifest, config["model_type"], num_blocks, calib.input_ids,
                   asdict(calib.summary))


def _resume_settings(spec: CalibrateSpec, fp16_manifest: dict) -> dict[str, str]:
    shards = json.dumps([[s["file"], s["sha256"]] for s in fp16_manifest["shards"]])
    # the clip search's settings are library constants, not spec fields: a run started by a
    # version with another search must not resume into this one (its blocks would mix both)
    return {**spec.resume_settings(),
            "clip_search": json.dumps(clip_search_settings(), sort_keys=True),
            "fp16_shards": hashlib.sha256(shards.encode()).hexdigest()[:16]}


def _differences(before: dict, now: dict) -> list[str]:
    keys = sorted((set(before) | set(now)) - {"out", "force"})
    return [f"{k}: {before.get(k)!r} before, {now.get(k)!r} now"
            for k in keys if before.get(k) != now.get(k)]


def _prepare_work(run: _Run, num_blocks: int) -> int:
    """Find the resume point in the work folder, or start it afresh; returns the first block.

    Same settings: resume (with or without --force). Other settings: an error naming them,
    or with --force the unfinished run is discarded. CALIB_DIR itself is never touched here,
    and neither is a folder at the work folder's path that quantpipe did not mark as its own.
    """
    check_work_dir(run.work, run.spec.out)
    progress = run.work / "progress.json"
    if progress.is_file():
        state = json.loads(progress.read_text())
        diffs = _differences(state.get("spec", {}), run.settings)
        nxt = _resume_point(run.work, int(state["next_block"]), num_blocks)
        if not diffs and nxt is not None:
            log.info("resuming %s at block %d (work folder %s)", run.spec.out, nxt, run.work)
            return nxt
        if diffs and not run.spec.force:
            raise ValueError(
                f"{run.spec.out} has an unfinished calibration with other settings ("
                + "; ".join(diffs) + "); re-run with the earlier settings to resume it, or "
                "pass --force to discard it"
            )
        log.warning("discarding the unfinished calibration in %s", run.work)
    if run.work.exists():
        shutil.rmtree(run.work)
    run.work.mkdir(parents=True)
    write_json_atomic(run.work / WORK_MARKER, {"version": 1, "calib_dir": str(run.spec.out)})
    return 0


def _resume_point(work: Path, progress_next: int, num_blocks: int) -> int | None:
    """The first block to calibrate when resuming from ``work``, or None (nothing to resume).

    The saved state names the block whose inputs it holds: that block is where the run
    continues, whatever the progress file says (a run killed after saving the next inputs but
    before writing its progress is one block behind in it). With no state left, the run was
    killed while finishing: every block is done. Either way every earlier block's results
    must be on disk (they are written before the state moves on)."""
    saved = ActivationSpace.saved_block(work / "state")
    nxt = saved if saved is not None else (num_blocks if progress_next >= num_blocks else None)
    if nxt is None or not all(block_file(work, j, "json").is_file() for j in range(nxt)):
        return None
    return nxt


def _save_progress(run: _Run, next_block: int, extra: dict) -> None:
    write_json_atomic(
        run.work / "progress.json",
        {"fingerprint": run.spec.fingerprint(), "next_block": next_block,
         "spec": run.settings, **extra},
    )


def _layer_spec(spec: CalibrateSpec, name: str, in_features: int) -> QuantSpec:
    """The INT4 spec of one linear (its group size after any fallback; the block files record
    it, and _finish counts the fallbacks from them)."""
    return spec.int4.with_group_size(layer_group_size(spec, name, in_features))


# ---------------------------------------------------------------------------------------
# the algorithms as data: what stages 4a-4d do for each one


@dataclass
class _BlockWork:
    """What the stages of one block share: the block, its context and what 4a captured."""

    block: torch.nn.Module  # materialised by the stream for the duration of the block
    name: str  # its model name, e.g. "model.layers.3"
    model_type: str  # config.json's model_type (how its norms apply their gain)
    family: Family
    groups: tuple[InputGroup, ...]  # the block's input groups, in execution order
    ctx: BlockContext  # positions and mask shared by every sample
    stats: dict[InputGroup, GroupStats]  # per input group: X^T X, mean |x|, a token sample
    recorded: dict[str, list[torch.Tensor]]  # inspected module -> its inputs [n, L, d] each
    fp_out: Activations | None  # [n, L, d] the FP block's outputs (None: not kept)


@dataclass(frozen=True)
class _StepResult:
    """What an algorithm step (4b) changed in the FP block."""

    info: dict  # recorded in the block's JSON under "awq" (per input group)
    fp_changed: dict[str, torch.Tensor]  # model name -> the changed FP tensor, fp16


_NO_STEP = _StepResult({}, {})


@dataclass(frozen=True)
class Algorithm:
    """How calibrate runs one algorithm, stage by stage (module docstring, stage 4)."""

    # 4a: also record the inputs of the family's inspected modules (AWQ's block-output loss)
    records_inputs: bool
    # 4a: keep a sample of each input group's rows (AWQ's clip search); the others need only
    # X^T X, and a 7B block's samples are hundreds of MB
    samples_rows: bool
    # 4b: changes the FP block before it is quantized (AWQ's scales); None: no step
    block_step: Callable[[CalibrateSpec, _BlockWork], _StepResult] | None
    # 4c: one linear -> its result: (spec, model name, W [out, in] fp32, H [in, in] fp32,
    # the layer's QuantSpec, a sample of its inputs [rows, in] fp32)
    quantize: Callable[..., QuantResult]
    # 4c: run with one thread. GPTQ runs many small column operations: with several OpenMP
    # threads each pays thread wake-ups (and spins when cores are shared), which costs far
    # more than the work itself (docs/algorithms.md); large matmuls keep all threads
    one_thread: bool
    # 4c-4d: leave the block's weights quantized, so that the next block's inputs go through
    # the quantized block (the original GPTQ ``llama_sequential``)
    quantized_forward: bool
    # CalibrateSpec defaults; None: the option does not apply and giving it is an error
    act_order_default: bool | None
    mse_clip_default: bool | None
    takes_static_groups: bool  # --static-groups / --dynamic-groups apply
    # 4a-4d GPTAQ: carry the FP model's block inputs beside the quantized model's; capture
    # each input group in the partly quantized block, paired with the FP inputs (dXXT)
    asymmetric: bool


def _quantize_gptq(spec: CalibrateSpec, name: str, W: torch.Tensor, H: torch.Tensor,
                   qspec: QuantSpec, x: torch.Tensor, solve=gptq) -> QuantResult:
    if qspec.group_size == -1 and not qspec.act_order:
        # One group per row: act-order only changes the order in which GPTQ walks the
        # columns (decreasing Hessian diagonal, so errors go to the columns that matter
        # least); every column keeps group 0, so no g_idx is stored and kernels and
        # formats see a plain per-channel layer, with a lower proxy loss (docs/algorithms.md)
        res = solve(W, H, QuantSpec(qspec.bits, -1, qspec.sym, act_order=True),
                    mse_clip=spec.mse_clip)
        w = res.weight
        assert w.g_idx is None
        res.weight = QuantizedWeight(qspec, w.q, w.scales, w.zeros, None)
        return res
    return solve(W, H, qspec, mse_clip=spec.mse_clip, static_groups=spec.static_groups)


@dataclass
class _AsymInputs:
    """GPTAQ's pairing of one input group: dXXT, and its correction per act_order (shared by
    the group's linears and both bit widths)."""

    dXXT: torch.Tensor  # [in, in] fp32: 2 (X_fp - X_q)^T X_q / tokens
    corrections: dict = field(default_factory=dict)  # calibration.gptq.gptaq's cache


def _quantize_gptaq(spec: CalibrateSpec, name: str, W: torch.Tensor, H: torch.Tensor,
                    qspec: QuantSpec, x: torch.Tensor, asym: _AsymInputs,
                    alpha: float = GPTAQ_ALPHA) -> QuantResult:
    if qspec.bits != 4:
        # the correction is for the INT4 model's input error (its blocks run the INT4 weights),
        # which an INT8 model does not have: corrected, its INT8 layers were several times
        # worse than GPTQ's (docs/algorithms.md); the INT8 result is GPTQ's on the same H
        return _quantize_gptq(spec, name, W, H, qspec, x)
    solve = functools.partial(gptaq, dXXT=asym.dXXT, corrections=asym.corrections,
                              alpha=alpha)
    return _quantize_gptq(spec, name, W, H, qspec, x, solve=solve)


def _quantize_rtn(spec: CalibrateSpec, name: str, W: torch.Tensor, H: torch.Tensor,
                  qspec: QuantSpec, x: torch.Tensor) -> QuantResult:
    return rtn(W, qspec, mse_clip=spec.mse_clip, H=H)


def _quantize_awq(spec: CalibrateSpec, name: str, W: torch.Tensor, H: torch.Tensor,
                  qspec: QuantSpec, x: torch.Tensor) -> QuantResult:
    return awq_quantize(name, W, qspec, x, H=H)


def _awq_step(spec: CalibrateSpec, work: _BlockWork) -> _StepResult:
    """AWQ's scales, searched and folded into the block; the changed tensors in fp16."""
    # compared under the FP16 folder's names (a MoE block's experts stacked back)
    before = {k: v.detach().clone() for k, v in fused_block_state(work.block,
                                                                    work.family).items()}
    norm_kind = "one_plus_norm" if work.model_type in ONE_PLUS_NORM_FAMILIES else "norm"
    info = scale_block(work.block, work.groups, work.stats, work.recorded, work.ctx.kwargs(),
                       lambda in_f: _layer_spec(spec, work.name, in_f), norm_kind)
    shared = moe_shared_input(work.family, work.groups)
    if shared is not None:  # MoE: every expert's (gate, up) scaled at once
        in_f = work.block.get_submodule(shared.linears[0]).in_features
        info[shared.key] = scale_shared_input(
            work.block, shared.linears, shared.prev_op, shared.compensate, shared.inspect,
            [work.stats[g] for g in shared.groups], work.recorded, work.ctx.kwargs(),
            _layer_spec(spec, work.name, in_f), norm_kind)
    changed = {f"{work.name}.{k}": to_host(v.detach().to(torch.float16)).clone()
               for k, v in fused_block_state(work.block, work.family).items()
               if not torch.equal(v, before[k])}
    return _StepResult(info, changed)


_GPTQ = Algorithm(records_inputs=False, samples_rows=False, block_step=None,
                  quantize=_quantize_gptq, one_thread=True, quantized_forward=True,
                  act_order_default=GPTQ_ACT_ORDER_DEFAULT, mse_clip_default=GPTQ_MSE_CLIP_DEFAULT,
                  takes_static_groups=True, asymmetric=False)
ALGORITHMS: dict[str, Algorithm] = {
    "gptq": _GPTQ,
    # GPTQ on ||W X_fp - Q X_q||^2 (calibration.gptq.gptaq): dense families only
    "gptaq": replace(_GPTQ, quantize=_quantize_gptaq, asymmetric=True),
    "awq": Algorithm(records_inputs=True, samples_rows=True,
                     block_step=_awq_step, quantize=_quantize_awq,
                     one_thread=False, quantized_forward=False,
                     act_order_default=None, mse_clip_default=None, takes_static_groups=False,
                     asymmetric=False),
    # AWQ's scales searched and folded, then GPTQ on the scaled weights, with the Hessians of
    # the scaled inputs (scale_block rescales the statistics it folds)
    "awq+gptq": replace(_GPTQ, records_inputs=True, samples_rows=True, block_step=_awq_step),
    # mse_clip off by default: RTN is the plain min-max baseline
    "rtn": Algorithm(records_inputs=False, samples_rows=False,
                     block_step=None, quantize=_quantize_rtn,
                     one_thread=False, quantized_forward=False,
                     act_order_default=None, mse_clip_default=False, takes_static_groups=False,
                     asymmetric=False),
}
# --algo's default (config.AUTO): GPTAQ, the best measured on held-out text
# (docs/algorithms.md), where it applies (dense models); GPTQ for mixture-of-experts models,
# which GPTAQ cannot pair. config.ALGOS lists AUTO and these names (a test checks it).
_AUTO_OPTIONS = "gptq"  # the options auto takes are GPTQ's (GPTAQ shares them)


def auto_algo(fp16_dir: Path) -> str:
    """What ``--algo auto`` runs for the model in ``fp16_dir``."""
    model_type = _read_config(Path(fp16_dir).expanduser()).get("model_type")
    return "gptq" if family_for(model_type).moe else "gptaq"


def calibrate(spec: CalibrateSpec) -> CalibrateResult:
    """Calibrate ``spec.fp16_dir`` into ``spec.out``: the stages of the module docstring."""
    t0 = time.perf_counter()
    spec = spec.resolved()  # the manifest and the resume fingerprint record concrete values
    inputs = _check_inputs(spec)  # 1
    run = _Run(spec, work_dir(spec.out), _resume_settings(spec, inputs.fp16_manifest))
    with output_lock(spec.out):  # 2
        clean_stale_temps(spec.out)
        check_output_dir(spec.out, spec.force)  # again: another run may have finished
        start = _prepare_work(run, inputs.num_blocks)
        try:
            data_summary, earlier_seconds = _earlier_progress(run, inputs, start)
            if start < inputs.num_blocks:
                _run_blocks(run, inputs, start, t0, earlier_seconds, data_summary)  # 3, 4
            result = _finish(run, inputs, data_summary,  # 5: the manifest
                             earlier_seconds + time.perf_counter() - t0, start)
        except BaseException:
            if not (run.work / "progress.json").is_file():  # nothing to resume from
                shutil.rmtree(run.work, ignore_errors=True)  # (made by _prepare_work)
            raise
        replace_dir(run.work, spec.out)  # 5: the finished folder replaces CALIB_DIR
        with contextlib.suppress(FileNotFoundError):  # the resume point, kept as a record
            os.replace(spec.out / "progress.json", spec.out / "blocks" / "progress-final.json")
        (spec.out / WORK_MARKER).unlink(missing_ok=True)  # a finished CALIB_DIR, no work folder
    return result


def _earlier_progress(run: _Run, inputs: _Inputs, start: int) -> tuple[dict, float]:
    """The data summary and the seconds of the run a resume continues (or this run's)."""
    if start == 0:
        return inputs.data_summary, 0.0
    progress = json.loads((run.work / "progress.json").read_text())
    # time spent before the kill counts in the manifest
    return progress.get("data", inputs.data_summary), float(progress.get("seconds", 0.0))


def _run_blocks(run: _Run, inputs: _Inputs, start: int, t0: float, earlier_seconds: float,
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
    # per-expert linears only once its weights are loaded, in _capture)
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
        _save_progress(run, 0, {"data": data_summary})
    for i in tqdm(range(start, len(blocks)), desc="calibrate", unit="block",
                  initial=start, total=len(blocks)):
        with stream.load(f"{family.blocks}.{i}", device=spec.device) as block:
            hiddens = _calibrate_block(run, block, i, family, model.config.model_type, hiddens,
                                       ctx.for_layer(i).to(spec.device), space)
        space.save(i + 1, hiddens, input_ids)
        _save_progress(run, i + 1, {"data": data_summary,
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


def _calibrate_block(run: _Run, block, i: int, family: Family, model_type: str,
                     hiddens: dict[str, Activations], ctx: BlockContext, space: ActivationSpace
                     ) -> dict[str, Activations]:
    """Stages 4a-4e of the module docstring for block ``i``; returns the next block's inputs
    (``hiddens``' keys: "hidden", and "hidden_fp" for GPTAQ; each [n, L, d])."""
    spec, algo = run.spec, ALGORITHMS[run.spec.algo]
    tb = time.perf_counter()
    name = f"{family.blocks}.{i}"
    if algo.asymmetric:  # 4a-4d, group by group
        results, raises, nxt = _asymmetric_block(spec, algo, block, name, model_type, family,
                                                 hiddens, ctx, seed=spec.seed + i,
                                                 out=lambda key: space.new(key, i + 1))
        step, expert_info = _NO_STEP, {}
    else:
        hidden = hiddens["hidden"]
        # the FP outputs are the next inputs unless the quantized block makes them (4d)
        fp_out = None if algo.quantized_forward else space.new("hidden", i + 1)
        work = _capture(spec, algo, block, name, model_type, family, hidden, ctx,
                        seed=spec.seed + i, out=fp_out)  # 4a
        step = algo.block_step(spec, work) if algo.block_step is not None else _NO_STEP  # 4b
        results, raises, expert_info = _quantize_block(spec, algo, work)  # 4c
        if algo.quantized_forward:
            _set_quantized_weights(block, name, results)
        nxt = {"hidden": run_block(block, hidden, ctx, spec.batch_size,
                                   out=space.new("hidden", i + 1))
               if algo.quantized_forward else work.fp_out}  # 4d
    save_block(run.work, i, results, step.fp_changed, {  # 4e (the caller saves nxt)
        "seconds": time.perf_counter() - tb, "awq": step.info, "damp_raises": raises,
        "device": spec.device, "batch_size": spec.batch_size, **expert_info,
    })
    return nxt


def _set_quantized_weights(block, name: str, results: dict[str, dict[int, QuantResult]]
                           ) -> None:
    """Every quantized linear of ``block`` gets its dequantized INT4 weight back for the
    quantized forward (4d): _quantize_block freed each fp32 weight once quantized, so a 7B
    block does not hold all its linears in fp32 while GPTQ factors the largest Hessian.
    The results are on the CPU already (4c): each weight is dequantized there and moved to
    the block's device (the emptied weight kept its device)."""
    for full, by_bits in results.items():
        lin = block.get_submodule(full[len(name) + 1:])
        lin.weight.data = to_device(by_bits[4].weight.dequantize(lin.weight.dtype),
                                    lin.weight.device)


def _asymmetric_block(spec: CalibrateSpec, algo: Algorithm, block, name: str, model_type: str,
                      family: Family, hiddens: dict[str, Activations], ctx: BlockContext,
                      seed: int, out: Callable[[str], Activations]
                      ) -> tuple[dict, int, dict[str, Activations]]:
    """GPTAQ's stages 4a-4d: the FP block over the FP model's inputs records every group's
    inputs (and gives the next FP inputs); then, per input group in execution order, its
    inputs in the block with the earlier groups quantized, over the quantized model's inputs,
    are paired with the FP ones (H and dXXT) and the group is quantized; last, the quantized
    block gives the next inputs.

    Only q/k/v's and o_proj's inputs need a pass through the block (each ends at its group,
    StopForward). o_proj's and down_proj's inputs are kept: with the linears before them
    quantized they are those of every later pass, so the later passes start from them (the
    decoder layer's residual adds, :func:`attention_residual` / :func:`mlp_residual`) instead
    of running the attention again, and the next inputs are computed from down_proj's."""
    groups = block_groups(family, block)
    # a dense block's input groups, in execution order (GPTAQ refuses MoE families)
    attn_in, attn_o, mlp_in, mlp_down = groups
    recorder = GroupInputRecorder(block, groups)  # the FP inputs: [tokens, in] per call
    try:
        fp_out = run_block(block, hiddens["hidden_fp"], ctx, spec.batch_size,
                           out=out("hidden_fp"))  # [n, L, d]
    finally:
        recorder.remove()
    hidden = hiddens["hidden"]  # the quantized model's block inputs [n, L, d]
    device = module_device(block)
    results: dict[str, dict[int, QuantResult]] = {}
    raises = 0

    def quantize_group(group: InputGroup, passes: Callable[[], None], keep: bool = False
                       ) -> list[torch.Tensor] | None:
        """Run ``passes`` with the statistics hooks of ``group`` and quantize it; with
        ``keep``, the group's inputs of every call ([..., in] each, in call order)."""
        nonlocal raises
        collector = StatsCollector(block, (group,), sample_rows=0, seed=seed,
                                   fp_inputs=recorder.inputs, stop=True, keep_inputs=keep)
        try:
            passes()
        finally:
            collector.remove()
        assert not recorder.inputs[group], "every FP input must be paired"
        work = _BlockWork(block, name, model_type, family, (group,), ctx, collector.stats, {},
                          fp_out)
        group_results, group_raises, _ = _quantize_block(spec, algo, work)  # 4c
        results.update(group_results)
        raises += group_raises
        return collector.kept[group] if keep else None

    def block_pass() -> None:  # ends at the group's hook
        run_block(block, hidden, ctx, spec.batch_size, keep=False)

    quantize_group(attn_in, block_pass)
    # per batch [b, L, attn] (q/k/v quantized)
    x_o = quantize_group(attn_o, block_pass, keep=True)
    o_proj = block.get_submodule(attn_o.linears[0])  # quantized from here on
    mlp, mlp_norm = block.get_submodule(family.mlp), block.get_submodule(family.mlp_in_norm)

    def after_attention() -> Iterator[tuple[int, int, torch.Tensor]]:
        """(batch index, first sample, the first residual add [b, L, d]) per batch."""
        for k, (a, h) in enumerate(batches(hidden, spec.batch_size, device)):
            yield k, a, attention_residual(block, family, h, o_proj(x_o[k]))

    def mlp_pass() -> None:  # ends at the group's hook inside the MLP
        with torch.no_grad():
            for _, _, h in after_attention():
                run_until_stopped(mlp, mlp_norm(h))

    quantize_group(mlp_in, mlp_pass)
    # per batch [b, L, mlp] (gate/up quantized)
    x_down = quantize_group(mlp_down, mlp_pass, keep=True)
    down_proj = block.get_submodule(mlp_down.linears[0])
    nxt = out("hidden")  # 4d: the quantized block's outputs, from down_proj's inputs
    with torch.no_grad():
        for k, a, h in after_attention():
            nxt.write(a, mlp_residual(block, family, h, down_proj(x_down[k])))
    nxt.commit()
    return results, raises, {"hidden": nxt, "hidden_fp": fp_out}


def _capture(spec: CalibrateSpec, algo: Algorithm, block, name: str, model_type: str,
             family: Family, hidden: Activations, ctx: BlockContext, seed: int,
             out: Activations | None) -> _BlockWork:
    """Run the FP block over its inputs hidden [n, L, d] with the capture hooks; its outputs
    go to ``out`` (None: not kept)."""
    groups = block_groups(family, block)  # MoE: splits the experts (hooks see routed rows)
    collector = StatsCollector(block, groups, seed=seed,
                               **({} if algo.samples_rows else {"sample_rows": 0}))
    recorder = None
    if algo.records_inputs:
        inspect_names = list(dict.fromkeys(g.inspect for g in groups if g.inspect))
        recorder = InputRecorder(block, inspect_names, spec.awq_samples)
    try:
        fp_out = run_block(block, hidden, ctx, spec.batch_size, out=out,
                           keep=out is not None)  # [n, L, d]
    finally:
        collector.remove()
        if recorder is not None:
            recorder.remove()
    return _BlockWork(block, name, model_type, family, groups, ctx, collector.stats,
                      recorder.inputs if recorder is not None else {}, fp_out)


def _quantize_block(spec: CalibrateSpec, algo: Algorithm, work: _BlockWork):
    """INT4 and INT8 results for every linear of the block (on the CPU: each comes back from
    the block's device once made), the damping raises, and (MoE) the tokens routed to each
    expert with the experts that fell back to RTN."""
    threads = torch.get_num_threads()
    if algo.one_thread and is_cpu(spec.device):  # OpenMP threads: a CPU matter only
        torch.set_num_threads(1)
    results: dict[str, dict[int, QuantResult]] = {}
    raises = 0
    tokens: dict[str, int] = {}  # expert linear -> rows routed to it
    fallbacks: dict[str, int] = {}  # the same, for experts below spec.min_expert_tokens
    try:
        for group in work.groups:
            stats = work.stats.pop(group)  # freed with H once the group is quantized
            H = stats.take_hessian()  # [in, in] fp32
            x = stats.x_sample()  # [rows, in] fp32 ([0, in] unless algo.samples_rows)
            extra = {"asym": _AsymInputs(stats.take_dxxt())} if algo.asymmetric else {}
            quantize = algo.quantize
            if is_expert_group(work.family, group):
                tokens.update({f"{work.name}.{n}": stats.tokens for n in group.linears})
                if stats.tokens < spec.min_expert_tokens:
                    fallbacks.update({f"{work.name}.{n}": stats.tokens for n in group.linears})
                    quantize = _quantize_fallback
            for lin_name in group.linears:
                full = f"{work.name}.{lin_name}"
                lin = work.block.get_submodule(lin_name)
                W = lin.weight.data.float()  # [out, in]
                q4 = _layer_spec(spec, full, lin.in_features)
                r4 = quantize(spec, full, W, H, q4, x, **extra)
                r8 = quantize(spec, full, W, H, INT8_PER_CHANNEL, x, **extra)
                raises += r4.damp_raises + r8.damp_raises
                del W
                if algo.asymmetric:  # GPTAQ's next groups run the block with it quantized
                    lin.weight.data = r4.weight.dequantize(lin.weight.dtype)
                elif algo.quantized_forward:  # not needed again until the quantized forward
                    lin.weight.data = lin.weight.data.new_empty(0)  # (4d): its fp32 freed
                results[full] = {4: result_to_host(r4), 8: result_to_host(r8)}
    finally:
        torch.set_num_threads(threads)
    if fallbacks:
        log.warning("%s: %d expert linear(s) got fewer than %d calibration tokens; quantized "
                    "with %s (recorded in the block's expert_fallbacks)", work.name,
                    len(fallbacks), spec.min_expert_tokens, FALLBACK)
    expert_info = {"expert_tokens": tokens, "expert_fallbacks": fallbacks} if tokens else {}
    return results, raises, expert_info


def _quantize_fallback(spec: CalibrateSpec, name: str, W: torch.Tensor, H: torch.Tensor,
                       qspec: QuantSpec, x: torch.Tensor) -> QuantResult:
    return fallback_quantize(W, qspec, H)


def _log_group_sizes(spec: CalibrateSpec, group_sizes: dict[str, int],
                     fallbacks: dict[str, int]) -> None:
    """Say what the INT4 group sizes are: a plan (the default) or, where an explicit
    --group-size did not divide a layer, a substitution the user should know about."""
    if fallbacks:
        log.warning("--group-size %d does not divide the in_features of %d layer(s); used %s "
                    "there (recorded per layer; --strict-group-size makes it an error)",
                    spec.group_size, len(fallbacks), sorted(set(fallbacks.values())))
    elif spec.group_size is None:
        counts = Counter(group_sizes.values())
        log.info("INT4 group sizes (auto, planned per layer): %s",
                 ", ".join(f"{gs} on {n} layer(s)" for gs, n in sorted(counts.items())))


def _finish(run: _Run, inputs: _Inputs, data_summary: dict, seconds: float,
            start: int) -> CalibrateResult:
    """Write the manifest (last file; it marks the folder valid) and drop the resume state."""
    spec = run.spec
    peak = _peak_rss_mb()
    # after a resume, this process saw only some blocks: the block files are the record
    fallbacks, total_raises, expert_fallbacks, group_sizes = {}, 0, {}, {}
    devices: dict[str, int] = {}  # device -> blocks calibrated there (a resume may switch)
    batch_sizes: dict[int, int] = {}  # batch size -> blocks (a resume may switch)
    for j in range(inputs.num_blocks):
        info = json.loads(block_file(run.work, j, "json").read_text())
        total_raises += int(info.get("damp_raises", 0))
        device = info.get("device", "cpu")  # blocks written before --device ran on the CPU
        devices[device] = devices.get(device, 0) + 1
        size = int(info.get("batch_size", spec.batch_size))  # blocks written before it counted
        batch_sizes[size] = batch_sizes.get(size, 0) + 1
        expert_fallbacks.update(info.get("expert_fallbacks", {}))
        for name, layer in info["layers"].items():
            gs = group_sizes[name] = layer["w4"]["spec"]["group_size"]
            if spec.group_size is not None and gs != spec.group_size:
                fallbacks[name] = gs
    _log_group_sizes(spec, group_sizes, fallbacks)
    write_manifest(
        run.work,
        stage="calibration",
        fp16_dir=str(spec.fp16_dir),
        fp16_shards=[{"file": s["file"], "sha256": s["sha256"]}
                     for s in inputs.fp16_manifest["shards"]],
        model_type=inputs.model_type,
        num_blocks=inputs.num_blocks,
        block_prefix=family_for(inputs.model_type).blocks,
        algo=spec.algo,
        int4=spec.int4.to_dict(),
        int8=INT8_PER_CHANNEL.to_dict(),
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(spec).items()},
        clip_search=clip_search_settings(),
        data=data_summary,
        int4_group_sizes=group_sizes,  # per layer, as planned (and fallen back)
        group_size_fallbacks=fallbacks,  # only where an explicit --group-size did not divide
        damp_raises=total_raises,
        devices=devices,
        batch_sizes={str(k): v for k, v in sorted(batch_sizes.items())},
        **({"expert_fallbacks": expert_fallbacks,
            "min_expert_tokens": spec.min_expert_tokens}
           if family_for(inputs.model_type).moe else {}),
        seconds=seconds,
        peak_rss_mb=peak,
    )
    shutil.rmtree(run.work / "state", ignore_errors=True)
    return CalibrateResult(spec.out, seconds, peak, fallbacks, total_raises, start,
                           expert_fallbacks)
