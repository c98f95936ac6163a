"""`quantpipe sensitivity`: the measured damage of quantizing each linear alone.

For every calibrated linear and each precision b in ``--bits`` (INT4, INT8), the FP16 model gets
only that layer replaced by its dequantized calibrated weight (the one stored in CALIB_DIR, so
exactly what `export` would write), and the damage is the mean over tokens of

    KL(P_fp16 || P_layer@b) = sum_v p_ref(v) (log p_ref(v) - log p_cand(v))

on calibration-style data (the shipped business-calib prompts, packed, seeded; never the
held-out eval prompts). This is the "leave-one-in" sensitivity that mixed-precision planners
(e.g. HAWQ's validation, llama.cpp's per-tensor KLD sweeps) treat as ground truth.

Cost control (the model is small, the number of runs is 2 x layers):
- the FP hidden states entering every block are computed once and cached, so a run for a layer
  of block i starts at block i (layers are never re-run upstream of the change);
- the FP16 reference logits and probabilities are computed once; per run only the
  candidate's final norm, LM head and a few float32 passes over the logit difference (see
  :func:`quantpipe.core.metrics.token_kld`) are computed, in row chunks (memory
  O(chunk x vocab));
- all sequences of a block go through in one batch.

Validation (``validate_tokens`` > 0, the default): the prompts are split by record, the even
records measured above and the odd ones held out. After the per-layer measurement, the planner's
upgrade path (:func:`~quantpipe.calibration.mixed_precision.budget.upgrade_path`: all-INT4, then
the moves the budget planner buys in its order) is walked on the FP model and the WHOLE mixed
model is scored on the held-out split at checkpoints every ``validate_step`` bits per weight, up to
``validate_max_bits``: the measured KLD of real plans on prompts the measurement never saw,
next to the summed per-layer prediction. The planner stops upgrading where that validation KLD
stops improving (``calibration.mixed_precision.plan.apply_validation``).

Cheap proxies, stored beside the measurement for comparison:
- ``proxy``: the calibration's per-layer loss tr(dW H dW^T) (squared output error of the
  layer on the calibration tokens);
- ``proxy_norm``: that loss divided by the layer's output energy tr(W H W^T) = 2 mean ||W x||^2
  (an inverse SQNR; scale free, so layers of different magnitude compare).
Their Spearman rank correlation with the measured KLD is reported and stored; the planner
uses a proxy only when it ranks well (see ``calibration.mixed_precision.plan``).

Models whose FP weights in fp32 would not fit in memory (or ``stream=True``) are measured
block by block instead (:mod:`.sensitivity_stream`: one block resident, each layer's change of
its block's output times the block's measured gain; no validation split).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantpipe.blocks.execute import BlockContext, embed_inputs, run_block
from quantpipe.calibration.artifact import Calibration, read_calibration
from quantpipe.calibration.menu import is_menu_tag, parse_menu, tag_of
from quantpipe.calibration.mixed_precision.budget import (
    bits_per_weight,
    layer_specs,
    menu_damage,
    primary_entries,
    start_state,
    upgrade_path,
)
from quantpipe.calibration.mixed_precision.scoring import (
    Scorer,
    head_logits,
    output_energy_hooks,
    proxies,
)
from quantpipe.core.families import attn_implementation, family_for, get_blocks
from quantpipe.core.heap import fits_in_memory
from quantpipe.core.io import MANIFEST_NAME, output_lock, weights_bytes, write_json_atomic

log = logging.getLogger(__name__)

SENSITIVITY_FILE = "sensitivity.json"
SENSITIVITY_VERSION = 1
PROMPT_SET = "business-calib"  # calibration-style data; business-eval stays held out
SPLIT = "records 0, 2, 4, ... measured; 1, 3, 5, ... validated"


@dataclass(frozen=True)
class SensitivitySpec:
    calib_dir: Path  # a finished CALIB_DIR
    tokens: int = 1024  # scored tokens (sequences x seq_len)
    seq_len: int = 256  # tokens per packed sequence
    bits: tuple[int, ...] = (4, 8)  # precisions measured; the planner needs both
    seed: int = 1  # prompt shuffle seed (calibration used 0 by default: different windows)
    batch_size: int = 8  # sequences per block forward
    chunk_rows: int = 256  # token rows per LM-head / KL chunk (memory: rows x vocab floats)
    force: bool = False  # recompute even if a matching sensitivity.json exists
    # scored tokens of the held-out prompt split for validating the upgrade path (0: no split,
    # every record measured and nothing validated: the measurement of version 1 files)
    validate_tokens: int = 1024
    validate_step: float = 0.025  # bits per weight between validation checkpoints
    validate_max_bits: float = 5.0  # last checkpoint at most here (plans rarely go beyond)
    out: Path | None = None  # the file written; None: CALIB_DIR/sensitivity.json
    # menu entries (calibrate --menu) measured as well, each like INT4 (kld_<tag>); ("all",):
    # every entry of the calibration. (): none; the planner then scales INT4's KLD by the
    # entry's loss ratio (budget.menu_damage)
    entries: tuple[str, ...] = ()
    # block by block (sensitivity_stream: one block resident, local changes x measured gains)
    # instead of the whole FP model; None: when the FP model in fp32 would not fit in memory
    stream: bool | None = None
    probe_tokens: int = 512  # streamed: tokens each block's gain probe is scored on

    def __post_init__(self) -> None:
        if self.entries != ("all",):
            parse_menu(self.entries)  # ValueError naming a malformed entry
        if not self.bits or any(b not in (4, 8) for b in self.bits) or len(set(self.bits)) != len(
            self.bits
        ):
            raise ValueError(f"--bits {self.bits}: give 4, 8 or 4,8 (each once)")
        if self.seq_len < 16:
            raise ValueError(f"seq_len {self.seq_len} is too short; use 128 or more")
        if self.tokens < self.seq_len:
            raise ValueError(f"--tokens {self.tokens} is below one sequence of {self.seq_len}; "
                             "use 1024 or more")
        for name in ("batch_size", "chunk_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.probe_tokens < 1:
            raise ValueError(f"--probe-tokens {self.probe_tokens}: give at least one token "
                             "(512, the default, or up to --tokens)")
        if self.validate_tokens and self.validate_tokens < self.seq_len:
            raise ValueError(f"validate_tokens {self.validate_tokens} is below one sequence of "
                             f"{self.seq_len}; use 0 (no validation) or 1024")
        if not (self.validate_step > 0 and self.validate_max_bits > 0):
            raise ValueError("validate_step and validate_max_bits must be > 0")

    @property
    def path(self) -> Path:
        return Path(self.calib_dir) / SENSITIVITY_FILE if self.out is None else Path(self.out)

    @property
    def validates(self) -> bool:
        """The held-out split is scored: asked for, both precisions the planner needs, and
        the whole model measured (a streamed measurement has no validation)."""
        return self.validate_tokens > 0 and set(self.bits) == {4, 8} and not self.stream

    @property
    def n_sequences(self) -> int:
        return -(-self.tokens // self.seq_len)  # ceil

    def settings(self) -> dict:
        """What makes two measurements comparable (reuse needs equal settings)."""
        out = {"tokens": self.tokens, "seq_len": self.seq_len, "bits": list(self.bits),
               "seed": self.seed, "prompts": PROMPT_SET}
        if self.entries:  # (files measured before entries existed stay comparable)
            out["entries"] = list(self.entries)
        if self.stream:  # (whole-model files predate the method key: they stay comparable)
            out["method"] = {"name": "stream", "probe_tokens": self.probe_tokens}
        if self.validates:
            out["validation"] = {"tokens": self.validate_tokens, "split": SPLIT,
                                 "step_bits": self.validate_step,
                                 "max_bits": self.validate_max_bits}
        return out


@dataclass(frozen=True)
class SensitivityResult:
    path: Path
    data: dict  # the content of sensitivity.json
    reused: bool  # True: an existing file with equal settings was returned

    def table(self, top: int = 15) -> str:
        layers = self.data["layers"]
        order = sorted(layers, key=lambda n: -layers[n].get("kld_w4", 0.0))
        rows = [f"{'layer':<40} {'kld_w4':>10} {'kld_w8':>10} {'proxy_w4':>10}"]
        for n in order[:top]:
            v = layers[n]
            rows.append(f"{n:<40} {v.get('kld_w4', float('nan')):>10.3e} "
                        f"{v.get('kld_w8', float('nan')):>10.3e} {v['proxy_w4']:>10.3e}")
        rho = self.data["spearman"]
        rows.append("Spearman(proxy, measured KLD): " + ", ".join(
            f"{k} {v:.3f}" for k, v in rho.items()))
        val = self.data.get("validation")
        if val:
            rows.append(f"validation on {val['tokens_scored']} held-out tokens (whole model, "
                        "predicted = summed per-layer KLD):")
            rows.append(f"{'bits/weight':>12} {'moves':>6} {'predicted':>10} {'validated':>10}")
            for c in val["checkpoints"]:
                rows.append(f"{c['bits']:>12.4f} {c['moves']:>6d} {c['predicted']:>10.4g} "
                            f"{c['validated']:>10.4g}")
        if self.data.get("method") == "stream":
            rows.append(f"block by block: each KLD = the relative change of its block's output on "
                        f"{self.data['tokens_measured']} tokens x the block's gain (KLD per "
                        "unit change of its INT4 probe); no validation split")
        rows.append(f"{self.data['tokens_scored']} tokens, {self.data['seconds']:.0f}s"
                    f"{' (reused)' if self.reused else ''}")
        return "\n".join(rows)


# ---------------------------------------------------------------------------------------
# maths (pure)


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation with average ranks for ties (Pearson on the ranks)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need two equal-length lists of >= 2 values (got {len(x)}, {len(y)})")

    def ranks(v: list[float]) -> torch.Tensor:
        t = torch.tensor(v, dtype=torch.float64)
        order = torch.argsort(t, stable=True)
        r = torch.empty_like(t)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        for value in torch.unique(t):  # ties share the mean of their ranks
            tie = t == value
            r[tie] = r[tie].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float((rx.pow(2).sum() * ry.pow(2).sum()).sqrt())
    return float((rx * ry).sum()) / den if den > 0 else 0.0


# ---------------------------------------------------------------------------------------
# orchestration


def calibration_identity(calib: Calibration) -> dict:
    """Which calibration a measurement describes: its folder and the hash of its manifest
    (the manifest records every setting and the FP16 shards' hashes; a new calibration into
    the same folder gets another one)."""
    manifest = (Path(calib.folder) / MANIFEST_NAME).read_bytes()
    return {"folder": str(Path(calib.folder).resolve()),
            "manifest_sha256": hashlib.sha256(manifest).hexdigest()}


def read_sensitivity(path: Path, calib: Calibration) -> dict:
    """The measurement in ``path``, refused (ValueError naming the remedy) unless it is JSON
    and was measured on ``calib``. Files written before measurements recorded their
    calibration are accepted only as that calibration's own sensitivity.json."""
    remedy = f"measure again: `quantpipe sensitivity {calib.folder} --out {path} --force`"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({exc}); {remedy}") from None
    if not isinstance(data, dict) or not isinstance(data.get("layers"), dict):
        raise ValueError(f"{path} is not a sensitivity measurement (no layers); {remedy}")
    recorded = data.get("calibration")
    own = Path(path).resolve() == (Path(calib.folder) / SENSITIVITY_FILE).resolve()
    if recorded is None and not own:
        raise ValueError(f"{path} does not record the calibration it was measured on; {remedy}")
    if recorded is not None and recorded.get("manifest_sha256") != calibration_identity(
            calib)["manifest_sha256"]:
        raise ValueError(f"{path} was measured on another calibration ({recorded.get('folder')}"
                         f") than {calib.folder}; {remedy}")
    return data


