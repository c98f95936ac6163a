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

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tqdm.auto import tqdm

from quantpipe.core.heap import fits_in_memory
from quantpipe.core.io import (  # noqa: F401 (MANIFEST_NAME, check_output_file re-exported)
    MANIFEST_NAME,
    check_output_file,
    weights_bytes,
)
from quantpipe.core.metrics import mean_kld, token_kld
from quantpipe.reports.intervals import bootstrap_ratio

log = logging.getLogger(__name__)

DEFAULT_CTX = 512  # window length when --ctx is not given (less if the model's context is)
# config.json keys that hold a model's context length, by family convention
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(frozen=True)
class EvalSpec:
    reference: Path  # FP16 folder (export-fp16)
    candidate: Path  # quantized (or any HF) folder
    texts: tuple[str, ...]  # documents to score; each is windowed on its own
    max_tokens: int = 0  # stop after this many scored tokens (0 = all)
    ctx: int = DEFAULT_CTX  # window length in tokens
    allow_other_source: bool = False  # compare a candidate quantized from another FP16 folder
    # run both models block by block (reports.stream_eval) instead of whole; None: when the
    # two whole models in fp32 would not fit in the available memory (:func:`use_streaming`)
    stream: bool | None = None

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
    # 95% intervals by window (reports.intervals): kld_mean, same_top_rate, ppl_ratio ->
    # [low, high]; empty below two windows
    intervals: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class _Window(NamedTuple):
    """One scored window's sums (the units the intervals resample)."""

    kld: float  # sum of the tokens' KLDs
    same_top: int  # tokens whose most likely next token is FP16's
    nll_ref: float  # negative log-likelihood of the text's tokens, FP16
    nll_cand: float  # ... and candidate
    tokens: int


ACC_ROWS = 64  # positions per pass over the vocabulary in _Accumulator.add


