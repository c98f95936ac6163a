"""The ``quantpipe`` command line: each command parses options, builds a spec, calls one function.

Nothing imports this module; library code lives in the packages it calls.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import sys
import traceback
from pathlib import Path

import click
from safetensors import SafetensorError

from quantpipe import __version__
from quantpipe.calibration import config as calib_config
from quantpipe.calibration.config import DEFAULTS as CALIB
from quantpipe.runtime.config import DEFAULTS, KV_DTYPE_NAMES

# errno -> (what happened, what to do); the path is named in front of both
_OS_ERRORS = {
    errno.ENOSPC: ("no space left on the device",
                   "free space (or choose another --out) and run the same command again"),
    errno.EDQUOT: ("disk quota exceeded",
                   "free space (or choose another --out) and run the same command again"),
    errno.EROFS: ("read-only file system", "write to a writable location instead"),
    errno.EACCES: ("permission denied", "fix its permissions or choose another path"),
    errno.EPERM: ("operation not permitted", "fix its permissions or choose another path"),
    errno.ENOENT: ("no such file or folder",
                   "check the path (a folder named in a manifest may have been moved or deleted)"),
    errno.ENOTDIR: ("a part of this path is a file, not a folder", "fix the path"),
    errno.EISDIR: ("is a folder where a file was expected", "give a file path"),
    errno.EEXIST: ("already exists and is in the way", "remove it or choose another path"),
    errno.EIO: ("input/output error", "the disk or the file is damaged; copy it to a healthy disk"),
    errno.EMFILE: ("too many open files", "raise the limit (ulimit -n) and run again"),
    errno.ENOMEM: ("out of memory", "free memory or use a machine with more"),
    errno.EADDRINUSE: ("address already in use", "choose another --port or stop the other server"),
}
# errors of writing, where the OSError often names no file (a write() on an open descriptor)
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
_OUTPUT_PARAMS = ("out", "json_out")  # command parameters naming what a command writes
_MAX_FILES_PROBED = 200  # corrupt-file search: files re-read at most
_NO_VERIFY_HELP = ("Quantized folder: skip the sha256 of its files and the check of every "
                   "layer's values (shapes and config sizes are still checked). Without it they "
                   "run once and are remembered while the files are unchanged.")
# an errno inside a safetensors error: "... (os error 28)" or "Os { code: 28, ... }"
_OS_ERROR_IN_TEXT = re.compile(r"os error (\d+)|code: (\d+)")


def _paths_in_traceback(exc: BaseException, params: dict) -> list[Path]:
    """Paths the failing code held, innermost frame first, then the command's options.

    JSON and safetensors parsers do not say which file they were reading; these are the
    places to look for it.
    """
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    values = [v for f in reversed(frames) for v in f.f_locals.values()] + list(params.values())
    out: list[Path] = []
    for v in values:
        for item in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(item, Path) or (isinstance(item, str) and os.sep in item
                                          and len(item) < 4096 and "\0" not in item):
                out.append(Path(item))
    return out


def _json_ok(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return False
    return True


def _safetensors_ok(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError:
        return False
    return True


def _find_unreadable(paths: list[Path], suffix: str, readable) -> Path | None:
    """The first ``*suffix`` file among ``paths`` (files, or files directly in folders) that
    ``readable`` rejects; None if every one reads (or none was found)."""
    seen: set[Path] = set()
    for p in paths:
        try:
            files = [p] if p.is_file() else sorted(p.glob(f"*{suffix}")) if p.is_dir() else []
        except OSError:
            continue
        for f in files:
            if f.suffix != suffix or f in seen or not f.is_file():
                continue
            seen.add(f)
            if len(seen) > _MAX_FILES_PROBED:
                return None
            try:
                if not readable(f):
                    return f
            except OSError:
                continue
    return None


def _describe_os_error(exc: OSError, params: dict) -> str:
    path = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
    problem, remedy = _OS_ERRORS.get(exc.errno, (None, None))
    if problem is None:  # e.g. transformers' own OSErrors: their text carries the advice
        text = " ".join(str(exc).split())
        return f"{path}: {text}" if path is not None and str(path) not in text else text
    if path is not None:
        return f"{path}: {problem}; {remedy}"
    outs = [str(params[k]) for k in _OUTPUT_PARAMS if params.get(k)]
    if outs and exc.errno in _WRITE_ERRNOS:
        return f"{problem} while writing {', '.join(outs)}; {remedy}"
    return f"{problem}; {remedy}"


def _corrupt_file(exc: Exception, params: dict, suffix: str, ok, kind: str, what: str,
                  remedy: str) -> str:
    """Name the file that fails to parse (found among the paths in play), or say how to."""
    bad = _find_unreadable(_paths_in_traceback(exc, params), suffix, ok)
    if bad is None:
        return f"{kind} is {what}; run with -vv to see which, then {remedy}"
    return f"{bad}: {what}; the file is truncated or corrupt: {remedy}"


def _describe_failure(exc: Exception, params: dict) -> str:
    """One line for an expected failure: what is wrong, with which path, and what to do."""
    if isinstance(exc, json.JSONDecodeError):
        what = f"not valid JSON ({exc.msg}: line {exc.lineno} column {exc.colno})"
        return _corrupt_file(exc, params, ".json", _json_ok, "a JSON file", what,
                             "restore it or re-run the step that wrote it")
    if isinstance(exc, UnicodeDecodeError):  # a JSON file (manifest, config) with a bad byte
        return _corrupt_file(exc, params, ".json", _json_ok, "a file",
                             f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                             "restore it or re-run the step that wrote it")
    if isinstance(exc, SafetensorError) and (m := _OS_ERROR_IN_TEXT.search(str(exc))):
        # safetensors' writer reports a full disk as its own error type, errno in the text
        return _describe_os_error(OSError(int(m.group(1) or m.group(2)), str(exc)), params)
    if isinstance(exc, SafetensorError):
        return _corrupt_file(exc, params, ".safetensors", _safetensors_ok, "a shard",
                             f"not a readable safetensors file ({exc})",
                             "copy it again or re-run the step that wrote it")
    if isinstance(exc, OSError):
        return _describe_os_error(exc, params)
    return str(exc)


class _Command(click.Command):
    """Every quantpipe command: bad input, corrupt files and a full or read-only disk end in
    one ``Error: ...`` line and exit code 1 (``-vv`` also prints the traceback)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (ValueError, OSError, SafetensorError) as exc:
            if ctx.find_root().params.get("verbose", 0) >= 2:
                click.echo("".join(traceback.format_exception(exc)), err=True, nl=False)
            raise click.ClickException(_describe_failure(exc, ctx.params)) from exc


