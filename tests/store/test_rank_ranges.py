"""Writer sets as ranges (store.rank_ranges), and what the restore's listing exchange sends.

Every rank all-gathers its candidates (one per version and tier it lists). Before, each
carried its writers as a tuple of ranks: a remote that holds a 16,384-rank version sent
16,384 ints per version from every rank to every rank.
"""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import torch

from ckpt import Checkpointer
from ckpt.restore.discover import choose_step, holdings, missing_writers, partial_steps, reachable_steps
from ckpt.store.rank_ranges import contains, expand, missing, ranges_of, union
from ckpt.store.versions import Candidate, committed


def _random_sets(seed: int, world: int) -> list[set[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(6):
        kind = rng.randrange(3)
        if kind == 0:  # a node's ranks
            lo = rng.randrange(world)
            out.append(set(range(lo, min(world, lo + rng.randrange(1, 9)))))
        elif kind == 1:  # scattered
            out.append({rng.randrange(world) for _ in range(rng.randrange(0, 20))})
        else:  # a remote's: all or most
            out.append(set(range(world)) - {rng.randrange(world) for _ in range(rng.randrange(0, 3))})
    return out


def test_ranges_agree_with_sets() -> None:
    for seed in range(200):
        world = random.Random(seed).choice([1, 2, 7, 64, 1000])
        sets = _random_sets(seed, world)
        rs = [ranges_of(s) for s in sets]
        for s, r in zip(sets, rs):
            assert expand(r) == s
            assert list(r) == sorted(r) and all(lo < hi for lo, hi in r)
            assert all(a[1] < b[0] for a, b in zip(r, r[1:])), f"ranges touch or overlap: {r}"
            for rank in range(-1, world + 1):
                assert contains(r, rank) == (rank in s)
        both = set().union(*sets)
        assert union(rs) == ranges_of(both)
        assert expand(missing(union(rs), world)) == set(range(world)) - both
    assert ranges_of([5, 3, 4, 4, 9]) == ((3, 6), (9, 10))
    assert union([((0, 2),), ((2, 4),), ((6, 7),)]) == ((0, 4), (6, 7))
    assert missing((), 3) == ((0, 3),) and missing(((0, 3),), 3) == ()


def _cand(step: int, world: int, writers: set[int], sid: str = "a" * 32) -> Candidate:
    return Candidate(step, sid, world, ranges_of(writers))


def test_discovery_from_ranges_matches_the_writer_sets() -> None:
    """reachable/partial/missing over every rank's view, as before from sets of ranks."""
    for seed in range(100):
        rng = random.Random(seed)
        world = rng.choice([2, 8, 64])
        views: list[list[Candidate]] = []
        truth: dict[tuple[int, str], set[int]] = {}
        for _ in range(rng.randrange(1, 5)):
            view = []
            for step in (1, 2, 3):
                sid = rng.choice(["a" * 32, "b" * 32]) if step == 3 else "a" * 32
                held = _random_sets(rng.randrange(10**6), world)[0]
                view.append(_cand(step, world, held, sid))
                truth.setdefault((step, sid), set()).update(held)
            views.append(view)
        whole = {k for k, held in truth.items() if held == set(range(world))}
        want: dict[int, str] = {}
        for s in {k[0] for k in truth}:  # a step saved twice (two save_ids): only if one save is whole
            ids = [sid for (s2, sid) in whole if s2 == s]
            if len(ids) == 1:
                want[s] = ids[0]
        held = holdings(views)
        assert reachable_steps(held) == want
        assert partial_steps(held) == sorted({k[0] for k in truth} - set(want))
        assert choose_step(held) == (max(want) if want else None)
        for s in {k[0] for k in truth}:
            gaps = [sorted(set(range(world)) - ranks) for (s2, _), ranks in truth.items() if s2 == s]
            assert missing_writers(held, s) == min(gaps, key=len)


def test_a_remote_candidate_of_16384_writers_is_small(tmp_path: Path) -> None:
    """A real committed version whose root info lists 16,384 writers (a remote that holds
    every rank's part): its candidate pickles (as the listing exchange sends it) to tens
    of bytes of writers, not 16,384 ranks."""
    root = tmp_path / "root"
    with Checkpointer(root) as ck:
        ck.save(1, {"a": torch.ones(4)})
        ck.wait()
    info_path = root / "v000000000001" / "root.json"
    doc = json.loads(info_path.read_text())
    doc.update(world_size=16384, writers=list(range(16384)))
    info_path.write_text(json.dumps(doc))
    (cand,) = committed(str(root))
    assert cand.world_size == 16384 and expand(cand.writers) == set(range(16384))
    sent = len(pickle.dumps([cand]))
    assert sent < 512, f"a candidate of a whole 16,384-rank version pickles to {sent} bytes"
    # every rank's view of it: reachable in one merge, whatever the number of ranks
    assert reachable_steps(holdings([[cand]] * 1000)) == {1: cand.save_id}


def test_the_keys_a_restore_needs_choose_among_saves() -> None:
    """Step 5 saved twice, whole both times (the full state, and params only); step 6
    params only. Needing every key chooses step 5's full save; needing none, step 6 (step 5,
    with two whole saves, is ambiguous)."""
    full, params = frozenset({"model", "optim"}), frozenset({"model"})
    views = [
        [Candidate(5, "x" * 32, 2, ((0, 1),), full), Candidate(6, "z" * 32, 2, ((0, 2),), params)],
        [Candidate(5, "x" * 32, 2, ((1, 2),), full), Candidate(5, "y" * 32, 2, ((0, 2),), params)],
    ]
    held = holdings(views)
    assert reachable_steps(held) == {6: "z" * 32}
    assert reachable_steps(held, full) == {5: "x" * 32}
    assert choose_step(held) == 6 and choose_step(held, needs=full) == 5
    assert choose_step(held, needs=frozenset({"data"})) is None
    assert partial_steps(held) == [5]  # (not one whole save)
