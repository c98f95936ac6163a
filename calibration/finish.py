"""The end of a calibration (stage 5 of ``calibration.pipeline``): the manifest, written last
from the block files (it marks CALIB_DIR valid), and the run's result."""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quantpipe.calibration.artifact import block_file
from quantpipe.calibration.grid import clip_search_settings
from quantpipe.calibration.menu import is_menu_tag
from quantpipe.calibration.resume import CalibInputs, Run
from quantpipe.core.families import family_for
from quantpipe.core.heap import peak_rss
from quantpipe.core.io import write_manifest

if TYPE_CHECKING:
    from quantpipe.calibration.spec import CalibrateSpec

log = logging.getLogger(__name__)


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


def finish(run: Run, inputs: CalibInputs, data_summary: dict, seconds: float,
            start: int) -> CalibrateResult:
    """Write the manifest (last file; it marks the folder valid) and drop the resume state."""
    spec = run.spec
    peak = (peak_rss() or 0) / 2**20
    # after a resume, this process saw only some blocks: the block files are the record
    fallbacks, total_raises, expert_fallbacks, group_sizes = {}, 0, {}, {}
    devices: dict[str, int] = {}  # device -> blocks calibrated there (a resume may switch)
    batch_sizes: dict[int, int] = {}  # batch size -> blocks (a resume may switch)
    menu: dict[str, int] = {}  # menu entry -> linears that have it (calibration.menu)
    for j in range(inputs.num_blocks):
        info = json.loads(block_file(run.work, j, "json").read_text())
        total_raises += int(info.get("damp_raises", 0))
        device = info.get("device", "cpu")  # blocks written before --device ran on the CPU
        devices[device] = devices.get(device, 0) + 1
        size = int(info.get("batch_size", spec.batch_size))  # blocks written before it counted
        batch_sizes[size] = batch_sizes.get(size, 0) + 1
        expert_fallbacks.update(info.get("expert_fallbacks", {}))
        for name, layer in info["layers"].items():
            for tag in filter(is_menu_tag, layer):
                menu[tag] = menu.get(tag, 0) + 1
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
        int8=spec.int8.to_dict(),  # as requested (each block's results: per layer)
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(spec).items()},
        clip_search=clip_search_settings(),
        data=data_summary,
        int4_group_sizes=group_sizes,  # per layer, as planned (and fallen back)
        menu={t: menu.get(t, 0) for t in spec.resolved().menu},  # entry -> linears with it
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
