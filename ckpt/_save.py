"""The save pipeline of one Checkpointer: from save() to a queued commit.

save() describes the state (ckpt._tree, ckpt._tensors), agrees with the other ranks on
the layout and the save's id (one collective), copies what must be copied before it
returns into the reused staging buffer (ckpt._staging), and queues the commit on the
background thread (ckpt._commit). With deferred staging the commit thread copies the
optimizer-owned tensors (ckpt._deferred); with overlap_writes the writers start on each
chunk as it lands. At most one save is in flight.

From the ranks' last collective in save() to its return, every exception (Ctrl-C, a
SIGTERM handler's SystemExit) still queues the commit, failed, so no other rank waits
for this one until the collective timeout, and no copy is left running into the buffer.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from ckpt._commit import RootContext, run_once
from ckpt._cores import rank_cores
from ckpt._deferred import StagingGate, Versions, deferrable_leaves, find_optimizers
from ckpt._dist import Comm
from ckpt._exchange import Schedule, schedule
from ckpt._gc import no_cyclic_gc
from ckpt._job import SaveJob, SaveRequest, SaveStats
from ckpt._plan import agree_plans, layout_key
from ckpt._staging import Arena, Readiness, StageBatch, StageTask, assign_offsets, slot_bytes, stage
from ckpt._tensors import Described, Describer
from ckpt._tree import EncodeMemo, Leaves, encode_state
from ckpt._write import open_tree, write_tasks
from ckpt.config import CheckpointerConfig
from ckpt.rng import capture_rng
from ckpt.store import commit, metrics
from ckpt.store.errors import CkptError, RankFailures, StateMismatchError, TierUnavailableError, VersionExistsError
from ckpt.store.faults import fault_delay, fault_point
from ckpt.store.layout import ArrayPlan, ChunkPlan, flat_index
from ckpt.store.tier import Tier
from ckpt.store.versions import is_committed

__all__ = ["Saver"]

log = logging.getLogger("ckpt")


def _with_buffers(ctl: Comm, plan: Schedule) -> Schedule:
    """The layout's exchange buffers (ckpt._exchange.Buffers), allocated on every rank, or
    the failure of any rank to allocate its own raised on every rank (collective)."""
    error: Exception | None = None
    try:
        plan = plan.allocate()
    except Exception as e:  # noqa: BLE001 - out of memory (torch's RuntimeError): every rank learns it
        error = e
    ctl.agree(error)
    return plan


def _staging_error(e: BaseException, step: int, root: str) -> BaseException:
    """What a failed copy reports through the commit: OSError as the documented type, an
    interruption (KeyboardInterrupt in save()) as an error rather than re-raised on a thread."""
    if isinstance(e, OSError) and not isinstance(e, CkptError):
        return TierUnavailableError(e.errno, f"cannot write step {step} to {root}: {e.strerror or e}")
    if not isinstance(e, Exception):
        return CkptError(f"staging of step {step} was interrupted by {type(e).__name__}")
    return e


def _batches(tasks: list[StageTask], limit: int | None) -> list[list[StageTask]]:
    """Batches of at most `limit` staged bytes, written one after another; the tasks of the
    sliver exchange all go in the last one, which the commit thread writes after the
    exchange (each is at most a chunk of GRID_BYTES, so they add little to it)."""
    if limit is None:
        return [tasks]
    out: list[list[StageTask]] = [[]]
    size = 0
    for t in [t for t in tasks if not t.exchanged]:
        if out[-1] and size + slot_bytes(t) > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += slot_bytes(t)
    out[-1].extend(t for t in tasks if t.exchanged)
    return out


class _Split(NamedTuple):
    """A staging batch's tasks, split by whether a deferred save copies their leaf later."""

    batch: StageBatch
    deferred_at: tuple[int, ...]  # the deferred leaves' places
    now: list[StageTask]  # copied in save()
    later: list[StageTask]  # copied by the commit thread
    watched: list[int]  # the leaves `later` copies, each once, in order


