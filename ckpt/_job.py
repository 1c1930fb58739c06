"""The records of one save as it passes from save() to the commit thread and across ranks.

Ownership, in order:
- save() builds a frozen `SaveRequest` (what to save, decided once) and a `SaveJob`;
- save() fills the job's staging part (`arena`, `data`, `tasks`, `ready`, `deferred`, `overlap`,
  `error`) and queues it; from then on only the commit thread reads it, except
  `SaveJob.fail`, which save()'s interrupt path calls under the job's claim lock;
- the commit thread owns the writing part (`written`) and `stats` (save() sets the
  stall figures in `stats` before the commit can read them: `ready.done()` orders it);
- each rank's result crosses to rank 0 as a frozen `RankReport`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt._exchange import ChunkKey, Schedule
from ckpt._staging import Readiness, StageTask
from ckpt.store.layout import ArrayPlan

__all__ = ["SaveStats", "SaveRequest", "SaveJob", "Written", "ChunkRecord", "RankTimings", "RankReport"]


@dataclass
class SaveStats:
    """Per-rank timings of one save, in seconds."""

    step: int
    milestone: bool = False  # the save's tag (milestone=True)
    stage_s: float = 0.0  # the training stall: staging copy (and any bounded-memory writes)
    write_s: float = 0.0  # chunk files written and fsynced, after the copy ended (overlap_writes: the tail)
    first_write_s: float | None = None  # save() call to the first chunk written (< stage_s with overlap_writes)
    fsync_s: float = 0.0  # directories fsynced
    commit_s: float = 0.0  # gather, prepare and publish
    total_s: float = 0.0  # save() call to committed
    staged_s: float = 0.0  # save() call to every tensor copied (later than stage_s with deferred staging)
    bytes_written: int = 0
    direct_bytes: int = 0  # of bytes_written, written with O_DIRECT (CheckpointerConfig.direct_io)


@dataclass(frozen=True)
class SaveRequest:
    """What one save writes, as save() decided it on every rank."""

    step: int
    save_id: str  # the same on every rank
    overwrite: bool
    milestone: bool  # tagged for milestone retention
    partial: bool  # a params-only version (only=, or the full_every schedule): not the whole state
    plans: Sequence[ArrayPlan]  # the chunk layout, the same on every rank
    exchange: Schedule  # the slivers this rank sends and receives (straddling chunks)
    tree: Any  # this rank's JSON state tree
    rng: dict[str, Any] | None  # this rank's RNG state
    check_finite: bool  # refuse NaN/Inf in floating tensors
    direct_io: bool  # large chunks with O_DIRECT (store.fsio.write_chunk)
    layout: str = ""  # ckpt._plan.layout_key of the plans: which spare tree fits (store.spare)
    started: float = field(default_factory=time.perf_counter)  # save() was called (perf_counter)
    started_unix: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One written chunk, as the manifest will list it."""

    index: tuple[int, ...]
    xxh3: str
    inline: str | None  # the value's bytes as hex, for inline arrays
    blocks: tuple[str, ...]  # block digests; empty for a chunk checksummed as one block


@dataclass
class Written:
    """What the writers produced so far (bounded staging writes in batches); the commit
    thread's, after save() queued the job."""

    records: dict[str, list[ChunkRecord]] = field(default_factory=dict)  # by array
    inline_docs: set[str] = field(default_factory=set)  # inline arrays whose zarr.json is written
    dirs: set[str] = field(default_factory=set)  # directories created, to fsync
    rank_file: tuple[int, str] = (0, "")  # size and xxh3 of this rank's file, once written
    reused: bool = False  # this rank took a spare tree as the save's tmp directory (store.spare)


@dataclass
class SaveJob:
    """One save, from save() to its commit (see the module docstring for who touches what)."""

    request: SaveRequest
    arena: torch.Tensor  # the staging buffer of the last batch
    data: Sequence[torch.Tensor] = ()  # the save's tensors (Described.data), which the copy reads
    tasks: list[StageTask] = field(default_factory=list)  # the last staged batch, still to be written
    ready: Readiness | None = None  # which of `tasks` are staged yet; None: all of them
    deferred: Callable[[SaveJob], None] | None = None  # the copy left to the commit thread (deferred staging)
    overlap: bool = False  # the writers start while the copy goes on (CheckpointerConfig.overlap_writes)
    error: BaseException | None = None  # a failure while staging, reported through the commit
    received: dict[ChunkKey, list[torch.Tensor]] = field(default_factory=dict)  # slivers for this rank's chunks
    written: Written = field(default_factory=Written)
    stats: SaveStats = field(init=False)
    outcome: Future[SaveStats] = field(default_factory=Future)  # what wait() waits for
    _claim: threading.Lock = field(default_factory=threading.Lock)
    _claimed: bool = False  # the commit has started (under _claim)

    def __post_init__(self) -> None:
        self.stats = SaveStats(self.request.step, milestone=self.request.milestone)

    @property
    def step(self) -> int:
        return self.request.step

    def claim(self) -> bool:
        """Whether the caller is the one to run the commit (a job queued twice runs once)."""
        with self._claim:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def release(self) -> None:
        """Drop the save's references to the state (`data`: a tensor per leaf, some made
        during the save: a module's state_dict() makes a detached tensor object per
        parameter) before the outcome is set. Freed after it, on this thread, they would
        compete for the GIL with the next save(): each tensor's deallocation lets another
        thread run. (Not in save(): there they would add to the stall.)"""
        self.data, self.tasks, self.received, self.deferred = (), [], {}, None

    def fail(self, error: BaseException) -> bool:
        """save() was interrupted: the commit fails on every rank. If it has not started, it
        is failed at once and runs no deferred copy; True then."""
        if self.ready is not None:
            self.ready.fail(error)  # wakes writers and the commit waiting for save()'s copy
        with self._claim:
            if self._claimed:
                return False
            self.error = self.error or error
            self.deferred = None
            return True


@dataclass(frozen=True)
class RankTimings:
    """A rank's phases of one save, recorded in the manifest's meta (per rank: O(ranks))."""

    stage_s: float
    staged_s: float
    write_s: float
    fsync_s: float
    bytes: int
    started: float  # unix time of save(): with the manifest's `created`, the commit time

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RankReport:
    """What each rank sends rank 0 after writing: O(1) in the ranks and its own chunks (its
    digests, tree and RNG went into its rank file, which this covers by size and xxh3)."""

    error: str | None  # "TypeName: message" if this rank failed
    rank_file: tuple[int, str]  # size and xxh3 of ranks/<rank>.json
    inline: dict[str, tuple[str, str]]  # the single-element arrays it wrote: value hex and its xxh3
    keys: tuple[str, ...]  # the top-level keys of its state
    host: str
    root: str  # the rank's root (for the straggler report)
    root_index: int
    timings: RankTimings
