"""run_lanes: every item attempted once, failures returned in item order, and the `solo`
tail taken by one lane alone, in order, before it joins the others."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from ckpt.store.lanes import run_lanes


def _record(seen: list[tuple[int, int]], lock: threading.Lock, delay: float = 0.0) -> Callable[[int], int]:
    def fn(item: int) -> int:
        if delay:
            time.sleep(delay)  # holds the lane long enough that another lane takes the next item
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
    items = list(range(30))
    run_lanes(items, _record(seen, threading.Lock(), delay=0.002), 3, solo=12)
    tail = [(i, t) for i, t in seen if i >= 18]
    assert [i for i, _ in tail] == list(range(18, 30))  # in order
    assert len({t for _, t in tail}) == 1  # one thread
    head_threads = {t for i, t in seen if i < 18}
    assert len(head_threads) >= 2  # the other lanes read the head meanwhile


def test_an_all_solo_list_runs_on_one_thread() -> None:
    seen: list[tuple[int, int]] = []
    run_lanes(list(range(20)), _record(seen, threading.Lock(), delay=0.001), 4, solo=20)
    assert [i for i, _ in seen] == list(range(20))
    assert len({t for _, t in seen}) == 1
