"""The background half of a save: write this rank's chunks, then commit across ranks.

Phases, each ending in a collective on the `data` group so every rank takes the same
branch (a failure anywhere aborts everywhere and removes the tmp directories):

  WRITE    each rank writes + fsyncs its chunk files and directories into the tmp dir
  GATHER   rank 0 collects checksums, trees and RNG, builds the manifest, broadcasts it
  PREPARE  each root's leader writes zarr metadata, root.json and the manifest, fsynced
  PUBLISH  each leader renames tmp -> v<N> and fsyncs the root

The version counts as committed once any root has published; every root was prepared
(its data and manifest durable) before any did, so recovery can roll the rest forward.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ckpt._dist import Comm
from ckpt._gc import no_cyclic_gc
from ckpt._staging import Readiness, StageTask
from ckpt.provenance import job_provenance, rank_provenance
from ckpt.store import commit as commit_mod
from ckpt.store import metrics
from ckpt.store.dtypes import itemsize
from ckpt.store.errors import NonFiniteError, RankFailures, TierUnavailableError
from ckpt.store.faults import fault_delay, fault_point
from ckpt.store.fsio import DIR_MODE, fsync_dirs, fsync_files, write_chunk, write_new
from ckpt.store.lanes import run_lanes
from ckpt.store.layout import ArrayPlan, block_rows, chunk_file
from ckpt.store.manifest import STATE_PREFIX, ArrayEntry, ChunkEntry, Manifest, RankEntry, parse_manifest
from ckpt.store.zarr_meta import ArrayNode, documents, write_hierarchy

__all__ = ["SaveJob", "SaveStats", "write_tasks", "run_commit", "run_once"]

log = logging.getLogger("ckpt")
_LANES = 16  # at most this many writer lanes per save (bounded by the pool's threads)
# array, chunk index, xxh3, inline value, block digests, bytes written with O_DIRECT
_Record = tuple[str, list[int], str, str | None, list[str], int]


@dataclass
class SaveStats:
    """Per-rank timings of one save, in seconds."""

    step: int
    stage_s: float = 0.0  # the training stall: staging copy (and any bounded-memory writes)
    write_s: float = 0.0  # chunk files written and fsynced, after the copy ended (overlap_writes: the tail)
    first_write_s: float | None = None  # save() call to the first chunk written (< stage_s with overlap_writes)
    fsync_s: float = 0.0  # directories fsynced
    commit_s: float = 0.0  # gather, prepare and publish
    total_s: float = 0.0  # save() call to committed
    staged_s: float = 0.0  # save() call to every tensor copied (later than stage_s with deferred staging)
    bytes_written: int = 0
    direct_bytes: int = 0  # of bytes_written, written with O_DIRECT (CheckpointerConfig.direct_io)


@dataclass
class SaveJob:
    step: int
    save_id: str
    overwrite: bool
    plans: Sequence[ArrayPlan]
    tree: Any
    rng: dict[str, Any] | None
    arena: torch.Tensor
    tasks: list[StageTask]  # the last staged batch, still to be written
    error: BaseException | None = None  # a failure while staging or writing in the foreground
    milestone: bool = False  # tagged for milestone retention
    check_finite: bool = False  # refuse NaN/Inf in floating tensors
    direct_io: bool = True  # large chunks with O_DIRECT (store.fsio.write_chunk)
    deferred: Callable[[SaveJob], None] | None = None  # the copy left to the commit thread (deferred staging)
    ready: Readiness | None = None  # which of `tasks` are staged yet; None: all of them
    overlap: bool = False  # the writers start while the copy goes on (CheckpointerConfig.overlap_writes)
    outcome: Future[SaveStats] = field(default_factory=Future)  # what wait() waits for
    claim: threading.Lock = field(default_factory=threading.Lock)
    claimed: bool = False  # the commit has started (run_once); under `claim`
    records: dict[str, list[tuple[list[int], str, str | None, list[str]]]] = field(default_factory=dict)
    inline_docs: set[str] = field(default_factory=set)  # inline arrays whose zarr.json is written
    dirs: set[str] = field(default_factory=set)
    stats: SaveStats = field(default_factory=lambda: SaveStats(0))
    started: float = field(default_factory=time.perf_counter)
    started_unix: float = field(default_factory=time.time)


@dataclass(frozen=True)
class RootContext:
    """Where this rank writes, and its part in the root group."""

    root: str
    rank: int
    is_leader: bool
    root_index: int
    root_groups: tuple[tuple[int, ...], ...]


def metadata_documents(job: SaveJob, tmp_dir: str) -> tuple[list[tuple[str, bytes]], set[str]]:
    """The zarr.json files known before the data is written: groups and every array but the
    inline ones (whose value is their fill_value and comes with the manifest); and every
    metadata directory, the inline arrays' included."""
    nodes = [
        ArrayNode(f"{STATE_PREFIX}/{p.spec.name}", p.spec.data_type, p.spec.shape, p.chunk_shape) for p in job.plans
    ]
    docs, dirs = documents(tmp_dir, nodes, {"ckpt": {"step": job.step}})
    inline = {os.path.join(tmp_dir, STATE_PREFIX, p.spec.name, "zarr.json") for p in job.plans if _is_inline(p)}
    return [d for d in docs if d[0] not in inline], dirs


