"""fn over many items on a few threads ("lanes") that take the items in order.

One task per thread rather than one future per item: for the ~1000-2500 chunks, files and
directories of a version, creating and collecting a future each cost more than the work
itself (py-spy: ~3x the fsyncs; a third of a warm restore), the submitting thread
competing with the workers for the GIL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

__all__ = ["run_lanes", "wait_through_interrupts"]

T = TypeVar("T")
R = TypeVar("R")


def wait_through_interrupts(futures: Iterable[Future[Any]], on_interrupt: Callable[[], None] | None = None) -> None:
    """Wait until every future is done, even when a signal handler raises meanwhile
    (KeyboardInterrupt, a SIGTERM handler's SystemExit); then re-raise the interruption.

    The threads behind them read or write a buffer (the staging arena) that the caller
    reuses once this returns: giving up on them early would let the next save copy into
    memory an abandoned thread still writes, and commit its bytes. `on_interrupt` may tell
    them to stop early. Their own errors are left in the futures."""
    futures = list(futures)
    interrupted: BaseException | None = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as e:  # noqa: BLE001 - re-raised below, once the threads have stopped
            if interrupted is None and on_interrupt is not None:
                on_interrupt()
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted


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
    stopped when this returns (so buffers the items point into may be reused). Interrupted
    (KeyboardInterrupt, SystemExit), the lanes take no further items, and the interruption
    is raised once they have stopped.

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
    stop = threading.Event()  # the caller was interrupted: take no further items

    def lane() -> None:
        while not stop.is_set():
            with lock:
                nxt = next(pending, None)
            if nxt is None:
                return
            attempt(*nxt)

    n = min(threads, len(items))
    own = None if pool is not None else ThreadPoolExecutor(n, thread_name_prefix=name)
    runner = pool if pool is not None else own
    assert runner is not None
    futures: list[Future[None]] = []
    try:
        for _ in range(n):
            futures.append(runner.submit(lane))
    finally:
        wait_through_interrupts(futures, stop.set)
        if own is not None:
            own.shutdown(wait=False)
    for f in futures:
        f.result()
    return results, sorted(failed, key=lambda x: x[0])
