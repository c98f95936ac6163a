"""`quantpipe calibrate`: layer-sequential calibration of every decoder block.

For each block, in order:
1. run it over the cached block inputs with hooks that gather each input group's statistics
   (GPTQ Hessian, mean |x|, a token sample) and, for AWQ, the inputs of the inspected modules;
2. AWQ only: search and fold the per-channel scales group by group (arXiv 2306.00978, sec. 3.2);
3. quantize every linear at INT4 (the requested spec) and INT8 (per channel) with the chosen
   algorithm; record losses and numerical fallbacks;
4. compute the next block's inputs: through the INT4-quantized block for GPTQ (the original
   ``llama_sequential`` propagates quantized outputs), through the FP block otherwise;
5. save the block's results and the next inputs, so a killed run resumes from here.

Data safety: every option and input (FP16 manifest, config and shard hashes, group size
against every layer, prompts and their token count) is checked before CALIB_DIR is touched.
The run holds CALIB_DIR's output lock (quantpipe.core.io) and builds the calibration in the hidden
work folder beside it (calibration.artifact.work_dir), which holds the resume state; the
finished folder replaces CALIB_DIR only at the end.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm

from quantpipe.calibration.artifact import block_file, save_block, work_dir
from quantpipe.calibration.awq import awq_clip_search, awq_search_scales, fold_scales
from quantpipe.calibration.capture import (
    BlockContext,
    InputRecorder,
    StatsCollector,
    embed_inputs,
    run_block,
)
from quantpipe.calibration.families import (
    ONE_PLUS_NORM_FAMILIES,
    Family,
    block_linear_names,
    family_for,
    get_blocks,
)
from quantpipe.calibration.gptq import gptq
from quantpipe.calibration.prompts import SHIPPED_SETS
from quantpipe.calibration.result import QuantResult
from quantpipe.calibration.rtn import rtn
from quantpipe.calibration.stream import ModelStream
from quantpipe.core.io import (
    check_not_overlapping,
    check_output_dir,
    clean_stale_temps,
    output_lock,
    read_manifest,
    replace_dir,
    save_safetensors_atomic,
    verify_shard_hashes,
    write_json_atomic,
    write_manifest,
)
from quantpipe.core.qformat import INT8_PER_CHANNEL, QuantizedWeight, QuantSpec, resolve_group_size

log = logging.getLogger(__name__)

ALGOS = ("gptq", "awq", "rtn")
# GPTQ walks columns by decreasing Hessian diagonal unless told otherwise (--no-act-order);
# with static groups this changes no stored layout (docs/algorithms.md has the measurements)
GPTQ_ACT_ORDER_DEFAULT = True
# GPTQ searches each group's clipping range (diag(H)-weighted error) unless --no-mse-clip
GPTQ_MSE_CLIP_DEFAULT = True
# INT4 group sizes calibrate accepts: -1 (one group per output row) or powers of two that
# every writer stores and every kernel runs (quantpipe's CPU kernel needs multiples of 16,
# torch's int4pack 32..256, Triton any size; other sizes take the dequantize path)
GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)


def check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size {group_size} is not supported; use one of "
                         f"{', '.join(map(str, GROUP_SIZES))} (-1: per output channel)")


@dataclass(frozen=True)
class CalibrateSpec:
    fp16_dir: Path  # output of export-fp16
    out: Path  # CALIB_DIR
    prompts: str = "business-calib"  # prompt file, or a shipped set name
    column: str | None = None  # text column for CSV/TSV/parquet prompt files
    algo: str = "gptq"  # gptq | awq | rtn
    group_size: int = 128  # INT4 group size requested (falls back per layer, see below)
    sym: bool = True  # INT4 symmetric (mid-point zero) or asymmetric
    # GPTQ: process columns by decreasing Hessian diagonal; None = GPTQ_ACT_ORDER_DEFAULT
    act_order: bool | None = None
    # RTN/GPTQ: search a clipping range per group (weighted by diag(H) for GPTQ);
    # None = GPTQ_MSE_CLIP_DEFAULT for GPTQ, off for RTN (the plain min-max baseline)
    mse_clip: bool | None = None
    strict_group_size: bool = False  # error instead of falling back to a smaller group size
    samples: int = 128  # calibration sequences
    seq_len: int = 512  # tokens per sequence
    min_tokens: int = 16  # drop prompts shorter than this
    seed: int = 0
    batch_size: int = 8  # sequences per block forward
    awq_samples: int = 16  # sequences used by AWQ's scale search (block-output loss)
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

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"--algo {self.algo!r} is not supported; use one of {ALGOS}")
        check_group_size(self.group_size)
        if self.act_order and self.algo != "gptq":
            raise ValueError("--act-order applies to GPTQ only; drop it or use --algo gptq")
        if self.mse_clip and self.algo == "awq":
            raise ValueError("--mse-clip applies to RTN and GPTQ; AWQ runs its own clip search")
        if self.static_groups is not None and self.algo != "gptq":
            raise ValueError("--static-groups/--dynamic-groups apply to GPTQ only; drop it or "
                             "use --algo gptq")
        lowest = {"samples": 1, "seq_len": 2, "min_tokens": 1, "seed": 0, "batch_size": 1,
                  "awq_samples": 1}
        for name, low in lowest.items():
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low} "
                                 f"(got {getattr(self, name)})")

    def resolved(self) -> CalibrateSpec:
        """The same spec with every default (None) replaced by the value it stands for, and
        the input paths resolved (so a relative and an absolute path resume the same run)."""
        gptq_algo = self.algo == "gptq"
        act_order = self.act_order if self.act_order is not None else (
            gptq_algo and GPTQ_ACT_ORDER_DEFAULT)
        static = self.static_groups if self.static_groups is not None else (
            act_order if gptq_algo else None)
        mse = self.mse_clip if self.mse_clip is not None else (
            gptq_algo and GPTQ_MSE_CLIP_DEFAULT)
        prompts = self.prompts
        if prompts not in SHIPPED_SETS and Path(prompts).expanduser().exists():
            prompts = str(Path(prompts).expanduser().resolve())
        return replace(self, fp16_dir=Path(self.fp16_dir).expanduser().resolve(),
                       prompts=prompts, act_order=act_order, static_groups=static, mse_clip=mse)

    @property
    def int4(self) -> QuantSpec:
        return QuantSpec(4, self.group_size, self.sym, bool(self.resolved().act_order))

    def resume_settings(self) -> dict[str, str]:
        """The settings that must match for a partial run to resume (paths resolved)."""
        return {k: str(v) for k, v in asdict(self.resolved()).items()
                if k not in ("out", "force")}

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
    names = block_linear_names(family)
    pattern = re.compile(rf"{re.escape(family.blocks)}\.(\d+)\.(.+)\.weight")
    found: dict[tuple[int, int], tuple[str, int]] = {}  # (block, linear) -> (name, in)
    for entry in manifest["shards"]:
        with safe_open(str(fp16_dir / entry["file"]), framework="pt") as f:
            for key in f.keys():
                m = pattern.fullmatch(key)
                if m and m.group(2) in names:
                    in_f = int(f.get_slice(key).get_shape()[1])  # weight: [out, in]
                    found[int(m.group(1)), names.index(m.group(2))] = (key[: -len(".weight")], in_f)
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
    """
    gs = spec.group_size
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
    from transformers import AutoTokenizer

    from quantpipe.calibration.prompts import (
        CalibDataSpec,
        build_calibration_set,
        load_prompt_records,
    )

    prompts_path = None if spec.prompts in SHIPPED_SETS else spec.prompts
    check_not_overlapping(spec.out, {"FP16_DIR": spec.fp16_dir, "--prompts": prompts_path})
    check_output_dir(spec.out, spec.force)
    records = load_prompt_records(spec.prompts, column=spec.column)
    manifest = read_manifest(spec.fp16_dir, "fp16")
    config = _read_config(spec.fp16_dir)
    family = family_for(config.get("model_type"))
    verify_shard_hashes(spec.fp16_dir, manifest["shards"])  # reads every byte: logged at -v
    in_features, num_blocks = _linear_in_features(spec.fp16_dir, manifest, family)
    for name, in_f in in_features.items():
        layer_group_size(spec, name, in_f)
    max_pos = config.get("max_position_embeddings")
    if max_pos and spec.seq_len > max_pos:
        raise ValueError(f"--seq-len {spec.seq_len} is above the model's "
                         f"max_position_embeddings {max_pos}; use at most {max_pos}")
    calib = build_calibration_set(
        AutoTokenizer.from_pretrained(spec.fp16_dir), records,
        CalibDataSpec(n_samples=spec.samples, seq_len=spec.seq_len,
                      min_tokens=spec.min_tokens, seed=spec.seed),
    )
    assert torch.is_tensor(calib.input_ids), "pack mode returns one [n, seq_len] tensor"
    return _Inputs(manifest, config["model_type"], num_blocks, calib.input_ids,
                   asdict(calib.summary))


