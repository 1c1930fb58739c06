"""Restores from a disk read large chunks with O_DIRECT: the chunk's pages are not brought
into the page cache, every byte is still checked, and a read that O_DIRECT refuses (an
unaligned buffer, a file's partial last block) is made buffered instead."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt import Checkpointer
from ckpt.store._local import LocalTier
from ckpt.store.fsio import DIRECT_ALIGN, in_ram
from ckpt.store.layout import block_rows
from tests._states import assert_bitwise, blank

MiB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": torch.randn(2600, 1031, generator=g),  # 10.7 MB: more than one read window
            "odd": torch.randn(333, 1027, generator=g).to(torch.bfloat16),  # rows of 2,054 bytes
            "small": torch.randn(100, 7, generator=g),  # under 1 MiB: read through the page cache
        },
        "step": seed,
    }


def _resident_pages(path: Path) -> int:
    """Pages of the file in the page cache (mincore)."""
    return sum(_resident(path))


def _resident(path: Path) -> list[bool]:
    """Whether each page of the file is in the page cache (mincore)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        try:
            assert _libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            _libc.munmap(addr, size)
        return [bool(v & 1) for v in vec]
    finally:
        os.close(fd)


def _chunk_files(root: Path, step: int) -> dict[str, Path]:
    state = root / f"v{step:012d}" / "state"
    return {str(p.relative_to(state)): p for p in state.rglob("c.*")}


def _evict(files: dict[str, Path]) -> None:
    for p in files.values():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.fixture
def disk_root(tmp_path: Path) -> Path:
    if in_ram(str(tmp_path)):
        pytest.skip("the test's temporary directory is in memory here")
    return tmp_path / "root"


def test_large_chunks_are_read_past_the_page_cache(disk_root: Path) -> None:
    with Checkpointer(disk_root) as ck:
        ck.save(1, _state())
        ck.wait()
    files = _chunk_files(disk_root, 1)
    _evict(files)
    assert sum(_resident_pages(p) for p in files.values()) == 0
    got = blank(_state())
    with Checkpointer(disk_root) as ck:
        assert ck.restore(got) == 1
    assert_bitwise(got, _state())
    for name, p in files.items():
        resident = _resident_pages(p)
        if p.stat().st_size >= MiB:  # at most the partial last page, read buffered
            assert resident <= 1, f"{name}: {resident} pages in the page cache"
        else:
            assert resident == -(-p.stat().st_size // mmap.PAGESIZE), name


def test_a_resharded_read_takes_only_its_blocks_and_lands_bitwise(disk_root: Path) -> None:
    want = _state()
    with Checkpointer(disk_root) as ck:
        ck.save(1, want)
        ck.wait()
    files = _chunk_files(disk_root, 1)
    _evict(files)
    rows = (700, 1900)  # starts and ends inside checksummed blocks
    big = want["model"]["big"]
    piece = ckpt.Shard(torch.zeros(rows[1] - rows[0], big.shape[1]), tuple(big.shape), (rows[0], 0))
    got = blank(want)
    got["model"]["big"] = piece
    with Checkpointer(disk_root) as ck:
        assert ck.restore(got) == 1
    assert torch.equal(piece.local_tensor.view(torch.int32), big[rows[0] : rows[1]].view(torch.int32))
    assert_bitwise(got["model"]["odd"], want["model"]["odd"])
    # The two blocks at the edges of the rows, which the ranks that hold the rows beside
    # them read too, came through the page cache (so the disk gives their bytes once to
    # both); the blocks inside them did not.
    (big_file,) = [p for n, p in files.items() if n.startswith("model/big/")]
    rb = big.shape[1] * 4
    k = block_rows(big.shape, 4)
    edges = [(r // k * k, min(big.shape[0], (r // k + 1) * k)) for r in rows]
    assert all(lo < r < hi for r, (lo, hi) in zip(rows, edges))  # (the test's premise)
    cached = {p for lo, hi in edges for p in range(lo * rb // mmap.PAGESIZE, -(-hi * rb // mmap.PAGESIZE))}
    resident = {i for i, r in enumerate(_resident(big_file)) if r}
    assert resident - cached == set(), "a block this rank needs whole came through the page cache"
    assert cached - resident == set(), "an edge block did not come through the page cache"


def test_a_flipped_byte_in_a_large_chunk_is_caught(disk_root: Path) -> None:
    with Checkpointer(disk_root, keep_last=3) as ck:
        for step in (1, 2):
            ck.save(step, _state(step))
        ck.wait()
    (big_file,) = [p for n, p in _chunk_files(disk_root, 2).items() if n.startswith("model/big/")]
    with open(big_file, "r+b") as f:
        f.seek(5 * MiB + 123)
        b = f.read(1)
        f.seek(5 * MiB + 123)
        f.write(bytes([b[0] ^ 0x10]))
        f.flush()
        os.fsync(f.fileno())
    _evict({"big": big_file})
    got = blank(_state())
    with Checkpointer(disk_root, keep_last=3) as ck:
        assert ck.restore(got) == 1  # past the damaged version, to the one before
    assert_bitwise(got, _state(1))


@pytest.mark.parametrize("shift", [0, 64])
def test_read_direct_fills_any_file_end_and_falls_back_where_refused(disk_root: Path, shift: int) -> None:
    """An aligned buffer reads with O_DIRECT; one O_DIRECT refuses (an address off the
    device's alignment: EINVAL) is read buffered. Either way the bytes up to the file's
    end (a partial last block) arrive, and the count says where it ended."""
    disk_root.mkdir()
    data = os.urandom(3 * MiB + 1234)
    (disk_root / "f").write_bytes(data)
    handle = LocalTier(disk_root).open_read("f")
    raw = torch.empty(4 * MiB + 2 * DIRECT_ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % DIRECT_ALIGN + shift
    view = memoryview(raw.numpy()).cast("B")[start : start + 4 * MiB]
    try:
        assert handle.read_direct(MiB, view) == len(data) - MiB
        assert bytes(view[: len(data) - MiB]) == data[MiB:]
        assert handle.read_direct(0, view[:MiB]) == MiB  # again, after a buffered read
        assert bytes(view[:MiB]) == data[:MiB]
        out = bytearray(100)
        handle.read_into(MiB + 7, memoryview(out))  # a plain read of any range still works
        assert bytes(out) == data[MiB + 7 : MiB + 107]
    finally:
        handle.close()


def test_the_read_window_of_the_restoring_thread_is_freed(disk_root: Path) -> None:
    """With one reader the restoring thread reads itself; its 16 MiB window does not outlive
    the restore (reader pool threads free theirs as they end)."""
    from ckpt.restore import execute

    with Checkpointer(disk_root, reader_threads=1) as ck:
        ck.save(1, _state())
        ck.wait()
        got = blank(_state())
        seen: list[bool] = []
        real = execute._read_windows

        def spy(*args: Any) -> None:
            real(*args)
            seen.append(execute._window.buf is not None)

        execute._read_windows = spy  # type: ignore[assignment]
        try:
            assert ck.restore(got) == 1
        finally:
            execute._read_windows = real  # type: ignore[assignment]
    assert seen and all(seen)  # the windows were used, on this thread
    assert execute._window.buf is None
    assert_bitwise(got, _state())
