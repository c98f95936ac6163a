"""quantpipe's own C++ CPU kernels, one build per instruction set, compiled on first use.

| ISA    | source                    | op namespace           | CPU flags (/proc/cpuinfo)    |
|--------|---------------------------|------------------------|------------------------------|
| avx512 | ``csrc/cpu_ops.cpp``      | ``quantpipe_cpu``      | avx512f/bw/vl, avx512_bf16,  |
|        |                           |                        | avx512_vnni, fma, f16c       |
| avx2   | ``csrc/cpu_ops_avx2.cpp`` | ``quantpipe_cpu_avx2`` | avx2, fma, f16c (avx_vnni    |
|        |                           |                        | used where present)          |

Both builds register the same op names (``w4a8_mm``, ``w8a32_mm``, ``w8a8_mm``,
``fp16_mm``, ``bf16_mm``, ``paged_attention``, ``add_rms_norm_``, ``rope_``, ``silu_mul``,
``gelu_tanh_mul``, ``decoder_layer``, ``quantize_a8``; the AVX-512 build adds the bf16
``w4a16_mm``, and ``w4a8_mm_amx`` / ``amx_supported`` for AMX CPUs, where ``w4a8_mm``
runs calls of 32 rows or more on the tile unit unless ``QUANTPIPE_CPU_AMX=0``), so callers
take the namespace from :func:`ops`. The best ISA the CPU has is
chosen; ``QUANTPIPE_CPU_ISA=avx2|avx512`` forces one (an error if the CPU lacks it: an AVX-512
host can run the AVX2 path, not the reverse), and ``QUANTPIPE_CPU_KERNELS=torch`` turns all of
them off (torch's kernels only).

torch compiles a source with the machine's C++ compiler and ninja
(``torch.utils.cpp_extension.load``) into ``<root>/quantpipe/<name>``, root being
``$TORCH_EXTENSIONS_DIR`` or torch's default (``~/.cache/torch_extensions``); the library name
carries a hash of the sources, the build flags, the torch version and install and the Python
interpreter (``sys.prefix``, executable, version), so an edited source or another torch builds
afresh, a stale build is never loaded, and two virtualenvs sharing the root each keep their
own build (one folder would be rebuilt by each in turn: torch's build file names the
interpreter's include paths, so ninja sees a changed command). A build takes 15-30 s and is
announced on every path that builds, as a warning (shown by default): before it starts when
the library is missing, and after a few seconds when torch's own cache turned out stale and ninja
is rebuilding; later processes load it in milliseconds.

When no build can be used -- an unsuitable CPU, no compiler, or ``QUANTPIPE_CPU_KERNELS=torch``
-- :func:`kernel_status` says why and the CPU path keeps torch's kernels (``kernels/cpu.py``);
the reason is logged once and shown as each layer's dispatch reason.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# "torch": never build or use our kernels (comparisons, escape hatch); "quantpipe" or unset:
# use them where the CPU allows; anything else is an error
ENV = "QUANTPIPE_CPU_KERNELS"
ISA_ENV = "QUANTPIPE_CPU_ISA"  # "avx2" / "avx512" force a build; unset or "auto": the best
BUILD_FLAGS_VERSION = "3"  # bump when the compiler flags below change (a new library name)
# a load that has not returned after this many seconds is compiling (a cached one takes well
# under a second, ninja's no-op check included, even on a busy host)
STALE_BUILD_NOTICE_S = 3.0


@dataclass(frozen=True)
class IsaBuild:
    """One build of the kernels for one instruction set."""

    name: str  # the QUANTPIPE_CPU_ISA spelling
    source: str  # file under csrc/ (includes the shared headers csrc/*.h)
    namespace: str  # torch op namespace it registers
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have
    cflags: tuple[str, ...]  # compiler flags beyond -O3 -fopenmp
    label: str  # for dispatch reasons

    def __post_init__(self) -> None:
        if not (CSRC / self.source).is_file():
            raise ValueError(f"{CSRC / self.source} is missing; reinstall quantpipe")


# best first
ISAS: dict[str, IsaBuild] = {
    "avx512": IsaBuild("avx512", "cpu_ops.cpp", "quantpipe_cpu",
                       ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "fma",
                        "f16c"), (), "AVX-512 BF16/VNNI"),
    # whole-file target flags: this library is loaded only on CPUs with these features
    "avx2": IsaBuild("avx2", "cpu_ops_avx2.cpp", "quantpipe_cpu_avx2", ("avx2", "fma", "f16c"),
                     ("-mavx2", "-mfma", "-mf16c"), "AVX2+FMA+F16C"),
}


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


def cpu_can_run(isa: str) -> bool:
    """Whether this CPU has every feature the ``isa`` build needs (x86-64 only)."""
    flags = _cpu_flags()
    return (platform.machine().lower() in ("x86_64", "amd64") and flags is not None
            and set(ISAS[isa].cpu_flags) <= flags)


def interpreter_key() -> str:
    """What makes a build belong to this Python and this torch (module docstring)."""
    return "\n".join((sys.prefix, os.path.realpath(sys.executable), sys.version,
                      torch.__version__, str(Path(torch.__file__).resolve().parent)))


def library_name(isa: str) -> str:
    b = ISAS[isa]
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # every shared header
    digest = hashlib.sha256((CSRC / b.source).read_bytes() + headers
                            + interpreter_key().encode() + BUILD_FLAGS_VERSION.encode()
                            + " ".join(b.cflags).encode()).hexdigest()
    return f"quantpipe_cpu_{isa}_{digest[:12]}"


# one chooser / builder at a time: a build started in the background (build_in_background) and
# the first kernel call then wait for one another instead of compiling twice
_LOCK = threading.RLock()


def build_status(isa: str) -> tuple[bool, str]:
    """(usable, reason) of one ISA's build; compiles and loads it on the first call."""
    with _LOCK:
        return _build_status(isa)


