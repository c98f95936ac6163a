"""The menu of formats: parsing, what each layer gets, the planner over many entries per layer
(greedy vs the exact knapsack, vLLM's fused modules and refused specs), and a calibration
with --menu end to end (entries equal to their own calibration, plans exported and read)."""

import itertools
import json
import random

import pytest
import torch

from quantpipe.calibration.artifact import read_calibration
from quantpipe.calibration.menu import DEFAULT_MENU, entry_of, layer_menu, parse_menu, tag_of
from quantpipe.calibration.mixed_precision.budget import (
    greedy_budget_plan,
    layer_specs,
    menu_damage,
    start_state,
    units_for,
    upgrade_path,
)
from quantpipe.calibration.mixed_precision.plan import Override, PlanSpec, make_plan
from quantpipe.calibration.mixed_precision.sensitivity import (
    SENSITIVITY_FILE,
    SensitivitySpec,
    measure_sensitivity,
)
from quantpipe.calibration.pipeline import calibrate
from quantpipe.core.formats.loader import load_quantized
from quantpipe.core.formats.registry import bits_per_weight
from quantpipe.core.qformat import INT8_PER_CHANNEL, QuantSpec
from quantpipe.stages.export import ExportSpec, export_quantized
from tests.calibration.test_pipeline import _spec, fp16_dir, prompt_file  # noqa: F401 (fixtures)

# --- parsing and per-layer entries --------------------------------------------------------


def test_parse_menu_expands_default_and_keeps_one_canonical_tag_each():
    assert parse_menu(("default",)) == DEFAULT_MENU
    assert parse_menu(("w4g32, w4g32", "none", "w4pc-asym,w8g128")) == (
        "w4g32", "w4pc-asym", "w8g128")
    assert parse_menu(()) == ()
    assert parse_menu(("w5g128,w6pc-asym",)) == ("w5g128", "w6pc-asym")
    for bad in ("w3g32", "w7g32", "w4g12", "int4", "w4g32-sym", "w4"):
        with pytest.raises(ValueError, match="menu entry"):
            parse_menu((bad,))


def test_layer_menu_offers_what_divides_and_differs_from_w4_and_w8():
    primary = (QuantSpec(4, 64, True, True), INT8_PER_CHANNEL)
    menu = ("w4g32", "w4g64", "w4g128", "w8pc", "w8g128", "w4g64-asym", "w4pc")
    got = layer_menu(menu, 576, True, primary)  # 576 = 4.5 x 128: no g128 entry
    assert got == {"w4g32": QuantSpec(4, 32, True, True),
                   "w4g64-asym": QuantSpec(4, 64, False, True),
                   "w4pc": QuantSpec(4, -1, True, True)}
    assert set(layer_menu(menu, 1536, False, primary)) == {
        "w4g32", "w4g128", "w8g128", "w4g64-asym", "w4pc"}
    # INT5 / INT6 only where the layer is whole words of the top plane (32 / 16 columns)
    assert layer_menu(("w5g16", "w6g16", "w6pc-asym"), 48, False, primary) == {
        "w6g16": QuantSpec(6, 16, True), "w6pc-asym": QuantSpec(6, -1, False)}
    assert set(layer_menu(("w5g64", "w6g64"), 576, False, primary)) == {"w5g64", "w6g64"}
    assert tag_of(4) == "w4" and tag_of(8) == "w8" and tag_of("w4g32") == "w4g32"
    assert [entry_of(t) for t in ("w4", "w8", "w4g32")] == [4, 8, "w4g32"]
    assert Override.parse("re:.*down_proj=W4G32").bits == "w4g32"
    with pytest.raises(ValueError, match="menu entry"):
        Override.parse("x=w4g33")


def test_unmeasured_entries_scale_int4_kld_by_the_loss_ratio():
    info = {"w4": {"loss": 2.0}, "w8": {"loss": 0.01}, "w4g32": {"loss": 1.0},
            "w4g16": {"loss": 0.5}}
    d = menu_damage(info, 0.4, 0.001, {"kld_w4g16": 0.05})
    assert d == {4: 0.4, "w4g32": pytest.approx(0.2), "w4g16": 0.05, 8: 0.001, None: 0.0}


# --- the planner over a menu --------------------------------------------------------------

G16, G64, PC = QuantSpec(4, 16, True), QuantSpec(4, 64, True), QuantSpec(4, -1, True)
A32 = QuantSpec(4, 32, False)
INT4 = QuantSpec(4, 32, True)


