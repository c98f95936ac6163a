"""Greedy/sampled text generation from an FP16 or a quantized folder, with timings.

``run_generate(GenerateSpec) -> GenerateResult``: prefill is one forward over the prompt,
decode is a loop of single-token forwards through the KV cache (greedy), each timed apart.
"""

from __future__ import annotations

import inspect
import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpipe.io import MANIFEST_NAME


@dataclass(frozen=True)
class GenerateSpec:
    model_dir: Path  # an FP16 export / HF folder, or a quantized (native) folder
    prompt: str  # the user text
    chat: bool = False  # wrap the prompt in the tokenizer's chat template
    max_new_tokens: int = 64  # tokens generated after the prompt (stops early at EOS)
    device: str = "cpu"  # cpu or cuda

    def __post_init__(self) -> None:
        if not Path(self.model_dir, "config.json").is_file():
            raise ValueError(f"{self.model_dir} has no config.json; pass a model folder")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: use cpu or cuda")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not self.prompt:
            raise ValueError("prompt is empty; pass --prompt TEXT")


@dataclass(frozen=True)
class GenerateResult:
    text: str  # the generated continuation only
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_tokens_per_s: float  # new tokens after the first / decode seconds
    peak_memory_bytes: int  # CUDA: max allocated; CPU: process peak RSS
    quantized: bool


def is_quantized_dir(folder: Path) -> bool:
    manifest = Path(folder) / MANIFEST_NAME
    return manifest.is_file() and json.loads(manifest.read_text()).get("stage") == "quantized"


def load_model(folder: Path, device: str):
    """(model, quantized) for an FP16 or quantized folder."""
    if is_quantized_dir(folder):
        from runtime.loader import load_quantized_model

        return load_quantized_model(folder, device=device), True
    from transformers import AutoModelForCausalLM

    # FP folders run in their stored dtype on CUDA; fp32 on CPU (fp16 matmuls are slow there)
    dtype = torch.float32 if device == "cpu" else torch.float16
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    return model.eval(), False


def prompt_ids(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, return_dict=False)
        return torch.tensor([list(ids)])
    return tokenizer(prompt, return_tensors="pt").input_ids  # [1, T]


@torch.inference_mode()
def greedy_decode(model, ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int]
                  ) -> tuple[list[int], float, float]:
    """(new token ids, prefill seconds, decode seconds) with a KV cache, greedy."""
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
    while len(new) < max_new_tokens and tok not in eos_ids:
        out = model(torch.tensor([[tok]], device=dev), use_cache=True, **{name: cache})
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
    sync()
    return new, t1 - t0, time.perf_counter() - t1


def eos_token_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {eos} if eos is not None else set()


def run_generate(spec: GenerateSpec) -> GenerateResult:
    from transformers import AutoTokenizer

    if spec.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
        torch.cuda.reset_peak_memory_stats()
    folder = Path(spec.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model, quantized = load_model(folder, spec.device)
    ids = prompt_ids(tokenizer, spec.prompt, spec.chat)
    new, prefill_s, decode_s = greedy_decode(model, ids, spec.max_new_tokens,
                                             eos_token_ids(model, tokenizer))
    if spec.device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:  # ru_maxrss is in KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    decode_tokens = len(new) - 1
    return GenerateResult(
        text=tokenizer.decode(new, skip_special_tokens=True),
        prompt_tokens=int(ids.shape[1]),
        new_tokens=len(new),
        prefill_s=prefill_s,
        decode_tokens_per_s=decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0,
        peak_memory_bytes=int(peak),
        quantized=quantized,
    )
