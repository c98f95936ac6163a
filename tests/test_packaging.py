"""The distribution as a user gets it: the wheel installs one top-level package, ``quantpipe``
(the repository's calibration/, runtime/ and reports/ folders become quantpipe.calibration,
quantpipe.runtime and quantpipe.reports), every command's ``--help`` works from a fresh
(non-editable) install, and the import-linter layer contracts in pyproject.toml hold on the
installed tree.

The wheel is built from a copy of the package sources without build isolation (setuptools from
the test environment, nothing downloaded); the fresh venv sees the test environment's
site-packages for the dependencies (torch, transformers...) through a ``.pth`` line, which adds
that folder without running its ``.pth`` files, so the editable install of this checkout is
invisible there.
"""

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "quantpipe", "calibration", "runtime", "reports")


def _run(cmd, cwd, env=None, timeout=600):
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, wheel path, a working folder outside the checkout) for the built wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(dist), str(src)], cwd=tmp)
    (wheel,) = dist.glob("quantpipe-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = Path(_run([str(python), "-c", where], cwd=tmp).strip())
    deps = [p for p in site.getsitepackages() + [sysconfig.get_path("purelib")] if Path(p).is_dir()]
    (purelib / "_test_env_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    # the test environment's pip installs into the fresh venv (it has none of its own)
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "-q", str(wheel)], cwd=tmp)
    work = tmp / "elsewhere"  # not the checkout: its folders must not be importable by accident
    work.mkdir()
    return python, wheel, work


def test_wheel_installs_only_quantpipe(installed):
    python, wheel, work = installed
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"quantpipe"}
    # the files the code opens at run time travel with the wheel
    for data in ("quantpipe/runtime/kernels/csrc/cpu_ops.cpp",
                 "quantpipe/runtime/kernels/csrc/cpu_ops_avx2.cpp",
                 "quantpipe/runtime/kernels/csrc/common.h",
                 "quantpipe/prompts/data/business_calib.jsonl",
                 "quantpipe/prompts/data/business_eval.jsonl",
                 "quantpipe/reports/assets/report.css",
                 "quantpipe/reports/metrics/rouge/rouge.py"):
        assert data in names, data
    # every module imports from the installed tree, and the old top-level names are gone
    probe = (
        "import importlib, json, pkgutil, quantpipe\n"
        "mods = [m.name for m in pkgutil.walk_packages(quantpipe.__path__, 'quantpipe.')]\n"
        "files = {m: importlib.import_module(m).__file__ for m in mods}\n"
        "stray = []\n"
        "for name in ('runtime', 'calibration', 'reports'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        stray.append(name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "from quantpipe.prompts.sets import load_prompt_records\n"
        "shipped = {n: len(load_prompt_records(n)) for n in ('business-calib', 'business-eval')}\n"
        "print(json.dumps({'files': files, 'stray': stray, 'shipped': shipped}))\n"
    )
    out = json.loads(_run([str(python), "-c", probe], cwd=work).splitlines()[-1])
    assert not out["stray"]
    assert min(out["shipped"].values()) > 0, out["shipped"]  # package data found by name
    assert len(out["files"]) > 40
    venv = python.parent.parent
    outside = {m: f for m, f in out["files"].items() if not Path(f).is_relative_to(venv)}
    assert not outside, f"modules loaded from outside the fresh install: {outside}"


def test_every_command_help_works_from_the_wheel(installed):
    python, _, work = installed
    quantpipe = python.parent / "quantpipe"
    top = _run([str(quantpipe), "--help"], cwd=work)
    commands = [line.split()[0] for line in top.split("Commands:")[1].splitlines() if line.strip()]
    assert {"export-fp16", "calibrate", "export", "serve", "run", "report"} <= set(commands)
    for command in commands:
        out = _run([str(quantpipe), command, "--help"], cwd=work)
        assert f"Usage: quantpipe {command}" in out


def test_import_contracts_kept_on_the_installed_tree(installed):
    python, _, work = installed
    # the contracts are read from the repository's pyproject.toml; 0 = every contract kept,
    # otherwise the tool prints each broken import chain
    code = ("import sys; from importlinter import cli; "
            f"sys.exit(cli.lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, "
            "no_cache=True))")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    _run([str(python), "-c", code], cwd=work, env=env)