def _existing(path: Path, spec: SensitivitySpec, calib: Calibration) -> dict | None:
    if not path.is_file() or spec.force:  # --force never needs to read the old file
        return None
    data = read_sensitivity(path, calib)
    if data.get("settings") != spec.settings():
        raise ValueError(
            f"{path} was measured with other settings ({data.get('settings')}); pass --force "
            "to measure again with these"
        )
    return data


def _check_fp16_source(calib: Calibration, spec: SensitivitySpec) -> None:
    """Before loading: the calibration's FP16 folder is still there, and --seq-len fits the
    model (beyond its trained context the measured KLDs would describe extrapolation)."""
    config_path = calib.fp16_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{calib.folder} was calibrated from {calib.fp16_dir}, which has no "
                         "config.json any more; restore that FP16 folder (or calibrate again)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{config_path}: not valid JSON ({exc}); restore it or run "
                         "export-fp16 again") from None
    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and spec.seq_len > limit:
        raise ValueError(f"--seq-len {spec.seq_len} exceeds the model's context of {limit} "
                         f"tokens ({config_path}); use --seq-len {limit} or less")


def _load_model(calib: Calibration):
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = attn_implementation(
        AutoConfig.from_pretrained(calib.fp16_dir, trust_remote_code=False).model_type)
    model = AutoModelForCausalLM.from_pretrained(
        calib.fp16_dir, dtype=torch.float32, use_safetensors=True, attn_implementation=attn,
        trust_remote_code=False,
    ).eval()
    # AWQ folds scales into norms and linears: the stored weights quantize the *scaled*
    # linears, so the reference is the folded FP model (the same function up to fp16 rounding).
    fp = calib.fp_tensors()
    if fp:
        state = model.state_dict()
        unknown = [k for k in fp if k not in state]
        if unknown:
            raise ValueError(f"{calib.folder} changes tensors the model lacks: {unknown[:3]}; "
                             "was it calibrated from another FP16 folder?")
        with torch.no_grad():
            for k, v in fp.items():
                state[k].copy_(v.float())
    return model


