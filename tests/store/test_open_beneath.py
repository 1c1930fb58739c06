"""store._local.open_beneath: one openat2 call on kernels that have it, a walk of O_NOFOLLOW
openat calls elsewhere; both refuse the same paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt.store import _local
from ckpt.store._local import open_beneath
from ckpt.store.errors import CorruptVersionError


@pytest.fixture(params=["openat2", "walk"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "walk":
        monkeypatch.setattr(_local, "_openat2_works", [False])
    else:
        assert _local._openat2_works[0], "this kernel has no openat2 (Linux 5.6+)"
    return str(request.param)


def test_only_regular_files_beneath_the_top_open(tmp_path: Path, mode: str) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"data")
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "a" / "b" / "f", tmp_path / "a" / "link")
    os.symlink(tmp_path / "a", tmp_path / "dirlink")
    os.symlink("../../outside", tmp_path / "a" / "b" / "up")
    os.mkfifo(tmp_path / "a" / "fifo")
    fd = open_beneath(str(tmp_path), "a/b/f")
    try:
        assert os.read(fd, 10) == b"data"
    finally:
        os.close(fd)
    for rel in ("a/link", "dirlink/b/f", "a/b/up", "a/fifo", "a/b/f/x", "a/../outside", "/etc/passwd", "a//b/f"):
        with pytest.raises(CorruptVersionError):
            open_beneath(str(tmp_path), rel)
    with pytest.raises(FileNotFoundError):
        open_beneath(str(tmp_path), "a/b/missing")
