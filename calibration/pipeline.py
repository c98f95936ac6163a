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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from calibration.artifact import block_file, save_block
from calibration.awq import awq_clip_search, awq_search_scales, fold_scales
from calibration.capture import (
    BlockContext,
    InputRecorder,
    StatsCollector,
    embed_inputs,
    run_block,
)
from calibration.families import ONE_PLUS_NORM_FAMILIES, Family, family_for, get_blocks
from calibration.gptq import gptq
from calibration.result import QuantResult
from calibration.rtn import rtn
from quantpipe.io import (
    MANIFEST_NAME,
    OutputExistsError,
    read_manifest,
    save_safetensors_atomic,
    write_json_atomic,
    write_manifest,
)
from quantpipe.qformat import INT8_PER_CHANNEL, QuantizedWeight, QuantSpec, resolve_group_size

log = logging.getLogger(__name__)

ALGOS = ("gptq", "awq", "rtn")
# GPTQ walks columns by decreasing Hessian diagonal unless told otherwise (--no-act-order);
# with static groups this changes no stored layout (docs/algorithms.md has the measurements)
GPTQ_ACT_ORDER_DEFAULT = True
# GPTQ searches each group's clipping range (diag(H)-weighted error) unless --no-mse-clip
GPTQ_MSE_CLIP_DEFAULT = True


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
    force: bool = False  # discard an existing CALIB_DIR

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"--algo {self.algo!r} is not supported; use one of {ALGOS}")
        QuantSpec(4, self.group_size, self.sym)  # validates group size
        if self.act_order and self.algo != "gptq":
            raise ValueError("--act-order applies to GPTQ only; drop it or use --algo gptq")
        if self.mse_clip and self.algo == "awq":
            raise ValueError("--mse-clip applies to RTN and GPTQ; AWQ runs its own clip search")
        if self.static_groups is not None and self.algo != "gptq":
            raise ValueError("--static-groups/--dynamic-groups apply to GPTQ only; drop it or "
                             "use --algo gptq")
        for name in ("samples", "seq_len", "batch_size", "awq_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    def resolved(self) -> CalibrateSpec:
        """The same spec with every default (None) replaced by the value it stands for."""
        gptq_algo = self.algo == "gptq"
        act_order = self.act_order if self.act_order is not None else (
            gptq_algo and GPTQ_ACT_ORDER_DEFAULT)
        static = self.static_groups if self.static_groups is not None else (
            act_order if gptq_algo else None)
        mse = self.mse_clip if self.mse_clip is not None else (
            gptq_algo and GPTQ_MSE_CLIP_DEFAULT)
        return replace(self, act_order=act_order, static_groups=static, mse_clip=mse)

    @property
    def int4(self) -> QuantSpec:
        return QuantSpec(4, self.group_size, self.sym, bool(self.resolved().act_order))

    def fingerprint(self) -> str:
        """Identifies the settings a partial run was started with (resume must match)."""
        keep = {k: str(v) for k, v in asdict(self).items() if k not in ("out", "force")}
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


def _prepare_out(spec: CalibrateSpec) -> int:
    """Create CALIB_DIR or find the resume point; returns the first block to compute."""
    out = spec.out
    progress = out / "progress.json"
    if (out / MANIFEST_NAME).is_file() or (out.exists() and not progress.is_file()
                                          and out.is_dir() and any(out.iterdir())):
        if not spec.force:
            raise OutputExistsError(
                f"{out} exists and holds other files or a finished calibration; pass --force "
                "to replace it or choose another --out"
            )
    if spec.force and out.exists():
        shutil.rmtree(out)
    if progress.is_file():
        state = json.loads(progress.read_text())
        if state["fingerprint"] != spec.fingerprint():
            raise ValueError(
                f"{out} holds an unfinished calibration with other settings "
                f"({state['spec']}); re-run with those settings to resume, or pass --force"
            )
        if (out / "state" / "hidden.safetensors").is_file():
            log.info("resuming %s at block %d", out, state["next_block"])
            return int(state["next_block"])
    out.mkdir(parents=True, exist_ok=True)
    return 0


def _save_progress(spec: CalibrateSpec, next_block: int, extra: dict) -> None:
    write_json_atomic(
        spec.out / "progress.json",
        {"fingerprint": spec.fingerprint(), "next_block": next_block,
         "spec": {k: str(v) for k, v in asdict(spec).items()}, **extra},
    )


def _layer_spec(spec: CalibrateSpec, name: str, in_features: int,
                fallbacks: dict[str, int]) -> QuantSpec:
    gs = resolve_group_size(spec.group_size, in_features, spec.strict_group_size)
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from calibration.prompts import CalibDataSpec, build_calibration_set, load_prompt_records

    t0 = time.perf_counter()
    spec = spec.resolved()  # the manifest and the resume fingerprint record concrete values
    fp16_manifest = read_manifest(spec.fp16_dir, "fp16")
    # read the prompts first: a bad file fails before CALIB_DIR exists or the model loads
    records = load_prompt_records(spec.prompts, column=spec.column)
    start = _prepare_out(spec)
    tokenizer = AutoTokenizer.from_pretrained(spec.fp16_dir)
    model = AutoModelForCausalLM.from_pretrained(
        spec.fp16_dir, dtype=torch.float32, use_safetensors=True, attn_implementation="sdpa"
    ).eval()
    model_type = model.config.model_type
    family = family_for(model_type)
    blocks = get_blocks(model, family)
    prefix = family.blocks
    data_summary = {}
    earlier_seconds = 0.0
    state_file = spec.out / "state" / "hidden.safetensors"
    if start == 0:
        calib = build_calibration_set(
            tokenizer, records,
            CalibDataSpec(n_samples=spec.samples, seq_len=spec.seq_len,
                          min_tokens=spec.min_tokens, seed=spec.seed),
        )
        input_ids = calib.input_ids
        if not torch.is_tensor(input_ids):
            raise ValueError("calibration needs equal-length sequences; use pack mode")
        data_summary = asdict(calib.summary)
        hidden, ctx = embed_inputs(model, input_ids)
        (spec.out / "state").mkdir(parents=True, exist_ok=True)
        save_safetensors_atomic({"hidden": hidden, "input_ids": input_ids}, state_file)
        _save_progress(spec, 0, {"data": data_summary})
    else:
        saved = load_file(str(state_file))
        hidden, input_ids = saved["hidden"], saved["input_ids"]
        _, ctx = embed_inputs(model, input_ids[:1])
        progress = json.loads((spec.out / "progress.json").read_text())
        data_summary = progress.get("data", {})
        earlier_seconds = float(progress.get("seconds", 0.0))  # time spent before the kill
    fallbacks: dict[str, int] = {}
    total_raises = 0
    for i in tqdm(range(start, len(blocks)), desc="calibrate", unit="block",
                  initial=start, total=len(blocks)):
        tb = time.perf_counter()
        block = blocks[i]
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
                                  lambda in_f: _layer_spec(spec, "", in_f, {}))
            for k, v in block.state_dict().items():
                if not torch.equal(v, before[k]):
                    fp_changed[f"{prefix}.{i}.{k}"] = v.detach().to(torch.float16).clone()
        results: dict[str, dict[int, QuantResult]] = {}
        block_raises = 0
        # GPTQ runs many small column operations: with several OpenMP threads each one pays
        # thread wake-ups (and spins when cores are shared), which was measured to cost 20x
        # the work itself on 2 cores. Large forwards keep all threads.
        threads = torch.get_num_threads()
        if spec.algo == "gptq":  # AWQ's clip search is large matmuls: keep all threads
            torch.set_num_threads(1)
        try:
            results, block_raises = _quantize_block(spec, block, family, collector, prefix, i,
                                                    fallbacks)
        finally:
            torch.set_num_threads(threads)
        total_raises += block_raises
        if spec.algo == "gptq":
            hidden = run_block(block, hidden, ctx, spec.batch_size)
        else:
            hidden = fp_out
        save_block(spec.out, i, results, fp_changed, {
            "seconds": time.perf_counter() - tb, "awq": awq_info,
            "damp_raises": block_raises,
        })
        save_safetensors_atomic({"hidden": hidden, "input_ids": input_ids}, state_file)
        _save_progress(spec, i + 1, {"data": data_summary,
                                     "seconds": earlier_seconds + time.perf_counter() - t0})
    # finished: the manifest marks the folder valid; the resume state is no longer needed
    seconds = earlier_seconds + time.perf_counter() - t0
    peak = _peak_rss_mb()
    # after a resume, this process saw only some blocks: the block files are the record
    fallbacks, total_raises = {}, 0
    for j in range(len(blocks)):
        info = json.loads(block_file(spec.out, j, "json").read_text())
        total_raises += int(info.get("damp_raises", 0))
        for name, layer in info["layers"].items():
            gs = layer["w4"]["spec"]["group_size"]
            if gs != spec.group_size:
                fallbacks[name] = gs
    if fallbacks:
        sizes = sorted(set(fallbacks.values()))
        log.warning("group size %d does not divide %d layer(s); used %s there "
                    "(recorded per layer)", spec.group_size, len(fallbacks), sizes)
    write_manifest(
        spec.out,
        stage="calibration",
        fp16_dir=str(Path(spec.fp16_dir).resolve()),
        fp16_shards=[{"file": s["file"], "sha256": s["sha256"]}
                     for s in fp16_manifest["shards"]],
        model_type=model_type,
        num_blocks=len(blocks),
        block_prefix=prefix,
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
    shutil.rmtree(spec.out / "state", ignore_errors=True)
    os.replace(spec.out / "progress.json", spec.out / "blocks" / "progress-final.json")
    return CalibrateResult(spec.out, seconds, peak, fallbacks, total_raises, start)
