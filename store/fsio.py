"""Durable file primitives: exclusive creates, chunk writes (O_DIRECT or early
writeback), fsync of files and directories, and an atomic directory swap.

Everything the commit protocol relies on for durability goes through here.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckpt.store.digest import ChunkHasher
from ckpt.store.errors import TierUnavailableError
from ckpt.store.lanes import run_lanes

__all__ = [
    "FILE_MODE",
    "DIR_MODE",
    "fsync_dir",
    "fsync_dirs",
    "fsync_files",
    "write_durable",
    "write_new",
    "write_chunk",
    "WrittenChunk",
    "open_new",
    "end_at",
    "DIRECT_ALIGN",
    "DIRECT_MIN_BYTES",
    "exchange_dirs",
    "makedirs",
    "makedirs_within",
    "set_direct",
    "write_all",
    "entries",
    "in_ram",
]

FILE_MODE = 0o644  # never world-writable
DIR_MODE = 0o755
_WRITE_BLOCK = 64 << 20
DIRECT_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length in whole blocks of this
DIRECT_MIN_BYTES = 1 << 20  # smaller chunks go through the page cache
_DIRECT_WRITE = 64 << 20  # bytes per O_DIRECT write (or the rest of the chunk)
_SYNC_FILE_RANGE_WRITE = 2

_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
_renameat2 = getattr(_libc, "renameat2", None)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_statfs = getattr(_libc, "statfs", None)
_RAM_FILESYSTEMS = frozenset({0x01021994, 0x858458F6})  # tmpfs, ramfs (linux/magic.h)


def in_ram(path: str) -> bool:
    """Whether `path` is on tmpfs or ramfs: every read is a copy out of memory, so nothing
    that hides a disk's latency pays there. False where it cannot tell."""
    if _statfs is None:
        return False
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first member, a long
    if _statfs(os.fsencode(path), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value in _RAM_FILESYSTEMS


def makedirs(path: str, made: list[str] | None = None) -> list[str]:
    """`os.makedirs(path, exist_ok=True)`, except that every directory it creates gets DIR_MODE;
    the directories its own calls created, parents first (as `path` names them). `made`, if
    given, gets each as it is created: a caller can remove them even when this raises part-way.

    os.makedirs gives its mode to the last directory only: the parents it creates get
    0o777 & ~umask, world-writable under a permissive umask (0).
    """
    out = made if made is not None else []
    start = len(out)
    _makedirs(path, out)
    return out[start:]


def _makedirs(path: str, made: list[str]) -> None:
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return
    except FileNotFoundError:
        parent = os.path.dirname(path.rstrip("/"))
        if not parent or parent == path:
            raise
        _makedirs(parent, made)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            return
    made.append(path)


def makedirs_within(root: str, path: str) -> None:
    """makedirs(path) for a directory inside `root`, which must exist already: a root whose
    disk was unmounted (its mount point now an empty directory of the disk below it) is
    not made again there by a background write (FileNotFoundError instead)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(errno.ENOENT, "the checkpoint root is gone", root)
    makedirs(path)


def entries(path: str) -> list[os.DirEntry[str]]:
    """The entries of a directory; [] if it does not exist, TierUnavailableError if it
    cannot be listed (an I/O error, a file where the directory should be)."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise TierUnavailableError(e.errno, f"cannot list {path}: {e.strerror}") from None


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_FSYNC_THREADS = 16
_fsync_pool: ThreadPoolExecutor | None = None
_fsync_pool_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process's fsync threads, started once. A pool per call started its threads on
    every fsync of a commit, and a thread starts only once it gets the GIL: with a training
    loop holding it, 8 of them took 26-31 ms (0.1-10 ms on threads already running)."""
    global _fsync_pool
    with _fsync_pool_lock:
        if _fsync_pool is None:
            _fsync_pool = ThreadPoolExecutor(_FSYNC_THREADS, thread_name_prefix="ckpt-fsync")
        return _fsync_pool


def _forget_pool() -> None:
    global _fsync_pool, _fsync_pool_lock
    _fsync_pool, _fsync_pool_lock = None, threading.Lock()  # a forked child has none of its threads


os.register_at_fork(after_in_child=_forget_pool)


def _each(paths: list[str], fn: Callable[[str], None], threads: int) -> None:
    """fn(path) for every path on `threads` lanes; raises the first failure (in path order)."""
    _, failed = run_lanes(paths, fn, min(threads, _FSYNC_THREADS), pool=_pool())
    if failed:
        raise failed[0][1]


def fsync_dirs(paths: Iterable[str], threads: int = 8) -> None:
    """fsync many directories in parallel: ext4 batches concurrent fsyncs into one journal commit."""
    _each(sorted(set(paths)), fsync_dir, threads)


def open_new(path: str, replace: bool) -> int:
    """A file to write from its start: created (it must not exist), or with `replace` an
    existing one overwritten in place (store.spare: its blocks stay allocated; the caller
    cuts it to length with _end_at)."""
    how = os.O_NOFOLLOW if replace else os.O_EXCL
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | how, FILE_MODE)


def end_at(fd: int, size: int) -> None:
    """An overwritten file ends where its new bytes do."""
    if os.fstat(fd).st_size > size:
        os.ftruncate(fd, size)


def write_new(path: str, data: bytes, *, fsync: bool = False, replace: bool = False) -> None:
    """Create `path` (it must not exist; with `replace` it may, and is overwritten) and
    write `data`; the caller makes it durable (`fsync_files`) unless `fsync`."""
    fd = open_new(path, replace)
    try:
        write_all(fd, memoryview(data))
        if replace:
            end_at(fd, len(data))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> None:
    """Create `path` (it must not exist), write `data`, fsync it. The caller fsyncs the directory."""
    write_new(path, data, fsync=True)


def replace_durable(path: str, data: bytes) -> None:
    """Replace `path` with `data` atomically: a reader sees the old bytes or the new, never
    a torn file; durable on return (the file and its directory fsynced)."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done : done + _WRITE_BLOCK])


@dataclass(frozen=True)
class WrittenChunk:
    xxh3: str  # the chunk digest (store.digest)
    blocks: list[str]  # block digests; empty for a chunk checksummed as one block
    direct_bytes: int  # bytes written with O_DIRECT (the rest went through the page cache)


def write_chunk(
    path: str,
    data: memoryview,
    *,
    block_bytes: int = 0,
    fsync: bool = True,
    direct: bool = False,
    replace: bool = False,
) -> WrittenChunk:
    """Write one chunk file from a staged buffer; return its digests (store.digest: each
    byte is hashed once, from the buffer, not by reading the file back).

    With `block_bytes` > 0 and a chunk larger than one block, every block gets its own
    digest, so a partial (resharded) read can be verified.

    With `direct`, a chunk of at least DIRECT_MIN_BYTES whose buffer starts on a
    DIRECT_ALIGN boundary is written with O_DIRECT, straight from the buffer to the device
    (all but its last partial block): no copy into the page cache, no dirty pages for the
    kernel to flush under memory pressure, and the same speed whatever else the page cache
    holds. Elsewhere (a filesystem that refuses O_DIRECT, a small or unaligned chunk) the
    file is written through the page cache, its writeback started every 64 MiB
    (sync_file_range) so that the final fsync has little left to wait for.

    With `fsync=False` the caller makes the file durable later (`fsync_files`; the
    O_DIRECT part needs it too: it created extents and may sit in the device's cache).
    With `replace`, an existing file at `path` is overwritten in place (store.spare).
    """
    view = data.cast("B")
    with_blocks = 0 < block_bytes < len(view)
    step = block_bytes if with_blocks else _WRITE_BLOCK  # whole blocks: one hash call each
    hasher = ChunkHasher(block_bytes if with_blocks else 0)
    fd = open_new(path, replace)
    try:
        direct_end = _direct_prefix(view) if direct else 0
        if direct_end and not set_direct(fd, True):
            direct_end = 0
        written = flushed = 0  # written: bytes in the file; flushed: its writeback started
        for start in range(0, len(view), step):
            hashed = min(len(view), start + step)
            hasher.update(view[start:hashed])
            # O_DIRECT: whole aligned blocks, as far as hashed, in large writes (each is
            # synchronous: a large one keeps many requests queued on the device)
            if written < direct_end and (hashed - written >= _DIRECT_WRITE or hashed >= direct_end):
                upto = min(direct_end, hashed - hashed % DIRECT_ALIGN)
                try:
                    write_all(fd, view[written:upto])
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    # The device wants more alignment than DIRECT_ALIGN (nothing was written
                    # by the refused call): the rest of the file goes through the page cache.
                    set_direct(fd, False)
                    os.lseek(fd, written, os.SEEK_SET)
                    direct_end = written
                else:
                    written = flushed = upto
                    if written == direct_end:
                        set_direct(fd, False)  # the tail goes through the page cache
            if written >= direct_end:
                write_all(fd, view[written:hashed])
                written = hashed
                if _sync_file_range is not None and written - flushed >= _WRITE_BLOCK:
                    _start_writeback(fd, flushed, written - flushed)
                    flushed = written
        if replace:
            end_at(fd, len(view))
        if fsync:
            os.fsync(fd)
        elif _sync_file_range is not None and written > flushed:
            _start_writeback(fd, flushed, 0)  # 0: to EOF
    finally:
        os.close(fd)
    return WrittenChunk(hasher.hexdigest(), hasher.blocks, direct_end)


def _direct_prefix(view: memoryview) -> int:
    """How many leading bytes of `view` O_DIRECT can write: whole DIRECT_ALIGN blocks from
    an aligned address; 0 for a small chunk (a synchronous write per file costs more than
    the page-cache copy) or an unaligned or read-only buffer."""
    if len(view) < DIRECT_MIN_BYTES or view.readonly:
        return 0
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return 0 if address % DIRECT_ALIGN else len(view) - len(view) % DIRECT_ALIGN


def set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for an open file; False where the filesystem refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    return True


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    assert _sync_file_range is not None
    _sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(nbytes), _SYNC_FILE_RANGE_WRITE)


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
