"""The multi-process launcher itself (tests/_dist.py): what it reports of a rank that hangs."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest

from tests._dist import launch

THIS = __file__


def _child_hangs() -> None:
    time.sleep(600)


def _rank_waits_for_its_child(pid_file: str) -> None:
    child = multiprocessing.get_context("fork").Process(target=_child_hangs)
    child.start()
    Path(pid_file).write_text(str(child.pid))
    child.join()


def one_rank_fails_the_other_hangs(ctx: Any, pid_file: str) -> None:
    if ctx.rank == 0:
        raise RuntimeError("rank 0 fails")
    _rank_waits_for_its_child(pid_file)  # as a rank whose DataLoader worker hangs at its start


def test_a_rank_that_hangs_reports_its_stack_and_its_childs(tmp_path: Path) -> None:
    """Rank 0 fails; rank 1 waits for a forked child that hangs. The launcher stops rank 1
    and the child, and the failure shows where each of them was."""
    pid_file = tmp_path / "child.pid"
    with pytest.raises(AssertionError) as failed:
        launch(THIS, "one_rank_fails_the_other_hangs", 2, tmp_path, pid_file=str(pid_file))
    report = str(failed.value)
    assert "rank 0 fails" in report
    assert "in _rank_waits_for_its_child" in report  # rank 1's main thread
    assert "in _child_hangs" in report  # its child's
    assert not _running(int(pid_file.read_text()))  # before, the child ran on, orphaned


def _running(pid: int) -> bool:
    """Whether `pid` runs, within a few seconds (a killed orphan is a zombie until init reaps it)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return False
        except FileNotFoundError:
            return False
        time.sleep(0.1)
    return True