@dataclass
class _Accumulator:
    """Per-token values gathered window by window (O(tokens) floats), and each window's sums;
    the totals are the windows' sums."""

    kld: list[torch.Tensor] = field(default_factory=list)
    dp: list[torch.Tensor] = field(default_factory=list)
    windows: list[_Window] = field(default_factory=list)

    def total(self, name: str) -> float:
        return sum(getattr(w, name) for w in self.windows)

    def add(self, logits_ref: torch.Tensor, logits_cand: torch.Tensor, targets: torch.Tensor):
        """logits_*: [T, V] for positions predicting ``targets`` [T].

        log-softmax in fp32 (a float64 pass over the vocabulary costs several times more on
        CPU), sums over tokens in float64; the KLD follows quantpipe.core.metrics' policy.
        Every value is a row's own, so rows go :data:`ACC_ROWS` at a time: the [rows, V]
        temporaries stay small beside a 150k-260k vocabulary (a [T, V] fp32 copy of a
        511-token window is 0.5 GB on Gemma-3's 262k, and the pass made several).
        """
        parts = [self._rows(logits_ref[r:r + ACC_ROWS], logits_cand[r:r + ACC_ROWS],
                            targets[r:r + ACC_ROWS])
                 for r in range(0, targets.numel(), ACC_ROWS)]
        kld, lp_ref_t, lp_cand_t = (torch.cat([p[i] for p in parts]) for i in range(3))
        same = sum(p[3] for p in parts)
        self.kld.append(kld)
        self.dp.append((lp_cand_t.exp() - lp_ref_t.exp()).float())
        self.windows.append(_Window(float(kld.double().sum()), same, -float(lp_ref_t.sum()),
                                    -float(lp_cand_t.sum()), int(targets.numel())))

    @staticmethod
    def _rows(logits_ref: torch.Tensor, logits_cand: torch.Tensor, targets: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """[r, V] logits of r positions -> (KLD [r] fp32, the targets' log-probabilities under
        each model [r] fp64 twice, positions whose top tokens agree)."""
        logp_ref = torch.log_softmax(logits_ref.float(), dim=-1)  # [r, V] fp32
        logp_cand = torch.log_softmax(logits_cand.float(), dim=-1)  # [r, V] fp32
        kld = token_kld(logits_ref, logits_cand, p_ref=logp_ref.exp())  # [r] fp32
        lp_ref_t = logp_ref.gather(-1, targets[:, None]).squeeze(-1).double()  # [r]
        lp_cand_t = logp_cand.gather(-1, targets[:, None]).squeeze(-1).double()  # [r]
        same = int((logp_ref.argmax(-1) == logp_cand.argmax(-1)).sum())
        return kld, lp_ref_t, lp_cand_t, same


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
    kld_stats = {"mean": mean_kld(acc.kld)}
    kld_stats.update(_quantiles(kld, {"median": 0.5, "p90": 0.9, "p99": 0.99, "p999": 0.999}))
    kld_stats["max"] = float(kld.max())
    dp_stats = {"rms": float(dp.double().pow(2).mean().sqrt())}
    dp_stats.update(
        _quantiles(dp, {"p1": 0.01, "p5": 0.05, "p50": 0.5, "p95": 0.95, "p99": 0.99})
    )
    tokens = int(acc.total("tokens"))
    ppl_ref = math.exp(acc.total("nll_ref") / tokens)
    ppl_cand = math.exp(acc.total("nll_cand") / tokens)
    return {
        "tokens": tokens,
        "kld": kld_stats,
        "same_top_rate": acc.total("same_top") / tokens,
        "top_prob_delta": dp_stats,
        "ppl_reference": ppl_ref,
        "ppl_candidate": ppl_cand,
        "ppl_ratio": ppl_cand / ppl_ref,
        "intervals": window_intervals(acc.windows),
    }


def window_intervals(wins: list[_Window]) -> dict[str, list[float]]:
    """95% intervals of the mean KLD, the same-top rate and the perplexity ratio, resampling
    windows (``_Accumulator.windows``); empty below two windows."""
    if len(wins) < 2:
        return {}
    tokens = [w.tokens for w in wins]
    out = {
        "kld_mean": bootstrap_ratio([w.kld for w in wins], tokens, "window"),
        "same_top_rate": bootstrap_ratio([w.same_top for w in wins], tokens, "window"),
        "ppl_ratio": bootstrap_ratio([w.nll_cand - w.nll_ref for w in wins], tokens, "window",
                                     transform=np.exp),
    }
    return {k: [iv.low, iv.high] for k, iv in out.items()}


def windows(token_ids: list[list[int]], ctx: int) -> list[list[int]]:
    """Split every document into windows of at most ``ctx`` tokens (>= 2 tokens each)."""
    out = []
    for ids in token_ids:
        for start in range(0, len(ids), ctx):
            w = ids[start : start + ctx]
            if len(w) >= 2:
                out.append(w)
    return out


def scored_windows(wins: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The windows scored, in order: all of them, or (``max_tokens``) until that many tokens
    are scored, the last one cut to fit (a window scores one token fewer than its length)."""
    out, scored = [], 0
    for w in wins:
        if max_tokens and scored >= max_tokens:
            break
        if max_tokens:
            w = w[: max_tokens - scored + 1]
        out.append(w)
        scored += len(w) - 1
    return out


def is_quantized(folder: str | Path) -> bool:
    """Whether the folder's config.json names a quantization method (native, GPTQ,
    compressed-tensors): such folders are verified, then dequantized, to be evaluated."""
    cfg = model_config(folder)
    return (cfg.get("quantization_config") or {}).get("quant_method") is not None


def load_eval_model(folder: str | Path, dtype: torch.dtype = torch.float32):
    """Load any folder quantpipe can evaluate: FP16 export, native quantized, or HF folder."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if is_quantized(folder):  # native, GPTQ or compressed-tensors: verified, then dequantized
        from quantpipe.core.formats.loader import load_dequantized_model

        return load_dequantized_model(folder, dtype)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True,
                                                trust_remote_code=False).eval()


@torch.no_grad()
def evaluate_many(ref_model, cand_models: list, tokenizer, spec: EvalSpec,
                  names: list[str] | None = None) -> list[EvalResult]:
    """Score several candidates against one reference forward per window."""
    t0 = time.perf_counter()
    wins = eval_windows(tokenizer, spec)
    accs = [_Accumulator() for _ in cand_models]
    used = 0
    for w in tqdm(scored_windows(wins, spec.max_tokens), desc="eval", unit="window",
                  leave=False):
        ids = torch.tensor([w])  # [1, T]
        logits_ref = ref_model(ids).logits[0, :-1]  # [T-1, V]
        for acc, cand in zip(accs, cand_models):
            acc.add(logits_ref, cand(ids).logits[0, :-1], ids[0, 1:])
        used += 1
    seconds = time.perf_counter() - t0
    names = names or [str(spec.candidate)] * len(cand_models)
    return [EvalResult(reference=str(spec.reference), candidate=name, windows=used,
                       seconds=seconds, **summarize(acc)) for name, acc in zip(names, accs)]


