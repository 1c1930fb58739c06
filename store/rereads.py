"""Reading a version's file again before calling it damaged.

Bytes from a store may arrive complete yet wrong where no transport checksum covers them
(an S3 range read, plain HTTP, checksum validation switched off), and a disk may fail a
read once: one bad read is no proof of damage. Every reader of a version's files (restore,
`ckpt verify`, listing, retention) re-reads through `reread`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from ckpt.store.errors import CorruptVersionError

__all__ = ["REREADS", "reread", "unproven_damage"]

log = logging.getLogger("ckpt")
T = TypeVar("T")

REREADS = 2
"""Reads of a version's file (its manifest, root info, a chunk's block) after the first,
while its bytes fail their checks or cannot be read."""


def reread(read: Callable[[], T], again: Callable[[Exception], bool], *, times: int = REREADS, what: str = "") -> T:
    """read(), and up to `times` more while what it raises passes `again` (each logged,
    prefixed by `what`); the last failure is raised, any other at once."""
    for attempt in range(times + 1):
        try:
            return read()
        except Exception as e:
            if attempt == times or not again(e):
                raise
            log.warning("%s%s; reading it again", what, e)
    raise AssertionError("unreachable")


def unproven_damage(e: Exception) -> bool:
    """A checksum mismatch (an `actual` digest) or a failed local read (`io_error`): another
    read may bring other bytes. A missing or misplaced file is damage however often read."""
    return isinstance(e, CorruptVersionError) and bool(e.actual or e.io_error)
