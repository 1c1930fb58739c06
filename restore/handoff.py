"""Who sends which chunk to a rank that cannot reach it, and in which round: the plan of a
restore's hand-off (restore.execute runs it).

A rank that needs chunks on no source it reaches (a node replaced with empty disks, or a
world-size change where each node's disk holds only its own ranks' chunks) picks, for each,
one rank that reaches the chunk's writer (`ask_holders`) and sends it the keys (an
all-to-all: each rank receives only what is asked of it), with the bytes it takes from
that holder in one round: the round's bytes over the number of holders it asks, so that
its receive buffers stay within one round's bytes. The holder reads each distinct chunk
once, for every rank that asked, in rounds within its own bound and each asker's
(`plan_sends`), and answers each asker with the round and tag of every key it asked for
(small chunks going to the same ranks share a tag: one message). No rank handles
another pair's requests: a rank's work and bytes grow with what it needs and what is asked
of it, not with the world size times the neediest rank's list.

The ranks that ask for a chunk pick the same holder (a hash of the key among the ranks that
reach its writer), so a chunk several ranks need is read once and the reading is spread
over its holders; groups of ASKERS_PER_READ ranks pick apart, so that a chunk thousands of
ranks need is sent by several holders.
"""

from __future__ import annotations

import bisect
import heapq
import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ckpt.store.errors import CkptError
from ckpt.store.rank_ranges import RankRanges, ranges_of

__all__ = ["ChunkKey", "Ask", "Outgoing", "Incoming", "Holders", "ask_holders", "plan_sends", "incoming"]

ChunkKey = tuple[str, tuple[int, ...]]  # (array name, chunk index)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A chunk this rank reads and sends to `to`, in message `tag` of round `round` (a
    small chunk shares its message with the others of that round that go to the same ranks)."""

    round: int
    tag: int
    key: ChunkKey
    to: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Incoming:
    """A chunk this rank receives from `holder`, in message `tag` of its round `round`."""

    round: int
    tag: int
    key: ChunkKey
    holder: int


class _Gathers(Protocol):
    def all_gather(self, obj: Any) -> list[Any]: ...


class _Cover:
    """The ranks whose ranges hold each rank, for ranks that share their ranges grouped: the
    ranges' bounds cut the ranks into segments, each with the groups that hold it, so a
    lookup is a binary search, not a scan of every rank's ranges."""

    def __init__(self, views: Sequence[RankRanges]) -> None:
        groups: dict[RankRanges, list[int]] = {}
        for rank, ranges in enumerate(views):
            groups.setdefault(ranges, []).append(rank)
        self._groups = [ranks for ranges, ranks in groups.items() if ranges]
        self._bounds = sorted({x for ranges in groups for span in ranges for x in span})
        cover: list[list[int]] = [[] for _ in self._bounds]  # segment i: [bounds[i], bounds[i+1])
        for g, ranges in enumerate(r for r in groups if r):
            for lo, hi in ranges:
                for i in range(bisect.bisect_left(self._bounds, lo), bisect.bisect_left(self._bounds, hi)):
                    cover[i].append(g)
        self._cover = [tuple(c) for c in cover]
        self._ranks: dict[tuple[int, ...], list[int]] = {}  # per set of groups: their ranks, in order

    def holding(self, rank: int) -> list[int]:
        """The ranks whose ranges hold `rank`, ascending."""
        i = bisect.bisect_right(self._bounds, rank) - 1
        if i < 0:
            return []
        groups = self._cover[i]
        if groups not in self._ranks:  # one list per distinct set of groups (a node's writers share one)
            self._ranks[groups] = list(heapq.merge(*(self._groups[g] for g in groups)))
        return self._ranks[groups]


class Holders:
    """Which ranks reach each saved rank's files, from what every rank reaches and what it
    found out of its reach (a few ranges a rank, all-gathered). Ranks with the same ranges (a
    node's ranks, with a root per node) are one group, so a rank that needs the files of
    every saved rank makes a binary search for each, not a scan of every rank (2.7e8 range
    lookups at 16,384 ranks, one a rank a writer)."""

    def __init__(self, views: Sequence[tuple[RankRanges, RankRanges]]) -> None:
        self._reach = _Cover([reach for reach, _ in views])
        self._lost = _Cover([lost for _, lost in views])

    @classmethod
    def gather(cls, comm: _Gathers, reach: Collection[int], lost: Collection[int]) -> Holders:
        """Collective: every rank's `reach` (the saved ranks whose files it offers) and `lost`
        (those with a copy on a source it could not reach)."""
        return cls(comm.all_gather((ranges_of(reach), ranges_of(lost))))

    def of(self, writer: int) -> list[int]:
        """The ranks that reach `writer`'s files, ascending."""
        return self._reach.holding(writer)

    def lost_by_any(self, writer: int) -> bool:
        """Whether a rank found a copy of `writer`'s files out of its reach: a file no rank
        reaches is then unreachable, not proven lost."""
        return bool(self._lost.holding(writer))