class _Group(click.Group):
    command_class = _Command


def _group_size_default() -> str:
    """--group-size's default as typed: ``auto`` for the library's None."""
    return "auto" if CALIB.group_size is None else str(CALIB.group_size)


def _group_size(ctx: click.Context, param: click.Parameter, value: str) -> int | None:
    """``auto`` -> None (calibration.pipeline plans each layer's size), else the integer
    (calibration checks it against the sizes it supports)."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not auto or an integer such as 64") from None




def configure_logging(verbose: int) -> None:
    """Default: warnings (what the user should act on) and the stages' progress bars (tqdm,
    on stderr whatever the level); -v adds INFO (stage starts, choices made, timings); -vv
    DEBUG."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quantpipe")
@click.option("-v", "--verbose", count=True,
              help="More logging (-v info, -vv debug and tracebacks of errors).")
def main(verbose: int) -> None:
    """quantpipe: quantize a Hugging Face causal LM to INT8/INT4, serve it, and report on it.

    Stages: export-fp16 -> calibrate -> export -> eval / report; `run` does them all.
    """
    configure_logging(verbose)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # torch's OpenMP workers spin for a while after each parallel region, holding a core that
    # the CPU kernels' own thread pool then waits for (docs/runtime.md: a decode step of an FP16
    # folder 35 -> 30 ms, a 2,048-token prefill's matmuls 14% faster); passive, they sleep at
    # once. libgomp reads this when torch loads, so it is set before any command imports torch.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@main.command("export-fp16")
@click.argument("source")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output folder.")
@click.option("--dtype", type=click.Choice(["fp16", "bf16"]), default="fp16", show_default=True)
@click.option("--max-shard-size", default="2GB", show_default=True,
              help="Largest shard, e.g. 2GB, 500MB.")
@click.option("--force", is_flag=True, help="Replace a non-empty output folder.")
@click.option("--trust-remote-code", is_flag=True, help="Run model code shipped with SOURCE.")
def export_fp16_cmd(source, out, dtype, max_shard_size, force, trust_remote_code):
    """Export SOURCE as the FP16 reference checkpoint (sharded safetensors + manifest).

    SOURCE is a local Hugging Face model folder, a .gguf file, or `smollm2-135m`.
    """
    from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16

    spec = Fp16ExportSpec(source, out, dtype, max_shard_size, force, trust_remote_code)
    res = export_fp16(spec)
    click.echo(f"wrote {res.out} ({res.num_parameters:,} parameters, {len(res.shards)} shard(s), "
               f"{res.seconds:.1f}s)")


