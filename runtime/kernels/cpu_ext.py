"""quantpipe's own C++ CPU kernels (``csrc/cpu_ops.cpp``): built on first use, once per machine.

torch compiles the source with the machine's C++ compiler and ninja
(``torch.utils.cpp_extension.load``) into ``<root>/quantpipe/<name>``, root being
``$TORCH_EXTENSIONS_DIR`` or torch's default (``~/.cache/torch_extensions``); the library name
carries a hash of the source, the torch version and the build flags, so an edited source or
another torch builds afresh and a stale build is never loaded. The build takes ~15 s (logged as
a warning, so the pause of a first run is explained); later processes load it in milliseconds.

When the kernel cannot be used -- the CPU lacks AVX-512 BF16, there is no compiler, or
``QUANTPIPE_CPU_KERNELS=torch`` is set -- :func:`kernel_status` says why and the CPU path
keeps torch's int4pack kernel (``kernels/cpu.py``); the reason is logged once and shown as the
layer's dispatch reason.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# "torch": never build or use our kernels (comparisons, escape hatch); "quantpipe" or unset:
# use them where the CPU allows; anything else is an error
ENV = "QUANTPIPE_CPU_KERNELS"
BUILD_FLAGS_VERSION = "2"  # bump when the compiler flags below change (a new library name)
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")  # /proc/cpuinfo spelling


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where that file does not exist."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def library_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()
                            + BUILD_FLAGS_VERSION.encode()).hexdigest()
    return f"quantpipe_cpu_{digest[:12]}"


@functools.cache
def kernel_status() -> tuple[bool, str]:
    """(usable, reason). Builds and loads the library on the first call of the process."""
    choice = os.environ.get(ENV, "").strip().lower()
    if choice == "torch":
        return False, f"{ENV}=torch"
    if choice not in ("", "quantpipe"):
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: use 'torch' (torch's kernels only) or "
                         "'quantpipe' / unset (quantpipe's where the CPU allows)")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"quantpipe's CPU kernels are x86-64 only (this is {platform.machine()})"
    flags = _cpu_flags()
    if flags is not None and not set(CPU_FLAGS) <= flags:
        missing = ", ".join(sorted(set(CPU_FLAGS) - flags))
        return False, f"the CPU lacks {missing} (quantpipe's CPU kernels need AVX-512 BF16)"
    from torch.utils import cpp_extension

    name = library_name()
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = Path(root) / "quantpipe" / name
    if not (build_dir / f"{name}.so").is_file():
        log.warning("compiling quantpipe's CPU kernels for this machine (once, ~15 s) in %s",
                    build_dir)
    start = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        # -fopenmp: at::parallel_for is inline OpenMP code; without it the kernels run on one
        # thread. The OpenMP runtime is the one torch already loaded (same libgomp.so.1).
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                           is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler / ninja, build error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("quantpipe's CPU kernels could not be built (%s); using torch's kernels "
                    "instead", first)
        return False, f"building quantpipe's CPU kernels failed: {first}"
    log.info("quantpipe CPU kernels %s ready in %.1f s", name, time.perf_counter() - start)
    if not torch.ops.quantpipe_cpu.int4_supported():
        return False, "the CPU lacks AVX-512 BF16 (quantpipe's CPU kernels need it)"
    return True, "quantpipe AVX-512 BF16 kernels"
