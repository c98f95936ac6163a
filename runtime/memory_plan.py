"""Serving memory planner: weights + KV cache + activations + reserve vs the device's memory.

KV cache per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element. A sequence
of ``context`` tokens holds ceil(context / block_size) blocks. Weights are the actual bytes of
the folder's safetensors tensors (so a quantized folder counts its packed INT4 + scales), plus
what loading widens: a native INT5 / INT6 layer runs as INT8 (``kernels.layout.widen_to_int8``). The
activation peak is an estimate of one engine step (see :func:`activation_peak_bytes`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from quantpipe.runtime.config import DEFAULTS

# qformat.VALID_BITS (kept here so this module imports without torch): the widths the runtime
# holds as stored; any other (INT5 / INT6) is held as INT8
KERNEL_BITS = (4, 8)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int  # KV / activation element size

    @classmethod
    def from_config(cls, cfg: dict, kv_dtype: str | None = None) -> ModelDims:
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
        except KeyError as exc:
            raise ValueError(f"config.json lacks {exc}; the planner needs a decoder-only config "
                             "with num_hidden_layers, num_attention_heads, hidden_size") from None
        dtype = kv_dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "float16"
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}")
        return cls(
            num_layers=layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
            vocab_size=int(cfg.get("vocab_size") or 32000), dtype_bytes=DTYPE_BYTES[dtype],
        )


@dataclass(frozen=True)
class MemoryPlanSpec:
    model_dir: Path | None  # folder with config.json + *.safetensors (None: config-only plan)
    context: int = DEFAULTS.plan_context  # tokens per sequence (prompt + output)
    concurrency: int = DEFAULTS.plan_concurrency  # sequences that must fit at once
    device_memory: int = DEFAULTS.device_memory  # bytes on the device
    utilization: float = DEFAULTS.utilization  # fraction of device memory the server may use
    block_size: int = DEFAULTS.block_size  # KV block size (context rounds up to whole blocks)
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens  # per step (activations)
    runtime_reserve: int = DEFAULTS.runtime_reserve  # CUDA context, allocator slack, workspaces
    kv_dtype: str | None = None  # None -> the config's dtype

    def __post_init__(self) -> None:
        if self.context < 1 or self.concurrency < 1:
            raise ValueError("--context and --concurrency must be >= 1")
        if not 0.0 < self.utilization <= 1.0:
            raise ValueError(f"--utilization must be in (0, 1], got {self.utilization}")
        if self.device_memory <= 0 or self.runtime_reserve < 0:
            raise ValueError("--device-memory must be positive and the reserve >= 0")
        if self.block_size < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size and max_num_batched_tokens must be >= 1")


@dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int  # at `context`, rounded up to whole blocks
    activation_bytes: int
    reserve_bytes: int
    usable_bytes: int  # device_memory x utilization
    kv_budget_bytes: int  # usable - weights - activations - reserve (may be negative)
    max_concurrent_sequences: int  # at `context`
    required_bytes: int  # device memory (before utilization) for `concurrency` sequences
    fits: bool
    context: int
    concurrency: int


def kv_bytes_per_token(d: ModelDims) -> int:
    """2 (K, V) x layers x kv_heads x head_dim x element bytes."""
    return 2 * d.num_layers * d.num_kv_heads * d.head_dim * d.dtype_bytes


def activation_peak_bytes(d: ModelDims, tokens: int, seqs: int, context: int) -> int:
    """Estimated live tensors of one step with ``tokens`` new tokens over ``seqs`` sequences.

    Per token: residual + norm output + attention output + MLP output (4 x hidden), q/k/v
    ((heads + 2 kv_heads) x head_dim) and the MLP's gate and up ([2 x intermediate]). Per
    sequence: fp32 logits of its last token. Plus the engine's gather + SDPA attention path,
    which materializes each sequence's K and V densely (``seqs x context x kv_heads x head_dim
    x 2``) for the layer being run.
    """
    per_token = (4 * d.hidden_size + (d.num_heads + 2 * d.num_kv_heads) * d.head_dim
                 + 2 * d.intermediate_size) * d.dtype_bytes
    logits = seqs * d.vocab_size * 4
    gathered = seqs * context * d.num_kv_heads * d.head_dim * 2 * d.dtype_bytes
    return tokens * per_token + logits + gathered


def _headers(folder: Path) -> dict[str, dict]:
    """Every tensor's header entry over *.safetensors (header: u64 LE length + JSON)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors files; pass a model folder written by "
                         "export-fp16 or export")
    out: dict[str, dict] = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out.update((k, v) for k, v in header.items() if k != "__metadata__")
    return out


