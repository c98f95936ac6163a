"""Greedy text generation from an FP16 or a quantized folder, with timings.

``run_generate(GenerateSpec) -> GenerateResult`` runs the prompt through the serving engine
(:mod:`runtime.engine`: our own decoder loop over a paged KV cache, QuantLinear kernels, the
half-precision output head of :mod:`runtime.fp_head`) as one request; model families the
engine does not know run through Hugging Face's forward with a ``DynamicCache`` instead
(:func:`greedy_decode`, also the baseline of ``bench/decode.py``). Prefill is the time to the
first token; decode tokens/s counts the tokens after it.
"""

from __future__ import annotations

import inspect
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpipe.core.heap import peak_rss
from quantpipe.core.io import MANIFEST_NAME
from quantpipe.runtime.config import DEFAULTS
from quantpipe.runtime.fp_head import HEAD_DTYPES


@dataclass(frozen=True)
class GenerateSpec:
    model_dir: Path  # an FP16 export / HF folder, or a quantized (native) folder
    prompt: str  # the user text
    chat: bool = False  # wrap the prompt in the tokenizer's chat template
    max_new_tokens: int = DEFAULTS.max_new_tokens  # tokens after the prompt (stops at EOS)
    device: str = "cpu"  # cpu or cuda
    head_dtype: str = DEFAULTS.generate_head_dtype  # runtime.fp_head mode on CPU (M = 1)
    ignore_eos: bool = False  # generate max_new_tokens even past EOS (benchmarks)
    min_new_tokens: int = 0  # EOS does not stop generation before this many new tokens
    verify: bool = True  # False: skip a quantized folder's hashes and value checks

    def __post_init__(self) -> None:
        if not Path(self.model_dir, "config.json").is_file():
            raise ValueError(f"{self.model_dir} has no config.json; pass a model folder")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: use cpu or cuda")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not self.prompt:
            raise ValueError("prompt is empty; pass --prompt TEXT")
        try:  # bytes that are not UTF-8 reach here from argv as lone surrogates (PEP 383)
            self.prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"--prompt is not UTF-8 text (at character {exc.start}); pass UTF-8 "
                             "text (check the terminal's or script's encoding)") from None
        if self.head_dtype not in HEAD_DTYPES:
            raise ValueError(f"head dtype {self.head_dtype!r}: use one of {HEAD_DTYPES}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"--min-new-tokens {self.min_new_tokens} must be in 0.."
                             f"{self.max_new_tokens} (--max-new-tokens); lower it or raise "
                             "--max-new-tokens")


@dataclass(frozen=True)
class GenerateResult:
    text: str  # the generated continuation only
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_tokens_per_s: float  # new tokens after the first / decode seconds
    peak_memory_bytes: int  # CUDA: max allocated; CPU: process peak RSS
    quantized: bool
    path: str  # "engine" or "hf" (families the engine does not run)


def is_quantized_dir(folder: Path) -> bool:
    manifest = Path(folder) / MANIFEST_NAME
    return manifest.is_file() and json.loads(manifest.read_text()).get("stage") == "quantized"


def prompt_ids(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, return_dict=False)
        return torch.tensor([list(ids)])
    return tokenizer(prompt, return_tensors="pt").input_ids  # [1, T]


@torch.inference_mode()
def greedy_decode(model, ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int],
                  min_new_tokens: int = 0) -> tuple[list[int], float, float]:
    """(new token ids, prefill seconds, decode seconds) with a KV cache, greedy; an EOS token
    ends generation once at least ``min_new_tokens`` were generated (empty ``eos_ids``: never).
    """
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cache = DynamicCache()
    # transformers 5 renamed past_key_values to cache
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    t0 = time.perf_counter()
    # logits_to_keep=1: the lm_head runs on the last position only
    out = model(ids.to(dev), use_cache=True, logits_to_keep=1, **{name: cache})
    tok = int(out.logits[0, -1].argmax())
    sync()
    t1 = time.perf_counter()
    new = [tok]
    while len(new) < max_new_tokens and (tok not in eos_ids or len(new) < min_new_tokens):
        out = model(torch.tensor([[tok]], device=dev), use_cache=True, **{name: cache})
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
    sync()
    return new, t1 - t0, time.perf_counter() - t1


