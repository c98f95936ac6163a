"""quantpipe.core.heap: the peak resident size every stage reports, and its reset between
the models of one process (the report answers with each model in turn)."""

import mmap
import sys

import numpy as np
import pytest

from quantpipe.core.heap import peak_rss, reset_peak_rss


def test_peak_rss_is_the_high_water_mark():
    high = peak_rss()
    block = np.ones(64 * 2**20 // 8)  # 64 MiB, every page touched
    assert peak_rss() >= high and peak_rss() >= block.nbytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs")
def test_peak_rss_is_reset_between_models():
    block = np.ones(256 * 2**20 // 8)  # 256 MiB, every page touched
    high = peak_rss()
    del block
    if not reset_peak_rss():  # a sandbox that keeps the mark: the report then says so
        assert peak_rss() >= high
        pytest.skip("this kernel keeps the RSS high-water mark through clear_refs")
    assert peak_rss() < high - 200 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs")
def test_a_peak_spans_the_resets_inside_it():
    """A pipeline stage's peak (PeakSince) counts a 256 MiB block held and freed before a
    nested measurement reset the mark (the report's per-model reset inside `run`'s stage)."""
    from quantpipe.core.heap import PeakSince

    outer = PeakSince()
    if not outer.measured:
        pytest.skip("this kernel keeps the RSS high-water mark through clear_refs")
    base = peak_rss()
    # 256 MiB of fresh pages, every one touched, then unmapped (an allocator could serve a
    # numpy array from pages it already holds resident, and the mark would not move)
    buf = mmap.mmap(-1, 256 * 2**20)
    np.frombuffer(buf, dtype=np.uint8)[:] = 1
    buf.close()
    inner = PeakSince()  # resets the mark: the block is no longer in it
    assert inner.bytes() < base + 200 * 2**20
    assert outer.bytes() >= base + 250 * 2**20
    assert PeakSince().bytes() < base + 200 * 2**20  # a later one starts after the block