@main.command("calibrate")
@click.argument("fp16_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="CALIB_DIR.")
@click.option("--prompts", default=CALIB.prompts, show_default=True,
              help="Prompt file (JSONL/CSV/TSV/TXT/parquet/dataset folder) or business-calib.")
@click.option("--column", default=None, help="Text column of a CSV/TSV/parquet prompt file.")
@click.option("--algo", type=click.Choice(calib_config.ALGOS),
              default=CALIB.algo, show_default=True,
              help="auto: gptaq for dense models, gptq for mixture-of-experts ones; gptaq: "
                   "GPTQ against the FP model's outputs (dense models); awq+gptq: AWQ's "
                   "scales, then GPTQ (docs/algorithms.md).")
@click.option("--group-size", default=_group_size_default(), show_default=True,
              callback=_group_size, help=calib_config.group_size_help())
@click.option("--sym/--asym", default=CALIB.sym, show_default=True, help="INT4 zero point.")
@click.option("--int8-group-size", default=CALIB.int8_group_size, show_default=True,
              help=calib_config.int8_group_size_help())
@click.option("--act-order/--no-act-order", default=None,
              help="GPTQ family (gptq, gptaq, awq+gptq): columns by decreasing Hessian "
                   "diagonal [default: on].")
@click.option("--mse-clip/--no-mse-clip", default=None,
              help="RTN/GPTQ family: search the clipping range per group [default: on for "
                   "the GPTQ family, off for rtn].")
@click.option("--damp", type=float, default=None,
              help="GPTQ family: dampening added to the Hessian's diagonal before its inverse, "
                   f"as a fraction of its mean [default: {CALIB.damp}].")
@click.option("--static-groups/--dynamic-groups", default=None,
              help="GPTQ group scales: from the original weights up front, or when GPTQ "
                   "reaches the group [default: static with --act-order, else dynamic].")
@click.option("--strict-group-size", is_flag=True,
              help="Error if the group size does not divide a layer (default: fall back).")
@click.option("--per-channel-if-larger", is_flag=True,
              help="Quantize layers narrower than the group size per channel (default: error).")
@click.option("--samples", default=CALIB.samples, show_default=True,
              help="Calibration sequences.")
@click.option("--seq-len", default=CALIB.seq_len, show_default=True, help="Tokens per sequence.")
@click.option("--min-tokens", default=CALIB.min_tokens, show_default=True,
              help="Drop shorter prompts.")
@click.option("--seed", default=CALIB.seed, show_default=True)
@click.option("--batch-size", default=CALIB.batch_size, show_default=True,
              help="Sequences per forward.")
@click.option("--min-expert-tokens", default=CALIB.min_expert_tokens, show_default=True,
              help="MoE: an expert routed fewer calibration tokens is quantized with RTN "
                   "(counted and reported); dense models ignore it.")
@click.option("--max-memory", default=None,
              help="RAM the block activations may hold (e.g. 8GB); beyond it they are spilled "
                   "to files in the work folder [default: a quarter of the available memory].")
@click.option("--device", default=CALIB.device, show_default=True,
              help="Where each block is calibrated: cpu, cuda or cuda:N (the activations stay "
                   "in RAM or spill to disk as on the CPU).")
@click.option("--menu", "menu", multiple=True,
              help="Extra formats for the precision planner, from the same Hessians: "
                   "comma-separated entries like w4g32, w4g128-asym, w4pc, w8g128, w5g128 "
                   "(INT5/INT6: native format only), or 'default' (docs/mixed-precision.md). "
                   "Repeatable.")
@click.option("--force", is_flag=True,
              help="Replace a finished CALIB_DIR (only once the new one is complete) and "
                   "discard an unfinished run with other settings.")
def calibrate_cmd(fp16_dir, out, prompts, column, algo, group_size, sym, int8_group_size,
                  act_order, mse_clip, damp,
                  static_groups, strict_group_size, per_channel_if_larger, samples, seq_len,
                  min_tokens, seed, batch_size, min_expert_tokens, max_memory, device, menu,
                  force):
    """Calibrate INT4 and INT8 scales of FP16_DIR on business prompts (resumable)."""
    from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
    from quantpipe.core.io import parse_size

    res = calibrate(CalibrateSpec(
        fp16_dir=fp16_dir, out=out, prompts=prompts, column=column, algo=algo,
        group_size=group_size, sym=sym, int8_group_size=int8_group_size, act_order=act_order,
        mse_clip=mse_clip, damp=damp, strict_group_size=strict_group_size, samples=samples,
        seq_len=seq_len, min_tokens=min_tokens, seed=seed, batch_size=batch_size,
        static_groups=static_groups, force=force, per_channel_if_larger=per_channel_if_larger,
        min_expert_tokens=min_expert_tokens,
        max_memory=None if max_memory is None else parse_size(max_memory, "--max-memory"),
        device=device, menu=tuple(menu)))
    fell_back = len(res.group_size_fallbacks)
    click.echo(f"wrote {res.out} in {res.seconds:.1f}s (peak RSS {res.peak_rss_mb:.0f} MB, "
               + (f"--group-size {group_size} did not divide {fell_back} layers, "
                  if fell_back else "")
               + f"damping raises {res.damp_raises})")
    if res.expert_fallbacks:
        click.echo(f"{len(res.expert_fallbacks)} expert linears got fewer than "
                   f"{min_expert_tokens} routed tokens and were quantized with RTN "
                   "(listed under expert_fallbacks in the manifest)")


_OVERRIDE_HELP = ("PATTERN=4|8|fp16 or a menu entry of the calibration (w4g32, ...); "
                  "PATTERN is a layer name or re:REGEX. Repeatable; the first matching rule "
                  "wins.")
_PLAN_MENU_HELP = ("Entries --budget-bits may choose, comma-separated: w4, w8, fp16 and the "
                   "calibration's menu entries (w4g32, ...) [default: all]. E.g. vLLM's CPU "
                   "build loads no 8-bit layer: --menu w4,w4g32,w4g64,w4g128,fp16.")
_BUDGET_SIZE_HELP = ("Checkpoint size to fill instead of --budget-bits, e.g. 1.2GB or 900MiB: "
                     "the tensors' bytes at most (embeddings, head and norms as stored; "
                     "headers and config files not counted).")
_SENSITIVITY_HELP = ("The measurement --budget-bits plans on (`quantpipe sensitivity --out`), "
                     "measured on this calibration [default: CALIB_DIR/sensitivity.json].")


@main.command("export")
@click.argument("calib_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--bits", type=click.Choice(["4", "8"]), default="4", show_default=True)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="QDIR.")
# the names of quantpipe.core.formats.registry, written here so --help does not import torch
# (tests/quantpipe/test_formats_registry.py checks they are equal)
@click.option("--format", "fmt", type=click.Choice(["native", "gptq", "compressed-tensors"]),
              default="native", show_default=True)
@click.option("--budget-bits", type=float, default=None,
              help="Average bits per weight; picks INT4/INT8/FP16 or a menu entry per "
                   "layer.")
@click.option("--budget-size", default=None, help=_BUDGET_SIZE_HELP)
@click.option("--override", "overrides", multiple=True, help=_OVERRIDE_HELP)
@click.option("--damage", type=click.Choice(["auto", "kld", "proxy"]), default="auto",
              show_default=True, help="What --budget-bits minimises (as plan's --damage).")
@click.option("--sensitivity", "sensitivity", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help=_SENSITIVITY_HELP)
@click.option("--menu", "menu", multiple=True, help=_PLAN_MENU_HELP)
@click.option("--max-shard-size", default="2GB", show_default=True)
@click.option("--force", is_flag=True, help="Replace a non-empty output folder.")
# quantpipe.core.vocab.VOCAB_WEIGHTS, written here so --help does not import torch
# (tests/quantpipe/test_vocab_export.py checks they are equal)
@click.option("--vocab-weights", type=click.Choice(["fp16", "int8", "int4"]), default="fp16",
              show_default=True,
              help="Embedding table and output head: as exported, or RTN INT8 / INT4 "
                   "(symmetric; a tied head stays tied).")
