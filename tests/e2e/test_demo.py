"""The main job in a reduced form: kill a rank, resume on 3 ranks; lose a node, resume from
its peer copies with no remote; both match the reference bit for bit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt import demo

REPO = Path(__file__).resolve().parents[2]


def test_demo_resumes_bit_exactly_on_another_world_size(tmp_path: Path) -> None:
    out = subprocess.run(
        # (a run's ranks get 100 s, then the demo stops them and prints their stacks)
        [sys.executable, "-m", "ckpt.demo", "--dir", str(tmp_path), "--steps", "12", "--every", "3", "--kill-at", "8"]
        + ["--timeout", "100"],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # (what it printed, should it be stopped)
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-20000:]
    assert "the resumed runs are bit-exact" in out.stdout
    assert re.search(r"SIGKILL rank 1 at step \d+\n", out.stdout)  # (rank 1 only: rank 0 lives on)
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    resumed = json.loads((tmp_path / "resumed" / "rank2.json").read_text())
    assert resumed["world"] == 3 and resumed["resumed_from"] in (3, 6)  # a version before the kill
    ref = json.loads((tmp_path / "ref" / "rank0.json").read_text())["losses"]
    assert all(ref[k] == v for k, v in resumed["losses"].items())
    # the resumed run saved with deferred staging: each copy ended after its save() returned
    assert resumed["stats"] and all(s["staged_s"] > s["stage_s"] for s in resumed["stats"])
    # the replicator copied to the other disk and the remote
    assert any((tmp_path / "disk1" / "ckpt" / "replicas").iterdir())
    assert any(p.name.startswith("v") for p in (tmp_path / "remote").iterdir())
    # a node's loss: node 1's ranks killed, its disk replaced; restored from node 0's peer copies
    back = [json.loads((tmp_path / "node-back" / f"rank{r}.json").read_text()) for r in range(4)]
    # (node 1 dies once a peer copy is verified: a version of step 3, 6 or 9)
    assert len({b["resumed_from"] for b in back}) == 1 and back[0]["resumed_from"] in (3, 6, 9, 12)
    # (node 1's ranks both, unless no peer copy was verified before rank 2 ended: step 12)
    assert re.search(r"SIGKILL ranks 2, 3 at step", out.stdout) or back[0]["resumed_from"] == 12
    assert (
        all(ref[k] == v for k, v in back[0]["losses"].items())
        and len(back[0]["losses"]) == 12 - back[0]["resumed_from"]
    )
    # (node 1's copies, named by its disk's identity: after the loss, the new disk's)
    assert (
        tmp_path
        / "nodes"
        / "node0"
        / "replicas"
        / f"peer-{(tmp_path / 'nodes' / 'node1' / '.ckpt-root-id').read_text()}"
    ).is_dir()


# A rank of the launcher's test jobs: `init` joins the group in init_process_group (which
# waits for every rank), then sleeps; `done` exits 0; `fail` exits 3 once rank 0 is about
# to join (an `init` rank 0) or has ended.
RANK_SCRIPT = """
import faulthandler, os, signal, sys, time
faulthandler.register(signal.SIGUSR2, all_threads=True)
rank, out = int(os.environ["RANK"]), sys.argv[sys.argv.index("--out") + 1]
plan = os.environ["DEMO_TEST_PLAN"].split(",")
print("rank", rank, plan[rank], "pid", os.getpid(), "via", os.environ["MASTER_PORT"], flush=True)
if plan[rank] == "done":
    sys.exit(0)

def rank0_ended():  # (its process gone, or a zombie its launcher has not reaped yet)
    words = open(os.path.join(out, "rank0.log")).read().split()
    if len(words) < 5:
        return False
    try:
        return open(f"/proc/{words[4]}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True

if plan[rank] == "fail":
    # an `init` rank 0 about to join stays in init_process_group for good; one `done`, ended
    while not ("joining" in open(os.path.join(out, "rank0.log")).read() if plan[0] == "init" else rank0_ended()):
        time.sleep(0.05)
    sys.exit(3)
import torch.distributed as dist
print("joining", flush=True)
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
print("rank joined", flush=True)
while True:
    time.sleep(1)
"""


def _plan(monkeypatch: pytest.MonkeyPatch, plan: str) -> list[str]:
    monkeypatch.setenv("DEMO_TEST_PLAN", plan)
    return [sys.executable, "-c", RANK_SCRIPT]


@pytest.mark.timeout(120)
def test_a_rank_that_fails_at_its_start_stops_the_run_with_the_others_stacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 dies before it joins: rank 0 would wait in init_process_group for the whole
    # gloo timeout (30 min); the launcher stops it and says why, with its stack.
    t0 = time.monotonic()
    with pytest.raises(demo.LaunchError) as err:
        demo._launch(2, str(tmp_path / "out"), [], worker=_plan(monkeypatch, "init,fail"))
    assert time.monotonic() - t0 < demo.ON_FAILURE_S + 30
    msg = str(err.value)
    assert "rank 1 exited with 3" in msg and "rank 0 still running, stopped" in msg
    assert "init_process_group" in msg  # rank 0's stack, from its log
    assert "rank 1 fail" in msg  # rank 1's log


@pytest.mark.timeout(120)
def test_ranks_still_running_at_the_timeout_are_stopped_with_their_stacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(demo.LaunchError) as err:
        demo._launch(3, str(tmp_path / "out"), [], worker=_plan(monkeypatch, "init,init,init"), timeout=40)
    msg = str(err.value)
    # every rank joined the launcher's store (rank 0 a client of it too), then hung
    assert all(f"rank {r} still running, stopped" in msg for r in range(3))
    assert msg.count("rank joined") == 3 and msg.count("Current thread") == 3


@pytest.mark.timeout(120)
def test_the_ranks_meet_at_the_launchers_store_and_their_exit_codes_come_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = RANK_SCRIPT.replace("while True:\n    time.sleep(1)", "dist.destroy_process_group()")
    monkeypatch.setenv("DEMO_TEST_PLAN", "init,init")
    assert demo._launch(2, str(tmp_path / "out"), [], worker=[sys.executable, "-c", script]) == [0, 0]


def test_the_job_store_holds_its_port_on_every_address() -> None:
    """Why the launcher hosts the store: a port found free on 127.0.0.1 may be in use on
    another address, and a rank-0 store then fails to bind it (its peers would retry
    their connection for 30 min). The job store's port is held on every address."""
    import socket

    import torch.distributed as dist

    from ckpt._job_store import job_store

    with socket.socket() as elsewhere:
        elsewhere.bind(("127.0.0.2", 0))  # (all of 127/8 is this machine's loopback)
        port = elsewhere.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # what a "free port" check finds: free
        with pytest.raises(dist.DistNetworkError, match="EADDRINUSE|in use"):
            dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    store, env = job_store(2)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.2", int(env["MASTER_PORT"])))
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and store.port == int(env["MASTER_PORT"])


@pytest.mark.timeout(120)
def test_a_rank_that_fails_after_the_others_ended_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the poll that finds every rank ended is the first to see the failure)
    with pytest.raises(demo.LaunchError, match="rank 1 exited with 3"):
        demo._launch(2, str(tmp_path / "out"), [], worker=_plan(monkeypatch, "done,fail"))
