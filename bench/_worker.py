"""One rank of one benchmark phase (started by bench/run.py; not meant to be run by hand).

Phases (each on the medium under --dir: the disk, or tmpfs):
  save      world 1 or 2: training stall and time to durable for ckpt (its own retention,
            keep_last=1: on a disk each save overwrites the tree of the version retention
            retired; also once with every file created anew), torch.save (world 1), DCP
            save (thread_count 1/2/4), DCP async_save with a reused stager,
            torch-checkpointing (bench/_torchckpt.py), the copy and raw write floors and
            the same-work floors (bench/_floors.SameWork: copy, xxh3, one file, fsync);
            each write that has a reader is followed by a restore of what it wrote
            (ckpt, torch.load, DCP load, torch-checkpointing, the raw and same-work read
            floors; cold: see cold()), same layout. Also ckpt with overlap_writes=True (stall and durable,
            no restore), and a training step (fixed compute) without a save and with one
            from ckpt, ckpt with deferred staging, ckpt with overlap_writes, and DCP
            async_save. At world 1 (which runs after world 2) also the resharded 2->1
            restores of what the world-2 phase left (ckpt, DCP, torch-checkpointing), in
            the same repetitions.
  restore   world 3: cold restores 2->3 of what the world-2 phase left; ckpt, DCP and
            torch-checkpointing.
  replicate world 1: ckpt's replicator vs a plain s3fs put, to a loopback moto server.

Every measurement is appended as a JSON line to the results file by rank 0: the
slowest rank's seconds (a collective operation is as slow as its slowest rank), each
rank's seconds, and the sums over ranks of the extra peak RSS and, for saves and
restores, of the CPU seconds (bench/_sys.cpu_seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import _floors  # noqa: E402
import _sys  # noqa: E402
import _torchckpt  # noqa: E402
import _workload  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
MEDIUM = ["disk"]  # of --dir (main sets it)


def log(msg: str) -> None:
    if RANK == 0:
        print(f"[{time.strftime('%H:%M:%S')} w{WORLD}] {msg}", flush=True)


class Recorder:
    def __init__(self, path: str, phase: str, medium: str) -> None:
        self.path, self.phase, self.medium = path, phase, medium

    def gather(self, obj: Any) -> list[Any]:
        if WORLD == 1:
            return [obj]
        out: list[Any] = [None] * WORLD
        dist.all_gather_object(out, obj)
        return out

    def add(
        self, op: str, rep: int, seconds: float, extra_rss: int = 0, cpu: float | None = None, **extra: Any
    ) -> None:
        """One measurement: the slowest rank's seconds, the RSS and CPU seconds summed over ranks."""
        views = self.gather((seconds, extra_rss, cpu))
        if RANK == 0:
            rec = {
                "phase": self.phase,
                "medium": self.medium,
                "world": WORLD,
                "op": op,
                "rep": rep,
                "seconds": max(v[0] for v in views),
                "rank_seconds": [v[0] for v in views],
                "extra_rss": sum(v[1] for v in views),
                **extra,
            }
            if cpu is not None:
                rec["cpu_s"] = sum(v[2] for v in views)
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            log(f"rep {rep} {op:34s} {rec['seconds']:7.3f} s  extra RSS {rec['extra_rss'] / 2**30:5.2f} GiB")


def barrier() -> None:
    if WORLD > 1:
        dist.barrier()


def cold(reads: str) -> None:
    """Before a restore: on a disk, every rank's data out of the page cache. On tmpfs, whose
    files stay in memory whatever is dropped, every file under `reads` (what the restore
    reads) is read once, untimed, by the ranks together: on this VM memory left idle for a
    few seconds reads 1.5-2x slower (a 1.5 GB restore from tmpfs 3 s after its files were
    last touched took 0.62 s, 0.46 s right after), and the same-layout restores read what
    their save had just written while the resharded ones read what an earlier phase wrote
    minutes before. So every tmpfs restore, of every library, starts from files just read."""
    barrier()
    if MEDIUM[0] == "tmpfs":
        _sys.read_tree(reads, RANK, WORLD)
    elif RANK == 0:
        _sys.drop_caches()
    barrier()


