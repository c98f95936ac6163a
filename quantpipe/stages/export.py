"""Stage 4: `quantpipe export` — a calibration becomes a quantized checkpoint.

The per-layer plan (which linears are INT4, INT8 or kept FP16) is computed from the
calibration by ``calibration.plan`` and applied here; the chosen format's writer does the rest.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from quantpipe.calibration.artifact import Calibration, read_calibration
from quantpipe.calibration.plan import Plan, PlanSpec, check_budget_bits, make_plan
from quantpipe.core.formats.registry import FORMAT_NAMES
from quantpipe.core.formats.writers import write_checkpoint
from quantpipe.core.io import (
    check_not_overlapping,
    check_output_dir,
    output_lock,
    parse_size,
)
from quantpipe.core.qformat import check_bits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportSpec:
    calib_dir: Path  # output of `quantpipe calibrate`
    out: Path  # QDIR
    bits: int = 4  # default precision of quantized linears: 4 or 8
    fmt: str = FORMAT_NAMES[0]  # a name of quantpipe.core.formats.registry.FORMATS
    budget_bits: float | None = None  # average bits per weight: automatic mixed precision
    overrides: tuple[str, ...] = field(default_factory=tuple)  # "NAME|re:REGEX=4|8|fp16"
    max_shard_size: str = "2GB"
    force: bool = False
    damage: str = "auto"  # what --budget-bits minimises: auto, kld or proxy (PlanSpec.damage)

    def __post_init__(self) -> None:
        check_bits(self.bits, "--bits ")
        check_budget_bits(self.budget_bits)  # before CALIB_DIR is read
        if self.fmt not in FORMAT_NAMES:
            raise ValueError(f"--format {self.fmt!r} is not supported; use one of {FORMAT_NAMES}")
        parse_size(self.max_shard_size, "--max-shard-size")  # before any slow work


@dataclass(frozen=True)
class ExportResult:
    out: Path
    plan: Plan
    bytes_on_disk: int
    seconds: float


def export_quantized(spec: ExportSpec) -> ExportResult:
    """Write QDIR from a calibration. Every check (inputs, --out, the FP16 shards' hashes
    against those the calibration recorded) runs before QDIR is touched; the whole export
    holds QDIR's output lock and writes through a hidden temp folder (quantpipe.core.io)."""
    t0 = time.perf_counter()
    check_not_overlapping(spec.out, {"CALIB_DIR": spec.calib_dir})
    calib = read_calibration(spec.calib_dir)
    check_not_overlapping(spec.out, {"FP16_DIR (of the calibration)": calib.fp16_dir})
    check_output_dir(spec.out, spec.force)  # fail before reading the weights
    with output_lock(spec.out):
        plan = make_plan(calib, PlanSpec(spec.bits, spec.budget_bits, spec.overrides,
                                         spec.damage, spec.fmt))
        weights = calib.weights({name: b for name, b in plan.bits.items() if b is not None})
        _write(spec, calib, plan, weights)
    size = sum(p.stat().st_size for p in Path(spec.out).glob("*.safetensors"))
    return ExportResult(Path(spec.out), plan, size, time.perf_counter() - t0)


def _write(spec: ExportSpec, calib: Calibration, plan: Plan, weights: dict) -> None:
    """Hand the plan's weights to the chosen format's writer (the registry's)."""
    manifest_fields = {
        "calibration": {
            "path": str(Path(spec.calib_dir).resolve()),
            "algo": calib.manifest["algo"],
            "int4": calib.manifest["int4"],
            "data": calib.manifest.get("data", {}),
            "group_size_fallbacks": calib.manifest.get("group_size_fallbacks", {}),
            "damp_raises": calib.manifest.get("damp_raises", 0),
            "seconds": calib.manifest.get("seconds"),
        },
        "plan": plan.to_dict(),
    }
    args = dict(
        fp_overrides=calib.fp_tensors(), manifest_fields=manifest_fields,
        max_shard_size=spec.max_shard_size, force=spec.force,
        # export reads FP tensors from the FP16 folder: it must hold the very bytes the
        # calibration was computed from, or the manifest would claim a wrong source hash
        fp16_shards=calib.manifest["fp16_shards"],
        recorded_by=f"the calibration {spec.calib_dir}",
    )
    write_checkpoint(spec.fmt, spec.out, calib.fp16_dir, weights, **args)