def eval_windows(tokenizer, spec: EvalSpec) -> list[list[int]]:
    """The texts' token windows (before ``max_tokens`` truncation)."""
    docs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in spec.texts if t.strip()]
    wins = windows(docs, spec.ctx)
    if not wins:
        raise ValueError("the text tokenizes to fewer than 2 tokens; give a longer text")
    return wins


def evaluate_models(ref_model, cand_model, tokenizer, spec: EvalSpec) -> EvalResult:
    return evaluate_many(ref_model, [cand_model], tokenizer, spec)[0]


def candidate_batches(reference: str | Path, n: int) -> list[range]:
    """Split ``n`` whole candidates into groups that fit in memory beside the loaded reference.

    Call with the reference loaded. Each candidate in fp32 takes about twice the reference's
    fp16 shards; a group holds as many as fit in ``WHOLE_MODELS_MEMORY_FRACTION`` of the memory
    available now (at least one). Scoring group by group costs one more reference forward per
    window and group, and gives every candidate the numbers it gets in one group (each has its
    own accumulator; the reference's logits do not depend on the group)."""
    each = 2 * weights_bytes(reference)
    size = 1
    while size < n and fits_in_memory((size + 1) * each)[0]:
        size += 1
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def use_streaming(spec: EvalSpec) -> tuple[bool, str]:
    """(run block by block, why): as asked, else when the reference and the candidate in fp32
    (twice the reference's fp16 shards each) would not fit (:func:`fits_in_memory`)."""
    if spec.stream is not None:
        return spec.stream, "as asked"
    need = 4 * weights_bytes(spec.reference)
    fits, have = fits_in_memory(need)
    if not fits:
        return True, (f"both models in fp32 need ~{need / 2**30:.1f} GiB, "
                      f"{have / 2**30:.1f} GiB available")
    return False, "both models fit in memory"


def run_eval(spec: EvalSpec) -> EvalResult:
    from quantpipe.core.sources import load_folder_tokenizer

    check_candidate(spec.reference, spec.candidate, spec.allow_other_source)
    tokenizer = load_folder_tokenizer(spec.reference)
    stream, why = use_streaming(spec)
    if stream:
        log.info("eval: running both models block by block (%s)", why)
        return _run_streamed(spec, tokenizer, why)
    ref = load_eval_model(spec.reference)
    cand = load_eval_model(spec.candidate)
    if ref.config.vocab_size != cand.config.vocab_size:
        raise ValueError(
            f"vocabularies differ ({ref.config.vocab_size} vs {cand.config.vocab_size}): "
            "the candidate must be a quantization of the reference"
        )
    return evaluate_models(ref, cand, tokenizer, spec)


def _run_streamed(spec: EvalSpec, tokenizer, why: str) -> EvalResult:
    from quantpipe.reports.stream_eval import stream_evaluate

    if model_config(spec.reference).get("vocab_size") != model_config(spec.candidate).get(
            "vocab_size"):
        raise ValueError("vocabularies differ: the candidate must be a quantization of the "
                         "reference")
    acc = _Accumulator()
    wins = scored_windows(eval_windows(tokenizer, spec), spec.max_tokens)
    seconds = stream_evaluate(spec.reference, spec.candidate, is_quantized(spec.candidate),
                              wins, acc)
    return EvalResult(reference=str(spec.reference), candidate=str(spec.candidate),
                      windows=len(wins), seconds=seconds, **summarize(acc),
                      notes=[f"both models run block by block ({why})"])


# ---- input checks: cheap, before any model is loaded ----------------------------------------


