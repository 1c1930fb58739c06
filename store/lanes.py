"""fn over many items on a few threads ("lanes") that take the items in order.

One task per thread rather than one future per item: for the ~1000-2500 chunks, files and
directories of a version, creating and collecting a future each cost more than the work
itself (py-spy: ~3x the fsyncs; a third of a warm restore), the submitting thread
competing with the workers for the GIL.

Lanes often read or write a buffer the caller reuses once they are joined (the staging
arena, the tensors of a restore). So a `LaneGroup` is joined even through interrupts
(KeyboardInterrupt, a SIGTERM handler's SystemExit, raised at any bytecode of the main
thread): a lane not started yet is cancelled and never starts, a running one is told to
stop and waited for, and only then is the interruption re-raised. Giving up on them early
would let the next save copy into memory an abandoned lane still writes, and commit it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["LIGHT_BYTES", "LaneGroup", "run_lanes"]

# A file of fewer bytes than this, read or written on tmpfs, costs more in Python and system
# calls than in copying: such items go to run_lanes' `solo` tail. On 2 cores a 16 KiB chunk
# read cost 28 us on one thread and 45-73 us with two; a 64 KiB one 46 against 88-118; at
# 256 KiB one thread and two were even, and at 1 MiB two were faster.
LIGHT_BYTES = 128 << 10

T = TypeVar("T")
R = TypeVar("R")

_QUEUED, _RUNNING, _OVER = 0, 1, 2


class LaneGroup:
    """Functions run on an executor, each either run to its end or never started."""

    def __init__(self, pool: Executor) -> None:
        self._pool = pool
        self._cond = threading.Condition()
        self._states: list[int] = []
        self.stop = threading.Event()  # lanes check it between items: the caller gave up
        self.errors: list[BaseException] = []

    def start(self, fn: Callable[[], None]) -> None:
        with self._cond:
            i = len(self._states)
            self._states.append(_QUEUED)  # before submit: an interrupt inside it leaves it known

        def run() -> None:
            with self._cond:
                if self._states[i] != _QUEUED:  # cancelled by join()
                    return
                self._states[i] = _RUNNING
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - the caller reads .errors after join()
                self.errors.append(e)
            finally:
                with self._cond:
                    self._states[i] = _OVER
                    self._cond.notify_all()

        self._pool.submit(run)

    def _cancel(self) -> None:
        self.stop.set()
        with self._cond:
            self._states[:] = [_OVER if s == _QUEUED else s for s in self._states]

    def join(self, cancel: bool = False) -> None:
        """Block until no lane runs. With `cancel`, or once interrupted, lanes not started
        yet never start and running ones see `stop`; an interruption is re-raised at the end."""
        interrupted: BaseException | None = None
        while True:
            try:
                if cancel or interrupted is not None:
                    self._cancel()
                with self._cond:
                    self._cond.wait_for(lambda: all(s == _OVER for s in self._states))
                break
            except BaseException as e:  # noqa: BLE001 - re-raised once no lane runs
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
    solo: int = 0,
) -> tuple[list[R | None], list[tuple[int, Exception]]]:
    """Call fn(item) for every item; return the results (None where fn raised) and the
    (index, exception) failures in item order. Every item is attempted, and no lane runs
    any more when this returns or raises (so buffers the items point into may be reused).
    Interrupted, the lanes take no further items, and the interruption is raised once
    they have stopped.

    With `pool`, the lanes run on it (more lanes than it has threads is harmless: a late
    lane finds nothing left); otherwise on a pool of their own, named `name`.

    The last `solo` items are taken by one lane alone, first, before it joins the others:
    for items whose work is mostly Python (a small chunk's open, read, hash and close), a
    second thread only adds GIL handoffs, one at each system call's return (64 KiB chunks
    from tmpfs on 2 cores: 46 us each on one thread, 118 us with two competing).
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
    solo = max(0, min(solo, len(items)))
    shared = len(items) - solo
    pending = iter(enumerate(items[:shared]))
    lock = threading.Lock()
    n = min(threads, shared + (1 if solo else 0))
    runner: Executor = pool if pool is not None else ThreadPoolExecutor(n, thread_name_prefix=name)
    group = LaneGroup(runner)

    def solo_lane() -> None:
        for i in range(shared, len(items)):
            if group.stop.is_set():
                return
            attempt(i, items[i])
        lane()

    def lane() -> None:
        while not group.stop.is_set():
            with lock:
                nxt = next(pending, None)
            if nxt is None:
                return
            attempt(*nxt)

    try:
        try:
            for k in range(n):
                group.start(solo_lane if solo and k == 0 else lane)
        except BaseException:
            group.join(cancel=True)
            raise
        group.join()
    finally:
        if runner is not pool:
            runner.shutdown(wait=False)  # its threads have nothing left to run
    if group.errors:
        raise group.errors[0]
    return results, sorted(failed, key=lambda x: x[0])
