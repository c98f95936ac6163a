"""The serving engine: requests in, token/text deltas out, one continuous-batching step at a time.

``LLMEngine`` is single-threaded (``add_request`` / ``abort`` / ``step``); the server steps it
in a background thread (``engine_loop.EngineLoop``). Model folders are loaded by
``loading.load_model_for_serving``; token ids become text deltas, and EOS / stop strings end a
request, in ``detokenize``.

Failures stay with the requests they hit: an exception while sampling or detokenizing one
sequence finishes that sequence with ``finish_reason == "error"``; an exception in a step's
forward pass finishes every sequence of that step the same way (their KV blocks are freed) and
the engine goes on. Only an error outside both (the scheduler's bookkeeping), or
``engine_loop.MAX_CONSECUTIVE_STEP_FAILURES`` failed forwards in a row (a broken device), stops
the loop.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from quantpipe.runtime.config import DEFAULTS, KV_DTYPE_NAMES
from quantpipe.runtime.engine.detokenize import Detokenizer, eos_ids, token_bytes
from quantpipe.runtime.engine.kv_cache import BlockPool
from quantpipe.runtime.engine.model_runner import ModelRunner, SeqChunk
from quantpipe.runtime.engine.sampling import SamplingParams, sample_token, token_logprobs
from quantpipe.runtime.engine.scheduler import Scheduler, SchedulerLimits, Sequence

log = logging.getLogger(__name__)


# kv_dtype -> KV cache element type (None: the model's activation dtype)
KV_DTYPES: dict[str, torch.dtype | None] = {"model": None, "bf16": torch.bfloat16}
assert tuple(KV_DTYPES) == KV_DTYPE_NAMES, "runtime.config.KV_DTYPE_NAMES lists the same names"


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = DEFAULTS.block_size  # tokens per KV block
    max_num_seqs: int = DEFAULTS.max_num_seqs  # running sequences per step
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens  # tokens per step
    kv_cache_memory: int | None = None  # KV pool bytes; None -> kv_memory_fraction of free
    num_kv_blocks: int | None = None  # KV pool size in blocks, instead of kv_cache_memory
    max_kv_blocks: int | None = None  # at most this many blocks in a pool sized from memory
    kv_dtype: str = DEFAULTS.kv_dtype  # KV cache elements: "model" (activation dtype) or "bf16"
    kv_memory_fraction: float = DEFAULTS.kv_memory_fraction  # of free memory, when no bytes
    enable_prefix_caching: bool = DEFAULTS.enable_prefix_caching  # reuse full KV blocks
    max_model_len: int | None = None  # prompt + output limit; None -> the model's own limit

    def __post_init__(self) -> None:
        SchedulerLimits(self.max_num_seqs, self.max_num_batched_tokens, self.block_size)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and (self.num_kv_blocks < 1 or self.kv_cache_memory):
            raise ValueError(f"num_kv_blocks must be >= 1 and replaces kv_cache_memory; got "
                             f"{self.num_kv_blocks} blocks and {self.kv_cache_memory} bytes")
        if self.max_kv_blocks is not None and self.max_kv_blocks < 2:
            raise ValueError(f"max_kv_blocks must be >= 2, got {self.max_kv_blocks}")
        if not 0.0 < self.kv_memory_fraction <= 0.95:
            raise ValueError(f"kv_memory_fraction must be in (0, 0.95], got "
                             f"{self.kv_memory_fraction}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r}: use one of {sorted(KV_DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely tokens' (``SamplingParams.logprobs``
    of them), each token as the bytes it stands for."""

    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...]  # most likely first


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens generated since the previous output of this request
    new_text: str  # text delta (held back while it might still become a stop string)
    finished: bool
    finish_reason: str | None  # "stop" (EOS / stop string), "length", "abort", "error"
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    error: str | None = None  # what failed, when finish_reason == "error"
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per new token, if asked for