def _menu_instance(rng: random.Random, n: int):
    sizes = [(64, 64), (32, 64), (128, 64), (64, 128)]
    shapes = {f"l{k}": rng.choice(sizes) for k in range(n)}
    specs_of, damage = {}, {}
    for k in shapes:
        specs_of[k] = {4: INT4, "w4g16": G16, "w4g64": G64, "w4pc": PC, "w4g32-asym": A32,
                       8: INT8_PER_CHANNEL, None: None}
        d4 = rng.lognormvariate(0, 1.5)
        damage[k] = {4: d4, "w4g16": d4 * rng.uniform(0.3, 1.1),  # sometimes no better
                     "w4g64": d4 * rng.uniform(0.9, 2.0), "w4pc": d4 * rng.uniform(1.0, 6.0),
                     "w4g32-asym": d4 * rng.uniform(0.5, 1.2),
                     8: d4 * rng.uniform(0.001, 0.5), None: 0.0}
    return shapes, specs_of, damage


def _exact(free, shapes, specs_of, damage, budget):
    total = sum(o * i for o, i in shapes.values())
    best = float("inf")
    for choice in itertools.product(*(list(specs_of[n]) for n in free)):
        bits = sum(bits_per_weight(specs_of[n][e], shapes[n], "native") * shapes[n][0]
                   * shapes[n][1] for n, e in zip(free, choice))
        if bits <= budget * total * (1 + 1e-12):
            best = min(best, sum(damage[n][e] for n, e in zip(free, choice)))
    return best


def test_greedy_over_a_menu_within_bound_of_exact():
    """greedy <= exact + the largest single hull move's gain, on random menus with dominated
    and non-convex entries; exactly optimal on most instances."""
    rng = random.Random(3)
    equal = 0
    for trial in range(40):
        shapes, specs_of, damage = _menu_instance(rng, rng.randint(2, 4))
        free, total = list(shapes), sum(o * i for o, i in shapes.values())
        start = start_state(free, shapes, specs_of, damage)
        lo = sum(bits_per_weight(specs_of[n][start[n]], shapes[n], "native") * o * i
                 for n, (o, i) in shapes.items()) / total
        budget = rng.uniform(lo, 9.0)
        chosen = greedy_budget_plan(free, shapes, specs_of, damage, {}, budget)
        used = sum(bits_per_weight(specs_of[n][e], shapes[n], "native") * shapes[n][0]
                   * shapes[n][1] for n, e in chosen.items()) / total
        assert used <= budget + 1e-9
        g = sum(damage[n][e] for n, e in chosen.items())
        opt = _exact(free, shapes, specs_of, damage, budget)
        max_gain = max(max(damage[n].values()) for n in free)
        assert opt - 1e-12 <= g <= opt + max_gain + 1e-12, (trial, g, opt)
        equal += abs(g - opt) <= 1e-12 * max(1.0, opt)
    assert equal >= 20


def test_start_is_the_cheapest_entry_and_the_path_is_monotone():
    rng = random.Random(4)
    shapes, specs_of, damage = _menu_instance(rng, 5)
    free = list(shapes)
    start = start_state(free, shapes, specs_of, damage)
    for n, e in start.items():  # the fewest bits (one scale per row), then the least damage
        cost = {f: bits_per_weight(specs_of[n][f], shapes[n], "native") for f in specs_of[n]}
        assert cost[e] == min(cost.values()) == cost["w4pc"]
        assert damage[n][e] == min(damage[n][f] for f in cost if cost[f] == cost[e])
    path = upgrade_path(free, shapes, specs_of, damage)
    assert [b for _, _, b in path] == sorted(b for _, _, b in path)
    # no move goes to an entry that is dominated (more bits, no less damage) on its layer
    for n, e, _ in path:
        cost = bits_per_weight(specs_of[n][e], shapes[n], "native")
        assert not any(bits_per_weight(specs_of[n][f], shapes[n], "native") <= cost
                       and damage[n][f] < damage[n][e] for f in specs_of[n] if f != e)


