"""Where the root is in memory (tmpfs), one writer lane writes the small files of a save
(small chunks and zarr.json documents) while the others write the large chunks: there a
small write is a short copy between system calls, and writers competing for the GIL at
each cost more than they save. On a disk, and while the copy still runs (overlap_writes),
every lane takes any file."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt._write as write
from ckpt import Checkpointer
from ckpt.store.fsio import in_ram
from ckpt.store.lanes import LIGHT_BYTES
from tests._rendezvous import Rendezvous
from tests._states import assert_bitwise, blank


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": {f"b{i}": torch.randn(1 << 18, generator=g) for i in range(8)},  # 1 MiB chunks
        "small": {f"s{i}": torch.randn(64, generator=g) for i in range(150)},
    }


def _writers(root: Path, monkeypatch: pytest.MonkeyPatch, meet: Rendezvous, **config: Any) -> tuple[set[int], set[int]]:
    """The threads that wrote the small files and the large chunks of a save (4 writers),
    the writes arriving at `meet` as "small" or "large"."""
    small: set[int] = set()
    large: set[int] = set()
    real_chunk, real_new = write.write_chunk, write.write_new

    def chunk_spy(path: str, view: Any, **kw: Any) -> Any:
        light = len(view) < LIGHT_BYTES
        (small if light else large).add(threading.get_ident())
        meet.arrive("small" if light else "large")
        return real_chunk(path, view, **kw)

    def new_spy(path: str, data: bytes, **kw: Any) -> Any:
        small.add(threading.get_ident())
        meet.arrive("small")
        return real_new(path, data, **kw)

    monkeypatch.setattr(write, "write_chunk", chunk_spy)
    monkeypatch.setattr(write, "write_new", new_spy)
    with Checkpointer(root, writer_threads=4, **config) as ck:
        ck.save(1, _state())
        ck.wait()
        got = blank(_state())
        assert ck.restore(got) == 1
    assert_bitwise(got, _state())
    return small, large


def test_in_memory_one_writer_takes_the_small_files(shm_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the first small write waits for two large ones on two other threads
    small, large = _writers(shm_root, monkeypatch, Rendezvous(["small", "large", "large"]), overlap_writes=False)
    assert len(small) == 1
    assert len(large - small) >= 2  # the other writers took the large chunks meanwhile


def test_on_a_disk_every_writer_takes_small_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if in_ram(str(tmp_path)):
        pytest.skip("the test's temporary directory is in memory here")
    small, _ = _writers(tmp_path / "root", monkeypatch, Rendezvous(["small", "small"]), overlap_writes=False)
    assert len(small) >= 2


def test_while_the_copy_runs_every_writer_takes_small_files(shm_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_DELAY", "stage:0:0.002")  # a slow copy: the writers wait for chunks
    small, _ = _writers(shm_root, monkeypatch, Rendezvous(["small", "small"]), overlap_writes=True)
    assert len(small) >= 2
