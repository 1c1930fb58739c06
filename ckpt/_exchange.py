"""The sliver exchange of a save: parts of straddling chunks, sent to their writers.

A chunk that straddles several ranks' regions (store.layout: arrays whose boundaries
share no useful divisor) is written by one rank; each other holder stages its part
(`StageTask.sliver`) in save() and sends it during the WRITE phase, on the commit
thread's own group, before any chunk file is written. The writer lays the parts into
its staged chunk (`apply`), so the chunk is written once, whole, and never read back.

Every rank takes part whatever happened to its staging: a rank whose copy failed still
sends (zeros) and receives, so no writer waits for it until the timeout; the version
then fails at the GATHER like any failed save. Messages between a pair of ranks carry
their position in the pair's sequence as the tag, so they match whatever order the
transport delivers them in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ckpt._dist import Comm
from ckpt._staging import Readiness, StageTask, chunk_view
from ckpt.store.dtypes import itemsize
from ckpt.store.errors import CkptError
from ckpt.store.layout import ArrayPlan, ChunkPlan, Sliver

__all__ = ["ChunkKey", "Transfer", "Buffers", "Schedule", "schedule", "exchange", "apply"]

ChunkKey = tuple[str, tuple[int, ...]]  # (array name, chunk index)


@dataclass(frozen=True, slots=True)
class Transfer:
    """One sliver between this rank and `peer`, the `tag`-th message between the two."""

    peer: int
    tag: int
    chunk: ChunkKey
    sliver: Sliver
    nbytes: int


@dataclass(frozen=True)
class Buffers:
    """A layout's memory for its exchanges, allocated once with the layout and reused by each
    save of it (one exchange at a time: the commit thread's): a receive buffer per transfer
    this rank receives (Schedule.recvs' order), and zeros as long as its longest send, sent
    in place of a sliver whose copy failed. An exchange so allocates nothing: a rank that
    failed to would fail before posting its part, and its peers would wait for it until
    the timeout; the ranks agree on this allocation when they plan the layout."""

    inbox: tuple[torch.Tensor, ...]
    blank: torch.Tensor


@dataclass(frozen=True)
class Schedule:
    """What this rank sends and receives in a save of one layout (the same for every save of it)."""

    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    buffers: Buffers | None = None  # (allocate() gives them: a schedule alone is plain data)

    @property
    def empty(self) -> bool:
        return not (self.sends or self.recvs)

    def allocate(self) -> Schedule:
        """This schedule with its Buffers."""
        inbox = tuple(torch.empty(tr.nbytes, dtype=torch.uint8) for tr in self.recvs)
        blank = torch.zeros(max((tr.nbytes for tr in self.sends), default=0), dtype=torch.uint8)
        return Schedule(self.sends, self.recvs, Buffers(inbox, blank))


def schedule(plans: Sequence[ArrayPlan], rank: int) -> Schedule:
    """This rank's transfers; every rank numbers each pair's messages in the same order
    (plans by name, chunks by grid position). O(straddling chunks), not O(chunks)."""
    sends: list[Transfer] = []
    recvs: list[Transfer] = []
    count: dict[tuple[int, int], int] = {}
    for plan in plans:
        item = itemsize(plan.spec.data_type)
        for flat in sorted(plan.slivers):
            chunk = plan.chunk(flat)
            for sliver in chunk.slivers:
                pair = (sliver.rank, chunk.writer)
                tag = count.get(pair, 0)
                count[pair] = tag + 1
                key = (plan.spec.name, chunk.index)
                nbytes = math.prod(sliver.shape) * item
                if sliver.rank == rank:
                    sends.append(Transfer(chunk.writer, tag, key, sliver, nbytes))
                if chunk.writer == rank:
                    recvs.append(Transfer(sliver.rank, tag, key, sliver, nbytes))
    return Schedule(tuple(sends), tuple(recvs))


def exchange(
    comm: Comm, plan: Schedule, staged: Sequence[StageTask], arena: torch.Tensor, ready: Readiness | None
) -> dict[ChunkKey, list[torch.Tensor]]:
    """Send this rank's staged slivers and receive the others'; returns the received bytes
    per chunk, in the chunk's sliver order. `staged` are the job's tasks (empty when its
    staging failed); each send waits for its copy (`ready`), and a sliver that was not
    copied is sent as zeros: the save fails anyway, and the writer must not wait. The
    received bytes are views of the layout's Buffers, valid until the next exchange."""
    box = plan.buffers if plan.buffers is not None else plan.allocate().buffers
    assert box is not None
    slots = {(t.array.spec.name, t.chunk.index, t.sliver): t for t in staged if t.sliver is not None}
    sends: list[tuple[int, int, torch.Tensor]] = []
    for tr in plan.sends:
        task = slots.get((*tr.chunk, tr.sliver))
        data = None
        if task is not None:
            try:
                if ready is not None:
                    ready.wait(task)
                data = arena[task.offset : task.offset + tr.nbytes]
            except CkptError:  # the copy failed: the commit reports its error
                data = None
        sends.append((tr.peer, tr.tag, box.blank[: tr.nbytes] if data is None else data))
    received: dict[ChunkKey, list[torch.Tensor]] = {}
    recvs: list[tuple[int, int, torch.Tensor]] = []
    for tr, buf in zip(plan.recvs, box.inbox, strict=True):
        received.setdefault(tr.chunk, []).append(buf)
        recvs.append((tr.peer, tr.tag, buf))
    comm.exchange(sends, recvs)
    return received


def apply(arena: torch.Tensor, task: StageTask, received: Sequence[torch.Tensor]) -> None:
    """Lay the received slivers into the writer's staged chunk (after its own part is staged)."""
    chunk: ChunkPlan = task.chunk
    view = chunk_view(arena, task)
    for sliver, raw in zip(chunk.slivers, received, strict=True):
        box = tuple(slice(o - c, o - c + s) for o, c, s in zip(sliver.offsets, chunk.offsets, sliver.shape))
        view[box].copy_(raw.view(view.dtype).view(sliver.shape))
