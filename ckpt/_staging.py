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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ckpt._tensors import LocalPiece
from ckpt.store.dtypes import itemsize
from ckpt.store.errors import CkptError
from ckpt.store.faults import fault_delay, faults_armed
from ckpt.store.fsio import DIRECT_ALIGN, DIRECT_MIN_BYTES
from ckpt.store.host_arrays import host_bytes
from ckpt.store.lanes import LaneGroup
from ckpt.store.layout import ArrayPlan, ChunkPlan, Sliver

__all__ = ["StageTask", "StageBatch", "Arena", "Readiness", "assign_offsets", "slot_bytes", "stage"]

_ALIGN = 64
_MEMCPY_MIN = 1024  # elements; smaller copies stay with torch (no numpy round trip)
_LANE_MIN_BYTES = 256 << 10  # smaller chunks are copied by save()'s own thread
_CHUNK_COST_BYTES = 128 << 10  # ~15 us of Python per chunk, at ~9 GB/s of memcpy
# Chunks under this size that a piece fills exactly go in one torch._foreach_copy_ (into
# views of the arena kept by their StageBatch): ~1 us each against ~8 us through Python.
_BATCH_MAX_BYTES = 64 << 10
_BATCH_COST_BYTES = 16 << 10
_BATCH_SPLIT_MIN = 256  # chunks in one _foreach_copy_ (~0.5 us each) worth a second thread's start
# Batched chunks of one dtype and shape at least this many are laid back to back in the
# arena and copied by one torch.cat (2,336 small tensors on one thread: 0.52 ms against
# 0.87 ms for one _foreach_copy_ with the caches warm, 0.99 against 1.40 ms cold).
_RUN_MIN = 4


_Tensors = tuple[torch.Tensor, ...] | list[torch.Tensor]  # (what torch._foreach_copy_ takes)


@dataclass(slots=True, eq=False)
class StageTask:
    """One chunk this rank writes, or (`sliver` set) the part of another rank's chunk that
    this rank sends it: its plan, where its piece lies and what it holds, and its arena
    offset. Made once per layout, from its first save's pieces: each save of the layout
    gives stage() its tensors (Described.data), the task's at `leaf`. Not changed once made
    (a new offset is a new task)."""

    array: ArrayPlan
    chunk: ChunkPlan
    leaf: int  # the index of its piece's tensor among a save's
    dtype: torch.dtype  # the piece's tensor's
    cuda: bool  # whether the piece is on a GPU
    piece_offsets: tuple[int, ...]  # where the piece starts in the array
    piece_shape: tuple[int, ...]  # the piece's tensor's
    staged_bytes: int  # read by the batching, the offsets, the lanes and the writers
    batched: bool  # small, and its piece fills it exactly: copied in one call with the others like it
    offset: int = 0
    sliver: Sliver | None = None
    # The task's typed view of the arena, made once per arena buffer (~3.5 us each to make).
    _view: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    @staticmethod
    def of(array: ArrayPlan, chunk: ChunkPlan, leaf: int, piece: LocalPiece, sliver: Sliver | None = None) -> StageTask:
        item = itemsize(array.spec.data_type)
        if sliver is not None:
            size = math.prod(sliver.shape) * item
        else:
            size = item if chunk.inline else chunk.nbytes
        data = piece.data
        shape = tuple(data.shape)
        fills = _fills(array, chunk, sliver, piece.offsets, shape)
        return StageTask(
            array,
            chunk,
            leaf,
            data.dtype,
            data.is_cuda,
            piece.offsets,
            shape,
            size,
            size < _BATCH_MAX_BYTES and fills,
            sliver=sliver,
        )

    @property
    def exchanged(self) -> bool:
        """Whether the task takes part in the sliver exchange (ckpt._exchange)."""
        return self.sliver is not None or bool(self.chunk.slivers)

    def view(self, arena: torch.Tensor) -> torch.Tensor:
        """chunk_view(arena, self), made once per arena buffer (the view keeps its storage:
        a task lives only as long as its layout, and the Saver drops both together)."""
        cached = self._view
        if cached is None or cached[0] is not arena:
            cached = self._view = (arena, chunk_view(arena, self))
        return cached[1]