@click.option("--vocab-group-size", type=int, default=None,
              help="Columns per scale of the quantized tables (-1: one per row) "
                   "[default: int8 -1, int4 32].")
def export_cmd(calib_dir, bits, out, fmt, budget_bits, budget_size, overrides, damage,
               sensitivity, menu, max_shard_size, force, vocab_weights, vocab_group_size):
    """Write a quantized checkpoint from CALIB_DIR."""
    from quantpipe.core.vocab import VocabSpec
    from quantpipe.stages.export import ExportSpec, export_quantized

    spec = ExportSpec(calib_dir, out, int(bits), fmt, budget_bits, tuple(overrides),
                      max_shard_size, force, damage,
                      VocabSpec(vocab_weights, vocab_group_size), sensitivity=sensitivity,
                      menu=tuple(menu), budget_size=budget_size)
    res = export_quantized(spec)
    if budget_size is not None:
        click.echo(f"--budget-size {budget_size}: {res.plan.budget_bits:.4f} bits per weight "
                   "left for the calibrated linears")
    if res.plan.budget_bits is not None and res.plan.validation:  # why the plan stops where
        click.echo(f"plan: {res.plan.validation}")  # it does, on which path (`plan` prints it)
    click.echo(f"wrote {res.out} ({fmt}, {res.bytes_on_disk / 1e6:.1f} MB, "
               f"{res.plan.effective_bits():.3f} bits/weight over the calibrated linears; "
               f"{res.plan.counts_text()}; "
               f"vocabulary tables {vocab_weights})")


@main.command("plan")
@click.argument("calib_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--bits", type=click.Choice(["4", "8"]), default="4", show_default=True)
@click.option("--budget-bits", type=float, default=None, help="Average bits per weight.")
@click.option("--budget-size", default=None,
              help=_BUDGET_SIZE_HELP[:-1] + "; vocabulary tables FP16, as export's default).")
@click.option("--override", "overrides", multiple=True, help=_OVERRIDE_HELP)
@click.option("--damage", type=click.Choice(["auto", "kld", "proxy"]), default="auto",
              show_default=True, help="What the budget planner minimises.")
@click.option("--format", "fmt", type=click.Choice(["native", "gptq", "compressed-tensors"]),
              default="native", show_default=True,
              help="Count bits per weight as this export format stores them.")
@click.option("--sensitivity", "sensitivity", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help=_SENSITIVITY_HELP)
@click.option("--menu", "menu", multiple=True, help=_PLAN_MENU_HELP)
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Write the plan here.")
def plan_cmd(calib_dir, bits, budget_bits, budget_size, overrides, damage, fmt, sensitivity,
             menu, json_out):
    """Print the per-layer precision plan without exporting."""
    from quantpipe.calibration.artifact import read_calibration
    from quantpipe.calibration.mixed_precision.plan import PlanSpec, make_plan
    from quantpipe.core.io import check_output_file, parse_size, write_json_atomic
    from quantpipe.stages.export import budget_bits_for_size

    if json_out:
        check_output_file(json_out, "--json", {"CALIB_DIR": calib_dir})
    if budget_size is not None and budget_bits is not None:
        raise click.UsageError("give --budget-bits or --budget-size, not both")
    calib = read_calibration(calib_dir)
    if budget_size is not None:
        budget_bits = budget_bits_for_size(calib, parse_size(budget_size, "--budget-size"), fmt,
                                           menu=tuple(menu))
    plan = make_plan(calib, PlanSpec(int(bits), budget_bits, tuple(overrides), damage, fmt,
                                     sensitivity=sensitivity, menu=tuple(menu)))
    click.echo(plan.table())
    if json_out:
        write_json_atomic(json_out, plan.to_dict())


@main.command("eval")
@click.option("--reference", required=True, type=click.Path(exists=True, path_type=Path),
              help="FP16 folder (export-fp16).")
@click.option("--candidate", required=True, type=click.Path(exists=True, path_type=Path),
              help="Quantized folder (or any folder transformers loads).")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Any UTF-8 text file, scored in windows of --ctx tokens.")
@click.option("--prompts", default=None,
              help="Prompt file or business-eval (held-out prompts, chat template applied).")
@click.option("--max-tokens", default=0, show_default=True, help="Stop after N tokens (0: all).")
@click.option("--ctx", default=None, type=int,
              help="Window length in tokens [default: 512, or the model's context if shorter].")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Write results here.")
@click.option("--allow-other-source", is_flag=True,
              help="Compare even if the manifests say CANDIDATE was made from other FP16 weights.")
@click.option("--stream/--no-stream", default=None,
              help="Run both models block by block (one block in memory at a time) or whole "
                   "[default: block by block when both whole fp32 models would not fit].")
def eval_cmd(reference, candidate, text_file, prompts, max_tokens, ctx, json_out,
             allow_other_source, stream):
    """KL divergence, top-token agreement and perplexity of CANDIDATE vs REFERENCE."""
    from quantpipe.core.io import check_output_file, write_json_atomic
    from quantpipe.reports.eval import (
        EvalSpec,
        eval_context,
        eval_inputs,
        format_result,
        load_texts,
        run_eval,
    )

    if json_out:
        check_output_file(json_out, "--json", eval_inputs(reference, candidate, text_file, prompts))
    ctx = eval_context(reference, ctx)
    texts = load_texts(reference, text_file, prompts, max_tokens, ctx)
    res = run_eval(EvalSpec(reference, candidate, texts, max_tokens, ctx, allow_other_source,
                            stream))
    click.echo(format_result(res))
    if json_out:
        write_json_atomic(json_out, res.to_dict())


