"""A chunk's checksummed blocks are read several to a read where they can be (from a disk,
a 16 MiB O_DIRECT window; from memory, up to 1 MiB) and land together: every one of them is
still checked, whichever place it has in its read, on both media and for a rank that takes
only some of the chunk's rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import Checkpointer
from ckpt.store.fsio import in_ram
from ckpt.store.layout import block_rows
from tests._damage import flip_byte
from tests._states import assert_bitwise

ROWS, COLS = 3000, 1000  # 12 MB: one chunk of 12 blocks, in one window from a disk
K = block_rows((ROWS, COLS), 4)
BLOCKS = -(-ROWS // K)


def _tensor(step: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(step))


@pytest.fixture(params=["memory", "disk"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "memory":
        return Path(request.getfixturevalue("shm_root")) / "root"  # the fixture removes the parent
    if in_ram(str(tmp_path)):
        pytest.fail("the test's temporary directory is in memory here: no disk to read from")
    return tmp_path / "root"


def _damage(root: Path, block: int) -> None:
    """Flip a byte in the middle of `block` of step 2's chunk, out of the page cache after."""
    (chunk,) = (root / "v000000000002" / "state" / "big").glob("c.*")
    flip_byte(chunk, (block * K + min(K, ROWS - block * K) // 2) * COLS * 4 + 3, 0x04, evict=True)


def _save(root: Path) -> None:
    with Checkpointer(root, keep_last=3) as ck:
        for step in (1, 2):
            ck.save(step, {"big": _tensor(step)})
        ck.wait()


@pytest.mark.parametrize("block", [0, 1, 5, BLOCKS - 2, BLOCKS - 1])
def test_every_block_of_a_batched_read_is_checked(root: Path, block: int) -> None:
    assert BLOCKS == 12 and ROWS * COLS * 4 <= 16 << 20  # (the test's premise: several blocks to a window)
    _save(root)
    _damage(root, block)
    got = {"big": torch.zeros(ROWS, COLS)}
    with Checkpointer(root, keep_last=3) as ck:
        assert ck.restore(got) == 1  # past the damaged version
    assert_bitwise(got["big"], _tensor(1))


@pytest.mark.parametrize("block", [2, 3, 7])
def test_a_rank_taking_some_rows_checks_every_block_it_reads(root: Path, block: int) -> None:
    lo, hi = 2 * K + 5, 8 * K - 7  # blocks 2-7; 2 and 7 only in part
    _save(root)
    _damage(root, block)
    piece = ckpt.Shard(torch.zeros(hi - lo, COLS), (ROWS, COLS), (lo, 0))
    with Checkpointer(root, keep_last=3) as ck:
        assert ck.restore({"big": piece}) == 1
    assert_bitwise(piece.local_tensor, _tensor(1)[lo:hi])
    # and undamaged, the same rows of step 2 land bitwise
    _save(root.parent / "clean")
    piece = ckpt.Shard(torch.zeros(hi - lo, COLS), (ROWS, COLS), (lo, 0))
    with Checkpointer(root.parent / "clean", keep_last=3) as ck:
        assert ck.restore({"big": piece}) == 2
    assert_bitwise(piece.local_tensor, _tensor(2)[lo:hi])
