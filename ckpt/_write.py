"""The WRITE phase of a save: this rank's staged chunks into files of the tmp directory.

Writers take the chunks largest first on a few lanes (store.lanes), each chunk written
from the staging buffer (O_DIRECT where it can) with its checksums computed from the same
bytes; with overlap_writes a writer waits only for its own chunk's copy (Readiness).
Every file is fsynced once at the end, together: one journal commit for all.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from ckpt._exchange import apply
from ckpt._job import ChunkRecord, SaveJob
from ckpt._staging import StageTask
from ckpt.store.dtypes import itemsize
from ckpt.store.errors import NonFiniteError
from ckpt.store.faults import fault_delay
from ckpt.store.fsio import DIR_MODE, fsync_files, in_ram, makedirs_within, write_chunk, write_new
from ckpt.store.lanes import LIGHT_BYTES, run_lanes
from ckpt.store.layout import block_rows, chunk_file
from ckpt.store.manifest import STATE_PREFIX
from ckpt.store.spare import spare_key, take
from ckpt.store.zarr_meta import ArrayNode, documents

__all__ = ["metadata_documents", "open_tree", "write_tasks"]

_LANES = 16  # at most this many writer lanes per save (bounded by the pool's threads)


def open_tree(job: SaveJob, root: str, tmp_dir: str, writers: Sequence[int]) -> None:
    """The save's tmp directory: the spare tree of its layout where the root keeps one
    (store.spare: its files are overwritten in place), else a new directory. Every rank of
    the root tries; the first to rename the spare wins, the others find it in place."""
    key = spare_key(job.request.layout, writers) if job.request.layout else ""
    if job.written.reused:  # by an earlier batch of this save (bounded staging)
        return
    job.written.reused = bool(key) and take(root, tmp_dir, key)
    if not job.written.reused:
        makedirs_within(root, tmp_dir)  # a root gone with its disk is not made again below its mount point


def metadata_documents(job: SaveJob, tmp_dir: str) -> tuple[list[tuple[str, bytes]], set[str]]:
    """The zarr.json files known before the data is written: groups and every array but the
    inline ones (whose value is their fill_value and comes with the manifest); and every
    metadata directory, the inline arrays' included.

    In a spare tree this rank took (job.written.reused), the documents of the groups below
    the root and of the arrays are those of a committed version of the same layout key,
    which covers everything they say (ckpt._plan.layout_key): they stay as they are, durable
    already, unless one is missing or of another size. The root group's names the step."""
    plans = job.request.plans
    nodes = [ArrayNode(f"{STATE_PREFIX}/{p.spec.name}", p.spec.data_type, p.spec.shape, p.chunk_shape) for p in plans]
    docs, dirs = documents(tmp_dir, nodes, {"ckpt": {"step": job.step}})
    inline = {os.path.join(tmp_dir, STATE_PREFIX, p.spec.name, "zarr.json") for p in plans if p.inline}
    top = os.path.join(tmp_dir, "zarr.json")
    return [d for d in docs if d[0] not in inline and (d[0] == top or not (job.written.reused and _holds(*d)))], dirs


