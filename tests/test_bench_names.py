"""No script under bench/ is named like an installed package.

Several bench scripts and tests put bench/ on sys.path; a script there named like a package
that a dependency imports then stands in for it. transformers 5.25 made ``kernels`` a
dependency and imports it when present: bench/kernels.py (now bench/kernel_speed.py) broke
every later model build in the suite with "cannot import name 'CUDAProperties' from 'kernels'".
"""

import importlib.metadata
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_no_bench_script_shadows_an_installed_package():
    installed = importlib.metadata.packages_distributions()  # top-level import name -> dists
    clashes = {p.stem: installed[p.stem] for p in BENCH.glob("*.py") if p.stem in installed}
    assert not clashes, f"bench scripts named like installed packages: {clashes}; rename them"