def _is_inline(plan: ArrayPlan) -> bool:
    return len(plan.chunks) == 1 and plan.chunks[0].inline


def write_tasks(
    job: SaveJob,
    tmp_dir: str,
    pool: ThreadPoolExecutor,
    metadata: tuple[Sequence[tuple[str, bytes]], set[str]] = ((), set()),
    inline_docs: bool = False,
) -> None:
    """Write the staged chunks of `job.tasks` and the files of `metadata` (zarr.json files and
    the directories they need); record the chunks' checksums. Everything is fsynced together
    at the end. With `inline_docs`, the zarr.json of each inline array among the tasks is
    written too (its fill_value is the staged value), instead of at PREPARE."""
    docs, meta_dirs = metadata
    arena_np = job.arena.numpy()
    written: list[str] = []  # list.append is atomic: the writer threads share it

    def doc(item: tuple[str, bytes]) -> None:
        write_new(*item)
        written.append(item[0])

    def one(task: StageTask) -> _Record:
        if job.ready is not None:
            job.ready.wait(task)
        if job.stats.first_write_s is None:  # racy between lanes, harmlessly: about the same instant
            job.stats.first_write_s = time.perf_counter() - job.started
        view = memoryview(arena_np[task.offset : task.offset + task.staged_bytes])  # type: ignore[arg-type]
        name, index = task.array.spec.name, list(task.chunk.index)
        if task.chunk.inline:
            if job.check_finite:
                _check_finite(job, task)
            raw = bytes(view)
            value = raw.hex()
            if inline_docs:
                spec = task.array.spec
                node = ArrayNode(f"{STATE_PREFIX}/{name}", spec.data_type, spec.shape, task.array.chunk_shape, value)
                (zarr_json,), _ = documents(tmp_dir, [node], None)
                doc(zarr_json)
                job.inline_docs.add(name)
            return name, index, xxhash.xxh3_64_hexdigest(raw), value, [], 0
        if job.check_finite:
            _check_finite(job, task)
        fault_delay("write", task.chunk.writer)
        path = os.path.join(tmp_dir, chunk_file(f"{STATE_PREFIX}/{name}", task.chunk.index))
        item = itemsize(task.array.spec.data_type)
        rows = block_rows(task.array.chunk_shape, item)
        row_bytes = math.prod(task.array.chunk_shape[1:]) * item
        # No fsync here: the writer moves on to the next chunk (an O_DIRECT part is on the
        # device already; a buffered part's writeback runs meanwhile); every file is fsynced
        # below, together (one journal commit for all).
        chunk = write_chunk(path, view, block_bytes=rows * row_bytes, fsync=False, direct=job.direct_io)
        written.append(path)
        return name, index, chunk.xxh3, None, chunk.blocks, chunk.direct_bytes

    t0 = time.perf_counter()
    # Every directory first (the inline arrays' too, whose zarr.json holds their value),
    # on one thread, before any data is dirty: ext4 (data=ordered) makes a mkdir next to
    # running writeback wait for a journal commit, which flushes the data written so far.
    # Created from the writer threads, mkdirs took most of their time (py-spy).
    new_dirs: set[str] = set()
    for task in job.tasks:
        if not task.chunk.inline:
            new_dirs.update(_ancestors(tmp_dir, chunk_file(f"{STATE_PREFIX}/{task.array.spec.name}", task.chunk.index)))
    new_dirs.update(meta_dirs)
    for d in sorted(new_dirs):  # parents sort before their children
        if d not in job.dirs:
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, DIR_MODE)
    job.dirs.update(new_dirs)
    # Largest first, so the writers finish together instead of one writing a big chunk alone.
    ordered: list[StageTask | tuple[str, bytes]] = [*sorted(job.tasks, key=lambda t: -t.staged_bytes), *docs]

    def work(task: StageTask | tuple[str, bytes]) -> _Record | None:
        if isinstance(task, StageTask):
            return one(task)
        doc(task)  # the small metadata files go last, filling in as the chunk writers finish
        return None

    # On a failure every lane has stopped before the arena may be reused.
    outcomes, failed = run_lanes(ordered, work, _LANES, pool=pool)
    if job.ready is not None:
        job.ready.result()  # a failed copy says more than the writers it stopped
    if failed:
        raise failed[0][1]
    results = outcomes[: len(job.tasks)]
    for r in results:
        assert r is not None
        name, index, digest, inline, blocks, direct_bytes = r
        job.records.setdefault(name, []).append((index, digest, inline, blocks))
        job.stats.direct_bytes += direct_bytes
    fsync_files(written)
    job.stats.bytes_written += sum(task.chunk.nbytes for task in job.tasks)
    # From the end of the copy when the writers overlapped it: the time they waited for it
    # is the copy's, and would make a rank with a slow copy look like one with a slow disk.
    copied = job.ready.finished_at if job.ready is not None else None
    job.stats.write_s += time.perf_counter() - max(t0, copied or t0)


_FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def _check_finite(job: SaveJob, task: StageTask) -> None:
    """NaN/Inf in the staged copy: one min/max pass, no temporary of the chunk's size."""
    dtype = task.piece.data.dtype
    if dtype not in _FLOATS and not dtype.is_complex:
        return
    raw = job.arena[task.offset : task.offset + task.staged_bytes]
    values = raw.view(dtype)
    if dtype.is_complex:
        values = torch.view_as_real(values).reshape(-1)
    lo, hi = torch.aminmax(values)
    if not (torch.isfinite(lo) and torch.isfinite(hi)):
        rank = task.chunk.writer
        raise NonFiniteError(
            f"tensor {task.array.spec.name!r} holds NaN or Inf on rank {rank} (check_finite); "
            f"step {job.step} was not committed, the previous version stays the newest"
        )


def _ancestors(top: str, rel: str) -> list[str]:
    """Every directory from `top` down to the one holding `rel`: each may be new, so each is fsynced."""
    parts = rel.split("/")[:-1]
    return [os.path.join(top, *parts[:i]) for i in range(len(parts) + 1)]


def _build_manifest(job: SaveJob, payloads: list[dict[str, Any]], ctx: RootContext, world: int) -> Manifest:
    records: dict[str, dict[tuple[int, ...], tuple[str, str | None, list[str]]]] = {}
    for p in payloads:
        for name, recs in p["records"].items():
            for index, digest, inline, blocks in recs:
                records.setdefault(name, {})[tuple(index)] = (digest, inline, blocks)
    arrays = {}
    for plan in job.plans:
        got = records.get(plan.spec.name, {})
        chunks = []
        for c in plan.chunks:
            digest, inline, blocks = got[c.index]
            chunks.append(ChunkEntry(c.index, c.writer, c.offsets, c.shape, c.nbytes, digest, inline, tuple(blocks)))
        regions = tuple({"offsets": list(o), "shape": list(s), "ranks": list(r)} for o, s, r in plan.regions)
        arrays[plan.spec.name] = ArrayEntry(
            plan.spec.name,
            plan.spec.data_type,
            plan.spec.shape,
            plan.chunk_shape,
            plan.replicated,
            regions,
            tuple(chunks),
            block_rows(plan.chunk_shape, itemsize(plan.spec.data_type)),
        )
    trees: dict[str, Any] = {}
    ranks = []
    for r, p in enumerate(payloads):
        text = json.dumps(p["tree"], sort_keys=True, separators=(",", ":"))
        key = hashlib.sha1(text.encode()).hexdigest()[:16]
        trees.setdefault(key, p["tree"])
        ranks.append(RankEntry(r, key, p["rng"], p["host"], p["root_index"]))
    meta = {
        **job_provenance(),
        "ranks": [p["provenance"] for p in payloads],
        "timings": [p["stats"] for p in payloads],
        "milestone": job.milestone,
    }
    return Manifest(
        step=job.step,
        save_id=job.save_id,
        created=time.time(),
        world_size=world,
        arrays=arrays,
        trees=trees,
        ranks=tuple(ranks),
        roots=ctx.root_groups,
        meta=meta,
    )