def _resume_settings(spec: CalibrateSpec, fp16_manifest: dict) -> dict[str, str]:
    shards = json.dumps([[s["file"], s["sha256"]] for s in fp16_manifest["shards"]])
    return {**spec.resume_settings(),
            "fp16_shards": hashlib.sha256(shards.encode()).hexdigest()[:16]}


def _differences(before: dict, now: dict) -> list[str]:
    keys = sorted((set(before) | set(now)) - {"out", "force"})
    return [f"{k}: {before.get(k)!r} before, {now.get(k)!r} now"
            for k in keys if before.get(k) != now.get(k)]


def _prepare_work(run: _Run, num_blocks: int) -> int:
    """Find the resume point in the work folder, or start it afresh; returns the first block.

    Same settings: resume (with or without --force). Other settings: an error naming them,
    or with --force the unfinished run is discarded. CALIB_DIR itself is never touched here.
    """
    progress = run.work / "progress.json"
    if progress.is_file():
        state = json.loads(progress.read_text())
        diffs = _differences(state.get("spec", {}), run.settings)
        nxt = int(state["next_block"])
        has_state = (run.work / "state" / "hidden.safetensors").is_file()
        if not diffs and (has_state or nxt >= num_blocks):
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
    return 0


def _save_progress(run: _Run, next_block: int, extra: dict) -> None:
    write_json_atomic(
        run.work / "progress.json",
        {"fingerprint": run.spec.fingerprint(), "next_block": next_block,
         "spec": run.settings, **extra},
    )


