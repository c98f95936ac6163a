"""Stage 4: `quantpipe export` — a calibration becomes a quantized checkpoint.

The per-layer plan (which linears are INT4, INT8 or kept FP16) is computed from the
calibration by ``calibration.mixed_precision.plan`` and applied here; the chosen format's
writer does the rest.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from quantpipe.calibration.artifact import Calibration, read_calibration
from quantpipe.calibration.menu import allowed_entries
from quantpipe.calibration.mixed_precision.budget import layer_specs
from quantpipe.calibration.mixed_precision.plan import (
    MAX_BUDGET_BITS,
    Plan,
    PlanSpec,
    check_budget_bits,
    make_plan,
)
from quantpipe.calibration.vocab import quantize_table
from quantpipe.core.families import family_for
from quantpipe.core.formats.registry import FORMAT_NAMES, format_named, layer_bits
from quantpipe.core.formats.writers import write_checkpoint
from quantpipe.core.io import (
    MANIFEST_NAME,
    LazyTensors,
    check_not_overlapping,
    check_output_dir,
    output_lock,
    parse_size,
    tensor_shape,
    weights_bytes,
)
from quantpipe.core.qformat import LazyWeights, QuantizedWeight, QuantSpec, check_bits
from quantpipe.core.vocab import VOCAB_SPEC_VERSION, VocabSpec, VocabTables, vocab_tables

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
    # the embedding table and output head: fp16 (as exported) or int8 / int4 RTN
    vocab: VocabSpec = field(default_factory=VocabSpec)
    # the measurement --budget-bits plans on; None: CALIB_DIR/sensitivity.json (PlanSpec)
    sensitivity: Path | None = None
    # the entries --budget-bits may choose (PlanSpec.menu); (): every entry calibrated
    menu: tuple[str, ...] = ()
    # the checkpoint's tensor bytes at most ("4GB", "1.2GiB"): planned as the --budget-bits
    # that size leaves for the calibrated linears (budget_bits_for_size)
    budget_size: str | None = None

    def __post_init__(self) -> None:
        check_bits(self.bits, "--bits ")
        allowed_entries(self.menu)  # before CALIB_DIR is read
        check_budget_bits(self.budget_bits)  # before CALIB_DIR is read
        if self.budget_size is not None:
            parse_size(self.budget_size, "--budget-size")
            if self.budget_bits is not None:
                raise ValueError("give --budget-bits or --budget-size, not both")
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
    vocab = _vocab_plan(spec, calib.fp16_dir)  # an unsupported option fails here
    budget_bits = spec.budget_bits
    if spec.budget_size is not None:
        budget_bits = budget_bits_for_size(calib, parse_size(spec.budget_size), spec.fmt, vocab,
                                           spec.menu)
    check_output_dir(spec.out, spec.force)  # fail before reading the weights
    with output_lock(spec.out):
        plan = make_plan(calib, PlanSpec(spec.bits, budget_bits, spec.overrides,
                                         spec.damage, spec.fmt, sensitivity=spec.sensitivity,
                                         menu=spec.menu))
        weights = calib.weights({name: b for name, b in plan.bits.items() if b is not None})
        _write(spec, calib, plan, weights, vocab)
    return ExportResult(Path(spec.out), plan, weights_bytes(spec.out), time.perf_counter() - t0)


def budget_bits_for_size(calib: Calibration, size: int, fmt: str,
                         vocab: VocabPlan | None = None, menu: tuple[str, ...] = ()) -> float:
    """The --budget-bits whose plan writes at most ``size`` bytes of tensors in format
    ``fmt``: ``size`` less every tensor that is not a calibrated linear (embeddings, head,
    norms, biases: as stored in the FP16 folder, or as ``vocab`` quantizes the tables), over
    the calibrated linears' weights. The safetensors headers and the config / tokenizer
    files (kilobytes) are not counted. ValueError naming the sizes a plan can reach when
    ``size`` is outside them (every linear at its cheapest entry that ``menu`` allows, or
    everything FP16)."""
    state = LazyTensors.of_folder(calib.fp16_dir)
    infos = calib.layer_infos()
    shapes = {n: tuple(v["w4"]["shape"]) for n, v in infos.items()}
    item = {"fp32": 4}.get(json.loads((Path(calib.fp16_dir) / MANIFEST_NAME).read_text())
                           .get("dtype", "fp16"), 2)
    # the linears' bytes as the FP16 folder stores them (a MoE model's experts may be fused
    # tensors there: counted by shape, not by name)
    rest = sum(state.nbytes(k) for k in state) - item * sum(o * i for o, i in shapes.values())
    if vocab is not None:
        for name in vocab.quantize:
            o, i = vocab.shapes[name]
            rest += layer_bits(vocab.spec, (o, i), fmt) // 8 - item * o * i
    params = sum(o * i for o, i in shapes.values())
    allowed = allowed_entries(menu)
    cheapest = sum(min(layer_bits(s, shapes[n], fmt) for e, s in specs.items()
                       if allowed is None or e in allowed) for n, specs in
                   layer_specs(infos).items()) / 8
    fp16 = 2 * params
    if not rest + cheapest <= size <= rest + fp16:
        raise ValueError(
            f"--budget-size {_size_text(size)} is outside what a plan of {calib.folder} can "
            f"write in --format {fmt}: {_size_text(rest + cheapest)} (every linear at its "
            f"cheapest entry) to {_size_text(rest + fp16)} (all FP16), of which "
            f"{_size_text(rest)} are the embeddings, head, norms and biases"
            + ("" if vocab is not None else " (export --vocab-weights int8 or int4 shrinks them)"))
    return min(8 * (size - rest) / params, MAX_BUDGET_BITS)


def check_budget_size_reachable(fp16_dir: Path, size: int) -> None:
    """Refuse, from FP16_DIR alone (before a calibration exists), a ``--budget-size`` that no
    plan can write in any format: under the decoder blocks' weight matrices at 4 bits (the
    codes alone: every entry also stores scales) plus every other tensor as stored, or over
    the whole folder (everything FP16). The exact range depends on the calibration's entries
    and is checked when the plan is made (:func:`budget_bits_for_size`)."""
    state = LazyTensors.of_folder(fp16_dir)
    config = json.loads((Path(fp16_dir) / "config.json").read_text(encoding="utf-8"))
    prefix = family_for(config.get("model_type")).blocks + "."
    matrices = [k for k in state if k.startswith(prefix) and k.endswith(".weight")
                and len(state.shape(k)) >= 2]
    total = sum(state.nbytes(k) for k in state)
    params = sum(math.prod(state.shape(k)) for k in matrices)
    low = total - sum(state.nbytes(k) for k in matrices) + params / 2
    if not low < size <= total:
        raise ValueError(
            f"--budget-size {_size_text(size)} is outside what any plan of {fp16_dir} can "
            f"write: more than {_size_text(low)} (the decoder blocks' {params:,} weights at 4 "
            f"bits with every other tensor as stored) and at most {_size_text(total)} (the "
            "folder: everything FP16)")


def _size_text(n: float) -> str:
    """Bytes as a user writes a size: 1.2 GB, 110.1 MB, 900 kB, 12 B."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class VocabPlan:
    """Which vocabulary tables an export quantizes, read from the FP16 folder's headers."""

    tables: VocabTables
    spec: QuantSpec | None  # None: both stay FP16
    quantize: tuple[str, ...]  # module names of the tables written quantized
    shapes: dict[str, tuple[int, int]]  # [vocab, hidden] of each table stored
    why: str  # why a table stays FP16 in this format ("" when none does)


