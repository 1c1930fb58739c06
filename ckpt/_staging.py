"""Staging: copy the chunks a rank writes into one reused host buffer.

`save()` blocks only for this copy (with deferred staging, not even for that: see
ckpt/_deferred.py; the commit thread makes it). With overlap_writes the writers do not
wait for the whole copy: each chunk is written as soon as its bytes are staged
(`Readiness`), so the commit runs alongside the stall instead of after it. The buffer
(pinned when any source is on CUDA) is page-aligned, so the writers can hand its large chunks to O_DIRECT, and is kept across
saves and reallocated only when it must grow: copies into fresh memory run
~9x slower here because of page faults. CUDA sources are copied with non_blocking on a
side stream that is synchronised before `stage()` returns, so the optimizer may modify
the parameters at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ckpt._tensors import LocalPiece
from ckpt.store.dtypes import itemsize
from ckpt.store.errors import CkptError
from ckpt.store.faults import fault_delay, faults_armed
from ckpt.store.fsio import DIRECT_ALIGN, DIRECT_MIN_BYTES
from ckpt.store.lanes import LaneGroup
from ckpt.store.layout import ArrayPlan, ChunkPlan, Sliver

__all__ = ["StageTask", "Slot", "SlotBatch", "Arena", "Readiness", "assign_offsets", "slot_bytes", "stage"]

_ALIGN = 64
_MEMCPY_MIN = 1024  # elements; smaller copies stay with torch (no numpy round trip)
_LANE_MIN_BYTES = 256 << 10  # smaller chunks are copied by save()'s own thread
_CHUNK_COST_BYTES = 128 << 10  # ~15 us of Python per chunk, at ~9 GB/s of memcpy
# Chunks under this size that a piece fills exactly go in one torch._foreach_copy_ (into
# views of the arena kept by their Slot): ~1 us each against ~8 us through Python.
_BATCH_MAX_BYTES = 64 << 10
_BATCH_COST_BYTES = 16 << 10
_BATCH_SPLIT_MIN = 256  # chunks in one _foreach_copy_ (~0.5 us each) worth a second thread's start


@dataclass(slots=True, eq=False)
class StageTask:
    """One chunk this rank writes, or (`sliver` set) the part of another rank's chunk that
    this rank sends it: its plan, the local piece it comes from, and its arena offset. Not
    changed once made (not frozen: save() makes one per chunk, and a frozen dataclass's
    __init__ costs ~0.5 us more per object)."""

    array: ArrayPlan
    chunk: ChunkPlan
    piece: LocalPiece
    offset: int = 0
    sliver: Sliver | None = None
    slot: Slot | None = field(default=None, repr=False)  # a layout's reused one

    @property  # read by the batching, the offsets, the lanes and the writers
    def staged_bytes(self) -> int:
        if self.slot is not None:
            return self.slot.staged_bytes
        item = itemsize(self.array.spec.data_type)
        if self.sliver is not None:
            return math.prod(self.sliver.shape) * item
        return item if self.chunk.inline else self.chunk.nbytes

    @property
    def exchanged(self) -> bool:
        """Whether the task takes part in the sliver exchange (ckpt._exchange)."""
        return self.sliver is not None or bool(self.chunk.slivers)


@dataclass(eq=False)
class Slot:
    """A StageTask without its piece: what a save of the same layout reuses, and the
    slot's typed view of the arena once a copy has made one (~3.5 us each to make)."""

    array: ArrayPlan
    chunk: ChunkPlan
    offset: int
    sliver: Sliver | None
    staged_bytes: int
    batched: bool  # small, and the layout's piece fills it exactly: copied with the others like it
    name: str  # the array's
    _view: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    @staticmethod
    def of(task: StageTask) -> Slot:
        size = task.staged_bytes
        batched = size < _BATCH_MAX_BYTES and _fills(task)
        return Slot(task.array, task.chunk, task.offset, task.sliver, size, batched, task.array.spec.name)

    def task(self, piece: LocalPiece) -> StageTask:
        return StageTask(self.array, self.chunk, piece, self.offset, self.sliver, self)

    def view(self, arena: torch.Tensor, task: StageTask) -> torch.Tensor:
        """chunk_view(arena, task), made once per arena buffer (the view keeps its storage:
        a Slot lives only as long as its layout, and the Saver drops both together)."""
        cached = self._view
        if cached is None or cached[0] is not arena:
            cached = self._view = (arena, chunk_view(arena, task))
        return cached[1]