class Saver:
    """save(), wait() and their state: the staging buffer, the plan cache, the threads."""

    def __init__(
        self,
        config: CheckpointerConfig,
        ctl: Comm,
        data: Comm,
        ctx: RootContext,
        tier: Tier,
        *,
        on_commit: Callable[[int, bool], None] | None = None,
    ) -> None:
        self.config, self._ctl, self._data, self._ctx, self._tier = config, ctl, data, ctx, tier
        self._on_commit = on_commit  # called with the step and its milestone tag after each commit that succeeded
        self.rank = ctl.rank
        self._pending: Future[SaveStats] | None = None
        self.stats: list[SaveStats] = []
        # Steps newer than the one the last restore loaded that it passed over: committed
        # only in part (a lost node's), or holding fewer keys (params-only versions of the
        # run it resumes). The resumed run saves its own versions of those steps: a save of
        # one replaces the old version (as an overwrite: after its commit).
        self.passed_over: frozenset[int] = frozenset()
        self._plans: list[ArrayPlan] = []
        self._exchange = Schedule((), ())
        self._mine: list[tuple[ArrayPlan, ChunkPlan]] = []  # the chunks this rank writes
        self._by_name: dict[str, ArrayPlan] = {}
        self._plan_sig: int | None = None  # hash of this rank's layout when self._plans was made
        self._encoded = EncodeMemo()  # the last save's encoded mappings, by name
        self._describe = Describer()  # and its leaves' specs
        # Each staging batch's tasks and arena size: a function of the plans and of the
        # leaves' order (which the signature covers), so computed by the layout's first save
        # and reused by the next ones; with the leaves' names they were made for.
        self._batches: list[StageBatch] | None = None
        self._batch_names: list[str] = []
        self._last_split: _Split | None = None  # the last deferred save's (_split)
        self._layout = ""  # the plans' layout_key
        self.last_partial = False  # whether the last save that went on is a params-only version (every rank alike)
        self._arena = Arena()
        self.gate = StagingGate()
        # save()'s thread is the first copy thread: copy_threads=1 copies on it alone.
        self._copy_pool = (
            ThreadPoolExecutor(config.copy_threads - 1, thread_name_prefix="ckpt-copy")
            if config.copy_threads > 1
            else None
        )
        self._writer_pool = ThreadPoolExecutor(config.writer_threads, thread_name_prefix="ckpt-write")
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")

    @property
    def root(self) -> str:
        return self._ctx.root

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        overwrite: bool,
        milestone: bool,
        named: Sequence[str] | None = None,
        partial: bool = False,
    ) -> bool:
        """`named`: the top-level keys chosen (`only=`, or the full_every schedule; every
        rank names some, or none does), of which `state` holds those this rank has; each
        must be held by some rank. `partial`: they leave some of this rank's state out. The
        version is a params-only one where they do on any rank (then `last_partial`)."""
        started = time.perf_counter()
        if self.config.if_busy == "skip":
            busy = self._pending is not None and not self._pending.done()
            if self._ctl.any(busy):
                log.info("rank %d step %d: skipped, a save is still in flight", self.rank, step)
                return False
        self.wait()
        # The stall allocates a few small objects per tensor: cyclic collections they would
        # trigger walk the training process's whole heap (ckpt/_gc.py), inside the stall.
        with no_cyclic_gc(promote=True):
            return self._save(
                step, state, started, overwrite=overwrite, milestone=milestone, named=named, partial=partial
            )

    def _check_held(self, keys: Sequence[str], state: Mapping[str, Any], *, same: bool) -> None:
        """Collective, where some rank lacks a key it names: ValueError on every rank unless
        each key named is held by some rank (one all-reduce of a flag per key). Ranks that
        name different keys must each hold all they name."""
        if not same:
            lacks = [k for k in keys if k not in state]
            raise ValueError(
                "save(): the ranks name different keys in only=, and "
                + (f"this rank's state has no {lacks}" if lacks else "another rank's state lacks some it names")
            )
        held = self._ctl.reduce_max([int(k in state) for k in keys])
        nowhere = [k for k, h in zip(keys, held) if not h]
        if nowhere:
            raise ValueError(f"only= / partial_keys name keys no rank's state has: {nowhere}")

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        started: float,
        *,
        overwrite: bool,
        milestone: bool,
        named: Sequence[str] | None,
        partial: bool,
    ) -> bool:
        described = Described([], [], [], 0, False, {})
        sig = 0  # this rank's layout signature
        leaves = Leaves()
        deferred_at: tuple[int, ...] = ()  # the places of the leaves copied after save() returns
        cuda = False  # whether any piece is on a GPU (the staging buffer is pinned then)
        tree: Any = None
        rng = None
        error: BaseException | None = None
        try:
            tree, leaves = encode_state(state, self._encoded)
            described = self._describe(leaves.paths, leaves.values)
            sig, cuda = described.signature, described.cuda
            if self.config.deferred_staging:
                owned = self.gate.owned_storages(find_optimizers(state))
                deferred_at = deferrable_leaves(leaves.values, described.data, owned)
            rng = capture_rng() if self.config.capture_rng else None
            if step in self.passed_over:
                overwrite = True  # on every rank alike: the restore's listing was gathered
                if self._ctx.is_leader and is_committed(self._tier, step):
                    log.warning("%s: step %d replaces the version the restore passed over", self.root, step)
            elif self._ctx.is_leader and is_committed(self._tier, step):
                if not overwrite:
                    raise VersionExistsError(f"step {step} is already committed under {self.root}; pass overwrite=True")
        except Exception as e:  # noqa: BLE001 - every rank must reach the collective below, then raises alike
            error = e
        # One all-reduce of a few integers: whether any rank failed, whether any rank's
        # layout changed since the last plan, and rank 0's random save id (the others give 0s).
        # Also each rank's step, overwrite, milestone and whether it names keys, and their
        # negatives: all alike, or an error; whether any rank's keys leave some of its state
        # out, whether any rank lacks a key it names, and whether all name the same keys.
        ids = [secrets.randbits(63), secrets.randbits(63)] if self.rank == 0 else [0, 0]
        args = [step, int(overwrite), int(milestone), int(named is not None)]
        keys = sorted(set(named or ()), key=repr)  # (repr: keys of any type, never a TypeError before the agreement)
        lacks = any(k not in state for k in keys)
        keys_sig = [len(keys), zlib.crc32(repr(keys).encode())]
        failed, changed, narrowed, lacking, *rest = self._ctl.reduce_max(
            [int(error is not None), int(sig != self._plan_sig), int(partial and named is not None), int(lacks)]
            + [*ids, *args, *keys_sig]
            + [-a for a in [*args, *keys_sig]]
        )
        id_parts, highs, lows = rest[:2], rest[2:8], [-x for x in rest[8:]]
        partial = bool(narrowed)
        if failed:  # rare: only now does each rank's error text cross, so that every rank can name it
            info = self._ctl.all_gather(None if error is None else (type(error).__name__, str(error)))
            if error is not None:
                raise error
            failures = {r: f"{e[0]}: {e[1]}" for r, e in enumerate(info) if e}
            exists = [e for e in info if e and e[0] == VersionExistsError.__name__]
            raise VersionExistsError(exists[0][1]) if exists else RankFailures(failures)
        if highs[:4] != lows[:4]:
            raise ValueError(
                f"save(): the ranks pass different steps ({lows[0]}..{highs[0]}), overwrite, milestone or only= flags"
            )
        if lacking:  # (a pipeline stage's rank, or a name no rank has)
            self._check_held(keys, state, same=highs[4:] == lows[4:])
        self.last_partial = partial
        if changed:  # the first save of a layout: plan its chunks (ckpt._plan)
            self._plan_sig, self._batches, self._last_split = None, None, None
            positional = {n for n, path in leaves.paths.items() if any(type(k) is int for k in path)}
            self._plans = agree_plans(self._ctl, described.pieces, self.config.split_bytes, positional)
            self._exchange = schedule(self._plans, self.rank)
            if any(plan.slivers for plan in self._plans):  # (the plans are the job's: every rank agrees)
                self._exchange = _with_buffers(self._ctl, self._exchange)
            self._mine = [(plan, chunk) for plan in self._plans for chunk in plan.chunks_of(self.rank)]
            self._by_name = {plan.spec.name: plan for plan in self._plans}
            self._layout = layout_key(self._plans, self._ctx.root_groups)
            self._plan_sig = sig
        request = SaveRequest(
            step=step,
            save_id="".join(f"{p:016x}" for p in id_parts),
            overwrite=overwrite,
            milestone=milestone,
            partial=partial,
            plans=self._plans,
            exchange=self._exchange,
            tree=tree,
            rng=rng,
            check_finite=self.config.check_finite,
            direct_io=self.config.direct_io,
            layout=self._layout,
            started=started,
        )
        job = SaveJob(request, self._arena.get(0, False), described.data)
        # From here on no rank waits for another in save(): whatever interrupts this one
        # must still queue its commit, to fail on every rank, and leave no copy running
        # into the staging buffer.
        try:
            self._stage_and_queue(job, described, leaves, deferred_at, cuda)
        except BaseException as e:
            # A second interrupt may strike while this handler runs (Ctrl-C pressed twice):
            # failing and queueing again is harmless (SaveJob.fail, run_once), so it is
            # tried until it has run to its end, and the first interruption is raised. No
            # call lies between the handler's entry and the try below, and Python runs
            # signal handlers only at calls and backward jumps.
            while True:
                try:
                    self._fail_save(job, e)
                    break
                except BaseException:  # noqa: BLE001 - the first interruption is raised below
                    continue
            raise
        return True

    def _stage_and_queue(
        self,
        job: SaveJob,
        described: Described,
        leaves: Leaves,
        deferred_at: tuple[int, ...],
        pin: bool,
    ) -> None:
        step, save_id = job.step, job.request.save_id
        now: list[StageTask] = []  # save()'s copy still to make: before the job is queued, or while it writes
        whole: StageBatch | None = None  # the batch `now` is all of, in its order
        data = described.data
        try:
            batches = self._placed(described)
            for i, batch in enumerate(batches):
                placed = batch.tasks
                job.arena = self._arena.get(batch.size, pin)
                job.tasks = placed
                if i < len(batches) - 1:  # bounded staging: write this batch before reusing the buffer
                    stage(job.arena, placed, data, self._copy_pool, gpu=pin, batch=batch)
                    tmp_dir = os.path.join(self.root, commit.tmp_dirname(step, save_id))
                    open_tree(job, self.root, tmp_dir, self._ctx.root_groups[self._ctx.root_index])
                    write_tasks(job, tmp_dir, self._writer_pool)
                    continue
                job.ready = Readiness(placed)
                now, whole = placed, batch
                split = self._split(batch, deferred_at) if deferred_at else None
                if split is not None:
                    now, whole = split.now, None
                if split is not None and split.later:  # the rest now; the deferred part is the commit thread's
                    stage(job.arena, now, data, self._copy_pool, copied=job.ready.mark, gpu=pin)
                    now = []
                    job.deferred = self._defer(job.arena, split, data, leaves, pin)
        except Exception as e:  # noqa: BLE001 - reported through the commit so every rank aborts together
            job.error = _staging_error(e, step, self.root)
        if job.error is not None:
            job.tasks, job.ready, job.deferred, now, whole = [], None, None, [], None
        ready = job.ready if job.deferred is None else None  # save()'s own copy, still to make
        job.overlap = job.ready is not None and self._overlap_writes(pin)
        copy_while_queued = ready is not None and job.overlap  # the writers take each chunk as it lands
        if not copy_while_queued:
            if ready is not None:
                self._copy_now(job, now, ready, pin, whole)
            self._stalled(job, ready)
        if job.deferred is not None:
            self.gate.close()  # optimizer steps wait from here until the commit thread has copied
        self._queue(job)
        if copy_while_queued:
            assert ready is not None
            self._copy_now(job, now, ready, pin, whole)
            self._stalled(job, ready)

    def _placed(self, described: Described) -> list[StageBatch]:
        """This save's staging batches: the layout's tasks at their arena offsets, made by
        its first save."""
        # The same names in the same order, as the signature says: compared all the same, as
        # the tasks find each tensor by its place (~20 us; the strings are the last save's).
        if self._batches is not None and described.names == self._batch_names:
            return self._batches
        names = set(described.names)
        unplanned = sorted(names - set(self._by_name))
        if unplanned:  # its mesh's lowest rank has no such array
            raise StateMismatchError(f"{unplanned[:5]} of rank {self.rank}'s state are not in the job's layout")
        absent = sorted({plan.spec.name for plan, _ in self._mine} - names)
        if absent:  # its mesh names this rank, which has no such array
            raise StateMismatchError(f"{absent[:5]} are in the job's layout with rank {self.rank}, not in its state")
        batches = [assign_offsets(b) for b in _batches(self._tasks(described), self.config.max_staging_bytes)]
        self._batches = [StageBatch.of(placed, size) for placed, size in batches]
        self._batch_names = described.names
        return self._batches

    def _tasks(self, described: Described) -> list[StageTask]:
        """What this rank copies: the chunks it writes and the parts of others' chunks it sends."""
        pieces = described.pieces
        leaf = {name: i for i, name in enumerate(described.names)}
        tasks = [StageTask.of(plan, chunk, leaf[plan.spec.name], pieces[plan.spec.name]) for plan, chunk in self._mine]
        for send in self._exchange.sends:  # the parts of other ranks' chunks that this rank sends
            plan = self._by_name[send.chunk[0]]
            chunk = plan.chunk(flat_index(send.chunk[1], plan.grid))
            name = plan.spec.name
            tasks.append(StageTask.of(plan, chunk, leaf[name], pieces[name], sliver=send.sliver))
        return tasks

    def _copy_now(
        self, job: SaveJob, tasks: list[StageTask], ready: Readiness, pin: bool, batch: StageBatch | None
    ) -> None:
        """save()'s copy into the arena, each chunk marked ready as it lands. A failure fails
        the commit (on every rank); an interruption propagates (to _fail_save). `batch`: the
        StageBatch `tasks` are all of, if they are."""
        try:
            stage(job.arena, tasks, job.data, self._copy_pool, copied=ready.mark, gpu=pin, batch=batch)
        except Exception as e:  # noqa: BLE001 - the commit raises it, on every rank
            ready.fail(_staging_error(e, job.step, self.root))

    def _queue(self, job: SaveJob) -> None:
        """Queue the job's commit; again is harmless (run_once)."""
        self._committer.submit(run_once, job, self._ctx, self._data, self._writer_pool, self.config.straggler_threshold)
        if self._on_commit is not None:
            on_commit, step, milestone = self._on_commit, job.step, job.request.milestone
            job.outcome.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else on_commit(step, milestone)
            )
        fault_delay("queued", self.rank)
        self._pending = job.outcome

    def _fail_save(self, job: SaveJob, e: BaseException) -> None:
        """save() was interrupted after the ranks' last collective: make the commit fail on
        every rank instead of waiting for a copy that will not be reported, and queue it if
        it may not be queued yet (no rank must wait for this one until the timeout)."""
        if job.fail(_staging_error(e, job.step, self.root)):
            self.gate.open()  # not started: it runs no deferred copy
        fault_delay("fail-save", self.rank)
        self._queue(job)

    def _stalled(self, job: SaveJob, ready: Readiness | None) -> None:
        """save()'s part is over: record the stall, then let the commit use what was copied
        (it reports the stats, so they are set first)."""
        job.stats.stage_s = time.perf_counter() - job.request.started
        if job.deferred is None:
            job.stats.staged_s = job.stats.stage_s
        fault_delay("after-stage", self.rank)
        fault_point("after-stage", self.rank)
        metrics.SAVE_STALL.observe(job.stats.stage_s)
        if ready is not None:
            ready.done()  # a no-op after a failed copy: result() raises its error

    def _overlap_writes(self, cuda: bool) -> bool:
        if self.config.overlap_writes is not None:
            return self.config.overlap_writes
        if cuda:  # the copy is DMA: the host's cores are free for the writers
            return True
        return rank_cores() >= self.config.copy_threads + self.config.writer_threads

    def _split(self, batch: StageBatch, deferred_at: tuple[int, ...]) -> _Split:
        """`batch`'s tasks split by whether their leaf is deferred (made again only when the
        batch or the deferred leaves change)."""
        last = self._last_split
        if last is not None and last.batch is batch and last.deferred_at == deferred_at:
            return last
        at = set(deferred_at)
        # Slivers are copied now, deferrable or not: the exchange sends them before any chunk
        # is written, and marks nothing a deferred copy would make.
        now = [t for t in batch.tasks if t.leaf not in at or t.sliver is not None]
        later = [t for t in batch.tasks if t.leaf in at and t.sliver is None]
        self._last_split = _Split(batch, deferred_at, now, later, list(dict.fromkeys(t.leaf for t in later)))
        return self._last_split

    def _defer(
        self, arena: torch.Tensor, split: _Split, data: Sequence[torch.Tensor], leaves: Leaves, gpu: bool
    ) -> Callable[[SaveJob], None]:
        """The copy of `split.later` from `data` (the save's tensors) that the commit thread
        makes before writing (deferred staging). `gpu=False`: no task's piece is on a GPU (as
        for stage())."""
        tasks = split.later
        after = None
        device = next((data[t.leaf].device for t in tasks if t.cuda), None) if gpu else None
        if device is not None:  # the values as of this save(): the work queued so far on its stream
            after = torch.cuda.Event()  # type: ignore[no-untyped-call]
            after.record(torch.cuda.current_stream(device))
        # Each deferred leaf's tensor, and the DTensor it was taken from, with its key path,
        # in the leaves' order (the error names the first few that changed).
        all_paths, values = list(leaves.paths.values()), leaves.values
        tensors: list[torch.Tensor] = []
        paths: list[tuple[Any, ...]] = []
        for i in split.watched:
            own, value = data[i], values[i]
            tensors.append(own)
            paths.append(all_paths[i])
            if value is not own and isinstance(value, torch.Tensor):
                tensors.append(value)
                paths.append(all_paths[i])
        versions = Versions(paths, tensors)

        def copy(job: SaveJob) -> None:
            assert job.ready is not None
            try:
                stage(arena, tasks, data, self._copy_pool, after=after, copied=job.ready.mark, gpu=device is not None)
                versions.check()
            except BaseException as e:  # noqa: BLE001 - the commit raises it, on every rank
                job.ready.fail(_staging_error(e, job.step, self.root))
            else:
                job.ready.done()
            finally:
                job.stats.staged_s = time.perf_counter() - job.request.started
                self.gate.open()

        return copy

    def wait(self) -> None:
        """Block until the pending save is committed; raise its error if it failed."""
        pending = self._pending
        if pending is None:
            return
        try:
            stats = pending.result()
        finally:
            # Forgotten only once it has ended: a wait interrupted by a signal (a SIGTERM
            # handler's SystemExit, then an emergency save) must not let the next save
            # reuse the staging buffer while this one still reads or writes it.
            if pending.done():
                self._pending = None
        self.stats.append(stats)
        # Replaced once committed (every rank alike: a commit ends alike on all of them): a
        # later save of the step is an ordinary one, refused unless it says overwrite.
        self.passed_over = self.passed_over - {stats.step}

    def close(self) -> None:
        """Stop the threads and free the buffer (after wait())."""
        for pool in (self._committer, self._writer_pool, self._copy_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self.gate.open()  # a failed save may have left it closed
        self.gate.remove_hooks()
        self._batches, self._last_split = None, None  # (their views of the arena hold its memory)
        self._arena.release()
