"""Process memory housekeeping: hand freed memory back to the OS (loaders, calibration), and
the peak resident size every stage reports."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys

import torch


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, looked up once (find_library runs ldconfig); None elsewhere."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def release_freed_memory() -> None:
    """Hand the load's freed temporaries back to the OS (glibc keeps them in its arenas).

    Reading a checkpoint allocates unpacked and re-packed copies of every layer that are
    freed by the time the model is built; without this the process keeps ~0.3 GB of free heap
    for SmolLM2-135M in its resident size. Loaders call it once per layer. No-op where glibc's
    malloc_trim does not exist.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A CPU tensor of zeros in an anonymous memory map, and the map: the OS hands out zero
    pages and makes a page resident only when it is first written, and a range the caller no
    longer needs can be handed back (``map.madvise(mmap.MADV_DONTNEED, ...)``) while the
    tensor lives. The tensor keeps the map alive."""
    numel = math.prod(shape)
    buf = mmap.mmap(-1, max(numel * dtype.itemsize, 1))  # a map cannot be empty
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape), buf


# the high-water mark (bytes) each reset discarded, in order: a measurement that spans
# another's reset (a pipeline stage around the report's per-model ones) still sees its peak
_discarded: list[int] = []


def reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark (Linux ``clear_refs`` 5); False where not
    possible (then :func:`peak_rss` is the peak since the process started). Some kernels and
    sandboxes accept the write and keep the old mark, so the reset is checked: the mark must
    have come down to the resident size."""
    before = _proc_status_kib("VmHWM").get("VmHWM")
    if before is not None:
        _discarded.append(before * 1024)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    status = _proc_status_kib("VmHWM", "VmRSS")
    return len(status) == 2 and status["VmHWM"] <= status["VmRSS"] + _RESET_SLACK_KIB


_RESET_SLACK_KIB = 8 * 1024  # pages touched between the reset and the read


def _proc_status_kib(*keys: str) -> dict[str, int]:
    """The named ``/proc/self/status`` fields in KiB; those missing (off Linux) left out."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys:
                    found[key] = int(rest.split()[0])
    except OSError:
        pass
    return found


def peak_rss() -> int | None:
    """The process's resident-memory high-water mark in bytes: Linux's ``VmHWM`` (which
    :func:`reset_peak_rss` lowers), else ``getrusage``'s peak since the process started (KiB
    on Linux, bytes on macOS); None where neither exists."""
    kib = _proc_status_kib("VmHWM").get("VmHWM")
    if kib is not None:
        return kib * 1024
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class PeakSince:
    """The process's RSS peak from now on, whatever resets happen meanwhile (nested
    measurements reset the mark for their own): ``PeakSince().bytes()`` after the work.
    ``measured`` is False where the mark could not be reset (then nothing is reported)."""

    def __init__(self) -> None:
        self.measured = reset_peak_rss()
        self._first = len(_discarded)

    def bytes(self) -> int | None:
        if not self.measured:
            return None
        return max([peak_rss() or 0, *_discarded[self._first:]])


# whole models held at once (eval's pair, report's answering model, sensitivity's FP model)
# may take at most this fraction of the available memory
WHOLE_MODELS_MEMORY_FRACTION = 0.6


def fits_in_memory(need: int) -> tuple[bool, int]:
    """(whether ``need`` bytes of whole models fit in ``WHOLE_MODELS_MEMORY_FRACTION`` of the
    memory available now, the bytes available)."""
    import psutil

    have = psutil.virtual_memory().available
    return need <= WHOLE_MODELS_MEMORY_FRACTION * have, have
