"""Preemption notices: signal handlers that note one, and the ranks' agreement on it.

A scheduler preempts a job with a signal (SIGTERM, then a grace period; SIGUSR1 for
requeue) that may reach only some ranks. The handler only sets a flag (it runs between
two bytecodes of the training thread, where nothing else is safe), then calls the handler
that was installed before it, if that one is a Python callable. `reached()` is the
collective: every rank calls it once per step, and from the first call at which any rank
had the notice, it returns True on every rank (latched), so all ranks save the same step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from ckpt._dist import Comm

__all__ = ["PreemptionWatch", "pass_on"]

log = logging.getLogger("ckpt")
_Handler = Callable[[int, FrameType | None], Any] | int | None

# Signals a closed watch's handler, installed, is passing to the handlers before it: a
# closed watch among them acts as the installed one (two fits that raised leave closed
# watches chained). Handlers run on the main thread only.
_standing_in: set[int] = set()


class PreemptionWatch:
    def __init__(self, signals: Sequence[int]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("preemption_signals: signal handlers can only be installed from the main thread")
        self.noticed_at: float | None = None  # time.monotonic() of the first notice on this rank
        self.reached_at: float | None = None  # of the call at which the ranks agreed
        self._signum: int | None = None
        self._passed = False  # the first notice reached the handler from before this one
        self._reached = False
        self._closed = False
        self._kept: set[int] = set()  # signals no longer passed on (take_over)
        self._previous: dict[int, _Handler] = {}
        sig: object = signals
        try:
            for sig in dict.fromkeys(signals):  # once each: a second pass would take ours for the previous
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        except (ValueError, OSError, TypeError) as e:  # not a signal, or one that cannot be caught
            self.close()  # (a bare signal, not in a sequence: `sig` is what was given)
            raise ValueError(f"preemption_signals: cannot handle {sig!r}: {e}") from None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum)
        if self._closed:
            # Still installed after close() (another handler was put on top, or close() ran
            # off the main thread): behave as the handler before this one would. Called by
            # another handler chained on top (an open watch's, a framework's), only forward:
            # that one is handling the signal, as if this one were gone, so the default
            # action is not taken. Called by a closed watch's standing in for the installed
            # handler, it stands in too.
            installed = signal.getsignal(signum) == self._handle or signum in _standing_in
            if installed and (previous == signal.SIG_DFL or previous is None):
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            elif callable(previous):
                standing = signum in _standing_in
                if installed:
                    _standing_in.add(signum)
                try:
                    previous(signum, frame)
                finally:
                    if not standing:
                        _standing_in.discard(signum)
            return
        first = self.noticed_at is None
        if first:
            self.noticed_at, self._signum = time.monotonic(), signum
        if callable(previous) and signum not in self._kept:
            # (another watch's handler only notes it, or forwards it: this one's close() still
            # sends it on where that one's chain ends in no Python handler)
            self._passed = self._passed or (first and not _is_watch(previous))
            previous(signum, frame)

    def take_over(self, sig: int) -> None:
        """Install this watch's handler for `sig` again, over any installed since, and stop
        passing that signal on: the ranks' agreement (reached()) alone acts on it. For a
        framework whose own handler acts on the signal on the rank that got it (Lightning's
        SIGTERM handler starts a collective from inside the handler: with the notice on one
        rank only, the ranks' collectives no longer match). close() puts back the handler
        from before this watch, as without take_over: the one it covered is its owner's to
        put back (Lightning's teardown puts back what it found, this watch's). No-op for a
        signal this watch does not handle. From the main thread."""
        if sig not in self._previous:
            return
        if signal.getsignal(sig) != self._handle:
            signal.signal(sig, self._handle)
        self._kept.add(sig)

    @property
    def agreed(self) -> bool:
        """Whether reached() has returned True (on every rank alike)."""
        return self._reached

    def reached(self, comm: Comm) -> bool:
        """Collective (every rank, at the same point of each step): True on every rank from
        the first call after any rank had a notice."""
        if self._reached:
            return True
        if comm.any(self.noticed_at is not None):
            self._reached = True
            self.reached_at = time.monotonic()
            if self.noticed_at is not None:
                name = signal.Signals(self._signum).name if self._signum is not None else "a signal"
                log.warning("rank %d: preemption notice (%s); the ranks agreed to stop", comm.rank, name)
        return self._reached

    def close(self, *, resend: bool = True) -> int | None:
        """Put the previous handlers back where ours is still the one installed (from the
        main thread); where it cannot be, ours forwards to them from now on. A notice no
        agreement acted on (it came after the last reached(), as while close() waited for
        the last save) and that no handler from before had is then sent again, to those
        handlers: the signal does what it would have done without this watch (SIGTERM's
        default: the process ends). With
        `resend=False` it is returned instead, for the caller to send once the other
        Checkpointers it closes have committed (MultiTier)."""
        self._closed = True
        main = threading.current_thread() is threading.main_thread()
        for sig, previous in list(self._previous.items()):
            if main and signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        if self._signum is None or self._reached or self._passed:
            return None  # (passed: the handler from before had it, once, as without this watch)
        if not resend:
            return self._signum
        pass_on(self._signum)
        return None


def _is_watch(handler: object) -> bool:
    """Whether a handler is a PreemptionWatch's (open or closed)."""
    return getattr(handler, "__func__", None) is PreemptionWatch._handle


def pass_on(signum: int) -> None:
    """Send a notice no agreement acted on again, to the handlers from before ckpt's."""
    log.warning("preemption notice (%s) after the last check: passed on", signal.Signals(signum).name)
    os.kill(os.getpid(), signum)
