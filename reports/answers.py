"""Greedy answers to the held-out prompts through quantpipe's serving engine, with speed and memory.

The report needs every model's answers to the same prompts. Hugging Face ``generate`` on both
whole models costs a padded batch per step and holds the reference and a candidate at once;
here each model is loaded alone (:func:`runtime.engine.load_model_for_serving`: the FP16 folder,
or a quantized folder on quantpipe's kernels), answers every prompt through the engine's
continuous batching, and is released before the next one loads.

The answers are timed as a serving benchmark would time them (``vllm bench serve``'s
definitions, as :mod:`runtime.loadgen`): a closed loop of ``concurrency`` requests in flight
(a request is sent when one finishes), TTFT = first token - send, TPOT = (last token - first
token) / (tokens - 1), output tokens/s = all output tokens / wall time. The answers come from
the loop at ``BATCH_CONCURRENCY``; a few of the prompts run again one at a time for the
single-user latencies. Peak RSS is the process's high-water mark (``VmHWM``, reset before each
model loads where Linux allows it) while that model loaded and answered.

A GPTQ or compressed-tensors candidate is verified and dequantized (quantpipe's runtime serves
its native format) and answers through the engine untimed; families the engine does not run
are answered by Hugging Face ``generate`` (greedy, batched, left-padded), untimed too.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantpipe.core.heap import peak_rss, release_freed_memory, reset_peak_rss
from quantpipe.core.io import weights_bytes
from quantpipe.prompts.sets import PromptRecord
from quantpipe.reports.data import ModelSpeed

log = logging.getLogger(__name__)

BATCH_CONCURRENCY = 8  # requests in flight while answering every prompt
SINGLE_PROMPTS = 3  # prompts answered again one at a time (concurrency 1)
# the output head: fp16 holds an FP16 export's table exactly (the int8 head `serve` uses by
# default would round the reference itself); both the reference and the candidates use it
HEAD_DTYPE = "fp16"


@dataclass(frozen=True)
class Answers:
    texts: tuple[str, ...]  # one per prompt, special tokens removed
    tokens: tuple[int, ...]  # output tokens per prompt
    speed: ModelSpeed | None  # None where Hugging Face generate answered (no engine)
    note: str = ""  # prompts cut to fit the model's context, if any


def render_prompts(tokenizer, records: list[PromptRecord]) -> list[list[int]]:
    """Each record as token ids: the chat template with the generation prompt where the
    tokenizer has one, else the record's text as it is."""
    out = []
    for r in records:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(r.chat(), add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        else:
            ids = tokenizer(r.prompt or "\n".join(c for _, c in r.messages or ()),
                            add_special_tokens=True).input_ids
        out.append([int(t) for t in ids])
    return out


def fit_context(prompt: list[int], budget: int, limit: int) -> tuple[list[int], int]:
    """(prompt, new-token budget) within the model's ``limit`` tokens: the budget is lowered
    to what the context leaves, but to no less than half the context (or the budget, if
    smaller) for an answer; a prompt still too long keeps its end (the question and the chat
    template's generation prompt), as every model of the report gets it."""
    if len(prompt) + budget <= limit:
        return prompt, budget
    budget = min(budget, max(limit - len(prompt), limit // 2))
    return prompt[max(0, len(prompt) + budget - limit):], budget


# ------------------------------------------------------------------------------ timing


@dataclass
class _Timing:
    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0


def closed_loop(engine, prompts: list[list[int]], max_new_tokens: list[int], concurrency: int,
                desc: str | None = None) -> tuple[list[list[int]], dict]:
    """Answer ``prompts`` greedily (at most ``max_new_tokens[i]`` tokens for prompt ``i``) with
    at most ``concurrency`` in flight (the next prompt is sent when one finishes); returns
    (each prompt's output token ids, the loop's timings: ``ttft_ms`` / ``tpot_ms``
    percentiles, ``output_tokens_per_s``, ``requests``, the KV pool's tokens and the
    preemptions it caused).

    A prompt is sent only when the KV pool holds it at its longest (prompt + budget) beside
    the requests in flight at theirs (the first one in flight always goes): in a pool smaller
    than ``concurrency`` requests, fewer run at once instead of the engine preempting them.
    A preempted request is recomputed whole (its prompt and every token so far), and with a
    full pool the newest one is preempted again and again: a Llama-2-7B report in a 1 GiB
    pool (about three of its requests) answered 7 prompts in 37 minutes that way."""
    from quantpipe.runtime.engine import SamplingParams
    from quantpipe.runtime.loadgen import latency_stats

    waiting = collections.deque(enumerate(prompts))
    ids: dict[str, int] = {}
    toks: list[list[int]] = [[] for _ in prompts]
    timing: dict[int, _Timing] = {}
    need = _request_need(prompts, max_new_tokens, engine.config.block_size)
    capacity = engine.pool.num_blocks - 1  # as _blocks_at_once counts
    bar = tqdm(total=len(prompts), desc=desc, unit="answer", disable=desc is None)
    preempted = engine.scheduler.num_preemptions
    most_in_flight = 0
    t0 = time.perf_counter()
    while waiting or ids:
        held = sum(need[i] for i in ids.values())
        while waiting and len(ids) < concurrency and (
                not ids or held + need[waiting[0][0]] <= capacity):
            i, p = waiting.popleft()
            ids[engine.add_request(p, SamplingParams(max_tokens=max_new_tokens[i]))] = i
            timing[i] = _Timing(time.perf_counter())
            held += need[i]
        most_in_flight = max(most_in_flight, len(ids))
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            i = ids[out.request_id]
            t = timing[i]
            if out.new_token_ids:
                toks[i] += out.new_token_ids
                t.first = now if t.first is None else t.first
                t.last = now
                t.tokens += len(out.new_token_ids)
            if out.finished:
                if out.finish_reason == "error":
                    raise RuntimeError(f"the engine failed on prompt {i}: {out.error}")
                del ids[out.request_id]
                bar.update(1)
    wall = time.perf_counter() - t0
    bar.close()
    done = [t for t in timing.values() if t.first is not None]
    ttfts = [t.first - t.sent for t in done]
    tpots = [(t.last - t.first) / (t.tokens - 1) for t in done if t.tokens > 1]
    stats = {"requests": len(prompts), "concurrency": concurrency,
             "output_tokens_per_s": sum(t.tokens for t in done) / wall if wall > 0 else 0.0,
             # a pool too small for `concurrency` requests runs fewer at once
             "kv_pool_tokens": engine.pool.num_blocks * engine.config.block_size,
             "preemptions": engine.scheduler.num_preemptions - preempted,
             "most_in_flight": most_in_flight,
             "kv_pool_limited": engine.pool.num_blocks < _blocks_at_once(
                 prompts, max_new_tokens, engine.config.block_size, concurrency),
             # milliseconds: mean and percentiles as `bench-serve` (and vLLM) compute them
             "ttft_ms": asdict(latency_stats(ttfts)) if ttfts else {},
             "tpot_ms": asdict(latency_stats(tpots)) if tpots else {}}
    return toks, stats


# ------------------------------------------------------------------------------ one model


@dataclass(frozen=True)
class AnswerPrecision:
    """How every model of a report answers (``reports.build.answer_precision``: the
    reference's memory decides)."""

    activations: torch.dtype  # activation dtype of the answering models
    kv_dtype: str  # the engine's KV cache elements: "model" (activation dtype) or "bf16"
    note: str = ""  # said on the page where it is not fp32 throughout
    step_tokens: int | None = None  # prompt tokens per engine step (None: the engine default;
    # fewer: smaller activations in each prefill step, for a model that only just fits)
    kv_cache_memory: int | None = None  # KV pool bytes at most unless --kv-cache-memory says
    # (None: what 8 requests need), never less than the longest request needs


def _request_need(prompts: list[list[int]], max_new_tokens: list[int], block_size: int
                  ) -> list[int]:
    """KV blocks of each request at its longest (prompt + budget), in the prompts' order."""
    return [-(-(len(p) + n) // block_size) for p, n in zip(prompts, max_new_tokens)]


def _request_blocks(prompts: list[list[int]], max_new_tokens: list[int], block_size: int
                    ) -> list[int]:
    """:func:`_request_need`, largest first."""
    return sorted(_request_need(prompts, max_new_tokens, block_size), reverse=True)


def _blocks_at_once(prompts: list[list[int]], max_new_tokens: list[int], block_size: int,
                    concurrency: int) -> int:
    """A pool in which any ``concurrency`` of the requests run at once, none waiting."""
    return sum(_request_blocks(prompts, max_new_tokens, block_size)[:concurrency]) + 1


def _engine_for(model, tokenizer, prompts: list[list[int]], max_new_tokens: list[int],
                kv_cache_memory: int | None = None,
                precision: AnswerPrecision = AnswerPrecision(torch.float32, "model")):
    """An engine whose KV pool holds the ``BATCH_CONCURRENCY`` largest requests at once (no
    request waits for blocks) or what ``kv_cache_memory`` bytes hold (default: the
    precision's cap, else the engine's share of the free memory), whichever is less: in a
    smaller pool :func:`closed_loop` runs fewer requests at a time (greedy answers do not
    change). The precision's cap (not a user's) grows to hold the longest request.
    Activations, KV dtype and tokens per step: ``precision``'s. Prefix caching off (each
    prompt is timed as a fresh one)."""
    from quantpipe.runtime.config import DEFAULTS
    from quantpipe.runtime.engine import EngineConfig, LLMEngine

    bs = DEFAULTS.block_size
    blocks = _request_blocks(prompts, max_new_tokens, bs)

    def build(memory: int | None, num_blocks: int | None = None) -> LLMEngine:
        return LLMEngine(model, tokenizer, EngineConfig(
            block_size=bs, max_num_seqs=BATCH_CONCURRENCY, kv_cache_memory=memory,
            num_kv_blocks=num_blocks,
            max_num_batched_tokens=precision.step_tokens or DEFAULTS.max_num_batched_tokens,
            max_kv_blocks=_blocks_at_once(prompts, max_new_tokens, bs, BATCH_CONCURRENCY),
            kv_dtype=precision.kv_dtype, enable_prefix_caching=False, max_model_len=None))

    engine = build(kv_cache_memory or precision.kv_cache_memory)
    if engine.pool.num_blocks < blocks[0]:
        if kv_cache_memory is None and precision.kv_cache_memory is not None:
            return build(None, blocks[0] + 1)  # the longest request, one at a time if need be
        per_block = engine.runner.kv_spec.bytes_per_block
        raise ValueError(
            f"the longest prompt with its answer needs {blocks[0] * per_block / 2**20:,.0f} MiB "
            f"of KV cache but the pool holds {engine.pool.num_blocks * per_block / 2**20:,.0f} "
            "MiB: raise --kv-cache-memory (or free memory) or lower --max-new-tokens")
    return engine


def load_answering_model(folder: Path, dtype: torch.dtype):
    """(model, tokenizer, timed): an FP16 folder or a quantpipe-native one as ``serve`` loads
    it (quantpipe's kernels; an FP16 folder built tensor by tensor, its linear layers on their
    fp16 weights with fp32 activations: its speed is what a deployment gets, ``timed``); a GPTQ
    or compressed-tensors folder verified and dequantized (its answers are its weights', its
    speed would be fp32's, so it is not timed: quantpipe's runtime serves the native format)."""
    from quantpipe.core.formats.loader import load_dequantized_model
    from quantpipe.core.sources import load_folder_tokenizer
    from quantpipe.reports.eval import model_config
    from quantpipe.runtime.engine import load_model_for_serving

    method = (model_config(folder).get("quantization_config") or {}).get("quant_method")
    if method in (None, "quantpipe"):
        return (*load_model_for_serving(folder, "cpu", dtype=dtype, head_dtype=HEAD_DTYPE),
                True)
    log.info("%s: %s checkpoint answered dequantized (not timed)", folder, method)
    return load_dequantized_model(folder, dtype), load_folder_tokenizer(folder), False


def answer_prompts(folder: Path, name: str, records: list[PromptRecord], max_new_tokens: int,
                   precision: AnswerPrecision = AnswerPrecision(torch.float32, "model"),
                   json_new_tokens: int | None = None,
                   kv_cache_memory: int | None = None) -> Answers:
    """Load ``folder`` alone, answer every record greedily (at most ``max_new_tokens`` each,
    ``json_new_tokens`` for a record that expects a JSON object: an object cut off cannot be
    compared), time it, release it. ``precision``: activation and KV cache dtypes;
    ``kv_cache_memory``: bytes for the engine's KV pool at most (``_engine_for``)."""
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    model, tokenizer, timed = load_answering_model(Path(folder), precision.activations)
    load_s = time.perf_counter() - t0
    limit = getattr(model.config, "max_position_embeddings", None) or 2048  # as the engine's
    rendered = render_prompts(tokenizer, records)
    fitted = [fit_context(p, (json_new_tokens or max_new_tokens) if r.expect_json
                          else max_new_tokens, limit) for p, r in zip(rendered, records)]
    prompts, budget = [p for p, _ in fitted], [b for _, b in fitted]
    clipped = sum(len(p) < len(q) for p, q in zip(prompts, rendered))
    note = (f"{clipped} of {len(prompts)} prompts do not fit the model's {limit}-token context "
            "with their answer: they keep their last tokens." if clipped else "")
    if note:
        log.info("%s: %s", name, note)  # and on the page (Answers.note)
    texts, tokens, runs, kv_bytes, kv_dtype = _answer(model, tokenizer, prompts, budget, name,
                                                      kv_cache_memory, precision)
    speed = None
    if runs and timed:
        speed = ModelSpeed(
            name=name, weight_bytes=weights_bytes(folder), peak_rss_bytes=peak_rss(),
            peak_rss_reset=reset, kv_bytes_per_token=kv_bytes, load_s=load_s,
            by_concurrency=runs,
            activation_dtype=str(precision.activations).removeprefix("torch."),
            head_dtype=HEAD_DTYPE, kv_dtype=str(kv_dtype).removeprefix("torch."))
    del model, tokenizer
    release_freed_memory()  # the next model loads into the memory this one held
    return Answers(texts, tokens, speed, note)


def _answer(model, tokenizer, prompts: list[list[int]], budget: list[int], name: str,
            kv_cache_memory: int | None, precision: AnswerPrecision
            ) -> tuple[tuple[str, ...], tuple[int, ...], dict[int, dict], int, str]:
    """(texts, output tokens, the engine loops' timings by concurrency, the engine's KV bytes
    per token and element dtype); no timings where Hugging Face generate answered."""
    from quantpipe.runtime.engine.model_runner import FAMILIES

    if model.config.model_type not in FAMILIES:
        answers = _hf_answers(model, tokenizer, prompts, budget, name)
        return tuple(t for t, _ in answers), tuple(n for _, n in answers), {}, 0, ""
    engine = _engine_for(model, tokenizer, prompts, budget, kv_cache_memory, precision)
    closed_loop(engine, prompts[:1], [4], 1)  # warm-up: first-call costs stay out
    toks, batch = closed_loop(engine, prompts, budget, BATCH_CONCURRENCY,
                              desc=f"report: {name} answers")
    single_idx = [int(i * len(prompts) / SINGLE_PROMPTS)
                  for i in range(min(SINGLE_PROMPTS, len(prompts)))]
    _, single = closed_loop(engine, [prompts[i] for i in single_idx],
                            [budget[i] for i in single_idx], 1)
    texts = tuple(tokenizer.decode(t, skip_special_tokens=True) for t in toks)
    return (texts, tuple(len(t) for t in toks), {1: single, BATCH_CONCURRENCY: batch},
            engine.runner.kv_spec.bytes_per_token, str(engine.runner.kv_dtype))


@torch.no_grad()
def _hf_answers(model, tokenizer, prompts: list[list[int]], max_new_tokens: list[int],
                name: str, batch_size: int = 8) -> list[tuple[str, int]]:
    """(text, output tokens) per prompt by Hugging Face generate, greedy, left-padded; a batch
    runs to its longest budget and each answer is cut to its own."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    out = []
    for start in tqdm(range(0, len(prompts), batch_size), desc=f"report: {name} answers",
                      unit="batch", leave=False):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        limits = max_new_tokens[start : start + batch_size]
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(limits),
                             do_sample=False, pad_token_id=pad)[:, width:]
        for row, limit in zip(gen.tolist(), limits):
            row = row[:limit]
            n = next((i + 1 for i, t in enumerate(row) if t == eos), len(row))
            out.append((tokenizer.decode(row[:n], skip_special_tokens=True), n))
    return out