def test_vllm_formats_plan_fused_modules_together_without_refused_entries():
    names = [f"model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj",
                                             "self_attn.v_proj", "self_attn.o_proj",
                                             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert units_for(names, "native") == [(n,) for n in names]
    assert [len(u) for u in units_for(names, "gptq")] == [3, 1, 2, 1]
    rng = random.Random(5)
    shapes = dict.fromkeys(names, (64, 64))
    specs_of, damage = {}, {}
    for n in names:
        specs_of[n] = {4: INT4, "w4g16": G16, "w4g32-asym": A32, "w5g32": QuantSpec(5, 32, True),
                       8: INT8_PER_CHANNEL, None: None}
        d4 = rng.uniform(0.5, 2.0)
        damage[n] = {4: d4, "w4g16": 0.8 * d4, "w4g32-asym": 0.1 * d4, "w5g32": 0.04 * d4,
                     8: 0.01 * d4, None: 0.0}
    for extra in (0.5, 1.5, 3.0, 6.0):  # bits per weight above each format's cheapest plan
        lo = bits_per_weight(INT4, (64, 64), "native")
        native = greedy_budget_plan(names, shapes, specs_of, damage, {}, lo + extra)
        if extra == 0.5:  # cheap and good first, then INT5 (which vLLM's formats lack: below)
            assert set(native.values()) == {"w4g32-asym", "w5g32"}
        for fmt in ("gptq", "compressed-tensors"):
            lo = bits_per_weight(INT4, (64, 64), fmt)
            plan = greedy_budget_plan(names, shapes, specs_of, damage, {}, lo + extra, fmt)
            for unit in units_for(names, fmt):
                assert len({plan[n] for n in unit}) == 1, (fmt, extra, plan)
            assert "w5g32" not in plan.values()  # INT5: native only
            if fmt == "gptq":  # vLLM's GPTQ has no zero points
                assert "w4g32-asym" not in plan.values()


# --- a calibration with a menu, end to end ------------------------------------------------

MENU = ("w4g64", "w4g16-asym", "w8g32", "w5g32", "w6g32-asym")


@pytest.fixture(scope="module")
def menu_calib(fp16_dir, prompt_file, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("menu") / "calib"
    calibrate(_spec(fp16_dir, prompt_file, out, algo="gptq", group_size=32, menu=MENU))
    measure_sensitivity(SensitivitySpec(out, tokens=64, seq_len=32, validate_tokens=64,
                                        entries=("w4g64",)))
    return read_calibration(out)


def test_menu_entries_are_what_a_calibration_at_that_spec_gives(
        menu_calib, fp16_dir, prompt_file, tmp_path):  # noqa: F811
    infos = menu_calib.layer_infos()
    assert all(set(v) == {"w4", "w8", *MENU} for v in infos.values())
    assert menu_calib.manifest["settings"]["menu"] == list(MENU)
    plain = read_calibration(calibrate(
        _spec(fp16_dir, prompt_file, tmp_path / "g64", algo="gptq", group_size=64)).out)
    # block 0's attention projections see the FP16 inputs in both runs: the menu entry, made
    # from the same Hessian after w4 and w8, equals that calibration's INT4 exactly
    first = [n for n in infos if ".0.self_attn." in n and n.rsplit(".", 1)[1] != "o_proj"]
    got = menu_calib.weights(dict.fromkeys(first, "w4g64"))
    want = plain.weights(dict.fromkeys(first, 4))
    for n in first:
        a, b = got[n], want[n]
        assert a.spec == b.spec and (a.spec.bits, a.spec.group_size, a.spec.sym) == (4, 64, True)
        assert torch.equal(a.q, b.q) and torch.equal(a.scales, b.scales)
        assert infos[n]["w4g64"]["loss"] == plain.layer_infos()[n]["w4"]["loss"]


def test_menu_plans_export_and_load_in_every_format(menu_calib, tmp_path):
    sens = json.loads((menu_calib.folder / SENSITIVITY_FILE).read_text())
    path = sens["validation"]["path"]
    assert any(isinstance(to, str) for _, to in path)  # the walk used menu entries
    # the entry asked for is measured on every layer (and planned on as measured); the others
    # are not
    infos = menu_calib.layer_infos()
    for n, v in sens["layers"].items():
        assert {k for k in v if k.startswith("kld_")} == {"kld_w4", "kld_w8", "kld_w4g64"}
        d = menu_damage(infos[n], v["kld_w4"], v["kld_w8"], v)
        assert d["w4g64"] == v["kld_w4g64"]
        assert d["w8g32"] == pytest.approx(
            v["kld_w4"] * infos[n]["w8g32"]["loss"] / infos[n]["w4"]["loss"])
    plan = make_plan(menu_calib, PlanSpec(budget_bits=5.0))
    assert plan.effective_bits() <= 5.0 and plan.validation
    # an override to a menu entry, and a plan over the menu in each format
    # (compressed-tensors refuses w4g16-asym: vLLM's kernels with zero points lack group 16)
    rule = {"native": "w4g16-asym", "gptq": None, "compressed-tensors": "w4g64"}
    with pytest.raises(ValueError, match="asymmetric with group size 16"):
        export_quantized(ExportSpec(menu_calib.folder, tmp_path / "refused",
                                    fmt="compressed-tensors",
                                    overrides=("re:.*mlp\\.down_proj=w4g16-asym",)))
    assert not (tmp_path / "refused" / "quantpipe.json").exists()
    for fmt, entry in rule.items():
        out = tmp_path / fmt
        res = export_quantized(ExportSpec(menu_calib.folder, out, fmt=fmt, budget_bits=6.0,
                                          overrides=(f"re:.*mlp\\.down_proj={entry}",)
                                          if entry else ()))
        specs = load_quantized(out).plan
        quantized = {n: s for n, s in res.plan.specs.items() if s is not None}
        assert {n: (s.bits, s.group_size, s.sym) for n, s in specs.items()} == {
            n: (s.bits, s.group_size, s.sym) for n, s in quantized.items()}
        manifest = json.loads((out / "quantpipe.json").read_text())
        assert manifest["plan"]["entries"] == res.plan.entries()
        if entry:
            assert all(res.plan.bits[n] == entry for n in res.plan.bits
                       if n.endswith("down_proj"))
    specs_of = layer_specs(menu_calib.layer_infos())
    assert all(e in specs_of[n] for n, e in plan.bits.items())


def test_plan_menu_restricts_the_entries_a_budget_may_choose(menu_calib):
    specs_of = layer_specs(menu_calib.layer_infos())
    for menu, allowed in ((("w4,w4g64", "fp16"), {4, "w4g64", None}),
                          (("w4g16-asym,w8",), {"w4g16-asym", 8})):
        for budget in (6.0, 9.0):
            plan = make_plan(menu_calib, PlanSpec(budget_bits=budget, menu=menu))
            assert set(plan.bits.values()) <= allowed, (menu, budget, plan.entries())
            assert plan.effective_bits() <= budget
    with pytest.raises(ValueError, match="menu entry"):
        PlanSpec(budget_bits=5.0, menu=("w4g33",))
    with pytest.raises(ValueError, match="no entry the calibration holds"):
        make_plan(menu_calib, PlanSpec(budget_bits=9.0, menu=("w4g128",)))
    assert all(4 in v and None in v for v in specs_of.values())


def test_sensitivity_measures_every_entry_with_all(menu_calib, tmp_path):
    out = tmp_path / "all.json"
    res = measure_sensitivity(SensitivitySpec(menu_calib.folder, tokens=64, seq_len=32,
                                              validate_tokens=0, entries=("all",), out=out))
    assert res.data["settings"]["entries"] == ["all"]
    for v in res.data["layers"].values():
        assert {k for k in v if k.startswith("kld_")} == {
            "kld_w4", "kld_w8", *(f"kld_{t}" for t in MENU)}
        assert all(v[f"kld_{t}"] >= 0 for t in MENU)
    with pytest.raises(ValueError, match="menu entry"):
        SensitivitySpec(menu_calib.folder, entries=("w4g33",))


def test_the_plan_follows_the_path_that_validates_better_on_held_out_prompts(menu_calib,
                                                                            tmp_path):
    """With a menu, the validation walks two paths: from the cheapest entries over the menu
    (here from w4g64, cheaper than the calibrated g32), and from uniform INT4 over INT4 / INT8
    / FP16 (``primary``, whose first checkpoint is uniform INT4). The plan follows the path
    whose best checkpoint within the budget validates lower."""
    sens = json.loads((menu_calib.folder / SENSITIVITY_FILE).read_text())
    val = sens["validation"]
    primary = val["primary"]
    assert primary["checkpoints"][0]["moves"] == 0 and primary["checkpoints"][0]["bits"] == (
        pytest.approx(make_plan(menu_calib, PlanSpec(bits=4)).effective_bits()))
    assert val["int4"]["validated"] == primary["checkpoints"][0]["validated"] > 0
    assert all(to in (8, None) for _, to in primary["path"])
    assert any(isinstance(to, str) for _, to in val["path"])
    from quantpipe.calibration.mixed_precision.plan import STOP_MARGIN

    def reported(checkpoints):  # (best, what the plan reports) along one path, budget 5.0
        within = [c for c in checkpoints if c["bits"] <= 5.0]
        best, last = min(c["validated"] for c in within), within[-1]["validated"]
        return best, last if last <= best * (1 + STOP_MARGIN) else best  # the stop margin

    menu, prim = reported(val["checkpoints"]), reported(primary["checkpoints"])
    normal = make_plan(menu_calib, PlanSpec(budget_bits=5.0))
    assert normal.validated_damage == min(menu, prim)[1]  # the path whose best is lower
    curves = normal.to_dict()["validation_curves"]  # what the report charts
    assert curves == {"menu's path": [[c["bits"], c["validated"]] for c in val["checkpoints"]],
                      "INT4 -> INT8 -> FP16 path": [[c["bits"], c["validated"]]
                                                     for c in primary["checkpoints"]]}
    assert make_plan(menu_calib, PlanSpec(budget_bits=5.0, fmt="gptq")).curves == {}

    def plan_with(edit) -> object:
        data = json.loads(json.dumps(sens))
        edit(data["validation"])
        (tmp_path / "sens.json").write_text(json.dumps(data))
        return make_plan(menu_calib, PlanSpec(budget_bits=5.0, sensitivity=tmp_path / "sens.json"))

    def primary_wins(v):  # the INT4 -> INT8 -> FP16 path's second checkpoint validates best
        v["primary"]["checkpoints"][1]["validated"] = -1.0

    plan = plan_with(primary_wins)
    assert "INT4 -> INT8 -> FP16 path validated better" in plan.validation
    assert plan.validated_damage == -1.0 and plan.effective_bits() <= 5.0
    assert set(plan.bits.values()) <= {4, 8, None}
    k = primary["checkpoints"][1]["moves"]  # stopped after the moves up to that checkpoint
    if primary["checkpoints"][1] is not primary["checkpoints"][-1]:
        assert {n: b for n, b in plan.bits.items() if b != 4} == dict(
            (n, b) for n, b in primary["path"][:k])

    def menu_wins(v):
        v["checkpoints"][0]["validated"] = -2.0
        for c in v["primary"]["checkpoints"]:
            c["validated"] = 1.0

    plan = plan_with(menu_wins)
    assert plan.validated_damage == -2.0 and "INT4 -> INT8" not in plan.validation
    assert any(isinstance(b, str) for b in plan.bits.values())

    def older_file(v):  # measured before the primary walk: only uniform INT4's score
        del v["primary"]
        v["int4"]["validated"] = -1.0  # better than any checkpoint of the menu's path

    plan = plan_with(older_file)
    assert "worse than uniform INT4" in plan.validation and plan.validated_damage is None
    assert set(plan.bits.values()) <= {4, 8, None} and plan.effective_bits() <= 5.0


def _tensor_bytes(folder) -> int:
    """Bytes of a checkpoint's tensors: its safetensors files less their headers."""
    total = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += f.stat().st_size - 8 - int.from_bytes(fh.read(8), "little")
    return total


@pytest.mark.parametrize("fmt,vocab", [("native", "fp16"), ("gptq", "fp16"),
                                       ("native", "int8")])
def test_budget_size_fills_a_checkpoint_size(menu_calib, tmp_path, fmt, vocab):
    """--budget-size SIZE plans the bits that SIZE leaves for the calibrated linears once the
    other tensors (as stored, or as --vocab-weights quantizes them) are counted: the tensors
    written never exceed it, and the plan spends what uniform INT4 leaves unused."""
    from quantpipe.core.vocab import VocabSpec

    uniform = export_quantized(ExportSpec(menu_calib.folder, tmp_path / "u", fmt=fmt,
                                          vocab=VocabSpec(vocab)))
    base = _tensor_bytes(tmp_path / "u")
    size = int(base * 1.15)
    res = export_quantized(ExportSpec(menu_calib.folder, tmp_path / "b", fmt=fmt,
                                      vocab=VocabSpec(vocab), budget_size=f"{size}B"))
    written = _tensor_bytes(tmp_path / "b")
    assert base < written <= size
    assert res.plan.effective_bits() > uniform.plan.effective_bits()
    # the bits it planned are exactly what the size leaves: all of it, to the bit
    params = res.plan.params
    assert written - base == pytest.approx(
        (res.plan.effective_bits() - uniform.plan.effective_bits()) * params / 8, abs=1)
    assert (size - base) * 8 / params - (
        res.plan.budget_bits - uniform.plan.effective_bits()) == pytest.approx(0, abs=1e-9)


def test_budget_size_refuses_sizes_no_plan_reaches(menu_calib, tmp_path):
    with pytest.raises(ValueError, match="not both"):
        ExportSpec(menu_calib.folder, tmp_path / "x", budget_bits=5.0, budget_size="1MB")
    with pytest.raises(ValueError, match="--budget-size"):
        ExportSpec(menu_calib.folder, tmp_path / "x", budget_size="lots")
    for size in ("1KB", "10GB"):
        with pytest.raises(ValueError, match="outside what a plan .* can write"):
            export_quantized(ExportSpec(menu_calib.folder, tmp_path / "x", budget_size=size))
        assert not (tmp_path / "x").exists()


def test_plan_cli_takes_a_budget_size(menu_calib, tmp_path):
    from click.testing import CliRunner

    from quantpipe.cli import main

    export_quantized(ExportSpec(menu_calib.folder, tmp_path / "u"))
    size = int(_tensor_bytes(tmp_path / "u") * 1.1)
    out = CliRunner().invoke(main, ["plan", str(menu_calib.folder), "--budget-size",
                                    f"{size}B", "--json", str(tmp_path / "p.json")])
    assert out.exit_code == 0, out.output
    plan = json.loads((tmp_path / "p.json").read_text())
    assert 4 < plan["budget_bits"] < 16 and plan["effective_bits_per_weight"] <= plan[
        "budget_bits"]
    both = CliRunner().invoke(main, ["plan", str(menu_calib.folder), "--budget-size", "1MB",
                                     "--budget-bits", "5"])
    assert both.exit_code != 0 and "not both" in both.output


def test_int5_int6_entries_export_native_bit_exact_and_run_in_the_runtime(menu_calib, tmp_path):
    from quantpipe.core.formats.loader import load_dequantized_model
    from quantpipe.runtime.loader import load_quantized_model
    from quantpipe.runtime.quant_linear import QuantLinear

    out = tmp_path / "w56"
    res = export_quantized(ExportSpec(menu_calib.folder, out, overrides=(
        "re:.*self_attn\\..*=w5g32", "re:.*mlp\\..*=w6g32-asym")))
    ckpt = load_quantized(out)
    assert {(s.bits, s.group_size, s.sym) for s in ckpt.plan.values()} == {
        (5, 32, True), (6, 32, False)}
    assert res.plan.counts() == {"int4": 0, "int5": 4 * len(ckpt.plan) // 7,
                                 "int6": 3 * len(ckpt.plan) // 7, "int8": 0, "fp16": 0}
    # the checkpoint holds the calibration's codes; its bits per weight are counted exactly
    got = menu_calib.weights(res.plan.bits)
    for n, spec in ckpt.plan.items():
        a, b = ckpt.layers[n], got[n]
        assert torch.equal(a.q, b.q) and torch.equal(a.scales, b.scales)
        want_bpw = spec.bits + (16 + (0 if spec.sym else 8)) / 32
        assert bits_per_weight(spec, a.shape, "native") == want_bpw
    # the runtime runs them (as INT8 layers of the same weights) like the dequantized model
    ref = load_dequantized_model(out, dtype=torch.float32)
    model = load_quantized_model(out, device="cpu")
    assert {m.spec.bits for m in model.modules() if isinstance(m, QuantLinear)} == {5, 6}
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        rel = (model(ids).logits.double() - ref(ids).logits.double()).norm() / \
            ref(ids).logits.double().norm()
    assert rel < 1e-4, rel  # fp32 activations in the INT8 kernels: summation order only
    for fmt in ("gptq", "compressed-tensors"):  # INT5 / INT6 are native only
        with pytest.raises(ValueError, match="5-bit"):
            export_quantized(ExportSpec(menu_calib.folder, tmp_path / fmt, fmt=fmt,
                                        overrides=("re:.*self_attn\\..*=w5g32",)))
        assert not (tmp_path / fmt / "quantpipe.json").exists()
