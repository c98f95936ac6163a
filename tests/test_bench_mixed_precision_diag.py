"""bench/mixed_precision_diag.py: the layer groups, type plans and the template token mask."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
diag = pytest.importorskip("mixed_precision_diag")

NAMES = [f"model.layers.{b}.{part}.{t}" for b in range(4)
         for part, types in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                             ("mlp", ("gate_proj", "up_proj", "down_proj")))
         for t in types]


def test_groups_partition_by_type_and_by_blocks():
    by_type = diag.groups(NAMES, 4, 0)
    assert list(by_type) == [f"group:{t}" for t in diag.TYPES]
    assert sorted(n for g in by_type.values() for n in g) == sorted(NAMES)
    assert by_type["group:v_proj"] == [f"model.layers.{b}.self_attn.v_proj" for b in range(4)]
    by_blocks = {k: v for k, v in diag.groups(NAMES, 4, 3).items() if "blocks" in k}
    assert list(by_blocks) == ["group:blocks 0-2", "group:blocks 3-3"]
    assert len(by_blocks["group:blocks 0-2"]) == 21 and len(by_blocks["group:blocks 3-3"]) == 7


def test_type_plans_upgrade_exactly_those_types():
    calib = SimpleNamespace(layer_infos=lambda: dict.fromkeys(NAMES), num_blocks=4)
    args = SimpleNamespace(no_groups=True, type_plans="v_proj+k_proj,v_proj", plans=None,
                           block_width=0, group_bits=4)
    configs = diag.configurations(calib, args)
    assert list(configs) == ["all-int4", "int8:v_proj+k_proj", "int8:v_proj"]
    assert set(configs["all-int4"].values()) == {4}
    vk = configs["int8:v_proj+k_proj"]
    assert {n for n, b in vk.items() if b == 8} == {
        n for n in NAMES if n.endswith(("v_proj", "k_proj"))}
    assert sum(b == 8 for b in configs["int8:v_proj"].values()) == 4


def test_template_mask_marks_the_positions_predicting_template_tokens():
    system, assistant = [7, 8, 9], [5, 6]  # the two constant runs, as a tokenizer gives them

    def tok(text, add_special_tokens=False):
        return {"input_ids": system if "system" in text else assistant}

    ids = torch.tensor([[7, 8, 9, 1, 2, 5, 6, 3],
                        [1, 7, 8, 9, 2, 2, 2, 5]])  # row 2: a run cut by the window's end
    mask = diag.template_mask(ids, tok)
    # position p predicts token p + 1; the run at 0 has no predicting position for its first
    # token, so positions 0..1 (predicting 8, 9) and 4..5 (predicting 5, 6) are marked
    assert mask[0].tolist() == [True, True, False, False, True, True, False, False]
    assert mask[1].tolist() == [True, True, True, False, False, False, False, False]


def test_group_bits_8_scores_int8_groups_against_an_int8_baseline():
    calib = SimpleNamespace(layer_infos=lambda: dict.fromkeys(NAMES), num_blocks=4)
    args = SimpleNamespace(no_groups=False, type_plans="", plans=None, block_width=0,
                           group_bits=8)
    configs = diag.configurations(calib, args)
    assert list(configs) == ["all-int8"] + [f"group:{t}@int8" for t in diag.TYPES]
    assert set(configs["all-int8"].values()) == {8}
    assert configs["group:down_proj@int8"] == {
        f"model.layers.{b}.mlp.down_proj": 8 for b in range(4)}
