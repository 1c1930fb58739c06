"""The `shm_root` fixture: a fresh directory on this machine's real tmpfs (/dev/shm),
removed afterwards, for tests of roots in memory; and a check at the end of the session
that no test left a directory of its own in /dev/shm (memory the machine does not get back)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM = Path("/dev/shm")
# What this session's tests name their entries in /dev/shm: with the pid, so that another
# session on the machine (its tests' entries) is never taken for a leak of this one.
PREFIXES = (f"ckpt-test-{os.getpid()}-", f"ckpt-placement-{os.getpid()}-")
_before: set[str] = set()
_left: list[str] = []


def _ours() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir() if p.name.startswith(PREFIXES)}
    except OSError:
        return set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _before.update(_ours())


@pytest.hookimpl(trylast=True)  # after the runner's, which tears down the fixtures still set up
def pytest_sessionfinish(session: pytest.Session) -> None:
    _left[:] = sorted(_ours() - _before)
    if _left and session.exitstatus == pytest.ExitCode.OK:  # (an interrupted run keeps its own status)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _left:
        terminalreporter.section("left in /dev/shm", red=True)
        shown = ", ".join(_left[:5]) + (", ..." if len(_left) > 5 else "")
        terminalreporter.line(f"tests left {len(_left)} entries in {SHM}: {shown}")


@pytest.fixture
def shm_root() -> Iterator[Path]:
    if not os.access(SHM, os.W_OK):
        pytest.fail("/dev/shm is not writable on this machine")
    path = SHM / f"{PREFIXES[0]}{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)
