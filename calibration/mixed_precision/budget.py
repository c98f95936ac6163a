"""The bit accounting and the upgrade order that the precision plan and the sensitivity
validation share: each layer moves along INT4 -> INT8 -> FP16, a move costs the extra bits
the checkpoint format stores (:func:`quantpipe.core.formats.registry.layer_bits`) and buys a
drop in predicted damage; moves are taken by decreasing drop per bit
(:func:`greedy_budget_plan` says why that is nearly optimal).
"""

from __future__ import annotations

from quantpipe.core.formats import registry
from quantpipe.core.qformat import QuantSpec

FP16 = None  # the plan's value for "keep this layer in FP16"
DEFAULT_FORMAT = registry.FORMAT_NAMES[0]  # whose layout counts the bits unless told otherwise


def bits_per_weight(spec: QuantSpec | None, shape: tuple[int, int],
                    fmt: str = DEFAULT_FORMAT) -> float:
    """Stored bits per weight of one layer in format ``fmt`` (every tensor written for it over
    its weights; FP16 layers: 16)."""
    return registry.bits_per_weight(spec, shape, fmt)


def upgrade_path(
    free: list[str],
    shapes: dict[str, tuple[int, int]],
    specs_of: dict[str, dict[int | None, QuantSpec | None]],
    damage: dict[str, dict[int | None, float]],
    fmt: str = DEFAULT_FORMAT,
) -> list[tuple[str, int | None, float]]:
    """Every upgrade the budget planner would buy with an unlimited budget, in the order it
    buys them, starting from all-INT4 with no overrides: (layer, new precision, effective
    bits per weight after the move). The greedy plan for a budget B is the longest prefix
    whose bits fit B, plus smaller later moves that still fit (:func:`greedy_budget_plan`)."""
    params = {n: shapes[n][0] * shapes[n][1] for n in free}
    total = sum(params.values())
    used = sum(registry.layer_bits(specs_of[n][4], shapes[n], fmt) for n in free)
    out = []
    for ratio, n, _frm, to, extra in _hull_moves(free, shapes, specs_of, damage, fmt):
        if ratio <= 0:
            break
        used += extra
        out.append((n, to, used / total))
    return out


def _hull_moves(free, shapes, specs_of, damage,
                fmt: str) -> list[tuple[float, str, int, int | None, float]]:
    """(ratio, layer, from, to, extra stored bits) sorted by decreasing damage drop per bit;
    see :func:`greedy_budget_plan` for why these moves and this order."""

    def cost(n, b):
        return registry.layer_bits(specs_of[n][b], shapes[n], fmt)

    moves = []
    for n in free:
        d4, d8, d16 = damage[n][4], damage[n][8], damage[n][None]
        c4, c8, c16 = cost(n, 4), cost(n, 8), cost(n, None)
        r48 = (d4 - d8) / (c8 - c4)
        r816 = (d8 - d16) / (c16 - c8)
        if r816 > r48:  # INT8 not on the lower hull: FP16 at once is the better rate
            moves.append(((d4 - d16) / (c16 - c4), n, 4, None, c16 - c4))
        else:
            moves.append((r48, n, 4, 8, c8 - c4))
            moves.append((r816, n, 8, None, c16 - c8))
    # stable order: ties broken by layer order, so equal inputs give equal plans
    moves.sort(key=lambda m: -m[0])
    return moves


def greedy_budget_plan(
    free: list[str],
    shapes: dict[str, tuple[int, int]],
    specs_of: dict[str, dict[int | None, QuantSpec | None]],
    damage: dict[str, dict[int | None, float]],
    fixed: dict[str, int | None],
    budget: float,
    fmt: str = DEFAULT_FORMAT,
) -> dict[str, int | None]:
    """Greedy multiple-choice knapsack: one precision per free layer, average bits <= budget.

    Each layer moves along INT4 -> INT8 -> FP16. A move costs extra stored bits
    (params x delta bits-per-weight) and buys a drop in predicted damage.

    Why greedy by ratio is (nearly) right: relax "one precision per layer" to fractions of a
    layer. That LP's optimum lies on each layer's lower convex hull of (bits, damage) points,
    and is found by taking hull moves in decreasing order of damage drop per bit until the
    budget is reached, the last move taken fractionally (Sinha & Zoltners 1979, the
    multiple-choice knapsack LP). So:
    - a layer whose INT8 point is above the chord INT4 -> FP16 (``r816 > r48``) is not on the
      hull; its two moves are merged into the jump 4 -> 16 at the average ratio (the greedy
      never takes 8 -> 16 before 4 -> 8, which is what makes the sorted order a valid plan);
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

    used = sum(cost(n, b) for n, b in fixed.items()) + sum(cost(n, 4) for n in free)
    limit = budget * total_params
    min_bits = used / total_params
    if used > limit * (1 + 1e-12):
        raise ValueError(
            f"--budget-bits {budget} is below the minimum {min_bits:.4f} bits per weight "
            "(every free layer at INT4, with scale and zero overhead, plus overrides); use "
            f"--budget-bits >= {min_bits:.4f}, fewer INT8/FP16 overrides or a larger group size"
        )
    moves = _hull_moves(free, shapes, specs_of, damage, fmt)
    state: dict[str, int | None] = {n: 4 for n in free}
    for ratio, n, frm, to, extra in moves:
        if ratio <= 0:
            break
        if state[n] != frm:  # its previous step was not taken: this one is not reachable
            continue
        if used + extra <= limit * (1 + 1e-12):
            state[n] = to
            used += extra
    return state
