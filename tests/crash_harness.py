"""Crash harness: a real 2-rank training job with replication and retention, SIGKILLed
again and again at random moments, checked after every kill.

    python -m tests.crash_harness --kills 200 --seed 1 --out DIR

What runs (all separate processes, on this machine; they are forked by a multiprocessing
forkserver that has imported torch and ckpt, because a fresh interpreter takes 3 to 15 s
to import them on a small busy machine; a SIGKILL still kills one real process):
- the training job: 2 ranks over gloo (MASTER_ADDR/MASTER_PORT), each with its own root
  on its own simulated node (`DIR/node<k>/disk0/ckpt`; the ranks share no checkpoint
  directory), saving every step, asynchronously, with `peer_copies=1` (each root's part
  of every version also on the other node's root) and `keep_last` (which prunes the
  peer copies); each rank journals (fsynced, before saving) the xxh3 of every tensor it
  saves (tests/_harness_worker.py);
- one replicator daemon per node, the `ckpt replicate` command (`ckpt replicate ROOT
  --replicas 2 --replica-root DIR/node<k>/disk1 --to file://DIR/remote --keep-last 3
  --remote-keep-last 4 --milestone-every 10 --abandoned-after 60`): copies to the node's second disk and to
  the shared remote, and deletes what retention allows (the job tags every 7th step as
  a milestone).

Each round waits until the job has restored, lets it run for a random time (seeded), then
SIGKILLs one of, in a shuffled rotation:
- `rank`: one rank (the other fails in its next collective, or is killed 5 s later);
- `all-ranks`: both ranks at once;
- `daemon`: one node's replicator daemon (or both);
- `gc`: a `ckpt gc` command started during training on a local root (`--keep-last 1`) or
  on the remote (`--keep-last 2 --milestone-every 10`). A run takes a few tenths of a
  second, most of them listing, so two gc kills in three come from the fault points of
  store/faults.py, to land inside a deletion: `CKPT_FAULT=gc-mid-delete` (the version
  is unpublished, its files not yet deleted) or `gc-delete` (decided, before the deletion). The third is a SIGKILL at a random moment
  of a typical run. The figures say which, and whether the run was killed at all (a
  fault point is not reached when there is nothing to delete);
- `node`: a node's loss: its rank and its replicator daemon, then its disks are replaced
  by empty ones (its root, its replica copies and the peer copies it held for the other
  node are gone); the next incarnation restores from what the other node and the remote
  hold.
The job is then stopped (gracefully where it was not killed), the daemons too (SIGTERM:
they must exit 0), so the tiers hold still, and the invariants are checked:
1. the restore of the round that follows returns at least the newest version the ranks
   together can reach (roots, replica copies, peer copies, the remote), and its tensors
   are bitwise what the job recorded for that step;
2. no committed version disappeared from a tier unless the retention in force (the
   daemon's, the job's, or the tighter `ckpt gc` one in a gc round) allowed its deletion
   (or its node was lost), judged
   from every version known on that tier (listings taken before each kill and at each
   check, a monitor thread's listings, and the job's journal);
3. every version listed as committed passes `ckpt verify` (local roots, replica copies;
   on the remote each new version, and everything at the end);
4. the remote never shows an incomplete version (checked at every check and by the
   monitor thread twice a second during the run);
5. every version reachable on each group of tiers (both roots; both replica copies; the
   remote) is read back and compared bitwise with the job's journal, once per save.
Then the daemons start again (resuming what was in flight) and the job resumes from
restore. A round that takes over 8 minutes counts as a hang (its stacks are in the figures).
At the end the job stops and the daemons must bring every root down to its keep-last
within 60 s (every version reaches the remote, so all become redundant); garbage that
retention leaves behind (replica copies of versions deleted from their source by `ckpt
gc`, remote directories without a manifest, versions whose remote upload waits for a part
a node's loss took) is counted under `leftovers`.
It prints the figures as JSON (and writes DIR/figures.json); exit status 1 if any
version was lost or corrupted or a process failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckpt._job_store import job_store
from ckpt.replicator.service import WAITING
from ckpt.replicator.status import read_status
from tests._harness_checks import (
    WORLD,
    Journals,
    Layout,
    Retention,
    Snapshot,
    candidates,
    compare,
    deep_check,
    expected_restore,
    groups,
    reachable,
    remote_problems,
    snapshot,
    verify,
)

KINDS = ("rank", "all-ranks", "daemon", "gc", "node")


@dataclass(frozen=True, kw_only=True)
class HarnessConfig:
    out: str
    """Work directory (created; must be empty or absent)."""
    kills: int = 20
    seed: int = 0
    keep_last: int = 3
    """The daemons' local retention (roots and their replica copies)."""
    remote_keep_last: int = 4
    milestone_every: int = 10
    abandoned_after_s: float = 60.0  # the daemons collect remote uploads idle this long (a live one writes every pass)
    """Remote: every multiple of this step is kept, and every tagged step."""
    tag_every: int = 7
    """The job saves every multiple of this step with milestone=True."""
    gc_keep_last: int = 1
    """`ckpt gc` on a local root."""
    gc_remote_keep_last: int = 2
    run_s: tuple[float, float] = (0.3, 2.5)
    """The job runs for a uniform random time in this range (after its restore) before a kill."""
    step_sleep_s: float = 0.02
    """Pause per training step, so the job leaves CPU to the daemons on a small machine."""
    interval_s: float = 0.3
    """The daemons' pass interval."""
    timeout_s: float = 120.0
    """Longest wait for any process (start-up, restore, stop) before it counts as hung."""

    def __post_init__(self) -> None:
        if self.kills < 0 or self.keep_last < 1 or self.gc_keep_last < 1 or self.remote_keep_last < 1:
            raise ValueError("kills must be >= 0 and every keep-last >= 1")
        if not 0 <= self.run_s[0] <= self.run_s[1]:
            raise ValueError("run_s must be an increasing pair of non-negative seconds")


