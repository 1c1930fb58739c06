"""Damage for tests: a byte of a file flipped on disk, as a bad sector or a stray write leaves it."""

from __future__ import annotations

import os
from pathlib import Path


def flip_byte(path: Path, offset: int, mask: int = 0x01, evict: bool = False) -> None:
    """XOR the byte at `offset` of `path` with `mask`, durably; with `evict`, the file's
    pages then leave the page cache (a restore reads the damage from the device)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
        f.flush()
        os.fsync(f.fileno())
        if evict:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