def touch(tensors: list[torch.Tensor]) -> None:
    """Read one byte of every page of `tensors`, as the training step before a save would.

    On this VM, memory left untouched for a second or more costs ~1 us per 4 KiB page on
    its next access (2.5x slower copies), whoever touches it first. Every stall measurement
    starts from state the training step has just touched, and from its own destination
    buffer as it was left by its previous use.
    """
    for t in tensors:
        if t.numel():
            t.detach().reshape(-1).view(torch.uint8)[::4096].sum()


def timed(
    rec: Recorder, op: str, rep: int, fn: Callable[[], Any], prep: Callable[[], Any] | None = None, **extra: Any
) -> Any:
    barrier()
    if prep is not None:
        prep()
    m = _sys.Measured(fn)
    rec.add(op, rep, m.seconds, m.extra_rss, cpu=m.cpu, **extra)
    return m.result


def rmtree(path: str) -> None:
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)
    barrier()


def global_fingerprint(state: dict[str, Any]) -> list[float]:
    """Sums of a few sharded tensors, summed over ranks: the same at every world size."""
    local = torch.tensor(_workload.fingerprint(state), dtype=torch.float64)
    if WORLD > 1:
        dist.all_reduce(local)
    return [float(x) for x in local]


def check(state: dict[str, Any], expected: list[float] | None, what: str) -> None:
    if expected is None:
        return
    got = global_fingerprint(state)
    for g, e in zip(got, expected):
        if abs(g - e) > 1e-6 * max(1.0, abs(e)):
            raise SystemExit(f"{what}: restored state differs from the saved one ({got} != {expected})")


