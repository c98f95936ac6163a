"""The bit accounting and the upgrade order that the precision plan and the sensitivity
validation share: each layer moves from its cheapest entry (INT4, or a cheaper menu entry)
along the lower convex hull of its entries' (bits, damage) points (INT4, menu entries, INT8,
FP16); a move costs the extra bits the checkpoint format stores
(:func:`quantpipe.core.formats.registry.layer_bits`) and buys a drop in predicted damage;
moves are taken by decreasing drop per bit (:func:`greedy_budget_plan` says why that is
nearly optimal).
"""

from __future__ import annotations

from quantpipe.calibration.menu import Entry, is_menu_tag
from quantpipe.core.formats import registry
from quantpipe.core.formats.vllm_support import ct_spec_problem, fused_group, gptq_spec_problem
from quantpipe.core.qformat import QuantSpec

FP16 = None  # the plan's value for "keep this layer in FP16"
DEFAULT_FORMAT = registry.FORMAT_NAMES[0]  # whose layout counts the bits unless told otherwise
# what each vLLM format cannot store, per layer spec (None: it can); the native format stores
# every spec
FORMAT_SPEC_PROBLEM = {"gptq": gptq_spec_problem, "compressed-tensors": ct_spec_problem}


def bits_per_weight(spec: QuantSpec | None, shape: tuple[int, int],
                    fmt: str = DEFAULT_FORMAT) -> float:
    """Stored bits per weight of one layer in format ``fmt`` (every tensor written for it over
    its weights; FP16 layers: 16)."""
    return registry.bits_per_weight(spec, shape, fmt)


def layer_specs(infos: dict[str, dict]) -> dict[str, dict[Entry, QuantSpec | None]]:
    """layer -> entry -> spec from ``Calibration.layer_infos()``: INT4 (4), the menu entries
    the layer has (their tags, in calibration order), INT8 (8) and FP16 (None)."""
    out = {}
    for n, info in infos.items():
        menu = {t: QuantSpec.from_dict(v["spec"]) for t, v in info.items() if is_menu_tag(t)}
        out[n] = {4: QuantSpec.from_dict(info["w4"]["spec"]), **menu,
                  8: QuantSpec.from_dict(info["w8"]["spec"]), None: None}
    return out


def menu_damage(info: dict, kld_w4: float, kld_w8: float, measured: dict) -> dict[Entry, float]:
    """A layer's damage per entry: the measured KLD of INT4 and INT8 (and of any menu entry
    measured, ``kld_<tag>`` in ``measured``); an unmeasured menu entry's is INT4's scaled by
    the ratio of the calibration losses tr(dW H dW^T) of that entry and INT4 (to first
    order a layer's KLD is a quadratic form in its output error, so it scales with that
    error's energy; bench/mixed_precision_menu.py checks the rule on INT8, where both are
    measured)."""
    loss4 = float(info["w4"]["loss"])
    out: dict[Entry, float] = {4: kld_w4}
    for tag, v in info.items():
        if not is_menu_tag(tag):
            continue
        key = f"kld_{tag}"
        out[tag] = (float(measured[key]) if key in measured
                    else kld_w4 * float(v["loss"]) / loss4 if loss4 > 0 else kld_w4)
    out[8], out[None] = kld_w8, 0.0
    return out


def primary_entries(specs_of: dict[str, dict[Entry, QuantSpec | None]]
                    ) -> dict[str, dict[Entry, QuantSpec | None]]:
    """``specs_of`` without the menu entries: INT4, INT8 and FP16 only (the planner before
    the menu, and the one the validation falls back to)."""
    return {n: {e: s for e, s in v.items() if e in (4, 8, None)} for n, v in specs_of.items()}


def units_for(names: list[str], fmt: str) -> list[tuple[str, ...]]:
    """The linears that must share one entry in format ``fmt``: each alone in the native
    format; in vLLM's formats (gptq, compressed-tensors) the parts of a module vLLM fuses
    (q/k/v, gate/up, a MoE block's experts) move together (vllm_support.fused_group)."""
    if fmt == DEFAULT_FORMAT:
        return [(n,) for n in names]
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(fused_group(n) or n, []).append(n)
    return [tuple(g) for g in groups.values()]


