"""fn over many items on a few threads ("lanes") that take the items in order.

One task per thread rather than one future per item: for the ~1000-2500 chunks, files and
directories of a version, creating and collecting a future each cost more than the work
itself (py-spy: ~3x the fsyncs; a third of a warm restore), the submitting thread
competing with the workers for the GIL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = ["run_lanes"]

T = TypeVar("T")
R = TypeVar("R")


def run_lanes(
    items: Sequence[T],
    fn: Callable[[T], R | None],
    threads: int,
    *,
    pool: Executor | None = None,
    name: str = "ckpt-lane",
) -> tuple[list[R | None], list[tuple[int, Exception]]]:
    """Call fn(item) for every item; return the results (None where fn raised) and the
    (index, exception) failures in item order. Every item is attempted, and every lane has
    stopped when this returns (so buffers the items point into may be reused).

    With `pool`, the lanes run on it (more lanes than it has threads is harmless: a late
    lane finds nothing left); otherwise on a pool of their own, named `name`.
    """
    results: list[R | None] = [None] * len(items)
    failed: list[tuple[int, Exception]] = []

    def attempt(i: int, item: T) -> None:
        try:
            results[i] = fn(item)
        except Exception as e:  # noqa: BLE001 - returned to the caller
            failed.append((i, e))

    if len(items) <= 1 or threads <= 1:
        for i, item in enumerate(items):
            attempt(i, item)
        return results, failed
    pending = iter(enumerate(items))
    lock = threading.Lock()

    def lane() -> None:
        while True:
            with lock:
                nxt = next(pending, None)
            if nxt is None:
                return
            attempt(*nxt)

    n = min(threads, len(items))
    if pool is not None:
        futures = [pool.submit(lane) for _ in range(n)]
        wait(futures)
        for f in futures:
            f.result()
    else:
        with ThreadPoolExecutor(n, thread_name_prefix=name) as own:
            for f in [own.submit(lane) for _ in range(n)]:
                f.result()
    return results, sorted(failed, key=lambda x: x[0])
