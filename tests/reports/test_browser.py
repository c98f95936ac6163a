"""End to end: the report opens in headless Chromium with its verdict, tables and charts."""

import pytest

from quantpipe.reports.html import write_report
from tests.reports.chromium import dump_dom, find_chromium, screenshot
from tests.reports.sample_data import sample_report

pytestmark = pytest.mark.skipif(
    find_chromium() is None,
    reason="chromium is not installed (apt-get update && apt-get install -y chromium)")


def test_report_renders_in_chromium(tmp_path):
    page, _ = write_report(sample_report(), tmp_path / "report.html")
    dom = dump_dom(page)
    assert 'data-verdict="inconclusive"' in dom and 'data-verdict="fail"' in dom
    assert dom.count("<table") >= 8
    assert dom.count("<svg") >= 8
    flat = dom.replace("<ins>", "").replace("</ins>", "")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in flat
    assert "<script" not in dom.lower()  # nothing became a script element while parsing
    png = screenshot(page, tmp_path / "report.png", height=1600)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