@main.command("verify")
@click.argument("qdir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def verify_cmd(qdir):
    """Check a quantized folder (native, GPTQ or compressed-tensors) before loading it.

    Hashes every file the manifest lists (shards, config.json, tokenizer files; quantpipe
    folders), checks every tensor's presence, shape and dtype, config.json's sizes against
    them, finite positive scales, zero points and group sizes, and loads the tokenizer. Always
    reads every byte (loading skips that for files unchanged since they last passed). Exit
    code 1 lists every problem.
    """
    from quantpipe.core.formats.verify import verify_checkpoint

    report = verify_checkpoint(qdir, "full")  # a ValueError lists every problem: exit code 1
    click.echo(report.summary())


@main.command("serve")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default=DEFAULTS.host, show_default=True,
              help="Bind address (loopback by default; other addresses expose the server).")
@click.option("--port", default=DEFAULTS.port, show_default=True, type=int)
@click.option("--max-num-seqs", default=DEFAULTS.max_num_seqs, show_default=True, type=int,
              help="Sequences in the running batch.")
@click.option("--max-queue", default=DEFAULTS.max_queue, show_default=True, type=int,
              help="Accepted requests waiting beyond the batch; more get 429.")
@click.option("--kv-cache-memory", default=None,
              help=f"KV pool size, e.g. 2GiB (default: {DEFAULTS.kv_memory_fraction:.0%} of the "
                   "free memory).")
@click.option("--block-size", default=DEFAULTS.block_size, show_default=True, type=int,
              help="Tokens per block.")
@click.option("--max-num-batched-tokens", default=DEFAULTS.max_num_batched_tokens,
              show_default=True, type=int,
              help="Tokens computed per engine step (prefill chunks + decodes).")
@click.option("--no-prefix-caching", is_flag=True, help="Disable KV prefix caching.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:i].")
@click.option("--head-dtype", type=click.Choice(["fp32", "fp16", "bf16", "auto", "int8"]),
              default=DEFAULTS.serve_head_dtype, show_default=True,
              help="CPU: precision of the embedding table and output head (int8: int8 "
                   "weights and activations per 32 columns, llama.cpp's Q8_0 dot, the fastest "
                   "for 1 to 16 rows; bf16: half the bytes of fp16; fp16: exact weights; auto: "
                   "fp16 for 1-2 rows, bf16 for more, so outputs can depend on the batch).")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPE_NAMES), default=DEFAULTS.kv_dtype,
              show_default=True,
              help="KV cache elements: the model's activation dtype (fp32 on CPU), or bf16: half "
                   "the memory per token (twice the context or sequences), keys and values "
                   "rounded to bf16.")
@click.option("--max-request-bytes", default=f"{DEFAULTS.max_request_bytes / 2**20:g}MiB",
              show_default=True,
              help="Largest request body (e.g. 1MiB); larger ones get 413.")
@click.option("--max-prompt-chars", default=DEFAULTS.max_prompt_chars, show_default=True,
              type=int,
              help="Longest prompt (chat: all messages) in characters, checked before "
                   "tokenizing; longer ones get 400.")
@click.option("--request-timeout", default=DEFAULTS.request_timeout, show_default=True,
              type=float,
              help="Seconds for a request body to arrive in full; a stalled client gets 408.")
@click.option("--header-timeout", default=DEFAULTS.header_timeout, show_default=True, type=float,
              help="Seconds for a request's headers to arrive (from the connection's start or "
                   "its previous response); then the connection is closed.")
@click.option("--max-connections", default=DEFAULTS.max_connections, show_default=True, type=int,
              help="Open client connections at most (lowered to fit the open-file limit); one "
                   "more closes the oldest connection still waiting for its headers.")
@click.option("--api-key", envvar="QUANTPIPE_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every endpoint but /health (401 "
                   "otherwise). Prefer the environment variable: arguments show in `ps`.")
@click.option("--no-verify", is_flag=True, help=_NO_VERIFY_HELP)
@click.option("--allowed-host", "allowed_hosts", multiple=True,
              help="Answer only requests whose Host header is this name (repeat it; "
                   "'*.example.com' matches subdomains); others get 400. Default: any.")
def serve_cmd(model_dir, host, port, max_num_seqs, max_queue, kv_cache_memory, block_size,
              max_num_batched_tokens, no_prefix_caching, device, head_dtype, kv_dtype,
              max_request_bytes, max_prompt_chars, request_timeout, header_timeout,
              max_connections, api_key, allowed_hosts, no_verify):
    """Serve MODEL_DIR (FP16 or quantized folder) with an OpenAI-compatible API."""
    from quantpipe.core.io import parse_size
    from quantpipe.runtime.server import ServeSpec, serve

    # every option and the folder are checked here, before the model loads
    spec = ServeSpec(
        model_dir, host=host, port=port, max_num_seqs=max_num_seqs, max_queue=max_queue,
        kv_cache_memory=(parse_size(kv_cache_memory, "--kv-cache-memory")
                         if kv_cache_memory else None),
        block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=not no_prefix_caching, device=device, head_dtype=head_dtype,
        kv_dtype=kv_dtype,
        max_request_bytes=parse_size(max_request_bytes, "--max-request-bytes"),
        max_prompt_chars=max_prompt_chars, request_timeout=request_timeout,
        header_timeout=header_timeout, max_connections=max_connections, api_key=api_key,
        allowed_hosts=tuple(allowed_hosts),
        verify=not no_verify,
    )
    # printed once the socket listens: every check and the model load have passed
    serve(spec, on_listening=lambda url: click.echo(f"serving {model_dir} on {url}",
                                                    err=True))


