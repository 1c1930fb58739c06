"""The machine's own limits for the benchmark's bytes: the best raw copy, write and read.

Each floor moves exactly the bytes of the rank's local tensors, with no format, no
checksums and no metadata beyond the files themselves. Several strategies are tried per
floor and the fastest is taken, so a library can only beat a floor by measurement noise.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ckpt.store.fsio import fsync_dir

_MIB = 1 << 20
_WRITE_BLOCK = 64 * _MIB  # one os.write per 64 MiB (no extra copies: views of the tensor)
_READ_BLOCK = 1 * _MIB  # preadv size: copies out of the page cache run far faster in 1 MiB pieces than in 4+ MiB
_SFR_EVERY = 64 * _MIB
_PAGE = 4096  # O_DIRECT alignment of memory addresses, file offsets and lengths
_SYNC_FILE_RANGE_WRITE = 2

_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def lanes(tensors: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """Split tensors into n lanes balanced by bytes (largest first onto the lightest lane)."""
    out: list[list[torch.Tensor]] = [[] for _ in range(n)]
    load = [0] * n
    for t in sorted(tensors, key=lambda t: -t.numel() * t.element_size()):
        i = load.index(min(load))
        out[i].append(t)
        load[i] += t.numel() * t.element_size()
    return out


def _memcpy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """glibc memcpy through numpy (GIL released): ~2x torch's copy_ on this machine."""
    np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())