@functools.cache
def _build_status(isa: str) -> tuple[bool, str]:
    b = ISAS[isa]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"quantpipe's CPU kernels are x86-64 only (this is {platform.machine()})"
    flags = _cpu_flags()
    if flags is not None and not set(b.cpu_flags) <= flags:
        missing = ", ".join(sorted(set(b.cpu_flags) - flags))
        return False, f"the CPU lacks {missing} (quantpipe's {b.label} kernels need them)"
    from torch.utils import cpp_extension

    name = library_name(isa)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = Path(root) / "quantpipe" / name
    notice = f"compiling quantpipe's {b.label} CPU kernels (once, ~30 s) in {build_dir}"
    announced = not (build_dir / f"{name}.so").is_file()
    if announced:
        log.warning("%s", notice)
    # a library on disk that torch still rebuilds (its cache is stale) is announced late
    late = threading.Timer(STALE_BUILD_NOTICE_S, log.warning, ("%s (the cached build is stale)",
                                                               notice))
    late.daemon = True
    start = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        if not announced:
            late.start()
        # -fopenmp: at::parallel_for is inline OpenMP code; without it the kernels run on one
        # thread. The OpenMP runtime is the one torch already loaded (same libgomp.so.1).
        cpp_extension.load(name=name, sources=[str(CSRC / b.source)],
                           extra_cflags=["-O3", "-fopenmp", *b.cflags],
                           extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                           is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler / ninja, build error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("quantpipe's %s CPU kernels could not be built (%s); using torch's kernels "
                    "instead", b.label, first)
        return False, f"building quantpipe's {b.label} CPU kernels failed: {first}"
    finally:
        late.cancel()
    log.info("quantpipe CPU kernels %s ready in %.1f s", name, time.perf_counter() - start)
    if not getattr(torch.ops, b.namespace).supported():
        return False, f"the CPU lacks {b.label} (quantpipe's {isa} kernels need it)"
    return True, f"quantpipe {b.label} kernels"


def _requested_isa() -> str | None:
    """The forced ISA from QUANTPIPE_CPU_ISA, None for the best; errors name the fix."""
    choice = os.environ.get(ISA_ENV, "").strip().lower()
    if choice in ("", "auto"):
        return None
    if choice not in ISAS:
        raise ValueError(f"{ISA_ENV}={os.environ[ISA_ENV]!r}: use one of {sorted(ISAS)} or "
                         "'auto' / unset (the best this CPU runs)")
    if not cpu_can_run(choice):
        flags = _cpu_flags() or set()
        missing = ", ".join(sorted(set(ISAS[choice].cpu_flags) - flags)) or platform.machine()
        able = [n for n in ISAS if cpu_can_run(n)]
        raise ValueError(f"{ISA_ENV}={choice} but this CPU lacks {missing}; use "
                         f"{' or '.join(able) if able else 'QUANTPIPE_CPU_KERNELS=torch'} "
                         f"or unset {ISA_ENV}")
    return choice


@functools.cache
def _status() -> tuple[str | None, bool, str]:
    """(chosen ISA or None, usable, reason), from the environment and the CPU; cached."""
    choice = os.environ.get(ENV, "").strip().lower()
    if choice == "torch":
        return None, False, f"{ENV}=torch"
    if choice not in ("", "quantpipe"):
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: use 'torch' (torch's kernels only) or "
                         "'quantpipe' / unset (quantpipe's where the CPU allows)")
    forced = _requested_isa()
    if forced is not None:
        usable, why = build_status(forced)
        return forced, usable, f"{why} ({ISA_ENV}={forced})" if usable else why
    for isa in ISAS:  # best first
        if cpu_can_run(isa):
            usable, why = build_status(isa)
            return isa, usable, why
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, False, f"quantpipe's CPU kernels are x86-64 only ({platform.machine()})"
    return None, False, "the CPU lacks AVX2, FMA or F16C (quantpipe's CPU kernels need them)"


def _chosen() -> tuple[str | None, bool, str]:
    with _LOCK:
        return _status()


def kernel_status() -> tuple[bool, str]:
    """(usable, reason) for the chosen ISA. Builds and loads its library on the first call."""
    _, usable, why = _chosen()
    return usable, why


def build_in_background() -> threading.Thread:
    """Choose and build (or load) the kernels on a daemon thread, so that a pipeline compiles
    them while an earlier stage leaves a core idle; the first kernel call waits for it. An
    environment error (a bad QUANTPIPE_CPU_KERNELS) is left for that call to raise."""
    def build() -> None:
        try:
            _chosen()
        except ValueError:
            pass  # not cached: kernel_status() raises it again where it is used

    thread = threading.Thread(target=build, name="quantpipe-cpu-build", daemon=True)
    thread.start()
    return thread


def reset() -> None:
    """Forget the cached choice and build statuses (tests that change the environment); a
    library already loaded stays loaded and is found again without compiling."""
    with _LOCK:
        _status.cache_clear()
        _build_status.cache_clear()


def active_isa() -> str | None:
    """The ISA whose build the CPU path uses, or None (torch's kernels)."""
    isa, usable, _ = _chosen()
    return isa if usable else None


def ops(isa: str | None = None):
    """The op namespace of ``isa`` (default: the active one), e.g. ``ops().w8a32_mm``."""
    isa = isa or active_isa()
    if isa is None:
        raise ValueError(f"quantpipe's CPU kernels are not usable here: {kernel_status()[1]}")
    return getattr(torch.ops, ISAS[isa].namespace)


def w4a8_uses_vnni(isa: str) -> bool:
    """w4a8_mm's instruction choice: VNNI always on AVX-512, AVX-VNNI where present on AVX2."""
    return isa == "avx512" or "avx_vnni" in (_cpu_flags() or set())