def _agree(comm: Comm, error: BaseException | None) -> None:
    """All ranks learn every rank's failure; raise RankFailures if there was any."""
    causes = comm.all_gather(None if error is None else f"{type(error).__name__}: {error}")
    bad = {r: c for r, c in enumerate(causes) if c is not None}
    if bad:
        raise RankFailures(bad) from error


def _report_stragglers(payloads: list[dict[str, Any]], step: int, threshold: float) -> None:
    """Warn about ranks whose write time exceeds the median by more than `threshold`."""
    times = [(r, p["stats"]["write_s"] + p["stats"]["fsync_s"]) for r, p in enumerate(payloads) if not p["error"]]
    if len(times) < 2:
        return
    median = statistics.median(t for _, t in times)
    for rank, t in times:
        if t > median * (1 + threshold) and t - median > 0.05:  # ignore noise on tiny saves
            p = payloads[rank]
            log.warning(
                "rank 0 step %d: straggler rank %d (host %s, disk %s) wrote in %.2fs, %.0f%% above the median %.2fs",
                step,
                rank,
                p["host"],
                p["root"],
                t,
                100 * (t / median - 1) if median else 100.0,
                median,
            )
            metrics.STRAGGLERS.labels(rank=str(rank)).inc()


def run_once(
    job: SaveJob, ctx: RootContext, comm: Comm, pool: ThreadPoolExecutor, straggler_threshold: float = 0.3
) -> None:
    """run_commit into job.outcome, at most once per job: save() may queue a job a second
    time when an interruption struck while it was being queued (inside submit itself)."""
    with job.claim:
        if job.claimed:
            return
        job.claimed = True
    try:
        stats = run_commit(job, ctx, comm, pool, straggler_threshold)
    except BaseException as e:  # noqa: BLE001 - raised by wait()
        job.outcome.set_exception(e)
    else:
        job.outcome.set_result(stats)


def run_commit(
    job: SaveJob, ctx: RootContext, comm: Comm, pool: ThreadPoolExecutor, straggler_threshold: float = 0.3
) -> SaveStats:
    """Runs on the background thread; returns the stats or raises (every rank raises alike)."""
    copier = None
    if job.deferred is not None and job.overlap:  # its chunks are written as it copies them (job.ready)
        copier = threading.Thread(target=job.deferred, args=(job,), name="ckpt-deferred-copy", daemon=True)
        copier.start()
    elif job.deferred is not None:
        job.deferred(job)  # it reports a failure through job.ready
    try:
        return _commit(job, ctx, comm, pool, straggler_threshold)
    finally:
        if copier is not None:
            copier.join()  # the arena is free for the next save only once the copy has stopped


