"""The precision plan: bits accounting, budget feasibility, overrides, greedy vs exact optimum.

A synthetic stand-in for ``calibration.artifact.Calibration`` (``folder`` + ``layer_infos()``)
keeps these tests free of models: make_plan only reads those two.
"""

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from quantpipe.calibration.mixed_precision.plan import (
    PlanSpec,
    apply_validation,
    bits_per_weight,
    greedy_budget_plan,
    make_plan,
    upgrade_path,
)
from quantpipe.calibration.mixed_precision.sensitivity import SENSITIVITY_FILE
from quantpipe.core.formats.native import quantized_tensors
from quantpipe.core.qformat import INT8_PER_CHANNEL, QuantizedWeight, QuantSpec


@dataclass
class FakeCalibration:
    folder: Path
    infos: dict

    def layer_infos(self) -> dict:
        return self.infos


def _infos(shapes: dict[str, tuple[int, int]], int4: QuantSpec, loss4=None, loss8=None) -> dict:
    out = {}
    for k, (name, shape) in enumerate(shapes.items()):
        out[name] = {
            "w4": {"spec": int4.to_dict(), "shape": list(shape),
                   "loss": (loss4 or {}).get(name, 1.0 + k)},
            "w8": {"spec": INT8_PER_CHANNEL.to_dict(), "shape": list(shape),
                   "loss": (loss8 or {}).get(name, 0.01 * (1.0 + k))},
        }
    return out


