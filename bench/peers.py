"""Peer copies and the RAM tier, measured side by side (issue: surviving a node's loss).

    python bench/peers.py [--params 40e6] [--reps 3] [--dir DIR] [--out FILE] [--skip-s3]

(bench/run.py runs it too, and puts its figures and targets in latest.json and latest.md.)

- recovery after a node's loss: 4 gloo ranks on 2 simulated nodes (LOCAL_WORLD_SIZE=2, a
  root per node, `peer_copies=1`), the bench state (model + Adam, DTensor Shard(0) over the
  4 ranks). Node 1's root is then replaced by an empty directory and the 4 ranks restore
  (cold page cache): its part comes from the peer copies on node 0 over the group. Against
  the same restore with every root in place (the same bytes, all local), and against the
  restore of node 1's part from the remote (moto S3 on 127.0.0.1, the version uploaded by
  the replicator) with the peer copies gone too. Every restore is checked bitwise.
- training-step cost (steady state, at least STEP_REPS repetitions): 2 ranks on 2 nodes,
  after KEEP_LAST + 2 unmeasured saves of each Checkpointer (see _step_cost), deferred
  staging, a save followed by 8 training
  steps (fixed matmul work, ~0.5 s alone, and the optimizer step, which waits for the
  deferred copy), from save() until the steps are done, the version committed and (with
  `peer_copies=1`) each root's peer copy verified, against the same without peer copies:
  the whole cost of the copy, wherever it falls. Also when the steps and commit were done,
  and a transport floor: the same save without peer copies while a background thread sends
  and receives a root's part over a gloo group (no reads, writes or hashing): the share of
  the cost that loopback TCP alone takes on this machine.
- RAM tier: time to committed (save + wait) on `/dev/shm`, against the tmpfs write floor
  (the fastest of bench/_floors.py's write strategies, writing the same bytes there).

Writes FILE (default bench/results/peers.json: figures, ratios, targets) and prints a table.
Needs root (the page cache is dropped before each restore).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

SHM = "/dev/shm/ckpt-bench-peers"
KEEP_LAST = 2  # of the training-step phase's Checkpointers
STEP_REPS = 7  # at least: single repetitions' ratios ranged 0.87-1.11 on this machine
WARM_SAVES = KEEP_LAST + 2  # until every save and peer copy writes into a retired version's tree
TARGETS = {
    "recovery from peer copies / same-layout local restore": 1.5,
    "training step with peer_copies=1 / without": 1.05,
}


# -- the parent ------------------------------------------------------------------------


def _launch(phase: str, world: int, local_world: int, args: argparse.Namespace, extra: dict[str, str]) -> None:
    from ckpt._job_store import job_store

    store, rendezvous = job_store(world)
    procs = []
    for rank in range(world):
        env = dict(os.environ, **extra, **rendezvous)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank % local_world),
            LOCAL_WORLD_SIZE=str(local_world),
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        cmd = [sys.executable, __file__, "--worker", phase, "--params", str(args.params), "--reps", str(args.reps)]
        cmd += ["--dir", args.dir, "--results", os.path.join(args.dir, "peers.jsonl")]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO))
    codes = [p.wait() for p in procs]
    del store  # (served until every rank has ended)
    if any(codes):
        raise SystemExit(f"bench/peers.py phase {phase} failed: exit codes {codes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=40e6, help="model parameters (state ~12 bytes each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckpt-bench-peers")
    ap.add_argument("--out", default=str(HERE / "results" / "peers.json"))
    ap.add_argument("--skip-s3", action="store_true")
    ap.add_argument("--only", choices=["recovery", "step", "ram"], default=None, help="run one phase")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--results", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    env: dict[str, str] = {}
    moto = None
    if not args.skip_s3 and args.only in (None, "recovery"):
        from run import FAKE_AWS, Moto

        moto = Moto(args.dir, "peers")
        env = dict(FAKE_AWS, BENCH_S3_ENDPOINT=moto.endpoint, BENCH_S3_BUCKET=moto.bucket)
    try:
        if args.only in (None, "recovery"):
            _launch("recovery", 4, 2, args, env)
    finally:
        if moto is not None:
            moto.stop()
    if args.only in (None, "step"):
        _launch("step", 2, 1, args, {})
    if args.only in (None, "ram"):
        _launch("ram", 1, 1, args, {})
    with open(os.path.join(args.dir, "peers.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    out = summarize(records, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("\n".join(markdown(out)))
    shutil.rmtree(args.dir, ignore_errors=True)


def summarize(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Medians per operation, and ratios taken within each repetition, then their median."""
    by: dict[str, dict[int, float]] = {}
    extra: dict[str, list[float]] = {}
    for r in records:
        by.setdefault(r["op"], {})[r["rep"]] = r["seconds"]
        for k, v in r.get("extra", {}).items():
            extra.setdefault(f"{r['op']}: {k}", []).append(v)
    medians = {op: statistics.median(v.values()) for op, v in by.items()}

    per_rep: dict[str, list[float]] = {}

    def ratio(a: str, b: str) -> float | None:
        reps = sorted(set(by.get(a, {})) & set(by.get(b, {})))
        per_rep[f"{a} / {b}"] = [round(by[a][i] / by[b][i], 3) for i in reps]
        return statistics.median(by[a][i] / by[b][i] for i in reps) if reps else None

    ratios = {
        "recovery from peer copies / same-layout local restore": ratio("restore after node loss, from peers", "restore, all roots in place"),
        "recovery from the remote / from peer copies": ratio("restore after node loss, from the remote", "restore after node loss, from peers"),
        "training step with peer_copies=1 / without": ratio("save + steps, peer_copies=1", "save + steps, no peer copies"),
        "training step with the copy's bytes over gloo alone / without": ratio(
            "save + steps, no peer copies + the copy's bytes over gloo", "save + steps, no peer copies"
        ),
        "RAM-tier save / tmpfs write floor": ratio("ckpt save + wait, /dev/shm", "tmpfs write floor"),
    }  # fmt: skip
    how = {
        "recovery from peer copies / same-layout local restore": "restore after node loss, from peers / restore, all roots in place",
        "training step with peer_copies=1 / without": "save + steps, peer_copies=1 / save + steps, no peer copies",
    }  # fmt: skip
    targets = []
    for name, limit in TARGETS.items():
        reps = per_rep.get(how[name], [])
        value = ratios[name]
        targets.append(
            {
                "name": name,
                "value": value,
                "target": limit,
                "pass": value is not None and value <= limit,
                "range": [min(reps), max(reps)] if reps else [0.0, 0.0],
                "per_rep": reps,
                "how": how[name] + ", same repetition",
            }
        )
    sizes = {r["op"]: r["bytes"] for r in records if "bytes" in r}
    return {
        "params": args.params,
        "reps": args.reps,
        "medians_s": medians,
        "runs_s": {op: [v[i] for i in sorted(v)] for op, v in by.items()},
        "extra_medians": {k: statistics.median(v) for k, v in extra.items()},
        "bytes": sizes,
        "ratios": ratios,
        "targets": targets,
    }


