"""The checkpoints tests/test_vllm.py loads in vLLM's CPU build, and quantpipe's side of the
comparison.

Each case is one tiny random model of a registry family (hidden 128, 4 heads of 32: vLLM's CPU
attention takes head sizes from 32, its int4 kernel in/out features in multiples of 32) with a
mixed plan: a spec per slot of each block (q/k/v, o, gate/up, down, a MoE block's experts) or
FP16. The plans of all cases together cover every spec quantpipe writes in each format for
vLLM: group sizes 16-1024 and per channel, symmetric and asymmetric, act-order with static
groups, FP16-kept linears and experts. Each case is written three times from the same
quantized weights: native (quantpipe's runtime runs it), GPTQ or compressed-tensors (vLLM
loads it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from quantpipe.core.qformat import QuantizedWeight, QuantSpec

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "vllm_worker.py"
PYTHON_ENV = "QUANTPIPE_VLLM_PYTHON"
WORKER_TIMEOUT_S = 1200
NEW_TOKENS = 32  # greedy tokens compared per prompt
MAX_MODEL_LEN = 64  # prompts of 12 and 20 tokens + 32 new (past every tiny sliding window)
FP16 = None  # a plan slot kept in FP16


def w4(group: int, sym: bool = True, act: bool = False) -> QuantSpec:
    return QuantSpec(4, group, sym, act)


# Plans: block index -> slot -> spec. Two per format, alternated over the families, so that
# each format's every setting runs on several families. Dense models here have
# intermediate_size 1024 (down_proj takes groups up to 1024), MoE experts 64.
GPTQ_PLANS = (
    {0: {"qkv": w4(32), "o": w4(64), "gate_up": w4(128, act=True), "down": w4(-1)},
     1: {"qkv": FP16, "o": w4(128), "gate_up": w4(32), "down": w4(64, act=True)}},
    {0: {"qkv": w4(-1), "o": w4(32, act=True), "gate_up": w4(64), "down": w4(128)},
     1: {"qkv": w4(128), "o": FP16, "gate_up": w4(-1), "down": w4(32)}},
)
CT_PLANS = (
    {0: {"qkv": w4(16), "o": w4(32, sym=False), "gate_up": w4(64), "down": w4(1024)},
     1: {"qkv": w4(128, sym=False, act=True), "o": w4(-1, sym=False), "gate_up": FP16,
         "down": w4(256, sym=False)}},
    {0: {"qkv": w4(32), "o": w4(64, sym=False), "gate_up": w4(128, act=True), "down": w4(512)},
     1: {"qkv": w4(-1), "o": w4(128), "gate_up": w4(32, sym=False), "down": w4(256)}},
)
# MoE: every expert of a block shares one spec (vLLM's FusedMoE). vLLM's CPU MoE kernel takes
# symmetric experts only, and compressed-tensors experts not at group 32 (vllm_support).
GPTQ_MOE_PLAN = {
    0: {"qkv": w4(32), "o": w4(64), "experts": w4(32, act=True), "gate_up": w4(128),
        "down": w4(-1)},
    1: {"qkv": w4(128), "o": FP16, "experts": FP16, "gate_up": w4(64), "down": w4(32)},
}
CT_MOE_PLAN = {
    0: {"qkv": w4(16), "o": w4(32, sym=False), "experts": w4(64), "gate_up": w4(64, sym=False),
        "down": w4(128)},
    1: {"qkv": w4(-1, sym=False), "o": w4(128, act=True), "experts": FP16, "gate_up": FP16,
        "down": w4(64, sym=False)},
}


def uniform(spec: QuantSpec | None) -> dict:
    return {b: {s: spec for s in ("qkv", "o", "gate_up", "down", "experts")} for b in (0, 1)}


@dataclass(frozen=True)
class Case:
    id: str
    family: str
    fmt: str  # "gptq" or "compressed-tensors"
    plan: dict  # block -> slot -> spec (FP16 = None)
    # None: vLLM must load it and match quantpipe's runtime; else a fragment of vLLM's error
    refused: str | None = None
    act_order_permuted: bool = False  # act-order layers get a permuted g_idx (dynamic groups)
    overrides: dict = field(default_factory=dict)  # linear-name regex -> spec (after the plan)

    @property
    def moe(self) -> bool:
        from tests.tiny_models import MOE_FAMILIES

        return self.family in MOE_FAMILIES


def slot_of(linear: str) -> str:
    """The plan slot of a block-relative linear name (calibration's split names)."""
    if ".experts." in linear:
        return "experts"
    leaf = linear.rsplit(".", 1)[-1]
    slots = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv_proj": "qkv",
             "o_proj": "o", "gate_proj": "gate_up", "up_proj": "gate_up",
             "gate_up_proj": "gate_up", "down_proj": "down"}
    return slots[leaf]


