"""The background half of a save: write this rank's chunks, then commit across ranks.

Phases, each ending in a collective on the `data` group so every rank takes the same
branch (a failure anywhere aborts everywhere and removes the tmp directories):

  WRITE    each rank writes + fsyncs its chunk files and directories into the tmp dir (ckpt._write)
  GATHER   rank 0 collects every rank's RankReport through the roots' leaders (ckpt._reports:
           40 bytes a rank; its rank file, written with its chunks, holds its digests,
           tree and RNG), builds the manifest, sends it to the other roots' leaders
  PREPARE  each root's leader writes zarr metadata, root.json and the manifest, fsynced
  PUBLISH  each leader renames tmp -> v<N> and fsyncs the root

The version counts as committed once any root has published; every root was prepared
(its data and manifest durable) before any did, so recovery can roll the rest forward.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from ckpt._dist import Comm, describe_error
from ckpt._exchange import exchange
from ckpt._gc import no_cyclic_gc
from ckpt._job import RankReport, RankTimings, SaveJob, SaveStats
from ckpt._peer_status import drop_overwritten_copies
from ckpt._reports import gather_reports
from ckpt._timings import summarize
from ckpt._write import metadata_documents, open_tree, write_tasks
from ckpt.provenance import job_provenance, rank_provenance
from ckpt.replicator.gc import note_whole
from ckpt.store import commit as commit_mod
from ckpt.store import metrics
from ckpt.store.dtypes import itemsize
from ckpt.store.errors import CkptError, TierUnavailableError
from ckpt.store.faults import fault_delay, fault_point
from ckpt.store.fsio import DIR_MODE, fsync_dirs, write_new
from ckpt.store.layout import block_rows, flat_index, grid_shape
from ckpt.store.manifest import ArrayEntry, Manifest, RankRef, parse_manifest
from ckpt.store.rank_file import RANKS_DIR, rank_file_bytes, rank_file_path
from ckpt.store.versions import remember_manifest
from ckpt.store.zarr_meta import ArrayNode, write_hierarchy

__all__ = ["RootContext", "run_once", "run_commit"]

log = logging.getLogger("ckpt")
_MANIFEST_TAG = 1 << 30  # rank 0 -> leaders; above any sliver exchange's tags (per-pair counts)


@dataclass(frozen=True)
class RootContext:
    """Where this rank writes, and its part in the root group."""

    root: str
    rank: int
    is_leader: bool
    root_index: int
    root_groups: tuple[tuple[int, ...], ...]


def _build_manifest(job: SaveJob, reports: list[RankReport], ctx: RootContext, world: int) -> Manifest:
    """Schema 3: O(arrays + ranks). The chunks' writers as runs, inline values, and a
    reference to each rank's file (its digests, tree and RNG)."""
    req = job.request
    inline: dict[str, tuple[str, str]] = {}
    for p in reports:
        inline.update(p.inline)
    arrays = {}
    for plan in req.plans:
        value = inline.get(plan.spec.name) if plan.inline else None
        arrays[plan.spec.name] = ArrayEntry(
            plan.spec.name,
            plan.spec.data_type,
            plan.spec.shape,
            plan.chunk_shape,
            plan.replicated,
            plan.sharding.to_json(),
            block_rows=block_rows(plan.chunk_shape, itemsize(plan.spec.data_type)),
            runs=plan.runs,
            inline=None if value is None else value[0],
            inline_xxh3="" if value is None else value[1],
        )
    created = time.time()
    meta = {
        **job_provenance(),
        "timings": summarize([p.timings.to_json() for p in reports], created),
        "milestone": req.milestone,
        "partial": req.partial,
        "keys": sorted({k for p in reports for k in p.keys}),  # every rank's
        "layout": req.layout,  # which save may reuse this version's tree once retired (store.spare)
    }
    return Manifest(
        step=req.step,
        save_id=req.save_id,
        created=created,
        world_size=world,
        arrays=arrays,
        trees={},
        ranks=(),
        roots=ctx.root_groups,
        meta=meta,
        rank_files=tuple(RankRef(*p.rank_file) for p in reports),
    )