def _commit(
    job: SaveJob, ctx: RootContext, comm: Comm, pool: ThreadPoolExecutor, straggler_threshold: float
) -> SaveStats:
    tmp_name = commit_mod.tmp_dirname(job.step, job.save_id)
    tmp_dir = os.path.join(ctx.root, tmp_name)
    error: BaseException | None = job.error
    try:  # WRITE
        if error is not None:
            raise error
        os.makedirs(tmp_dir, mode=DIR_MODE, exist_ok=True)
        if ctx.is_leader:
            write_tasks(job, tmp_dir, pool, metadata_documents(job, tmp_dir), inline_docs=True)
        else:
            write_tasks(job, tmp_dir, pool)
        fault_point("after-write", ctx.rank)
        t0 = time.perf_counter()
        fsync_dirs(job.dirs)
        job.stats.fsync_s = time.perf_counter() - t0
    except OSError as e:  # disk full, I/O error, unwritable: one documented type, errno kept
        error = (
            e
            if isinstance(e, TierUnavailableError)
            else TierUnavailableError(e.errno, f"cannot write step {job.step} to {ctx.root}: {e.strerror or e}")
        )
    except BaseException as e:  # noqa: BLE001 - reported to every rank, then re-raised
        error = e
    t_commit = time.perf_counter()
    prepared_everywhere = False
    try:
        payload = {
            "records": job.records,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "tree": job.tree,
            "rng": job.rng,
            "host": platform.node(),
            "root_index": ctx.root_index,
            "stats": {
                "stage_s": job.stats.stage_s,
                "staged_s": job.stats.staged_s,
                "write_s": job.stats.write_s,
                "fsync_s": job.stats.fsync_s,
                "bytes": job.stats.bytes_written,
                "started": job.started_unix,  # with the manifest's `created`: the commit time
            },
            "root": ctx.root,
            "provenance": rank_provenance(),
        }
        gathered = comm.gather(payload)  # GATHER
        decision: dict[str, Any] = {}
        if gathered is not None:
            _report_stragglers(gathered, job.step, straggler_threshold)
            bad = {r: p["error"] for r, p in enumerate(gathered) if p["error"]}
            if bad:
                decision = {"abort": bad}
            else:
                try:
                    with no_cyclic_gc():
                        decision = {"manifest": _build_manifest(job, gathered, ctx, comm.world).to_json()}
                except BaseException as e:  # noqa: BLE001
                    decision = {"abort": {0: f"{type(e).__name__}: {e}"}}
        decision = comm.broadcast(decision)
        if "abort" in decision:
            if error is not None:  # this rank's own failure says the most
                raise error
            raise RankFailures({int(r): c for r, c in decision["abort"].items()})
        with no_cyclic_gc():
            manifest = parse_manifest(decision["manifest"])
        error = None
        if ctx.is_leader:  # PREPARE
            try:
                # The rest of the zarr metadata went with the data (metadata_documents, and
                # the inline arrays this rank wrote): what is left are other ranks' inline values.
                inline = [
                    ArrayNode.of(a)
                    for a in manifest.arrays.values()
                    if a.name not in job.inline_docs and any(c.inline is not None for c in a.chunks)
                ]
                with no_cyclic_gc():  # serializes the manifest
                    dirs = write_hierarchy(tmp_dir, inline, None)
                    commit_mod.prepare(tmp_dir, manifest, list(ctx.root_groups[ctx.root_index]), dirs)
            except BaseException as e:  # noqa: BLE001
                error = e
        _agree(comm, error)
        prepared_everywhere = True
        fault_point("after-prepare", ctx.rank)
        if ctx.is_leader:  # PUBLISH
            try:
                commit_mod.publish(ctx.root, tmp_name, job.step, overwrite=job.overwrite)
            except BaseException as e:  # noqa: BLE001
                error = e
        fault_point("after-publish", ctx.rank)
        _agree(comm, error)
    except BaseException as e:
        metrics.SAVE_FAILURES.labels(reason=type(e).__name__).inc()
        # Once every root is prepared, another root may have published: a prepared copy
        # is kept so the next open rolls it forward instead of losing the version.
        if ctx.is_leader and not prepared_everywhere:
            commit_mod.remove_tmp(ctx.root, tmp_name)
        raise
    job.stats.commit_s = time.perf_counter() - t_commit
    job.stats.total_s = time.perf_counter() - job.started
    metrics.COMMIT_LATENCY.observe(job.stats.total_s)
    metrics.BYTES_WRITTEN.inc(job.stats.bytes_written)
    s = job.stats
    log.info(
        "rank %d step %d: committed in %.3fs (stage %.3fs, write %.3fs, fsync %.3fs, commit %.3fs, %d bytes)",
        ctx.rank,
        job.step,
        s.total_s,
        s.stage_s,
        s.write_s,
        s.fsync_s,
        s.commit_s,
        s.bytes_written,
    )
    return job.stats