def failed_output(request_id: str, message: str, prompt_tokens: int = 0,
                  completion_tokens: int = 0) -> RequestOutput:
    """The last output of a request that failed (no text: the client gets an error)."""
    return RequestOutput(request_id, [], "", True, "error", prompt_tokens, completion_tokens, 0,
                         error=message)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        mcfg = model.config
        limit = getattr(mcfg, "max_position_embeddings", None) or 2048
        self.max_model_len = min(config.max_model_len or limit, limit)
        kv_dtype = KV_DTYPES[config.kv_dtype]
        num_blocks = config.num_kv_blocks
        if num_blocks is None:  # probe the KV layout with a 1-block pool to size it in bytes
            probe = ModelRunner(model, config.block_size, 1, kv_dtype)
            kv_bytes = config.kv_cache_memory or int(
                free_memory_bytes(probe.device) * config.kv_memory_fraction)
            num_blocks = probe.kv_spec.num_blocks_for(kv_bytes)
            del probe
            num_blocks = min(num_blocks, config.max_kv_blocks or num_blocks)
        self.runner = ModelRunner(model, config.block_size, num_blocks, kv_dtype)
        block_bytes = self.runner.kv_spec.bytes_per_block
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, config.block_size),
            self.pool,
        )
        self.eos_ids = eos_ids(model, tokenizer)
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._ids = itertools.count()
        self.num_failed = 0  # requests finished with finish_reason "error"
        self.consecutive_step_failures = 0  # forward passes failed in a row (reset on success)
        log.info("KV cache: %d blocks x %d tokens (%.1f MiB, %s)", num_blocks, config.block_size,
                 num_blocks * block_bytes / 2**20, self.runner.kv_dtype)

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        self.validate(prompt_ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(params.seed if params.seed is not None else
                            torch.randint(0, 2**62, ()).item())
        seq = Sequence(rid, list(prompt_ids), params, gen)
        self._seqs[rid] = seq
        self._detok[rid] = Detokenizer()
        self.scheduler.add(seq)
        return rid

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run (reads only fixed sizes: thread-safe)."""
        if not prompt_ids:
            raise ValueError("prompt is empty; send at least one token")
        vocab = self.runner.decoder.embed_tokens.num_embeddings
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's {self.max_model_len}-token limit; shorten the prompt or "
                "lower max_tokens"
            )
        bs = self.config.block_size
        if -(-total // bs) > self.pool.num_blocks:
            raise ValueError(
                f"a {total}-token request needs {-(-total // bs)} KV blocks but the pool has "
                f"{self.pool.num_blocks}; raise --kv-cache-memory or lower max_tokens"
            )

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        self._detok.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        try:
            logits = self.runner.forward([
                SeqChunk(c.seq.all_ids[c.seq.num_computed : c.seq.num_computed + c.num_tokens],
                         c.seq.num_computed, list(c.seq.block_table))
                for c in chunks
            ])  # [B, vocab] fp32
        except Exception as exc:  # fail this step's requests, keep serving the others
            log.exception("forward step over %d sequences failed", len(chunks))
            self.consecutive_step_failures += 1
            return [self._fail(c.seq, f"forward pass failed: {type(exc).__name__}: {exc}")
                    for c in chunks]
        self.consecutive_step_failures = 0
        self.scheduler.after_forward(chunks)
        outputs = []
        for row, c in enumerate(chunks):
            seq = c.seq
            if seq.num_computed < seq.num_tokens:
                continue  # a prefill chunk with more to come: nothing to sample yet
            try:
                tok = sample_token(logits[row], seq.params, seq.generator)
                logprobs = self._logprobs(logits[row], tok, seq.params.logprobs)
                seq.output_ids.append(tok)
                outputs.append(self._emit(seq, tok, logprobs))
            except Exception as exc:  # this request fails alone
                log.exception("sampling request %s failed", seq.request_id)
                outputs.append(self._fail(seq, f"sampling failed: {type(exc).__name__}: {exc}"))
        return outputs

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """Finish ``seq`` with an error and free its blocks (idempotent)."""
        self.scheduler.finish(seq)
        self._seqs.pop(seq.request_id, None)
        self._detok.pop(seq.request_id, None)
        self.num_failed += 1
        return failed_output(seq.request_id, message, len(seq.prompt_ids), len(seq.output_ids))

    def _logprobs(self, logits: torch.Tensor, tok: int,
                  k: int | None) -> tuple[TokenLogprob, ...] | None:
        if k is None:
            return None
        lp = token_logprobs(logits, tok, k)
        chosen, *top = token_bytes(self.tokenizer, [tok, *lp.top_ids])
        return (TokenLogprob(chosen, lp.logprob, tuple(zip(top, lp.top_logprobs))),)

    def _emit(self, seq: Sequence, tok: int,
              logprobs: tuple[TokenLogprob, ...] | None = None) -> RequestOutput:
        new_text, reason = self._detok[seq.request_id].emit(self.tokenizer, seq.output_ids,
                                                            seq.params, self.eos_ids)
        if reason is not None:
            self.scheduler.finish(seq)
            del self._seqs[seq.request_id]
            del self._detok[seq.request_id]
        return RequestOutput(seq.request_id, [tok], new_text, reason is not None, reason,
                             len(seq.prompt_ids), len(seq.output_ids),
                             seq.num_cached_prompt_tokens, logprobs=logprobs)

    # --- convenience ------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 ) -> list[list[int]]:
        """Run prompts to completion together; returns each prompt's generated token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        toks: dict[str, list[int]] = {r: [] for r in rids}
        while self.has_work():
            for out in self.step():
                toks[out.request_id] += out.new_token_ids
        return [toks[r] for r in rids]

    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_total": self.pool.num_blocks,
            "prefix_cache_hit_rate": self.pool.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_failed": self.num_failed,
        }