ASKERS_PER_READ = 64
"""Ranks (consecutive) that pick the same holder for a chunk: a chunk that thousands of ranks
lack (a replicated tensor, written once) is read by up to one holder per group of them and
sent by each to its group, not by one holder to every rank; a chunk few ranks lack (the
usual reshard: neighbouring ranks) is read once."""


def pick(key: ChunkKey, holders: Sequence[int], asker: int) -> int:
    """The holder `asker` asks for `key`: the same for every asker of its group, stable across
    processes (Python's str hash is not)."""
    name, index = key
    salt = asker // ASKERS_PER_READ
    return holders[zlib.crc32(f"{name}\0{','.join(map(str, index))}\0{salt}".encode()) % len(holders)]


def ask_holders(
    needs: Sequence[ChunkKey],
    writer_of: Callable[[ChunkKey], int],
    holders_of: Callable[[int], Sequence[int]],
    asker: int,
) -> tuple[dict[int, list[ChunkKey]], list[ChunkKey]]:
    """The keys `asker` asks of each holder (in `needs`' order), and the keys no rank reaches."""
    asks: dict[int, list[ChunkKey]] = {}
    unheld: list[ChunkKey] = []
    for key in needs:
        holders = holders_of(writer_of(key))
        if holders:
            asks.setdefault(pick(key, holders, asker), []).append(key)
        else:
            unheld.append(key)
    return asks, unheld


class Ask(NamedTuple):
    """What a rank asks of one holder: the chunks, and how many of their bytes it takes in one
    round (its receive buffers are bounded by the round bytes over all its holders)."""

    budget: int
    keys: list[ChunkKey]


def plan_sends(
    asked: Sequence[Ask | None],
    nbytes: Callable[[ChunkKey], int],
    round_bytes: int,
    packed: Callable[[ChunkKey], bool] = lambda key: False,
) -> tuple[list[Outgoing], list[list[tuple[int, int]] | None]]:
    """This holder's sends (each distinct chunk asked of it once, in key order, in rounds of
    at most `round_bytes`, and at most each asker's budget of bytes for it, unless a round
    holds one chunk only), and for each rank that asked, the (round, tag) of each key it
    asked for, in its order. The chunks that are `packed` (small: a message costs more
    than their copy) share one tag a round for each set of ranks they go to: one message,
    the chunks in key order (restore.execute lays it out alike on both sides)."""
    askers: dict[ChunkKey, list[int]] = {}
    budget: dict[int, int] = {}
    for rank, ask in enumerate(asked):
        if ask is not None:
            budget[rank] = ask.budget
            for key in ask.keys:
                askers.setdefault(key, []).append(rank)
    sends: list[Outgoing] = []
    where: dict[ChunkKey, tuple[int, int]] = {}
    rnd, tag, held = 0, 0, 0
    taken: dict[int, int] = {}  # bytes of this round, per asker
    packs: dict[tuple[int, ...], int] = {}  # this round's tag for the packed chunks, per set of askers
    for key in sorted(askers):
        n, to = nbytes(key), tuple(askers[key])
        full = held + n > round_bytes or any(taken.get(r, 0) + n > budget[r] for r in to)
        if tag and full:
            rnd, tag, held = rnd + 1, 0, 0
            taken.clear()
            packs.clear()
        at = tag
        if packed(key):
            at = packs.setdefault(to, tag)
        if at == tag:
            tag += 1
        sends.append(Outgoing(rnd, at, key, to))
        where[key] = (rnd, at)
        held += n
        for r in to:
            taken[r] = taken.get(r, 0) + n
    answers = [None if ask is None or not ask.keys else [where[k] for k in ask.keys] for ask in asked]
    return sends, answers


def incoming(
    asks: dict[int, list[ChunkKey]], answers: Sequence[Sequence[tuple[int, int]] | None]
) -> tuple[list[Incoming], CkptError | None]:
    """What this rank receives: each key it asked of a holder, at the round and tag the holder
    gave; and an error for a holder whose answer does not match what was asked of it (it
    sends this rank nothing). The other holders' chunks are still received: they send them
    whatever this rank's error, and a send with no receive posted waits for the timeout."""
    out: list[Incoming] = []
    error: CkptError | None = None
    for holder, keys in asks.items():
        got = answers[holder] or ()
        if len(got) != len(keys):
            error = error or CkptError(f"rank {holder} answered {len(got)} of the {len(keys)} chunks asked of it")
            continue
        out += [Incoming(rnd, tag, key, holder) for key, (rnd, tag) in zip(keys, got)]
    return out, error
