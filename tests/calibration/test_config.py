"""calibration.config is the one source of calibration's defaults: the commands and the specs
read it, so `quantpipe calibrate` / `quantpipe run` and a library caller get the same run."""

from __future__ import annotations

import dataclasses

import click
import pytest

from quantpipe import cli
from quantpipe.calibration import config
from quantpipe.calibration.algorithms import ALGORITHMS
from quantpipe.calibration.spec import CalibrateSpec
from quantpipe.stages.run import RunSpec


def _spec_defaults(spec_class) -> dict:
    out = {}
    for f in dataclasses.fields(spec_class):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _as_library_value(command: click.Command, param: click.Parameter):
    """An option's default as the command hands it to the spec (its callback and type)."""
    ctx = click.Context(command)
    value = param.get_default(ctx)
    if param.callback is not None:
        value = param.callback(ctx, param, value)
    if param.multiple:  # no default: click passes an empty tuple
        value = tuple(value) if isinstance(value, (list, tuple)) else ()
    if param.name == "bits":  # a choice of "4" / "8" (repeatable for run)
        value = tuple(int(v) for v in value) if param.multiple else int(value)
    return value


@pytest.mark.parametrize("command, spec_class, shared", [
    (cli.calibrate_cmd, CalibrateSpec,
     {"prompts", "column", "algo", "group_size", "sym", "int8_group_size", "act_order",
      "mse_clip", "damp", "static_groups", "strict_group_size", "per_channel_if_larger", "samples",
      "seq_len",
      "min_tokens", "seed", "batch_size", "min_expert_tokens", "max_memory", "device", "menu",
      "force"}),
    (cli.run_cmd, RunSpec,
     {"bits", "budget_bits", "budget_size", "overrides", "algo", "group_size", "sym",
      "int8_group_size", "samples", "seq_len", "prompts", "eval_tokens", "speed", "menu"}),
])
def test_command_defaults_are_the_library_defaults(command, spec_class, shared):
    spec = _spec_defaults(spec_class)
    options = {p.name: p for p in command.params if p.name in spec}
    assert set(options) == shared  # an option added to both is checked here too
    differ = {name: (_as_library_value(command, p), spec[name]) for name, p in options.items()
              if _as_library_value(command, p) != spec[name]}
    assert not differ, differ


def test_library_default_algorithm_is_auto_as_on_the_command_line():
    assert CalibrateSpec.algo == RunSpec.algo == config.AUTO == config.DEFAULTS.algo


def test_algo_choices_are_the_algorithm_table():
    """config.ALGOS (the CLI's choices) is auto and the rows of both algorithm tables (how
    each runs: algorithms.ALGORITHMS; its options: config.ALGO_OPTIONS), in order."""
    assert config.ALGOS == (config.AUTO, *ALGORITHMS) == (config.AUTO, *config.ALGO_OPTIONS)


def test_group_size_help_lists_every_accepted_size():
    text = config.group_size_help()
    for g in config.GROUP_SIZES:
        assert f"{g}" in text
    assert f"auto ({config.AUTO_GROUP_SIZE}" in text


def test_defaults_table_rejects_unknown_values():
    with pytest.raises(ValueError, match="algo"):
        config.CalibrationDefaults(algo="smoothquant")
    with pytest.raises(ValueError, match="group_size"):
        config.CalibrationDefaults(group_size=48)