def unit_entries(unit: tuple[str, ...], specs_of: dict, damage: dict,
                 fmt: str) -> list[Entry]:
    """The entries every linear of ``unit`` has (specs and damage known) that format ``fmt``
    can store, in menu order. The calibrated INT4 (4) is always kept (the user asked for it;
    an export the format refuses says why); FP16 (None) always fits."""
    spec_problem = FORMAT_SPEC_PROBLEM.get(fmt)
    out = []
    for e in specs_of[unit[0]]:
        if not all(e in specs_of[n] and e in damage[n] for n in unit):
            continue
        if e not in (4, None) and spec_problem is not None and any(
                spec_problem(specs_of[n][e]) is not None for n in unit):
            continue
        out.append(e)
    return out


def start_state(free: list[str], shapes, specs_of, damage, fmt: str = DEFAULT_FORMAT
                ) -> dict[str, Entry]:
    """Where the budget planner starts: each unit at its cheapest entry (all-INT4 unless the
    menu has a cheaper one), the lower damage on equal bits."""
    state: dict[str, Entry] = {}
    for unit in units_for(free, fmt):
        pts = _unit_points(unit, shapes, specs_of, damage, fmt)
        state.update(dict.fromkeys(unit, pts[0][2]))
    return state


def _unit_points(unit, shapes, specs_of, damage, fmt) -> list[tuple[float, float, Entry]]:
    """(stored bits, damage, entry) of a unit's entries, by bits then damage."""
    pts = [(float(sum(registry.layer_bits(specs_of[n][e], shapes[n], fmt) for n in unit)),
            float(sum(damage[n][e] for n in unit)), e)
           for e in unit_entries(unit, specs_of, damage, fmt)]
    order = {e: i for i, (_, _, e) in enumerate(pts)}
    return sorted(pts, key=lambda p: (p[0], p[1], order[p[2]]))


