"""W8 per channel: which INT8 calibration reaches mean KLD <= 0.001 on held-out text (#18).

What `quantpipe export --bits 8` ships: every calibrated linear's INT8 result from
`calibrate`, INT8 symmetric per output channel (``qformat.INT8_PER_CHANNEL``), computed by the
same algorithm as INT4 (GPTQ with act-order and the diag(H)-weighted clip search by default),
on a Hessian captured while the next block's inputs go through the **INT4**-quantized block
(``calibration.pipeline``: GPTQ's quantized forward uses the INT4 results). `quantpipe eval`
scores the checkpoint with the INT8 weights dequantized into an fp32 transformers model: the
activations are never quantized (the runtime's INT8 CPU kernels also keep fp32 activations).

This script re-does only the INT8 pass, one setting at a time, with the library's own pieces
(quantpipe.blocks.stream, calibration.capture, calibration.gptq / rtn) and without changing them:

- ``prop``: whose inputs the Hessians come from: ``w4`` (the pipeline: each block's inputs
  through the earlier blocks quantized with the INT4 results of ``--calib``) or ``fp`` (the
  FP model's);
- ``sym``, ``mse`` (the clip search), ``damp`` (GPTQ percdamp), ``act`` (act-order),
  ``samples`` (calibration sequences of ``--seq-len`` tokens), ``algo`` (gptq, rtn),
  ``down`` (the group size of the down_projs: -1 is per channel; 128 is a reference point,
  not per channel); ``smooth`` (an exact AWQ-style rescaling of the chosen input groups,
  searched for the INT8 grid: :func:`smoothed`); ``refine`` (after that search, the scales of
  the producer rows with the largest diag(H) searched one at a time: :func:`refined_scale`);
- ``fp``: layer types left in FP (with ``smooth``: their rescaled weights), to locate the
  INT8 error by type;
- ``from``: no calibration here, the INT8 results of an existing calibration folder.

Each variant is scored like `bench/quality.py` (``reports.eval``'s accumulator and windows,
ctx 512) on business-eval (the first 4,096 tokens) and sotu (bench/corpora.py) against the
FP16 reference; the reference's logits are computed once and cached in ``--work``. Hessians
of ``fp`` and ``w4`` are cached there too (they do not depend on the INT8 settings).

    python bench/w8_study.py --fp16 /tmp/qp/fp16 --calib CALIB_DIR --work /tmp/w8 \
        --variants pipeline,fp,asym --json bench/results/w8_study.json

Results already in ``--json`` are kept and skipped (delete the entry to re-measure).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from corpora import eval_texts  # bench/corpora.py (the script's folder)

from quantpipe.blocks.execute import embed_inputs, run_block
from quantpipe.blocks.stream import ModelStream
from quantpipe.calibration.artifact import read_calibration
from quantpipe.calibration.capture import StatsCollector
from quantpipe.calibration.gptq import gptq
from quantpipe.calibration.rtn import rtn
from quantpipe.core.families import block_groups, family_for, get_path
from quantpipe.core.io import write_json_atomic
from quantpipe.core.qformat import QuantizedWeight, QuantSpec
from quantpipe.prompts.sets import (
    CalibDataSpec,
    build_calibration_set,
    load_prompt_records,
)
from quantpipe.reports.eval import (
    EvalSpec,
    _Accumulator,  # the accumulator evaluate_many uses: the same statistics, per window
    eval_windows,
    load_eval_model,
    scored_windows,
    summarize,
)

BATCH = 8  # sequences per block forward, as calibrate's default batch_size
CORPUS_LIMITS = {"business-eval": 4096, "sotu": 0}  # scored tokens (0: all), as the issue
# an input group by its first linear's short name (the Llama family's four groups)
SMOOTH_GROUPS = {"qkv": "q_proj", "o": "o_proj", "gateup": "gate_proj", "down": "down_proj"}
SMOOTH_ALPHAS = tuple(i / 10 for i in range(11))  # AWQ's grid of exponents
LAYER_TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Variant:
    """One INT8 calibration (see the module docstring)."""

    prop: str = "w4"  # w4 | fp: whose inputs the Hessians come from
    algo: str = "gptq"  # gptq | rtn
    sym: bool = True
    mse: bool = True  # the diag(H)-weighted clip search
    damp: float = 0.01  # GPTQ percdamp
    act: bool = True  # act-order
    samples: int = 64  # calibration sequences
    down: int = -1  # the down_projs' group size (-1: per channel)
    # input groups whose inputs are rescaled before quantizing (see smoothed): "+"-joined
    # of qkv, o, gateup, down; "" = none
    smooth: str = ""
    # with smooth: after the exponent search, each group's ``refine`` producer rows with the
    # largest diag(H) get their own scale (refined_scale); 0 = none
    refine: int = 0
    # "+"-joined layer types (e.g. down_proj) left in FP (with smooth: their rescaled FP
    # weights), to locate the INT8 error; "" = none
    fp: str = ""
    source: str = ""  # an existing calibration folder: its INT8 results, nothing computed

    def __post_init__(self) -> None:
        if self.prop not in ("w4", "fp") or self.algo not in ("gptq", "rtn"):
            raise ValueError(f"prop {self.prop!r} / algo {self.algo!r}: use w4|fp, gptq|rtn "
                             "(GPTAQ: label:from=CALIB_DIR of a calibrate --algo gptaq run)")
        if not set(filter(None, self.smooth.split("+"))) <= set(SMOOTH_GROUPS):
            raise ValueError(f"smooth {self.smooth!r}: join any of {', '.join(SMOOTH_GROUPS)} "
                             "with +")
        if self.smooth and self.algo != "gptq":
            raise ValueError("smooth is measured with GPTQ only: use algo gptq")
        if self.refine and not self.smooth:
            raise ValueError("refine refines smooth's scales: give smooth too")
        if not set(filter(None, self.fp.split("+"))) <= set(LAYER_TYPES):
            raise ValueError(f"fp {self.fp!r}: join any of {', '.join(LAYER_TYPES)} with +")


# The calibration (--calib) is the pipeline row; every other row changes one setting
# of it, except the combinations at the end.
BASE = Variant()
VARIANTS: dict[str, Variant] = {
    "pipeline": replace(BASE, source="calib"),
    "w4": BASE,  # the pipeline's INT8 pass re-done here (a check: same codes expected)
    "fp": replace(BASE, prop="fp"),
    "asym": replace(BASE, sym=False),
    "no-mse": replace(BASE, mse=False),
    "damp0.001": replace(BASE, damp=0.001),
    "no-act": replace(BASE, act=False),
    "rtn": replace(BASE, algo="rtn", mse=False),
    "down-g128": replace(BASE, down=128),
    # more tokens, on the FP model's Hessians (compare with "fp": the INT4 results of --calib
    # were calibrated on its 64 sequences)
    "fp-samples128": replace(BASE, prop="fp", samples=128),
    "smooth-down": replace(BASE, smooth="down"),
    "smooth-all": replace(BASE, smooth="qkv+o+gateup+down"),
    "smooth-all-asym": replace(BASE, smooth="qkv+o+gateup+down", sym=False),
    # combinations of the settings that helped
    "asym-no-mse-damp0.001": replace(BASE, sym=False, mse=False, damp=0.001),
    "combo": replace(BASE, smooth="qkv+o+gateup+down", sym=False, mse=False, damp=0.001),
}
# the rows of docs/algorithms.md's "W8 per channel" table, in its order (plus two from= rows:
# the INT8 results of a GPTQ and a GPTAQ calibration on 32 x 256 tokens, given on the command
# line as label:from=CALIB_DIR)
TABLE = ("pipeline", "w4", "fp", "asym", "no-mse", "damp0.001", "no-act", "fp-samples128",
         "rtn", "down-g128", "smooth-down", "smooth-all", "smooth-all-asym",
         "asym-no-mse-damp0.001", "combo")


# ---- calibration tokens and Hessians -------------------------------------------------------


def calibration_tokens(fp16: Path, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """[samples, seq_len] int64: the windows `calibrate` packs from business-calib."""
    from transformers import AutoTokenizer

    calib = build_calibration_set(AutoTokenizer.from_pretrained(fp16, trust_remote_code=False),
                                  load_prompt_records("business-calib"),
                                  CalibDataSpec(n_samples=samples, seq_len=seq_len, seed=seed))
    return calib.input_ids


def int4_weights(calib_dir: Path) -> dict[str, QuantizedWeight]:
    """The INT4 result of every linear of a calibration (what its quantized forward used)."""
    calib = read_calibration(calib_dir)
    lazy = calib.weights({name: 4 for name in calib.layer_infos()})
    return {name: lazy[name] for name in lazy}


def set_weights(block, prefix: str, weights: dict[str, QuantizedWeight]) -> None:
    for full, w in weights.items():
        if full.startswith(prefix + "."):
            block.get_submodule(full[len(prefix) + 1:]).weight.data = w.dequantize()


class Sequential:
    """Block by block over the calibration tokens, as `calibrate` walks them (its stream, its
    hooks, its batch size), to capture the Hessians of every linear."""

    def __init__(self, fp16: Path, input_ids: torch.Tensor):
        self.stream = ModelStream(fp16)
        self.family = family_for(self.stream.model.config.model_type)
        with self.stream.load(self.stream.embeddings_name):
            self.hidden, self.ctx = embed_inputs(self.stream.model, input_ids)  # [n, L, d]
        self.blocks = len(get_path(self.stream.model, self.family.blocks))

    def hessians(self, prop: str, w4: dict[str, QuantizedWeight] | None
                 ) -> dict[str, torch.Tensor]:
        """Every linear -> H [in, in] fp32 (shared by an input group's linears), the inputs
        going through the FP blocks (prop fp) or the INT4 ones (prop w4)."""
        out: dict[str, torch.Tensor] = {}
        hidden = self.hidden
        for i in range(self.blocks):
            name = f"{self.family.blocks}.{i}"
            with self.stream.load(name) as block:
                ctx = self.ctx.for_layer(i)
                stats, fp_out = self._capture(block, hidden, ctx, i)
                for group, st in stats.items():
                    H = st.take_hessian()
                    out.update({f"{name}.{lin}": H for lin in group.linears})
                if prop == "w4":
                    set_weights(block, name, w4)
                    hidden = run_block(block, hidden, ctx, BATCH)
                else:
                    hidden = fp_out
        return out

    def _capture(self, block, hidden, ctx, i):
        collector = StatsCollector(block, block_groups(self.family, block), sample_rows=0,
                                   seed=i)
        try:
            fp_out = run_block(block, hidden, ctx, BATCH)  # [n, L, d]
        finally:
            collector.remove()
        return collector.stats, fp_out


# ---- the INT8 quantizer of a variant --------------------------------------------------------


def make_quantizer(v: Variant, losses: dict[str, float]):
    """(name, W [out, in], H [in, in]) -> QuantizedWeight; records each layer's proxy loss
    tr(dW H dW^T) in ``losses``."""

    def quantize(name: str, W: torch.Tensor, H: torch.Tensor) -> QuantizedWeight:
        gs = v.down if name.endswith("down_proj") else -1
        W = W.float()
        if v.algo == "rtn":
            res = rtn(W, QuantSpec(8, gs, v.sym), mse_clip=v.mse, H=H)
        else:
            spec = QuantSpec(8, gs, v.sym, act_order=v.act)
            kw = {"mse_clip": v.mse, "percdamp": v.damp,
                  "static_groups": True if gs != -1 else None}
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as calibrate runs GPTQ (pipeline.Algorithm.one_thread)
            try:
                res = gptq(W, H, spec, **kw)
            finally:
                torch.set_num_threads(threads)
        losses[name] = res.loss
        return res.weight

    return quantize


def int8_from(calib_dir: Path) -> tuple[dict[str, QuantizedWeight], dict[str, float]]:
    calib = read_calibration(calib_dir)
    infos = calib.layer_infos()
    lazy = calib.weights({name: 8 for name in infos})
    return {n: lazy[n] for n in lazy}, {n: infos[n]["w8"]["loss"] for n in infos}


class Calibrator:
    """Runs the variants' INT8 passes, caching tokens and Hessians in ``work``."""

    def __init__(self, args):
        self.args = args
        self.tokens: dict[int, torch.Tensor] = {}
        self.cached: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def input_ids(self, samples: int) -> torch.Tensor:
        if samples not in self.tokens:
            self.tokens[samples] = calibration_tokens(self.args.fp16, samples,
                                                      self.args.seq_len, self.args.seed)
        return self.tokens[samples]

    def hessians(self, prop: str, samples: int) -> dict[str, torch.Tensor]:
        key = (prop, samples)
        path = self.args.work / f"H-{prop}-{samples}x{self.args.seq_len}.pt"
        if key not in self.cached:
            if path.is_file():
                self.cached = {key: torch.load(path)}  # one set in memory at a time
            else:
                w4 = int4_weights(self.args.calib) if prop == "w4" else None
                H = Sequential(self.args.fp16, self.input_ids(samples)).hessians(prop, w4)
                torch.save(H, path)
                self.cached = {key: H}
        return self.cached[key]

    def run(self, v: Variant) -> tuple[dict[str, QuantizedWeight], dict[str, float]]:
        if v.source:
            return int8_from(self.args.calib if v.source == "calib" else Path(v.source))
        losses: dict[str, float] = {}
        quantize = make_quantizer(v, losses)
        H = self.hessians(v.prop, v.samples)
        prefix = self.args.blocks_prefix
        stream = ModelStream(self.args.fp16)
        with stream.load(prefix) as blocks:
            if v.smooth:
                return smoothed(stream.model.config, prefix, blocks, H, v, quantize), losses
            weights = {}
            for name, Hn in H.items():
                if not in_fp(name, v):
                    lin = blocks.get_submodule(name[len(prefix) + 1:])
                    weights[name] = quantize(name, lin.weight.data, Hn)
        return weights, losses


def in_fp(name: str, v: Variant) -> bool:
    """The linear is one of the types ``v`` leaves in FP."""
    return any(name.endswith("." + t) for t in filter(None, v.fp.split("+")))


# ---- exact input rescaling before INT8 (AWQ's fold, searched for the INT8 grid) ------------


def producer_rows(n_cols: int, n_rows: int, head_dim: int) -> torch.Tensor:
    """[n_cols] int64: the producer row feeding each input column of a consumer. Equal sizes:
    the identity; o_proj after a GQA v_proj: every kv head's rows feed n_cols / n_rows query
    heads' columns."""
    c = torch.arange(n_cols)
    if n_cols == n_rows:
        return c
    n_rep = n_cols // n_rows
    return (c // head_dim) // n_rep * head_dim + c % head_dim


def rtn_proxy(Ws: list[torch.Tensor], H: torch.Tensor, sc: torch.Tensor, sym: bool) -> float:
    """The consumers' summed RTN INT8 proxy loss with their columns times sc [in]."""
    Hs = H / (sc[:, None] * sc[None, :])  # [in, in]: the Hessian of x / sc
    return sum(rtn(W * sc, QuantSpec(8, -1, sym), H=Hs).loss for W in Ws)


def diag_by_row(H: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """[n_rows] fp64: diag(H) summed over the consumer columns each producer row feeds."""
    return torch.zeros(n_rows, dtype=torch.float64).index_add_(0, rows,
                                                               torch.diagonal(H).double())


def search_scale(Ws: list[torch.Tensor], H: torch.Tensor, rows: torch.Tensor, n_rows: int,
                 sym: bool) -> tuple[torch.Tensor, float]:
    """AWQ's search (arXiv 2306.00978, sec. 3.3), scored by INT8 per channel: the producer's
    scales s = rms(x)^alpha [n_rows] (normalised to a geometric mid-range of 1) whose RTN proxy
    loss tr(dW H' dW^T) summed over the consumers, with W' = W diag(s[rows]) and H' the
    Hessian of x / s, is smallest; alpha = 0 (no scaling) is a candidate."""
    count = torch.zeros(n_rows, dtype=torch.float64).index_add_(
        0, rows, torch.ones(rows.numel(), dtype=torch.float64))
    stat = diag_by_row(H, rows, n_rows) / count  # [n_rows] mean x^2 times 2
    stat = stat.sqrt().clamp_min(float(stat[stat > 0].min().sqrt()))  # [n_rows]: dead kept > 0
    best = (float("inf"), None, 0.0)
    for alpha in SMOOTH_ALPHAS:
        s = stat.pow(alpha)
        s = (s / (s.max() * s.min()).sqrt()).float()  # [n_rows]
        loss = rtn_proxy(Ws, H, s[rows], sym)  # s[rows]: [in] per consumer column
        if loss < best[0]:
            best = (loss, s, alpha)
    return best[1], best[2]


def refined_scale(Ws: list[torch.Tensor], H: torch.Tensor, rows: torch.Tensor, s: torch.Tensor,
                  top: int, sym: bool) -> torch.Tensor:
    """One pass of coordinate search after the exponent search: each of the ``top`` producer
    rows with the largest summed diag(H) (the massive-activation inputs) in turn takes the
    multiple 2^(k/2), k = -2..6, of its scale with the smallest RTN proxy loss, the others
    fixed; s [n_rows] -> refined copy."""
    s = s.clone()
    stat = diag_by_row(H, rows, s.numel())  # [n_rows]
    best = rtn_proxy(Ws, H, s[rows], sym)
    for j in stat.argsort(descending=True)[:top].tolist():
        base = keep = float(s[j])
        for k in range(-2, 7):
            s[j] = base * 2 ** (k / 2)
            loss = rtn_proxy(Ws, H, s[rows], sym)
            if loss < best:
                best, keep = loss, float(s[j])
        s[j] = keep
    return s


def smoothed(config, prefix: str, blocks, H: dict[str, torch.Tensor], v: Variant, quantize
             ) -> dict[str, QuantizedWeight | torch.Tensor]:
    """Every block's chosen input groups rescaled, then everything quantized: a consumer's
    columns times s, its producer (a norm's gain or a linear's rows) divided by s. The model is
    unchanged in exact arithmetic, and per-output-channel INT8 of a producer linear is
    invariant to scaling its rows (up to the fp16 rounding of the scales). Returns the INT8
    linears and the changed norm gains (module name -> weight [d] fp32); the linears of the
    types ``v.fp`` names stay FP (their rescaled weights)."""
    family = family_for(config.model_type)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // \
        config.num_attention_heads
    chosen = {SMOOTH_GROUPS[k] for k in v.smooth.split("+")}
    out: dict[str, QuantizedWeight | torch.Tensor] = {}
    for i, block in enumerate(blocks):
        name = f"{prefix}.{i}"
        W = {lin: block.get_submodule(lin).weight.data.float().clone()
             for g in family.groups for lin in g.linears}
        Hb = {lin: H[f"{name}.{lin}"] for lin in W}
        norms = {}
        for g in family.groups:
            if g.linears[0].rsplit(".", 1)[-1] not in chosen:
                continue
            prev = block.get_submodule(g.prev_op).weight.data.float()
            rows = producer_rows(W[g.linears[0]].shape[1], prev.shape[0], head_dim)
            s, _ = search_scale([W[lin] for lin in g.linears], Hb[g.linears[0]], rows,
                                prev.shape[0], v.sym)
            if v.refine:
                s = refined_scale([W[lin] for lin in g.linears], Hb[g.linears[0]], rows, s,
                                  v.refine, v.sym)
            sc = s[rows]
            Hs = Hb[g.linears[0]] / (sc[:, None] * sc[None, :])
            for lin in g.linears:
                W[lin].mul_(sc)  # [out, in] columns
                Hb[lin] = Hs
            if g.prev_op in W:  # a linear: its rows
                W[g.prev_op].div_(s[:, None])
            else:  # a norm's gain (Llama: x_norm * weight)
                assert not family.one_plus_norm, "a (1 + w) gain folds differently"
                norms[f"{name}.{g.prev_op}"] = prev / s
        out.update(norms)
        for lin, Wl in W.items():
            full = f"{name}.{lin}"
            out[full] = Wl if in_fp(full, v) else quantize(full, Wl, Hb[lin])
    return out


# ---- scoring --------------------------------------------------------------------------------


class Scorer:
    """KLD of a candidate (the FP16 model with INT8 linears dequantized in fp32, as `eval`
    loads a quantized folder) against the FP16 reference's cached logits."""

    def __init__(self, fp16: Path, work: Path, corpora: list[str], ctx: int):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(fp16, trust_remote_code=False)
        self.model = load_eval_model(fp16)  # fp32; its linears are replaced per candidate
        self.windows, self.ref = {}, {}
        for corpus in corpora:
            spec = EvalSpec(fp16, fp16, eval_texts(corpus, fp16, tokenizer),
                            CORPUS_LIMITS[corpus], ctx)
            self.windows[corpus] = scored_windows(eval_windows(tokenizer, spec),
                                                  spec.max_tokens)
            path = work / f"ref-logits-{corpus}-ctx{ctx}.pt"
            if not path.is_file():
                torch.save([self._forward(w) for w in self.windows[corpus]], path)
            self.ref[corpus] = path

    @torch.no_grad()
    def _forward(self, w: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([w])).logits[0, :-1]  # [T-1, V] fp32

    @torch.no_grad()
    def score(self, weights: dict[str, QuantizedWeight | torch.Tensor]) -> dict[str, dict]:
        """weights: module name -> its INT8 result, or a changed FP weight (a norm's gain)."""
        saved = {}
        for name, w in weights.items():
            module = self.model.get_submodule(name)
            saved[name] = module.weight.data
            module.weight.data = w if torch.is_tensor(w) else w.dequantize(torch.float32)
        try:
            out = {}
            for corpus, wins in self.windows.items():
                acc = _Accumulator()
                for w, logits_ref in zip(wins, torch.load(self.ref[corpus])):
                    acc.add(logits_ref, self._forward(w), torch.tensor(w[1:]))
                out[corpus] = summarize(acc)
            return out
        finally:
            for name, data in saved.items():
                self.model.get_submodule(name).weight.data = data


def loss_by_type(losses: dict[str, float]) -> dict[str, float]:
    return {t: sum(v for k, v in losses.items() if k.endswith(t)) for t in LAYER_TYPES}


def same_codes(a: dict, b: dict[str, QuantizedWeight]) -> int:
    """How many linears have exactly the same INT8 codes and scales in both."""
    return sum(isinstance(a[n], QuantizedWeight) and torch.equal(a[n].q, b[n].q)
               and torch.equal(a[n].scales, b[n].scales) for n in a if n in b)


# ---- the run --------------------------------------------------------------------------------


def parse_variant(text: str) -> tuple[str, Variant]:
    """A VARIANTS name, or ``label:key=value;...`` over BASE (e.g. ``x:prop=fp;sym=0``), or
    ``label:from=CALIB_DIR`` (the INT8 results of another calibration)."""
    if ":" not in text:
        if text not in VARIANTS:
            raise ValueError(f"unknown variant {text!r}; use one of {', '.join(VARIANTS)} or "
                             "label:key=value;...")
        return text, VARIANTS[text]
    label, _, body = text.partition(":")
    kv = dict(item.split("=", 1) for item in body.split(";") if item)
    conv = {"prop": str, "algo": str, "sym": lambda s: s == "1", "mse": lambda s: s == "1",
            "damp": float, "act": lambda s: s == "1", "samples": int, "down": int,
            "from": str, "smooth": str, "refine": int, "fp": str}
    fields = {("source" if k == "from" else k): conv[k](val) for k, val in kv.items()}
    return label, replace(BASE, **fields)


def machine() -> dict:
    flags = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        flags = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                      if ln.startswith("Flags")), "")
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"cpu": platform.processor() or platform.machine(), "lscpu_flags": flags,
            "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "loadavg_start": os.getloadavg()}


def print_row(label: str, r: dict) -> None:
    k = r["kld"]
    cells = [f"{k[c]['kld']['mean']:.5f} {100 * k[c]['same_top_rate']:5.1f}%" for c in k]
    print(f"{label:22s} " + "   ".join(cells) + f"   calib {r['calibrate_seconds']:6.0f}s",
          flush=True)


def run_variant(v: Variant, cal: Calibrator, scorer: Scorer, ref_pipeline,
                results: dict) -> dict:
    t0 = time.perf_counter()
    weights, losses = cal.run(v)
    seconds = time.perf_counter() - t0
    entry = {"variant": asdict(v), "calibrate_seconds": seconds,
             "proxy_loss_by_type": loss_by_type(losses)}
    if v.source:
        return {**entry, "kld": scorer.score(weights)}
    same = same_codes(weights, ref_pipeline)
    entry["same_codes_as_pipeline"] = [same, len(weights)]
    if same == len(weights) == len(ref_pipeline) and "pipeline" in results:
        # the scoring is deterministic: the same weights score the same
        return {**entry, "kld": results["pipeline"]["kld"],
                "note": "every linear's codes and scales equal the pipeline's: its scores"}
    t1 = time.perf_counter()
    entry["kld"] = scorer.score(weights)
    entry["eval_seconds"] = time.perf_counter() - t1
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True,
                    help="the GPTQ calibration whose INT8 results are the pipeline row and "
                         "whose INT4 results make the w4 inputs")
    ap.add_argument("--work", type=Path, default=Path("/tmp/w8"))
    ap.add_argument("--variants", default=",".join(TABLE),
                    help="comma list of VARIANTS names or label:key=value;... (parse_variant)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--corpora", default="business-eval,sotu")
    ap.add_argument("--json", type=Path, default=Path("bench/results/w8_study.json"))
    args = ap.parse_args()
    try:
        variants = [parse_variant(t) for t in args.variants.split(",") if t]
    except ValueError as exc:
        ap.error(str(exc))
    args.work.mkdir(parents=True, exist_ok=True)
    args.blocks_prefix = read_calibration(args.calib).manifest["block_prefix"]
    old = json.loads(args.json.read_text()) if args.json.is_file() else {}
    results = old.get("results", {})
    scorer = Scorer(args.fp16, args.work, args.corpora.split(","), args.ctx)
    cal = Calibrator(args)
    ref_pipeline = int8_from(args.calib)[0]
    print(f"{'variant':22s} " + "   ".join(f"{c + ' KLD  same-top':>22s}"
                                          for c in scorer.windows))
    for label, v in variants:
        if label not in results:
            results[label] = run_variant(v, cal, scorer, ref_pipeline, results)
            write_json_atomic(args.json, {
                "machine": old.get("machine") or machine(),
                "settings": {"fp16": str(args.fp16), "calib": str(args.calib),
                             "seq_len": args.seq_len, "seed": args.seed, "ctx": args.ctx,
                             "corpus_limits": CORPUS_LIMITS},
                "results": results})
        print_row(label, results[label])


if __name__ == "__main__":
    main()
