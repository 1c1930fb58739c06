"""The foreground replicator process (`ckpt replicate`): for systemd or Kubernetes.

It holds a lock per source root (a second replicator on the same root is refused),
passes over the roots every `interval_s`, so a newly committed version is picked up
within about that time plus one listing, and stops cleanly on SIGTERM or SIGINT: the
copy in flight is abandoned before its manifest is written, so nothing half-done is
ever visible, and the journal lets the next start resume.

A signal handler runs in the main thread between two bytecodes, so it takes no lock: a
`stop.set()` or a log line in it deadlocks where the main thread was interrupted holding
that Event's lock (as it is for a moment in every `stop.wait()`), or the log handler's, or
inside the handler itself at a second signal. The handler only notes the signal; the passes
run in a worker thread, and the main thread waits for it in short waits and sets `stop`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor, wait
from types import FrameType

from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.service import Replicator
from ckpt.replicator.status import STATE_DIR
from ckpt.store.errors import RootLockedError, StoppedError, TierUnavailableError
from ckpt.store.fsio import makedirs

__all__ = ["run_daemon", "lock_root"]

log = logging.getLogger("ckpt.replicator")
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def lock_root(root: str) -> int:
    """Take the root's replicator lock (held by this daemon or a Checkpointer's replicator
    thread); the fd holds it until closed. RootLockedError if another replicator has it."""
    d = os.path.join(root, STATE_DIR)
    makedirs(d)
    fd = os.open(os.path.join(d, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RootLockedError(f"another replicator is running on {root}") from None
    return fd


def run_daemon(sources: list[str], config: ReplicatorConfig, *, once: bool = False) -> Replicator:
    fds = [lock_root(s) for s in sources]
    try:  # the locks are let go however it ends (a remote refused or unreachable included)
        return _run(Replicator(sources, config), once)
    finally:
        for fd in fds:
            os.close(fd)


def _run(replicator: Replicator, once: bool) -> Replicator:
    signals: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals.append(signum)  # no lock here: see the module's docstring

    def work() -> None:
        if not once:
            replicator.run()
            return
        try:
            replicator.run_once()
        except StoppedError:
            pass
        if replicator.errors:
            raise TierUnavailableError(f"{len(replicator.errors)} cop(ies) failed: {replicator.errors[0]}")

    previous = {s: signal.signal(s, on_signal) for s in _STOP_SIGNALS}
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-replicator") as pool:
            done = pool.submit(work)
            # Short waits: the handler has run when one ends (the kernel may give the signal
            # to any thread, and only the main thread runs the handler, when it next wakes).
            try:
                while not wait([done], timeout=0.1).done:
                    if signals and not replicator.stop.is_set():
                        log.info("replicator: signal %d, stopping", signals[0])
                        replicator.stop.set()
            finally:
                replicator.stop.set()  # the pool's exit waits for the passes: whatever ends this wait ends them
            done.result()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return replicator
