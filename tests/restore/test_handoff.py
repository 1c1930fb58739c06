"""The hand-off plan (restore.handoff): which rank sends which chunk, in which round."""

from __future__ import annotations

from ckpt.restore.handoff import ChunkKey, Incoming, ask_holders, incoming, plan_sends
from ckpt.store.errors import CkptError

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
    asks = {r: ask_holders(_needs(r), _writer, _holders) for r in range(WORLD)}
    asked_of = [[asks[r][0].get(h) for r in range(WORLD)] for h in range(WORLD)]
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
        for o in sends:
            per_round.setdefault(o.round, []).append(o.tag)
        # Rounds of at most 3000 bytes (3 chunks), tags 0.. in each.
        assert all(tags == list(range(len(tags))) and len(tags) <= 3 for tags in per_round.values())
    for r in range(WORLD):
        got[r], mismatch = incoming(asks[r][0], [answers[h][r] for h in range(WORLD)])
        assert mismatch is None
        for inc in got[r]:
            assert r in sent[inc.key] and holder_of[inc.key] == inc.holder
    assert {(k, r) for k, to in sent.items() for r in to} == {(i.key, r) for r in range(WORLD) for i in got[r]}


def test_a_holder_answers_each_key_with_its_round_and_tag() -> None:
    asked = [None, [("b", (1,)), ("a", (0,))], [("a", (0,))], []]
    sends, answers = plan_sends(asked, lambda k: 10, 10)
    assert [(o.round, o.tag, o.key, o.to) for o in sends] == [(0, 0, ("a", (0,)), (1, 2)), (1, 0, ("b", (1,)), (1,))]
    assert answers == [None, [(1, 0), (0, 0)], [(0, 0)], None]


def test_an_answer_that_does_not_match_the_asks_is_an_error_for_that_holder_only() -> None:
    """The other holders send their chunks whatever this rank's error: it still receives them
    (a send with no receive posted would wait for the group's timeout)."""
    got, error = incoming({3: [("a", (0,)), ("a", (1,))], 1: [("b", (0,))]}, [None, [(0, 0)], None, [(0, 0)]])
    assert isinstance(error, CkptError) and "answered 1 of the 2" in str(error)
    assert got == [Incoming(0, 0, ("b", (0,)), 1)]
    got, error = incoming({1: [("a", (0,))]}, [None, None])
    assert got == [] and error is not None and "answered 0 of the 1" in str(error)
