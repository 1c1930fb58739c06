"""The main job: train, checkpoint, lose a rank, come back on another world size, match.

    python -m ckpt.demo [--dir DIR] [--steps 30] [--every 5] [--kill-at 17] [--remote URL | --moto]

1. A reference run trains a small transformer on synthetic data on 2 ranks (gloo).
2. The same run saves asynchronously every few steps to two local "disks" with the
   replicator running in the trainer (copies across the disks, upload to the remote),
   and one rank is SIGKILLed mid-run.
3. The job restarts on 3 ranks from the newest intact version, resharded, and finishes.
4. A node's loss, without the remote: 4 ranks on 2 simulated nodes (a root per node,
   `peer_copies=1`) train; node 1's ranks are SIGKILLed and its disk is replaced by an
   empty one; 4 ranks restart and restore from the peer copies node 0 holds.
5. The losses of 2+3, and of 4, must equal the reference's bit for bit: the global batch
   is the same 12 samples whatever the world size, and per-sample gradients are summed in
   one fixed order, so the arithmetic does not depend on how many ranks share the work.

Prints a summary table and writes a PNG with the loss curves and a timeline of the saves.
The remote is a local file:// directory by default; --moto starts a loopback S3 server.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckpt._job_store import job_store

GLOBAL_BATCH = 12  # divisible by 2 and 3: the same global batch at either world size
SAMPLES = 240


def _model() -> Any:
    import torch

    class Block(torch.nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.attn = torch.nn.MultiheadAttention(d, 4, batch_first=True)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

        def forward(self, x: Any) -> Any:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class TinyGPT(torch.nn.Module):
        def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2, ctx: int = 16) -> None:
            super().__init__()
            self.tok = torch.nn.Embedding(vocab, d)
            self.pos = torch.nn.Parameter(torch.zeros(ctx, d))
            self.blocks = torch.nn.Sequential(*[Block(d) for _ in range(layers)])
            self.head = torch.nn.Linear(d, vocab)

        def forward(self, idx: Any) -> Any:
            return self.head(self.blocks(self.tok(idx) + self.pos[: idx.shape[-1]]))

    torch.manual_seed(0)
    return TinyGPT()


def _worker(args: argparse.Namespace) -> None:
    """One rank. Exits 0 after `--steps`, or is killed."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # (stdout and stderr are the rank's log)
    import torch
    import torch.distributed as dist

    from ckpt import Checkpointer, DistributedSampler

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 64, (SAMPLES, 17), generator=gen)  # a synthetic corpus
    dataset = torch.utils.data.TensorDataset(tokens)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=7)
    per_rank = GLOBAL_BATCH // world
    loader = torch.utils.data.DataLoader(dataset, batch_size=per_rank, sampler=sampler, generator=torch.Generator())
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    state: dict[str, Any] = {"model": model, "optim": opt, "sched": sched, "sampler": sampler, "step": 0, "epoch": 0}
    ck = None
    report: dict[str, Any] = {"rank": rank, "world": world, "losses": {}, "saves": []}
    if args.ckpt:
        # Deferred staging: the optimizer is in the state, so save() returns before copying
        # the parameters and moments, and opt.step() waits for that copy.
        if args.nodes:  # a root per node; each node's part also on the other node, sent over the group
            ck = Checkpointer(os.path.join(args.work, "nodes", "node{node}"), peer_copies=1, deferred_staging=True)
        else:
            roots = [os.path.join(args.work, "disk0", "ckpt"), os.path.join(args.work, "disk1", "ckpt")]
            opts = json.loads(args.storage_options) if args.storage_options else None
            ck = Checkpointer(roots, replicate_to=args.remote, storage_options=opts, deferred_staging=True)
        t0 = time.perf_counter()
        resumed = ck.restore(state)
        report["restore_s"] = time.perf_counter() - t0
        report["resumed_from"] = resumed
    params = [p for p in model.parameters()]
    step, epoch = state["step"], state["epoch"]
    while step < args.steps:
        sampler.set_epoch(epoch)
        for (batch,) in loader:
            # Per-sample gradients, gathered and summed in global-batch order: the same
            # floating-point operations whatever the world size.
            grads, losses = [], []
            for sample in batch:
                model.zero_grad(set_to_none=True)
                logits = model(sample[:-1].unsqueeze(0))
                loss = torch.nn.functional.cross_entropy(logits.view(-1, 64), sample[1:])
                loss.backward()  # type: ignore[no-untyped-call]
                grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
                losses.append(loss.detach().reshape(1))
            mine = torch.stack(grads)
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine)
            all_losses = [torch.empty(per_rank) for _ in range(world)]
            dist.all_gather(all_losses, torch.cat(losses))
            # rank r's i-th sample sits at global position i * world + r
            order = [everyone[p % world][p // world] for p in range(GLOBAL_BATCH)]
            total = order[0].clone()
            for g in order[1:]:
                total += g
            total /= GLOBAL_BATCH
            offset = 0
            for p in params:
                p.grad = total[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            opt.step()
            sched.step()
            step += 1
            loss_value = sum(all_losses[p % world][p // world].item() for p in range(GLOBAL_BATCH)) / GLOBAL_BATCH
            report["losses"][step] = loss_value
            state["step"], state["epoch"] = step, epoch
            if ck is not None and step % args.every == 0:
                t0 = time.perf_counter()
                ck.save(step, state)
                report["saves"].append({"step": step, "t": time.time(), "stall_s": time.perf_counter() - t0})
            _write_report(args.out, rank, report)  # kept current: this rank may be killed
            write_progress(args.out, rank, step)
            if step >= args.steps:
                break
        else:
            epoch += 1
            continue
        break
    if ck is not None:
        ck.close()
        report["stats"] = [vars(s) for s in ck.stats()]
    _write_report(args.out, rank, report)
    dist.destroy_process_group()


def _write_report(out: str, rank: int, report: dict[str, Any]) -> None:
    tmp = os.path.join(out, f"rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, os.path.join(out, f"rank{rank}.json"))


def write_progress(out: str, rank: int, step: int) -> None:
    """Publish the rank's step by rename, so a reader never sees a truncated file."""
    tmp = os.path.join(out, f"progress.rank{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(str(step))
    os.replace(tmp, os.path.join(out, f"progress.rank{rank}"))


def read_progress(out: str, rank: int) -> int | None:
    """The step the rank last published, or None before its first one."""
    try:
        text = Path(out, f"progress.rank{rank}").read_text()
    except FileNotFoundError:
        return None
    return int(text) if text.strip() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LaunchError(RuntimeError):
    """A phase's ranks did not end as the demo expects: one failed, or hung."""


STACKS_SIGNAL = signal.SIGUSR2  # a rank the launcher stops logs its threads' stacks first
ON_FAILURE_S = 10.0  # a failed rank leaves the others blocked in a collective: how long they get
AFTER_KILL_S = 60.0  # the survivors of a kill fail in their next collective: how long they get


def _launch(
    world: int,
    out: str,
    extra: list[str],
    kill_rank_at: tuple[int, int] | None = None,
    per_node: int | None = None,
    kill_once: Callable[[], bool] = lambda: True,
    worker: Sequence[str] = (sys.executable, "-m", "ckpt.demo", "--worker"),
    timeout: float = 600.0,
) -> list[int]:
    """Start `world` rank processes (`per_node` to a simulated node; default: one node),
    as torchrun does: this process hosts the job's TCPStore. Optionally SIGKILL one rank
    when it reaches a step (and `kill_once()` holds), with the other ranks of its node.
    Returns the exit codes.

    Raises LaunchError when a rank fails without a kill, or when ranks are still running
    `timeout` seconds after the start (or long after a failure or the kill); those ranks
    log their threads' stacks before they are stopped, and the error quotes their logs.
    """
    per_node = per_node or world
    os.makedirs(out, exist_ok=True)
    store, rendezvous = job_store(world)
    procs: list[subprocess.Popen[bytes]] = []
    logs = [os.path.join(out, f"rank{rank}.log") for rank in range(world)]
    killed: list[int] = []
    killed_at: float | None = None
    failed_at: float | None = None  # when a rank first failed, no kill before
    try:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), **rendezvous)
            env.update(LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node), OMP_NUM_THREADS="1")
            with open(logs[rank], "wb") as log:
                cmd = [*worker, "--out", out, *extra]
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        start = time.monotonic()
        while True:
            codes = [p.poll() for p in procs]
            now = time.monotonic()
            if failed_at is None and killed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if None not in codes:
                break
            if kill_rank_at is not None and killed_at is None and failed_at is None:
                victim, at = kill_rank_at
                reached = read_progress(out, victim)
                if codes[victim] is None and reached is not None and reached >= at and kill_once():
                    killed = (
                        [r for r in range(world) if r // per_node == victim // per_node]
                        if per_node < world
                        else [victim]
                    )
                    for r in killed:
                        procs[r].send_signal(signal.SIGKILL)
                    killed_at = now
                    print(
                        f"  SIGKILL rank{'s' if len(killed) > 1 else ''} {', '.join(map(str, killed))} at step {reached}"
                    )
            late = (
                now - start > timeout
                or (failed_at is not None and now - failed_at > ON_FAILURE_S)
                or (killed_at is not None and now - killed_at > AFTER_KILL_S)
            )
            if late:
                break
            time.sleep(0.01)
    finally:
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for r in hung:
            with contextlib.suppress(ProcessLookupError):
                procs[r].send_signal(STACKS_SIGNAL)
        if hung:
            time.sleep(1.0)  # for the stacks to reach the logs
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        del store  # (served until every rank has ended)
    if killed_at is not None and not hung:
        print(f"  the other ranks ended {time.monotonic() - killed_at:.1f} s after the kill")
    ended = [p.wait() for p in procs]  # (each has ended)
    failed = [r for r, c in enumerate(ended) if c != 0 and r not in killed and r not in hung]
    if hung or failed_at is not None:
        what = [f"rank {r} still running, stopped" for r in hung]
        what += [f"rank {r} exited with {ended[r]}" for r in failed]
        tails = "\n".join(f"--- {logs[r]} (end) ---\n{_tail(logs[r])}" for r in sorted({*hung, *failed}))
        raise LaunchError(f"{out}: {'; '.join(what)}\n{tails}")
    return ended


def _tail(path: str, size: int = 6000) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - size))
        return f.read().decode(errors="replace")


def _start_moto(work: str) -> tuple[subprocess.Popen[bytes], str, dict[str, Any]]:
    import boto3

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "demo")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "demo-secret")
    for _ in range(200):
        try:
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="ckpt-demo")
            break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    return proc, "s3://ckpt-demo/run", {"endpoint_url": endpoint}


