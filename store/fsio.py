"""Durable file primitives: exclusive creates, fsync of files and directories,
early writeback, and an atomic directory swap.

Everything the commit protocol relies on for durability goes through here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Callable, Iterable

from store.digest import ChunkHasher
from store.lanes import run_lanes

__all__ = [
    "FILE_MODE",
    "DIR_MODE",
    "fsync_dir",
    "fsync_dirs",
    "fsync_files",
    "write_durable",
    "write_new",
    "write_chunk",
    "exchange_dirs",
    "makedirs",
]

FILE_MODE = 0o644  # never world-writable
DIR_MODE = 0o755
_WRITE_BLOCK = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2

_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
_renameat2 = getattr(_libc, "renameat2", None)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def makedirs(path: str) -> None:
    """`os.makedirs(path, exist_ok=True)`, except that every directory it creates gets DIR_MODE.

    os.makedirs gives its mode to the last directory only: the parents it creates get
    0o777 & ~umask, world-writable under a permissive umask (0).
    """
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    except FileNotFoundError:
        parent = os.path.dirname(path.rstrip("/"))
        if not parent or parent == path:
            raise
        makedirs(parent)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, DIR_MODE)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _each(paths: list[str], fn: Callable[[str], None], threads: int) -> None:
    """fn(path) for every path on `threads` lanes; raises the first failure (in path order)."""
    _, failed = run_lanes(paths, fn, threads, name="ckpt-fsync")
    if failed:
        raise failed[0][1]


def fsync_dirs(paths: Iterable[str], threads: int = 8) -> None:
    """fsync many directories in parallel: ext4 batches concurrent fsyncs into one journal commit."""
    _each(sorted(set(paths)), fsync_dir, threads)


def write_new(path: str, data: bytes, *, fsync: bool = False) -> None:
    """Create `path` (it must not exist) and write `data`; the caller makes it durable
    (`fsync_files`) unless `fsync`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        _write_all(fd, memoryview(data))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> None:
    """Create `path` (it must not exist), write `data`, fsync it. The caller fsyncs the directory."""
    write_new(path, data, fsync=True)


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done : done + _WRITE_BLOCK])


def write_chunk(path: str, data: memoryview, *, block_bytes: int = 0, fsync: bool = True) -> tuple[str, list[str]]:
    """Write one chunk file from a staged buffer; return its digest and block digests
    (store.digest: each byte is hashed once).

    Checksums are computed from the staged buffer, not by reading the file back. With
    `block_bytes` > 0 and a chunk larger than one block, every block gets its own digest,
    so a partial (resharded) read can be verified. Large files start their writeback
    every 64 MiB (sync_file_range) so the final fsync has little left to wait for.
    With `fsync=False` the writeback of the rest is started too, and the caller makes the
    file durable later (`fsync_files`): a writer thread then never waits for the disk.
    """
    view = data.cast("B")
    with_blocks = 0 < block_bytes < len(view)
    step = block_bytes if with_blocks else _WRITE_BLOCK  # whole blocks: one hash call each
    hasher = ChunkHasher(block_bytes if with_blocks else 0)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        done = flushed = 0
        while done < len(view):
            piece = view[done : done + step]
            hasher.update(piece)
            _write_all(fd, piece)
            done += len(piece)
            if _sync_file_range is not None and done - flushed >= _WRITE_BLOCK:
                _sync_file_range(fd, ctypes.c_int64(flushed), ctypes.c_int64(done - flushed), _SYNC_FILE_RANGE_WRITE)
                flushed = done
        if fsync:
            os.fsync(fd)
        elif _sync_file_range is not None and done > flushed:
            _sync_file_range(fd, ctypes.c_int64(flushed), ctypes.c_int64(0), _SYNC_FILE_RANGE_WRITE)  # 0: to EOF
    finally:
        os.close(fd)
    return hasher.hexdigest(), hasher.blocks


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(paths: Iterable[str], threads: int = 16) -> None:
    """fsync files written earlier (write_chunk(fsync=False)), many at once.

    Their data is already on its way to the disk; concurrent fsyncs share one journal
    commit (ext4), so this costs about one commit plus the writeback still in flight.
    An fd opened after a writeback error still reports it (errseq: nobody has seen it).
    """
    _each(sorted(set(paths)), _fsync_file, threads)


def exchange_dirs(a: str, b: str) -> bool:
    """Atomically swap two directory entries (renameat2 RENAME_EXCHANGE); False where unsupported."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)
