"""`quantpipe eval`: token-level distribution metrics of a candidate model against the reference.

The statistic set of llama.cpp's ``perplexity --kl-divergence``:

- KL divergence per token, ``KL(P_ref || P_cand) = sum_v p_ref(v) (log p_ref(v) - log p_cand(v))``,
  summarised as mean / median / p90 / p99 / p99.9 / max;
- same-top-token rate: how often both models put the most probability on the same token;
- top-token probability change ``dp = p_cand(t) - p_ref(t)`` of the text's actual next token
  ``t`` (llama.cpp's "Δp"), as RMS and percentiles;
- perplexity of both models on the text.

Streaming: one window of ``ctx`` tokens at a time, so memory is O(ctx x vocab) for logits and
O(tokens) floats for the per-token values (needed for exact percentiles), never
O(tokens x vocab). Each window is scored from its second token on (the first has no context).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSpec:
    reference: Path  # FP16 folder (export-fp16)
    candidate: Path  # quantized (or any HF) folder
    texts: tuple[str, ...]  # documents to score; each is windowed on its own
    max_tokens: int = 0  # stop after this many scored tokens (0 = all)
    ctx: int = 512  # window length in tokens

    def __post_init__(self) -> None:
        if not self.texts or not any(t.strip() for t in self.texts):
            raise ValueError("nothing to evaluate: the text is empty")
        if self.ctx < 8:
            raise ValueError(f"ctx={self.ctx} is too short; use 128 or more")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0 (0 = no limit)")


@dataclass
class EvalResult:
    reference: str
    candidate: str
    tokens: int  # scored tokens
    windows: int
    kld: dict[str, float]  # mean, median, p90, p99, p999, max
    same_top_rate: float
    top_prob_delta: dict[str, float]  # rms, p1, p5, p50, p95, p99 of p_cand(t) - p_ref(t)
    ppl_reference: float
    ppl_candidate: float
    ppl_ratio: float
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Accumulator:
    """Per-token values gathered window by window (O(tokens) floats)."""

    kld: list[torch.Tensor] = field(default_factory=list)
    dp: list[torch.Tensor] = field(default_factory=list)
    same_top: int = 0
    nll_ref: float = 0.0
    nll_cand: float = 0.0
    tokens: int = 0

    def add(self, logits_ref: torch.Tensor, logits_cand: torch.Tensor, targets: torch.Tensor):
        """logits_*: [T, V] for positions predicting ``targets`` [T].

        log-softmax in fp32 (a float64 pass over [T, 49k] costs several times more on CPU;
        fp32 leaves an error of ~1e-6 nats per token, far below the KLDs of interest), sums
        over tokens in float64.
        """
        logp_ref = torch.log_softmax(logits_ref.float(), dim=-1)  # [T, V] fp32
        logp_cand = torch.log_softmax(logits_cand.float(), dim=-1)  # [T, V] fp32
        kld = (logp_ref.exp() * (logp_ref - logp_cand)).sum(-1).clamp_min(0.0)  # [T]
        lp_ref_t = logp_ref.gather(-1, targets[:, None]).squeeze(-1).double()  # [T]
        lp_cand_t = logp_cand.gather(-1, targets[:, None]).squeeze(-1).double()  # [T]
        self.kld.append(kld)
        self.dp.append((lp_cand_t.exp() - lp_ref_t.exp()).float())
        self.same_top += int((logp_ref.argmax(-1) == logp_cand.argmax(-1)).sum())
        self.nll_ref -= float(lp_ref_t.sum())
        self.nll_cand -= float(lp_cand_t.sum())
        self.tokens += int(targets.numel())


def _quantiles(values: torch.Tensor, qs: dict[str, float]) -> dict[str, float]:
    v = values.double().sort().values
    out = {}
    for name, q in qs.items():
        # nearest-rank on the sorted values (exact, no interpolation surprises at the tails)
        idx = min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))
        out[name] = float(v[idx])
    return out


def summarize(acc: _Accumulator) -> dict:
    kld = torch.cat(acc.kld)
    dp = torch.cat(acc.dp)
    kld_stats = {"mean": float(kld.double().mean())}
    kld_stats.update(_quantiles(kld, {"median": 0.5, "p90": 0.9, "p99": 0.99, "p999": 0.999}))
    kld_stats["max"] = float(kld.max())
    dp_stats = {"rms": float(dp.double().pow(2).mean().sqrt())}
    dp_stats.update(
        _quantiles(dp, {"p1": 0.01, "p5": 0.05, "p50": 0.5, "p95": 0.95, "p99": 0.99})
    )
    ppl_ref = math.exp(acc.nll_ref / acc.tokens)
    ppl_cand = math.exp(acc.nll_cand / acc.tokens)
    return {
        "tokens": acc.tokens,
        "kld": kld_stats,
        "same_top_rate": acc.same_top / acc.tokens,
        "top_prob_delta": dp_stats,
        "ppl_reference": ppl_ref,
        "ppl_candidate": ppl_cand,
        "ppl_ratio": ppl_cand / ppl_ref,
    }


def windows(token_ids: list[list[int]], ctx: int) -> list[list[int]]:
    """Split every document into windows of at most ``ctx`` tokens (>= 2 tokens each)."""
    out = []
    for ids in token_ids:
        for start in range(0, len(ids), ctx):
            w = ids[start : start + ctx]
            if len(w) >= 2:
                out.append(w)
    return out


def load_eval_model(folder: str | Path, dtype: torch.dtype = torch.float32):
    """Load any folder quantpipe can evaluate: FP16 export, native quantized, or HF folder."""
    import json

    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method is not None:  # native, GPTQ or compressed-tensors: verified, then dequantized
        from quantpipe.formats.loader import load_dequantized_model

        return load_dequantized_model(folder, dtype)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True).eval()


@torch.no_grad()
def evaluate_many(ref_model, cand_models: list, tokenizer, spec: EvalSpec,
                  names: list[str] | None = None) -> list[EvalResult]:
    """Score several candidates against one reference forward per window."""
    t0 = time.perf_counter()
    docs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in spec.texts if t.strip()]
    wins = windows(docs, spec.ctx)
    if not wins:
        raise ValueError("the text tokenizes to fewer than 2 tokens; give a longer text")
    accs = [_Accumulator() for _ in cand_models]
    used = 0
    for w in tqdm(wins, desc="eval", unit="window", leave=False):
        scored = accs[0].tokens
        if spec.max_tokens and scored >= spec.max_tokens:
            break
        if spec.max_tokens:
            w = w[: spec.max_tokens - scored + 1]
        ids = torch.tensor([w])  # [1, T]
        logits_ref = ref_model(ids).logits[0, :-1]  # [T-1, V]
        for acc, cand in zip(accs, cand_models):
            acc.add(logits_ref, cand(ids).logits[0, :-1], ids[0, 1:])
        used += 1
    seconds = time.perf_counter() - t0
    names = names or [str(spec.candidate)] * len(cand_models)
    return [EvalResult(reference=str(spec.reference), candidate=name, windows=used,
                       seconds=seconds, **summarize(acc)) for name, acc in zip(names, accs)]


def evaluate_models(ref_model, cand_model, tokenizer, spec: EvalSpec) -> EvalResult:
    return evaluate_many(ref_model, [cand_model], tokenizer, spec)[0]


def run_eval(spec: EvalSpec) -> EvalResult:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.reference)
    ref = load_eval_model(spec.reference)
    cand = load_eval_model(spec.candidate)
    if ref.config.vocab_size != cand.config.vocab_size:
        raise ValueError(
            f"vocabularies differ ({ref.config.vocab_size} vs {cand.config.vocab_size}): "
            "the candidate must be a quantization of the reference"
        )
    return evaluate_models(ref, cand, tokenizer, spec)


def format_result(r: EvalResult) -> str:
    k, d = r.kld, r.top_prob_delta
    lines = [
        f"tokens scored        {r.tokens} in {r.windows} windows ({r.seconds:.1f}s)",
        f"PPL reference        {r.ppl_reference:.4f}",
        f"PPL candidate        {r.ppl_candidate:.4f}  (ratio {r.ppl_ratio:.4f})",
        f"KLD mean             {k['mean']:.6f}",
        f"KLD median           {k['median']:.6f}",
        f"KLD p90 / p99        {k['p90']:.6f} / {k['p99']:.6f}",
        f"KLD p99.9 / max      {k['p999']:.6f} / {k['max']:.6f}",
        f"same top token       {100 * r.same_top_rate:.2f}%",
        f"RMS dp (next token)  {100 * d['rms']:.3f}%",
        f"dp p1/p50/p99        {100 * d['p1']:.3f}% / {100 * d['p50']:.3f}% / "
        f"{100 * d['p99']:.3f}%",
    ]
    return "\n".join(lines)


def load_texts(reference: Path, text_file: Path | None, prompts: str | None) -> tuple[str, ...]:
    """The documents to score: a UTF-8 text file, or prompts rendered with the chat template."""
    if (text_file is None) == (prompts is None):
        raise ValueError("give exactly one of --text FILE or --prompts (a file or business-eval)")
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{text_file} is not UTF-8 text ({exc})") from None
        return (text,)
    from transformers import AutoTokenizer

    from calibration.prompts import load_prompt_records, render_eval_texts

    tokenizer = AutoTokenizer.from_pretrained(reference)
    return tuple(render_eval_texts(tokenizer, load_prompt_records(prompts)))