def spoil(state: dict[str, Any]) -> None:
    """Zero the fingerprinted tensors so a restore that does nothing is caught by check()."""
    ts = _workload.local_tensors(state)
    for t in (ts[0], ts[len(ts) // 3], ts[-2], ts[-1]):
        t.zero_()


class Compute:
    """The forward and backward passes of a training step, as fixed CPU work (matmuls), about
    `seconds` long when alone: what runs between a save() and the next optimizer step."""

    def __init__(self, rec: Recorder, seconds: float = 1.0) -> None:
        self.a, self.b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        self.c = torch.empty(1024, 1024)
        barrier()
        t = time.perf_counter()
        for _ in range(10):
            torch.mm(self.a, self.b, out=self.c)
        per = (time.perf_counter() - t) / 10
        self.n = max(rec.gather(max(1, round(seconds / per))))  # the same work on every rank

    def run(self) -> None:
        for _ in range(self.n):
            torch.mm(self.a, self.b, out=self.c)


def rotate(ops: list[Any], rep: int) -> list[Any]:
    k = (rep * 3) % len(ops)
    return ops[k:] + ops[:k]


# -- the save phase -------------------------------------------------------------------


def _caching_writer(path: str) -> Any:
    """FileSystemWriter(cache_staged_state_dict=True), to be reused by every async_save.

    Its cache is allocated with pin_memory=True, which raises without an accelerator; on a
    CPU-only torch the same stager code runs with pageable memory instead.
    """
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint import FileSystemWriter

    if torch.cuda.is_available():
        return FileSystemWriter(path, cache_staged_state_dict=True)

    class UnpinnedCachingWriter(FileSystemWriter):
        def stage(self, state_dict: Any) -> Any:  # BlockingAsyncStager.stage with pin_memory=False
            self.per_thread_copy_ahead = 0
            if self.state_dict_cache is None:
                self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=False)
            return _copy_state_dict(state_dict, self.state_dict_cache)

    return UnpinnedCachingWriter(path, cache_staged_state_dict=True)


def phase_save(args: argparse.Namespace, rec: Recorder, mesh: Any) -> None:
    """Stall and time-to-durable of every writer, each followed by a cold restore of what it wrote.

    The virtual disk here writes ~3x faster into blocks that were just freed than into
    blocks never (or long ago) written. So every write goes under one directory (the ckpt
    root), and the previous write's output is deleted (and synced) right before the next
    write starts: every writer reuses about the same amount of freshly freed space.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckpt import Checkpointer
    from ckpt.store.spare import spares
    from ckpt.store.versions import version_dirname

    base = os.path.join(args.dir, f"w{WORLD}")
    rmtree(base)
    t = time.perf_counter()
    state = _workload.build_state(args.params, RANK, WORLD, mesh)
    tensors = _workload.local_tensors(state)
    total = sum(rec.gather(_workload.nbytes(state)))
    fp = global_fingerprint(state)
    log(f"state built in {time.perf_counter() - t:.1f}s: {total / 1e9:.2f} GB, {len(tensors)} tensors per rank")
    if RANK == 0:
        with open(os.path.join(args.dir, f"meta-w{WORLD}.json"), "w") as f:
            json.dump(
                {
                    "state_bytes": total,
                    "fingerprint": fp,
                    "tensors": len(tensors),
                    "width": _workload.width_for(args.params),
                    "params": args.params,
                    "dir": args.dir,
                },
                f,
            )
    gc.collect()
    baseline_rss = sum(rec.gather(_sys.rss()))

    root = os.path.join(base, "ckpt")
    # Its own retention, as in a training loop: the version before the newest is deleted
    # (on a disk, kept as the spare tree the next save overwrites: ckpt.store.spare).
    ck = Checkpointer(root, keep_last=1)
    tc = _torchckpt.TorchCheckpointing()
    same = _floors.SameWork(tensors)

    def warm() -> None:
        touch(tensors)

    step = [0]

    def free_previous() -> None:
        """Delete the previous write's output (a sibling directory of ckpt's versions, which
        ckpt's retention deletes itself), then sync."""
        barrier()
        if RANK == 0:
            for name in os.listdir(root):
                if name.startswith("out-"):
                    shutil.rmtree(os.path.join(root, name))
            os.sync()
        barrier()

    def out(name: str) -> str:
        return os.path.join(root, f"out-{name}")

    def restore(op: str, rep: int, fn: Callable[[], Any], reads: str, verify: bool = True) -> None:
        spoil(state)
        cold(reads)
        timed(rec, op, rep, fn)
        check(state, fp if verify else None, op)

    # The copy floor: two threads, glibc memcpy (about twice torch's copy_ here), into the
    # same-work floor's buffer, as its previous use left it (as ckpt's arena and DCP's
    # stager are).
    copy_floor = [False]  # measured once DCP's stager exists: the same memory pressure

    default_config = ck.config
    # With overlap_writes=True the writers start while save() copies. This machine leaves
    # it off by default (CheckpointerConfig.overlap_writes: too few cores).
    overlap_config = dataclasses.replace(default_config, overlap_writes=True)

    def use(config: Any) -> None:
        """The tunables of the next saves: the save pipeline (ckpt._save.Saver) holds its own
        reference, read at each save; setting only ck.config changed nothing."""
        ck.config = config
        ck._saver.config = config

    def save_and_wait(config: Any) -> tuple[float, float, float]:
        """One ckpt save with `config`: (seconds save() blocked, seconds until committed, CPU seconds)."""
        use(config)
        try:
            cpu = _sys.cpu_seconds()
            t0 = time.perf_counter()
            ck.save(step[0], state)
            t1 = time.perf_counter()
            ck.wait()
            return t1 - t0, time.perf_counter() - t0, _sys.cpu_seconds() - cpu
        finally:
            use(default_config)

    # ckpt: the first save allocates the staging buffer; later ones reuse it.
    def ckpt_save(rep: int, first: bool = False, new_tree: bool = False) -> None:
        free_previous()
        if copy_floor[0]:  # the copy floor, under the same conditions, just before
            timed(rec, "stall/floor_copy_2_threads_memcpy", rep, same.copy, warm)
        if new_tree:  # no spare tree to overwrite: every file and directory created
            barrier()
            if RANK == 0:
                for tree in spares(root):
                    shutil.rmtree(tree)
                os.sync()
        step[0] += 1
        barrier()
        warm()
        _sys.reset_peak()
        before = _sys.rss()
        stall, durable, cpu = save_and_wait(default_config)
        extra = max(0, _sys.peak() - before)
        s = ck.stats()[-1]
        tag = "_first" if first else "_new_tree" if new_tree else ""
        if not new_tree:
            rec.add(f"stall/ckpt{tag}", rep, stall, extra)
        rec.add(
            f"durable/ckpt{tag}",
            rep,
            durable,
            extra,
            cpu,
            write_s=s.write_s,
            fsync_s=s.fsync_s,
            commit_s=s.commit_s,
            direct_bytes=s.direct_bytes,
        )
        if not first and not new_tree:
            restore(
                f"restore/ckpt_{WORLD}to{WORLD}",
                rep,
                lambda: ck.restore(state, step=step[0]),
                os.path.join(root, version_dirname(step[0])),
            )

    ckpt_save(-1, first=True)

    def ckpt_save_overlap(rep: int) -> None:
        free_previous()
        step[0] += 1
        barrier()
        warm()
        stall, durable, cpu = save_and_wait(overlap_config)
        rec.add("stall/ckpt_overlap", rep, stall)
        rec.add("durable/ckpt_overlap", rep, durable, cpu=cpu)

    buf = getattr(getattr(ck, "_arena", None), "buffer", None)  # the staging buffer ckpt keeps between saves
    arena_bytes = sum(rec.gather(buf.numel() if buf is not None else 0))
    del buf

    # DCP async_save with one reused stager (FileSystemWriter(cache_staged_state_dict=True)).
    writer = _caching_writer(out("dcp_async_first"))

    def dcp_async(rep: int, first: bool = False) -> None:
        free_previous()
        path = out("dcp_async_first" if first else f"dcp_async_r{rep}")
        barrier()
        warm()
        _sys.reset_peak()
        before = _sys.rss()
        cpu = _sys.cpu_seconds()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=path, storage_writer=writer)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        cpu = _sys.cpu_seconds() - cpu
        extra = max(0, _sys.peak() - before)
        tag = "_first" if first else ""
        rec.add(f"stall/dcp_async_save{tag}", rep, t1 - t0, extra)
        rec.add(f"durable/dcp_async_save{tag}", rep, t2 - t0, extra, cpu)

    dcp_async(-1, first=True)
    same.copy()
    copy_floor[0] = True

    def tc_save(rep: int, first: bool = False) -> None:
        """torch-checkpointing: stall until its staging is done, its future (files written,
        not fsynced: it never fsyncs), then the fsync a durable save needs, by this bench."""
        free_previous()
        path = out("torch_checkpointing")
        barrier()
        warm()
        _sys.reset_peak()
        before = _sys.rss()
        cpu = _sys.cpu_seconds()
        t0 = time.perf_counter()
        stall, written = tc.save(path, state)
        barrier()  # rank 0 renames its tmp directory onto `path` last
        if RANK == 0:
            _sys.fsync_tree(path)
        barrier()
        durable = time.perf_counter() - t0
        cpu = _sys.cpu_seconds() - cpu
        extra = max(0, _sys.peak() - before)
        tag = "_first" if first else ""
        rec.add(f"stall/torch_checkpointing{tag}", rep, stall, extra)
        rec.add(f"written/torch_checkpointing{tag}", rep, written, extra)
        rec.add(f"durable/torch_checkpointing{tag}", rep, durable, extra, cpu)
        if not first:
            restore(f"restore/torch_checkpointing_{WORLD}to{WORLD}", rep, lambda: tc.load(path, state), path)

    tc_save(-1, first=True)

    def same_work(strategy: str, threads: int, direct_read: bool = False) -> Callable[[int], None]:
        """The same-work write `strategy`, then the first read of its file (`threads`, through
        the page cache or with O_DIRECT). On the VM here how a file was written decides how
        fast it reads back cold: the layer below the guest keeps what was written through
        the page cache, not what was written with O_DIRECT (bench/run.py), so each read is
        the first of a file just written, and the file ckpt's own restore is compared with is
        written as ckpt writes (O_DIRECT where the medium takes it)."""

        def run(rep: int) -> None:
            free_previous()
            path = out(f"same_{strategy}")
            try:
                if direct_read:  # a second write of the strategy, for this read only: not timed
                    barrier()
                    same.write(path, RANK, strategy)
                else:
                    timed(rec, f"durable/same_work_{strategy}", rep, lambda: same.write(path, RANK, strategy), warm)
            except OSError as e:  # O_DIRECT refused by the medium: the other strategies stand
                if e.errno != errno.EINVAL:
                    raise
                log(f"same-work {strategy}: {e}")
                return
            name = f"{'o_direct_' if direct_read else ''}{threads}_thread{'s' if threads > 1 else ''}"
            if _floors.SAME_WORK_WRITES[strategy][1]:
                name += "_of_o_direct_write"
            restore(
                f"restore/same_work_read_{name}",
                rep,
                lambda: same.read(path, RANK, threads, direct=direct_read),
                path,
                verify=False,
            )
            check(state, fp, "same-work read")

        return run

    def torch_save(rep: int) -> None:
        free_previous()
        path = os.path.join(out("torch"), "state.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        warm()
        _sys.reset_peak()
        before = _sys.rss()
        cpu = _sys.cpu_seconds()
        t0 = time.perf_counter()
        torch.save(state, path)
        t1 = time.perf_counter()
        _sys.fsync_path(path)
        _sys.fsync_path(os.path.dirname(path))
        t2 = time.perf_counter()
        cpu = _sys.cpu_seconds() - cpu
        extra = max(0, _sys.peak() - before)
        rec.add("stall/torch_save", rep, t1 - t0, extra)
        rec.add("durable/torch_save", rep, t2 - t0, extra, cpu)

        def load() -> None:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            for name, t in state["model"].items():  # what load_state_dict does
                t.copy_(loaded["model"][name])
            for name, s in state["optim"]["state"].items():
                for k, t in s.items():
                    t.copy_(loaded["optim"]["state"][name][k])

        restore("restore/torch_load", rep, load, path)

    def dcp_save(threads: int) -> Callable[[int], None]:
        def run(rep: int) -> None:
            free_previous()
            path = out(f"dcp_t{threads}")
            timed(
                rec,
                f"durable/dcp_save_t{threads}",
                rep,
                lambda: dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=threads)),
                warm,
            )
            if threads == 1:  # DCP's default
                restore(f"restore/dcp_{WORLD}to{WORLD}", rep, lambda: dcp.load(state, checkpoint_id=path), path)

        return run

    def write_floor(strategy: str) -> Callable[[int], None]:
        def run(rep: int) -> None:
            free_previous()
            path = out(f"floor_{strategy}")
            timed(
                rec, f"durable/floor_{strategy}", rep, lambda: _floors.write_floor(path, RANK, tensors, strategy), warm
            )
            files = _floors.WRITE_STRATEGIES[strategy][0]
            if strategy == "one_file":
                restore(
                    "restore/floor_read_1_thread",
                    rep,
                    lambda: _floors.read_floor(path, RANK, tensors, 1),
                    path,
                    verify=False,
                )
                restore(
                    "restore/floor_read_1_file_4_threads",
                    rep,
                    lambda: _floors.read_floor_ranges(path, RANK, tensors, 4),
                    path,
                    verify=False,
                )
                check(state, fp, "floor reads")
            elif strategy == "4_files_4_threads":
                restore(
                    "restore/floor_read_4_files_4_threads",
                    rep,
                    lambda: _floors.read_floor(path, RANK, tensors, files),
                    path,
                    verify=False,
                )
                check(state, fp, "floor reads")

        return run

    # A training step that saves: save(), then the step's forward and backward (Compute), then
    # what its optimizer step must wait for (deferred staging: the copy). Its time minus the
    # same step without a save is what the save cost training, whatever save() blocked for;
    # background work (writes, a deferred copy) that slows the compute counts too.
    compute = Compute(rec)
    # The training loop's optimizer: it owns the state's tensors (so deferred staging may copy
    # them late) and its step() waits for that copy. lr=0 and no gradients: step() changes nothing.
    optimizer = torch.optim.SGD(tensors, lr=0.0)
    ck.guard(optimizer)
    modes = {
        "ckpt_deferred": dataclasses.replace(default_config, deferred_staging=True),
        "ckpt_overlap": overlap_config,
    }

    def train_step(mode: str) -> Callable[[int], None]:
        def run(rep: int) -> None:
            free_previous()
            step[0] += 1
            barrier()
            warm()
            fut = None
            use(modes.get(mode, default_config))
            try:
                t0 = time.perf_counter()
                if mode.startswith("ckpt"):
                    ck.save(step[0], state)
                elif mode == "dcp_async_save":
                    fut = dcp.async_save(state, checkpoint_id=out(f"step_dcp_r{rep}"), storage_writer=writer)
                t1 = time.perf_counter()
                compute.run()
                optimizer.step()
                t2 = time.perf_counter()
                ck.wait()
                if fut is not None:
                    fut.result()
            finally:
                use(default_config)
            rec.add(f"train_step/{mode}", rep, t2 - t0)
            if mode == "ckpt_deferred":
                rec.add("stall/ckpt_deferred", rep, t1 - t0)
                rec.add("staged/ckpt_deferred", rep, ck.stats()[-1].staged_s)

        return run

    ops: list[Callable[[int], None]] = [
        ckpt_save,
        train_step("none"),
        train_step("ckpt"),
        train_step("ckpt_deferred"),
        ckpt_save_overlap,
        train_step("ckpt_overlap"),
        train_step("dcp_async_save"),
        dcp_save(1),
        dcp_async,
        write_floor("one_file"),
        dcp_save(2),
        write_floor("4_files_4_threads"),
        dcp_save(4),
        write_floor("4_files_4_threads_sync_file_range"),
        write_floor("4_files_4_threads_o_direct"),
        tc_save,
        same_work("buffered_1_thread", 1),
        same_work("buffered_4_threads", 4),
        same_work("o_direct_4_threads", 4),
        same_work("o_direct_4_threads", 4, direct_read=True),
        functools.partial(ckpt_save, new_tree=True),
    ]
    ck2 = None
    if WORLD == 1:
        ops.insert(5, torch_save)
        # Resharded 2->1 (what the world-2 phase left), in the same repetitions as 1->1.
        w2 = os.path.join(args.dir, "w2")
        ck2 = Checkpointer(os.path.join(w2, "ckpt"))
        step2 = ck2.latest_step()
        ops.insert(
            3,
            lambda rep: restore(
                "restore/ckpt_2to1",
                rep,
                lambda: ck2.restore(state, step=step2),
                os.path.join(w2, "ckpt", version_dirname(step2)),
            ),
        )
        ops.insert(
            7,
            lambda rep: restore(
                "restore/dcp_2to1",
                rep,
                lambda: dcp.load(state, checkpoint_id=os.path.join(w2, "dcp")),
                os.path.join(w2, "dcp"),
            ),
        )
        ops.insert(
            11,
            lambda rep: restore(
                "restore/torch_checkpointing_2to1",
                rep,
                lambda: tc.load(os.path.join(w2, "torch_checkpointing"), state),
                os.path.join(w2, "torch_checkpointing"),
            ),
        )
    for rep in range(args.reps):
        for op in rotate(ops, rep):
            op(rep)
    same.close()
    gc.collect()
    if ck2 is not None:
        ck2.close()
    if WORLD == 2:  # left on disk for the 2->1 and 2->3 restores
        free_previous()
        t = time.perf_counter()
        step[0] += 1
        ck.save(step[0], state)
        ck.wait()
        dcp.save(state, checkpoint_id=os.path.join(base, "dcp"))
        tc.save(os.path.join(base, "torch_checkpointing"), state)
        barrier()
        log(
            f"kept a version of ckpt, DCP and torch-checkpointing for the resharding restores ({time.perf_counter() - t:.1f}s)"
        )
    tc.close()
    ck.close()
    if RANK == 0:
        with open(os.path.join(args.dir, f"rss-w{WORLD}.json"), "w") as f:
            json.dump({"arena_bytes": arena_bytes, "baseline_rss": baseline_rss, "state_bytes": total}, f)


