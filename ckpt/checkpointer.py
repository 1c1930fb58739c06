"""`Checkpointer`: the training loop's entry point (save, wait, restore, list).

It owns the per-job wiring: the root of each rank, the root lock, the staging arena,
the background commit thread and the plan cache. The format and the commit protocol
live in `store`, reading in `restore`; this module only sequences them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import platform
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from types import TracebackType
from typing import Any

import numpy as np
import torch

from ckpt._commit import RootContext, SaveJob, SaveStats, run_once, write_tasks
from ckpt._deferred import StagingGate, Versions, can_defer, find_optimizers
from ckpt._dist import destroy_comms, make_comms
from ckpt._gc import no_cyclic_gc
from ckpt._staging import Arena, Readiness, StageTask, assign_offsets, slot_bytes, stage
from ckpt._tensors import LocalPiece, describe
from ckpt._tree import bind, encode_state
from ckpt.config import CheckpointerConfig
from ckpt.replicator.core import Replicator, ReplicatorConfig
from ckpt.replicator.daemon import lock_root
from ckpt.restore.discover import choose_step, reachable_steps
from ckpt.restore.execute import ReadRequest, Source, full_tensor, load_arrays
from ckpt.restore.tiers import Candidate, LocalTier, RemoteTier, Tier
from ckpt.rng import capture_rng, restore_rng, seed_new_rank
from ckpt.store import commit, metrics
from ckpt.store.errors import (
    CkptError,
    CorruptVersionError,
    RankFailures,
    RootLockedError,
    StateMismatchError,
    TierUnavailableError,
    VersionExistsError,
    VersionNotFoundError,
)
from ckpt.store.faults import fault_delay, fault_point
from ckpt.store.fsio import makedirs
from ckpt.store.layout import ArrayPlan, ArraySpec, HeldRegion, plan_arrays
from ckpt.store.manifest import MANIFEST_NAME, Manifest, parse_manifest
from ckpt.store.objstore import is_url

__all__ = ["Checkpointer", "RootSpec"]

log = logging.getLogger("ckpt")

PathSpec = str | os.PathLike[str] | Callable[[int], "str | os.PathLike[str]"]
RootSpec = PathSpec | Sequence[PathSpec]
LocalSpec = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # name, dtype, global, offsets, local


def _resolve_root(root: PathSpec, rank: int) -> str:
    """A path, a callable of the rank, or a string with {rank}, {local_rank}, {node} or {hostname}."""
    if callable(root):
        return os.path.abspath(os.fspath(root(rank)))
    text = os.fspath(root)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    fields = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank % local_world)),
        "node": rank // local_world,
        "hostname": platform.node(),
    }
    try:
        return os.path.abspath(text.format(**fields)) if "{" in text else os.path.abspath(text)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"checkpoint root {text!r} has an unknown field: {e}") from None


def _merge_specs(per_rank: list[list[LocalSpec]]) -> list[ArraySpec]:
    merged: dict[str, tuple[str, tuple[int, ...], list[HeldRegion], int]] = {}
    for rank, entries in enumerate(per_rank):
        for name, dtype, gshape, offsets, lshape in entries:
            if name not in merged:
                merged[name] = (dtype, gshape, [], rank)
            first_dtype, first_shape, held, first = merged[name]
            if (dtype, gshape) != (first_dtype, first_shape):
                raise StateMismatchError(
                    f"{name}: rank {rank} holds {dtype}{list(gshape)}, rank {first} holds {first_dtype}{list(first_shape)}"
                )
            held.append(HeldRegion(rank, offsets, lshape))
    return [ArraySpec(n, d, s, tuple(h)) for n, (d, s, h, _) in merged.items()]


def _source(tier: Tier, step: int, cand: Candidate) -> Source:
    return Source(tier.version_dir(step), frozenset(cand.writers), tier.name, tier.fetcher(step))


def _staging_error(e: BaseException, step: int, root: str) -> BaseException:
    """What a failed copy reports through the commit: OSError as the documented type, an
    interruption (KeyboardInterrupt in save()) as an error rather than re-raised on a thread."""
    if isinstance(e, OSError) and not isinstance(e, CkptError):
        return TierUnavailableError(e.errno, f"cannot write step {step} to {root}: {e.strerror or e}")
    if not isinstance(e, Exception):
        return CkptError(f"staging of step {step} was interrupted by {type(e).__name__}")
    return e


def _copy_now(job: SaveJob, tasks: list[StageTask], ready: Readiness, pool: ThreadPoolExecutor, root: str) -> None:
    """save()'s copy into the arena, each chunk marked ready as it lands. A failure fails the
    commit (on every rank); an interruption propagates (to Checkpointer._fail_save)."""
    try:
        stage(job.arena, tasks, pool, copied=ready.mark)
    except Exception as e:
        ready.fail(_staging_error(e, job.step, root))


def _batches(tasks: list[StageTask], limit: int | None) -> list[list[StageTask]]:
    if limit is None:
        return [tasks]
    out: list[list[StageTask]] = [[]]
    size = 0
    for t in tasks:
        if out[-1] and size + slot_bytes(t) > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += slot_bytes(t)
    return out


class Checkpointer:
    """Asynchronous, atomic checkpoints of a training job's full state.

    Collective under torch.distributed: every rank constructs it, saves and restores
    together. `root` may differ per rank (node-local disks): pass a callable of the
    rank or a string with {rank}, {local_rank}, {node} or {hostname}. `tiers` are
    further places restore() reads from, in order: local paths (replica disks) or fsspec
    URLs (s3://bucket/prefix, configured by AWS_* variables or `storage_options`).
    """

    def __init__(
        self,
        root: RootSpec,
        *,
        tiers: Sequence[PathSpec | Tier] = (),
        storage_options: Mapping[str, Any] | None = None,
        replicate_to: str | None = None,
        replication: ReplicatorConfig | None = None,
        config: CheckpointerConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.config = replace(config or CheckpointerConfig(), **overrides)
        self._ctl, self._data = make_comms(self.config.timeout)
        self.rank, self.world = self._ctl.rank, self._ctl.world
        self._closed = True
        self._lock: commit.RootLock | None = None
        self._pending: Future[SaveStats] | None = None
        self._stats: list[SaveStats] = []
        self._plans: list[ArrayPlan] = []
        self._plan_sigs: list[int] | None = None
        self._arena = Arena()
        self._gate = StagingGate()
        self._replicator: Replicator | None = None
        self._replicator_thread: threading.Thread | None = None
        self._replicator_lock: int | None = None
        node_roots = self._node_roots(root)
        if node_roots:
            self.root = node_roots[self._local_rank() % len(node_roots)]
        else:
            self.root = _resolve_root(root, self.rank)  # type: ignore[arg-type]
        self._ctx = self._open_root()
        self._tier = LocalTier(self.root)
        replication = self._replication_config(replication, replicate_to, storage_options, node_roots)
        extra = list(tiers) + ([replication.remote] if replication and replication.remote else [])
        self._tiers: list[Tier] = [self._tier] + [self._open_tier(t, storage_options) for t in extra]
        self._replica_roots = [r for r in (node_roots or [self.root]) if not is_url(r)]
        try:
            self._recover()
            self._replicator_lock = self._lock_replicator(replication)
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        if replication is not None and self._ctx.is_leader:
            self._replicator = Replicator([self.root], replication)
            self._replicator_thread = threading.Thread(target=self._replicator.run, name="ckpt-replicator", daemon=True)
            self._replicator_thread.start()
        if self.config.metrics_port is not None:
            metrics.serve(self.config.metrics_port + self._local_rank())
        self._copy_pool = ThreadPoolExecutor(max(1, self.config.copy_threads - 1), thread_name_prefix="ckpt-copy")
        self._writer_pool = ThreadPoolExecutor(self.config.writer_threads, thread_name_prefix="ckpt-write")
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")
        self._closed = False

    # -- opening ---------------------------------------------------------------------

    def _node_roots(self, root: RootSpec) -> list[str] | None:
        """Several local disks per node: `root` given as a list; ranks of a node are spread over them."""
        if isinstance(root, (list, tuple)):
            if not root:
                raise ValueError("root list is empty")
            return [_resolve_root(r, self.rank) for r in root]
        return None

    def _local_rank(self) -> int:
        """This rank's index among the ranks of its host (LOCAL_RANK when torchrun sets it)."""
        if "LOCAL_RANK" in os.environ:
            return int(os.environ["LOCAL_RANK"])
        hosts = self._ctl.all_gather(platform.node())
        return sum(1 for h in hosts[: self.rank] if h == hosts[self.rank])

    def _replication_config(
        self,
        replication: ReplicatorConfig | None,
        replicate_to: str | None,
        storage_options: Mapping[str, Any] | None,
        node_roots: list[str] | None,
    ) -> ReplicatorConfig | None:
        if replication is None and replicate_to is None:
            return None
        others = tuple(r for r in (node_roots or []) if r != self.root)
        if replication is None:
            return ReplicatorConfig(
                replicas=2 if others else 1,
                replica_roots=others,
                remote=replicate_to,
                storage_options=dict(storage_options or {}),
            )
        return replace(
            replication, remote=replicate_to or replication.remote, replica_roots=replication.replica_roots or others
        )

    def _replica_tiers(self) -> list[Tier]:
        """Copies the replicator made of any root of this node (found again on every restore)."""
        out: list[Tier] = []
        for r in self._replica_roots:
            base = os.path.join(r, "replicas")
            try:
                names = sorted(os.listdir(base))
            except OSError:  # none there, or the disk has failed
                continue
            out += [LocalTier(os.path.join(base, d)) for d in names if os.path.isdir(os.path.join(base, d))]
        return out

    def _open_tier(self, spec: PathSpec | Tier, storage_options: Mapping[str, Any] | None) -> Tier:
        if isinstance(spec, Tier):
            return spec
        if isinstance(spec, str) and is_url(spec):
            return RemoteTier(spec, storage_options, cache_dir=os.path.join(self.root, ".cache"))
        return LocalTier(_resolve_root(spec, self.rank))

    def _open_root(self) -> RootContext:
        key: str | None = None
        error = None
        try:
            makedirs(self.root)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(f"{self.root} is not writable")
            key = commit.root_id(self.root)
        except OSError as e:
            error = f"cannot use checkpoint root {self.root}: {e.strerror or e}"
        views = self._ctl.all_gather((key, error))
        failures = {r: err for r, (_, err) in enumerate(views) if err}
        if failures:
            raise TierUnavailableError(failures.get(self.rank) or str(RankFailures(failures)))
        keys: list[str] = []
        for k, _ in views:
            if k not in keys:
                keys.append(k)
        groups = tuple(tuple(r for r, (k, _) in enumerate(views) if k == key_) for key_ in keys)
        index = keys.index(key)  # type: ignore[arg-type]
        ctx = RootContext(self.root, self.rank, groups[index][0] == self.rank, index, groups)
        lock_error = None
        if ctx.is_leader:
            self._lock = commit.RootLock(self.root)
            try:
                self._lock.acquire()
            except (RootLockedError, OSError) as e:
                self._lock = None
                lock_error = str(e) if isinstance(e, RootLockedError) else f"cannot lock {self.root}: {e}"
        locks = self._ctl.all_gather(lock_error)
        if any(locks):
            if self._lock is not None:
                self._lock.release()
            raise RootLockedError(next(m for m in locks if m))
        return ctx

    def _lock_replicator(self, replication: ReplicatorConfig | None) -> int | None:
        """The replicator thread takes the lock `ckpt replicate` takes: two replicators on one
        root would race on its status, journals and GC. Collective: every rank raises alike."""
        if replication is None:
            return None
        fd, error = None, None
        if self._ctx.is_leader:
            try:
                fd = lock_root(self.root)
            except OSError as e:
                error = (isinstance(e, RootLockedError), str(e))
        errors = [e for e in self._ctl.all_gather(error) if e]
        if errors:
            if fd is not None:
                os.close(fd)
            locked = [msg for is_locked, msg in errors if is_locked]
            raise RootLockedError(locked[0]) if locked else TierUnavailableError(errors[0][1])
        return fd

    def _recover(self) -> None:
        """Leftovers of a crash: roll prepared saves forward if another root published them, else remove."""
        mine: list[tuple[int, str]] = []
        error = None
        try:
            mine = [(c.step, c.save_id) for c in self._tier.committed()] if self._ctx.is_leader else []
        except CkptError as e:
            error = e
        self._agree(error, TierUnavailableError)
        published = {tuple(x) for view in self._ctl.all_gather(mine) for x in view}
        if not self._ctx.is_leader:
            return
        for p in commit.prepared_versions(self.root):
            if p.has_manifest and (p.step, p.save_id) in published:
                log.warning("rank %d: rolling forward step %d, published on another root", self.rank, p.step)
                commit.publish(self.root, p.dirname, p.step, overwrite=True)
            else:
                log.info("rank %d: removing unfinished save of step %d (%s)", self.rank, p.step, p.dirname)
                commit.remove_tmp(self.root, p.dirname)
        commit.empty_trash(self.root)

    # -- saving ----------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *, overwrite: bool = False, milestone: bool = False) -> bool:
        """Stage `state` and return; the commit goes on in the background.

        Returns False when the save was skipped (if_busy="skip" and a save in flight).
        `milestone=True` tags the version: milestone retention policies always keep it.
        Raises a previous save's error, VersionExistsError, UnsupportedStateError.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        started = time.perf_counter()
        if self.config.if_busy == "skip":
            busy = self._pending is not None and not self._pending.done()
            if any(self._ctl.all_gather(busy)):
                log.info("rank %d step %d: skipped, a save is still in flight", self.rank, step)
                return False
        self._wait_pending()
        pieces: dict[str, LocalPiece] = {}
        local: list[LocalSpec] = []
        deferrable: dict[str, tuple[str, Any]] = {}  # array name -> (key, leaf), copied after save() returns
        tree: Any = None
        rng = None
        error: BaseException | None = None
        try:
            with no_cyclic_gc():
                tree, leaves = encode_state(state)
                owned: set[tuple[str, int]] = set()
                if self.config.deferred_staging:
                    owned = self._gate.owned_storages(find_optimizers(state))
                for leaf in leaves:
                    p = describe(leaf.value, leaf.key)
                    pieces[leaf.name] = p
                    local.append((leaf.name, p.data_type, p.global_shape, p.offsets, tuple(p.data.shape)))
                    if owned and can_defer(leaf.value, p.data, owned):
                        deferrable[leaf.name] = (leaf.key, leaf.value)
            rng = capture_rng() if self.config.capture_rng else None
        except Exception as e:  # noqa: BLE001 - every rank must reach the collective below
            error = e
        exists = False
        try:
            exists = self._ctx.is_leader and step in commit.committed_steps(self.root)
        except CkptError as e:
            error = error or e
        info = self._ctl.all_gather(
            (hash(tuple(local)), exists, uuid.uuid4().hex, None if error is None else str(error))
        )
        failures = {r: e for r, (_, _, _, e) in enumerate(info) if e}
        if error is not None:
            raise error
        if failures:
            raise RankFailures(failures)
        if any(x for _, x, _, _ in info) and not overwrite:
            raise VersionExistsError(f"step {step} is already committed under {self.root}; pass overwrite=True")
        save_id = info[0][2]
        sigs = [s for s, _, _, _ in info]
        if sigs != self._plan_sigs:
            self._plans = plan_arrays(_merge_specs(self._ctl.all_gather(local)), split_bytes=self.config.split_bytes)
            self._plan_sigs = sigs
        job = SaveJob(step, save_id, overwrite, self._plans, tree, rng, self._arena.get(0, False), [])
        # From here on no rank waits for another in save(): whatever interrupts this one
        # (Ctrl-C, a SIGTERM handler's SystemExit) must still queue its commit, to fail on
        # every rank, and leave no copy running into the staging buffer.
        try:
            self._stage_and_queue(job, started, pieces, deferrable, milestone)
        except BaseException as e:
            self._fail_save(job, e)
            raise
        return True

    def _stage_and_queue(
        self,
        job: SaveJob,
        started: float,
        pieces: Mapping[str, LocalPiece],
        deferrable: Mapping[str, tuple[str, Any]],
        milestone: bool,
    ) -> None:
        step, save_id = job.step, job.save_id
        job.milestone = milestone
        job.check_finite = self.config.check_finite
        job.direct_io = self.config.direct_io
        job.started = started
        job.stats.step = step
        tasks = [
            StageTask(plan, chunk, pieces[plan.spec.name])
            for plan in self._plans
            for chunk in plan.chunks
            if chunk.writer == self.rank
        ]
        pin = any(t.piece.data.is_cuda for t in tasks)
        batches = _batches(tasks, self.config.max_staging_bytes)
        now: list[StageTask] = []  # save()'s copy still to make: before the job is queued, or while it writes
        try:
            for i, batch in enumerate(batches):
                placed, size = assign_offsets(batch)
                job.arena = self._arena.get(size, pin)
                job.tasks = placed
                if i < len(batches) - 1:  # bounded staging: write this batch before reusing the buffer
                    stage(job.arena, placed, self._copy_pool)
                    tmp_dir = os.path.join(self.root, commit.tmp_dirname(step, save_id))
                    makedirs(tmp_dir)
                    write_tasks(job, tmp_dir, self._writer_pool)
                    continue
                job.ready = Readiness(placed)
                now = [t for t in placed if t.array.spec.name not in deferrable]
                later = [t for t in placed if t.array.spec.name in deferrable]
                if later:  # the rest now; the deferred part is the commit thread's to copy
                    stage(job.arena, now, self._copy_pool, copied=job.ready.mark)
                    now = []
                    job.deferred = self._defer(job.arena, later, deferrable)
        except Exception as e:  # reported through the commit so every rank aborts together
            job.error = _staging_error(e, step, self.root)
        if job.error is not None:
            job.tasks, job.ready, job.deferred, now = [], None, None, []
        ready = job.ready if job.deferred is None else None  # save()'s own copy, still to make
        job.overlap = job.ready is not None and self._overlap_writes(pin)
        copy_while_queued = ready is not None and job.overlap  # the writers take each chunk as it lands
        if not copy_while_queued:
            if ready is not None:
                _copy_now(job, now, ready, self._copy_pool, self.root)
            self._stalled(job, started, ready)
        if job.deferred is not None:
            self._gate.close()  # optimizer steps wait from here until the commit thread has copied
        self._queue(job)
        if copy_while_queued:
            assert ready is not None
            _copy_now(job, now, ready, self._copy_pool, self.root)
            self._stalled(job, started, ready)

    def _queue(self, job: SaveJob) -> None:
        """Queue the job's commit; again is harmless (run_once)."""
        self._committer.submit(run_once, job, self._ctx, self._data, self._writer_pool, self.config.straggler_threshold)
        fault_delay("queued", self.rank)
        self._pending = job.outcome

    def _fail_save(self, job: SaveJob, e: BaseException) -> None:
        """save() was interrupted after the ranks' last collective: make the commit fail on
        every rank instead of waiting for a copy that will not be reported, and queue it if
        it may not be queued yet (no rank must wait for this one until the timeout)."""
        error = _staging_error(e, job.step, self.root)
        if job.ready is not None:
            job.ready.fail(error)  # wakes writers and the commit waiting for save()'s copy
        with job.claim:
            if not job.claimed:  # not started: it fails at once, and runs no deferred copy
                job.error = job.error or error
                job.deferred = None
                self._gate.open()
        self._queue(job)

    def _stalled(self, job: SaveJob, started: float, ready: Readiness | None) -> None:
        """save()'s part is over: record the stall, then let the commit use what was copied
        (it reports the stats, so they are set first)."""
        job.stats.stage_s = time.perf_counter() - started
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
        cores = len(os.sched_getaffinity(0))
        if cores == os.cpu_count():  # not pinned to its own cores: shared with this node's other ranks
            cores //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return cores >= self.config.copy_threads + self.config.writer_threads

    def _defer(
        self, arena: torch.Tensor, tasks: list[StageTask], leaves: Mapping[str, tuple[str, Any]]
    ) -> Callable[[SaveJob], None]:
        """The copy of `tasks` that the commit thread makes before writing (deferred staging)."""
        after = None
        device = next((t.piece.data.device for t in tasks if t.piece.data.is_cuda), None)
        if device is not None:  # the values as of this save(): the work queued so far on its stream
            after = torch.cuda.Event()  # type: ignore[no-untyped-call]
            after.record(torch.cuda.current_stream(device))
        watched: dict[str, tuple[str, list[torch.Tensor]]] = {}
        for t in tasks:
            key, value = leaves[t.array.spec.name]
            wrapper = [value] if isinstance(value, torch.Tensor) and value is not t.piece.data else []
            watched[t.array.spec.name] = (key, [t.piece.data, *wrapper])
        versions = Versions(watched.values())

        def copy(job: SaveJob) -> None:
            assert job.ready is not None
            try:
                stage(arena, tasks, self._copy_pool, after=after, copied=job.ready.mark)
                versions.check()
            except BaseException as e:  # noqa: BLE001 - the commit raises it, on every rank
                job.ready.fail(_staging_error(e, job.step, self.root))
            else:
                job.ready.done()
            finally:
                job.stats.staged_s = time.perf_counter() - job.started
                self._gate.open()

        return copy

    def wait_staged(self) -> float:
        """Block until the last save's tensors are copied (deferred staging), after which
        the state may change; returns the seconds waited. Optimizers in the state do this
        themselves at the start of step()."""
        return self._gate.wait()

    def guard(self, *optimizers: Any) -> None:
        """Make these optimizers' step() wait for a deferred copy, as the ones found in the
        state do (for an optimizer the state reaches only through a wrapper's state_dict())."""
        self._gate.guard(optimizers)

    def wait(self) -> None:
        """Block until every pending save is committed; raise its error if it failed."""
        self._wait_pending()

    def _wait_pending(self) -> None:
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
        self._stats.append(stats)

    # -- reading ---------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps on this rank's root, oldest first."""
        return commit.committed_steps(self.root)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def stats(self) -> list[SaveStats]:
        """Timings of this rank's completed saves, oldest first."""
        return list(self._stats)

    def restore(self, state: Mapping[str, Any], step: int | None = None) -> int | None:
        """Load the newest intact committed step (or `step`) into `state` in place; None if none.

        Every configured tier is searched (this rank's root first). A version that turns out
        corrupt is skipped with a warning for the next older one, unless `step` was given;
        a bad chunk is first fetched from another tier that holds it. The state may use
        another world size or sharding than the one that saved it.
        """
        self._check_open()
        self._wait_pending()
        excluded: set[int] = set()
        vanished: set[int] = set()  # deleted by GC since they were listed
        while True:
            mine: list[tuple[int, Candidate]] = []
            error: BaseException | None = None
            unreachable: list[str] = []
            tiers = self._tiers[:1] + self._replica_tiers() + self._tiers[1:]
            for i, tier in enumerate(tiers):
                try:
                    mine += [(i, c) for c in tier.committed()]
                except CkptError as e:
                    if i == 0:
                        error = e
                    unreachable.append(f"{tier.name}: {e}")
                    log.warning("rank %d: tier %s is unavailable: %s", self.rank, tier.name, e)
            if mine:  # a failed root (disk error) is no reason to ignore the copies elsewhere
                error = None
            self._agree(error, TierUnavailableError)
            views: list[list[Candidate]] = self._ctl.all_gather([c for _, c in mine])
            chosen = choose_step(views, step, frozenset(excluded | vanished))
            if chosen is None:
                if step is not None:
                    raise VersionNotFoundError(
                        f"step {step} is not committed where every rank can reach it ({self.root})"
                    )
                if excluded:
                    raise CorruptVersionError(
                        f"no committed version is intact (steps {sorted(excluded)} failed their checks); "
                        "the state may be partly overwritten"
                    )
                # Nothing found, but a tier could not be listed (the remote is down): the
                # versions may be there, so starting from scratch would be a silent loss.
                if any(self._ctl.all_gather(bool(unreachable))):
                    raise TierUnavailableError(
                        errno.EIO,
                        "no committed version on the reachable tiers, and some could not be read "
                        f"({'; '.join(unreachable) or 'on another rank'}); not starting from scratch",
                    )
                return None
            save_id = reachable_steps(views)[chosen]
            sources: list[tuple[Tier, Source]] = []
            for i, c in mine:
                if c.step == chosen and c.save_id == save_id:
                    try:
                        sources.append((tiers[i], _source(tiers[i], chosen, c)))
                    except OSError as e:  # e.g. a remote tier whose cache is on the failed root
                        log.warning("rank %d: tier %s is unavailable: %s", self.rank, tiers[i].name, e)
            try:
                with contextlib.ExitStack() as pins:
                    held = True
                    for tier, _ in sources:
                        if isinstance(tier, LocalTier):
                            held = pins.enter_context(commit.pin_version(tier.root, chosen)) and held
                    # GC deleted it between the listing and the pin, or is deleting it: it is
                    # gone, not corrupt; choose again. Pinned and still there, it stays.
                    gone = not held or any(
                        isinstance(t, LocalTier) and not os.path.isfile(os.path.join(s.version_dir, MANIFEST_NAME))
                        for t, s in sources
                    )
                    if any(self._ctl.all_gather(gone)):
                        vanished.add(chosen)
                        continue
                    with no_cyclic_gc():  # thousands of manifest objects: see ckpt/_gc.py
                        self._load(chosen, sources, state)
                return chosen
            except CorruptVersionError as e:
                metrics.VERIFY_ERRORS.inc()
                if step is not None:
                    raise
                log.warning("rank %d: step %d is not intact (%s); trying an older version", self.rank, chosen, e)
                excluded.add(chosen)

    def _load(self, step: int, sources: list[tuple[Tier, Source]], state: Mapping[str, Any]) -> None:
        found: Manifest | None = None
        error: BaseException | None = None
        for tier, _ in sources:
            try:
                found = tier.manifest(step)
                break
            except CkptError as e:
                error = e
                log.warning("rank %d: manifest of step %d on %s: %s", self.rank, step, tier.name, e)
        if found is not None:
            error = None
        elif sources and not isinstance(error, CorruptVersionError):
            error = CorruptVersionError(f"no readable manifest of step {step}: {error}")
        self._agree(error, CorruptVersionError)
        haves = self._ctl.all_gather(found is not None)
        if not all(haves):  # ranks without a copy get it from one that has it
            src = haves.index(True)
            raw = self._ctl.broadcast(found.to_json() if found is not None and self.rank == src else None, src=src)
            if found is None:
                found = parse_manifest(raw)
        assert found is not None
        manifest = found
        saved_world = manifest.world_size
        entry = manifest.ranks[self.rank % saved_world]
        bound = None
        requests: list[ReadRequest] = []
        error = None
        try:
            bound = bind(manifest.trees[entry.tree], state)
            for leaf in bound.leaves:
                array = manifest.arrays.get(leaf.name)
                if array is None:
                    raise CorruptVersionError(f"{leaf.key}: the manifest has no array {leaf.name!r}")
                if leaf.value is None:
                    dest = full_tensor(array)
                    bound.results[leaf.name] = dest
                    requests.append(ReadRequest(array, dest, (0,) * len(array.shape)))
                    continue
                piece = describe(leaf.value, leaf.key)
                if (piece.data_type, piece.global_shape) != (array.data_type, array.shape):
                    raise StateMismatchError(
                        f"{leaf.key}: the checkpoint holds {array.data_type}{list(array.shape)}, "
                        f"the state has {piece.data_type}{list(piece.global_shape)}"
                    )
                bound.results[leaf.name] = piece.data if isinstance(leaf.value, np.ndarray) else leaf.value
                requests.append(ReadRequest(array, piece.data, piece.offsets))
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            error = e
        self._agree(error, StateMismatchError)
        load_arrays(
            self._ctl,
            [s for _, s in sources],
            manifest,
            requests,
            verify=self.config.verify_on_restore,
            threads=self.config.reader_threads,
        )
        assert bound is not None
        bound.finish()
        if self.config.capture_rng:
            if self.rank < saved_world and manifest.ranks[self.rank].rng is not None:
                restore_rng(manifest.ranks[self.rank].rng)  # type: ignore[arg-type]
            else:
                seed_new_rank(manifest.save_id, self.rank)
        how = "" if saved_world == self.world else f" (saved by {saved_world} ranks, resharded)"
        log.info("rank %d step %d: restored%s", self.rank, step, how)

    def _agree(self, error: BaseException | None, kind: type[CkptError]) -> None:
        """Collective: if any rank failed, raise on every rank, so none is left waiting in a collective.

        A corrupt version anywhere makes every rank raise CorruptVersionError, so that
        restore() falls back to an older version on all ranks together.
        """
        causes = self._ctl.all_gather(None if error is None else (isinstance(error, CorruptVersionError), str(error)))
        bad = {r: c[1] for r, c in enumerate(causes) if c}
        if not bad:
            return
        corrupt = any(c[0] for c in causes if c)
        if error is not None and (isinstance(error, CorruptVersionError) or not corrupt):
            raise error
        raise (CorruptVersionError if corrupt else kind)(str(RankFailures(bad)))

    # -- lifecycle -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CkptError("this Checkpointer is closed")

    def close(self) -> None:
        """Wait for pending saves (raising their error), then release the root."""
        if self._closed:
            return
        try:
            self._wait_pending()
        finally:
            self._closed = True
            if self._replicator is not None and self._replicator_thread is not None:
                self._replicator.stop.set()
                self._replicator_thread.join()
                self._drain_replicator(self._replicator)
            if self._replicator_lock is not None:
                os.close(self._replicator_lock)
                self._replicator_lock = None
            for pool in (self._committer, self._writer_pool, self._copy_pool):
                pool.shutdown(wait=True)
            self._gate.open()  # a failed save may have left it closed
            self._gate.remove_hooks()
            self._arena.release()
            if self._lock is not None:
                self._lock.release()
            destroy_comms(self._ctl, self._data)

    def _drain_replicator(self, replicator: Replicator) -> None:
        """One last pass so the final versions reach their copies and the remote before exit."""
        replicator.stop.clear()
        try:
            replicator.run_once()
        except Exception as e:  # noqa: BLE001 - close() must still release the root
            log.warning("rank %d: final replication pass failed: %s", self.rank, type(e).__name__)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # the body's exception wins; the save error is logged
            log.exception("rank %d: a pending save failed while handling another error", self.rank)