def _write_rank_file(job: SaveJob, ctx: RootContext, tmp_dir: str) -> tuple[int, str]:
    """This rank's file (digests of the chunks it wrote, its tree, RNG and provenance) into
    the tmp directory, fsynced with the rest; its size and xxh3."""
    req = job.request
    grids = {p.spec.name: grid_shape(p.spec.shape, p.chunk_shape) for p in req.plans}
    chunks: dict[str, list[tuple[int, str, tuple[str, ...]]]] = {}
    for name, records in job.written.records.items():
        for r in records:
            if r.inline is None:
                chunks.setdefault(name, []).append((flat_index(r.index, grids[name]), r.xxh3, r.blocks))
    for entries in chunks.values():
        entries.sort()
    data = rank_file_bytes(
        step=req.step,
        save_id=req.save_id,
        rank=ctx.rank,
        host=platform.node(),
        root=ctx.root_index,
        tree=req.tree,
        rng=req.rng,
        provenance=rank_provenance(),
        chunks=chunks,
    )
    folder = os.path.join(tmp_dir, RANKS_DIR)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, DIR_MODE)
    write_new(os.path.join(tmp_dir, rank_file_path(ctx.rank)), data, fsync=True, replace=True)
    job.written.dirs.update((folder, tmp_dir))
    return len(data), xxhash.xxh3_64_hexdigest(data)