def _layer_spec(spec: CalibrateSpec, name: str, in_features: int,
                fallbacks: dict[str, int]) -> QuantSpec:
    gs = layer_group_size(spec, name, in_features)
    if gs != spec.group_size:
        fallbacks[name] = gs
    return spec.int4.with_group_size(gs)


def _quantize(spec: CalibrateSpec, W: torch.Tensor, H: torch.Tensor, qspec: QuantSpec,
              clip_x: torch.Tensor | None) -> QuantResult:
    """One linear, one spec, with the chosen algorithm. W: [out, in] fp32, H: [in, in] fp32."""
    if spec.algo == "gptq":
        if qspec.group_size == -1 and not qspec.act_order:
            # One group per row: act-order only changes the order in which GPTQ walks the
            # columns (decreasing Hessian diagonal, so errors go to the columns that matter
            # least); every column keeps group 0, so no g_idx is stored and kernels and
            # formats see a plain per-channel layer. ~2.5x lower proxy loss on INT8.
            res = gptq(W, H, QuantSpec(qspec.bits, -1, qspec.sym, act_order=True),
                       mse_clip=spec.mse_clip)
            w = res.weight
            assert w.g_idx is None
            res.weight = QuantizedWeight(qspec, w.q, w.scales, w.zeros, None)
            return res
        return gptq(W, H, qspec, mse_clip=spec.mse_clip, static_groups=spec.static_groups)
    if spec.algo == "rtn":
        return rtn(W, qspec, mse_clip=spec.mse_clip, H=H)
    if spec.algo == "awq":
        # q/k: llm-awq does not clip them (attention scores are sensitive); INT8's grid is
        # fine enough that clipping buys nothing measurable and its search costs as much
        if clip_x is None or qspec.bits == 8:
            return rtn(W, qspec, H=H)
        max_val = awq_clip_search(W, clip_x, qspec)
        return rtn(W, qspec, H=H, clip=max_val)
    raise ValueError(f"unknown algorithm {spec.algo!r}")