@dataclass
class Figures:
    seed: int
    kills_requested: int
    kills: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    kill_detail: dict[str, int] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)
    rounds: int = 0
    steps_committed: int = 0
    restores_checked: int = 0
    versions_checked: int = 0
    versions_verified: int = 0
    remote_scans: int = 0
    deletions_seen: int = 0
    lost: int = 0
    corruptions: int = 0
    incomplete_remote: int = 0
    nondeterministic_steps: int = 0
    failures: list[str] = field(default_factory=list)
    lost_detail: list[str] = field(default_factory=list)
    corruption_detail: list[str] = field(default_factory=list)
    leftovers: dict[str, int] = field(default_factory=dict)
    phase_s: dict[str, float] = field(default_factory=dict)
    runtime_s: float = 0.0

    def detail(self, key: str) -> None:
        self.kill_detail[key] = self.kill_detail.get(key, 0) + 1

    def note(self, key: str) -> None:
        self.notes[key] = self.notes.get(key, 0) + 1

    def timed(self, phase: str, t0: float) -> float:
        now = time.monotonic()
        self.phase_s[phase] = round(self.phase_s.get(phase, 0.0) + now - t0, 2)
        return now


class Hang(Exception):
    """A round took longer than the watchdog allows."""


def _hang(signum: int, frame: object) -> None:
    raise Hang()