# -- the restore phases ------------------------------------------------------------------


def phase_restore(args: argparse.Namespace, rec: Recorder, mesh: Any) -> None:
    """Cold restores of the version the world-2 phase left onto this world size (2->3): ckpt and DCP."""
    import torch.distributed.checkpoint as dcp

    from ckpt import Checkpointer
    from ckpt.store.versions import version_dirname

    with open(os.path.join(args.dir, "meta-w2.json")) as f:
        fp = json.load(f)["fingerprint"]
    state = _workload.empty_state(args.params, RANK, WORLD, mesh)
    w2 = os.path.join(args.dir, "w2")
    ck2 = Checkpointer(os.path.join(w2, "ckpt"))
    step2 = ck2.latest_step()
    tc = _torchckpt.TorchCheckpointing()
    ops: list[tuple[str, Callable[[], Any], str]] = [
        (
            f"restore/ckpt_2to{WORLD}",
            lambda: ck2.restore(state, step=step2),
            os.path.join(w2, "ckpt", version_dirname(step2)),
        ),
        (
            f"restore/dcp_2to{WORLD}",
            lambda: dcp.load(state, checkpoint_id=os.path.join(w2, "dcp")),
            os.path.join(w2, "dcp"),
        ),
        (
            f"restore/torch_checkpointing_2to{WORLD}",
            lambda: tc.load(os.path.join(w2, "torch_checkpointing"), state),
            os.path.join(w2, "torch_checkpointing"),
        ),
    ]
    for rep in range(args.reps):
        for op, fn, reads in rotate(ops, rep):
            spoil(state)
            cold(reads)
            timed(rec, op, rep, fn)
            check(state, fp, op)
        gc.collect()
    tc.close()
    ck2.close()