def model_overrides(family: str) -> dict:
    """The tiny config of a case (on top of tests.tiny_models.FAMILY_CONFIGS)."""
    over = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                intermediate_size=1024)
    if family == "mixtral":
        over["intermediate_size"] = 64  # its experts' width
    elif family == "qwen2_moe":
        over.update(moe_intermediate_size=64, shared_expert_intermediate_size=128)
    elif family == "qwen3_moe":  # no shared expert: vLLM would build one from that field
        over.update(moe_intermediate_size=64)
    return over


def _quantize(w: torch.Tensor, spec: QuantSpec, permuted: bool, seed: int) -> QuantizedWeight:
    from tests.quantpipe.test_formats_common import act_order_g_idx, rtn

    g_idx = None
    if permuted and spec.act_order and spec.group_size != -1:
        g_idx = act_order_g_idx(w.shape[1], spec.group_size, seed)
    return rtn(w, spec, g_idx)


def case_weights(case: Case, model) -> dict[str, QuantizedWeight]:
    """RTN of every calibrated linear (calibration's names) by the case's plan; FP16 slots
    are left out (the writers keep them)."""
    from quantpipe.core.families import block_linear_names, family_for, get_blocks

    fam = family_for(case.family)
    weights = {}
    for i, block in enumerate(get_blocks(model, fam)):
        for j, linear in enumerate(block_linear_names(fam, block)):
            name = f"model.layers.{i}.{linear}"
            spec = case.plan[i][slot_of(linear)]
            for pattern, over in case.overrides.items():
                if re.search(pattern, name):
                    spec = over
            if spec is None:
                continue
            w = block.get_submodule(linear).weight.detach()  # [out, in] fp32
            weights[name] = _quantize(w.half().float(), spec, case.act_order_permuted, j)
    return weights


def write_case(case: Case, root: Path) -> tuple[Path, Path]:
    """The case's FP16 export, then its native folder and its vLLM folder (``fmt``); the vLLM
    folder is written with ``for_vllm=False`` when the case expects vLLM to refuse it (the
    export would refuse it first). Returns (native dir, vLLM dir)."""
    from quantpipe.core.formats import write_checkpoint
    from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
    from tests.tiny_models import make_family_model, save_model

    model, tok = make_family_model(case.family, **model_overrides(case.family))
    d = root / case.id
    src = save_model(model, tok, d / "src")
    export_fp16(Fp16ExportSpec(str(src), d / "fp16"))
    weights = case_weights(case, model)
    write_checkpoint("native", d / "native", d / "fp16", weights)
    write_checkpoint(case.fmt, d / case.fmt, d / "fp16", weights,
                     for_vllm=case.refused is None)
    return d / "native", d / case.fmt


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (12, 20)]


# ---- vLLM's side ----------------------------------------------------------------------------


