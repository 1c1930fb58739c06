"""A rank whose rows start or end inside a checksummed block of a saved chunk (a reshard)
reads that block's rows it takes straight into its tensor and only the others into the
bounce buffer, and still checks the whole block: a flipped byte on either side of its
boundary is damage, and the restore falls back to the version before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
import ckpt.restore.execute as execute
from ckpt import Checkpointer
from tests._damage import flip_byte
from tests._states import assert_bitwise

ROWS, COLS = 2600, 1031  # rows of 4,124 bytes: 254 rows to a ~1 MiB block
LO, HI = 300, 1900  # both inside a block (blocks 1 and 7)


def _tensor(step: int, shape: tuple[int, ...] = (ROWS, COLS)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(step))


def _save(root: Path, steps: tuple[int, ...], shape: tuple[int, ...] = (ROWS, COLS), **config: Any) -> None:
    with Checkpointer(root, keep_last=3, **config) as ck:
        for step in steps:
            ck.save(step, {"model": {"big": _tensor(step, shape)}})
        ck.wait()


def _restore(root: Path, lo: int, hi: int, shape: tuple[int, ...] = (ROWS, COLS)) -> tuple[int, torch.Tensor]:
    piece = ckpt.Shard(torch.zeros(hi - lo, *shape[1:]), shape, (lo,) + (0,) * (len(shape) - 1))
    with Checkpointer(root, keep_last=3) as ck:
        step = ck.restore({"model": {"big": piece}})
    return step, piece.local_tensor


CASES = {
    "edges-in-two-blocks": ((ROWS, COLS), LO, HI, {}),
    "both-edges-in-one-block": ((ROWS, COLS), 300, 400, {}),
    "chunk-of-one-block": ((100_000,), 10_000, 20_000, {}),  # 400 KB: checksummed whole
    "edges-on-block-boundaries": ((ROWS, COLS), 254, 7 * 254, {}),  # blocks 1-6 whole, in one loop
}


@pytest.mark.parametrize("case", list(CASES))
def test_rows_inside_a_boundary_block_go_straight_into_place(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    shape, lo, hi, config = CASES[case]
    _save(shm_root, (1,), shape, **config)
    placed: list[Any] = []
    real = execute._place
    monkeypatch.setattr(execute, "_place", lambda *a: (placed.append(a), real(*a)))
    step, got = _restore(shm_root, lo, hi, shape)
    assert step == 1
    assert_bitwise(got, _tensor(1, shape)[lo:hi])
    assert placed == []  # no copy out of the bounce buffer


@pytest.mark.parametrize("row", [260, 400, 1850, 1950], ids=["before-lo", "after-lo", "before-hi", "after-hi"])
def test_a_flipped_byte_in_a_boundary_block_is_caught_on_either_side(shm_root: Path, row: int) -> None:
    _save(shm_root, (1, 2))
    (chunk,) = (shm_root / "v000000000002" / "state" / "model" / "big").glob("c.*")
    flip_byte(chunk, row * COLS * 4 + 5, 0x20)
    step, got = _restore(shm_root, LO, HI)
    assert step == 1  # past the damaged version
    assert_bitwise(got, _tensor(1)[LO:HI])