# -- replication ---------------------------------------------------------------------------


def phase_replicate(args: argparse.Namespace, rec: Recorder) -> None:
    import s3fs

    from ckpt import Checkpointer
    from ckpt.replicator.config import ReplicatorConfig
    from ckpt.replicator.service import Replicator
    from ckpt.store import versions

    root = os.path.join(args.dir, "replicate", "ckpt")
    shutil.rmtree(os.path.dirname(root), ignore_errors=True)
    state = _workload.build_state(args.replicate_bytes / 12)
    with Checkpointer(root) as ck:
        ck.save(1, state)
    del state
    gc.collect()
    vdir = os.path.join(root, versions.version_dirname(1))
    nbytes = _sys.du(vdir)
    opts = {"endpoint_url": args.endpoint}
    fs = s3fs.S3FileSystem(**opts)
    log(f"replicating {nbytes / 1e6:.0f} MB ({sum(len(f) for _, _, f in os.walk(vdir))} files) to {args.endpoint}")

    def ckpt_push(rep: int) -> None:
        shutil.rmtree(os.path.join(root, ".replicator"), ignore_errors=True)  # no memory of earlier passes
        url = f"s3://{args.bucket}/ckpt-r{rep}"
        r = Replicator([root], ReplicatorConfig(remote=url, storage_options=opts))
        timed(rec, "replicate/ckpt_replicator", rep, r.run_once, bytes=nbytes)
        remote = r.run_once()[root].versions[1].remote
        status = remote.state if remote is not None else None
        if status != "verified":
            raise SystemExit(f"replication did not complete: {status}")

    def plain_put(rep: int) -> None:
        timed(
            rec,
            "replicate/s3fs_put",
            rep,
            lambda: fs.put(vdir, f"{args.bucket}/plain-r{rep}", recursive=True),
            bytes=nbytes,
        )

    for rep in range(args.reps):
        for op in rotate([ckpt_push, plain_put], rep):
            op(rep)
        for prefix in (f"ckpt-r{rep}", f"plain-r{rep}"):  # moto holds objects in memory
            fs.rm(f"{args.bucket}/{prefix}", recursive=True)
        fs.invalidate_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["save", "restore", "replicate"])
    ap.add_argument("--params", type=float, required=True)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--medium", default="disk", help="what --dir is on: disk or tmpfs (recorded with each figure)")
    ap.add_argument("--endpoint", default="")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--replicate-bytes", type=float, default=512e6)
    args = ap.parse_args()
    mesh = None
    if args.phase != "replicate":
        dist.init_process_group("gloo", rank=RANK, world_size=WORLD, timeout=timedelta(minutes=30))
        if WORLD > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (WORLD,))
    name = {"save": f"save_w{WORLD}", "restore": f"restore_w{WORLD}", "replicate": "replicate"}[args.phase]
    rec = Recorder(args.results, name, args.medium)
    MEDIUM[0] = args.medium
    try:
        if args.phase == "save":
            phase_save(args, rec, mesh)
        elif args.phase == "restore":
            phase_restore(args, rec, mesh)
        else:
            phase_replicate(args, rec)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
