"""fsync_files / fsync_dirs run on the process's fsync threads, started once: a pool per
call started its threads at every fsync of every commit, and with another thread holding
the GIL (a training loop) starting them took tens of milliseconds each time."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path

import pytest

from ckpt.store import fsio


def _files(tmp_path: Path, n: int) -> list[str]:
    out = []
    for i in range(n):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x" * 10)
        out.append(str(p))
    return out


def test_fsyncs_reuse_the_same_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[threading.Thread]] = [[], []]
    call = [0]
    real = fsio._fsync_file

    def spy(path: str) -> None:
        seen[call[0]].append(threading.current_thread())
        real(path)

    monkeypatch.setattr(fsio, "_fsync_file", spy)
    paths = _files(tmp_path, 64)
    for _ in range(20):  # the pool starts its threads as lanes find none idle, up to its size
        fsio.fsync_files(paths)
        before = [t for t in threading.enumerate() if t.name.startswith("ckpt-fsync")]  # kept: no id is reused
        if len(before) >= fsio._FSYNC_THREADS:
            break
    seen[0].clear()
    fsio.fsync_files(paths)
    call[0] = 1
    fsio.fsync_files(paths)
    assert len(seen[0]) == len(seen[1]) == 64
    assert threading.main_thread() not in seen[1]
    assert {id(t) for t in seen[1]} <= {id(t) for t in before}, "the second call started threads of its own"


def _child(paths: list[str], out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    fsio.fsync_files(paths)
    fsio.fsync_dirs([os.path.dirname(paths[0])])
    out.put("done")


def test_a_forked_child_fsyncs_on_threads_of_its_own(tmp_path: Path) -> None:
    paths = _files(tmp_path, 8)
    fsio.fsync_files(paths)  # the parent's threads exist before the fork
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child, args=(paths, out))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child's fsync hung on the parent's threads")
    assert child.exitcode == 0
    assert out.get(timeout=5) == "done"