@main.command("bench-serve")
@click.option("--url", default=DEFAULTS.bench_url, show_default=True)
@click.option("--concurrency", default=",".join(map(str, DEFAULTS.bench_concurrency)),
              show_default=True, help="Comma-separated in-flight caps, one run each.")
@click.option("--prompt-len", default=DEFAULTS.bench_prompt_len, show_default=True, type=int)
@click.option("--output-len", default=DEFAULTS.bench_output_len, show_default=True, type=int)
@click.option("--duration", default=DEFAULTS.bench_duration, show_default=True, type=float,
              help="Seconds of sending per run.")
@click.option("--repeats", default=DEFAULTS.bench_repeats, show_default=True, type=int)
@click.option("--request-rate", default=None, type=float,
              help="Poisson arrival rate (req/s); default: closed loop at each concurrency.")
@click.option("--shared-prefix-len", default=0, show_default=True, type=int,
              help="Leading prompt tokens common to all requests (prefix caching).")
@click.option("--warmup", default=DEFAULTS.bench_warmup_requests, show_default=True, type=int,
              help="Warm-up requests.")
@click.option("--max-requests", default=DEFAULTS.bench_max_requests, show_default=True, type=int,
              help="Requests per run at most. With a --duration the runs do not reach, every "
                   "server gets exactly the same prompts (fair latency percentiles).")
@click.option("--ttft-slo", default=DEFAULTS.ttft_slo, show_default=True, type=float,
              help="Seconds.")
@click.option("--tpot-slo", default=DEFAULTS.tpot_slo, show_default=True, type=float,
              help="Seconds.")
@click.option("--allow-remote", is_flag=True, help="Permit a non-loopback --url.")
@click.option("--json", "json_out", default=None, type=click.Path(path_type=Path),
              help="Write all runs and medians here.")
def bench_serve_cmd(url, concurrency, prompt_len, output_len, duration, repeats, request_rate,
                    shared_prefix_len, warmup, max_requests, ttft_slo, tpot_slo, allow_remote,
                    json_out):
    """Load-test a running server (metrics as `vllm bench serve` defines them)."""
    from quantpipe.core.io import check_output_file
    from quantpipe.runtime.loadgen import BenchSpec, format_table, run_bench

    if json_out:
        check_output_file(json_out, "--json")
    try:
        conc = tuple(int(c) for c in concurrency.split(",") if c.strip())
    except ValueError:
        raise ValueError(f"--concurrency {concurrency!r}: write integers like 1,4,16") from None
    spec = BenchSpec(url=url, concurrency=conc, prompt_len=prompt_len, output_len=output_len,
                     duration=duration, repeats=repeats, request_rate=request_rate,
                     warmup_requests=warmup, max_requests=max_requests,
                     shared_prefix_len=shared_prefix_len, ttft_slo=ttft_slo, tpot_slo=tpot_slo,
                     allow_remote=allow_remote, json_out=json_out)
    res = run_bench(spec)
    click.echo(format_table(res))


@main.command("plan-memory")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--context", default=DEFAULTS.plan_context, show_default=True, type=int,
              help="Tokens per sequence (prompt + output).")
@click.option("--concurrency", default=DEFAULTS.plan_concurrency, show_default=True, type=int)
@click.option("--device-memory", default=f"{DEFAULTS.device_memory / 10**9:g}GB",
              show_default=True)
@click.option("--utilization", default=DEFAULTS.utilization, show_default=True, type=float)
@click.option("--block-size", default=DEFAULTS.block_size, show_default=True, type=int)
@click.option("--reserve", default=f"{DEFAULTS.runtime_reserve / 2**30:g}GiB", show_default=True,
              help="Runtime reserve.")
@click.option("--kv-dtype", default=None, help="KV element type (default: the config's dtype).")
def plan_memory_cmd(model_dir, context, concurrency, device_memory, utilization, block_size,
                    reserve, kv_dtype):
    """Weights + KV cache + activations vs device memory; max sequences at --context."""
    from quantpipe.core.io import parse_size
    from quantpipe.runtime.memory_plan import MemoryPlanSpec, format_plan, plan_memory

    spec = MemoryPlanSpec(model_dir, context=context, concurrency=concurrency,
                          device_memory=parse_size(device_memory, "--device-memory"),
                          utilization=utilization, block_size=block_size,
                          runtime_reserve=parse_size(reserve, "--reserve"),
                          kv_dtype=kv_dtype)
    click.echo(format_plan(plan_memory(spec)))


@main.command("generate")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--max-new-tokens", default=DEFAULTS.max_new_tokens, show_default=True, type=int)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--head-dtype", type=click.Choice(["fp32", "fp16", "bf16", "auto", "int8"]),
              default=DEFAULTS.generate_head_dtype, show_default=True,
              help="CPU: precision of the embedding table and output head (fp16 = the "
                   "checkpoint's; fp32 = upcast, slower; int8 = the head quantized per 32 "
                   "columns at load, half the bytes of fp16).")
@click.option("--ignore-eos", is_flag=True,
              help="Generate all --max-new-tokens even past EOS (benchmarks).")
@click.option("--min-new-tokens", default=0, show_default=True, type=int,
              help="EOS does not end generation before this many new tokens.")