def _vocab_plan(spec: ExportSpec, fp16_dir: Path) -> VocabPlan | None:
    """The tables ``--vocab-weights`` quantizes in ``--format``; ValueError (one line) when the
    format can hold neither, or the group size does not divide the hidden size."""
    if not spec.vocab.quantized:
        return None
    tables = vocab_tables(json.loads((Path(fp16_dir) / "config.json").read_text()))
    state = LazyTensors.of_folder(fp16_dir)
    # a tied head is the table (a stray lm_head.weight of a tied model is not written)
    names = (tables.embedding,) if tables.tied else (tables.embedding, tables.head)
    shapes = {n: tuple(tensor_shape(state, f"{n}.weight")) for n in names
              if f"{n}.weight" in state}
    if tables.embedding not in shapes:
        raise ValueError(f"--vocab-weights: {fp16_dir} has no {tables.embedding}.weight")
    qspec = spec.vocab.quant_spec(shapes[tables.embedding][1])
    support = format_named(spec.fmt).vocab_support(tables.tied)
    quantize = tuple(n for n, ok in ((tables.embedding, support.embedding),
                                     (tables.head, support.head and not tables.tied))
                     if ok and n in shapes)
    if not quantize:
        raise ValueError(f"--vocab-weights {spec.vocab.weights} with --format {spec.fmt}: "
                         f"{support.why}")
    if support.why:
        log.warning("--vocab-weights %s with --format %s: %s", spec.vocab.weights, spec.fmt,
                    support.why)
    return VocabPlan(tables, qspec, quantize, shapes, support.why)


