"""Chunk files written with O_DIRECT from the page-aligned staging buffer: the same bytes
and digests as buffered writes, the fallback where the buffer or the filesystem does not
allow it (a ramfs, mounted for real in a private mount namespace), and whole saves that
restore bitwise either way."""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from ckpt import Checkpointer
from ckpt.cli import main as cli
from store.digest import chunk_digest
from store.fsio import DIRECT_ALIGN, DIRECT_MIN_BYTES, write_chunk

REPO = Path(__file__).resolve().parent.parent


def accepts_o_direct(directory: Path) -> bool:
    probe = directory / ".o_direct_probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def aligned_bytes(n: int, seed: int) -> np.ndarray:
    """n random bytes in an anonymous mapping: page-aligned, as the staging arena is."""
    buf = np.frombuffer(mmap.mmap(-1, n + DIRECT_ALIGN), dtype=np.uint8)
    buf[:n] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return buf


@pytest.mark.parametrize(
    ("nbytes", "block_bytes"),
    [
        (3 * (1 << 20) + 123, 0),  # one block; a tail that is not whole 4 KiB blocks
        (3 * (1 << 20) + 123, 1_000_000),  # blocks that end off the 4 KiB grid
        (8 << 20, 4 << 20),  # whole aligned blocks, no tail
        (DIRECT_MIN_BYTES - 1, 0),  # too small for O_DIRECT
    ],
)
def test_direct_writes_the_same_bytes_and_digests(tmp_path: Path, nbytes: int, block_bytes: int) -> None:
    data = aligned_bytes(nbytes, seed=nbytes)
    view = memoryview(data)[:nbytes]
    want = chunk_digest(view, block_bytes)
    direct_ok = accepts_o_direct(tmp_path)
    for direct in (True, False):
        path = tmp_path / f"chunk-{direct}"
        written = write_chunk(str(path), view, block_bytes=block_bytes, direct=direct)
        assert path.read_bytes() == view.tobytes()
        assert written.xxh3 == want
        big = direct and direct_ok and nbytes >= DIRECT_MIN_BYTES
        assert written.direct_bytes == (nbytes - nbytes % DIRECT_ALIGN if big else 0)
        assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_unaligned_or_read_only_buffers_are_written_through_the_page_cache(tmp_path: Path) -> None:
    data = aligned_bytes(2 << 20, seed=1)
    off_grid = memoryview(data)[64 : 64 + (1 << 20) + 4096]  # starts 64 bytes past a page boundary
    written = write_chunk(str(tmp_path / "a"), off_grid, direct=True)
    assert written.direct_bytes == 0 and (tmp_path / "a").read_bytes() == off_grid.tobytes()
    read_only = memoryview(data.tobytes())  # bytes: no writable buffer to take the address of
    written = write_chunk(str(tmp_path / "b"), read_only, direct=True)
    assert written.direct_bytes == 0 and (tmp_path / "b").read_bytes() == data.tobytes()


def test_a_device_refusing_the_alignment_gets_the_rest_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that needs more than 4 KiB alignment answers EINVAL to O_DIRECT writes (the
    fault is injected at os.write after 2 MiB have gone direct): the chunk is still written
    whole and right, through the page cache from there on."""
    if not accepts_o_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT outright (the ramfs test covers that)")
    nbytes = 3 * (1 << 20) + 4096 + 123
    data = aligned_bytes(nbytes, seed=5)
    view = memoryview(data)[:nbytes]
    write = os.write
    direct_writes = []

    def refuse_after_2_mib(fd: int, buf: bytes) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            if sum(direct_writes) >= 2 << 20:
                raise OSError(errno.EINVAL, "Invalid argument")
            direct_writes.append(len(buf))
        return write(fd, buf)

    monkeypatch.setattr("store.fsio._DIRECT_WRITE", 1 << 20)  # several direct writes per chunk
    monkeypatch.setattr("store.fsio.os.write", refuse_after_2_mib)
    written = write_chunk(str(tmp_path / "c"), view, block_bytes=1 << 20, fsync=True, direct=True)
    monkeypatch.undo()
    assert (tmp_path / "c").read_bytes() == view.tobytes()
    assert written.xxh3 == chunk_digest(view, 1 << 20)
    assert written.direct_bytes == 2 << 20 == sum(direct_writes)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    # 12 MB and 5.2 MB chunks (O_DIRECT), and small ones (page cache)
    return {
        "big": torch.randn(3000, 1000, generator=g),
        "odd": torch.randn(1301, 1001, generator=g),
        "bias": torch.randn(1000, generator=g),
        "step": torch.tensor(7),
    }


def _blank() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _state().items()}


@pytest.mark.parametrize("direct_io", [True, False])
def test_saves_restore_bitwise_with_and_without_o_direct(tmp_path: Path, direct_io: bool) -> None:
    state = _state()
    root = tmp_path / "root"
    with Checkpointer(root, direct_io=direct_io) as ck:
        ck.save(1, state)
        ck.wait()
        stats = ck.stats()[-1]
        got = _blank()
        assert ck.restore(got) == 1
    for name, want in state.items():
        assert torch.equal(got[name], want), name
    large = [t.numel() * t.element_size() for t in state.values() if t.numel() * t.element_size() >= DIRECT_MIN_BYTES]
    expected = sum(n - n % DIRECT_ALIGN for n in large) if direct_io and accepts_o_direct(tmp_path) else 0
    assert stats.direct_bytes == expected and stats.bytes_written == sum(t.numel() * t.element_size() for t in state.values() if t.dim())
    verify = CliRunner().invoke(cli, ["verify", str(root)])
    assert verify.exit_code == 0 and "ok" in verify.output, verify.output


def _can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


_ON_RAMFS = """
import json, sys, torch
from ckpt import Checkpointer
from tests.test_direct_io import _blank, _state
state = _state()
with Checkpointer(sys.argv[1]) as ck:
    ck.save(1, state)
    ck.wait()
    got = _blank()
    step = ck.restore(got)
print(json.dumps({"direct_bytes": ck.stats()[-1].direct_bytes, "step": step,
                  "equal": all(torch.equal(got[k], v) for k, v in state.items())}))
"""


@pytest.mark.skipif(not _can_mount(), reason="needs root and unshare -m to mount a ramfs")
def test_a_filesystem_that_refuses_o_direct_gets_buffered_writes(tmp_path: Path) -> None:
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    shell = f"mount -t ramfs ramfs {mnt} && cd {REPO} && {sys.executable} -c '{_ON_RAMFS}' {mnt}/root"
    out = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"direct_bytes": 0, "step": 1, "equal": True}