def _model_layers(n_blocks=2, d=64, ff=128):
    shapes = {}
    for i in range(n_blocks):
        p = f"model.layers.{i}"
        for lin, shape in (("self_attn.q_proj", (d, d)), ("self_attn.k_proj", (d // 2, d)),
                           ("self_attn.v_proj", (d // 2, d)), ("self_attn.o_proj", (d, d)),
                           ("mlp.gate_proj", (ff, d)), ("mlp.up_proj", (ff, d)),
                           ("mlp.down_proj", (d, ff))):
            shapes[f"{p}.{lin}"] = shape
    return shapes


def _write_sensitivity(folder: Path, kld: dict[str, tuple[float, float]], rho: float = 0.9,
                       validation: dict | None = None):
    layers = {n: {"kld_w4": a, "kld_w8": b} for n, (a, b) in kld.items()}
    data = {"version": 1, "spearman": {"proxy_w4": rho}, "layers": layers}
    if validation is not None:
        data["validation"] = validation
    (folder / SENSITIVITY_FILE).write_text(json.dumps(data))


# --- bits arithmetic -------------------------------------------------------------------


@pytest.mark.parametrize("spec, shape, expected", [
    (QuantSpec(4, 64, True), (576, 576), 4 + 16 / 64),  # 4.25: SmolLM2 g64 fallback
    (QuantSpec(4, 128, True), (1536, 576 * 2), 4.125),
    (QuantSpec(4, 128, False), (128, 256), 4 + 16 / 128 + 8 / 128),  # asym: + uint8 zero
    (QuantSpec(4, 128, True, act_order=True), (64, 256), 4 + 0.125 + 32 / 64),  # + g_idx
    (QuantSpec(4, 32, False, act_order=True), (128, 64), 4 + 0.5 + 0.25 + 0.25),
    (INT8_PER_CHANNEL, (64, 256), 8 + 16 / 256),  # one fp16 scale per row
    (None, (64, 256), 16.0),
])
def test_bits_per_weight_by_hand(spec, shape, expected):
    assert bits_per_weight(spec, shape) == pytest.approx(expected, abs=0, rel=1e-15)


@pytest.mark.parametrize("spec", [QuantSpec(4, 32, True), QuantSpec(4, 64, False),
                                  QuantSpec(4, 32, False, act_order=True),
                                  QuantSpec(8, -1, True)])
def test_bits_per_weight_matches_native_tensor_bytes(spec):
    """The accounting equals the bytes the native format really stores for the layer."""
    out_f, in_f = 48, 128
    g = spec.n_groups(in_f)
    qw = QuantizedWeight(
        spec, torch.randint(0, 2**spec.bits, (out_f, in_f), dtype=torch.uint8),
        torch.rand(out_f, g).half() + 0.1,
        torch.full((out_f, g), spec.sym_zero, dtype=torch.uint8),
        (torch.randperm(in_f) % g).to(torch.int32) if spec.act_order else None,
    )
    stored_bits = 8 * sum(t.numel() * t.element_size()
                          for t in quantized_tensors("x", qw).values())
    assert stored_bits / (out_f * in_f) == bits_per_weight(spec, (out_f, in_f))


def test_effective_bits_mixture_by_hand(tmp_path):
    shapes = {"a": (64, 128), "b": (128, 128), "c": (32, 256)}
    calib = FakeCalibration(tmp_path, _infos(shapes, QuantSpec(4, 32, True)))
    plan = make_plan(calib, PlanSpec(overrides=("b=fp16", "c=8")))
    # a: 8192 x (4 + 16/32) ; b: 16384 x 16 ; c: 8192 x (8 + 16/256)
    expected = (8192 * 4.5 + 16384 * 16 + 8192 * 8.0625) / (8192 + 16384 + 8192)
    assert plan.effective_bits() == pytest.approx(expected, rel=1e-15)
    assert plan.counts() == {"int4": 1, "int8": 1, "fp16": 1}
    d = plan.to_dict()
    assert d["layers"]["b"]["bits"] is None and d["layers"]["c"]["bits_per_weight"] == 8.0625
    assert "effective bits per weight" in plan.table()


# --- budget feasibility ----------------------------------------------------------------


def test_budget_below_minimum_and_above_16(tmp_path):
    shapes = _model_layers()
    calib = FakeCalibration(tmp_path, _infos(shapes, QuantSpec(4, 64, True)))
    _write_sensitivity(tmp_path, {n: (1.0, 0.1) for n in shapes})
    with pytest.raises(ValueError, match=r"below the minimum 4\.2500"):
        make_plan(calib, PlanSpec(budget_bits=4.2))
    with pytest.raises(ValueError, match=r"range a plan can reach, \(4, 16\]"):
        PlanSpec(budget_bits=16.5)
    for below in (0, 1, 4):  # INT4 alone is 4 bits per weight before its scales
        with pytest.raises(ValueError, match=rf"--budget-bits {below} is outside the range"):
            PlanSpec(budget_bits=below)
    # exactly the minimum: all INT4; 16: everything that still gains goes to FP16
    assert set(make_plan(calib, PlanSpec(budget_bits=4.25)).bits.values()) == {4}
    top = make_plan(calib, PlanSpec(budget_bits=16))
    assert set(top.bits.values()) == {None} and top.effective_bits() == 16.0
    # overrides count against the budget: FP16 everywhere but one layer leaves no room
    over = make_plan(calib, PlanSpec(budget_bits=5.0, overrides=("model.layers.0.mlp.up_proj=8",)))
    assert over.effective_bits() <= 5.0 + 1e-12
    assert over.bits["model.layers.0.mlp.up_proj"] == 8
    with pytest.raises(ValueError, match="below the minimum"):
        make_plan(calib, PlanSpec(budget_bits=5.0, overrides=("re:.*mlp.*=fp16",)))


def test_budget_plan_uses_budget_and_reports_exact_bits(tmp_path):
    shapes = _model_layers()
    calib = FakeCalibration(tmp_path, _infos(shapes, QuantSpec(4, 64, True)))
    _write_sensitivity(tmp_path, {n: (1.0 + k, 0.01) for k, n in enumerate(shapes)})
    plan = make_plan(calib, PlanSpec(budget_bits=5.0))
    total = sum(o * i for o, i in shapes.values())
    by_hand = sum(bits_per_weight(plan.specs[n], s) * s[0] * s[1]
                  for n, s in shapes.items()) / total
    assert plan.effective_bits() == by_hand <= 5.0
    assert plan.damage_source.startswith("measured")
    assert plan.counts()["int4"] < len(shapes)
    assert all(r == "budget" for r in plan.reasons.values())


# --- overrides ------------------------------------------------------------------------


def test_override_precedence_first_match_wins(tmp_path):
    shapes = _model_layers()
    calib = FakeCalibration(tmp_path, _infos(shapes, QuantSpec(4, 32, True)))
    plan = make_plan(calib, PlanSpec(bits=4, overrides=(
        "model.layers.0.mlp.down_proj=fp16",  # exact name first
        r"re:.*down_proj=8",  # then every other down_proj
        r"re:model\.layers\.1\..*=fp16",  # block 1 except what was matched above
        r"re:.*q_proj=8",  # block 0 q_proj only (block 1's was taken by the rule above)
    )))
    assert plan.bits["model.layers.0.mlp.down_proj"] is None
    assert plan.bits["model.layers.1.mlp.down_proj"] == 8
    assert plan.bits["model.layers.1.self_attn.q_proj"] is None
    assert plan.bits["model.layers.0.self_attn.q_proj"] == 8
    assert plan.bits["model.layers.0.mlp.up_proj"] == 4
    assert plan.reasons["model.layers.0.mlp.up_proj"] == "default"
    assert plan.reasons["model.layers.1.mlp.down_proj"] == r"override re:.*down_proj"
    # fullmatch, not search: "q_proj" alone matches no full layer name
    with pytest.raises(ValueError, match="matches no calibrated layer"):
        make_plan(calib, PlanSpec(overrides=("re:q_proj=8",)))


@pytest.mark.parametrize("text, msg", [("q_proj", "must look like"), ("a=3", "must be 4, 8"),
                                       ("re:(=8", "bad regex")])
def test_override_parse_errors(text, msg):
    with pytest.raises(ValueError, match=msg):
        PlanSpec(overrides=(text,))


# --- damage source rule ---------------------------------------------------------------


def test_damage_source_rule(tmp_path):
    shapes = _model_layers(n_blocks=1)
    calib = FakeCalibration(tmp_path, _infos(shapes, QuantSpec(4, 32, True)))
    with pytest.raises(ValueError, match="quantpipe sensitivity"):
        make_plan(calib, PlanSpec(budget_bits=5.0))  # auto, nothing measured
    proxy = make_plan(calib, PlanSpec(budget_bits=5.0, damage="proxy"))  # unvalidated: warns
    assert proxy.damage_source.startswith("proxy")
    _write_sensitivity(tmp_path, {n: (1.0, 0.1) for n in shapes}, rho=0.5)
    assert make_plan(calib, PlanSpec(budget_bits=5.0)).damage_source.startswith("measured")
    with pytest.raises(ValueError, match="ranks layers poorly"):
        make_plan(calib, PlanSpec(budget_bits=5.0, damage="proxy"))
    _write_sensitivity(tmp_path, {n: (1.0, 0.1) for n in shapes}, rho=0.85)
    assert make_plan(calib, PlanSpec(budget_bits=5.0, damage="proxy")).damage_source.startswith(
        "proxy")
    _write_sensitivity(tmp_path, {n: (1.0, 0.1) for n in list(shapes)[1:]})
    with pytest.raises(ValueError, match="lacks INT4/INT8 KLD"):
        make_plan(calib, PlanSpec(budget_bits=5.0, damage="kld"))


# --- greedy vs exact ------------------------------------------------------------------


def _exact(free, shapes, specs_of, damage, budget):
    """Exhaustive optimum over all 3**n precision assignments (the exact knapsack)."""
    total = sum(o * i for o, i in shapes.values())
    best, best_choice = float("inf"), None
    for choice in itertools.product((4, 8, None), repeat=len(free)):
        bits = sum(bits_per_weight(specs_of[n][b], shapes[n]) * shapes[n][0] * shapes[n][1]
                   for n, b in zip(free, choice))
        if bits > budget * total * (1 + 1e-12):
            continue
        d = sum(damage[n][b] for n, b in zip(free, choice))
        if d < best:
            best, best_choice = d, dict(zip(free, choice))
    return best, best_choice


def _instance(rng: random.Random, n: int, same_shape: bool):
    int4 = QuantSpec(4, 32, True)
    sizes = [(64, 64), (32, 64), (128, 64), (64, 128), (96, 32)]
    shapes = {f"l{k}": sizes[0] if same_shape else rng.choice(sizes) for k in range(n)}
    specs_of = {k: {4: int4, 8: INT8_PER_CHANNEL, None: None} for k in shapes}
    damage = {}
    for k in shapes:
        d4 = rng.lognormvariate(0, 1.5)
        d8 = d4 * rng.uniform(0.001, 0.9)  # often non-convex (d8 close to d4)
        damage[k] = {4: d4, 8: d8, None: 0.0}
    return shapes, specs_of, damage


def _damage_of(choice, damage):
    return sum(damage[n][b] for n, b in choice.items())


def test_greedy_within_bound_of_exact_on_random_instances():
    """greedy <= exact + largest single-move gain (the LP argument in the docstring)."""
    rng = random.Random(0)
    equal = 0
    for trial in range(60):
        n = rng.randint(2, 6)
        shapes, specs_of, damage = _instance(rng, n, same_shape=False)
        free = list(shapes)
        total = sum(o * i for o, i in shapes.values())
        lo = sum(bits_per_weight(specs_of[k][4], shapes[k]) * o * i
                 for k, (o, i) in shapes.items()) / total
        budget = rng.uniform(lo, 16.0)
        chosen = greedy_budget_plan(free, shapes, specs_of, damage, {}, budget)
        used = sum(bits_per_weight(specs_of[k][b], shapes[k]) * shapes[k][0] * shapes[k][1]
                   for k, b in chosen.items()) / total
        assert used <= budget + 1e-9
        g = _damage_of(chosen, damage)
        opt, _ = _exact(free, shapes, specs_of, damage, budget)
        max_gain = max(damage[k][4] for k in free)  # no single move gains more than d4 - 0
        assert opt - 1e-12 <= g <= opt + max_gain + 1e-12, (trial, g, opt)
        equal += abs(g - opt) <= 1e-12 * max(1.0, opt)
    assert equal >= 30  # on most instances the greedy is exactly optimal


def test_greedy_exact_on_uniform_convex_instances():
    """Equal shapes, FP16 gains nothing over INT8, budget = k INT8 upgrades: greedy is optimal."""
    rng = random.Random(1)
    for _ in range(20):
        n = rng.randint(3, 6)
        shapes, specs_of, damage = _instance(rng, n, same_shape=True)
        for k in damage:
            damage[k][None] = damage[k][8]  # 8 -> 16 buys nothing: convex, never taken
        o, i = shapes["l0"]
        c4 = bits_per_weight(specs_of["l0"][4], (o, i))
        c8 = bits_per_weight(specs_of["l0"][8], (o, i))
        k_up = rng.randint(0, n)
        budget = c4 + k_up * (c8 - c4) / n
        chosen = greedy_budget_plan(list(shapes), shapes, specs_of, damage, {}, budget)
        opt, _ = _exact(list(shapes), shapes, specs_of, damage, budget)
        assert _damage_of(chosen, damage) == pytest.approx(opt, rel=1e-12, abs=1e-15)
        assert sum(b == 8 for b in chosen.values()) == k_up


# --- upgrade path and validation --------------------------------------------------------


def test_upgrade_path_prefixes_are_the_greedy_plans():
    """The greedy plan at exactly the bits of the path's first k moves is those k moves."""
    rng = random.Random(2)
    for _ in range(30):
        shapes, specs_of, damage = _instance(rng, rng.randint(2, 7), same_shape=False)
        free = list(shapes)
        path = upgrade_path(free, shapes, specs_of, damage)
        assert [b for _, _, b in path] == sorted(b for _, _, b in path)
        for k in range(len(path) + 1):
            state = dict.fromkeys(free, 4)
            for n, to, _ in path[:k]:
                state[n] = to
            total = sum(o * i for o, i in shapes.values())
            bits = sum(bits_per_weight(specs_of[n][b], shapes[n]) * shapes[n][0] * shapes[n][1]
                       for n, b in state.items()) / total
            if k:
                assert path[k - 1][2] == pytest.approx(bits, rel=1e-12)
            assert greedy_budget_plan(free, shapes, specs_of, damage, {}, bits) == state


def _validated_setup(tmp_path, validated: list[float]):
    """A model whose layers' damages give a path; checkpoints after 0, 2, 4, ... moves."""
    shapes = _model_layers()
    int4 = QuantSpec(4, 64, True)
    calib = FakeCalibration(tmp_path, _infos(shapes, int4))
    kld = {n: (1.0 + k, 0.01) for k, n in enumerate(shapes)}
    specs_of = {n: {4: int4, 8: INT8_PER_CHANNEL, None: None} for n in shapes}
    damage = {n: {4: a, 8: b, None: 0.0} for n, (a, b) in kld.items()}
    path = upgrade_path(list(shapes), shapes, specs_of, damage)
    start = make_plan(calib, PlanSpec()).effective_bits()
    ks = [2 * i for i in range(len(validated))]
    checkpoints = [{"moves": k, "bits": path[k - 1][2] if k else start, "predicted": 0.0,
                    "validated": v} for k, v in zip(ks, validated)]
    validation = {"tokens_scored": 8, "path": [[n, b] for n, b, _ in path[: ks[-1]]],
                  "checkpoints": checkpoints}
    _write_sensitivity(tmp_path, kld, validation=validation)
    return calib, path, checkpoints


def test_validation_stops_upgrading_where_it_stops_improving(tmp_path):
    calib, path, cps = _validated_setup(tmp_path, [1.0, 0.6, 0.4, 0.45, 0.5, 0.3])
    # budget up to the 5th checkpoint: the best within it is the 3rd (4 moves)
    plan = make_plan(calib, PlanSpec(budget_bits=cps[4]["bits"]))
    want = dict.fromkeys(plan.bits, 4)
    for n, b, _ in path[:4]:
        want[n] = b
    assert plan.bits == want and plan.validated_damage == 0.4
    assert "stopped improving" in plan.validation
    assert plan.effective_bits() == pytest.approx(cps[2]["bits"], rel=1e-12)
    assert plan.to_dict()["validated_damage"] == 0.4 and "validated KLD" in plan.table()
    # the whole path within the budget: the last checkpoint is the best, the greedy plan stays
    plain = tmp_path / "unvalidated"
    plain.mkdir()
    _write_sensitivity(plain, {n: (1.0 + k, 0.01) for k, n in enumerate(calib.infos)})

    def greedy(budget):
        return make_plan(FakeCalibration(plain, calib.infos), PlanSpec(budget_bits=budget))

    budget = cps[-1]["bits"] + 0.3
    plan = make_plan(calib, PlanSpec(budget_bits=budget))
    assert plan.validated_damage == 0.3 and "last checkpoint" in plan.validation
    assert plan.bits == greedy(budget).bits and plan.effective_bits() > cps[-1]["bits"]
    assert greedy(budget).validated_damage is None
    # between checkpoints, still improving: the greedy plan for the budget, not a prefix
    mid = (cps[1]["bits"] + cps[2]["bits"]) / 2
    plan = make_plan(calib, PlanSpec(budget_bits=mid))
    assert plan.validated_damage == 0.6 and plan.bits == greedy(mid).bits
    assert cps[1]["bits"] < plan.effective_bits() <= mid


def test_a_rise_within_the_stop_margin_does_not_stop_the_plan(tmp_path):
    """The held-out split is small: the last checkpoint within the budget scoring less than
    STOP_MARGIN above the lowest keeps the greedy plan for the whole budget; more stops it."""
    from quantpipe.calibration.mixed_precision.plan import STOP_MARGIN

    lowest = 0.4
    for rise, stops in ((0.5 * STOP_MARGIN, False), (2 * STOP_MARGIN, True)):
        sub = tmp_path / str(rise)
        sub.mkdir()
        calib, path, cps = _validated_setup(sub, [1.0, 0.6, lowest, lowest * (1 + rise)])
        plan = make_plan(calib, PlanSpec(budget_bits=cps[3]["bits"]))
        if stops:
            assert "stopped improving" in plan.validation and plan.validated_damage == lowest
            assert plan.effective_bits() == pytest.approx(cps[2]["bits"], rel=1e-12)
        else:
            assert f"within {STOP_MARGIN:.0%} of the lowest" in plan.validation
            assert plan.validated_damage == pytest.approx(lowest * (1 + rise))
            assert plan.effective_bits() == pytest.approx(cps[3]["bits"], rel=1e-12)


def test_validation_not_applied_when_it_does_not_describe_the_plan(tmp_path):
    calib, path, cps = _validated_setup(tmp_path, [1.0, 0.6, 0.4, 0.45])
    budget = cps[3]["bits"]
    plan = make_plan(calib, PlanSpec(budget_bits=budget, overrides=(f"{path[-1][0]}=4",)))
    assert plan.validated_damage is None and "overrides" in plan.validation
    plan = make_plan(calib, PlanSpec(budget_bits=budget, damage="proxy"))
    assert plan.validated_damage is None
    # a path that is not the one the damages give (e.g. sensitivity measured again)
    data = json.loads((tmp_path / SENSITIVITY_FILE).read_text())
    data["validation"]["path"] = data["validation"]["path"][::-1]
    (tmp_path / SENSITIVITY_FILE).write_text(json.dumps(data))
    plan = make_plan(calib, PlanSpec(budget_bits=budget))
    assert plan.validated_damage is None and "is not the one validated" in plan.validation
    chosen = {"a": 4}
    assert apply_validation(None, chosen, {}, {}, {}, {}, 5.0)[:2] == (chosen, None)