def _vocab_weights(vocab: VocabPlan, fp16_dir: Path, head: bool) -> LazyWeights:
    """The quantized head (``head``) or embedding table, quantized (RTN) from the FP16 folder
    when it is written."""
    state = LazyTensors.of_folder(fp16_dir)
    names = [n for n in vocab.quantize if (n == vocab.tables.head) == head]

    def load(name: str) -> QuantizedWeight:
        return quantize_table(state[f"{name}.weight"], vocab.spec)  # [vocab, hidden]

    return LazyWeights({n: vocab.spec for n in names}, {n: vocab.shapes[n] for n in names}, load)


def _vocab_record(spec: ExportSpec, vocab: VocabPlan | None) -> dict:
    """The manifest's ``vocab``: what was stored and its bits (the registry's count)."""
    if vocab is None:
        return {"version": VOCAB_SPEC_VERSION, "weights": "fp16"}
    tables = {}
    for name, shape in vocab.shapes.items():
        q = vocab.spec if name in vocab.quantize else None
        tables[name] = {"spec": None if q is None else q.to_dict(), "shape": list(shape),
                        "bits_per_weight": layer_bits(q, shape, spec.fmt) / (shape[0] * shape[1])}
    return {"version": VOCAB_SPEC_VERSION, "weights": spec.vocab.weights,
            "method": "rtn (min-max symmetric, no calibration data)",
            "tied": vocab.tables.tied, "tables": tables, "kept_fp16_because": vocab.why}


def _with(weights: LazyWeights, extra: LazyWeights) -> LazyWeights:
    """``weights`` and ``extra`` as one lazy mapping (``extra``'s after)."""
    if not extra:
        return weights
    specs, shapes = {**weights.specs, **extra.specs}, {**weights.shapes, **extra.shapes}
    return LazyWeights(specs, shapes, lambda n: extra[n] if n in extra else weights[n])


def _write(spec: ExportSpec, calib: Calibration, plan: Plan, weights: LazyWeights,
           vocab: VocabPlan | None = None) -> None:
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
        "vocab": _vocab_record(spec, vocab),
    }
    embeddings: Mapping[str, QuantizedWeight] = {}
    if vocab is not None:  # a quantized untied head is one more linear
        weights = _with(weights, _vocab_weights(vocab, calib.fp16_dir, head=True))
        embeddings = _vocab_weights(vocab, calib.fp16_dir, head=False)
    args = dict(
        fp_overrides=calib.fp_tensors(), manifest_fields=manifest_fields,
        max_shard_size=spec.max_shard_size, force=spec.force,
        # export reads FP tensors from the FP16 folder: it must hold the very bytes the
        # calibration was computed from, or the manifest would claim a wrong source hash
        fp16_shards=calib.manifest["fp16_shards"],
        recorded_by=f"the calibration {spec.calib_dir}", embeddings=embeddings,
    )
    write_checkpoint(spec.fmt, spec.out, calib.fp16_dir, weights, **args)
