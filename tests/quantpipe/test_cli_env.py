"""The command line sets OpenMP's wait policy before torch loads (libgomp reads it only then),
and leaves a policy the user chose alone."""

import json
import os
import subprocess
import sys

import pytest

# a fresh interpreter: runs one command through the CLI group (a missing source: it fails fast,
# after the group's callback), then reports the environment torch would see and whether torch
# had been imported before the command ran
PROBE = """
import json, os, sys
from click.testing import CliRunner
from quantpipe.cli import main
before = "torch" in sys.modules
CliRunner().invoke(main, ["export-fp16", "/nonexistent/model", "--out", "/nonexistent/out"])
print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY"), "torch_before": before}))
"""


@pytest.mark.parametrize("preset,want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_cli_sets_a_passive_openmp_wait_policy_before_torch_loads(preset, want):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"policy": want, "torch_before": False}


def test_report_help_states_the_kv_cap_of_a_reference_that_only_just_fits():
    """The help's default for --kv-cache-memory is the library's (reports.build)."""
    from click.testing import CliRunner

    from quantpipe.cli import main
    from quantpipe.reports.build import TIGHT_KV_MEMORY

    out = " ".join(CliRunner().invoke(main, ["report", "--help"]).output.split())
    assert f"{TIGHT_KV_MEMORY / 2**30:g} GiB (at least the longest request)" in out
