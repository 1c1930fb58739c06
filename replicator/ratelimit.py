"""A token bucket shared by upload threads: an optional bandwidth cap in bytes/s."""

from __future__ import annotations

import threading
import time

__all__ = ["RateLimiter"]


class RateLimiter:
    """`acquire(n)` blocks until n more bytes fit under the rate. None: unlimited."""

    def __init__(self, bytes_per_s: float | None, burst_s: float = 0.25) -> None:
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError("bandwidth limit must be positive")
        self.rate = bytes_per_s
        self._capacity = (bytes_per_s or 0) * burst_s
        self._tokens = self._capacity
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self, n: int, stop: threading.Event | None = None) -> None:
        """Blocks until the n bytes fit; returns early (without them) once `stop` is set."""
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._capacity, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            if stop is None:
                time.sleep(wait)
            else:
                stop.wait(wait)