@dataclass(eq=False)
class _Run:
    """Batched tasks of one dtype and shape that lie back to back in the arena: one
    torch.cat (torch.stack for 0-d tensors) copies them all, with no per-tensor call."""

    tasks: list[StageTask]
    start: int  # the first one's arena offset
    nbytes: int
    _pick: Callable[[Sequence[torch.Tensor]], _Tensors] = field(init=False, repr=False)
    _view: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._pick = operator.itemgetter(*(t.leaf for t in self.tasks))  # (at least two)

    def copy(self, arena: torch.Tensor, data: Sequence[torch.Tensor]) -> None:
        """Copy the run's tensors, from a save's, into the arena."""
        first = self.tasks[0]
        cached = self._view
        if cached is None or cached[0] is not arena:
            shape = first.piece_shape
            whole = (len(self.tasks) * shape[0], *shape[1:]) if shape else (len(self.tasks),)
            cached = self._view = (arena, arena[self.start : self.start + self.nbytes].view(first.dtype).view(whole))
        if first.piece_shape:
            torch.cat(self._pick(data), out=cached[1])
        else:
            torch.stack(self._pick(data), out=cached[1])


def _runs(placed: list[StageTask], joint: list[int]) -> tuple[list[_Run], list[int]]:
    """The runs among the batched tasks at `joint` (as assign_offsets lays them), and the
    positions of the batched tasks in none (copied by one _foreach_copy_)."""
    groups: dict[tuple[torch.dtype, tuple[int, ...]], list[int]] = {}
    for i in joint:
        t = placed[i]
        groups.setdefault((t.dtype, t.piece_shape), []).append(i)
    runs: list[_Run] = []
    rest: list[int] = []
    for members in groups.values():
        tasks = sorted((placed[i] for i in members), key=operator.attrgetter("offset"))
        end = tasks[-1].offset + tasks[-1].staged_bytes
        back_to_back = all(a.offset + a.staged_bytes == b.offset for a, b in zip(tasks, tasks[1:]))
        if len(tasks) >= _RUN_MIN and tasks[0].staged_bytes > 0 and back_to_back:
            nbytes = end - tasks[0].offset
            # A large run in two halves, one for each copy lane.
            parts = [tasks] if nbytes < 2 * _LANE_MIN_BYTES else [tasks[: len(tasks) // 2], tasks[len(tasks) // 2 :]]
            runs.extend(_Run(p, p[0].offset, sum(t.staged_bytes for t in p)) for p in parts)
        else:
            rest.extend(members)
    return runs, sorted(rest)


@dataclass(eq=False)
class StageBatch:
    """A staging batch of a layout: its tasks in order, the arena bytes they take, and how
    its batched tasks (StageTask.batched) are copied: runs of one dtype and shape by one call
    each, the rest by one _foreach_copy_ (their positions, their tensors' indices and their
    views of the arena). Found once, for every save of the layout."""

    tasks: list[StageTask]
    size: int
    joint: list[int]  # positions of the batched tasks in no run
    single: list[int]  # of the tasks that are not batched
    runs: list[_Run] = field(default_factory=list)
    _views: tuple[torch.Tensor, list[torch.Tensor]] | None = field(default=None, init=False, repr=False)
    _pick: Callable[[Sequence[torch.Tensor]], _Tensors] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        leaves = [self.tasks[i].leaf for i in self.joint]
        # The batched tasks' tensors among a save's in one C call (an itemgetter of one
        # index returns the item itself, not a tuple).
        self._pick = operator.itemgetter(*leaves) if len(leaves) > 1 else lambda data: [data[i] for i in leaves]

    @staticmethod
    def of(placed: list[StageTask], size: int) -> StageBatch:
        runs, joint = _runs(placed, [i for i, t in enumerate(placed) if t.batched])
        single = [i for i, t in enumerate(placed) if not t.batched]
        return StageBatch(placed, size, joint, single, runs)

    def sources(self, data: Sequence[torch.Tensor]) -> _Tensors:
        """The tensors of the batched tasks in no run, in their order, from a save's tensors."""
        return self._pick(data)

    def views(self, arena: torch.Tensor) -> list[torch.Tensor]:
        """The views of the arena those tasks are copied into, made once per arena buffer."""
        cached = self._views
        if cached is None or cached[0] is not arena:
            cached = self._views = (arena, [chunk_view(arena, self.tasks[i]) for i in self.joint])
        return cached[1]


def _fills(
    array: ArrayPlan, chunk: ChunkPlan, sliver: Sliver | None, offsets: tuple[int, ...], shape: tuple[int, ...]
) -> bool:
    """Whether a piece at `offsets` of `shape` is exactly its chunk's slot: no slivers, no padding."""
    if sliver is not None or chunk.slivers or chunk.offsets != offsets:
        return False
    slot_shape = (() if not array.chunk_shape else array.chunk_shape) if chunk.inline else chunk.shape
    return chunk.shape == shape and slot_shape == shape and (chunk.inline or chunk.shape == array.chunk_shape)


def _alignment(task: StageTask) -> int:
    return DIRECT_ALIGN if task.staged_bytes >= DIRECT_MIN_BYTES else _ALIGN


def slot_bytes(task: StageTask) -> int:
    """At most this many arena bytes hold the task: its bytes and its alignment padding."""
    return task.staged_bytes + _alignment(task)


def assign_offsets(tasks: list[StageTask]) -> tuple[list[StageTask], int]:
    """Slots in the arena: chunks large enough for O_DIRECT start on a DIRECT_ALIGN boundary.
    After the others, the batched ones (small chunks, never written with O_DIRECT), each
    dtype and shape back to back, for StageBatch's runs."""
    rest: list[StageTask] = []
    alike: dict[tuple[torch.dtype, tuple[int, ...]], list[StageTask]] = {}
    for t in tasks:
        if t.batched:
            alike.setdefault((t.dtype, t.piece_shape), []).append(t)
        else:
            rest.append(t)
    out, pos = [], 0
    for t in rest:
        align = _alignment(t)
        pos = -(-pos // align) * align
        out.append(dataclasses.replace(t, offset=pos))
        pos += t.staged_bytes
    for run in alike.values():
        pos = -(-pos // _ALIGN) * _ALIGN
        for t in run:  # (each a whole number of its dtype's items)
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
    dtype = task.dtype
    if task.sliver is not None:
        shape = task.sliver.shape
    else:
        shape = () if task.chunk.inline and not task.array.chunk_shape else task.array.chunk_shape
    numel = 1 if task.chunk.inline else math.prod(shape)
    raw = arena[task.offset : task.offset + numel * itemsize(task.array.spec.data_type)]
    return raw.view(dtype).view(shape)


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
    chunk = task.chunk
    if not chunk.slivers:
        return chunk.offsets, chunk.shape
    lo = tuple(map(max, chunk.offsets, task.piece_offsets))
    hi = tuple(
        min(c + s, p + t) for c, s, p, t in zip(chunk.offsets, chunk.shape, task.piece_offsets, task.piece_shape)
    )
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _whole_piece(flat: np.ndarray, task: StageTask, data: torch.Tensor) -> bool:
    """Copy the task from `data`, its piece's tensor, if it is the most common kind, with no
    tensor views made: a chunk that is this rank's whole piece, fills its slot, and can go
    through memcpy. Whether it did."""
    chunk = task.chunk
    if task.sliver is not None or chunk.slivers or chunk.inline or chunk.offsets != task.piece_offsets:
        return False
    if chunk.shape != task.array.chunk_shape or chunk.shape != task.piece_shape:  # (an edge chunk is padded)
        return False
    if data.numel() < _MEMCPY_MIN or not data.is_contiguous() or data.is_conj() or data.is_neg():
        return False
    np.copyto(flat[task.offset : task.offset + task.staged_bytes], host_bytes(data), casting="no")
    return True


def _copy_one(arena: torch.Tensor, task: StageTask, data: torch.Tensor, non_blocking: bool) -> None:
    offsets, shape = _own_part(task)
    src = data[tuple(slice(c - p, c - p + s) for c, p, s in zip(offsets, task.piece_offsets, shape))]
    dst = chunk_view(arena, task)
    if tuple(shape) == tuple(dst.shape):
        if _memcpy_ok(src, dst):
            # glibc memcpy through numpy (GIL released): ~10 GB/s on two threads here, where
            # torch's copy_ reaches ~5.5 GB/s; the staging copy is the training stall.
            np.copyto(host_bytes(dst), host_bytes(src), casting="no")
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
    data: Sequence[torch.Tensor],
    pool: ThreadPoolExecutor | None,
    after: torch.cuda.Event | None = None,
    copied: Callable[[Sequence[StageTask]], None] | None = None,
    gpu: bool = True,
    batch: StageBatch | None = None,
) -> None:
    """Copy every task into the arena from `data`, the save's tensors (a task's at its
    `leaf`); returns when all bytes are in host memory.

    CUDA sources are read once the work queued before `after` (an event recorded by the
    caller) is done, or, without it, the work queued so far on the current stream.
    `copied(tasks)` is called as tasks' bytes are in the arena (CUDA ones: after the CPU
    ones, each once its own event on the side stream has fired). `gpu=False` says that no
    task's piece is on a GPU (save() knows it from describing them): the tasks are then
    not looked at one by one to find out. `batch`: the StageBatch `tasks` are, all of its
    tasks in its order (its positions, sources and views then serve the batched copy).
    Even when interrupted, no copy into the arena is still running when this returns or
    raises."""
    cuda_tasks: list[StageTask] = []
    cpu_tasks = tasks
    if gpu:
        cuda_tasks = [t for t in tasks if t.cuda]
        cpu_tasks = [t for t in tasks if not t.cuda] if cuda_tasks else tasks
    device = data[cuda_tasks[0].leaf].device if cuda_tasks else None
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
                        _copy_one(arena, t, data[t.leaf], non_blocking=True)
                        if copied is not None:  # one event per chunk: its writer may start once it is here
                            landed.append(torch.cuda.Event())  # type: ignore[no-untyped-call]
                            landed[-1].record(stream)
            _copy_cpu(arena, cpu_tasks, data, pool, copied, batch if cpu_tasks is tasks else None)
            for t, event in zip(cuda_tasks, landed):
                event.synchronize()
                assert copied is not None
                copied([t])
        finally:
            if stream is not None:  # no DMA into the arena may outlive this call, even on an error
                stream.synchronize()


def _unit_bytes(u: StageTask | _Run) -> int:
    return u.nbytes if isinstance(u, _Run) else u.staged_bytes


def _copy_cpu(
    arena: torch.Tensor,
    tasks: list[StageTask],
    data: Sequence[torch.Tensor],
    pool: ThreadPoolExecutor | None,
    copied: Callable[[Sequence[StageTask]], None] | None,
    batch: StageBatch | None = None,
) -> None:
    slow = faults_armed()  # the environment is read once per copy, not once per chunk
    flat = arena.numpy()

    def copy(t: StageTask) -> None:
        if slow:
            fault_delay("stage", t.chunk.writer)  # a slow copy, for tests of writes overlapping it
        src = data[t.leaf]
        if not _whole_piece(flat, t, src):
            _copy_one(arena, t, src, False)
        if copied is not None:
            copied((t,))

    # Small chunks that their pieces fill: one C++ call for each run of them and one for the
    # rest (not under armed faults, whose per-chunk delays the tests of overlapping writes
    # rely on).
    batched: list[StageTask] = []
    views: list[torch.Tensor] = []
    sources: _Tensors = []
    runs: list[_Run] = []
    if not slow:
        if batch is not None:
            runs = batch.runs
            batched = [tasks[i] for i in batch.joint]
            if batched:
                views, sources = batch.views(arena), batch.sources(data)
            tasks = [tasks[i] for i in batch.single]
        else:
            batched = [t for t in tasks if t.batched]
            if batched:
                views, sources = [t.view(arena) for t in batched], [data[t.leaf] for t in batched]
                tasks = [t for t in tasks if not t.batched]

    def copy_batched(part: list[StageTask], into: list[torch.Tensor], src: _Tensors) -> None:
        if part:
            torch._foreach_copy_(into, src)
            if copied is not None:
                copied(part)

    def copy_run(run: _Run) -> None:
        run.copy(arena, data)
        if copied is not None:
            copied(run.tasks)

    # Many small chunks: half in each lane (torch releases the GIL inside _foreach_copy_).
    halves: tuple[list[StageTask], list[StageTask]] = (batched, [])
    into: tuple[list[torch.Tensor], list[torch.Tensor]] = (views, [])
    srcs: tuple[_Tensors, _Tensors] = (sources, [])
    if pool is not None and len(batched) >= _BATCH_SPLIT_MIN:
        mid = len(batched) // 2
        halves, into = (batched[:mid], batched[mid:]), (views[:mid], views[mid:])
        srcs = (sources[:mid], sources[mid:])
    # Two lanes balanced by cost (bytes, and Python per chunk); numpy and torch release the
    # GIL while copying. Chunks and runs under _LANE_MIN_BYTES all stay on this thread:
    # split over both lanes, their Python would pass the GIL between the threads at every one.
    big: list[StageTask | _Run] = sorted(
        [*(t for t in tasks if t.staged_bytes >= _LANE_MIN_BYTES), *(r for r in runs if r.nbytes >= _LANE_MIN_BYTES)],
        key=_unit_bytes,
        reverse=True,
    )
    if pool is None or (len(big) < 2 and not halves[1]):
        for r in runs:
            copy_run(r)
        copy_batched(batched, views, sources)
        for t in tasks:
            copy(t)
        return
    small: list[StageTask | _Run] = [
        *(r for r in runs if r.nbytes < _LANE_MIN_BYTES),
        *(t for t in tasks if t.staged_bytes < _LANE_MIN_BYTES),
    ]
    lanes: list[list[StageTask | _Run]] = [[], []]
    if big:
        loads = [sum(_unit_bytes(u) + _CHUNK_COST_BYTES for u in small), 0]
        for i, half in enumerate(halves):
            loads[i] += sum(t.staged_bytes + _BATCH_COST_BYTES for t in half)
        for u in big:
            i = 0 if loads[0] <= loads[1] else 1
            lanes[i].append(u)
            loads[i] += _unit_bytes(u) + _CHUNK_COST_BYTES
    lanes[0].extend(small)

    def copy_unit(u: StageTask | _Run) -> None:
        if isinstance(u, _Run):
            copy_run(u)
        else:
            copy(u)

    first = (lanes[0] or lanes[1])[0] if lanes[0] or lanes[1] else batched[0]
    rank = (first.tasks[0] if isinstance(first, _Run) else first).chunk.writer
    group = LaneGroup(pool)

    def other_lane() -> None:
        if not group.stop.is_set():  # (set: this thread failed or was interrupted)
            copy_batched(halves[1], into[1], srcs[1])
        for u in lanes[1]:
            if group.stop.is_set():
                return
            copy_unit(u)

    try:
        group.start(other_lane)
        fault_delay("lane-started", rank)
        copy_batched(halves[0], into[0], srcs[0])
        for u in lanes[0]:
            copy_unit(u)
    except BaseException:
        group.join(cancel=True)  # even through Ctrl-C: no lane may write into the arena after we return
        raise
    group.join()
    if group.errors:
        raise group.errors[0]
