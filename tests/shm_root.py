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
PREFIXES = ("ckpt-test-", "ckpt-placement-")  # what tests name their directories in /dev/shm
_before: set[str] = set()
_left: list[str] = []


def _ours() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir() if p.name.startswith(PREFIXES)}
    except OSError:
        return set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _before.update(_ours())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _left[:] = sorted(_ours() - _before)
    if _left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _left:
        terminalreporter.section("left in /dev/shm", red=True)
        terminalreporter.line(f"tests left {len(_left)} directories in {SHM}: {', '.join(_left[:5])}")


@pytest.fixture
def shm_root() -> Iterator[Path]:
    if not os.access(SHM, os.W_OK):
        pytest.fail("/dev/shm is not writable on this machine")
    path = SHM / f"ckpt-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)