@dataclass(eq=False)
class SlotBatch:
    """A staging batch of a layout: its slots in order, the arena bytes they take, and
    where the slots copied in one _foreach_copy_ (Slot.batched) lie among them, with their
    views of the arena: found once, for every save of the layout."""

    slots: list[Slot]
    size: int
    joint: list[int]  # positions of the batched slots
    single: list[int]  # of the others
    _views: tuple[torch.Tensor, list[torch.Tensor]] | None = field(default=None, init=False, repr=False)

    @staticmethod
    def of(placed: list[StageTask], size: int) -> SlotBatch:
        slots = [Slot.of(t) for t in placed]
        joint = [i for i, s in enumerate(slots) if s.batched]
        single = [i for i, s in enumerate(slots) if not s.batched]
        return SlotBatch(slots, size, joint, single)

    def tasks(self, pieces: Mapping[str, LocalPiece]) -> list[StageTask]:
        return [s.task(pieces[s.name]) for s in self.slots]

    def views(self, arena: torch.Tensor, joint: Sequence[StageTask]) -> list[torch.Tensor]:
        """The views of the arena the `joint` tasks (this batch's, at `self.joint`) are
        copied into, made once per arena buffer."""
        cached = self._views
        if cached is None or cached[0] is not arena:
            cached = self._views = (arena, [_slot_view(arena, t) for t in joint])
        return cached[1]


def _fills(task: StageTask) -> bool:
    """Whether the task's piece is exactly its chunk's slot: no slivers, no padding."""
    chunk, data = task.chunk, task.piece.data
    if task.sliver is not None or chunk.slivers or chunk.offsets != task.piece.offsets:
        return False
    shape = tuple(data.shape)
    slot_shape = (() if not task.array.chunk_shape else task.array.chunk_shape) if chunk.inline else chunk.shape
    return chunk.shape == shape and slot_shape == shape and (chunk.inline or chunk.shape == task.array.chunk_shape)


def _alignment(task: StageTask) -> int:
    return DIRECT_ALIGN if task.staged_bytes >= DIRECT_MIN_BYTES else _ALIGN


def slot_bytes(task: StageTask) -> int:
    """At most this many arena bytes hold the task: its bytes and its alignment padding."""
    return task.staged_bytes + _alignment(task)


