"""The cyclic collector's pause around the allocations of save() and restore
(ckpt/_gc.py), with the real collector: what their sections leave alive costs no young
collection after them, the process's own frozen objects stay frozen, and a cycle made in
a section is still freed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

import ckpt._gc
from ckpt._gc import no_cyclic_gc


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def collections_seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The generations of the collections that start while the test runs, with the collector
    on (and no frozen objects seen by an earlier test)."""
    seen: list[int] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    monkeypatch.setattr(ckpt._gc, "_user_froze", False)
    was = gc.isenabled()
    gc.enable()
    gc.collect()
    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)
        if not was:
            gc.disable()


def test_what_saves_section_leaves_alive_starts_no_young_collection_after_it(collections_seen):
    with no_cyclic_gc(promote=True):
        assert not gc.isenabled()
        survivors = [[i] for i in range(30_000)]  # tracked objects, as a save's records are
    assert gc.isenabled()
    after = [[i] for i in range(300)]  # well under the young generation's threshold (700)
    assert collections_seen == []  # re-enabled with 30,000 young objects, the first allocation would start one
    assert len(survivors) + len(after) == 30_300


def test_other_sections_leave_the_young_generation_as_it_is(collections_seen):
    with no_cyclic_gc():
        survivors = [[i] for i in range(30_000)]
    after = [[i] for i in range(300)]
    assert collections_seen[:1] == [0]  # the young collection, over the section's survivors
    assert len(survivors) + len(after) == 30_300


def test_a_nested_section_leaves_the_collector_to_the_outer_one(collections_seen):
    with no_cyclic_gc(promote=True):
        with no_cyclic_gc(promote=True):
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_processes_own_frozen_objects_stay_frozen(collections_seen):
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        for _ in range(2):
            with no_cyclic_gc(promote=True):
                kept = [[i] for i in range(1000)]
            assert gc.isenabled()
            assert gc.get_freeze_count() == frozen
        assert ckpt._gc._user_froze  # seen once: not counted again
        assert len(kept) == 1000
    finally:
        gc.unfreeze()


def test_a_cycle_made_in_a_section_is_freed_by_a_full_collection(collections_seen):
    with no_cyclic_gc(promote=True):
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
    del a, b
    assert ref() is not None  # a cycle: reference counting cannot free it
    gc.collect()
    assert ref() is None


def test_a_restore_starts_no_young_collection_over_its_manifest(collections_seen, tmp_path):
    import torch

    from ckpt import Checkpointer

    state = {f"t{i}": torch.full((3,), float(i)) for i in range(1500)}
    with Checkpointer(tmp_path, capture_rng=False) as ck:
        ck.save(1, state)
        ck.wait()
        target = {k: torch.zeros(3) for k in state}
        gc.collect()
        collections_seen.clear()
        ck.restore(target, step=1)
        during = list(collections_seen)
    # Paused through the manifest's parse and the plan, the collector would start a young
    # collection over their thousands of objects at the first allocation after the pause.
    assert during == []
    assert all(torch.equal(target[k], state[k]) for k in state)
