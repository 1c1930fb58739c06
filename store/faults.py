"""Named fault points for crash tests: a real SIGKILL at a chosen step of the protocol.

Inert unless CKPT_FAULT names the point (and CKPT_FAULT_RANK, if set, names this rank).
Tests set them in a child process's environment; production never does. Delay points
(fault_delay) also take CKPT_DELAY (sleep there) and CKPT_INTERRUPT (a real SIGINT, i.e.
Ctrl-C, at the n-th pass: an interruption at an exact place of save()).
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["fault_point", "fault_delay"]


def fault_point(name: str, rank: int = 0) -> None:
    if os.environ.get("CKPT_FAULT") != name:
        return
    want = os.environ.get("CKPT_FAULT_RANK")
    if want is None or int(want) == rank:
        os.kill(os.getpid(), signal.SIGKILL)


_passes: dict[str, str] = {"spec": ""}
_count = [0]
_passes_lock = threading.Lock()


def _interrupt(name: str, rank: int) -> None:
    """SIGINT this process at the n-th pass where CKPT_INTERRUPT="<name>:<rank>:<n>" says
    (counted from when the variable took this value)."""
    spec = os.environ.get("CKPT_INTERRUPT", "")
    with _passes_lock:
        if spec != _passes["spec"]:
            _passes["spec"], _count[0] = spec, 0
        if not spec:
            return
        point, want, nth = spec.split(":")
        if point != name or int(want) != rank:
            return
        _count[0] += 1
        hit = _count[0] == int(nth)
    if hit:
        os.kill(os.getpid(), signal.SIGINT)


def fault_delay(name: str, rank: int = 0) -> None:
    """Sleep where CKPT_DELAY="<name>:<rank>:<seconds>" says: a slow disk or rank, for straggler tests."""
    _interrupt(name, rank)
    spec = os.environ.get("CKPT_DELAY")
    if not spec:
        return
    point, want, seconds = spec.split(":")
    if point == name and int(want) == rank:
        import time

        time.sleep(float(seconds))
