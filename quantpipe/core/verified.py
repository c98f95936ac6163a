"""A "verified" stamp: a full check of a folder remembered, so that loading it again skips
re-reading every byte.

After every hash and value check of a folder passed, :func:`write_stamp` records the
``(size, mtime_ns, inode, ctime_ns)`` of each file the check read. :func:`stamp_matches` is
true only while every one of those files still has exactly that key and no other file was
added to or removed from the list. Any write to a file changes its ctime, which a user cannot
set back (``os.utime`` restores mtime but sets ctime to now), and a copy or a replacement
gets a new inode: a modified file never passes as verified. What the stamp does not guard
against is a person forging it; it replaces a re-hash, not a signature.

The stamp lives beside the checkpoint (``.quantpipe-verified.json``) when the folder is
writable, otherwise in the per-user cache (``$XDG_CACHE_HOME/quantpipe/verified/``, default
``~/.cache``) under a name derived from the folder's real path, so read-only checkpoints load
fast too. Writes are atomic (temp + rename); an unreadable or foreign stamp counts as absent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from quantpipe.core.io import write_json_atomic

log = logging.getLogger(__name__)

STAMP_NAME = ".quantpipe-verified.json"
STAMP_FORMAT = "quantpipe-verified"
# bump when verify checks more than before: stamps of the older checks are then ignored
CHECKS_VERSION = 2


def file_key(path: Path) -> list[int]:
    """``[size, mtime_ns, inode, ctime_ns]`` of ``path`` (follows symlinks)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def _cache_path(folder: Path) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32]
    return Path(base) / "quantpipe" / "verified" / f"{digest}.json"


def _candidates(folder: Path) -> list[Path]:
    return [folder / STAMP_NAME, _cache_path(folder)]


def file_keys(folder: Path, files: Iterable[str]) -> dict[str, list[int]] | None:
    """``{name: file_key}`` of ``files`` (relative to ``folder``); None if one is missing.
    Taken before a check and passed to :func:`write_stamp`, so that a file written while it
    was being hashed is not stamped."""
    return _keys(folder, files)


def _keys(folder: Path, files: Iterable[str]) -> dict[str, list[int]] | None:
    try:
        return {f: file_key(folder / f) for f in sorted(set(files))}
    except OSError:
        return None  # a file vanished: not verified


def stamp_matches(folder: str | os.PathLike, files: Iterable[str]) -> bool:
    """Whether a stamp records a passed full check of exactly ``files`` (names relative to
    ``folder``), each with the size, mtime, inode and ctime it has now."""
    folder = Path(folder)
    now = _keys(folder, files)
    if now is None:
        return False
    for path in _candidates(folder):
        try:
            stamp = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if (isinstance(stamp, dict) and stamp.get("format") == STAMP_FORMAT
                and stamp.get("checks_version") == CHECKS_VERSION
                and stamp.get("folder") == str(folder.resolve()) and stamp.get("files") == now):
            return True
    return False


def write_stamp(folder: str | os.PathLike, files: Iterable[str],
                before: dict[str, list[int]] | None) -> Path | None:
    """Record that ``files`` of ``folder`` passed a full check that started when they had the
    keys ``before`` (:func:`file_keys`); returns where the stamp went, or None when a file
    changed during the check or neither the folder nor the cache is writable (the next load
    then checks again)."""
    folder = Path(folder)
    keys = _keys(folder, files)
    if keys is None or keys != before:
        log.info("%s changed while it was checked: not stamped", folder)
        return None
    stamp = {"format": STAMP_FORMAT, "checks_version": CHECKS_VERSION,
             "folder": str(folder.resolve()), "files": keys}
    for path in _candidates(folder):  # beside the checkpoint, else the user's cache
        try:
            write_json_atomic(path, stamp)
        except (OSError, ValueError) as exc:  # write_json_atomic names the path in a ValueError
            log.debug("could not write the verified stamp %s: %s", path, exc)
            continue
        return path
    log.info("%s: no writable place for a verified stamp; the next load hashes again", folder)
    return None