def markdown(out: dict[str, Any]) -> list[str]:
    """The figures as markdown (bench/run.py appends it to latest.md)."""
    lines = [
        f"### Peer copies and the RAM tier ({out['params']:.3g} parameters, Adam; {out['reps']} repetitions)",
        "",
        "| operation | median | bytes |",
        "| --- | --- | --- |",
    ]
    for op, s in out["medians_s"].items():
        size = out["bytes"].get(op)
        lines.append(f"| {op} | {s:.3f} s | {'' if size is None else f'{size / 2**20:,.0f} MiB'} |")
    for k, v in out["extra_medians"].items():
        lines.append(f"| {k} | {v:.3f} s | |")
    lines += ["", "| ratio (median of per-repetition ratios) | value | target |", "| --- | --- | --- |"]
    limits = {t["name"]: t for t in out["targets"]}
    for name, value in out["ratios"].items():
        t = limits.get(name)
        mark = "" if t is None else f"<= {t['target']} {'PASS' if t['pass'] else 'FAIL'}"
        lines.append(f"| {name} | {'n/a' if value is None else f'{value:.2f}x'} | {mark} |")
    return lines


# -- the ranks -------------------------------------------------------------------------


class _Ranks:
    def __init__(self, results: str) -> None:
        import torch.distributed as dist

        self.dist = dist
        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.results = results

    def barrier(self) -> None:
        self.dist.barrier()

    def slowest(self, seconds: float) -> float:
        import torch

        t = torch.tensor([seconds], dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def total(self, value: float) -> float:
        import torch

        t = torch.tensor([value], dtype=torch.float64)
        self.dist.all_reduce(t)
        return float(t.item())

    def record(self, op: str, rep: int, seconds: float, **fields: Any) -> None:
        worst = self.slowest(seconds)
        if self.rank == 0:
            with open(self.results, "a") as f:
                f.write(json.dumps({"op": op, "rep": rep, "seconds": worst, **fields}) + "\n")
            print(f"[{time.strftime('%H:%M:%S')}] rep {rep} {op:45s} {worst:7.3f} s", flush=True)

    def cold(self) -> None:
        import _sys

        self.barrier()
        if self.rank == 0:
            _sys.drop_caches()
        self.barrier()


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import _workload
    import torch

    return all(torch.equal(x, y) for x, y in zip(_workload.local_tensors(a), _workload.local_tensors(b)))


def _rotate(ops: list[Any], rep: int) -> list[Any]:
    k = rep % len(ops)
    return ops[k:] + ops[:k]


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    ranks = _Ranks(args.results)
    {"recovery": _recovery, "step": _step_cost, "ram": _ram}[args.worker](args, ranks)
    ranks.dist.destroy_process_group()


def _recovery(args: argparse.Namespace, ranks: _Ranks) -> None:
    import _workload
    from torch.distributed.device_mesh import init_device_mesh

    from ckpt import Checkpointer
    from ckpt.replicator.config import ReplicatorConfig
    from ckpt.replicator.service import Replicator

    mesh = init_device_mesh("cpu", (ranks.world,))
    state = _workload.build_state(args.params, ranks.rank, ranks.world, mesh)
    root = os.path.join(args.dir, "node{node}")
    node = ranks.rank // int(os.environ["LOCAL_WORLD_SIZE"])
    leader = ranks.rank % int(os.environ["LOCAL_WORLD_SIZE"]) == 0
    endpoint = os.environ.get("BENCH_S3_ENDPOINT")
    remote = f"s3://{os.environ['BENCH_S3_BUCKET']}/run" if endpoint else None
    options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    away = os.path.join(args.dir, "away")

    def move(paths: list[str]) -> None:
        """Rank 0 takes node 1's root (and what else is named) away: a node's loss."""
        ranks.barrier()
        if ranks.rank == 0:
            os.makedirs(away, exist_ok=True)
            for p in paths:
                os.rename(p, os.path.join(away, p.replace("/", "_")))
            os.makedirs(os.path.join(args.dir, "node1"), exist_ok=True)
        ranks.barrier()

    def bring_back(paths: list[str]) -> None:
        ranks.barrier()
        if ranks.rank == 0:
            shutil.rmtree(os.path.join(args.dir, "node1"))
            for p in paths:
                os.rename(os.path.join(away, p.replace("/", "_")), p)
        ranks.barrier()

    def restore(op: str, rep: int, step: int, tiers: list[str]) -> None:
        target = _workload.empty_state(args.params, ranks.rank, ranks.world, mesh)
        with Checkpointer(root, peer_copies=1, tiers=tiers, storage_options=options) as ck:
            ranks.cold()
            t = time.perf_counter()
            got = ck.restore(target)
            seconds = time.perf_counter() - t
        if got != step or not _same(target, state):
            raise SystemExit(f"{op}: restored step {got}, bitwise equal: {_same(target, state)}")
        ranks.record(op, rep, seconds, bytes=_workload.nbytes(state) * ranks.world)

    node1 = os.path.join(args.dir, "node1")
    peers_of_node1 = os.path.join(args.dir, "node0", "replicas")
    for rep in range(args.reps):
        step = rep + 1
        with Checkpointer(root, peer_copies=1, keep_last=1) as ck:
            ck.save(step, state)
        # close() let the peer copies finish; each leader checks its own was verified
        from ckpt._peer_status import verified_peer_steps

        if leader and step not in verified_peer_steps(root.format(node=node)):
            raise SystemExit(f"rank {ranks.rank}: step {step}'s peer copy was not verified")
        if remote is not None:  # each node's replicator uploads its part; a second pass sees it complete
            config = ReplicatorConfig(remote=remote, storage_options=options)
            for _ in range(2):
                if leader:
                    Replicator([root.format(node=node)], config).run_once()
                ranks.barrier()

        def local(rep: int = rep, step: int = step) -> None:
            restore("restore, all roots in place", rep, step, [])

        def from_peers(rep: int = rep, step: int = step) -> None:
            move([node1])
            restore("restore after node loss, from peers", rep, step, [])
            bring_back([node1])

        def from_remote(rep: int = rep, step: int = step) -> None:
            move([node1, peers_of_node1])
            restore("restore after node loss, from the remote", rep, step, [remote] if remote else [])
            bring_back([node1, peers_of_node1])

        for op in _rotate([local, from_peers] + ([from_remote] if remote else []), rep):
            op()


def _step_cost(args: argparse.Namespace, ranks: _Ranks) -> None:
    import threading

    import _sys
    import torch
    from partial_and_preemption import build_model

    from ckpt import Checkpointer
    from ckpt._peer_status import verified_peer_steps
    from ckpt.store import versions

    model, opt = build_model(args.params / 2)
    state = {"model": model, "optim": opt, "step": 0}
    a, b, c = torch.randn(512, 512), torch.randn(512, 512), torch.empty(512, 512)
    t = time.perf_counter()
    for _ in range(10):
        torch.mm(a, b, out=c)
    per = (time.perf_counter() - t) / 10
    n = int(ranks.slowest(max(1.0, 0.5 / per)))  # ~0.5 s of work a step, the same on every rank
    steps = 8  # long enough for the peer copy to end inside the window: what it costs, all of it
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3

    def train() -> None:
        for _ in range(steps):
            for _ in range(n):
                torch.mm(a, b, out=c)
            opt.step()  # waits for the deferred copy of the parameters and moments

    mine = os.path.join(args.dir, "step-{mode}", "node{node}")
    cks = {
        mode: Checkpointer(
            mine.format(mode=mode, node="{node}"),
            deferred_staging=True,
            keep_last=KEEP_LAST,
            peer_copies=int(mode == "peers"),
        )
        for mode in ("none", "peers")
    }
    label = {
        "none": "save + steps, no peer copies",
        "peers": "save + steps, peer_copies=1",
        "floor": "save + steps, no peer copies + the copy's bytes over gloo",
    }
    step = 0
    # Not measured: the saves before the steady state of a long run. The first save of a
    # layout plans it, and until retention has deleted a version (keep_last + 1 saves) each
    # save creates its files and directories, and so does each peer copy; after that both
    # write into the tree of a version retention deleted (store.spare). Creating a file or
    # directory costs 0.3-0.8 ms of CPU on this machine's ext4 against ~0.01 ms to overwrite
    # one: a peer copy's first rounds cost ~0.25 CPU s each at this size, once per run.
    for mode, ck in cks.items():
        for _ in range(WARM_SAVES):
            step += 1
            ck.save(step, state)
            ck.wait()
            path = mine.format(mode=mode, node=ranks.rank)
            t0 = time.perf_counter()
            while mode == "peers" and step not in verified_peer_steps(path) and time.perf_counter() - t0 < 120:
                time.sleep(0.01)
    # The transport floor: what moving a root's part to its peer costs by itself, the same
    # bytes each way over a gloo group of their own on a background thread (no reads,
    # writes, hashing or commits), alongside a save without peer copies.
    part = _sys.du(os.path.join(mine.format(mode="peers", node=ranks.rank), versions.version_dirname(step)))
    wire = ranks.dist.new_group(backend="gloo")
    other = 1 - ranks.rank
    pieces = [torch.empty(8 << 20, dtype=torch.uint8) for _ in range(2)]

    def transfer() -> None:
        for r in range(-(-part // (8 << 20))):
            got = ranks.dist.irecv(pieces[(r + 1) % 2], src=other, group=wire, tag=r)
            ranks.dist.isend(pieces[r % 2], dst=other, group=wire, tag=r).wait()
            got.wait()

    for rep in range(max(args.reps, STEP_REPS)):
        for mode in _rotate([*cks, "floor"], rep):
            ck = cks["none" if mode == "floor" else mode]
            step += 1
            time.sleep(0.5)  # the previous round's background work is over
            ranks.barrier()
            cpu0, sys0 = _cpu_seconds(), _system_cpu()
            t0 = time.perf_counter()
            ck.save(step, state)
            wire_thread = threading.Thread(target=transfer) if mode == "floor" else None
            if wire_thread is not None:
                wire_thread.start()
            train()
            ck.wait()
            if wire_thread is not None:
                wire_thread.join()
            steps_done = time.perf_counter() - t0
            if mode == "peers":  # the window ends once this root's copy is verified too: all of its cost
                path = mine.format(mode=mode, node=ranks.rank)
                while step not in verified_peer_steps(path) and time.perf_counter() - t0 < 120:
                    time.sleep(0.01)
            seconds = time.perf_counter() - t0
            cpu = ranks.total(_cpu_seconds() - cpu0)
            busy = {k: v - sys0[k] for k, v in _system_cpu().items()}
            extra = {"steps and commit done after": steps_done, "CPU s, both ranks' processes": cpu}
            extra.update({f"CPU s, machine ({k})": v for k, v in busy.items()})
            ranks.record(label[mode], rep, seconds, bytes=nbytes * ranks.world, extra=extra)
    for ck in cks.values():
        ck.close()


def _cpu_seconds() -> float:
    """This process's CPU time, every thread, user and system."""
    t = os.times()
    return t.user + t.system


def _system_cpu() -> dict[str, float]:
    """The machine's CPU seconds so far by kind (/proc/stat: the kernel's work for the
    processes too, such as softirq for loopback TCP), summed over cores."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, iowait, irq, softirq = (x / tick for x in fields)
    return {"user+nice": user + nice, "system": system, "irq+softirq": irq + softirq, "iowait": iowait}


def _ram(args: argparse.Namespace, ranks: _Ranks) -> None:
    import _floors
    import _workload

    from ckpt import Checkpointer

    shutil.rmtree(SHM, ignore_errors=True)
    state = _workload.build_state(args.params)
    tensors = _workload.local_tensors(state)
    size = _workload.nbytes(state)
    floor_dir = os.path.join(SHM, "floor")
    try:
        with Checkpointer(os.path.join(SHM, "root"), keep_last=1) as ck:
            ck.save(0, state)  # plans the layout, allocates the staging buffer
            ck.wait()
            for rep in range(args.reps):
                t = time.perf_counter()
                ck.save(rep + 1, state)
                ck.wait()
                ranks.record("ckpt save + wait, /dev/shm", rep, time.perf_counter() - t, bytes=size)
                best = float("inf")
                for strategy in _floors.WRITE_STRATEGIES:
                    shutil.rmtree(floor_dir, ignore_errors=True)
                    t = time.perf_counter()
                    try:
                        _floors.write_floor(floor_dir, 0, tensors, strategy)
                    except OSError:  # O_DIRECT refused by an older kernel's tmpfs
                        continue
                    best = min(best, time.perf_counter() - t)
                ranks.record("tmpfs write floor", rep, best, bytes=size)
    finally:
        shutil.rmtree(SHM, ignore_errors=True)


if __name__ == "__main__":
    main()