def _hull(pts: list[tuple[float, float, Entry]]) -> list[tuple[float, float, Entry]]:
    """The lower convex hull of a unit's (bits, damage) points from its cheapest point on:
    the Pareto points (each strictly less damage than every cheaper one), minus those above
    the chord of their neighbours."""
    pareto = [pts[0]]
    for p in pts[1:]:
        if p[1] < pareto[-1][1] and p[0] > pareto[-1][0]:
            pareto.append(p)
    hull: list[tuple[float, float, Entry]] = []
    for p in pareto:
        # drop the last point while it lies above the chord from the one before it to p
        while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])
                                  > (p[1] - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append(p)
    return hull


def upgrade_path(
    free: list[str],
    shapes: dict[str, tuple[int, int]],
    specs_of: dict[str, dict[Entry, QuantSpec | None]],
    damage: dict[str, dict[Entry, float]],
    fmt: str = DEFAULT_FORMAT,
) -> list[tuple[str, Entry, float]]:
    """Every upgrade the budget planner would buy with an unlimited budget, in the order it
    buys them, starting from :func:`start_state` with no overrides: (layer, new entry,
    effective bits per weight after the move; a unit's linears get one row each, with the
    bits after the whole move). The greedy plan for a budget B is the longest prefix whose
    bits fit B, plus smaller later moves that still fit (:func:`greedy_budget_plan`)."""
    params = {n: shapes[n][0] * shapes[n][1] for n in free}
    total = sum(params.values())
    state = start_state(free, shapes, specs_of, damage, fmt)
    used = sum(registry.layer_bits(specs_of[n][state[n]], shapes[n], fmt) for n in free)
    out = []
    for ratio, unit, _frm, to, extra in _hull_moves(free, shapes, specs_of, damage, fmt):
        if ratio <= 0:
            break
        used += extra
        out += [(n, to, used / total) for n in unit]
    return out


def _hull_moves(free, shapes, specs_of, damage,
                fmt: str) -> list[tuple[float, tuple[str, ...], Entry, Entry, float]]:
    """(ratio, unit, from, to, extra stored bits) sorted by decreasing damage drop per bit;
    see :func:`greedy_budget_plan` for why these moves and this order."""
    moves = []
    for unit in units_for(free, fmt):
        hull = _hull(_unit_points(unit, shapes, specs_of, damage, fmt))
        for (c0, d0, e0), (c1, d1, e1) in zip(hull, hull[1:]):
            moves.append(((d0 - d1) / (c1 - c0), unit, e0, e1, c1 - c0))
    # stable order: ties broken by layer order, so equal inputs give equal plans
    moves.sort(key=lambda m: -m[0])
    return moves


def greedy_budget_plan(
    free: list[str],
    shapes: dict[str, tuple[int, int]],
    specs_of: dict[str, dict[Entry, QuantSpec | None]],
    damage: dict[str, dict[Entry, float]],
    fixed: dict[str, Entry],
    budget: float,
    fmt: str = DEFAULT_FORMAT,
) -> dict[str, Entry]:
    """Greedy multiple-choice knapsack: one entry per free layer, average bits <= budget.

    Each layer (or each unit of linears vLLM fuses, :func:`units_for`) has a set of entries,
    each a point (stored bits, predicted damage): INT4 (4), INT8 (8), FP16 (None) and the
    calibration's menu entries (calibration.menu) that the format stores. It starts at its
    cheapest entry; a move to a costlier one costs extra stored bits and buys a drop in damage.

    Why greedy by ratio is (nearly) right: relax "one entry per unit" to fractions of a
    unit. That LP's optimum lies on each unit's lower convex hull of (bits, damage) points,
    and is found by taking hull moves in decreasing order of damage drop per bit until the
    budget is reached, the last move taken fractionally (Sinha & Zoltners 1979, the
    multiple-choice knapsack LP). So:
    - entries off the hull (more bits for no less damage, or above the chord of their
      neighbours, as an INT8 whose point lies above the chord INT4 -> FP16) are never
      stopped at: the hull's moves jump over them at the chord's ratio (the greedy never
      takes a later hull move of a unit before an earlier one, since hull ratios decrease,
      which is what makes the sorted order a valid plan);
    - the LP optimum is a lower bound on the integer optimum, and the greedy prefix (every move
      before the first one that does not fit) is at most the gain of that one move above the
      LP optimum: greedy damage <= exact optimum + the largest single-move gain.
    - after that move, smaller moves later in the order are still tried, so the leftover
      budget is used as fully as the granularity of layers allows (this only lowers damage).
    The exact dynamic programme is tested against it on small instances
    (tests/calibration/test_plan.py). Moves with no gain (ratio <= 0) are never bought.
    """
    params = {n: shapes[n][0] * shapes[n][1] for n in shapes}
    total_params = sum(params.values())

    def cost(n, b):
        return registry.layer_bits(specs_of[n][b], shapes[n], fmt)

    state = start_state(free, shapes, specs_of, damage, fmt)
    used = sum(cost(n, b) for n, b in fixed.items()) + sum(cost(n, state[n]) for n in free)
    limit = budget * total_params
    min_bits = used / total_params
    if used > limit * (1 + 1e-12):
        raise ValueError(
            f"--budget-bits {budget} is below the minimum {min_bits:.4f} bits per weight "
            "(every free layer at its cheapest format, with scale and zero overhead, plus "
            f"overrides); use --budget-bits >= {min_bits:.4f}, fewer INT8/FP16 overrides or a "
            "larger group size"
        )
    for ratio, unit, frm, to, extra in _hull_moves(free, shapes, specs_of, damage, fmt):
        if ratio <= 0:
            break
        if state[unit[0]] != frm:  # its previous step was not taken: this one is not reachable
            continue
        if used + extra <= limit * (1 + 1e-12):
            state.update(dict.fromkeys(unit, to))
            used += extra
    return state