def _write_file(path: str, tensors: list[torch.Tensor], early: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        done = flushed = 0
        for t in tensors:
            view = byte_view(t)
            pos = 0
            while pos < len(view):
                n = os.write(fd, view[pos : pos + _WRITE_BLOCK])
                pos += n
                done += n
                if early and _sync_file_range is not None and done - flushed >= _SFR_EVERY:
                    _sync_file_range(
                        fd, ctypes.c_int64(flushed), ctypes.c_int64(done - flushed), _SYNC_FILE_RANGE_WRITE
                    )
                    flushed = done
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_direct(path: str, tensors: list[torch.Tensor]) -> None:
    """O_DIRECT straight from the tensors: no page-cache copy. O_DIRECT needs the memory
    address and the file offset on the same 4 KiB grid, so each tensor starts at a file
    offset congruent to its address (holes of < 4 KiB between tensors); the partial pages
    at either end of a tensor go through the page cache."""
    buffered = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    direct = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        end = 0
        for t in tensors:
            view = byte_view(t)
            if not len(view):
                continue
            address = t.data_ptr()
            base = end + (address - end) % _PAGE  # base = address (mod _PAGE)
            head = min(len(view), -address % _PAGE)
            body_end = head + (len(view) - head) // _PAGE * _PAGE
            if head:
                os.pwrite(buffered, view[:head], base)
            pos = head
            while pos < body_end:
                pos += os.pwrite(direct, view[pos : min(body_end, pos + _WRITE_BLOCK)], base + pos)
            if body_end < len(view):
                os.pwrite(buffered, view[body_end:], base + body_end)
            end = base + len(view)
        os.fsync(buffered)
    finally:
        os.close(direct)
        os.close(buffered)


# name -> (files, how: "plain", "sync_file_range" (early writeback) or "o_direct")
WRITE_STRATEGIES = {
    "one_file": (1, "plain"),
    "4_files_4_threads": (4, "plain"),
    "4_files_4_threads_sync_file_range": (4, "sync_file_range"),
    "4_files_4_threads_o_direct": (4, "o_direct"),
}


def write_floor(directory: str, rank: int, tensors: list[torch.Tensor], strategy: str) -> list[str]:
    """Durably write the tensors' bytes into `directory` (files, then the directory, fsynced)."""
    files, how = WRITE_STRATEGIES[strategy]
    os.makedirs(directory, exist_ok=True)
    groups = lanes(tensors, files) if files > 1 else [tensors]
    paths = [os.path.join(directory, f"rank{rank}-part{i}.bin") for i in range(len(groups))]

    def write(path: str, group: list[torch.Tensor]) -> None:
        if how == "o_direct":
            _write_file_direct(path, group)
        else:
            _write_file(path, group, how == "sync_file_range")

    if len(groups) == 1:
        write(paths[0], groups[0])
    else:
        with ThreadPoolExecutor(len(groups)) as pool:
            list(pool.map(lambda a: write(*a), zip(paths, groups)))
    fsync_dir(directory)
    return paths


def _read_file(path: str, tensors: list[torch.Tensor]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        off = 0
        for t in tensors:
            view = byte_view(t)
            pos = 0
            while pos < len(view):
                n = os.preadv(fd, [view[pos : pos + _READ_BLOCK]], off + pos)
                if n <= 0:
                    raise EOFError(path)
                pos += n
            off += len(view)
    finally:
        os.close(fd)


def read_floor(directory: str, rank: int, tensors: list[torch.Tensor], files: int) -> None:
    """Read back what write_floor(strategy with `files` files) wrote, into the existing tensors."""
    groups = lanes(tensors, files) if files > 1 else [tensors]
    paths = [os.path.join(directory, f"rank{rank}-part{i}.bin") for i in range(len(groups))]
    if len(groups) == 1:
        _read_file(paths[0], groups[0])
    else:
        with ThreadPoolExecutor(len(groups)) as pool:
            list(pool.map(lambda a: _read_file(a[0], a[1]), zip(paths, groups)))


def read_floor_ranges(directory: str, rank: int, tensors: list[torch.Tensor], threads: int) -> None:
    """One file (one_file layout), read by `threads` threads, each a contiguous byte range of tensors."""
    path = os.path.join(directory, f"rank{rank}-part0.bin")
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off += t.numel() * t.element_size()
    items = list(zip(tensors, offsets))
    total = off
    cut = [0]
    acc = 0
    for i, (t, _) in enumerate(items):
        acc += t.numel() * t.element_size()
        if acc >= total * len(cut) / threads and len(cut) < threads:
            cut.append(i + 1)
    cut.append(len(items))
    parts = [items[a:b] for a, b in zip(cut, cut[1:]) if b > a]

    def one(part: list[tuple[torch.Tensor, int]]) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for t, base in part:
                view = byte_view(t)
                pos = 0
                while pos < len(view):
                    n = os.preadv(fd, [view[pos : pos + _READ_BLOCK]], base + pos)
                    if n <= 0:
                        raise EOFError(path)
                    pos += n
        finally:
            os.close(fd)

    with ThreadPoolExecutor(len(parts)) as pool:
        list(pool.map(one, parts))


# -- same-work floors ----------------------------------------------------------------------
#
# The simplest code that does the work a durable, checksummed save must do, and no more:
# copy the state into a reused buffer (so training may go on), xxh3 every byte, write one
# file per rank, fsync it and its directory; and for a restore: read the file into the
# existing tensors and verify every byte against the digests. ckpt's time over these is
# the cost of its format (zarr v3, a file per chunk, manifest, rank files) and protocol
# (atomic commit across ranks).

_HASH_BLOCK = 16 * _MIB  # one digest per block: about ckpt's chunks' granularity


def _aligned(nbytes: int) -> torch.Tensor:
    """A page-aligned buffer (mmap'd: O_DIRECT needs the alignment), already touched."""
    import mmap

    m = mmap.mmap(-1, max(_PAGE, -(-nbytes // _PAGE) * _PAGE))
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(0)
    return t[:nbytes]


SAME_WORK_WRITES = {  # name -> (writer threads, O_DIRECT)
    "buffered_1_thread": (1, False),
    "buffered_4_threads": (4, False),
    "o_direct_4_threads": (4, True),
}


class SameWork:
    """The same-work floors of one rank: a reused buffer holding its tensors back to back."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = [t for t in tensors if t.numel()]
        self.offsets: list[int] = []
        pos = 0
        for t in self.tensors:
            self.offsets.append(pos)
            pos += t.numel() * t.element_size()
        self.nbytes = pos
        self.buffer = _aligned(self.nbytes)
        self.digests: list[int] = []
        self._scratch: list[torch.Tensor] = []  # per lane of an O_DIRECT read: one hash block
        self.pool = ThreadPoolExecutor(4)

    def copy(self) -> None:
        """Two threads, glibc memcpy (the fastest copy floor here), into the reused buffer."""
        pairs = [(t, self.buffer[o : o + t.numel() * t.element_size()]) for t, o in zip(self.tensors, self.offsets)]
        half = [p for i, p in enumerate(pairs) if i % 2]
        fut = self.pool.submit(lambda: [_memcpy(s, d) for s, d in half])
        for i, (s, d) in enumerate(pairs):
            if not i % 2:
                _memcpy(s, d)
        fut.result()

    def _ranges(self, threads: int) -> list[tuple[int, int]]:
        """`threads` contiguous ranges of whole hash blocks."""
        blocks = -(-self.nbytes // _HASH_BLOCK)
        per = -(-blocks // threads)
        return [
            (i * per * _HASH_BLOCK, min(self.nbytes, (i + 1) * per * _HASH_BLOCK))
            for i in range(threads)
            if i * per * _HASH_BLOCK < self.nbytes
        ]

    def write(self, directory: str, rank: int, strategy: str) -> None:
        """Copy, hash and durably write; raises OSError(EINVAL) where O_DIRECT is refused."""
        import xxhash

        threads, direct = SAME_WORK_WRITES[strategy]
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank{rank}.bin")
        self.copy()
        view = memoryview(self.buffer.numpy()).cast("B")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC) if direct else -1
        digests: dict[int, int] = {}
        try:

            def lane(lo: int, hi: int) -> None:
                for start in range(lo, hi, _HASH_BLOCK):
                    end = min(hi, start + _HASH_BLOCK)
                    digests[start] = xxhash.xxh3_64_intdigest(view[start:end])
                    whole = (end - start) // _PAGE * _PAGE if direct else 0
                    if whole:
                        os.pwrite(direct_fd, view[start : start + whole], start)
                    if start + whole < end:
                        os.pwrite(fd, view[start + whole : end], start + whole)

            list(self.pool.map(lambda r: lane(*r), self._ranges(threads)))
            os.fsync(fd)
        finally:
            os.close(fd)
            if direct_fd >= 0:
                os.close(direct_fd)
        fsync_dir(directory)
        self.digests = [digests[k] for k in sorted(digests)]

    def read(self, directory: str, rank: int, threads: int, direct: bool = False) -> None:
        """Read the file into the tensors, every block verified against its digest: straight
        into the tensors through the page cache, or (`direct`) with O_DIRECT, one hash block
        at a time into an aligned buffer per thread, checked there and copied out."""
        import xxhash

        path = os.path.join(directory, f"rank{rank}.bin")
        # (tensor view, file offset) pieces of at most _READ_BLOCK, grouped by hash block
        pieces: list[list[tuple[memoryview, int]]] = [[] for _ in range(-(-self.nbytes // _HASH_BLOCK))]
        for t, base in zip(self.tensors, self.offsets):
            v = byte_view(t)
            pos = 0
            while pos < len(v):
                off = base + pos
                n = min(len(v) - pos, _READ_BLOCK, _HASH_BLOCK - off % _HASH_BLOCK)
                pieces[off // _HASH_BLOCK].append((v[pos : pos + n], off))
                pos += n
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        try:

            def lane(lo: int, hi: int) -> None:
                for b in range(lo // _HASH_BLOCK, -(-hi // _HASH_BLOCK)):
                    h = xxhash.xxh3_64()
                    for v, off in pieces[b]:
                        if os.preadv(fd, [v], off) != len(v):
                            raise EOFError(path)
                        h.update(v)
                    if h.intdigest() != self.digests[b]:
                        raise ValueError(f"{path}: block {b} does not match its digest")

            def direct_lane(lo: int, hi: int) -> None:
                view = memoryview(self._scratch[lo // per].numpy()).cast("B")
                for b in range(lo // _HASH_BLOCK, -(-hi // _HASH_BLOCK)):
                    start = b * _HASH_BLOCK
                    n = min(_HASH_BLOCK, self.nbytes - start)
                    if os.preadv(fd, [view[: -(-n // _PAGE) * _PAGE]], start) < n:
                        raise EOFError(path)
                    if xxhash.xxh3_64_intdigest(view[:n]) != self.digests[b]:
                        raise ValueError(f"{path}: block {b} does not match its digest")
                    for v, off in pieces[b]:  # glibc memcpy, the GIL released
                        np.copyto(np.asarray(v), np.asarray(view[off - start : off - start + len(v)]))

            ranges = self._ranges(threads)
            if direct:
                per = ranges[0][1] - ranges[0][0]  # every lane but the last covers `per` bytes
                while len(self._scratch) < len(ranges):
                    self._scratch.append(_aligned(_HASH_BLOCK))
            list(self.pool.map(lambda r: (direct_lane if direct else lane)(*r), ranges))
        finally:
            os.close(fd)

    def close(self) -> None:
        self.pool.shutdown()
        self._scratch.clear()
        del self.buffer
