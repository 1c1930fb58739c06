"""How many threads a restore reads with: `reader_threads` from a disk, at most the rank's
cores from a root in memory (tmpfs), where each read is a copy and more readers only
contend for the cores and the GIL."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt._load as ckpt_load
import ckpt.restore.execute as execute
from ckpt import Checkpointer
from ckpt._cores import rank_cores
from ckpt.store.fsio import in_ram
from ckpt.store.lanes import LIGHT_BYTES
from tests._rendezvous import Rendezvous
from tests._states import assert_bitwise, blank

READERS = 8


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"model": {f"w{i}": torch.randn(64 + i, 32, generator=g) for i in range(12)}}


def _readers_of_a_restore(root: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread counts the restore's chunk reads ran with; the restore checked bitwise."""
    seen: list[int] = []
    real = execute.run_lanes

    def spy(items: Any, fn: Callable[[Any], Any], threads: int, **kw: Any) -> Any:
        if kw.get("name") == "ckpt-read":
            seen.append(threads)
        return real(items, fn, threads, **kw)

    with Checkpointer(root, reader_threads=READERS) as ck:
        ck.save(1, _state())
        ck.wait()
        got = blank(_state())
        monkeypatch.setattr(execute, "run_lanes", spy)
        assert ck.restore(got) == 1
    assert_bitwise(got, _state())
    return seen


def test_a_root_in_memory_is_read_with_at_most_the_ranks_cores(shm_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert in_ram("/dev/shm")
    assert _readers_of_a_restore(shm_root, monkeypatch) == [min(READERS, rank_cores())]


def test_a_root_on_disk_is_read_with_reader_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if in_ram(str(tmp_path)):
        pytest.skip("the test's temporary directory is in memory here")
    assert _readers_of_a_restore(tmp_path / "root", monkeypatch) == [READERS]


def test_a_ranks_cores_are_its_share_of_an_unpinned_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = len(os.sched_getaffinity(0))
    if machine != os.cpu_count():
        pytest.skip("this process is pinned to some cores")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert rank_cores() == machine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(machine * 2))
    assert rank_cores() == 1


def _chunk_readers(root: Path, monkeypatch: pytest.MonkeyPatch, meet: Rendezvous) -> tuple[set[int], set[int]]:
    """The threads that read the small chunks and the large ones of a restore (two readers),
    the reads arriving at `meet` as "small" or "large"."""
    g = torch.Generator().manual_seed(9)
    state = {
        "big": {f"b{i}": torch.randn(1 << 18, generator=g) for i in range(6)},  # 1 MiB chunks
        "small": {f"s{i}": torch.randn(64, generator=g) for i in range(200)},
    }
    small: set[int] = set()
    large: set[int] = set()
    real, real_whole = execute._read_from, execute._read_whole

    def arrive(chunk: Any) -> None:
        light = chunk.nbytes < LIGHT_BYTES
        (small if light else large).add(threading.get_ident())
        meet.arrive("small" if light else "large")

    def spy(src: Any, array: Any, chunk: Any, *args: Any) -> None:
        arrive(chunk)
        real(src, array, chunk, *args)

    def spy_whole(src: Any, manifest: Any, array: Any, chunk: Any, *args: Any) -> bool:
        arrive(chunk)  # (one it refuses arrives again in _read_from, after its first arrival)
        return real_whole(src, manifest, array, chunk, *args)

    with Checkpointer(root, reader_threads=2) as ck:
        ck.save(1, state)
        ck.wait()
        got = blank(state)
        monkeypatch.setattr(execute, "_read_from", spy)
        monkeypatch.setattr(execute, "_read_whole", spy_whole)
        monkeypatch.setattr(ckpt_load, "rank_cores", lambda: 2)  # two readers on any machine
        assert ck.restore(got) == 1
    assert_bitwise(got, state)
    return small, large


def test_small_chunks_in_memory_are_read_by_one_reader(shm_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the first small read waits for a large one on another thread: the readers run at once
    small, large = _chunk_readers(shm_root, monkeypatch, Rendezvous(["small", "large"]))
    assert len(small) == 1  # other readers would only queue for the GIL at each system call
    assert len(large | small) == 2  # while the second reader takes the large chunks


def test_small_chunks_on_disk_are_read_by_every_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if in_ram(str(tmp_path)):
        pytest.skip("the test's temporary directory is in memory here")
    small, _ = _chunk_readers(tmp_path / "root", monkeypatch, Rendezvous(["small", "small"]))
    assert len(small) == 2  # a disk read waits on the device: readers overlap those waits