def read_json_file(path: str | os.PathLike, what: str) -> dict:
    """A JSON file, or ValueError naming it (the parser alone does not say which file)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: {what} is not valid JSON ({exc}); restore it or re-run the "
                         "step that wrote it") from None


def model_config(folder: str | os.PathLike) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json: not a model folder; pass an export-fp16 "
                         "folder, a quantized folder or a Hugging Face model folder")
    return read_json_file(path, "the model config")


def context_length(config: dict) -> int | None:
    """The longest sequence the model was built for (None: the config does not say)."""
    for key in CONTEXT_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return None


def eval_context(reference: str | os.PathLike, ctx: int | None) -> int:
    """The window length: ``ctx`` if the reference's context holds it; by default
    :data:`DEFAULT_CTX`, or the context length when that is shorter."""
    limit = context_length(model_config(reference))
    if ctx is None:
        return DEFAULT_CTX if limit is None else min(DEFAULT_CTX, limit)
    if limit is not None and ctx > limit:
        raise ValueError(f"--ctx {ctx} exceeds the context length of {reference} ({limit} "
                         f"tokens); use --ctx {limit} or less")
    return ctx


def _shards_key(shards: list[dict]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(s["file"]), str(s["sha256"])) for s in shards))


def _describe_shards(key: tuple[tuple[str, str], ...]) -> str:
    first, sha = key[0]
    more = f" and {len(key) - 1} more" if len(key) > 1 else ""
    return f"{first} sha256 {sha[:12]}{more}"


def recorded_fp16_shards(folder: str | os.PathLike) -> tuple[str, tuple] | str:
    """(FP16 folder, its shard (file, sha256) pairs) that ``folder``'s manifest says its
    weights are or came from; otherwise why it cannot say.

    An export-fp16 folder records its own ``shards``; a quantized one ``source_fp16.shards``
    (older ones only name the calibration, whose manifest records ``fp16_shards``).
    """
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return f"{folder} has no {MANIFEST_NAME} (not made by quantpipe)"
    manifest = read_json_file(path, "the manifest")
    if manifest.get("stage") == "fp16" and manifest.get("shards"):
        return str(folder), _shards_key(manifest["shards"])
    src = manifest.get("source_fp16") or {}
    if src.get("shards"):
        return str(src.get("path", "?")), _shards_key(src["shards"])
    calib = (manifest.get("calibration") or {}).get("path")
    if calib and (Path(calib) / MANIFEST_NAME).is_file():
        cm = read_json_file(Path(calib) / MANIFEST_NAME, "the calibration manifest")
        if cm.get("fp16_shards"):
            return str(cm.get("fp16_dir", calib)), _shards_key(cm["fp16_shards"])
    return f"{path} records no FP16 shard hashes"


def check_same_source(reference: str | os.PathLike, candidate: str | os.PathLike,
                      allow_other: bool = False) -> None:
    """Refuse a candidate made from other FP16 weights than ``reference`` (by the shard
    hashes both manifests record); warn when that cannot be checked, or when ``allow_other``."""
    ref = recorded_fp16_shards(reference)
    cand = recorded_fp16_shards(candidate)
    if isinstance(ref, str) or isinstance(cand, str):
        why = ref if isinstance(ref, str) else cand
        log.warning("cannot check that %s was made from %s: %s; comparing anyway",
                    candidate, reference, why)
        return
    if cand[1] == ref[1]:
        return
    made_from = f"{cand[0]} ({_describe_shards(cand[1])})"
    ref_desc = _describe_shards(ref[1])
    if allow_other:
        log.warning("%s was made from %s, not from %s (%s); comparing anyway "
                    "(--allow-other-source)", candidate, made_from, reference, ref_desc)
        return
    raise ValueError(f"--candidate {candidate} was made from {made_from}, not from --reference "
                     f"{reference} ({ref_desc}); pass the FP16 folder it was made from as "
                     "--reference, or --allow-other-source to compare anyway")


def _manifest_stage(folder: str | os.PathLike) -> str | None:
    """The stage a quantpipe folder's manifest names (fp16, quantized, ...); None without one."""
    path = Path(folder) / MANIFEST_NAME
    return read_json_file(path, "the manifest").get("stage") if path.is_file() else None


def check_roles(reference: str | os.PathLike, candidate: str | os.PathLike) -> None:
    """Refuse a quantized --reference: the reference is the FP16 export the candidate is
    measured against (with the two swapped, the source check passes, as both name the same
    FP16 weights, and the report would show the FP16 model's numbers as the damage)."""
    if _manifest_stage(reference) != "quantized" and not is_quantized(reference):
        return
    if _manifest_stage(candidate) == "fp16":
        raise ValueError(f"--reference {reference} is a quantized export and --candidate "
                         f"{candidate} an FP16 export: they look swapped; pass --reference "
                         f"{candidate} --candidate {reference}")
    raise ValueError(f"--reference {reference} is a quantized model; the reference must be the "
                     "FP16 folder (export-fp16) the candidate was made from")


def check_candidate(reference: str | os.PathLike, candidate: str | os.PathLike,
                    allow_other_source: bool = False) -> None:
    """Everything about a candidate that can be checked without loading a model."""
    check_roles(reference, candidate)
    check_same_source(reference, candidate, allow_other_source)
    ref_vocab = model_config(reference).get("vocab_size")
    cand_vocab = model_config(candidate).get("vocab_size")
    if ref_vocab is not None and cand_vocab is not None and ref_vocab != cand_vocab:
        raise ValueError(f"vocabularies differ: {reference} has {ref_vocab} tokens, {candidate} "
                         f"{cand_vocab}; the candidate must be a quantization of the reference")


