"""The serving engine: requests in, token/text deltas out, one continuous-batching step at a time.

``LLMEngine`` is single-threaded (``add_request`` / ``abort`` / ``step``). ``EngineLoop`` runs it
in a background thread for the server: other threads submit and abort through a thread-safe
command queue, and receive outputs through the callback they registered.

Failures stay with the requests they hit: an exception while sampling or detokenizing one
sequence finishes that sequence with ``finish_reason == "error"``; an exception in a step's
forward pass finishes every sequence of that step the same way (their KV blocks are freed) and
the engine goes on. Only an error outside both (the scheduler's bookkeeping), or
``MAX_CONSECUTIVE_STEP_FAILURES`` failed forwards in a row (a broken device), stops the loop.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpipe.core.heap import release_freed_memory
from quantpipe.runtime.engine.kv_cache import BlockPool
from quantpipe.runtime.engine.model_runner import ModelRunner, SeqChunk
from quantpipe.runtime.engine.sampling import SamplingParams, sample_token
from quantpipe.runtime.engine.scheduler import Scheduler, SchedulerLimits, Sequence
from quantpipe.runtime.fp_head import set_half_head

log = logging.getLogger(__name__)


# Forward passes failing back to back mean the device or model is broken, not one request:
# the loop then stops and reports itself dead (/health 503) instead of failing every request.
MAX_CONSECUTIVE_STEP_FAILURES = 8

# kv_dtype -> KV cache element type (None: the model's activation dtype)
KV_DTYPES: dict[str, torch.dtype | None] = {"model": None, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 16  # running sequences per step
    max_num_batched_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    kv_cache_memory: int | None = None  # KV pool bytes; None -> kv_memory_fraction of free
    num_kv_blocks: int | None = None  # KV pool size in blocks, instead of kv_cache_memory
    kv_dtype: str = "model"  # KV cache elements: "model" (activation dtype) or "bf16"
    kv_memory_fraction: float = 0.5  # of free device (or system) memory, when bytes not given
    enable_prefix_caching: bool = True  # reuse full KV blocks across requests
    max_model_len: int | None = None  # prompt + output limit; None -> the model's own limit

    def __post_init__(self) -> None:
        SchedulerLimits(self.max_num_seqs, self.max_num_batched_tokens, self.block_size)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and (self.num_kv_blocks < 1 or self.kv_cache_memory):
            raise ValueError(f"num_kv_blocks must be >= 1 and replaces kv_cache_memory; got "
                             f"{self.num_kv_blocks} blocks and {self.kv_cache_memory} bytes")
        if not 0.0 < self.kv_memory_fraction <= 0.95:
            raise ValueError(f"kv_memory_fraction must be in (0, 0.95], got "
                             f"{self.kv_memory_fraction}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r}: use one of {sorted(KV_DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


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


def failed_output(request_id: str, message: str, prompt_tokens: int = 0,
                  completion_tokens: int = 0) -> RequestOutput:
    """The last output of a request that failed (no text: the client gets an error)."""
    return RequestOutput(request_id, [], "", True, "error", prompt_tokens, completion_tokens, 0,
                         error=message)


@dataclass
class _Detok:
    """Incremental detokenization state of one request (vLLM's prefix/read offsets)."""

    text: str = ""  # decoded text of the output tokens so far
    emitted: int = 0  # characters already returned
    prefix: int = 0  # output index where the decode window starts (a character boundary)
    read: int = 0  # output tokens already turned into text

    def advance(self, tokenizer, ids: list[int], final: bool) -> None:
        """Append the text of ``ids[self.read:]``, decoding only a short window.

        The window starts at ``prefix``, an earlier boundary, so tokenizers whose decode
        depends on the previous token (leading spaces) diff correctly; text is only taken
        once it does not end in an incomplete UTF-8 character (U+FFFD), unless ``final``.
        Each call costs O(window), not O(output): the full text is never decoded again.
        """
        before = tokenizer.decode(ids[self.prefix:self.read], skip_special_tokens=True)
        after = tokenizer.decode(ids[self.prefix:], skip_special_tokens=True)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(ids)


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
        window = getattr(mcfg, "sliding_window", None)
        if window and getattr(mcfg, "use_sliding_window", mcfg.model_type == "mistral"):
            limit = min(limit, window)  # no sliding-window attention here: stay inside one window
        self.max_model_len = min(config.max_model_len or limit, limit)
        kv_dtype = KV_DTYPES[config.kv_dtype]
        num_blocks = config.num_kv_blocks
        if num_blocks is None:  # probe the KV layout with a 1-block pool to size it in bytes
            probe = ModelRunner(model, config.block_size, 1, kv_dtype)
            kv_bytes = config.kv_cache_memory or int(
                free_memory_bytes(probe.device) * config.kv_memory_fraction)
            num_blocks = probe.kv_spec.num_blocks_for(kv_bytes)
            del probe
        self.runner = ModelRunner(model, config.block_size, num_blocks, kv_dtype)
        block_bytes = self.runner.kv_spec.bytes_per_block
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, config.block_size),
            self.pool,
        )
        self.eos_ids = eos_ids(model, tokenizer)
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, _Detok] = {}
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
        self._detok[rid] = _Detok()
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
                seq.output_ids.append(tok)
                outputs.append(self._emit(seq, tok))
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

    def _emit(self, seq: Sequence, tok: int) -> RequestOutput:
        p = seq.params
        d = self._detok[seq.request_id]
        reason = None
        if tok in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens:
            reason = "length"
        d.advance(self.tokenizer, seq.output_ids, final=reason is not None)
        for s in p.stop:
            # Only search the new region (+ overlap) so an earlier emitted char cannot match.
            at = d.text.find(s, max(0, d.emitted - len(s) + 1))
            if at != -1:
                d.text, reason = d.text[:at], "stop"
                break
        if reason is None:
            # Hold back a possible stop-string prefix and an incomplete UTF-8 character.
            hold = max((len(s) - 1 for s in p.stop), default=0)
            end = len(d.text) - hold
            while end > d.emitted and d.text[end - 1] == "\ufffd":
                end -= 1
        else:
            end = len(d.text)
        end = max(end, d.emitted)
        new_text, d.emitted = d.text[d.emitted : end], end
        if reason is not None:
            self.scheduler.finish(seq)
            del self._seqs[seq.request_id]
            del self._detok[seq.request_id]
        return RequestOutput(seq.request_id, [tok], new_text, reason is not None, reason,
                             len(seq.prompt_ids), len(seq.output_ids),
                             seq.num_cached_prompt_tokens)

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


def eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    ids: set[int] = set()
    gc = getattr(model, "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return ids


def load_model_for_serving(model_dir: str | Path, device: str = "cpu",
                           dtype: torch.dtype | None = None, head_dtype: str = "fp32"):
    """(model, tokenizer) from an FP16 export or a quantpipe quantized folder.

    ``head_dtype``: precision of the embedding table and output head on CPU
    (``runtime.fp_head``; fp32 = the model's dtype, unchanged). On CUDA the whole model already
    runs in fp16 and ``head_dtype`` is ignored.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(model_dir)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{folder} has no config.json; pass a folder written by export-fp16 "
                         "or export")
    cfg = json.loads(cfg_path.read_text())
    # fp32 on CPU: fp16 matmuls there are slow and less exact; fp16 on CUDA.
    dtype = dtype or (torch.float16 if device.startswith("cuda") else torch.float32)
    qcfg = cfg.get("quantization_config") or {}
    if qcfg.get("quant_method") == "quantpipe":
        try:
            from quantpipe.runtime.loader import load_quantized_model
        except ImportError as exc:
            raise ValueError(
                f"{folder} is a quantpipe quantized folder but runtime.loader is not available "
                f"({exc}); serve the FP16 folder instead"
            ) from exc
        model = load_quantized_model(folder, device, dtype)
    elif qcfg:
        raise ValueError(f"{folder} uses quant_method {qcfg.get('quant_method')!r}; the engine "
                         "serves FP16 folders and quantpipe-native quantized folders")
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, use_safetensors=True, trust_remote_code=False
        ).to(device)
    set_half_head(model, head_dtype if device == "cpu" else "fp32")
    release_freed_memory()  # the load's temporaries and a replaced fp32 table
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    return model.eval(), tok


# --- background thread for the server -------------------------------------------------------
Callback = Callable[[RequestOutput], None]


class EngineLoop:
    """Steps an ``LLMEngine`` in a daemon thread; submit/abort are thread-safe.

    Every submitted request gets exactly one finished output through its callback, also when
    the loop dies: ``error`` is then set (the server answers /health with 503) and every
    pending and later request is finished with ``finish_reason == "error"``.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cmds: queue.Queue = queue.Queue()
        self._callbacks: dict[str, Callback] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # orders submit() against the loop's death
        self._thread = threading.Thread(target=self._run, name="quantpipe-engine", daemon=True)
        self.stats: dict[str, float] = engine.stats()
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout=10)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               callback: Callback) -> None:
        with self._lock:
            if self.error is None:
                self._cmds.put(("add", request_id, prompt_ids, params, callback))
                return
        _deliver(callback, failed_output(request_id, f"engine stopped: {self.error}",
                                         len(prompt_ids)))

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, ids, params, cb = cmd
            try:
                self.engine.add_request(ids, params, rid)
            except Exception as exc:  # validated up front by the server; fail it, never crash
                log.exception("adding request %s failed", rid)
                _deliver(cb, failed_output(rid, f"request rejected by the engine: {exc}",
                                           len(ids)))
                return
            self._callbacks[rid] = cb
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
            self._callbacks.pop(cmd[1], None)
        elif cmd[0] == "wake":
            pass
        else:
            raise AssertionError(f"unknown engine command {cmd[0]!r}")

    def _step(self) -> None:
        t0 = time.perf_counter()
        outs = self.engine.step() if self.engine.has_work() else []
        for out in outs:
            cb = self._callbacks.get(out.request_id)
            if out.finished:
                self._callbacks.pop(out.request_id, None)
            if cb is not None:
                _deliver(cb, out)
        if self.engine.consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise RuntimeError(f"{self.engine.consecutive_step_failures} forward passes failed "
                               "in a row; restart the server (see its log for the cause)")
        self.stats = {**self.engine.stats(), "step_seconds": time.perf_counter() - t0}

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_work()
                try:
                    cmd = self._cmds.get(timeout=0.1) if block else self._cmds.get_nowait()
                    self._apply(cmd)
                    while True:
                        self._apply(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                self._step()
        except BaseException as exc:  # surface engine crashes through /health, never hang
            log.exception("engine loop crashed")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self.error = exc
            pending = []
            while True:
                try:
                    pending.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
        message = f"engine stopped: {type(exc).__name__}: {exc}"
        for cmd in pending:
            if cmd[0] == "add":
                _deliver(cmd[4], failed_output(cmd[1], message, len(cmd[2])))
        for rid, cb in list(self._callbacks.items()):
            _deliver(cb, failed_output(rid, message))
        self._callbacks.clear()


def _deliver(callback: Callback, out: RequestOutput) -> None:
    """Hand one output to its request; a broken callback must not stop the engine."""
    try:
        callback(out)
    except Exception:
        log.exception("delivering an output of request %s failed", out.request_id)
