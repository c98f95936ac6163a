"""Headless Chromium helpers for the report tests and the docs screenshot.

Install on Debian: ``apt-get update && apt-get install -y chromium fonts-wqy-zenhei`` (the font
only makes the Chinese sample text legible in screenshots).

Usage to regenerate the docs picture:
``python -m tests.reports.chromium docs/report-sample.png``
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
# Every flag that could make Chromium reach the network at start-up is turned off.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--hide-scrollbars")


def find_chromium() -> str | None:
    for c in CANDIDATES:
        if Path(c).is_file():
            return c
    return shutil.which("chromium")


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found; apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="qp-chromium-") as profile:
        return subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout, check=True)


def dump_dom(page: Path, timeout: float = 90) -> str:
    """The DOM after Chromium parsed and laid out ``page``."""
    return _run(["--dump-dom", page.resolve().as_uri()], timeout).stdout


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 2400,
               timeout: float = 90) -> Path:
    _run([f"--window-size={width},{height}", f"--screenshot={png.resolve()}",
          page.resolve().as_uri()], timeout)
    return png


if __name__ == "__main__":
    from quantpipe.reports.html import write_report
    from tests.reports.sample_data import sample_report

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/report-sample.png")
    height = int(sys.argv[2]) if len(sys.argv) > 2 else 2400
    with tempfile.TemporaryDirectory() as tmp:
        page, _ = write_report(sample_report(), Path(tmp) / "sample.html")
        screenshot(page, out, height=height)
    print(out)