def _report_stragglers(reports: list[RankReport], step: int, threshold: float) -> None:
    """Warn about ranks whose write time exceeds the median by more than `threshold`."""
    times = [(r, p.timings.write_s + p.timings.fsync_s) for r, p in enumerate(reports) if not p.error]
    if len(times) < 2:
        return
    median = statistics.median(t for _, t in times)
    for rank, t in times:
        if t > median * (1 + threshold) and t - median > 0.05:  # ignore noise on tiny saves
            p = reports[rank]
            log.warning(
                "rank 0 step %d: straggler rank %d (host %s, disk %s) wrote in %.2fs, %.0f%% above the median %.2fs",
                step,
                rank,
                p.host,
                p.root,
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
    if not job.claim():
        return
    try:
        stats = run_commit(job, ctx, comm, pool, straggler_threshold)
    except BaseException as e:  # noqa: BLE001 - raised by wait()
        job.release()
        job.outcome.set_exception(e)
    else:
        job.release()
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


def _write(job: SaveJob, ctx: RootContext, tmp_dir: str, pool: ThreadPoolExecutor, comm: Comm) -> BaseException | None:
    """WRITE: the sliver exchange (every rank, whatever its staging did), then this rank's
    chunks into the tmp directory, durably; the failure, if any."""
    try:
        if not job.request.exchange.empty:
            job.received = exchange(comm, job.request.exchange, job.tasks, job.arena, job.ready)
        if job.error is not None:
            return job.error
        open_tree(job, ctx.root, tmp_dir, ctx.root_groups[ctx.root_index])
        if ctx.is_leader:
            write_tasks(job, tmp_dir, pool, metadata_documents(job, tmp_dir), inline_docs=True)
        else:
            write_tasks(job, tmp_dir, pool)
        job.written.rank_file = _write_rank_file(job, ctx, tmp_dir)
        fault_point("after-write", ctx.rank)
        t0 = time.perf_counter()
        fsync_dirs(job.written.dirs)
        job.stats.fsync_s = time.perf_counter() - t0
    except BaseException as e:  # noqa: BLE001 - reported to every rank, then re-raised
        return _disk_error(e, f"cannot write step {job.step} to {ctx.root}")
    return None


def _disk_error(e: BaseException, what: str) -> BaseException:
    """A disk's OSError (disk full, I/O error, unwritable) as the one documented type,
    TierUnavailableError, its errno kept; anything else as it is."""
    if isinstance(e, OSError) and not isinstance(e, CkptError):
        return TierUnavailableError(e.errno, f"{what}: {e.strerror or e}")
    return e


def _report(job: SaveJob, ctx: RootContext, error: BaseException | None) -> RankReport:
    s = job.stats
    tree = job.request.tree
    return RankReport(
        error=None if error is None else describe_error(error),
        rank_file=job.written.rank_file,
        inline={name: (r.inline, r.xxh3) for name, records in job.written.records.items() for r in records if r.inline},
        keys=tuple(sorted(str(k) for k in tree)) if isinstance(tree, dict) else (),
        host=platform.node(),
        root=ctx.root,
        root_index=ctx.root_index,
        timings=RankTimings(s.stage_s, s.staged_s, s.write_s, s.fsync_s, s.bytes_written, job.request.started_unix),
    )


def _decide(
    job: SaveJob, reports: list[RankReport], ctx: RootContext, world: int, threshold: float
) -> tuple[bytes, BaseException | None]:
    """Rank 0: the manifest to commit (its JSON; empty when the save is aborted because a
    rank failed), or rank 0's own failure to build it."""
    _report_stragglers(reports, job.step, threshold)
    if any(p.error for p in reports):  # the failed ranks report their own causes in agree()
        return b"", None
    try:
        with no_cyclic_gc():
            return _build_manifest(job, reports, ctx, world).to_json(), None
    except BaseException as e:  # noqa: BLE001 - every rank learns it in agree()
        return b"", e


def _commit(
    job: SaveJob, ctx: RootContext, comm: Comm, pool: ThreadPoolExecutor, straggler_threshold: float
) -> SaveStats:
    tmp_name = commit_mod.tmp_dirname(job.step, job.request.save_id)
    tmp_dir = os.path.join(ctx.root, tmp_name)
    error = _write(job, ctx, tmp_dir, pool, comm)
    t_commit = time.perf_counter()
    prepared_everywhere = False
    try:
        reports = gather_reports(comm, _report(job, ctx, error), ctx.root_groups, ctx.root_index)  # GATHER
        # Only the roots' leaders need the manifest (they write it): rank 0 sends it to each,
        # empty when the save is aborted. The other ranks learn the outcome in agree().
        raw = b""
        if reports is not None:
            raw, failure = _decide(job, reports, ctx, comm.world, straggler_threshold)
            error = error or failure
            leaders = [g[0] for g in ctx.root_groups if g[0] != ctx.rank]
            if leaders:
                comm.send_bytes(raw, leaders, _MANIFEST_TAG)
        elif ctx.is_leader:
            raw = comm.recv_bytes(0, _MANIFEST_TAG)
        if ctx.is_leader and raw and error is None:  # PREPARE
            try:
                # The parsed manifest (a few objects per array) lives and dies inside: no
                # collection sees it, so none moves it to the oldest generation, whose growth
                # by survivors triggers the full collections that stop every thread.
                with no_cyclic_gc():
                    manifest = parse_manifest(raw)
                    # The rest of the zarr metadata went with the data (metadata_documents, and
                    # the inline arrays this rank wrote): what is left are other ranks' inline values.
                    inline = [
                        ArrayNode.of(a)
                        for a in manifest.arrays.values()
                        if a.name not in job.written.inline_docs and a.inline is not None
                    ]
                    dirs = write_hierarchy(tmp_dir, inline, None, replace=True)
                    commit_mod.prepare(tmp_dir, manifest, list(ctx.root_groups[ctx.root_index]), dirs, raw)
                    remember_manifest(raw, manifest)  # retention judges it next, without parsing it again
                    note_whole(ctx.root, job.step, manifest.save_id)  # (nor statting its files)
                    del manifest, inline
            except BaseException as e:  # noqa: BLE001 - every rank learns it in agree()
                error = _disk_error(e, f"cannot prepare step {job.step} in {ctx.root}")
        comm.agree(error)
        prepared_everywhere = True
        fault_point("after-prepare", ctx.rank)
        fault_delay("after-prepare", ctx.rank)
        if ctx.is_leader:  # PUBLISH
            try:
                if job.request.overwrite:
                    drop_overwritten_copies(ctx.root, job.step)
                commit_mod.publish(ctx.root, tmp_name, job.step, overwrite=job.request.overwrite)
            except BaseException as e:  # noqa: BLE001 - every rank learns it in agree()
                error = _disk_error(e, f"cannot publish step {job.step} in {ctx.root}")
        fault_point("after-publish", ctx.rank)
        comm.agree(error)
    except BaseException as e:
        metrics.SAVE_FAILURES.labels(reason=type(e).__name__).inc()
        # Once every root is prepared, another root may have published: a prepared copy
        # is kept so the next open rolls it forward instead of losing the version.
        if ctx.is_leader and not prepared_everywhere:
            commit_mod.remove_tmp(ctx.root, tmp_name)
        raise
    job.stats.commit_s = time.perf_counter() - t_commit
    job.stats.total_s = time.perf_counter() - job.request.started
    metrics.COMMIT_LATENCY.observe(job.stats.total_s)
    metrics.BYTES_WRITTEN.inc(job.stats.bytes_written)
    log.info("rank %d step %d: committed %s", ctx.rank, job.step, _timings(job.stats))
    return job.stats


def _timings(s: SaveStats) -> str:
    return (
        f"in {s.total_s:.3f}s (stage {s.stage_s:.3f}s, write {s.write_s:.3f}s, fsync {s.fsync_s:.3f}s, "
        f"commit {s.commit_s:.3f}s, {s.bytes_written} bytes)"
    )