@click.option("--no-verify", is_flag=True, help=_NO_VERIFY_HELP)
def generate_cmd(model_dir, prompt, chat, max_new_tokens, device, head_dtype, ignore_eos,
                 min_new_tokens, no_verify):
    """Greedy-generate from an FP16 or quantized MODEL_DIR; text on stdout, timings on stderr."""
    from quantpipe.runtime.generate import GenerateSpec, run_generate

    res = run_generate(GenerateSpec(model_dir, prompt, chat, max_new_tokens, device,
                                    head_dtype, ignore_eos, min_new_tokens,
                                    verify=not no_verify))
    click.echo(res.text)
    click.echo(f"{'quantized' if res.quantized else 'fp'} model ({res.path} path), "
               f"{res.prompt_tokens} prompt "
               f"tokens: prefill {res.prefill_s * 1000:.1f} ms, decode "
               f"{res.decode_tokens_per_s:.1f} tokens/s ({res.new_tokens} new), peak memory "
               f"{res.peak_memory_bytes / 2**20:.0f} MiB", err=True)


@main.command("sensitivity")
@click.argument("calib_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--tokens", default=1024, show_default=True, type=int,
              help="Scored tokens of business-calib prompts (more: slower, less noise).")
@click.option("--seq-len", default=256, show_default=True, type=int, help="Tokens per sequence.")
@click.option("--bits", default="4,8", show_default=True,
              help="Precisions to measure (the budget planner needs 4,8).")
@click.option("--seed", default=1, show_default=True, type=int, help="Prompt shuffle seed.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The measurement's file (plan and export read it with --sensitivity) "
                   "[default: CALIB_DIR/sensitivity.json].")
@click.option("--entries", default="",
              help="Menu entries (calibrate --menu) to measure as well, comma-separated, or "
                   "'all' (one more run per entry and layer) [default: none; the planner "
                   "scales INT4's KLD by each entry's calibration loss].")
@click.option("--stream/--no-stream", default=None,
              help="Block by block (one block in memory; each layer's relative change of its "
                   "block's output times the block's measured gain, no validation split) or "
                   "the whole FP model (exact leave-one-in KLD) [default: block by block when "
                   "the FP model in fp32 does not fit in memory]. Block by block saves its "
                   "state after each block and a killed run resumes where it stopped.")
@click.option("--probe-tokens", default=512, show_default=True, type=int,
              help="Block by block: tokens each block's gain is measured on.")
@click.option("--force", is_flag=True,
              help="Measure again even if the file (or a killed run's saved state) exists.")
def sensitivity_cmd(calib_dir, tokens, seq_len, bits, seed, out, entries, stream, probe_tokens,
                    force):
    """Measure each linear's KLD when quantized alone; writes CALIB_DIR/sensitivity.json."""
    from quantpipe.calibration.mixed_precision.sensitivity import (
        SensitivitySpec,
        measure_sensitivity,
    )
    from quantpipe.core.io import check_output_file

    try:
        bits_t = tuple(int(b) for b in bits.split(",") if b.strip())
    except ValueError:
        raise ValueError(f"--bits {bits!r}: write 4, 8 or 4,8") from None
    if out is not None:
        check_output_file(out, "--out", {"CALIB_DIR": calib_dir})
    entries_t = ("all",) if entries.strip() == "all" else tuple(
        e.strip() for e in entries.split(",") if e.strip())
    res = measure_sensitivity(SensitivitySpec(calib_dir, tokens, seq_len, bits_t, seed,
                                              force=force, out=out, entries=entries_t,
                                              stream=stream, probe_tokens=probe_tokens))
    click.echo(res.table())
    click.echo(f"{'reused' if res.reused else 'wrote'} {res.path}")


@main.command("report")
@click.option("--reference", required=True, type=click.Path(exists=True, path_type=Path),
              help="FP16 folder.")
@click.option("--candidate", "candidates", required=True, multiple=True,
              type=click.Path(exists=True, path_type=Path), help="Quantized folder (repeatable).")
@click.option("--prompts", default="business-eval", show_default=True,
              help="Held-out prompts for side-by-side generations (and KLD unless --text).")
@click.option("--text", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Score KL divergence on this UTF-8 text instead of the prompts.")
@click.option("--max-prompts", default=0, show_default=True,
              help="Prompts answered, spread over the categories (0: all).")
@click.option("--max-new-tokens", default=96, show_default=True, help="Greedy tokens each.")
@click.option("--json-new-tokens", default=256, show_default=True,
              help="Greedy tokens for a prompt that expects a JSON object.")
@click.option("--eval-max-tokens", default=0, show_default=True, help="KLD token limit.")
@click.option("--speed", "speed", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Speed JSON from bench/decode.py, bench/kernel_speed.py or bench-serve "
                   "(repeatable).")
@click.option("--memory-budget", default=None,
              help="Memory for the speed table's 'KV tokens that fit' (e.g. 16GB) "
                   "[default: this host's RAM].")
@click.option("--kv-cache-memory", default=None,
              help="KV pool of the engine that answers, at most (e.g. 1GiB): on a big model, "
                   "fewer requests at a time for less memory [default: what 8 requests need, "
                   f"up to {DEFAULTS.kv_memory_fraction:.0%} of the free memory; 1 GiB (at "
                   "least the longest request) where the FP16 reference only just fits].")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="reports/NAME.html (NAME.json is written beside it).")
@click.option("--allow-other-source", is_flag=True,
              help="Report candidates whose manifests say they were made from other FP16 "
                   "weights.")
@click.option("--max-kld", type=float, default=None,
              help="Recommend only a candidate whose mean KLD (95% upper end) is at most this.")
@click.option("--max-size", default=None,
              help="Recommend only a candidate whose weights take at most this (e.g. 4GB).")