def _calibration_ids(fp16_dir: Path, spec: SensitivitySpec,
                     split: str = "measure") -> torch.Tensor:
    """Packed token ids [n, seq_len] of the measured split ("measure"; every record when the
    spec does not validate) or of the held-out split ("validate")."""
    from quantpipe.core.sources import load_folder_tokenizer
    from quantpipe.prompts.sets import (
        CalibDataSpec,
        build_calibration_set,
        load_prompt_records,
    )

    records = load_prompt_records(PROMPT_SET)
    tokens = spec.tokens
    if spec.validates:
        records = records[0::2] if split == "measure" else records[1::2]
        tokens = spec.tokens if split == "measure" else spec.validate_tokens
    tok = load_folder_tokenizer(fp16_dir)
    data = build_calibration_set(
        tok, records,
        CalibDataSpec(n_samples=-(-tokens // spec.seq_len), seq_len=spec.seq_len, min_tokens=16,
                      seed=spec.seed, mode="pack"),
    )
    return data.input_ids  # [n, seq_len] int64


def _model_and_ids(calib: Calibration, spec: SensitivitySpec, model,
                   input_ids: torch.Tensor | None, validate_ids: torch.Tensor | None) -> tuple:
    """The FP model and the token ids [n, seq_len] of both splits; every check, and the prompts
    (too few tokens fail at once), before the slow model load. Ids passed by the caller are
    used as given; the held-out split is built only when the measured one is too."""
    if model is None:
        _check_fp16_source(calib, spec)
    if input_ids is None:
        input_ids = _calibration_ids(calib.fp16_dir, spec)
        if spec.validates and validate_ids is None:
            validate_ids = _calibration_ids(calib.fp16_dir, spec, "validate")
    model = _load_model(calib) if model is None else model
    return model, input_ids, validate_ids if spec.validates else None


def measure_sensitivity(spec: SensitivitySpec, model=None, input_ids: torch.Tensor | None = None,
                        validate_ids: torch.Tensor | None = None) -> SensitivityResult:
    """Measure every linear of ``spec.calib_dir`` alone; write ``spec.path``
    (CALIB_DIR/sensitivity.json unless ``spec.out`` names another file).

    ``model`` / ``input_ids`` / ``validate_ids`` may be passed to skip loading (tests); by
    default the FP16 model is loaded from the calibration's ``fp16_dir`` and the business-calib
    prompts are split and packed (``input_ids`` given without ``validate_ids``: no validation).
    Holds CALIB_DIR's output lock throughout: `calibrate --force` replaces CALIB_DIR under it,
    so the results land in the calibration they were measured on, one writer at a time.
    """
    with output_lock(spec.calib_dir):
        if spec.stream is None and model is None:
            spec = replace(spec, stream=_auto_stream(spec))
        return _measure(spec, model, input_ids, validate_ids)


@torch.no_grad()
def _measure(spec: SensitivitySpec, model, input_ids: torch.Tensor | None,
             validate_ids: torch.Tensor | None) -> SensitivityResult:
    t0 = time.perf_counter()
    calib = read_calibration(spec.calib_dir)
    path = spec.path
    old = _existing(path, spec, calib)
    if old is not None:
        log.info("reusing %s (same settings); pass --force to measure again", path)
        return SensitivityResult(path, old, reused=True)
    infos = calib.layer_infos()
    if spec.stream:
        return _measure_streamed(spec, calib, infos, input_ids, t0)
    model, input_ids, validate_ids = _model_and_ids(calib, spec, model, input_ids, validate_ids)
    family = family_for(model.config.model_type)
    blocks = get_blocks(model, family)
    prefix = family.blocks
    if len(blocks) != calib.num_blocks:
        raise ValueError(f"the model has {len(blocks)} blocks, the calibration "
                         f"{calib.num_blocks}; use the FP16 folder it was calibrated from")

    # 1. FP pass: cache every block's input, the output energy of every linear
    hidden, ctx = embed_inputs(model, input_ids)  # [n, L, d] fp32
    block_in: list[torch.Tensor] = []
    energy: dict[str, tuple[float, int]] = {}
    by_block: list[list[str]] = []
    for i, block in enumerate(tqdm(blocks, desc="sensitivity: FP pass", unit="block",
                                   leave=False)):
        names = [n for n in infos if n.startswith(f"{prefix}.{i}.")]
        by_block.append(names)
        handles = output_energy_hooks(
            block, {n[len(f"{prefix}.{i}.") :]: n for n in names}, energy)
        block_in.append(hidden)
        hidden = run_block(block, hidden, ctx.for_layer(i), spec.batch_size)
        for h in handles:
            h.remove()
    scorer = Scorer(partial(head_logits, model), hidden, spec.chunk_rows)

    # 2. one run per (layer, bits), from the layer's block onwards; the bar counts runs (a run
    # of an early block's layer costs more: it runs every block after it)
    layers: dict[str, dict] = {}
    menu = _measured_entries(spec, infos)
    bar = tqdm(total=sum(len(spec.bits) + len(menu[n]) for n in infos), desc="sensitivity",
               unit="run")
    for i, names in enumerate(by_block):
        if not names:
            continue
        qweights = {tag_of(b): calib.weights(dict.fromkeys(names, b)) for b in spec.bits}
        for tag in dict.fromkeys(t for n in names for t in menu[n]):
            qweights[tag] = calib.weights({n: tag for n in names if tag in menu[n]})
        for name in names:
            lin = blocks[i].get_submodule(name[len(f"{prefix}.{i}.") :])
            entry = proxies(infos[name], energy[name])
            original = lin.weight.data
            for tag in [tag_of(b) for b in spec.bits] + menu[name]:
                lin.weight.data = qweights[tag][name].dequantize(original.dtype)  # [out, in]
                try:
                    entry[f"kld_{tag}"] = scorer.mean_kld(
                        _run_from(blocks, i, block_in[i], ctx, spec.batch_size))
                finally:
                    lin.weight.data = original
                bar.update()
            layers[name] = entry
        log.info("block %d/%d measured (%.0fs)", i + 1, len(blocks), time.perf_counter() - t0)
    bar.close()

    extra = {"tokens_scored": scorer.tokens}
    if validate_ids is not None:
        extra["validation"] = _validate(calib, infos, layers, blocks, by_block, prefix,
                                        (model, validate_ids), spec)
    return _write(spec, calib, infos, layers, extra, t0)


def _write(spec: SensitivitySpec, calib: Calibration, infos: dict, layers: dict, extra: dict,
           t0: float) -> SensitivityResult:
    """Check every calibrated layer was measured, then write the file (atomically)."""
    missing = sorted(set(infos) - set(layers))
    if missing:  # fail loudly: a plan over unmeasured layers would be silently wrong
        raise ValueError(f"{len(missing)} calibrated layers were not measured, e.g. "
                         f"{missing[:3]}: their names do not match the model's blocks")
    data = {
        "version": SENSITIVITY_VERSION,
        "calibration": calibration_identity(calib),
        "settings": spec.settings(),
        "seconds": time.perf_counter() - t0,
        "spearman": _correlations(layers, spec.bits),
        **extra,  # tokens_scored; validation, or the streamed method's gains
        "layers": layers,
    }
    write_json_atomic(spec.path, data)
    return SensitivityResult(spec.path, data, reused=False)


def _auto_stream(spec: SensitivitySpec) -> bool:
    """The method when none was asked for: the one an existing file was measured with (so a
    resumed `run` reuses it even if the free memory changed since), else block by block when
    the FP model would not fit (:func:`_needs_streaming`)."""
    if spec.path.is_file() and not spec.force:
        try:
            settings = json.loads(spec.path.read_text(encoding="utf-8")).get("settings")
        except (ValueError, AttributeError):  # not JSON / not an object: _existing says so
            settings = None
        for stream in (False, True):
            if settings == replace(spec, stream=stream).settings():
                return stream
    return _needs_streaming(read_calibration(spec.calib_dir))


def _needs_streaming(calib: Calibration) -> bool:
    """Whether the FP model in fp32 (twice its fp16 shards) would not fit in memory
    (quantpipe.core.heap.fits_in_memory): then it is measured block by block."""
    need = 2 * weights_bytes(calib.fp16_dir)
    fits, have = fits_in_memory(need)
    if not fits:
        log.info("sensitivity: block by block (the FP model in fp32 needs ~%.1f GiB, %.1f GiB "
                 "available)", need / 2**30, have / 2**30)
    return not fits


def _measure_streamed(spec: SensitivitySpec, calib: Calibration, infos: dict,
                      input_ids: torch.Tensor | None, t0: float) -> SensitivityResult:
    """The block-by-block measurement (sensitivity_stream), written like the whole-model one.
    It saves its state after each block beside the output file (stream_progress) and takes a
    killed run's state up where the settings, calibration and tokens are the same; the file's
    ``seconds`` are then those of every run together."""
    from quantpipe.calibration.mixed_precision.sensitivity_stream import measure_streamed
    from quantpipe.calibration.mixed_precision.stream_progress import (
        StreamProgress,
        tokens_sha256,
    )

    _check_fp16_source(calib, spec)
    if input_ids is None:
        input_ids = _calibration_ids(calib.fp16_dir, spec)  # every record: no validation
    progress = StreamProgress(spec.path, {
        "settings": spec.settings(), "calibration": calibration_identity(calib),
        "tokens_sha256": tokens_sha256(input_ids), "batch_size": spec.batch_size})
    if spec.force:
        progress.discard()
    layers, extra = measure_streamed(spec, calib, infos, input_ids,
                                     _measured_entries(spec, infos), progress)
    before = extra.get("resumed", {}).get("seconds_before", 0.0)
    result = _write(spec, calib, infos, layers, extra, t0 - before)
    progress.discard()
    return result


def _measured_entries(spec: SensitivitySpec, infos: dict) -> dict[str, list[str]]:
    """layer -> the menu tags measured on it (``spec.entries`` it has)."""
    if spec.entries == ("all",):
        return {n: [t for t in v if is_menu_tag(t)] for n, v in infos.items()}
    wanted = parse_menu(spec.entries)
    return {n: [t for t in wanted if t in v] for n, v in infos.items()}


def _checkpoints(path: list[tuple[str, int | None, float]], start_bits: float, step: float,
                 max_bits: float) -> list[int]:
    """Move counts k (0 = all-INT4) at which the whole model is scored: the first move that
    reaches each next multiple of ``step`` above the all-INT4 bits, while the bits stay
    <= ``max_bits`` (so a checkpoint's bits are exact, never interpolated)."""
    out = [0]
    next_bits = start_bits + step
    for k, (_name, _to, bits) in enumerate(path, start=1):
        if bits > max_bits * (1 + 1e-12):
            break
        if bits >= next_bits - 1e-12:
            out.append(k)
            next_bits = start_bits + step * (int((bits - start_bits) / step + 1e-9) + 1)
    return out


def _validate(calib: Calibration, infos: dict, layers: dict, blocks, by_block: list[list[str]],
              prefix: str, model_ids: tuple, spec: SensitivitySpec) -> dict:
    """Score the whole mixed model on the held-out split along the planner's upgrade path
    (from the cheapest entries over every entry) and, where the calibration has a menu, along
    the path from uniform INT4 over INT4 / INT8 / FP16 only (``primary``: the plan keeps the
    better of the two at its budget, calibration.mixed_precision.plan.apply_validation)."""

    model, ids = model_ids
    names = [n for group in by_block for n in group]
    shapes = {n: tuple(infos[n]["w4"]["shape"]) for n in names}
    specs_of = layer_specs({n: infos[n] for n in names})
    damage = {n: menu_damage(infos[n], layers[n]["kld_w4"], layers[n]["kld_w8"], layers[n])
              for n in names}
    total = sum(o * i for o, i in shapes.values())
    block_of = {n: i for i, group in enumerate(by_block) for n in group}

    def linear(n):
        return blocks[block_of[n]].get_submodule(n[len(f"{prefix}.{block_of[n]}.") :])

    hidden0, ctx = embed_inputs(model, ids)
    scorer = Scorer(partial(head_logits, model),
                     _run_from(blocks, 0, hidden0, ctx, spec.batch_size), spec.chunk_rows)
    originals = {n: linear(n).weight.data for n in names}

    def walk(specs: dict, label: str) -> dict:
        """Walk the upgrade path over ``specs`` from its start; the whole model scored at
        every checkpoint."""
        path = upgrade_path(names, shapes, specs, damage)
        first = start_state(names, shapes, specs, damage)
        start_bits = sum(bits_per_weight(specs[n][first[n]], shapes[n]) * shapes[n][0]
                         * shapes[n][1] for n in names) / total
        ks = _checkpoints(path, start_bits, spec.validate_step, spec.validate_max_bits)
        for group in by_block:  # the start first, one block's weights at a time
            for n, w in calib.weights({n: first[n] for n in group}).items():
                linear(n).weight.data = w.dequantize(originals[n].dtype)
        state, done, checkpoints = dict(first), 0, []
        for k in tqdm(ks, desc=f"sensitivity: validate {label}", unit="checkpoint"):
            for n, to, _bits in path[done:k]:
                state[n] = to
                linear(n).weight.data = (originals[n] if to is None else
                                         calib.weights({n: to})[n].dequantize(originals[n].dtype))
            done = k
            kld = scorer.mean_kld(_run_from(blocks, 0, hidden0, ctx, spec.batch_size))
            checkpoints.append({"moves": k, "bits": path[k - 1][2] if k else start_bits,
                                "predicted": sum(damage[n][b] for n, b in state.items()),
                                "validated": kld})
            log.info("validation (%s): %.4f bits per weight, KLD %.4g (predicted %.4g)", label,
                     checkpoints[-1]["bits"], kld, checkpoints[-1]["predicted"])
        return {"path": [[n, to] for n, to, _ in path[: ks[-1]]], "checkpoints": checkpoints}

    try:
        out = {"tokens_scored": scorer.tokens, "split": SPLIT, **walk(specs_of, "plan")}
        primary = primary_entries(specs_of)
        if primary != specs_of:  # a menu: the path without it too, from uniform INT4
            out["primary"] = walk(primary, "INT4/INT8/FP16 plan")
            c0 = out["primary"]["checkpoints"][0]
            out["int4"] = {"bits": c0["bits"], "validated": c0["validated"]}
    finally:
        for n, w in originals.items():
            linear(n).weight.data = w
    return out


def _run_from(blocks, i: int, hidden: torch.Tensor, ctx: BlockContext,
              batch_size: int) -> torch.Tensor:
    """Blocks i..end on the cached FP input of block i -> final hidden [n, L, d]."""
    for j in range(i, len(blocks)):
        hidden = run_block(blocks[j], hidden, ctx.for_layer(j), batch_size)
    return hidden


def _correlations(layers: dict[str, dict], bits: tuple[int, ...]) -> dict[str, float]:
    """Spearman rho of each proxy against the measured KLD, per measured precision."""
    if len(layers) < 2:
        return {}
    out = {}
    for b in bits:
        kld = [v[f"kld_w{b}"] for v in layers.values()]
        for proxy in ("proxy", "proxy_norm"):
            out[f"{proxy}_w{b}"] = spearman([v[f"{proxy}_w{b}"] for v in layers.values()], kld)
    return out