def _first_stop(new: list[int], eos: set[int], min_new_tokens: int) -> int | None:
    """Length of ``new`` up to its first EOS at or after position ``min_new_tokens`` - 1."""
    for i in range(max(0, min_new_tokens - 1), len(new)):
        if new[i] in eos:
            return i + 1
    return None


def engine_decode(model, tokenizer, ids: list[int], max_new_tokens: int,
                  stop_at_eos: bool = True, block_size: int = DEFAULTS.block_size,
                  min_new_tokens: int = 0
                  ) -> tuple[list[int], float, float]:
    """(new token ids, prefill seconds, decode seconds): one greedy request through the engine.

    The KV pool holds exactly this request (prompt + max_new_tokens, rounded up to blocks);
    prefix caching is off so a repeated prompt is timed as a fresh one. With
    ``min_new_tokens``, EOS tokens before that count are generated and generation goes on
    (greedy: the tokens are those of an uninterrupted run); the first EOS after it ends it.
    """
    from quantpipe.runtime.engine import EngineConfig, LLMEngine, SamplingParams
    from quantpipe.runtime.engine.detokenize import eos_ids

    blocks = -(-(len(ids) + max_new_tokens) // block_size) + 1
    engine = LLMEngine(model, tokenizer, EngineConfig(
        block_size=block_size, max_num_seqs=1,
        max_num_batched_tokens=max(DEFAULTS.max_num_batched_tokens, block_size),
        num_kv_blocks=blocks, enable_prefix_caching=False))
    hold = stop_at_eos and min_new_tokens > 1  # the engine ignores EOS; we stop after min
    eos = eos_ids(model, tokenizer) if hold else set()
    engine.add_request(list(ids), SamplingParams(max_tokens=max_new_tokens,
                                                 ignore_eos=hold or not stop_at_eos))
    dev = engine.runner.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    new: list[int] = []
    t0 = time.perf_counter()
    t1 = None
    while engine.has_work():
        for out in engine.step():
            new += out.new_token_ids
        if t1 is None and new:
            sync()
            t1 = time.perf_counter()
        stop = _first_stop(new, eos, min_new_tokens) if hold else None
        if stop is not None:
            new = new[:stop]
            break
    sync()
    return new, t1 - t0, time.perf_counter() - t1


def check_chat_template(folder: Path) -> None:
    """--chat on a model whose tokenizer has no chat template (a base model) is a one-line
    error before the model loads, not transformers' error after it."""
    from quantpipe.core.sources import load_folder_tokenizer

    if not getattr(load_folder_tokenizer(folder), "chat_template", None):
        raise ValueError(f"--chat: the tokenizer in {folder} has no chat template (a base "
                         "model); drop --chat to continue the prompt as plain text")


def run_generate(spec: GenerateSpec) -> GenerateResult:
    from quantpipe.runtime.engine import load_model_for_serving
    from quantpipe.runtime.engine.detokenize import eos_ids
    from quantpipe.runtime.engine.model_runner import FAMILIES

    if spec.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
        torch.cuda.reset_peak_memory_stats()
    folder = Path(spec.model_dir)
    if spec.chat:
        check_chat_template(folder)
    model, tokenizer = load_model_for_serving(folder, spec.device, head_dtype=spec.head_dtype,
                                              verify=spec.verify)
    ids = prompt_ids(tokenizer, spec.prompt, spec.chat)
    if model.config.model_type in FAMILIES:
        path = "engine"
        new, prefill_s, decode_s = engine_decode(model, tokenizer, ids[0].tolist(),
                                                 spec.max_new_tokens, not spec.ignore_eos,
                                                 min_new_tokens=spec.min_new_tokens)
    else:
        path = "hf"
        eos = set() if spec.ignore_eos else eos_ids(model, tokenizer)
        new, prefill_s, decode_s = greedy_decode(model, ids, spec.max_new_tokens, eos,
                                                 spec.min_new_tokens)
    if spec.device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = peak_rss() or 0
    decode_tokens = len(new) - 1
    return GenerateResult(
        text=tokenizer.decode(new, skip_special_tokens=True),
        prompt_tokens=int(ids.shape[1]),
        new_tokens=len(new),
        prefill_s=prefill_s,
        decode_tokens_per_s=decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0,
        peak_memory_bytes=int(peak),
        quantized=is_quantized_dir(folder),
        path=path,
    )