def report_cmd(reference, candidates, prompts, text, max_prompts, max_new_tokens,
               json_new_tokens, eval_max_tokens, speed, memory_budget, kv_cache_memory, out,
               allow_other_source, max_kld, max_size):
    """Self-contained HTML quality (and speed) report of candidates vs the FP16 reference."""
    from quantpipe.core.io import parse_size
    from quantpipe.reports.build import ReportSpec, build_report
    from quantpipe.reports.data import Constraint

    limit = Constraint(max_kld, None if max_size is None else parse_size(max_size, "--max-size"))
    budget = None if memory_budget is None else parse_size(memory_budget, "--memory-budget")
    html, js = build_report(ReportSpec(reference, tuple(candidates), out, prompts, text,
                                       max_prompts, max_new_tokens, eval_max_tokens,
                                       tuple(speed), memory_budget=budget,
                                       json_new_tokens=json_new_tokens,
                                       kv_cache_memory=(parse_size(kv_cache_memory,
                                                                   "--kv-cache-memory")
                                                        if kv_cache_memory else None),
                                       allow_other_source=allow_other_source,
                                       constraint=limit))
    click.echo(f"wrote {html} and {js}")


@main.command("run")
@click.argument("source", default="smollm2-135m")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="WORKDIR.")
@click.option("--bits", "bits", type=click.Choice(["4", "8"]), multiple=True,
              help="A uniform candidate at this precision (repeatable: --bits 4 --bits 8) "
                   "[default: 4, none with --budget-bits alone].")
@click.option("--budget-bits", type=float, default=None,
              help="A mixed-precision candidate at this average bits per weight (measures "
                   "sensitivity first).")
@click.option("--budget-size", default=None,
              help="Or the mixed candidate at this checkpoint size (export --budget-size), "
                   "e.g. 120MB; one out of reach is refused after export-fp16, before "
                   "calibrating.")
@click.option("--override", "overrides", multiple=True, help=_OVERRIDE_HELP)
@click.option("--algo", type=click.Choice(calib_config.ALGOS), default=CALIB.algo,
              show_default=True, help="As calibrate's --algo.")
@click.option("--group-size", default=_group_size_default(), show_default=True,
              callback=_group_size, help="As calibrate's --group-size.")
@click.option("--sym/--asym", default=CALIB.sym, show_default=True)
@click.option("--int8-group-size", default=CALIB.int8_group_size, show_default=True,
              help="As calibrate's --int8-group-size.")
@click.option("--samples", default=CALIB.run_samples, show_default=True,
              help=f"Calibration sequences ({CALIB.samples}, calibrate's default, gives the "
                   f"best quality in {CALIB.samples / CALIB.run_samples:g}x the time).")
@click.option("--seq-len", default=CALIB.seq_len, show_default=True)
@click.option("--prompts", default=CALIB.prompts, show_default=True,
              help="Calibration prompts (file or business-calib).")
@click.option("--eval-tokens", default=CALIB.eval_tokens, show_default=True,
              help="Held-out tokens scored for KL divergence (0: all, ~25k).")
@click.option("--speed", "speed", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Speed-record JSON to include in the report (repeatable).")
@click.option("--menu", "menu", multiple=True,
              help="calibrate --menu [default: 'default' with --budget-bits or --budget-size, "
                   "else none; 'none': none].")
def run_cmd(source, out, bits, budget_bits, budget_size, overrides, algo, group_size, sym,
            int8_group_size, samples, seq_len, prompts, eval_tokens, speed, menu):
    """Whole pipeline: export-fp16 -> calibrate -> export -> eval -> report (resumable)."""
    from quantpipe.core.io import check_output_path
    from quantpipe.stages.run import RunSpec, run_pipeline

    check_output_path(out)
    res = run_pipeline(RunSpec(
        source=source, out=out, bits=tuple(int(b) for b in bits), budget_bits=budget_bits,
        budget_size=budget_size,
        overrides=tuple(overrides), algo=algo, group_size=group_size, sym=sym,
        int8_group_size=int8_group_size, samples=samples,
        seq_len=seq_len, prompts=prompts, eval_tokens=eval_tokens, speed=tuple(speed),
        menu=tuple(menu)))
    for name, ev in res.evals.items():
        k, iv = ev["kld"], ev.get("intervals") or {}
        kld_ci = (f"95% {iv['kld_mean'][0]:.5f}-{iv['kld_mean'][1]:.5f}, "
                  if "kld_mean" in iv else "")
        click.echo(f"{name + ': ' if len(res.evals) > 1 else ''}KLD mean {k['mean']:.5f} "
                   f"({kld_ci}p99 {k['p99']:.4f}), same top token "
                   f"{100 * ev['same_top_rate']:.2f}%, PPL {ev['ppl_candidate']:.3f} "
                   f"vs FP16 {ev['ppl_reference']:.3f}")
    click.echo("stages: " + ", ".join(
        f"{k} {v:.0f}s" + (f" (peak RSS {res.peaks[k] / 2**20:,.0f} MiB)"
                           if res.peaks.get(k) else "")
        for k, v in res.stages.items()))
    doc = json.loads(res.report.with_suffix(".json").read_text())
    for cand in doc["candidates"]:
        verdict = cand["verdict"]
        click.echo(f"verdict{' ' + cand['name'] if len(res.evals) > 1 else ''}: "
                   f"{verdict['status']}"
                   + "".join(f"\n  next step: {a}" for a in verdict.get("advice", [])))
    speeds = doc.get("model_speed") or []
    if speeds:
        def rate(m: dict) -> float:
            by_c = m["by_concurrency"]
            return by_c[max(by_c, key=int)]["output_tokens_per_s"]

        ref = speeds[0]
        click.echo(f"speed (output tokens/s at concurrency "
                   f"{max(ref['by_concurrency'], key=int)}, this host): FP16 {rate(ref):.1f}"
                   + "".join(f", {m['name']} {rate(m):.1f} ({rate(m) / rate(ref):.2f}x)"
                             for m in speeds[1:]))
    if len(res.evals) > 1:
        click.echo(doc["recommendation"])
    click.echo(f"report: {res.report}")


if __name__ == "__main__":
    main()