def vllm_python() -> Path:
    """The python of the vLLM venv: $QUANTPIPE_VLLM_PYTHON (an error when it cannot import
    vllm) or .venv-vllm/bin/python; the test is skipped when neither is there."""
    named = os.environ.get(PYTHON_ENV)
    python = Path(named) if named else REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        if named:
            raise FileNotFoundError(f"${PYTHON_ENV}={named} does not exist")
        pytest.skip("no vLLM venv: run tools/vllm_venv.sh (README command 2 does) or set "
                    f"${PYTHON_ENV} to a python that imports vllm")
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util, sys; "
         "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True)
    if probe.returncode != 0:
        if named:
            raise RuntimeError(f"${PYTHON_ENV}={named} cannot import vllm")
        pytest.skip(f"{python} cannot import vllm: run tools/vllm_venv.sh")
    return python


class VllmWorker:
    """tests/vllm_worker.py over ``jobs`` (``{"path", "prompts"[, "max_model_len"]}``) in a
    process of its own, while the ``with`` body runs quantpipe's side; ``results`` (one per
    job, in order) once the body is done and the worker exited 0."""

    def __init__(self, python: Path, root: Path, jobs: list[dict], max_model_len: int):
        self.root, self.n = root, len(jobs)
        self.job = root / "job.json"
        self.job.write_text(json.dumps({"checkpoints": jobs, "max_tokens": NEW_TOKENS,
                                        "max_model_len": max_model_len}))
        self.python, self.log = python, root / "worker.log"
        self.results: list[dict] = []

    def __enter__(self) -> VllmWorker:
        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [str(self.python), str(WORKER), str(self.job), str(self.root / "res.json")],
            stdout=self._out, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                 "DO_NOT_TRACK": "1"})
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            rc = self.proc.wait(timeout=WORKER_TIMEOUT_S if exc is None else 0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            if exc is None:
                raise
            return
        finally:
            self._out.close()
        if exc is not None:
            return
        tail = self.log.read_text(errors="replace")[-3000:]
        assert rc == 0, f"the vLLM worker failed (exit {rc}); its log ends:\n{tail}"
        self.results = json.loads((self.root / "res.json").read_text())["results"]
        assert len(self.results) == self.n, tail


# ---- quantpipe's side -----------------------------------------------------------------------


@dataclass
class Greedy:
    tokens: list[int]
    logprobs: list[float]  # of each chosen token


def runtime_greedy(native_dir: Path, prompt_ids: list[list[int]], kv_cache_memory: int = 2**23):
    """quantpipe's serving engine on the native folder (default CPU kernels, the checkpoint's
    fp16 head): greedy tokens and their logprobs; returns (outputs, engine). The default KV
    cache fits the tiny models' prompts; a real model's longer prompts need more."""
    from quantpipe.runtime.engine import EngineConfig, LLMEngine, SamplingParams
    from quantpipe.runtime.engine.loading import load_model_for_serving

    model, tok = load_model_for_serving(native_dir, head_dtype="fp32")
    eng = LLMEngine(model, tok, EngineConfig(block_size=16, max_num_seqs=len(prompt_ids),
                                             max_num_batched_tokens=256,
                                             kv_cache_memory=kv_cache_memory))
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    rids = [eng.add_request(p, params) for p in prompt_ids]
    outs = {r: Greedy([], []) for r in rids}
    while eng.has_work():
        for o in eng.step():
            outs[o.request_id].tokens += o.new_token_ids
            outs[o.request_id].logprobs += [lp.logprob for lp in o.logprobs or ()]
    return [outs[r] for r in rids], eng


def forced_logprobs(eng, ids: list[int]) -> torch.Tensor:
    """log_softmax of quantpipe's logits after ``ids`` (one prefill on the engine's runner,
    over blocks the finished requests have freed): [vocab] fp32."""
    from quantpipe.runtime.engine.model_runner import SeqChunk

    block = eng.config.block_size
    table = list(range(1, 1 + -(-len(ids) // block)))
    logits = eng.runner.forward([SeqChunk(list(ids), 0, table)])  # [1, vocab]
    return torch.log_softmax(logits[0].float(), dim=-1)


# ---- the comparison -------------------------------------------------------------------------

# |logprob(vLLM) - logprob(quantpipe)| of a chosen token. The two runtimes compute the same
# integer weights differently: vLLM's CPU kernel with fp16 activations, quantpipe's W4A8 kernel
# with int8 activations per 32 columns (fp32 elsewhere); on these tiny models the chosen
# tokens' logprobs differed by at most 0.07 (every family, both formats). A loading error (a
# wrong zero point, group or order) moves them by more: test_comparison_rejects_other_weights
# feeds it another plan's weights of the same model.
LOGPROB_TOL = 0.15
# vLLM computes some families in bfloat16 whatever the checkpoint's dtype (Gemma 3: its fp16
# scales and activations are cast to bf16, 8 mantissa bits for fp16's 11); on the real
# Gemma-3-270M the chosen tokens' logprobs then differed by up to 0.17 (vs 0.054 on
# Qwen2.5-Coder-1.5B in fp16). tests/test_vllm_real_models.py uses this one there.
BF16_LOGPROB_TOL = 0.3
# Where vLLM's greedy token is not quantpipe's, it must be a near tie in quantpipe's own
# distribution (within TIE_FACTOR times the logprob tolerance of quantpipe's top logprob): the
# two can then round apart.
TIE_FACTOR = 2
# MoE: a token whose router scores two experts nearly alike goes to different experts in the
# two runtimes, and its logprob then differs by more (measured: one token of 0.30 among 128).
# Up to MOE_FLIPS tokens per prompt may exceed the tolerances above, by at most MOE_FLIP_TOL.
MOE_FLIPS = 2
MOE_FLIP_TOL = 1.0


def compare(eng, prompt: list[int], ours: Greedy, theirs: dict, moe: bool = False,
            tol: float = LOGPROB_TOL) -> tuple[bool, str]:
    """(ok, what happened) for one prompt. Up to the first token where the greedy choices
    differ, the logprobs of the chosen tokens are compared; from there on quantpipe is fed
    vLLM's tokens (teacher forcing) and each of them must be a near tie for quantpipe
    (TIE_FACTOR * tol) with a logprob close to vLLM's (``tol``)."""
    v_tok, v_lp = theirs["tokens"], theirs["logprobs"]
    if len(v_tok) != NEW_TOKENS:
        return False, f"vLLM generated {len(v_tok)} tokens, not {NEW_TOKENS}"
    k = next((i for i, (a, b) in enumerate(zip(ours.tokens, v_tok)) if a != b), NEW_TOKENS)
    rows = []  # (token index, |logprob difference|, quantpipe's top - its logprob of it)
    for i in range(NEW_TOKENS):
        if i < k:
            rows.append((i, abs(ours.logprobs[i] - v_lp[i]), 0.0))
            continue
        lp = forced_logprobs(eng, prompt + v_tok[:i])
        got = float(lp[v_tok[i]])
        rows.append((i, abs(got - v_lp[i]), float(lp.max()) - got))
    bad = [r for r in rows if r[1] > tol or r[2] > TIE_FACTOR * tol]
    flips_ok = moe and len(bad) <= MOE_FLIPS and all(max(r[1:]) <= MOE_FLIP_TOL for r in bad)
    what = "equal" if k == NEW_TOKENS else f"diverged at a near tie at token {k}"
    worst = max(rows, key=lambda r: r[1])
    what += f"; largest logprob difference {worst[1]:.3f} (token {worst[0]})"
    if bad and not flips_ok:
        i, d, t = bad[0]
        return False, (f"token {i} ({v_tok[i]}): logprob {v_lp[i]:.4f} in vLLM, differs by "
                       f"{d:.4f} from quantpipe's, {t:.4f} below quantpipe's top ({what})")
    return True, what + (f"; {len(bad)} MoE routing flip(s)" if bad else "")