def _du(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if os.path.isdir(path) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="work directory (default: a fresh temp dir)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=17)
    ap.add_argument("--remote", default=None, help="remote tier URL (default: file://<dir>/remote)")
    ap.add_argument("--moto", action="store_true", help="start a loopback S3 server (moto) as the remote")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each run's ranks may take (default 600)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--storage-options", default="", help=argparse.SUPPRESS)
    ap.add_argument("--nodes", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    from ckpt._peer_status import verified_peer_steps

    work = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="ckpt-demo-"))
    for d in ("disk0", "disk1"):
        os.makedirs(os.path.join(work, d), exist_ok=True)
        Path(work, d, ".ckpt-disk").write_text(d)  # two simulated disks: copies must not share one
    moto = None
    options: dict[str, Any] = {}
    remote = args.remote or f"file://{os.path.join(work, 'remote')}"
    if args.moto:
        moto, remote, options = _start_moto(work)
    common = ["--steps", str(args.steps), "--every", str(args.every), "--work", work]
    try:
        print(f"ckpt demo in {work} (remote: {remote})")
        print("1) reference run: 2 ranks, no checkpoints")
        _launch(2, os.path.join(work, "ref"), common, timeout=args.timeout)
        print(f"2) 2 ranks, async saves every {args.every} steps to 2 disks + replication; one rank dies")
        run = [*common, "--ckpt", "--remote", remote, "--storage-options", json.dumps(options)]
        codes = _launch(2, os.path.join(work, "killed"), run, kill_rank_at=(1, args.kill_at), timeout=args.timeout)
        print(f"  exit codes {codes}")
        print("3) restart on 3 ranks from the newest intact version (resharded)")
        _launch(3, os.path.join(work, "resumed"), run, timeout=args.timeout)
        print("4) 4 ranks on 2 nodes with peer copies, no remote; node 1 dies and comes back with an empty disk")
        nodes = [*common, "--ckpt", "--nodes"]
        node0 = os.path.join(work, "nodes", "node0")
        codes = _launch(
            4,
            os.path.join(work, "node-lost"),
            nodes,
            kill_rank_at=(2, args.kill_at),
            per_node=2,
            kill_once=lambda: bool(verified_peer_steps(node0)),  # a node lost before any copy: an error, not this demo
            timeout=args.timeout,
        )
        print(f"  exit codes {codes}")
        shutil.rmtree(os.path.join(work, "nodes", "node1"))
        os.makedirs(os.path.join(work, "nodes", "node1"))
        print("  node 1's disk replaced by an empty one; restart on 4 ranks")
        _launch(4, os.path.join(work, "node-back"), nodes, per_node=2, timeout=args.timeout)
        return _summarize(work, remote, options, args)
    except LaunchError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait()