class Child:
    """A process forked by the harness's forkserver, with the subprocess.Popen calls we use."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def poll(self) -> int | None:
        return self.proc.exitcode  # type: ignore[no-any-return]

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return int(self.proc.exitcode)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a reaped pid: it may belong to someone else by now
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def forkserver() -> Any:
    """A multiprocessing context whose children start with torch and ckpt imported."""
    # Read when torch is imported, so set before the forkserver starts.
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ckpt", "ckpt.cli", "tests._harness_worker"])
    return ctx


class Harness:
    def __init__(self, config: HarnessConfig) -> None:
        self.c = config
        self.layout = Layout(os.path.abspath(config.out))
        self.rng = random.Random(config.seed)
        self.fig = Figures(config.seed, config.kills)
        self.journals = Journals(self.layout)
        self.ctx = forkserver()
        self.trainers: list[Child] = []
        self._store: Any = None  # the trainers' rendezvous, served here
        self.daemons: dict[int, Child | None] = dict.fromkeys(range(WORLD))
        self.inc = 0
        self.known: dict[str, set[int]] = {}
        self.last: Snapshot = {}
        self.seen: list[Snapshot] = []  # the monitor's listings since the last check, in order
        self.judged_known: dict[str, set[int]] = {}  # per tier: every step listed up to the last check
        self.gone: dict[str, set[int]] = {}  # per tier: steps seen deleted up to the last check
        self._listing = threading.Lock()  # listings never overlap, so their order is the tiers' order
        self.checked: set[tuple[str, int, str]] = set()
        self.verified_remote: set[tuple[int, str]] = set()
        self.gc_durations: list[float] = []
        # saves (step, save_id) left incomplete (a lost node's part), so far: a save of such a
        # step may replace what is left of them, in any later round (a lost part never returns)
        self.replaceable: set[tuple[int, str]] = set()
        self.lost_through = -1  # the newest step committed when a node was last lost
        self._lock = threading.Lock()
        self._stop_monitor = threading.Event()

    # -- processes ---------------------------------------------------------------------------

    def spawn(self, kind: str, payload: Any, log: str, header: str, **env: str) -> Child:
        """Start a trainer rank or a `ckpt` command (forked: see _harness_worker.child)."""
        path = os.path.join(self.c.out, "logs", log)
        with open(path, "a") as f:
            f.write(f"=== {header}\n")
        from tests._harness_worker import child

        proc = self.ctx.Process(target=child, args=(kind, payload, env, path), name=f"harness-{log}")
        proc.start()
        return Child(proc)

    def start_daemon(self, k: int) -> None:
        lo = self.layout
        cmd = [
            "replicate", lo.root(k), "--to", lo.remote_url,
            "--replicas", "2", "--replica-root", lo.disk(k, 1), "--interval", str(self.c.interval_s),
            "--keep-last", str(self.c.keep_last), "--remote-keep-last", str(self.c.remote_keep_last),
            "--milestone-every", str(self.c.milestone_every), "--abandoned-after", str(self.c.abandoned_after_s),
        ]  # fmt: skip
        self.daemons[k] = self.spawn("cli", cmd, f"daemon{k}.log", f"ckpt {' '.join(cmd)} (round {self.fig.rounds})")

    def start_trainers(self) -> None:
        self.inc += 1
        lo = self.layout
        run = os.path.join(self.c.out, "run")
        spec = {
            "inc": self.inc,
            "roots": [lo.root(k) for k in range(WORLD)],
            "tiers": [[lo.replica(k), lo.remote_url] for k in range(WORLD)],
            "journal": lo.journal,
            "stop_file": os.path.join(run, f"stop.{self.inc}"),
            "ready_prefix": os.path.join(run, f"ready.{self.inc}"),
            "tag_every": self.c.tag_every,
            "step_sleep_s": self.c.step_sleep_s,
            "keep_last": self.c.keep_last,
            "timeout_s": 30,
        }
        self._store, rendezvous = job_store(WORLD)  # (the previous incarnation's store closes)
        self.trainers = []
        for rank in range(WORLD):
            env = {"RANK": str(rank), "WORLD_SIZE": str(WORLD), **rendezvous}
            env["LOCAL_WORLD_SIZE"] = "1"  # each rank a node (its own disks), as torchrun on that node says
            self.trainers.append(self.spawn("trainer", spec, f"rank{rank}.log", f"incarnation {self.inc}", **env))

    def wait_ready(self) -> bool:
        deadline = time.monotonic() + self.c.timeout_s
        ready = [os.path.join(self.c.out, "run", f"ready.{self.inc}.rank{r}") for r in range(WORLD)]
        while time.monotonic() < deadline:
            if all(os.path.exists(p) for p in ready):
                return True
            if any(p.poll() is not None for p in self.trainers):
                break
            time.sleep(0.05)
        codes = [p.poll() for p in self.trainers]
        self.fail(f"round {self.fig.rounds}: the job did not get ready (exit codes {codes}; see logs/rank*.log)")
        self._kill_all(self.trainers)
        return False

    def stop_trainers(self) -> None:
        """Graceful: both ranks break after the same step, close() commits the last save."""
        Path(self.c.out, "run", f"stop.{self.inc}").touch()
        deadline = time.monotonic() + self.c.timeout_s
        while any(p.poll() is None for p in self.trainers) and time.monotonic() < deadline:
            time.sleep(0.05)
        codes = [p.poll() for p in self.trainers]
        if codes != [0] * WORLD:
            self.fail(f"round {self.fig.rounds}: the job did not stop cleanly (exit codes {codes})")
        self._kill_all(self.trainers)

    @staticmethod
    def _kill_all(procs: list[Child]) -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def reap(self, proc: Child, hung: str) -> int:
        """proc's exit code; SIGKILL and a failure (`hung`) if it runs past the timeout,
        after its threads' stacks are dumped into its log."""
        try:
            return proc.wait(timeout=self.c.timeout_s)
        except subprocess.TimeoutExpired:
            from tests._harness_worker import STACKS_SIGNAL

            proc.send_signal(STACKS_SIGNAL)
            time.sleep(1.0)
            proc.kill()
            self.fail(f"round {self.fig.rounds}: {hung} (its threads' stacks are in its log)")
            return proc.wait()

    def fail(self, msg: str) -> None:
        with self._lock:
            self.fig.failures.append(msg)
        print("FAILURE:", msg, flush=True)

    # -- kills -------------------------------------------------------------------------------

    def kill_ranks(self, victims: list[int]) -> None:
        for r in victims:
            self.trainers[r].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 5.0  # the survivor fails in its next collective, or a launcher kills it
        while any(p.poll() is None for p in self.trainers) and time.monotonic() < deadline:
            time.sleep(0.05)
        if len(victims) == 1:
            survivor = self.trainers[1 - victims[0]].poll()
            how = "still running after 5 s, killed" if survivor is None else f"exited {survivor} by itself"
            self.fig.note(f"rank kill: the surviving rank {how}")
            self.fig.detail(f"rank: rank {victims[0]}")
        self._kill_all(self.trainers)

    def kill_daemons(self) -> list[int]:
        victims = self.rng.choice([[0], [1], [0, 1]])
        for k in victims:
            p = self.daemons[k]
            if p is None or p.poll() is not None:
                self.fail(
                    f"round {self.fig.rounds}: daemon {k} had exited (code {None if p is None else p.returncode})"
                )
                continue
            p.send_signal(signal.SIGKILL)
            p.wait()
            self.daemons[k] = None
        self.fig.detail(f"daemon: {'both nodes' if len(victims) == 2 else 'one node'}")
        return victims

    def kill_node(self) -> int:
        """A node's rank and daemon (the other rank fails in its next collective); its disks
        are replaced once the checks of what came before have run (lose_node)."""
        k = self.rng.randrange(WORLD)
        p = self.daemons[k]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        self.daemons[k] = None
        self.kill_ranks([k])
        return k

    def lose_node(self, k: int) -> None:
        """Node k's disks come back empty: what its tiers held is gone, by no policy's doing."""
        with self._listing:
            self.layout.replace_node(k)
            # and `peer<k>`: the name now stands for the new disk's copies (the old disk's,
            # on the other node, are listed as `peer<k>-<id>` from now on)
            departed_here = [t for t in self.last if t.startswith(f"peer{1 - k}-")]
            for tier in [*self.layout.node_tiers(k), f"peer{k}", *departed_here]:
                for snap in self.seen:  # the monitor's listings from before the loss: its versions went with it
                    snap[tier] = {}
                self.last[tier] = {}
                self.judged_known[tier] = set()
                self.gone[tier] = set()
                self.known[tier] = set()
        self.journals.refresh()
        self.lost_through = max(self.journals.committed, default=0)
        self.fig.detail(f"node: node {k}")

    def orphaned(self, k: int) -> set[int]:
        """Root k's versions that wait on the remote for a part a node's loss took: saved
        before the last loss, their upload waiting for the other node's part. Retention
        keeps them (never redundant: the remote cannot complete them), milestones for good;
        counted as leftovers, not as retention stuck."""
        status = read_status(self.layout.root(k))
        if status is None:
            return set()
        return {
            s
            for s, v in status.versions.items()
            if s <= self.lost_through and v.remote is not None and v.remote.state == WAITING
        }

    def kill_gc(self) -> str:
        """Start `ckpt gc` on a tier, let it be killed; returns the tier it ran on."""
        tiers = ["root0", "root1", "remote"]
        # A kill lands only in a run that deletes something: prefer the tiers where one would.
        target = self.rng.choice([t for t in tiers if self._would_delete(self._gc_command(t))] or tiers)
        mode = self.rng.choice(["fault", "fault", "random"])
        cmd = self._gc_command(target)
        fault = self.rng.choice(["gc-mid-delete", "gc-delete"])
        env = {"CKPT_FAULT": fault} if mode == "fault" else {}
        header = f"round {self.fig.rounds}: ckpt {' '.join(cmd)} ({mode} {fault if mode == 'fault' else ''})"
        t0 = time.monotonic()
        proc = self.spawn("cli", cmd, "gc.log", header, **env)
        if mode == "random":
            typical = sorted(self.gc_durations)[len(self.gc_durations) // 2] if self.gc_durations else 0.5
            try:
                proc.wait(timeout=self.rng.uniform(0.0, 1.0) * typical)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        rc = self.reap(proc, "ckpt gc hung")
        if rc == 0:
            self.gc_durations.append(time.monotonic() - t0)
        where = "remote" if target == "remote" else "local"
        what = f"fault {fault}" if mode == "fault" else "random time"
        if rc == -signal.SIGKILL:
            outcome = "killed"
        elif rc == 0:
            outcome = "nothing to delete, the fault point never ran" if mode == "fault" else "finished before its kill"
        else:
            outcome = f"exit {rc}"
        self.fig.detail(f"gc: {where}, {what}: {outcome}")
        if rc not in (0, -signal.SIGKILL):
            self.fail(f"round {self.fig.rounds}: ckpt gc {' '.join(cmd)} exited {rc} (see logs/gc.log)")
        return target

    def _gc_command(self, target: str) -> list[str]:
        lo = self.layout
        if target == "remote":
            keep = ["--keep-last", str(self.c.gc_remote_keep_last), "--milestone-every", str(self.c.milestone_every)]
            return ["gc", lo.remote_url, *keep]
        return ["gc", lo.root(int(target[-1])), "--keep-last", str(self.c.gc_keep_last)]

    def _would_delete(self, cmd: list[str]) -> bool:
        """Whether `ckpt gc` deletes anything if run now (its dry run says so)."""
        log = os.path.join(self.c.out, "logs", "gc-dry-run.log")
        start = os.path.getsize(log) if os.path.exists(log) else 0
        self.reap(self.spawn("cli", [*cmd, "--dry-run"], "gc-dry-run.log", " ".join(cmd)), "ckpt gc --dry-run hung")
        with open(log) as f:
            f.seek(start)
            said = f.read()
        return "would delete" in said and "would delete 0 " not in said

    # -- checks ------------------------------------------------------------------------------

    def observe(self, snap: Snapshot) -> None:
        with self._lock:
            for tier, steps in snap.items():
                self.known.setdefault(tier, set()).update(steps)

    def monitor(self) -> None:
        """Listings and remote completeness while everything runs."""
        while not self._stop_monitor.wait(0.5):
            try:
                with self._listing:  # observed inside: a node's loss must not come between
                    snap = snapshot(self.layout)
                    self.seen.append(snap)
                    self.observe(snap)
                listed, problems = remote_problems(self.layout.remote_dir)
            except Exception as e:  # noqa: BLE001 - a listing racing a deletion; the next one will do
                self.fig.note(f"monitor: a listing raced a deletion ({type(e).__name__})")
                continue
            with self._lock:
                self.fig.remote_scans += 1
            for p in problems:
                self.corrupt(f"remote (during the run): {p}", incomplete=True)

    def corrupt(self, msg: str, incomplete: bool = False) -> None:
        with self._lock:
            self.fig.corruptions += 1
            self.fig.incomplete_remote += incomplete
            self.fig.corruption_detail.append(msg)
        print("CORRUPTION:", msg, flush=True)

    def lose(self, msg: str) -> None:
        self.fig.lost += 1
        self.fig.lost_detail.append(msg)
        print("LOST:", msg, flush=True)

    def policy(self, tier: str, gc_tier: str | None) -> Retention:
        """The tightest retention that ran on `tier` since the last listing."""
        if tier == "remote":
            keep = self.c.gc_remote_keep_last if gc_tier == "remote" else self.c.remote_keep_last
            return Retention(keep, self.c.milestone_every)
        if tier == gc_tier:
            return Retention(self.c.gc_keep_last)
        if tier.startswith("peer") and "-" in tier:  # a replaced disk's copies go as their holder's steps do
            holder = f"root{1 - int(tier[4])}"
            return Retention(self.c.gc_keep_last if holder == gc_tier else self.c.keep_last)
        if tier.startswith("peer"):  # only the job's retention prunes peer copies: it keeps tagged steps
            return Retention(self.c.keep_last, keep_tagged=True)
        return Retention(self.c.keep_last)

    def check_deletions(self, gc_tier: str | None, *, quiet: bool = False) -> Snapshot:
        """Invariant 2, from the previous check's listing through the monitor's listings to a
        new one (returned). Every version any of them shows is judged when it first goes
        missing (not only those of the previous check: a version the monitor saw come and go
        counts too), against the versions listed up to that listing: a version that
        arrives later cannot excuse a deletion made before it existed.
        `quiet` (nothing runs): also, the remote holds the newest keep-last of the versions
        ever listed there and not seen deleted in an earlier check (a GC that deletes only
        what its policy allows never deletes those, whatever the monitor missed)."""
        with self._listing:
            now = snapshot(self.layout)
            seen, self.seen = self.seen, []
        for tier in self.last:  # a replaced disk's copies, every one deleted: the directory too
            now.setdefault(tier, {})
        self.journals.refresh()
        self.observe(now)
        for tier in now:
            cum = set(self.judged_known.get(tier, set()))
            if tier.startswith("root") or (tier.startswith("peer") and "-" in tier):
                # the job's own retention runs once a commit is done, before
                cum |= self.journals.committed | self.journals.newest_saved()  # its next save journals it
            if tier.startswith("replica"):  # copies are deleted when their source's versions are
                cum |= self.known.get("root" + tier[-1], set()) | self.journals.committed | self.journals.newest_saved()
            judged: set[int] = set()
            gone_before = set(self.gone.get(tier, set()))
            prev = self.last.get(tier, {})
            for snap in [*seen, now]:
                cur = snap.get(tier, {})
                cum |= set(cur)
                for step in prev:
                    if step in cur or step in judged:
                        continue
                    judged.add(step)
                    if step in now[tier]:
                        continue  # back again: a new save of the step (judged below)
                    self.gone.setdefault(tier, set()).add(step)
                    self.fig.deletions_seen += 1
                    if (step, prev[step]) in self.replaceable:  # a part of a save no tier holds whole
                        self.fig.note("a part of an incomplete save was deleted (its step saved anew)")
                        continue
                    if not self.policy(tier, gc_tier).may_delete(step, cum, self.journals.tagged):
                        newer = sorted(s for s in cum if s > step)
                        self.lose(f"{tier} step {step}: deleted, but retention keeps it (known newer: {newer[:8]})")
                prev = cur
            self.judged_known[tier] = cum
            if quiet and tier == "remote":
                keep = self.policy(tier, gc_tier).keep_last
                for step in sorted(cum - gone_before)[-keep:]:
                    if step not in now[tier] and step not in judged:
                        self.lose(f"{tier} step {step}: gone, but it is among the newest {keep} versions listed there")
            for step, save_id in self.last.get(tier, {}).items():
                if step in now[tier] and now[tier][step] != save_id:
                    if (step, save_id) in self.replaceable:
                        self.fig.note("a version a node's loss left incomplete was replaced by a new save of its step")
                        continue
                    self.lose(f"{tier} step {step}: replaced by another save ({save_id} -> {now[tier][step]})")
        self.last = now
        return now

    def check_restore(self, expected: int | None) -> None:
        """Invariant 1, for the incarnation that just got ready."""
        self.journals.refresh()
        for rank in range(WORLD):
            rec = self.journals.restored.get((self.inc, rank))
            if rec is None:
                self.fail(f"incarnation {self.inc} rank {rank}: no restore recorded")
                continue
            step = rec["step"]
            if expected is not None and (step is None or step < expected):
                self.lose(
                    f"incarnation {self.inc} rank {rank}: restored step {step}, but step {expected} was reachable"
                )
            if step is None:
                continue
            problem = compare(rec["sums"], self.journals.expected.get((step, rank), []))
            self.fig.restores_checked += 1
            if problem:
                self.corrupt(f"restore of step {step} (incarnation {self.inc}) rank {rank}: {problem}")

    def check_tiers(self, *, full_remote: bool = False) -> None:
        """Invariants 3, 4 and 5 on quiet tiers."""
        lo = self.layout
        t = time.monotonic()
        for name, loc in lo.tiers().items():
            if name == "remote":
                continue
            if os.path.isdir(loc) and self.last.get(name):
                ok, out = verify(loc)
                self.fig.versions_verified += len(self.last[name])
                if not ok:
                    self.corrupt(f"ckpt verify {name}: {out.strip()[-600:]}")
        t = self.fig.timed("check: verify local", t)
        for step, save_id in sorted(self.last.get("remote", {}).items()):
            if full_remote or (step, save_id) not in self.verified_remote:
                ok, out = verify(lo.remote_url, step)
                self.fig.versions_verified += 1
                self.verified_remote.add((step, save_id))
                if not ok:
                    self.corrupt(f"ckpt verify remote --step {step}: {out.strip()[-600:]}")
        _, problems = remote_problems(lo.remote_dir)
        self.fig.remote_scans += 1
        for p in problems:
            self.corrupt(f"remote: {p}", incomplete=True)
        t = self.fig.timed("check: verify remote", t)
        self.journals.refresh()
        for group, locations in groups(lo).items():
            for step, save_id in sorted(reachable(locations).items()):
                if (group, step, save_id) in self.checked:
                    continue
                self.checked.add((group, step, save_id))
                self.fig.versions_checked += 1
                try:
                    problem = deep_check(locations, step, self.journals)
                except Exception as e:  # noqa: BLE001 - an unreadable listed version is a corruption too
                    problem = f"cannot be read back: {type(e).__name__}: {e}"
                if problem:
                    self.corrupt(f"{group} step {step}: {problem}")
        self.fig.timed("check: bitwise", t)

    # -- the loop ----------------------------------------------------------------------------

    def kinds(self) -> list[str]:
        out: list[str] = []
        while len(out) < self.c.kills:
            block = list(KINDS)
            self.rng.shuffle(block)
            out += block
        return out[: self.c.kills]

    def run(self, *, watchdog_s: float | None = None) -> Figures:
        """The rounds, the final checks, the figures. `watchdog_s`: a round that takes longer
        counts as a hang (a SIGALRM interrupts it; not under pytest-timeout, which uses it)."""
        t0 = time.monotonic()
        os.makedirs(self.c.out, exist_ok=True)
        for d in ("logs", "run"):
            os.makedirs(os.path.join(self.c.out, d), exist_ok=True)
        self.layout.create()
        self.last = snapshot(self.layout)
        monitor = threading.Thread(target=self.monitor, name="harness-monitor", daemon=True)
        monitor.start()
        previous = signal.signal(signal.SIGALRM, _hang) if watchdog_s else None
        try:
            self.rounds(watchdog_s)
        except Hang:
            self.fail(f"round {self.fig.rounds}: hung (over {watchdog_s} s):\n{traceback.format_exc()}")
        finally:
            if watchdog_s:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)
            self._stop_monitor.set()
            monitor.join()
            self._kill_all(self.trainers)
            self._kill_all([p for p in self.daemons.values() if p is not None])
            self._store = None
        self.journals.refresh()
        self.fig.steps_committed = len(self.journals.committed)
        self.fig.nondeterministic_steps = len(self.journals.nondeterministic())
        self.fig.runtime_s = round(time.monotonic() - t0, 1)
        with open(os.path.join(self.c.out, "figures.json"), "w") as f:
            json.dump(asdict(self.fig), f, indent=2)
        return self.fig

    def rounds(self, watchdog_s: float | None) -> None:
        t0 = time.monotonic()
        for k in range(WORLD):
            self.start_daemon(k)
        self.start_trainers()
        expected: int | None = None
        for kind in self.kinds():
            if watchdog_s:
                signal.alarm(int(watchdog_s))
            self.fig.rounds += 1
            t = time.monotonic()
            if not self.wait_ready():
                break
            t = self.fig.timed("start and restore", t)
            self.check_restore(expected)
            time.sleep(self.rng.uniform(*self.c.run_s))
            t = self.fig.timed("run", t)
            self.check_deletions(None)  # the listing before the kill
            gc_tier = None
            lost: int | None = None
            if kind == "rank":
                self.kill_ranks([self.rng.randrange(WORLD)])
            elif kind == "all-ranks":
                self.kill_ranks(list(range(WORLD)))
            elif kind == "daemon":
                self.kill_daemons()
                self.stop_trainers()
            elif kind == "node":
                lost = self.kill_node()
            else:
                gc_tier = self.kill_gc()
                self.stop_trainers()
            self.fig.kills[kind] += 1
            t = self.fig.timed(f"kill and stop: {kind}", t)
            self.stop_daemons()  # the tiers hold still while they are checked
            self.check_deletions(gc_tier, quiet=True)
            if lost is not None:
                self.lose_node(lost)
            self.check_tiers()
            expected = self.take_stock()
            t = self.fig.timed("check", t)
            resumed = self.journals.restored.get((self.inc, 0), {}).get("step")
            print(
                f"round {self.fig.rounds}/{self.c.kills}: {kind:9s} after a resume from step {resumed}; "
                f"{len(self.journals.committed)} steps committed, {self.fig.versions_checked} versions checked, "
                f"lost {self.fig.lost}, corruptions {self.fig.corruptions}, {time.monotonic() - t0:.0f} s",
                flush=True,
            )
            for k in range(WORLD):
                self.start_daemon(k)
            self.start_trainers()
        else:
            if self.wait_ready():
                self.check_restore(expected)
                self.run_on(self.c.remote_keep_last + 2)
            self.stop_trainers()
        self.finish()

    def take_stock(self) -> int | None:
        """The step the next incarnation must restore at least; the saves the tiers hold only
        in part join those the job may replace."""
        expected, partial = expected_restore(self.layout)
        self.replaceable |= partial
        return expected

    def run_on(self, steps: int) -> None:
        """Let the last incarnation commit `steps` more steps: after a node's loss, the
        versions it left incomplete wait for that node's part on the remote until the
        remote holds enough newer ones to expire them (then retention takes them)."""
        self.journals.refresh()
        start = max(self.journals.committed, default=0)
        deadline = time.monotonic() + self.c.timeout_s
        while max(self.journals.committed, default=0) < start + steps and time.monotonic() < deadline:
            time.sleep(0.1)
            self.journals.refresh()

    def stop_daemons(self) -> None:
        """SIGTERM: each daemon finishes its pass (a copy in flight is abandoned) and exits 0.
        (Not SIGSTOP: a daemon frozen inside GC would hold the root's pin lock, and every
        reader, the checks included, would wait for it.)"""
        for k, p in self.daemons.items():
            if p is None:
                continue
            if p.poll() is not None:
                self.fail(f"round {self.fig.rounds}: daemon {k} exited by itself (code {p.returncode})")
                self.daemons[k] = None
                continue
            p.send_signal(signal.SIGTERM)
            rc = self.reap(p, f"daemon {k} did not stop on SIGTERM")
            if rc != 0:
                self.fail(f"round {self.fig.rounds}: daemon {k} exited {rc} on SIGTERM")
            self.daemons[k] = None

    def finish(self) -> None:
        """Let the daemons catch up: retention must bring every root down to its keep-last
        (every version reaches the remote, so all become redundant). Then SIGTERM them and
        check everything once more."""
        deadline = time.monotonic() + 60.0
        while True:
            held = {k: len({c.step for c in candidates(self.layout.root(k))} - self.orphaned(k)) for k in range(WORLD)}
            if all(n <= self.c.keep_last for n in held.values()):
                break
            if time.monotonic() > deadline:
                self.fail(f"retention stuck: the roots hold {held} versions 60 s after the job stopped "
                          f"(keep-last {self.c.keep_last}; see .replicator/status.json)")  # fmt: skip
                break
            time.sleep(0.5)
        self.stop_daemons()
        self.check_deletions(None, quiet=True)
        self.check_tiers(full_remote=True)
        self.fig.leftovers = leftovers(self.layout, self.last, self.c.keep_last)
        for k in range(WORLD):
            self.fig.leftovers[f"root{k}: versions waiting on the remote for a lost node's part"] = len(
                self.orphaned(k) & set(self.last.get(f"root{k}", {}))
            )
        for k in range(WORLD):
            with open(os.path.join(self.c.out, "logs", f"daemon{k}.log"), errors="replace") as f:
                errors = sum(1 for line in f if "replication pass failed" in line)
            self.fig.leftovers[f"daemon{k}: failed passes (logged, retried)"] = errors