def assign_offsets(tasks: list[StageTask]) -> tuple[list[StageTask], int]:
    """Slots in the arena: chunks large enough for O_DIRECT start on a DIRECT_ALIGN boundary."""
    out, pos = [], 0
    for t in tasks:
        align = _alignment(t)
        pos = -(-pos // align) * align
        out.append(dataclasses.replace(t, offset=pos))
        pos += t.staged_bytes
    return out, -(-pos // _ALIGN) * _ALIGN


class _StagingAborted(CkptError):
    """Internal: a writer's chunk will never be staged. Never reaches the user: the commit
    raises the copy's own error (Readiness.result()) instead."""


class Readiness:
    """Which staged chunks the writers may take, so that writing overlaps the copy.

    The copy (save()'s; with deferred staging, the commit thread's) marks each task as its
    bytes land in the arena, and calls done() at the end. A writer waits only for its own
    task; the commit waits for result(). So a copy that fails after marking its tasks
    (StagingRaceError: that check runs after the copy) still stops the commit: chunks
    written meanwhile lie in the tmp directory, uncommitted.
    """

    def __init__(self, tasks: Sequence[StageTask]) -> None:
        # An event only for a writer that comes before its chunk: a save has a thousand
        # chunks, and making an Event (a Condition and a lock) for each cost the stall ~30 ms.
        self._lock = threading.Lock()
        self._marked: set[int] = set()
        self._waiting: dict[int, threading.Event] = {}
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self.finished_at: float | None = None  # perf_counter() when the copy ended (or failed)

    def mark(self, tasks: Sequence[StageTask]) -> None:
        """These tasks' bytes are in the arena."""
        with self._lock:
            self._marked.update(map(id, tasks))
            waiting = self._waiting
            waiters = (
                [w for w in map(waiting.pop, map(id, tasks), itertools.repeat(None)) if w is not None]
                if waiting
                else []
            )
        for waiter in waiters:
            waiter.set()

    def done(self) -> None:
        """The copy has ended (or failed: then after fail()); wake every waiter."""
        if self.finished_at is None:
            self.finished_at = time.perf_counter()
        with self._lock:
            self._finished.set()
            waiters, self._waiting = list(self._waiting.values()), {}
        for e in waiters:
            e.set()

    def fail(self, error: BaseException) -> None:
        """The copy will not complete: wake every waiter; result() raises `error` (the first)."""
        if self._error is None:
            self._error = error
        self.done()

    def wait(self, task: StageTask) -> None:
        """Block until the task is staged; raise _StagingAborted if it never will be."""
        with self._lock:
            here = id(task) in self._marked or self._finished.is_set()
            waiter = None if here else self._waiting.setdefault(id(task), threading.Event())
        if waiter is not None:
            waiter.wait()
        if self._error is not None:
            raise _StagingAborted(str(self._error))

    def result(self) -> None:
        """Block until the copy is done; raise its error, if any."""
        self._finished.wait()
        if self._error is not None:
            raise self._error


class Arena:
    """One flat uint8 host buffer, grown on demand and otherwise reused."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def get(self, nbytes: int, pin: bool) -> torch.Tensor:
        buf = self.buffer
        if buf is None or buf.numel() < nbytes or (pin and not buf.is_pinned()):
            self.buffer = None  # free before allocating the replacement
            # Ordinary pages, not transparent huge pages: O_DIRECT from huge pages was 10%
            # faster here, but the staging copy (the stall) 7% slower.
            size = max(nbytes, 1)
            # Slack to start on a DIRECT_ALIGN boundary, except for pinned memory: its blocks
            # come page-aligned, and rounded up to a power of two (slack could double them).
            # An unaligned buffer still works: its chunks are written through the page cache.
            slack = 0 if pin else DIRECT_ALIGN
            raw = torch.empty(size + slack, dtype=torch.uint8, pin_memory=pin)
            skip = -raw.data_ptr() % DIRECT_ALIGN
            buf = raw[skip : skip + size] if skip <= slack else raw
            self.buffer = buf
        return buf

    def release(self) -> None:
        self.buffer = None


def chunk_view(arena: torch.Tensor, task: StageTask) -> torch.Tensor:
    """The task's slot in the arena, typed and shaped as the full chunk (or as its sliver)."""
    dtype = task.piece.data.dtype
    if task.sliver is not None:
        shape = task.sliver.shape
    else:
        shape = () if task.chunk.inline and not task.array.chunk_shape else task.array.chunk_shape
    numel = 1 if task.chunk.inline else math.prod(shape)
    raw = arena[task.offset : task.offset + numel * itemsize(task.array.spec.data_type)]
    return raw.view(dtype).view(shape)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def _memcpy_ok(src: torch.Tensor, dst: torch.Tensor) -> bool:
    return (
        src.device.type == "cpu"
        and src.dtype == dst.dtype
        and src.numel() >= _MEMCPY_MIN
        and src.is_contiguous()
        and not (src.is_conj() or src.is_neg())  # lazy views: their bytes are not the values
    )


def _own_part(task: StageTask) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box (global offsets, shape) of the task's slot that this rank's piece fills."""
    if task.sliver is not None:
        return task.sliver.offsets, task.sliver.shape
    chunk, piece = task.chunk, task.piece
    if not chunk.slivers:
        return chunk.offsets, chunk.shape
    lo = tuple(map(max, chunk.offsets, piece.offsets))
    hi = tuple(min(c + s, p + t) for c, s, p, t in zip(chunk.offsets, chunk.shape, piece.offsets, piece.data.shape))
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _whole_piece(flat: np.ndarray, task: StageTask) -> bool:
    """Copy the task if it is the most common kind, with no tensor views made: a chunk that
    is this rank's whole piece, fills its slot, and can go through memcpy. Whether it did."""
    chunk, data = task.chunk, task.piece.data
    if task.sliver is not None or chunk.slivers or chunk.inline or chunk.offsets != task.piece.offsets:
        return False
    if chunk.shape != task.array.chunk_shape or chunk.shape != data.shape:  # (an edge chunk is padded)
        return False
    if data.numel() < _MEMCPY_MIN or not data.is_contiguous() or data.is_conj() or data.is_neg():
        return False
    np.copyto(flat[task.offset : task.offset + task.staged_bytes], _bytes(data), casting="no")
    return True


def _copy_one(arena: torch.Tensor, task: StageTask, non_blocking: bool) -> None:
    piece = task.piece
    offsets, shape = _own_part(task)
    src = piece.data[tuple(slice(c - p, c - p + s) for c, p, s in zip(offsets, piece.offsets, shape))]
    dst = chunk_view(arena, task)
    if tuple(shape) == tuple(dst.shape):
        if _memcpy_ok(src, dst):
            # glibc memcpy through numpy (GIL released): ~10 GB/s on two threads here, where
            # torch's copy_ reaches ~5.5 GB/s; the staging copy is the training stall.
            np.copyto(_bytes(dst), _bytes(src), casting="no")
            return
        dst.copy_(src, non_blocking=non_blocking)
        return
    # An edge chunk: zero padding keeps the file (and its checksum) deterministic. A
    # straddling chunk: the other ranks' slivers land in the rest before it is written.
    dst.zero_()
    start = task.chunk.offsets
    dst[tuple(slice(o - c, o - c + s) for o, c, s in zip(offsets, start, shape))].copy_(src, non_blocking=non_blocking)


def stage(
    arena: torch.Tensor,
    tasks: list[StageTask],
    pool: ThreadPoolExecutor | None,
    after: torch.cuda.Event | None = None,
    copied: Callable[[Sequence[StageTask]], None] | None = None,
    gpu: bool = True,
    batch: SlotBatch | None = None,
) -> None:
    """Copy every task into the arena; returns when all bytes are in host memory.

    CUDA sources are read once the work queued before `after` (an event recorded by the
    caller) is done, or, without it, the work queued so far on the current stream.
    `copied(tasks)` is called as tasks' bytes are in the arena (CUDA ones: after the CPU
    ones, each once its own event on the side stream has fired). `gpu=False` says that no
    task's piece is on a GPU (save() knows it from describing them): the tasks are then
    not looked at one by one to find out. `batch`: the SlotBatch that made `tasks`, all of
    its tasks in its order (its positions and views then serve the batched copy). Even when
    interrupted, no copy into the arena is still running when this returns or raises."""
    cuda_tasks: list[StageTask] = []
    cpu_tasks = tasks
    if gpu:
        cuda_tasks = [t for t in tasks if t.piece.data.is_cuda]
        cpu_tasks = [t for t in tasks if not t.piece.data.is_cuda] if cuda_tasks else tasks
    device = cuda_tasks[0].piece.data.device if cuda_tasks else None
    # All CUDA calls on the sources' device: a thread of its own (deferred staging) would
    # otherwise make device 0 current, and create a context there on every rank.
    landed: list[torch.cuda.Event] = []
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        stream = None
        if device is not None:
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.current_stream(device))
        try:
            if stream is not None:
                with torch.cuda.stream(stream):
                    for t in cuda_tasks:
                        _copy_one(arena, t, non_blocking=True)
                        if copied is not None:  # one event per chunk: its writer may start once it is here
                            landed.append(torch.cuda.Event())  # type: ignore[no-untyped-call]
                            landed[-1].record(stream)
            _copy_cpu(arena, cpu_tasks, pool, copied, batch if cpu_tasks is tasks else None)
            for t, event in zip(cuda_tasks, landed):
                event.synchronize()
                assert copied is not None
                copied([t])
        finally:
            if stream is not None:  # no DMA into the arena may outlive this call, even on an error
                stream.synchronize()


_SOURCE = operator.attrgetter("piece.data")


def _slot_view(arena: torch.Tensor, task: StageTask) -> torch.Tensor:
    assert task.slot is not None  # (a batchable task's)
    return task.slot.view(arena, task)


def _copy_cpu(
    arena: torch.Tensor,
    tasks: list[StageTask],
    pool: ThreadPoolExecutor | None,
    copied: Callable[[Sequence[StageTask]], None] | None,
    batch: SlotBatch | None = None,
) -> None:
    slow = faults_armed()  # the environment is read once per copy, not once per chunk
    flat = arena.numpy()

    def copy(t: StageTask) -> None:
        if slow:
            fault_delay("stage", t.chunk.writer)  # a slow copy, for tests of writes overlapping it
        if not _whole_piece(flat, t):
            _copy_one(arena, t, False)
        if copied is not None:
            copied((t,))

    # Small chunks that their pieces fill: one C++ call for all of them (not under armed
    # faults, whose per-chunk delays the tests of overlapping writes rely on).
    batched: list[StageTask] = []
    views: list[torch.Tensor] = []
    if not slow:
        if batch is not None:
            batched = [tasks[i] for i in batch.joint]
            if batched:
                views = batch.views(arena, batched)
                tasks = [tasks[i] for i in batch.single]
        else:
            batched = [t for t in tasks if t.slot is not None and t.slot.batched]
            if batched:
                views = [_slot_view(arena, t) for t in batched]
                tasks = [t for t in tasks if t.slot is None or not t.slot.batched]

    def copy_batched(part: list[StageTask], into: list[torch.Tensor]) -> None:
        if part:
            torch._foreach_copy_(into, list(map(_SOURCE, part)))
            if copied is not None:
                copied(part)

    # Many small chunks: half in each lane (torch releases the GIL inside _foreach_copy_).
    halves: tuple[list[StageTask], list[StageTask]] = (batched, [])
    into: tuple[list[torch.Tensor], list[torch.Tensor]] = (views, [])
    if pool is not None and len(batched) >= _BATCH_SPLIT_MIN:
        mid = len(batched) // 2
        halves, into = (batched[:mid], batched[mid:]), (views[:mid], views[mid:])
    # Two lanes balanced by cost (bytes, and Python per chunk); numpy and torch release the
    # GIL while copying. Chunks under _LANE_MIN_BYTES all stay on this thread: split over
    # both lanes, their Python would pass the GIL between the threads at every chunk.
    big = (
        sorted((t for t in tasks if t.staged_bytes >= _LANE_MIN_BYTES), key=lambda t: -t.staged_bytes) if tasks else []
    )
    if pool is None or (len(big) < 2 and not halves[1]):
        copy_batched(batched, views)
        for t in tasks:
            copy(t)
        return
    small = [t for t in tasks if t.staged_bytes < _LANE_MIN_BYTES]
    lanes: list[list[StageTask]] = [[], []]
    if big:
        loads = [sum(t.staged_bytes + _CHUNK_COST_BYTES for t in small), 0]
        for i, half in enumerate(halves):
            loads[i] += sum(t.staged_bytes + _BATCH_COST_BYTES for t in half)
        for t in big:
            i = 0 if loads[0] <= loads[1] else 1
            lanes[i].append(t)
            loads[i] += t.staged_bytes + _CHUNK_COST_BYTES
    lanes[0].extend(small)

    group = LaneGroup(pool)

    def other_lane() -> None:
        if not group.stop.is_set():  # (set: this thread failed or was interrupted)
            copy_batched(halves[1], into[1])
        for t in lanes[1]:
            if group.stop.is_set():
                return
            copy(t)

    try:
        group.start(other_lane)
        fault_delay("lane-started", (lanes[0] or lanes[1] or batched)[0].chunk.writer)
        copy_batched(halves[0], into[0])
        for t in lanes[0]:
            copy(t)
    except BaseException:
        group.join(cancel=True)  # even through Ctrl-C: no lane may write into the arena after we return
        raise
    group.join()
    if group.errors:
        raise group.errors[0]
