"""The ``quantpipe`` command line: each command parses options, builds a spec, calls one function.

Nothing imports this module; library code lives in the packages it calls.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from quantpipe import __version__


def _fail(exc: Exception) -> None:
    """Turn a library ValueError (bad user input) into a clean CLI error."""
    raise click.ClickException(str(exc)) from exc


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="quantpipe")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """quantpipe: quantize a Hugging Face causal LM to INT8/INT4, serve it, and report on it.

    Stages: export-fp16 -> calibrate -> export -> eval / report; `run` does them all.
    """
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
    from quantpipe.fp16_export import Fp16ExportSpec, export_fp16

    try:
        spec = Fp16ExportSpec(source, out, dtype, max_shard_size, force, trust_remote_code)
        res = export_fp16(spec)
    except ValueError as exc:
        _fail(exc)
    click.echo(f"wrote {res.out} ({res.num_parameters:,} parameters, {len(res.shards)} shard(s), "
               f"{res.seconds:.1f}s)")


if __name__ == "__main__":
    main()
