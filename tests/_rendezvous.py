"""`Rendezvous`: proof that some calls ran on distinct threads at once, without sleeps."""

from __future__ import annotations

import threading
from collections.abc import Sequence


class Rendezvous:
    """The first arrival of each listed role (a role listed twice: its first two) blocks
    until all of them have arrived, so they must come from that many threads at once. A
    thread that would have to come twice waits on itself: BrokenBarrierError after
    `timeout`, which fails the test. Later arrivals pass straight through."""

    def __init__(self, roles: Sequence[str], timeout: float = 30.0) -> None:
        self._barrier = threading.Barrier(len(roles), timeout=timeout)
        self._waiting = list(roles)
        self._lock = threading.Lock()

    def arrive(self, role: str) -> None:
        with self._lock:
            if role not in self._waiting:
                return
            self._waiting.remove(role)
        self._barrier.wait()
