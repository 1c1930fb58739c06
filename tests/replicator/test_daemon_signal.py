"""The daemon stops on SIGTERM wherever the signal lands.

A Python signal handler runs in the main thread between two bytecodes, so a handler that
calls `threading.Event.set()` deadlocks when the main thread was interrupted inside that
Event's own lock (every `Event.wait()` takes it for a moment). The old daemon ran its passes
in the main thread and waited between them with `stop.wait(interval)`: about once in
hundreds of stops it hung until killed (the crash harness's "daemon 1 did not stop on
SIGTERM" in CI). The test makes that moment certain: the pass holds the Event's lock when the
signal arrives.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time

    from ckpt.replicator.config import ReplicatorConfig
    from ckpt.replicator.daemon import run_daemon
    from ckpt.replicator.service import Replicator

    def pass_that_holds_the_stop_lock(self):
        # As inside Event.wait(): the Event's condition lock is held when SIGTERM arrives.
        with self.stop._cond:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)  # the handler runs now on the old code, in this thread
        return {}

    Replicator.run_once = pass_that_holds_the_stop_lock
    run_daemon([sys.argv[1]], ReplicatorConfig(interval_s=0.05))
    print("stopped", flush=True)
    """
)


def test_sigterm_that_lands_inside_the_stop_events_lock_still_stops_the_daemon(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    try:
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, str(root)],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(
            "the daemon did not stop within 30 s of SIGTERM (deadlocked in its signal handler)"
        ) from None
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "stopped"
