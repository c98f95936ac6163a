"""Triton kernels vs a float64 dequantized reference.

CPU: every kernel and layout under the Triton interpreter, in ONE subprocess (TRITON_INTERPRET
must be set before triton is imported and must not leak into other test modules).
GPU: the compiled kernels and the autotuner, skipped without CUDA.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantpipe.core.qformat import QuantSpec
from quantpipe.runtime.kernels.layout import dequantize_reference, repack_for_triton
from tests.runtime._quant_helpers import random_packed

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interp_results() -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("QUANTPIPE_TRITON_PIN", None)
    proc = subprocess.run([sys.executable, "-m", "tests.runtime._interp_cases"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_interpreter_all_layouts_and_kernels(interp_results):
    cases = [r for r in interp_results if "rel" in r]
    assert len(cases) >= 30 * 4
    bad = [r for r in cases if r["nan"] or not r["rel"] < r["tol"] or not r["same_buffer"]]
    assert not bad, bad[:5]
    ids = " ".join(r["id"] for r in cases)
    for needle in ("w4g32", "w8pc", "w5g64", "w6g32", "-asym", "-act", "gemv_splitk", "fused_gemm",
                   "dequant_matmul", "autotune", "-M1-", "-M3-", "-M16-", "-M33-", "-M64-",
                   "-M80-", "float16", "float32", "K160"):
        assert needle in ids, needle


def test_interpreter_pin_parsing(interp_results):
    assert [r["ok"] for r in interp_results if r["id"] == "parse_pin"] == [True]


def test_triton_pin_env_rejects_unknown_kernel(monkeypatch):
    from quantpipe.runtime.kernels import autotune

    with pytest.raises(ValueError, match="unknown"):
        autotune.parse_pin("marlin:BLOCK_N=1")
    with pytest.raises(ValueError, match="KEY=INT"):
        autotune.parse_pin("gemv_splitk:BLOCK_N=x")


def _compile_to_ptx(fn, signature: dict, constexprs: dict) -> str:
    """Compile a @triton.jit kernel for sm_90 up to PTX (no GPU or ptxas needed)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    opts = backend.parse_options({"num_warps": 4, "num_stages": 3})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    mod = src.make_ir(target, opts, backend.get_codegen_implementation(opts),
                      backend.get_module_map(), context)
    stages: dict = {}
    backend.add_stages(stages, opts, src.language)
    metadata: dict = {}
    for name, stage in stages.items():
        mod = stage(mod, metadata)
        if name == "ptx":
            return str(mod)
    raise AssertionError("no ptx stage")


_PTRS = {"qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "g_ptr": "*i32"}
_I32 = "i32"


@pytest.mark.parametrize("kernel,act,flags", [
    ("gemv", "fp16", dict(BITS=4, GROUP=128, HAS_ZEROS=True, HAS_GIDX=True, SPLIT_K=1)),
    ("gemv", "bf16", dict(BITS=8, GROUP=4096, HAS_ZEROS=False, HAS_GIDX=False, SPLIT_K=4)),
    ("dot", "fp16", dict(BITS=4, GROUP=128, HAS_ZEROS=True, HAS_GIDX=True, DOT_PREC="tf32")),
    ("dot", "bf16", dict(BITS=8, GROUP=64, HAS_ZEROS=False, HAS_GIDX=False, DOT_PREC="tf32")),
    ("dot", "fp32", dict(BITS=4, GROUP=32, HAS_ZEROS=False, HAS_GIDX=False, DOT_PREC="ieee")),
    ("dequant", "bf16", dict(BITS=4, GROUP=64, HAS_ZEROS=True, HAS_GIDX=False)),
])
def test_kernels_compile_to_ptx_for_sm90(kernel, act, flags):
    """The compiled (non-interpreter) path on a machine without a GPU: every kernel variant
    lowers to PTX for Hopper; the tl.dot kernel uses tensor-core MMA for 16-bit inputs."""
    try:
        from triton.compiler.compiler import make_backend  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"triton internals moved: {exc}")
    from quantpipe.runtime.kernels import triton_kernels as tk

    out = "*fp32" if flags.get("SPLIT_K", 1) > 1 else f"*{act}"
    if kernel == "gemv":
        fn, blocks = tk._gemv_splitk_kernel, dict(BLOCK_N=64, BLOCK_K=64)
        sig = {"x_ptr": f"*{act}", **_PTRS, "out_ptr": out, "N": _I32, "K": _I32,
               "stride_xm": _I32, "stride_om": _I32}
    elif kernel == "dot":
        fn, blocks = tk._fused_gemm_kernel, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
        sig = {"x_ptr": f"*{act}", **_PTRS, "out_ptr": out, "M": _I32, "N": _I32, "K": _I32,
               "stride_xm": _I32, "stride_om": _I32}
    else:
        fn, blocks = tk._dequant_kernel, dict(BLOCK_N=64, BLOCK_K=64)
        sig = {**_PTRS, "w_ptr": f"*{act}", "N": _I32, "K": _I32}
    ptx = _compile_to_ptx(fn, sig, {**flags, **blocks})
    assert ".entry" in ptx
    if kernel == "dot" and act != "fp32":
        assert "mma" in ptx


def test_interpreter_env_did_not_leak():
    assert os.environ.get("TRITON_INTERPRET") != "1"


GPU_CASES = [(QuantSpec(4, 128, True), torch.float16),
             (QuantSpec(4, 32, False, True), torch.float16),
             (QuantSpec(8, -1, True), torch.float16),
             (QuantSpec(8, 64, False), torch.float16),
             (QuantSpec(4, 64, True), torch.bfloat16)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec,dtype", GPU_CASES, ids=lambda v: getattr(v, "label", str)())
def test_gpu_kernels_all_paths(spec, dtype):
    """Every autotune candidate of every M bucket, plus the autotuned choice, compiled."""
    from quantpipe.runtime.kernels import autotune

    dev = torch.device("cuda")
    k, n = 512, 384
    p = random_packed(n, k, spec, seed=11)
    tw = repack_for_triton(p, dev)
    w64 = dequantize_reference(p)
    tol = 2e-3 if dtype == torch.float16 else 1e-2  # output rounding (+ W tile rounding)
    for m in (1, 16, 33, 256):
        x = torch.randn(m, k, device=dev).to(dtype)
        want = x.double().cpu() @ w64.T
        for plan in [*autotune.candidates(m), None]:
            out = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
            got = autotune.run(x, tw, pin=plan, out=out)
            rel = float((got.double().cpu() - want).norm() / want.norm())
            assert rel < tol, (m, plan, rel)
            assert not got.isnan().any(), (m, plan)
