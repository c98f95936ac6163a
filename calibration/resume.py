"""Calibration's inputs and its resume point: stages 1-2 of ``calibration.pipeline``.

Every check on the options and inputs runs before CALIB_DIR is touched (``check_inputs``); the
hidden work folder beside CALIB_DIR holds each finished block and the next block's inputs, and
``progress.json`` the settings they were made with: a killed run resumes at its first unfinished
block when the settings match (``prepare_work``), and ``save_progress`` moves the resume point
after each block."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from quantpipe.blocks.activations import ActivationSpace
from quantpipe.calibration.algorithms import ALGORITHMS
from quantpipe.calibration.artifact import (
    WORK_MARKER,
    block_file,
    check_work_dir,
    work_dir,
)
from quantpipe.calibration.grid import clip_search_settings
from quantpipe.calibration.moe import expert_linears_in
from quantpipe.calibration.spec import CalibrateSpec, read_config
from quantpipe.core.config_check import check_folder_config
from quantpipe.core.families import (
    Family,
    family_for,
    family_linear_names,
)
from quantpipe.core.io import (
    check_not_overlapping,
    check_output_dir,
    read_manifest,
    verify_shard_hashes,
    write_json_atomic,
)
from quantpipe.prompts.sets import SHIPPED_SETS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibInputs:
    """What calibrate read and checked before touching CALIB_DIR."""

    fp16_manifest: dict
    model_type: str
    num_blocks: int
    input_ids: torch.Tensor  # [samples, seq_len] int64: the packed calibration windows
    data_summary: dict  # quantpipe.prompts.sets.CalibSummary as a dict


@dataclass(frozen=True)
class Run:
    """One calibrate run: the resolved spec, where it builds CALIB_DIR, what resume matches."""

    spec: CalibrateSpec
    work: Path  # hidden folder beside spec.out (calibration.artifact.work_dir)
    settings: dict[str, str]  # spec.resume_settings() + the FP16 shards' hashes


def linear_in_features(fp16_dir: Path, manifest: dict, family: Family) -> tuple[dict, int]:
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


def check_inputs(spec: CalibrateSpec) -> CalibInputs:
    """Every check on the options and inputs, before CALIB_DIR (or its lock) is touched."""
    from quantpipe.core.sources import load_folder_tokenizer
    from quantpipe.prompts.sets import (
        CalibDataSpec,
        build_calibration_set,
        load_prompt_records,
    )

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
    config = read_config(spec.fp16_dir)
    family = family_for(config.get("model_type"))
    if ALGORITHMS[spec.algo].asymmetric and family.moe:
        raise ValueError(f"--algo {spec.algo} does not support mixture-of-experts models "
                         "(an expert's routed tokens differ between the FP and the quantized "
                         "model, so its inputs cannot be paired); use --algo gptq")
    verify_shard_hashes(spec.fp16_dir, manifest["shards"])  # reads every byte: logged at -v
    check_folder_config(spec.fp16_dir)  # an absurd config.json size would be built first
    in_features, num_blocks = linear_in_features(spec.fp16_dir, manifest, family)
    for name, in_f in in_features.items():
        spec.layer_group_size(name, in_f)
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
    return CalibInputs(manifest, config["model_type"], num_blocks, calib.input_ids,
                   asdict(calib.summary))


def resume_settings(spec: CalibrateSpec, fp16_manifest: dict) -> dict[str, str]:
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


def prepare_work(run: Run, num_blocks: int) -> int:
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


def save_progress(run: Run, next_block: int, extra: dict) -> None:
    write_json_atomic(
        run.work / "progress.json",
        {"fingerprint": run.spec.fingerprint(), "next_block": next_block,
         "spec": run.settings, **extra},
    )




def earlier_progress(run: Run, inputs: CalibInputs, start: int) -> tuple[dict, float]:
    """The data summary and the seconds of the run a resume continues (or this run's)."""
    if start == 0:
        return inputs.data_summary, 0.0
    progress = json.loads((run.work / "progress.json").read_text())
    # time spent before the kill counts in the manifest
    return progress.get("data", inputs.data_summary), float(progress.get("seconds", 0.0))