def _summarize(work: str, remote: str, options: dict[str, Any], args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ckpt.replicator.status import read_status

    def load(run: str, rank: int) -> dict[str, Any]:
        with open(os.path.join(work, run, f"rank{rank}.json")) as f:
            return json.load(f)  # type: ignore[no-any-return]

    ref = load("ref", 0)
    resumed = [load("resumed", r) for r in range(3)]
    start = resumed[0]["resumed_from"]
    ref_losses = {int(k): v for k, v in ref["losses"].items()}
    got = {int(k): v for k, v in resumed[0]["losses"].items()}
    exact = all(got[s] == ref_losses[s] for s in got) and len(got) == args.steps - (start or 0)
    back = [load("node-back", r) for r in range(4)]
    node_start = back[0]["resumed_from"]
    node_got = {int(k): v for k, v in back[0]["losses"].items()}
    node_exact = (
        node_start is not None
        and all(node_got[s] == ref_losses[s] for s in node_got)
        and len(node_got) == args.steps - node_start
    )
    saves = [s for r in resumed for s in r["saves"] if r["rank"] == 0]
    stats = resumed[0].get("stats", [])
    status = read_status(os.path.join(work, "disk0", "ckpt"))
    versions = status.versions.values() if status is not None else []
    lags = [v.remote.at - v.created for v in versions if v.remote is not None and v.remote.state == "verified"]
    table = Table(title="ckpt demo summary")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("resumed from step", str(start)),
        ("saves after the restart (rank 0)", str(len(saves))),
        ("stall per save, median", f"{1e3 * _median([s['stall_s'] for s in saves]):.1f} ms"),
        ("time to commit, median", f"{1e3 * _median([s['total_s'] for s in stats]):.0f} ms"),
        ("replication lag to the remote, median", f"{_median(lags):.2f} s" if lags else "-"),
        ("restore time (3 ranks, resharded)", f"{max(r['restore_s'] for r in resumed):.2f} s"),
        ("bytes on disk0 / disk1", f"{_du(os.path.join(work, 'disk0')):,} / {_du(os.path.join(work, 'disk1')):,}"),
        ("bytes on the remote", f"{_du(remote[len('file://') :]):,}" if remote.startswith("file://") else "(s3)"),
        ("losses identical to the uninterrupted run", "yes, bit for bit" if exact else "NO"),
        ("node loss (no remote): resumed from step, from peer copies", str(node_start)),
        ("node loss: restore time (4 ranks)", f"{max(r['restore_s'] for r in back):.2f} s"),
        ("node loss: losses identical to the uninterrupted run", "yes, bit for bit" if node_exact else "NO"),
    ]
    for r in rows:
        table.add_row(*r)
    Console().print(table)
    _plot(work, ref_losses, load("killed", 0), resumed[0], start)
    print(f"plot: {os.path.join(work, 'demo.png')}; checkpoints: ckpt ls {os.path.join(work, 'disk0', 'ckpt')}")
    ok = exact and node_exact
    print("RESULT:", "the resumed runs are bit-exact" if ok else "MISMATCH")
    return 0 if ok else 1


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def _plot(work: str, ref: dict[int, float], killed: dict[str, Any], resumed: dict[str, Any], start: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7))
    a.plot(list(ref), list(ref.values()), "k-", lw=3, alpha=0.3, label="reference, uninterrupted (2 ranks)")
    k = {int(s): v for s, v in killed["losses"].items()}
    a.plot(list(k), list(k.values()), "C0.-", label="2 ranks, one killed")
    r = {int(s): v for s, v in resumed["losses"].items()}
    a.plot(list(r), list(r.values()), "C1.-", label=f"resumed on 3 ranks from step {start}")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.legend()
    a.set_title("loss: the resumed run continues the reference exactly")
    saves = [(s, "killed run") for s in killed["saves"]] + [(s, "resumed run") for s in resumed["saves"]]
    stats = {s["step"]: s for s in killed.get("stats", []) + resumed.get("stats", [])}
    t0 = min(s["t"] for s, _ in saves) if saves else 0
    for i, (s, label) in enumerate(saves):
        y = i
        b.barh(y, s["stall_s"], left=s["t"] - t0, color="C3")
        st = stats.get(s["step"])
        if st:
            b.barh(y, st["total_s"] - s["stall_s"], left=s["t"] - t0 + s["stall_s"], color="C2", alpha=0.6)
        b.text(s["t"] - t0, y, f" step {s['step']} ({label})", va="center", fontsize=7)
    b.set_xlabel("seconds since the first save")
    b.set_title("saves: training stall (red) and background write + commit (green)")
    b.set_yticks([])
    fig.tight_layout()
    fig.savefig(os.path.join(work, "demo.png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
