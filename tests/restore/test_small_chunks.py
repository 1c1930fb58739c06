"""A small chunk (one checksummed block) whose needed rows land contiguously in the rank's
tensor is read whole with one open, read and close, checked, and its rows put in place
(restore.execute._read_whole): the whole file is checked even where the rank needs some
of its rows, and anything unexpected goes to the full path, which reports it."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
import ckpt.restore.execute as execute
from ckpt import Checkpointer
from tests._states import assert_bitwise

N = 1000  # float32: 4,000 bytes, one chunk file, checksummed whole
CHUNK = Path("state") / "model" / "v" / "c.0"


def _tensor(step: int, shape: tuple[int, ...] = (N,)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(step))


def _save(root: Path, steps: tuple[int, ...], shape: tuple[int, ...] = (N,)) -> None:
    with Checkpointer(root, keep_last=3) as ck:
        for step in steps:
            ck.save(step, {"model": {"v": _tensor(step, shape)}})
        ck.wait()


def _restore(
    root: Path, lo: int, hi: int, step: int | None = None, shape: tuple[int, ...] = (N,), **config: Any
) -> tuple[int | None, torch.Tensor]:
    if (lo, hi) == (0, shape[0]):
        dest = {"v": torch.zeros(shape)}
    else:
        dest = {"v": ckpt.Shard(torch.zeros(hi - lo, *shape[1:]), shape, (lo,) + (0,) * (len(shape) - 1))}
    with Checkpointer(root, keep_last=3, **config) as ck:
        got = ck.restore({"model": dest}, step=step)
    v = dest["v"]
    return got, v if isinstance(v, torch.Tensor) else v.local_tensor


class _Paths:
    """What each read of a restore took: the fast path's verdicts, and the full path's chunks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.whole: list[bool] = []
        self.full: list[int] = []  # the sizes of the chunks the full path read
        real_whole, real_from = execute._read_whole, execute._read_from

        def whole(*args: Any) -> bool:
            self.whole.append(real_whole(*args))
            return self.whole[-1]

        def full(src: Any, array: Any, chunk: Any, *args: Any) -> None:
            self.full.append(chunk.nbytes)
            real_from(src, array, chunk, *args)

        monkeypatch.setattr(execute, "_read_whole", whole)
        monkeypatch.setattr(execute, "_read_from", full)


CASES = {  # shape, rows, verify_on_restore
    "whole": ((N,), (0, N), True),
    "middle": ((N,), (300, 700), True),
    "first": ((N,), (0, 1), True),
    "last": ((N,), (999, N), True),
    "middle-unverified": ((N,), (300, 700), False),
    "2-d-middle": ((40, 30), (10, 25), True),  # rows of 120 bytes
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_small_chunk_is_read_in_one_piece_into_place(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    shape, rows, verify = CASES[case]
    _save(shm_root, (1,), shape)
    paths = _Paths(monkeypatch)
    step, got = _restore(shm_root, *rows, shape=shape, verify_on_restore=verify)
    assert step == 1
    assert_bitwise(got, _tensor(1, shape)[rows[0] : rows[1]])
    assert paths.whole == [True] and paths.full == []


@pytest.mark.parametrize("row", [100, 500, 950], ids=["before", "inside", "after"])
def test_a_flipped_byte_anywhere_in_a_small_chunk_is_damage(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, row: int
) -> None:
    # The rank needs rows [300, 700): a flipped byte outside them fails the file's checksum too.
    _save(shm_root, (1, 2))
    path = shm_root / "v000000000002" / CHUNK
    with open(path, "r+b") as f:
        f.seek(row * 4 + 1)
        b = f.read(1)
        f.seek(row * 4 + 1)
        f.write(bytes([b[0] ^ 0x10]))
        f.flush()
        os.fsync(f.fileno())
    paths = _Paths(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="ckpt"), pytest.raises(ckpt.CorruptVersionError, match="fail"):
        _restore(shm_root, 300, 700, step=2)
    assert paths.whole == [False] and paths.full == [N * 4] * 3  # refused, then read and read again
    # the refusal is logged as a re-read is: a disk that misreads once is not silent
    refused = [r.getMessage() for r in caplog.records if "fails its checksum (xxh3" in r.getMessage()]
    assert len(refused) == 1 and str(CHUNK) in refused[0] and "reading it again" in refused[0], refused
    step, got = _restore(shm_root, 300, 700)
    assert step == 1  # past the damaged version
    assert_bitwise(got, _tensor(1)[300:700])


def test_a_short_small_chunk_is_damage_the_full_path_names(shm_root: Path) -> None:
    _save(shm_root, (1, 2))
    path = shm_root / "v000000000002" / CHUNK
    os.truncate(path, N * 2)
    with pytest.raises(ckpt.CorruptVersionError, match=f"has {N * 2} bytes, the manifest says {N * 4}"):
        _restore(shm_root, 0, N, step=2)
    step, got = _restore(shm_root, 0, N)
    assert step == 1
    assert_bitwise(got, _tensor(1))