def _holds(path: str, data: bytes) -> bool:
    """Whether `path` is a file of data's size (of a spare tree of the same layout key)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == len(data)


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
    tasks = [t for t in job.tasks if t.sliver is None]  # slivers were sent, not written here
    arena_np = job.arena.numpy()
    written: list[str] = []  # list.append is atomic: the writer threads share it

    def doc(item: tuple[str, bytes]) -> None:
        write_new(*item, replace=True)  # the tree may be a spare (ckpt.store.spare)
        written.append(item[0])

    def one(task: StageTask) -> tuple[str, ChunkRecord, int]:
        if job.ready is not None:
            job.ready.wait(task)
        if task.chunk.slivers:  # the other ranks' parts, received before any writer started
            apply(job.arena, task, job.received[(task.array.spec.name, task.chunk.index)])
        if job.stats.first_write_s is None:  # racy between lanes, harmlessly: about the same instant
            job.stats.first_write_s = time.perf_counter() - job.request.started
        view = memoryview(arena_np[task.offset : task.offset + task.staged_bytes])  # type: ignore[arg-type]
        name, index = task.array.spec.name, task.chunk.index
        if task.chunk.inline:
            if job.request.check_finite:
                _check_finite(job, task)
            raw = bytes(view)
            value = raw.hex()
            if inline_docs:
                spec = task.array.spec
                node = ArrayNode(f"{STATE_PREFIX}/{name}", spec.data_type, spec.shape, task.array.chunk_shape, value)
                (zarr_json,), _ = documents(tmp_dir, [node], None)
                doc(zarr_json)
                job.written.inline_docs.add(name)
            return name, ChunkRecord(index, xxhash.xxh3_64_hexdigest(raw), value, ()), 0
        if job.request.check_finite:
            _check_finite(job, task)
        fault_delay("write", task.chunk.writer)
        path = os.path.join(tmp_dir, chunk_file(f"{STATE_PREFIX}/{name}", task.chunk.index))
        item = itemsize(task.array.spec.data_type)
        rows = block_rows(task.array.chunk_shape, item)
        row_bytes = math.prod(task.array.chunk_shape[1:]) * item
        # No fsync here: the writer moves on to the next chunk (an O_DIRECT part is on the
        # device already; a buffered part's writeback runs meanwhile); every file is fsynced
        # below, together (one journal commit for all).
        chunk = write_chunk(
            path, view, block_bytes=rows * row_bytes, fsync=False, direct=job.request.direct_io, replace=True
        )
        written.append(path)
        return name, ChunkRecord(index, chunk.xxh3, None, tuple(chunk.blocks)), chunk.direct_bytes

    t0 = time.perf_counter()
    # Every directory first (the inline arrays' too, whose zarr.json holds their value),
    # on one thread, before any data is dirty: ext4 (data=ordered) makes a mkdir next to
    # running writeback wait for a journal commit, which flushes the data written so far.
    # Created from the writer threads, mkdirs took most of their time (py-spy).
    new_dirs: set[str] = set()
    for task in tasks:
        if not task.chunk.inline:
            new_dirs.update(_ancestors(tmp_dir, chunk_file(f"{STATE_PREFIX}/{task.array.spec.name}", task.chunk.index)))
    new_dirs.update(meta_dirs)
    for d in sorted(new_dirs):  # parents sort before their children
        if d not in job.written.dirs:
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, DIR_MODE)
    job.written.dirs.update(new_dirs)
    # Largest first, so the writers finish together instead of one writing a big chunk alone.
    ordered: list[StageTask | tuple[str, bytes]] = [*sorted(tasks, key=lambda t: -t.staged_bytes), *docs]

    def work(task: StageTask | tuple[str, bytes]) -> tuple[str, ChunkRecord, int] | None:
        if isinstance(task, StageTask):
            return one(task)
        doc(task)  # the small metadata files go last
        return None

    # In memory (tmpfs) a small file's write is a short copy between system calls, each a
    # point where competing writers queue for the GIL: one writer takes the small files
    # while the others write the large chunks (1.5 GB to tmpfs, 2 cores: writes 184-197 ms
    # against 206-235). Not while the copy still runs (overlap_writes): the small chunks
    # may be the last it reaches, and that writer would wait for them.
    solo = 0
    if not job.overlap and in_ram(tmp_dir):
        solo = sum(1 for t in ordered if not isinstance(t, StageTask) or t.staged_bytes < LIGHT_BYTES)
    # On a failure every lane has stopped before the arena may be reused.
    outcomes, failed = run_lanes(ordered, work, _LANES, pool=pool, solo=solo)
    if job.ready is not None:
        job.ready.result()  # a failed copy says more than the writers it stopped
    if failed:
        raise failed[0][1]
    results = outcomes[: len(tasks)]
    for r in results:
        assert r is not None
        name, record, direct_bytes = r
        job.written.records.setdefault(name, []).append(record)
        job.stats.direct_bytes += direct_bytes
    fsync_files(written)
    job.stats.bytes_written += sum(task.chunk.nbytes for task in tasks)
    # From the end of the copy when the writers overlapped it: the time they waited for it
    # is the copy's, and would make a rank with a slow copy look like one with a slow disk.
    copied = job.ready.finished_at if job.ready is not None else None
    job.stats.write_s += time.perf_counter() - max(t0, copied or t0)


_FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
# float8: no min/max kernel; the bytes of NaN (and of Inf, where the type has it), by mask
_FLOAT8_NONFINITE: dict[torch.dtype, tuple[int, int]] = {  # (mask, value): byte & mask == value
    torch.float8_e4m3fn: (0x7F, 0x7F),
    torch.float8_e5m2: (0x7C, 0x7C),
    torch.float8_e4m3fnuz: (0xFF, 0x80),
    torch.float8_e5m2fnuz: (0xFF, 0x80),
}


def _nonfinite(raw: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the staged bytes `raw` of a floating `dtype` hold NaN or Inf."""
    if dtype in _FLOAT8_NONFINITE:
        mask, value = _FLOAT8_NONFINITE[dtype]
        return bool(((raw & mask) == value).any()) if raw.numel() else False
    values = raw.view(dtype)
    if dtype.is_complex:
        values = torch.view_as_real(values).reshape(-1)
    lo, hi = torch.aminmax(values)
    return not (torch.isfinite(lo) and torch.isfinite(hi))


def _check_finite(job: SaveJob, task: StageTask) -> None:
    """NaN/Inf in the staged copy: one min/max pass, no temporary of the chunk's size (a
    float8 chunk: one mask pass, a boolean temporary)."""
    dtype = task.dtype
    if dtype not in _FLOATS and dtype not in _FLOAT8_NONFINITE and not dtype.is_complex:
        return
    raw = job.arena[task.offset : task.offset + task.staged_bytes]
    if _nonfinite(raw, dtype):
        rank = task.chunk.writer
        raise NonFiniteError(
            f"tensor {task.array.spec.name!r} holds NaN or Inf on rank {rank} (check_finite); "
            f"step {job.step} was not committed, the previous version stays the newest"
        )


def _ancestors(top: str, rel: str) -> list[str]:
    """Every directory from `top` down to the one holding `rel`: each may be new, so each is fsynced."""
    parts = rel.split("/")[:-1]
    return [os.path.join(top, *parts[:i]) for i in range(len(parts) + 1)]
