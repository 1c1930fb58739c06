"""Named fault points for crash tests: a real SIGKILL at a chosen step of the protocol.

Inert unless CKPT_FAULT names the point (and CKPT_FAULT_RANK, if set, names this rank).
Tests set them in a child process's environment; production never does.
"""

from __future__ import annotations

import os
import signal

__all__ = ["fault_point", "fault_delay"]


def fault_point(name: str, rank: int = 0) -> None:
    if os.environ.get("CKPT_FAULT") != name:
        return
    want = os.environ.get("CKPT_FAULT_RANK")
    if want is None or int(want) == rank:
        os.kill(os.getpid(), signal.SIGKILL)


def fault_delay(name: str, rank: int = 0) -> None:
    """Sleep where CKPT_DELAY="<name>:<rank>:<seconds>" says: a slow disk or rank, for straggler tests."""
    spec = os.environ.get("CKPT_DELAY")
    if not spec:
        return
    point, want, seconds = spec.split(":")
    if point == name and int(want) == rank:
        import time

        time.sleep(float(seconds))
