"""run_lanes: every item attempted once, failures returned in item order, and the `solo`
tail taken by one lane alone, in order, before it joins the others."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckpt.store.lanes import run_lanes


def _record(seen: list[tuple[int, int]], lock: threading.Lock) -> Callable[[int], int]:
    def fn(item: int) -> int:
        with lock:
            seen.append((item, threading.get_ident()))
        if item % 7 == 3:
            raise ValueError(item)
        return item * 2

    return fn


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("solo", [0, 1, 5, 40, 99])
def test_every_item_runs_once_and_failures_come_in_item_order(threads: int, solo: int) -> None:
    seen: list[tuple[int, int]] = []
    items = list(range(40))
    results, failed = run_lanes(items, _record(seen, threading.Lock()), threads, solo=solo)
    assert sorted(i for i, _ in seen) == items
    assert [i for i, _ in failed] == [i for i in items if i % 7 == 3]
    assert all(isinstance(e, ValueError) and e.args == (i,) for i, e in failed)
    assert results == [None if i % 7 == 3 else i * 2 for i in items]


def test_the_solo_tail_runs_on_one_thread_in_order_while_the_others_share_the_rest() -> None:
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()
    meet = threading.Barrier(2, timeout=30)  # items 0 and 1 finish only on two lanes at once
    record = _record(seen, lock)

    def fn(item: int) -> int:
        if item in (0, 1):
            meet.wait()
        return record(item)

    _, failed = run_lanes(list(range(30)), fn, 3, solo=12)
    assert not [e for _, e in failed if isinstance(e, threading.BrokenBarrierError)]  # the head ran on two lanes
    tail = [(i, t) for i, t in seen if i >= 18]
    assert [i for i, _ in tail] == list(range(18, 30))  # in order
    assert len({t for _, t in tail}) == 1  # one thread


def test_the_solo_lane_first_takes_its_tail_then_joins_the_others() -> None:
    seen: list[tuple[int, int]] = []
    meet = threading.Barrier(2, timeout=30)  # items 0 and 1 finish only on two lanes at once
    record = _record(seen, threading.Lock())

    def fn(item: int) -> int:
        if item in (0, 1):
            meet.wait()
        return record(item)

    _, failed = run_lanes(list(range(10)), fn, 2, solo=2)  # one shared lane, one solo lane
    assert not [e for _, e in failed if isinstance(e, threading.BrokenBarrierError)]
    solo_thread = next(t for i, t in seen if i == 8)
    assert [i for i, t in seen if t == solo_thread][:2] == [8, 9]  # its tail first
    assert any(t == solo_thread for i, t in seen if i < 8)  # then items of the head


def test_more_lanes_than_the_pools_threads() -> None:
    seen: list[tuple[int, int]] = []
    with ThreadPoolExecutor(1) as pool:
        results, _ = run_lanes(list(range(12)), _record(seen, threading.Lock()), 4, pool=pool, solo=5)
    assert sorted(i for i, _ in seen) == list(range(12))
    assert [i for i, _ in seen][:5] == list(range(7, 12))  # the solo lane is the first to start


def test_an_all_solo_list_runs_on_one_thread() -> None:
    seen: list[tuple[int, int]] = []
    run_lanes(list(range(20)), _record(seen, threading.Lock()), 4, solo=20)
    assert [i for i, _ in seen] == list(range(20))
    assert len({t for _, t in seen}) == 1
