"""store._local.open_beneath: one openat2 call on kernels that have it, a walk of O_NOFOLLOW
openat calls elsewhere; both refuse the same paths, from the top's path or from its open
directory (a read pass's). LocalTier.reading keeps that directory open for the pass."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt.store import _local
from ckpt.store._local import LocalTier, open_beneath
from ckpt.store.errors import CorruptVersionError


@pytest.fixture(params=["openat2", "walk"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "walk":
        monkeypatch.setattr(_local, "_openat2_works", [False])
    else:
        assert _local._openat2_works[0], "this kernel has no openat2 (Linux 5.6+)"
    return str(request.param)


@pytest.fixture(params=["path", "held"])
def top_fd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[int | None]:
    if request.param == "path":
        yield None
        return
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.fstat(fd)  # still open: open_beneath never closes the caller's directory
    os.close(fd)


def test_only_regular_files_beneath_the_top_open(tmp_path: Path, mode: str, top_fd: int | None) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"data")
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "a" / "b" / "f", tmp_path / "a" / "link")
    os.symlink(tmp_path / "a", tmp_path / "dirlink")
    os.symlink("../../outside", tmp_path / "a" / "b" / "up")
    os.mkfifo(tmp_path / "a" / "fifo")
    fd, size = open_beneath(str(tmp_path), "a/b/f", top_fd)
    try:
        assert (os.read(fd, 10), size) == (b"data", 4)
    finally:
        os.close(fd)
    for rel in ("a/link", "dirlink/b/f", "a/b/up", "a/fifo", "a/b/f/x", "a/../outside", "/etc/passwd", "a//b/f"):
        with pytest.raises(CorruptVersionError):
            open_beneath(str(tmp_path), rel, top_fd)
    with pytest.raises(FileNotFoundError):
        open_beneath(str(tmp_path), "a/b/missing", top_fd)


def test_a_read_pass_opens_the_directory_once(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [f"v1/d{i}/c.0" for i in range(6)]
    for i, k in enumerate(keys):
        (tmp_path / k).parent.mkdir(parents=True)
        (tmp_path / k).write_bytes(bytes([i]) * (i + 1))
    tier = LocalTier(tmp_path)
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: Any, *args: Any, **kwargs: Any) -> int:
        if path == str(tmp_path):
            opened.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(_local.os, "open", counting_open)
    for i, k in enumerate(keys):  # outside a pass: each open opens the tier's directory too
        assert tier.get(k) == bytes([i]) * (i + 1)
    assert len(opened) == len(keys)
    opened.clear()
    with tier.reading(keys):
        for i, k in enumerate(keys):
            assert tier.get(k) == bytes([i]) * (i + 1)
            h = tier.open_read(k)
            assert h.size == i + 1
            h.close()
        with pytest.raises(FileNotFoundError):
            tier.open_read("v1/missing")
        with pytest.raises(CorruptVersionError):
            tier.open_read("v1/../x")
        fd = tier._dir.acquire()
        assert fd is not None
        tier._dir.release()
    assert len(opened) == 1, opened  # once, for the whole pass
    assert tier._dir.acquire() is None  # and closed after it
    assert not _is_dir_of(fd, tmp_path)
    opened.clear()
    tier.get(keys[0])
    assert len(opened) == 1


def _is_dir_of(fd: int, path: Path) -> bool:
    """Whether `fd` is open on `path` (a closed number may be reused meanwhile, for another file)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == str(path)
    except OSError:
        return False


def test_a_read_pass_over_a_missing_tier_raises_nothing_itself(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "absent")
    with tier.reading(["v1/c"]):
        with pytest.raises(FileNotFoundError):
            tier.open_read("v1/c")


def test_the_held_directory_outlives_the_pass_while_an_open_uses_it(tmp_path: Path) -> None:
    held = _local._HeldDir(str(tmp_path))
    assert held.acquire() is None  # outside a pass: the caller opens the path itself
    with held.held():
        with held.held():  # a second pass shares the descriptor
            fd = held.acquire()
            assert fd is not None
    assert _is_dir_of(fd, tmp_path)  # both passes ended; an open still uses it: not closed
    held.release()
    assert not _is_dir_of(fd, tmp_path)
    assert held.acquire() is None
