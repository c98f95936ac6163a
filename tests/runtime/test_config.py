"""runtime/config.py's DEFAULTS is the one source of the engine's, the server's and the commands'
default values (issue #14): every spec and click option reads it, so changing one default
there changes it everywhere."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest

from quantpipe.cli import main
from quantpipe.core.io import parse_size
from quantpipe.runtime.config import DEFAULTS, KV_DTYPE_NAMES, RuntimeDefaults
from quantpipe.runtime.engine.engine import KV_DTYPES, EngineConfig
from quantpipe.runtime.engine.kv_cache import KVCacheSpec
from quantpipe.runtime.engine.scheduler import SchedulerLimits
from quantpipe.runtime.generate import GenerateSpec
from quantpipe.runtime.loadgen import BenchSpec
from quantpipe.runtime.memory_plan import MemoryPlanSpec
from quantpipe.runtime.server import RequestLimits, ServeSpec


def _field_defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


# spec class -> {its field: the DEFAULTS field it must take its default from}
SPEC_FIELDS = {
    EngineConfig: {"block_size": "block_size", "max_num_seqs": "max_num_seqs",
                   "max_num_batched_tokens": "max_num_batched_tokens", "kv_dtype": "kv_dtype",
                   "kv_memory_fraction": "kv_memory_fraction",
                   "enable_prefix_caching": "enable_prefix_caching"},
    SchedulerLimits: {"block_size": "block_size", "max_num_seqs": "max_num_seqs",
                      "max_num_batched_tokens": "max_num_batched_tokens"},
    KVCacheSpec: {"block_size": "block_size"},
    ServeSpec: {"host": "host", "port": "port", "max_num_seqs": "max_num_seqs",
                "max_queue": "max_queue", "block_size": "block_size",
                "max_num_batched_tokens": "max_num_batched_tokens",
                "enable_prefix_caching": "enable_prefix_caching",
                "head_dtype": "serve_head_dtype", "kv_dtype": "kv_dtype",
                "max_request_bytes": "max_request_bytes", "max_prompt_chars": "max_prompt_chars",
                "request_timeout": "request_timeout"},
    RequestLimits: {"max_request_bytes": "max_request_bytes",
                    "max_prompt_chars": "max_prompt_chars", "request_timeout": "request_timeout"},
    GenerateSpec: {"max_new_tokens": "max_new_tokens", "head_dtype": "generate_head_dtype"},
    MemoryPlanSpec: {"context": "plan_context", "concurrency": "plan_concurrency",
                     "device_memory": "device_memory", "utilization": "utilization",
                     "block_size": "block_size",
                     "max_num_batched_tokens": "max_num_batched_tokens",
                     "runtime_reserve": "runtime_reserve"},
    BenchSpec: {"url": "bench_url", "concurrency": "bench_concurrency",
                "prompt_len": "bench_prompt_len", "output_len": "bench_output_len",
                "duration": "bench_duration", "repeats": "bench_repeats",
                "warmup_requests": "bench_warmup_requests", "ttft_slo": "ttft_slo",
                "tpot_slo": "tpot_slo", "max_requests": "bench_max_requests"},
}

# command -> {option parameter: the DEFAULTS field its default comes from}
CLI_OPTIONS = {
    "serve": {"host": "host", "port": "port", "max_num_seqs": "max_num_seqs",
              "max_queue": "max_queue", "block_size": "block_size",
              "max_num_batched_tokens": "max_num_batched_tokens",
              "head_dtype": "serve_head_dtype", "kv_dtype": "kv_dtype",
              "max_request_bytes": "max_request_bytes", "max_prompt_chars": "max_prompt_chars",
              "request_timeout": "request_timeout"},
    "generate": {"max_new_tokens": "max_new_tokens", "head_dtype": "generate_head_dtype"},
    "plan-memory": {"context": "plan_context", "concurrency": "plan_concurrency",
                    "device_memory": "device_memory", "utilization": "utilization",
                    "block_size": "block_size", "reserve": "runtime_reserve"},
    "bench-serve": {"url": "bench_url", "concurrency": "bench_concurrency",
                    "prompt_len": "bench_prompt_len", "output_len": "bench_output_len",
                    "duration": "bench_duration", "repeats": "bench_repeats",
                    "warmup": "bench_warmup_requests", "ttft_slo": "ttft_slo",
                    "tpot_slo": "tpot_slo", "max_requests": "bench_max_requests"},
}
SIZE_OPTIONS = {"max_request_bytes", "device_memory", "reserve"}  # "1MiB" -> bytes


def _reads_defaults(node: ast.AST, field: str | None = None) -> bool:
    """Whether the expression refers to ``DEFAULTS.field`` (any field when None)."""
    return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id == "DEFAULTS" and (field is None or n.attr == field)
               for n in ast.walk(node))


@pytest.mark.parametrize("cls", list(SPEC_FIELDS), ids=lambda c: c.__name__)
def test_spec_defaults_come_from_defaults(cls):
    got = _field_defaults(cls)
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    written = {n.target.id: n.value for n in body
               if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for field, source in SPEC_FIELDS[cls].items():
        assert got[field] == getattr(DEFAULTS, source), (cls.__name__, field)
        # the value is read from DEFAULTS, not written again (16 in one place only)
        assert _reads_defaults(written[field], source), (cls.__name__, field)


@pytest.mark.parametrize("command", list(CLI_OPTIONS))
def test_cli_option_defaults_come_from_defaults(command):
    params = {p.name: p for p in main.commands[command].params}
    for name, source in CLI_OPTIONS[command].items():
        value = params[name].default
        if name in SIZE_OPTIONS:
            value = parse_size(value)
        elif name == "concurrency" and command == "bench-serve":
            value = tuple(int(c) for c in value.split(","))
        assert value == getattr(DEFAULTS, source), (command, name)
    # ... and the decorator reads it from DEFAULTS instead of writing the value again
    func = inspect.unwrap(main.commands[command].callback)
    checked = set()
    for d in ast.parse(inspect.getsource(func)).body[0].decorator_list:
        opts = [a.value for a in getattr(d, "args", []) if isinstance(a, ast.Constant)]
        name = opts[0][2:].replace("-", "_") if opts else None
        if name in CLI_OPTIONS[command]:
            default = next(k.value for k in d.keywords if k.arg == "default")
            assert _reads_defaults(default, CLI_OPTIONS[command][name]), (command, name)
            checked.add(name)
    assert checked == set(CLI_OPTIONS[command])
    if command == "serve":
        assert tuple(params["kv_dtype"].type.choices) == KV_DTYPE_NAMES


def test_kv_dtype_names_match_the_engine_table():
    assert tuple(KV_DTYPES) == KV_DTYPE_NAMES


@pytest.mark.parametrize("over, fragment", [
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens"),
    ({"kv_dtype": "fp8"}, "kv_dtype"),
    ({"utilization": 1.5}, "utilization"),
])
def test_bad_defaults_are_refused(over, fragment):
    with pytest.raises(ValueError, match=fragment):
        RuntimeDefaults(**over)