def leftovers(layout: Layout, snap: Snapshot, keep_last: int) -> dict[str, int]:
    """Garbage retention left behind (not a loss): versions beyond the local policy, replica
    copies of versions their source no longer holds, remote directories without a manifest."""
    out = {}
    for k in range(WORLD):
        root, replica = snap.get(f"root{k}", {}), snap.get(f"replica{k}", {})
        out[f"root{k}: versions beyond keep-last"] = max(0, len(root) - keep_last)
        out[f"replica{k}: copies of versions gone from the source"] = len(set(replica) - set(root))
    try:
        names = os.listdir(layout.remote_dir)
    except FileNotFoundError:
        names = []
    out["remote: directories without a manifest"] = sum(
        1
        for n in names
        if n.startswith("v") and not os.path.exists(os.path.join(layout.remote_dir, n, "manifest.json"))
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True, help="work directory (must not exist or be empty)")
    args = ap.parse_args(argv)
    if os.path.isdir(args.out) and os.listdir(args.out):
        ap.error(f"{args.out} is not empty")
    config = HarnessConfig(out=args.out, kills=args.kills, seed=args.seed)
    fig = Harness(config).run(watchdog_s=4 * config.timeout_s)
    print(json.dumps(asdict(fig), indent=2))
    print(summary(fig))
    return 0 if not (fig.lost or fig.corruptions or fig.failures) else 1


def summary(fig: Figures) -> str:
    kills = ", ".join(f"{k} {v}" for k, v in fig.kills.items())
    return "\n".join(
        [
            f"kills injected     {sum(fig.kills.values())} ({kills})",
            f"versions checked   {fig.versions_checked} bitwise against the journal; {fig.restores_checked} restores",
            f"versions verified  {fig.versions_verified} (ckpt verify); {fig.remote_scans} remote completeness scans",
            f"deletions seen     {fig.deletions_seen}",
            f"versions lost      {fig.lost}",
            f"silent corruptions {fig.corruptions} ({fig.incomplete_remote} incomplete remote versions)",
            f"process failures   {len(fig.failures)}",
            f"runtime            {fig.runtime_s:.0f} s",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
