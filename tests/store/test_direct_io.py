"""Chunk files written with O_DIRECT from the page-aligned staging buffer: the same bytes
and digests as buffered writes, the fallback where the buffer or the filesystem does not
allow it (a ramfs, mounted for real in a private mount namespace), and whole saves that
restore bitwise either way."""

from __future__ import annotations

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
from ckpt.store.digest import chunk_digest
from ckpt.store.fsio import DIRECT_ALIGN, DIRECT_MIN_BYTES, write_chunk
from tests._states import assert_bitwise

REPO = Path(__file__).resolve().parents[2]


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
    assert_bitwise(got, state)
    large = [t.numel() * t.element_size() for t in state.values() if t.numel() * t.element_size() >= DIRECT_MIN_BYTES]
    expected = sum(n - n % DIRECT_ALIGN for n in large) if direct_io and accepts_o_direct(tmp_path) else 0
    assert stats.direct_bytes == expected and stats.bytes_written == sum(
        t.numel() * t.element_size() for t in state.values() if t.dim()
    )
    verify = CliRunner().invoke(cli, ["verify", str(root)])
    assert verify.exit_code == 0 and "ok" in verify.output, verify.output


def _can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


_ON_RAMFS = """
import json, sys
from ckpt import Checkpointer
from tests._states import bitwise_diff
from tests.store.test_direct_io import _blank, _state
state = _state()
with Checkpointer(sys.argv[1]) as ck:
    ck.save(1, state)
    ck.wait()
    got = _blank()
    step = ck.restore(got)
print(json.dumps({"direct_bytes": ck.stats()[-1].direct_bytes, "step": step,
                  "equal": not bitwise_diff(got, state)}))
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


def _can_loop_mount() -> bool:
    needs = ("losetup", "mkfs.ext4")
    return _can_mount() and all(shutil.which(t) for t in needs) and os.path.exists("/dev/loop-control")


_ON_4K_SECTORS = """
import json, sys
from ckpt.store.digest import chunk_digest
import ckpt.store.fsio as fsio
from tests.store.test_direct_io import aligned_bytes
fsio.DIRECT_ALIGN = 512  # finer than the device's 4096-byte sectors: it refuses the last direct write
fsio._DIRECT_WRITE = 1 << 20  # 1 MiB direct writes: three go through before the refused one
n = 3 * (1 << 20) + 512 + 123
view = memoryview(aligned_bytes(n, seed=5))[:n]
written = fsio.write_chunk(sys.argv[1], view, block_bytes=1 << 20, fsync=True, direct=True)
with open(sys.argv[1], "rb") as f:
    same = f.read() == view.tobytes()
print(json.dumps({"direct_bytes": written.direct_bytes, "same": same, "digest": written.xxh3 == chunk_digest(view, 1 << 20)}))
"""


@pytest.mark.skipif(not _can_loop_mount(), reason="needs root, unshare -m, losetup and mkfs.ext4 for a 4K-sector disk")
def test_a_device_refusing_the_alignment_gets_the_rest_buffered(tmp_path: Path) -> None:
    """A disk with 4096-byte sectors (a loop device, for real) refuses an O_DIRECT write
    aligned to 512 bytes only (EINVAL): the chunk is still written whole and right, the
    rest of it through the page cache."""
    image, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    mnt.mkdir()
    probe = tmp_path / "probe.py"
    probe.write_text(_ON_4K_SECTORS)
    shell = (
        f"dev=$(losetup -f --show -b 4096 {image}) && mkfs.ext4 -q $dev && mount $dev {mnt} && "
        f"(cd {REPO} && PYTHONPATH={REPO} {sys.executable} {probe} {mnt}/chunk); rc=$?; "
        f"umount {mnt}; losetup -d $dev; exit $rc"
    )
    out = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"direct_bytes": 3 << 20, "same": True, "digest": True}  # 3 MiB direct, the rest buffered


def _mount_type(path: str) -> str:
    """The filesystem type /proc/self/mounts gives for the mount holding `path`."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            _, point, fstype, *_ = line.split()
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fstype
    return kind


def test_in_ram_tells_tmpfs_from_a_disk(tmp_path: Path) -> None:
    from ckpt.store.fsio import in_ram

    if _mount_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    assert in_ram("/dev/shm")
    assert in_ram(str(tmp_path)) == (_mount_type(str(tmp_path)) in ("tmpfs", "ramfs"))
    assert not in_ram(str(tmp_path / "missing"))  # cannot tell: not in RAM
