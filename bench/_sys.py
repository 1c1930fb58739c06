"""Process-level measuring tools for the benchmark: peak RSS, page cache, clocks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    return _status_kb("VmRSS")


def peak() -> int:
    return _status_kb("VmHWM")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def can_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    """Write back dirty pages, then drop the page cache (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def cpu_seconds() -> float:
    """CPU seconds (user + system, every thread) of this process and its live children
    (torch-checkpointing writes from a subprocess)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


class Measured:
    """Wall time, CPU seconds (cpu_seconds) and extra peak RSS (VmHWM above the RSS at the
    start) of one call."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        reset_peak()
        before = rss()
        cpu = cpu_seconds()
        t0 = time.perf_counter()
        self.result = fn()
        self.seconds = time.perf_counter() - t0
        self.cpu = cpu_seconds() - cpu
        self.extra_rss = max(0, peak() - before)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file under `path` (16 at once: they share journal commits), then every directory."""
    from ckpt.store.fsio import fsync_dirs, fsync_files

    files, dirs = [], []
    for top, _, names in os.walk(path):
        dirs.append(top)
        files += [os.path.join(top, n) for n in names]
    fsync_files(files)
    fsync_dirs(dirs)


def read_tree(path: str, part: int = 0, parts: int = 1) -> int:
    """Read every regular file under `path` (or the file) once, those with index % parts ==
    part (the ranks share the work: page-cache pages are one for all); the bytes read."""
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(os.path.join(top, n) for top, _, names in os.walk(path) for n in names)
    buf = bytearray(8 << 20)
    total = 0
    for i, f in enumerate(files):
        if i % parts != part or os.path.islink(f) or not os.path.isfile(f):
            continue
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total


def du(path: str) -> int:
    """Bytes of the regular files under `path` (or of the file)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for top, _, names in os.walk(path):
        for n in names:
            p = os.path.join(top, n)
            if os.path.isfile(p) and not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def available_memory() -> int:
    """MemAvailable: what the kernel can give without swapping (tmpfs files are not in it)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0