def format_result(r: EvalResult) -> str:
    k, d, iv = r.kld, r.top_prob_delta, r.intervals

    def ci(key: str, scale: float, spec: str, lead: str) -> str:
        """``lead`` and ``key``'s 95% interval by window; nothing below two windows."""
        if key not in iv:
            return ""
        low, high = iv[key]
        return f"{lead}95% {scale * low:{spec}} - {scale * high:{spec}}"

    lines = [
        f"tokens scored        {r.tokens} in {r.windows} windows ({r.seconds:.1f}s)",
        f"PPL reference        {r.ppl_reference:.4f}",
        f"PPL candidate        {r.ppl_candidate:.4f}  (ratio {r.ppl_ratio:.4f}"
        f"{ci('ppl_ratio', 1, '.4f', ', ')})",
        f"KLD mean             {k['mean']:.6f}{ci('kld_mean', 1, '.6f', '  ')}",
        f"KLD median           {k['median']:.6f}",
        f"KLD p90 / p99        {k['p90']:.6f} / {k['p99']:.6f}",
        f"KLD p99.9 / max      {k['p999']:.6f} / {k['max']:.6f}",
        f"same top token       {100 * r.same_top_rate:.2f}%"
        f"{ci('same_top_rate', 100, '.2f', '  ')}",
        f"RMS dp (next token)  {100 * d['rms']:.3f}%",
        f"dp p1/p50/p99        {100 * d['p1']:.3f}% / {100 * d['p50']:.3f}% / "
        f"{100 * d['p99']:.3f}%",
    ]
    return "\n".join(lines)


# --text is read whole only up to this size (a larger file needs --max-tokens); tokenizing a
# text takes several times its size in memory
MAX_TEXT_BYTES = 64 * 2**20
# with --max-tokens N, at most this many characters per token needed are read (a token is
# about 4 characters of English; 32 leaves room for long whitespace or symbol runs)
TEXT_CHARS_PER_TOKEN = 32


def read_text_file(path: str | os.PathLike, max_tokens: int = 0, ctx: int = DEFAULT_CTX) -> str:
    """A --text file as text: a regular UTF-8 file (a BOM is dropped), whole up to
    :data:`MAX_TEXT_BYTES`, or with ``max_tokens`` only its start, enough for that many
    scored tokens in windows of ``ctx``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--text {path} is not a regular file (a pipe, device or folder); "
                         "save the text to a file and pass that")
    size = path.stat().st_size
    if not max_tokens and size > MAX_TEXT_BYTES:
        raise ValueError(f"--text {path} is {size:,} bytes, above the {MAX_TEXT_BYTES:,} bytes "
                         "read whole; pass --max-tokens N to score only its start, or split it")
    # scoring N tokens takes N + one per window (its first token is not scored) tokens
    need_tokens = max_tokens + max_tokens // max(1, ctx - 1) + 1
    limit = min(need_tokens * TEXT_CHARS_PER_TOKEN, MAX_TEXT_BYTES) if max_tokens else -1
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read(limit)
    except UnicodeDecodeError as exc:
        raise ValueError(f"--text {path} is not UTF-8 text ({exc}); re-save it as UTF-8") from None


def eval_inputs(reference: Path, candidate: Path, text_file: Path | None,
                prompts: str | None) -> dict[str, Path | None]:
    """What eval reads (label -> path), for the check that its output overwrites none."""
    from quantpipe.prompts.sets import SHIPPED_SETS

    return {"--reference": reference, "--candidate": candidate, "--text": text_file,
            "--prompts": None if prompts is None or prompts in SHIPPED_SETS else Path(prompts)}


def load_texts(reference: Path, text_file: Path | None, prompts: str | None,
               max_tokens: int = 0, ctx: int = DEFAULT_CTX) -> tuple[str, ...]:
    """The documents to score: a UTF-8 text file (only as much as ``max_tokens`` needs), or
    prompts rendered with the chat template."""
    if (text_file is None) == (prompts is None):
        raise ValueError("give exactly one of --text FILE or --prompts (a file or business-eval)")
    if text_file is not None:
        return (read_text_file(text_file, max_tokens, ctx),)
    from quantpipe.core.sources import load_folder_tokenizer
    from quantpipe.prompts.sets import load_prompt_records, render_eval_texts

    records = load_prompt_records(prompts)  # a bad prompt file fails before the tokenizer loads
    return tuple(render_eval_texts(load_folder_tokenizer(reference), records))
