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

__all__ = ["fault_point", "fault_delay", "faults_armed"]


def fault_point(name: str, rank: int = 0) -> None:
    if os.environ.get("CKPT_FAULT") != name:
        return
    want = os.environ.get("CKPT_FAULT_RANK")
    if want is None or int(want) == rank:
        os.kill(os.getpid(), signal.SIGKILL)


_interrupt_spec = ""  # the CKPT_INTERRUPT value the counts below belong to
_interrupt_passes: dict[str, int] = {}  # per point: passes since the variable took this value
_interrupt_lock = threading.Lock()


def _interrupt(name: str, rank: int) -> None:
    """SIGINT this process at the n-th pass of a point, where CKPT_INTERRUPT says so:
    "<name>:<rank>:<n>", or several such, comma-separated (a second Ctrl-C at another
    point). Passes are counted from when the variable took this value."""
    global _interrupt_spec
    spec = os.environ.get("CKPT_INTERRUPT", "")
    if not spec and not _interrupt_spec:  # unset, as in production: no lock on the copy's path
        return
    hit = False
    with _interrupt_lock:
        if spec != _interrupt_spec:
            _interrupt_spec = spec
            _interrupt_passes.clear()
        for one in filter(None, spec.split(",")):
            point, want, nth = one.split(":")
            if point == name and int(want) == rank:
                _interrupt_passes[point] = _interrupt_passes.get(point, 0) + 1
                hit = hit or _interrupt_passes[point] == int(nth)
    if hit:
        os.kill(os.getpid(), signal.SIGINT)


def faults_armed() -> bool:
    """Whether any delay or interrupt point may fire: a loop over many items asks once, and
    skips fault_delay (two environment reads) per item when none can."""
    return bool(_interrupt_spec or os.environ.get("CKPT_INTERRUPT") or os.environ.get("CKPT_DELAY"))


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