def _awq_block(block, family: Family, model_type: str, collector: StatsCollector,
               recorder: InputRecorder, ctx: BlockContext, spec_for) -> dict:
    """Search and fold AWQ scales for each input group of one block (in place)."""
    info = {}
    prev_kind_norm = "one_plus_norm" if model_type in ONE_PLUS_NORM_FAMILIES else "norm"
    for group in family.groups:
        st = collector.stats[group]
        linears = [block.get_submodule(n) for n in group.linears]
        prev = block.get_submodule(group.prev_op)
        is_norm = not isinstance(prev, torch.nn.Linear)
        if not is_norm and prev.out_features != linears[0].in_features:
            info[group.linears[0]] = {"skipped": f"{group.prev_op} -> {group.linears} shapes "
                                      "differ (grouped-query attention)"}
            continue
        weights = [lin.weight.data.float() for lin in linears]
        if group.inspect:
            module = block.get_submodule(group.inspect)
            x_in = recorder.get(group.inspect)  # [n, L, d]
            with torch.no_grad():
                ref = _run_inspect(module, x_in, ctx)

            def loss_fn(candidates, module=module, linears=linears, x_in=x_in, ref=ref):
                saved = [lin.weight.data for lin in linears]
                try:
                    for lin, w in zip(linears, candidates):
                        lin.weight.data = w.to(saved[0].dtype)
                    with torch.no_grad():
                        out = _run_inspect(module, x_in, ctx)
                finally:
                    for lin, w in zip(linears, saved):
                        lin.weight.data = w
                return float((out - ref).float().pow(2).mean())
        else:
            x = st.x_sample()  # [rows, in]
            ref = x @ weights[0].T  # [rows, out]

            def loss_fn(candidates, x=x, ref=ref):
                return float((x @ candidates[0].T - ref).pow(2).mean())

        res = awq_search_scales(st.x_absmean, weights, spec_for(linears[0].in_features),
                                loss_fn)
        s = res.scales  # [in]
        prev_w = prev.weight.data.float()
        prev_b = prev.bias.data.float() if getattr(prev, "bias", None) is not None else None
        folded = fold_scales(prev_w, prev_kind_norm if is_norm else "linear", weights, s, prev_b)
        prev.weight.data = folded.prev_weight.to(prev.weight.dtype)
        if prev_b is not None:
            prev.bias.data = folded.prev_bias.to(prev.bias.dtype)
        for lin, w in zip(linears, folded.weights):
            lin.weight.data = w.to(lin.weight.dtype)
        # the group's input is now x / s: keep statistics in the new coordinates
        st.xtx /= (s[:, None] * s[None, :]).double()
        st.abs_sum /= s.double()
        st.sample = [t / s for t in st.sample]
        if group.inspect:
            recorder.inputs[group.inspect] = [t / s for t in recorder.inputs[group.inspect]]
        info[group.linears[0]] = {"ratio": res.ratio, "loss_s1": res.losses[0],
                                  "loss_best": min(res.losses)}
    return info


