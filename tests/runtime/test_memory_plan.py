"""Memory planner: the seed's 70B KV example, tensor bytes of a real folder, fit decisions."""

from __future__ import annotations

import re

import pytest
import torch

from quantpipe.runtime.engine.kv_cache import KVCacheSpec
from quantpipe.runtime.memory_plan import (
    MemoryPlanSpec,
    ModelDims,
    format_plan,
    kv_bytes_per_token,
    plan,
    plan_memory,
)

LLAMA_70B = {  # Llama-2/3-70B shapes
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "hidden_size": 8192, "intermediate_size": 28672, "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}


def test_70b_kv_example():
    d = ModelDims.from_config(LLAMA_70B)
    assert d.head_dim == 128
    assert kv_bytes_per_token(d) == 327_680  # 320 KiB per token
    p = plan(d, weights_bytes=140 * 10**9,
             spec=MemoryPlanSpec(None, context=8192, concurrency=10, device_memory=80 * 10**9))
    assert p.kv_bytes_per_sequence == 2_684_354_560 == int(2.5 * 2**30)  # 2.5 GiB per 8k seq
    assert not p.fits and p.max_concurrent_sequences == 0  # 140 GB of BF16 weights > 72 GB
    # The engine's own KV layout agrees with the planner.
    spec = KVCacheSpec(80, 8, 128, torch.bfloat16)
    assert spec.bytes_per_token == kv_bytes_per_token(d)


def test_fit_arithmetic():
    d = ModelDims.from_config(LLAMA_70B)
    spec = MemoryPlanSpec(None, context=8192, concurrency=10, device_memory=2 * 80 * 10**9)
    p = plan(d, weights_bytes=40 * 10**9, spec=spec)
    budget = int(160e9 * 0.9) - 40 * 10**9 - p.activation_bytes - 2**30
    assert p.kv_budget_bytes == budget
    assert p.max_concurrent_sequences == budget // 2_684_354_560
    assert p.fits == (p.max_concurrent_sequences >= 10)
    assert p.required_bytes * 0.9 >= 40e9 + 10 * 2_684_354_560


def test_plan_from_folder_counts_tensor_bytes(tiny_llama_dir):
    p = plan_memory(MemoryPlanSpec(tiny_llama_dir, context=128, concurrency=2,
                                   device_memory=2 * 10**9))
    from safetensors.torch import load_file

    tensors = {k: v for f in tiny_llama_dir.glob("*.safetensors") for k, v in
               load_file(f).items()}
    assert p.weights_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    # tiny llama: 2 layers x 2 kv heads x head_dim 16 x fp32
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert p.fits and "max concurrent" in format_plan(p)


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="utilization"):
        MemoryPlanSpec(None, utilization=1.5)
    with pytest.raises(ValueError, match="config.json"):
        plan_memory(MemoryPlanSpec(tmp_path))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelDims.from_config({"hidden_size": 8})


def test_cli_plan_memory(tiny_llama_dir):
    from click.testing import CliRunner

    from quantpipe.cli import main

    res = CliRunner().invoke(main, ["plan-memory", str(tiny_llama_dir), "--context", "128",
                                    "--concurrency", "2", "--device-memory", "2GB"])
    assert res.exit_code == 0, res.output
    assert re.search(r"KV cache per token\s+512 B \(0\.5 KiB\)", res.output), res.output
    bad = CliRunner().invoke(main, ["plan-memory", str(tiny_llama_dir), "--utilization", "2"])
    assert bad.exit_code != 0 and "utilization" in bad.output
