"""Who sends which chunk to a rank that cannot reach it, and in which round: the plan of a
restore's hand-off (restore.execute runs it).

A rank that needs chunks on no source it reaches (a node replaced with empty disks, or a
world-size change where each node's disk holds only its own ranks' chunks) picks, for each,
one rank that reaches the chunk's writer (`ask_holders`) and sends it the keys (an
all-to-all: each rank receives only what is asked of it). The holder reads each distinct
chunk once, for every rank that asked, in rounds of at most `round_bytes` (`plan_sends`),
and answers each asker with the round and tag of every key it asked for. No rank handles
another pair's requests: a rank's work and bytes grow with what it needs and what is asked
of it, not with the world size times the neediest rank's list.

Every rank that asks for a chunk picks the same holder (a hash of the key among the ranks
that reach its writer), so a chunk many ranks need is read once and the reading is spread
over its holders.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ckpt.store.errors import CkptError

__all__ = ["ChunkKey", "Outgoing", "Incoming", "ask_holders", "plan_sends", "incoming"]

ChunkKey = tuple[str, tuple[int, ...]]  # (array name, chunk index)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A chunk this rank reads and sends to `to`, as the `tag`-th message of round `round`."""

    round: int
    tag: int
    key: ChunkKey
    to: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Incoming:
    """A chunk this rank receives from `holder`, as the `tag`-th message of its round `round`."""

    round: int
    tag: int
    key: ChunkKey
    holder: int


def pick(key: ChunkKey, holders: Sequence[int]) -> int:
    """The holder every rank picks for `key`: stable across processes (Python's str hash is not)."""
    name, index = key
    return holders[zlib.crc32(f"{name}\0{','.join(map(str, index))}".encode()) % len(holders)]


def ask_holders(
    needs: Sequence[ChunkKey], writer_of: Callable[[ChunkKey], int], holders_of: Callable[[int], Sequence[int]]
) -> tuple[dict[int, list[ChunkKey]], list[ChunkKey]]:
    """The keys to ask of each holder (in `needs`' order), and the keys no rank reaches."""
    asks: dict[int, list[ChunkKey]] = {}
    unheld: list[ChunkKey] = []
    for key in needs:
        holders = holders_of(writer_of(key))
        if holders:
            asks.setdefault(pick(key, holders), []).append(key)
        else:
            unheld.append(key)
    return asks, unheld


def plan_sends(
    asked: Sequence[Sequence[ChunkKey] | None], nbytes: Callable[[ChunkKey], int], round_bytes: int
) -> tuple[list[Outgoing], list[list[tuple[int, int]] | None]]:
    """This holder's sends (each distinct chunk asked of it once, in key order, in rounds
    that hold at least one chunk and reach `round_bytes` at most by their last), and for
    each rank that asked, the (round, tag) of each key it asked for, in its order."""
    askers: dict[ChunkKey, list[int]] = {}
    for rank, keys in enumerate(asked):
        for key in keys or ():
            askers.setdefault(key, []).append(rank)
    sends: list[Outgoing] = []
    where: dict[ChunkKey, tuple[int, int]] = {}
    rnd, tag, held = 0, 0, 0
    for key in sorted(askers):
        if held >= round_bytes:
            rnd, tag, held = rnd + 1, 0, 0
        sends.append(Outgoing(rnd, tag, key, tuple(askers[key])))
        where[key] = (rnd, tag)
        tag += 1
        held += nbytes(key)
    answers = [None if not keys else [where[k] for k in keys] for keys in asked]
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
