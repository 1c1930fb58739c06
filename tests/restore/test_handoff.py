"""The hand-off plan (restore.handoff): which rank sends which chunk, in which round."""

from __future__ import annotations

import random

from ckpt.restore.handoff import Ask, ChunkKey, Holders, Incoming, ask_holders, incoming, plan_sends
from ckpt.store.errors import CkptError
from ckpt.store.rank_ranges import RankRanges, contains, ranges_of

WORLD = 64
PER_NODE = 8


def _writer(key: ChunkKey) -> int:
    return key[1][0]


def _holders(writer: int) -> list[int]:
    """The ranks of the writer's node reach its chunks; node 7 lost its disks."""
    node = writer // PER_NODE
    return [] if node == 7 else list(range(node * PER_NODE, (node + 1) * PER_NODE))


def _needs(rank: int) -> list[ChunkKey]:
    """A world-size change: each rank needs 40 chunks of 3 writers of other nodes."""
    writers = [(rank * 5 + d) % WORLD for d in (8, 9, 17)]
    return sorted((f"a{i % 7}", (w, i)) for w in writers for i in range(40 // 3 + (w % 2)))


def test_every_asker_picks_the_same_holder_and_each_chunk_is_read_once() -> None:
    asks = {r: ask_holders(_needs(r), _writer, _holders, r) for r in range(WORLD)}
    budget = {r: 3000 // max(1, len(asks[r][0])) for r in range(WORLD)}  # as restore.execute asks
    asked_of = [
        [Ask(budget[r], asks[r][0][h]) if h in asks[r][0] else None for r in range(WORLD)] for h in range(WORLD)
    ]
    holder_of: dict[ChunkKey, int] = {}
    for r, (by_holder, unheld) in asks.items():
        assert sorted([k for ks in by_holder.values() for k in ks] + unheld) == _needs(r)
        assert all(_holders(_writer(k)) == [] for k in unheld)
        for h, keys in by_holder.items():
            assert h in _holders(_writer(keys[0])) and all(h in _holders(_writer(k)) for k in keys)
            for k in keys:
                assert holder_of.setdefault(k, h) == h, k  # the same holder, whoever asks
    assert len(set(holder_of.values())) > WORLD // 2  # the reading is spread over the holders
    sent: dict[ChunkKey, tuple[int, ...]] = {}
    got: list[list[Incoming]] = [[] for _ in range(WORLD)]
    answers = {}
    for h in range(WORLD):
        sends, answers[h] = plan_sends(asked_of[h], lambda k: 1000, 3000)
        for o in sends:
            assert o.key not in sent  # one read a chunk, sent to every rank that asked
            sent[o.key] = o.to
        per_round: dict[int, list[int]] = {}
        taken: dict[tuple[int, int], int] = {}
        for o in sends:
            per_round.setdefault(o.round, []).append(o.tag)
            for r in o.to:
                taken[(o.round, r)] = taken.get((o.round, r), 0) + 1000
        # Rounds of at most 3000 bytes (3 chunks), tags 0.. in each; an asker gets at most its
        # budget from this holder in a round, or one chunk.
        assert all(tags == list(range(len(tags))) and len(tags) <= 3 for tags in per_round.values())
        assert all(n <= max(budget[r], 1000) for (_, r), n in taken.items())
    for r in range(WORLD):
        got[r], mismatch = incoming(asks[r][0], [answers[h][r] for h in range(WORLD)])
        assert mismatch is None
        for inc in got[r]:
            assert r in sent[inc.key] and holder_of[inc.key] == inc.holder
    assert {(k, r) for k, to in sent.items() for r in to} == {(i.key, r) for r in range(WORLD) for i in got[r]}


def test_a_holder_answers_each_key_with_its_round_and_tag() -> None:
    asked = [None, Ask(100, [("b", (1,)), ("a", (0,))]), Ask(100, [("a", (0,))]), Ask(100, [])]
    sends, answers = plan_sends(asked, lambda k: 10, 10)
    assert [(o.round, o.tag, o.key, o.to) for o in sends] == [(0, 0, ("a", (0,)), (1, 2)), (1, 0, ("b", (1,)), (1,))]
    assert answers == [None, [(1, 0), (0, 0)], [(0, 0)], None]


def test_small_chunks_share_one_tag_a_round_for_each_set_of_askers() -> None:
    """Packed chunks going to the same ranks in a round share a message (a tag); those going
    to other ranks, the large ones and those of the next round get tags of their own, and
    each asker's answers name the message each of its chunks travels in."""
    small = {("s", (i,)) for i in range(6)}
    asked = [
        None,
        Ask(100, [("s", (0,)), ("s", (1,)), ("s", (2,)), ("b", (0,)), ("s", (4,)), ("s", (5,))]),
        Ask(100, [("s", (2,)), ("s", (3,))]),
    ]
    sends, answers = plan_sends(asked, lambda k: 10, 60, lambda k: k in small)
    got = {o.key: (o.round, o.tag, o.to) for o in sends}
    assert got == {
        ("b", (0,)): (0, 0, (1,)),
        ("s", (0,)): (0, 1, (1,)),
        ("s", (1,)): (0, 1, (1,)),
        ("s", (2,)): (0, 2, (1, 2)),  # wanted by both: a message of its own set of ranks
        ("s", (3,)): (0, 3, (2,)),
        ("s", (4,)): (0, 1, (1,)),
        ("s", (5,)): (1, 0, (1,)),  # a new round: the 60 bytes of this holder's round are full
    }, got
    assert answers[1] == [(0, 1), (0, 1), (0, 2), (0, 0), (0, 1), (1, 0)]
    assert answers[2] == [(0, 2), (0, 3)]


def test_an_answer_that_does_not_match_the_asks_is_an_error_for_that_holder_only() -> None:
    """The other holders send their chunks whatever this rank's error: it still receives them
    (a send with no receive posted would wait for the group's timeout)."""
    got, error = incoming({3: [("a", (0,)), ("a", (1,))], 1: [("b", (0,))]}, [None, [(0, 0)], None, [(0, 0)]])
    assert isinstance(error, CkptError) and "answered 1 of the 2" in str(error)
    assert got == [Incoming(0, 0, ("b", (0,)), 1)]
    got, error = incoming({1: [("a", (0,))]}, [None, None])
    assert got == [] and error is not None and "answered 0 of the 1" in str(error)


def test_a_round_holds_no_more_than_an_askers_budget() -> None:
    """Rank 1 asks 4 chunks of 10 bytes with a budget of 20 (it asks other holders too);
    rank 2 asks 2 others with a budget of 100: rounds of 20 bytes for rank 1, though the
    holder's own bound (100) would take all six chunks in one."""
    asked = [None, Ask(20, [("a", (i,)) for i in range(4)]), Ask(100, [("b", (0,)), ("b", (1,))])]
    sends, answers = plan_sends(asked, lambda k: 10, 100)
    rounds = {o.key: o.round for o in sends}
    assert [rounds[("a", (i,))] for i in range(4)] == [0, 0, 1, 1]
    assert answers[1] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rounds[("b", (0,))] == rounds[("b", (1,))] == 1  # with rank 1's last two: 40 bytes, its 20
    big = plan_sends([Ask(5, [("c", (0,)), ("c", (1,))])], lambda k: 10, 100)[0]
    assert [o.round for o in big] == [0, 1]  # a chunk over the budget goes alone


def test_a_chunk_thousands_of_ranks_lack_is_sent_by_several_holders() -> None:
    """A replicated tensor written once by rank 0, the job resumed on other nodes: 4,096
    ranks lack its chunk and the 8 ranks of rank 0's old node hold it. Each group of 64
    consecutive askers picks one holder: every holder sends, none to more than a few
    groups; a chunk only neighbouring ranks lack is still read once."""
    key = ("norm.weight", (0,))
    holders = list(range(8))
    picked = {r: ask_holders([key], _writer, lambda w: holders, r)[0] for r in range(8, 4096 + 8)}
    fan: dict[int, int] = {}
    for r, by in picked.items():
        (h,) = by
        fan[h] = fan.get(h, 0) + 1
        assert h == next(iter(picked[r - r % 64 if r - r % 64 >= 8 else 8])), r  # one holder a group
    assert set(fan) == set(holders), fan
    assert max(fan.values()) <= 4096 // 8 * 2, fan
    near = {next(iter(ask_holders([key], _writer, lambda w: holders, r)[0])) for r in range(64, 128)}
    assert len(near) == 1


def _scan(views: list[tuple[RankRanges, RankRanges]], writer: int, which: int) -> list[int]:
    """Every rank whose ranges hold `writer`, one by one (what Holders replaces)."""
    return [r for r, v in enumerate(views) if contains(v[which], writer)]


def test_holders_match_a_scan_of_every_rank() -> None:
    rng = random.Random(7)
    world = 96
    # A root per node of 8 in a new order, peer copies of the next node, a remote that a few
    # ranks list, ranks that lost a source, and ranks that reach nothing at all.
    views: list[tuple[RankRanges, RankRanges]] = []
    for r in range(world):
        node = (r // PER_NODE + 3) % (world // PER_NODE)
        reach = set(range(node * PER_NODE, node * PER_NODE + PER_NODE))
        if r % 3 == 0:
            reach |= {(w + PER_NODE) % world for w in reach}
        if r % 17 == 0:
            reach = set(range(world)) - {rng.randrange(world) for _ in range(5)}
        if r % 23 == 5:
            reach = set()
        lost = {rng.randrange(world) for _ in range(rng.choice((0, 0, 2, 9)))}
        views.append((ranges_of(reach - lost), ranges_of(lost)))
    holders = Holders(views)
    for writer in [*range(-2, world + 3), 10**6]:
        assert holders.of(writer) == _scan(views, writer, 0), writer
        assert holders.lost_by_any(writer) == bool(_scan(views, writer, 1)), writer


def test_holders_of_a_world_that_reaches_nothing() -> None:
    holders = Holders([((), ())] * 5)
    assert holders.of(0) == [] and not holders.lost_by_any(3)
