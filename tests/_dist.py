"""Run a test scenario on N real processes joined by a gloo process group.

The parent (pytest) calls `launch(module_file, "scenario_name", world, workdir, **kwargs)`.
It starts `world` fresh Python processes running this module (`python -m tests._dist`,
from the repository root); each joins a gloo group through a FileStore under `workdir`,
calls `scenario_name(ctx, **kwargs)` from `module_file`, and writes
`workdir/<tag>.rank<r>.json` with the scenario's result and the failed checks. The
parent raises AssertionError if any process failed, timed out, recorded a failed check
or wrote no result, so a broken library fails the test.

Checks inside a scenario go through `ctx.check(cond, msg)`: a failed check is recorded
and the scenario goes on, so no rank leaves the others hanging in a collective.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STACKS_SIGNAL = signal.SIGUSR2  # a rank still running when the parent stops it logs its threads' stacks


@dataclass
class Ctx:
    rank: int
    world: int
    workdir: Path
    failures: list[str] = field(default_factory=list)
    section: str = "main"  # failed checks are reported as "[section] rank r: message"

    def check(self, cond: Any, msg: str) -> bool:
        if not cond:
            self.failures.append(f"[{self.section}] rank {self.rank}: {msg}")
        return bool(cond)


@dataclass(frozen=True)
class Nodes:
    """Ranks on simulated nodes that share no filesystem: each rank runs in a private mount
    namespace (unshare -m, as root) where `view` is an empty tmpfs holding only its node's
    disk, `disks/node<k>` bind-mounted at `view/node<k>` (k = rank // per_node); the other
    nodes' disks are not there to see. LOCAL_WORLD_SIZE and LOCAL_RANK are set as torchrun
    sets them."""

    disks: Path
    view: Path
    per_node: int

    def command(self, rank: int, argv: list[str]) -> list[str]:
        k = rank // self.per_node
        disk, seen = self.disks / f"node{k}", self.view / f"node{k}"
        script = (
            f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(self.view))} && mkdir {shlex.quote(str(seen))} && "
            f'mount --bind {shlex.quote(str(disk))} {shlex.quote(str(seen))} && exec "$@"'
        )
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def can_isolate() -> bool:
    """Whether Nodes can run here: root, unshare(1), and mount namespaces allowed."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def in_private_mounts(setup: str, script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -c script` from the repository root, in a private mount namespace (as root)
    after the shell commands `setup` (mounts that only this process sees)."""
    cmd = f'{setup} && exec {shlex.quote(sys.executable)} -c "$0"'
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd, script],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=str(REPO),
    )


def launch(
    module_file: str,
    scenario: str,
    world: int,
    workdir: Path,
    *,
    timeout: float = 120,
    isolate: Nodes | None = None,
    killed: frozenset[int] = frozenset(),
    **kwargs: Any,
) -> tuple[list[Any], list[str]]:
    """Run `scenario` on `world` processes: (each rank's result, every failed check).

    Raises AssertionError when a process crashed, timed out or wrote no result. With
    `isolate`, each rank sees only its own node's disk (Nodes). The ranks
    in `killed` must die of SIGKILL (the scenario kills them: a node lost); the others then
    exit without the final barrier, and their results are returned in rank order. A rank
    still running when launch stops it (past `timeout`, or 10 s after another rank failed)
    first logs every thread's stack, as do its child processes.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"{scenario}-{uuid.uuid4().hex[:8]}"
    store = workdir / f"{tag}.store"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # Several ranks share few cores: one intra-op thread each keeps them from thrashing.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("PYTHONHASHSEED", None)  # each process hashes differently, as in a real job
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that aborts in native code logs every thread's Python stack
    # Each rank a node of its own (its own root), as torchrun on one-GPU nodes says: without
    # it, peer copies tell nodes apart by host name, and this one host is a single node.
    env.setdefault("LOCAL_WORLD_SIZE", "1")
    spec = json.dumps(
        {
            "module": str(module_file),
            "scenario": scenario,
            "kwargs": kwargs,
            "tag": tag,
            "store": str(store),
            "workdir": str(workdir),
            "killed": sorted(killed),
        }
    )
    procs = []
    logs = []
    for rank in range(world):
        log = open(workdir / f"{tag}.rank{rank}.log", "wb")
        logs.append(log)
        # -m from the repository root, not this file's path: a script's folder (tests/)
        # would come first on sys.path, and tests/ckpt/ would shadow the ckpt package.
        argv = [sys.executable, "-m", "tests._dist", spec, str(rank), str(world)]
        rank_env = env
        if isolate is not None:
            argv = isolate.command(rank, argv)
            rank_env = {**env, "LOCAL_WORLD_SIZE": str(isolate.per_node), "LOCAL_RANK": str(rank % isolate.per_node)}
        procs.append(
            subprocess.Popen(
                argv,
                cwd=REPO,
                env=rank_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if any(p.returncode not in (None, 0) for p in procs) and first_failure is None:
                first_failure = now
            # A dead rank leaves the others blocked in a collective: give them a moment, then stop them.
            if now > deadline or (first_failure is not None and now - first_failure > 10):
                timed_out = now > deadline
                break
            time.sleep(0.05)
    finally:
        hung = [p for p in procs if p.poll() is None]
        below = [q for p in hung for q in _descendants(p.pid)]
        for pid in [*(p.pid for p in hung), *below]:
            # Its children (DataLoader workers) inherit the handler: a worker that hangs
            # leaves its rank waiting, and its stack says why. One at a time: a rank and
            # its children write to the same log.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, STACKS_SIGNAL)
            time.sleep(0.3)
        if hung:
            time.sleep(0.5)  # for the last stacks to reach the logs
        for p in hung:
            p.kill()
            p.wait()
        for pid in below:  # orphaned by their rank's death, they would run on past the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for log in logs:
            log.close()
    problems: list[str] = []
    failures: list[str] = []
    results: list[Any] = []
    for rank, p in enumerate(procs):
        out = (workdir / f"{tag}.rank{rank}.log").read_text(errors="replace")
        if rank in killed:
            if p.returncode != -9:
                problems.append(f"rank {rank}: should have died of SIGKILL, exit code {p.returncode}\n{out[-4000:]}")
            continue
        res_path = workdir / f"{tag}.rank{rank}.json"
        res = json.loads(res_path.read_text()) if res_path.exists() else None
        if p.returncode != 0 or res is None:
            problems.append(
                f"rank {rank}: exit code {p.returncode}{' (timed out)' if timed_out else ''}, "
                f"result {'missing' if res is None else 'written'}\n--- output ---\n{out[-12000:]}"
            )
            if res is not None:
                problems.extend(res["failures"])
        else:
            failures.extend(res["failures"])
            results.append(res["result"])
    if problems:
        raise AssertionError(f"{scenario} on {world} ranks failed:\n" + "\n".join(problems + failures))
    return results, failures


def _descendants(pid: int) -> list[int]:
    """The processes below `pid`, at any depth (Linux /proc)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _worker(spec_json: str, rank: int, world: int) -> None:
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # (stderr is the rank's log)
    spec = json.loads(spec_json)
    import torch.distributed as dist

    ctx = Ctx(rank, world, Path(spec["workdir"]))
    out_path = Path(spec["workdir"]) / f"{spec['tag']}.rank{rank}.json"
    dist.init_process_group(
        "gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        mod_spec = importlib.util.spec_from_file_location("_scenarios", spec["module"])
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        result = getattr(module, spec["scenario"])(ctx, **spec["kwargs"])
        if not spec["killed"]:
            dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, then the process exits 1
        traceback.print_exc()
        ctx.failures.append(f"rank {rank}: exception\n{traceback.format_exc()}")
        out_path.write_text(json.dumps({"failures": ctx.failures, "result": None}))
        sys.stdout.flush()
        os._exit(1)  # peers may be stuck in a collective; do not wait for a clean shutdown
    tmp = out_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"failures": ctx.failures, "result": result}))
    os.replace(tmp, out_path)
    if spec["killed"]:  # the group lost members: no clean shutdown to wait for
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()
    # DCP and DeviceMesh keep references to the default group past destroy_process_group,
    # so its gloo threads would otherwise be torn down during interpreter finalization,
    # where they can abort the process (SIGABRT) after a passing scenario. The result is
    # written: end without finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
