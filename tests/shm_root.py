"""The `shm_root` fixture: a fresh directory on this machine's real tmpfs (/dev/shm),
removed afterwards, for tests of roots in memory."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shm_root() -> Iterator[Path]:
    if not os.access("/dev/shm", os.W_OK):
        pytest.fail("/dev/shm is not writable on this machine")
    path = Path("/dev/shm") / f"ckpt-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)