def runtime_weight_bytes(folder: Path) -> int:
    """Tensor payload bytes over *.safetensors plus what loading adds: each INT5 / INT6 layer
    of a native folder is held as INT8 (codes at 8 bits, no zero points)."""
    headers = _headers(folder)
    total = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in headers.values())
    cfg_path = Path(folder) / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    qcfg = cfg.get("quantization_config") or {}
    if qcfg.get("quant_method") != "quantpipe":
        return total
    for name, spec in (qcfg.get("layers") or {}).items():
        bits, entry = int(spec.get("bits", 4)), headers.get(f"{name}.qweight")
        if bits in KERNEL_BITS or entry is None:
            continue
        rows, words = entry["shape"]
        columns = words * 32 // bits
        zeros = headers.get(f"{name}.qzeros")
        total += rows * columns - rows * words * 4  # int8 codes instead of the bit planes
        total -= 0 if zeros is None else zeros["data_offsets"][1] - zeros["data_offsets"][0]
    return total


def plan(d: ModelDims, weights_bytes: int, spec: MemoryPlanSpec) -> MemoryPlan:
    per_tok = kv_bytes_per_token(d)
    blocks = -(-spec.context // spec.block_size)
    per_seq = blocks * spec.block_size * per_tok
    tokens = min(spec.max_num_batched_tokens, spec.concurrency * spec.context)
    act = activation_peak_bytes(d, tokens, spec.concurrency, spec.context)
    usable = int(spec.device_memory * spec.utilization)
    budget = usable - weights_bytes - act - spec.runtime_reserve
    max_seqs = max(0, budget // per_seq)
    required = weights_bytes + act + spec.runtime_reserve + spec.concurrency * per_seq
    return MemoryPlan(
        weights_bytes=weights_bytes, kv_bytes_per_token=per_tok, kv_bytes_per_sequence=per_seq,
        activation_bytes=act, reserve_bytes=spec.runtime_reserve, usable_bytes=usable,
        kv_budget_bytes=budget, max_concurrent_sequences=int(max_seqs),
        required_bytes=int(-(-required // spec.utilization)),
        fits=max_seqs >= spec.concurrency, context=spec.context, concurrency=spec.concurrency,
    )


def plan_memory(spec: MemoryPlanSpec) -> MemoryPlan:
    if spec.model_dir is None:
        raise ValueError("plan_memory needs model_dir; use plan() with a config dict otherwise")
    cfg_path = Path(spec.model_dir) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{spec.model_dir} has no config.json; pass a model folder")
    cfg = json.loads(cfg_path.read_text())
    return plan(ModelDims.from_config(cfg, spec.kv_dtype), runtime_weight_bytes(spec.model_dir),
                spec)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def format_plan(p: MemoryPlan) -> str:
    rows = [
        ("weights (tensor bytes)", _gib(p.weights_bytes)),
        ("KV cache per token", f"{p.kv_bytes_per_token:,} B ({p.kv_bytes_per_token / 1024:,.1f} "
                               "KiB)"),
        (f"KV cache per {p.context}-token sequence", _gib(p.kv_bytes_per_sequence)),
        ("activation peak (estimate)", _gib(p.activation_bytes)),
        ("runtime reserve", _gib(p.reserve_bytes)),
        ("usable device memory", _gib(p.usable_bytes)),
        ("left for KV cache", _gib(p.kv_budget_bytes)),
        (f"max concurrent sequences at {p.context}", f"{p.max_concurrent_sequences}"),
        (f"device memory needed for {p.concurrency}", _gib(p.required_bytes)),
        ("fits", "yes" if p.fits else "NO"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
