"""The foreground replicator process (`ckpt replicate`): for systemd or Kubernetes.

It holds a lock per source root (a second replicator on the same root is refused),
passes over the roots every `interval_s`, so a newly committed version is picked up
within about that time plus one listing, and stops cleanly on SIGTERM or SIGINT: the
copy in flight is abandoned before its manifest is written, so nothing half-done is
ever visible, and the journal lets the next start resume.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
from types import FrameType

from replicator.core import STATE_DIR, Replicator, ReplicatorConfig
from replicator.push import Stopped
from store.errors import RootLockedError
from store.fsio import DIR_MODE

__all__ = ["run_daemon"]

log = logging.getLogger("ckpt.replicator")


def _lock(root: str) -> int:
    d = os.path.join(root, STATE_DIR)
    os.makedirs(d, mode=DIR_MODE, exist_ok=True)
    fd = os.open(os.path.join(d, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RootLockedError(f"another replicator is running on {root}") from None
    return fd


def run_daemon(sources: list[str], config: ReplicatorConfig, *, once: bool = False) -> Replicator:
    fds = [_lock(s) for s in sources]
    replicator = Replicator(sources, config)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("replicator: signal %d, stopping", signum)
        replicator.stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if once:
            try:
                replicator.run_once()
            except Stopped:
                pass
        else:
            replicator.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for fd in fds:
            os.close(fd)
    return replicator