def _run_inspect(module, x: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
    if isinstance(module, torch.nn.Linear) or not hasattr(module, "q_proj"):
        out = module(x)
    else:  # attention needs the positions and the mask
        out = module(hidden_states=x, **ctx.kwargs())
    return out[0] if isinstance(out, tuple) else out


def _quantize_block(spec: CalibrateSpec, block, family: Family, collector: StatsCollector,
                    prefix: str, i: int, fallbacks: dict[str, int]):
    """INT4 and INT8 results for every linear of block ``i`` (GPTQ: weights left quantized)."""
    results: dict[str, dict[int, QuantResult]] = {}
    raises = 0
    for group in family.groups:
        H = collector.stats[group].H  # [in, in] fp32
        x_clip = collector.stats[group].x_sample()  # [rows, in]
        for lin_name in group.linears:
            full = f"{prefix}.{i}.{lin_name}"
            lin = block.get_submodule(lin_name)
            W = lin.weight.data.float()  # [out, in]
            q4 = _layer_spec(spec, full, lin.in_features, fallbacks)
            clip_x = None if lin_name.endswith(("q_proj", "k_proj")) else x_clip
            r4 = _quantize(spec, W, H, q4, clip_x)
            r8 = _quantize(spec, W, H, INT8_PER_CHANNEL, clip_x)
            results[full] = {4: r4, 8: r8}
            raises += r4.damp_raises + r8.damp_raises
            if spec.algo == "gptq":  # the next block sees this block's quantized outputs
                lin.weight.data = r4.weight.dequantize(lin.weight.dtype)
    return results, raises


def calibrate(spec: CalibrateSpec) -> CalibrateResult:
    """Calibrate ``spec.fp16_dir`` into ``spec.out`` (see the module docstring)."""
    t0 = time.perf_counter()
    spec = spec.resolved()  # the manifest and the resume fingerprint record concrete values
    inputs = _check_inputs(spec)
    run = _Run(spec, work_dir(spec.out), _resume_settings(spec, inputs.fp16_manifest))
    with output_lock(spec.out):
        clean_stale_temps(spec.out)
        check_output_dir(spec.out, spec.force)  # again: another run may have finished
        start = _prepare_work(run, inputs.num_blocks)
        try:
            result = _calibrate_into_work(run, inputs, start, t0)
        except BaseException:
            if not (run.work / "progress.json").is_file():
                shutil.rmtree(run.work, ignore_errors=True)  # nothing to resume from
            raise
        replace_dir(run.work, spec.out)
        with contextlib.suppress(FileNotFoundError):  # the resume point, kept as a record
            os.replace(spec.out / "progress.json", spec.out / "blocks" / "progress-final.json")
    return result


def _calibrate_into_work(run: _Run, inputs: _Inputs, start: int, t0: float) -> CalibrateResult:
    data_summary, earlier_seconds = inputs.data_summary, 0.0
    if start > 0:
        progress = json.loads((run.work / "progress.json").read_text())
        data_summary = progress.get("data", data_summary)
        earlier_seconds = float(progress.get("seconds", 0.0))  # time spent before the kill
    if start < inputs.num_blocks:
        _run_blocks(run, inputs, start, t0, earlier_seconds, data_summary)
    return _finish(run, inputs, data_summary, earlier_seconds + time.perf_counter() - t0, start)


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
    blocks = get_blocks(model, family)
    if len(blocks) != inputs.num_blocks:
        raise ValueError(f"{spec.fp16_dir}: config.json describes {len(blocks)} blocks, the "
                         f"shards hold {inputs.num_blocks}; re-run export-fp16")
    state_file = run.work / "state" / "hidden.safetensors"
    embed_name = _embeddings_name(model)
    with stream.load(embed_name):
        if start == 0:
            input_ids = inputs.input_ids  # [n, L] int64
            hidden, ctx = embed_inputs(model, input_ids)  # [n, L, d]
        else:
            saved = load_file(str(state_file))
            hidden, input_ids = saved["hidden"], saved["input_ids"]
            _, ctx = embed_inputs(model, input_ids[:1])  # the shared context only
    if start == 0:
        state_file.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors_atomic({"hidden": hidden, "input_ids": input_ids}, state_file)
        _save_progress(run, 0, {"data": data_summary})
    for i in tqdm(range(start, len(blocks)), desc="calibrate", unit="block",
                  initial=start, total=len(blocks)):
        with stream.load(f"{family.blocks}.{i}") as block:
            hidden = _calibrate_block(run, block, i, family, model.config.model_type, hidden,
                                      ctx)
        save_safetensors_atomic({"hidden": hidden, "input_ids": input_ids}, state_file)
        _save_progress(run, i + 1, {"data": data_summary,
                                    "seconds": earlier_seconds + time.perf_counter() - t0})


def _embeddings_name(model: torch.nn.Module) -> str:
    emb = model.get_input_embeddings()
    return next(name for name, m in model.named_modules() if m is emb)


def _calibrate_block(run: _Run, block, i: int, family: Family, model_type: str,
                     hidden: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
    """Steps 1-5 of the module docstring for block ``i``; returns the next block's inputs."""
    spec, prefix = run.spec, family.blocks
    tb = time.perf_counter()
    collector = StatsCollector(block, family.groups, seed=spec.seed + i)
    inspect_names = [g.inspect for g in family.groups if g.inspect]
    recorder = (InputRecorder(block, inspect_names, spec.awq_samples)
                if spec.algo == "awq" else None)
    fp_out = run_block(block, hidden, ctx, spec.batch_size)  # [n, L, d]
    collector.remove()
    if recorder is not None:
        recorder.remove()
    awq_info: dict = {}
    fp_changed: dict[str, torch.Tensor] = {}
    if spec.algo == "awq":
        before = {k: v.detach().clone() for k, v in block.state_dict().items()}
        awq_info = _awq_block(block, family, model_type, collector, recorder, ctx,
                              lambda in_f: _layer_spec(spec, f"{prefix}.{i}", in_f, {}))
        for k, v in block.state_dict().items():
            if not torch.equal(v, before[k]):
                fp_changed[f"{prefix}.{i}.{k}"] = v.detach().to(torch.float16).clone()
    # GPTQ runs many small column operations: with several OpenMP threads each one pays
    # thread wake-ups (and spins when cores are shared), which was measured to cost 20x
    # the work itself on 2 cores. Large forwards keep all threads.
    threads = torch.get_num_threads()
    if spec.algo == "gptq":  # AWQ's clip search is large matmuls: keep all threads
        torch.set_num_threads(1)
    try:
        results, block_raises = _quantize_block(spec, block, family, collector, prefix, i, {})
    finally:
        torch.set_num_threads(threads)
    # GPTQ: the next block sees this block's quantized outputs
    next_hidden = run_block(block, hidden, ctx, spec.batch_size) if spec.algo == "gptq" else fp_out
    save_block(run.work, i, results, fp_changed, {
        "seconds": time.perf_counter() - tb, "awq": awq_info, "damp_raises": block_raises,
    })
    return next_hidden


def _finish(run: _Run, inputs: _Inputs, data_summary: dict, seconds: float,
            start: int) -> CalibrateResult:
    """Write the manifest (last file; it marks the folder valid) and drop the resume state."""
    spec = run.spec
    peak = _peak_rss_mb()
    # after a resume, this process saw only some blocks: the block files are the record
    fallbacks, total_raises = {}, 0
    for j in range(inputs.num_blocks):
        info = json.loads(block_file(run.work, j, "json").read_text())
        total_raises += int(info.get("damp_raises", 0))
        for name, layer in info["layers"].items():
            gs = layer["w4"]["spec"]["group_size"]
            if gs != spec.group_size:
                fallbacks[name] = gs
    if fallbacks:
        sizes = sorted(set(fallbacks.values()))
        log.warning("group size %d does not fit %d layer(s); used %s there "
                    "(recorded per layer)", spec.group_size, len(fallbacks), sizes)
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
        data=data_summary,
        group_size_fallbacks=fallbacks,
        damp_raises=total_raises,
        seconds=seconds,
        peak_rss_mb=peak,
    )
    shutil.rmtree(run.work / "state", ignore_errors=True)
    return CalibrateResult(spec.out, seconds, peak, fallbacks, total_raises, start)
