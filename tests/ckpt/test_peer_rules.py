"""The rules of peer copies that need no job: where copies go, and that every GC of a root
(the Checkpointer's retention, a replicator's, `ckpt gc`) keeps the newest version whose
peer copies are verified and every newer one (the jobs: tests/e2e/test_peer_copies.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpt import Checkpointer
from ckpt._peer_status import PEER_STATUS, record_peers_stopped, verified_peer_steps
from ckpt._peers import plan_peers
from ckpt._retention import Retention
from ckpt.cli import main as ckpt_cli
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.policy import KeepLast
from ckpt.replicator.service import Replicator
from ckpt.store.tier import open_tier
from ckpt.store.versions import committed_steps
from tests._dist import launch


def test_peer_plans_refuse_copies_on_the_same_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="same node"):
        plan_peers([(0,), (1,), (4,), (5,)], 0, 1, 1)  # roots 0 and 1 share node 0
    plan = plan_peers([(0,), (1,), (4,), (5,)], 0, 1, 2)  # a stride of 2 crosses nodes
    assert plan.targets == (2,) and plan.sources == (2,) and plan.leaders == (0, 1, 4, 5)
    plan = plan_peers([(0,), (4,), (8,)], 1, 2, 1)
    assert plan.targets == (2, 0) and plan.sources == (0, 2)
    with pytest.raises(ValueError, match="more roots"):
        plan_peers([(0, 1), (4, 5)], 0, 2, 1)


def _status(root: Path, verified: dict[int, str]) -> None:
    doc = {"steps": {str(s): {"1": v} for s, v in verified.items()}}
    (root / PEER_STATUS).write_text(json.dumps(doc))


def _retained(root: Path, verified: dict[int, str]) -> list[int]:
    _status(root, verified)
    tier = open_tier(str(root))
    retention = Retention(tier, str(root), KeepLast(1))
    retention.committed(3)
    retention.close()
    return committed_steps(tier)


def test_retention_keeps_the_newest_version_a_node_loss_leaves_whole(tmp_path: Path) -> None:
    """keep_last=1, steps 1-3: the newest version whose peer copies are verified and every
    newer one are kept (after a node's loss the newest such version is the one the
    survivors hold whole: their own parts, and the lost node's as peer copies)."""
    with Checkpointer(tmp_path) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})
    assert verified_peer_steps(str(tmp_path)) == set()
    assert _retained(tmp_path, {1: "verified", 2: "failed"}) == [1, 2, 3]
    assert _retained(tmp_path, {1: "verified", 2: "verified"}) == [2, 3]
    assert _retained(tmp_path, {1: "verified", 2: "verified", 3: "verified"}) == [3]


def test_retention_without_peer_copies_deletes_by_the_policy(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})
    tier = open_tier(str(tmp_path))
    retention = Retention(tier, str(tmp_path), KeepLast(1))
    retention.committed(3)
    retention.close()
    assert committed_steps(tier) == [3]


def _three_steps(root: Path) -> None:
    with Checkpointer(root) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})


def test_ckpt_gc_keeps_what_the_peer_copies_need(tmp_path: Path) -> None:
    """`ckpt gc --keep-last 1` on a root whose newest verified peer copy is step 1 keeps 1-3
    (before, only the Checkpointer's own retention knew the rule: gc deleted 1 and 2)."""
    _three_steps(tmp_path)
    _status(tmp_path, {1: "verified", 2: "failed"})
    out = CliRunner().invoke(ckpt_cli, ["gc", str(tmp_path), "--keep-last", "1"])
    assert out.exit_code == 0, out.output
    assert committed_steps(open_tier(str(tmp_path))) == [1, 2, 3]
    _status(tmp_path, {1: "verified", 2: "verified"})
    out = CliRunner().invoke(ckpt_cli, ["gc", str(tmp_path), "--keep-last", "1"])
    assert committed_steps(open_tier(str(tmp_path))) == [2, 3], out.output


def test_a_replicators_local_retention_keeps_what_the_peer_copies_need(tmp_path: Path) -> None:
    root, disk1 = tmp_path / "d0", tmp_path / "d1"
    for d in (root, disk1):
        d.mkdir()
        (d / ".ckpt-disk").write_text(d.name)
    _three_steps(root)
    _status(root, {1: "verified"})
    config = ReplicatorConfig(replicas=2, replica_roots=(str(disk1),), local_policy=KeepLast(1))
    Replicator([str(root)], config).run_once()
    assert committed_steps(open_tier(str(root))) == [1, 2, 3]
    _status(root, {1: "verified", 3: "verified"})
    Replicator([str(root)], config).run_once()
    assert committed_steps(open_tier(str(root))) == [3]


def test_a_stopped_copier_keeps_its_newest_verified_step_and_a_job_without_peers_lifts_the_rule(
    tmp_path: Path,
) -> None:
    """A copier stops for good when a peer stops answering: most often the node loss the
    rule is for. Before, the stop lifted the rule: `ckpt gc --keep-last 1` (or any GC)
    deleted step 1, the version whole on the survivors, and a restore after the node's
    loss found none whole. Newer steps, which will never have verified copies, may go."""
    _three_steps(tmp_path)
    _status(tmp_path, {1: "verified"})
    record_peers_stopped(str(tmp_path), "RuntimeError: a peer stopped answering")
    out = CliRunner().invoke(ckpt_cli, ["gc", str(tmp_path), "--keep-last", "1"])
    assert out.exit_code == 0, out.output
    assert committed_steps(open_tier(str(tmp_path))) == [1, 3]
    assert _retained_as_is(tmp_path) == [1, 3]  # the Checkpointer's retention alike
    state = {"w": torch.zeros(4)}
    with Checkpointer(tmp_path) as ck:  # no peer_copies: the old status holds nothing back
        ck.save(4, state)
    _status(tmp_path, {4: "failed"})
    with Checkpointer(tmp_path, keep_last=1) as ck:
        ck.save(5, state)
    assert committed_steps(open_tier(str(tmp_path))) == [5]
    assert not (tmp_path / PEER_STATUS).exists()


def _retained_as_is(root: Path) -> list[int]:
    tier = open_tier(str(root))
    retention = Retention(tier, str(root), KeepLast(1))
    retention.committed(3)
    retention.close()
    return committed_steps(tier)


def test_a_step_whose_copies_failed_on_another_root_does_not_count(tmp_path: Path) -> None:
    """This root's copies of step 2 were verified, another root's were not (the leaders
    agreed so): after that root's node is lost, step 2 lacks its part, so step 1 is kept."""
    with Checkpointer(tmp_path) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})
    doc = {"steps": {"1": {"1": "verified"}, "2": {"1": "verified"}}, "partial": [2]}
    (tmp_path / PEER_STATUS).write_text(json.dumps(doc))
    assert verified_peer_steps(str(tmp_path)) == {1}
    tier = open_tier(str(tmp_path))
    retention = Retention(tier, str(tmp_path), KeepLast(1))
    retention.committed(3)
    retention.close()
    assert committed_steps(tier) == [1, 2, 3]


def open_with_uneven_nodes(ctx: Any, base: str) -> dict[str, Any]:
    """Node 0 runs rank 0 alone, node 1 ranks 1 and 2: LOCAL_WORLD_SIZE as torchrun sets it
    on each node. Ranks 1 and 2 judge the plan impossible (their roots would share a node);
    rank 0, by its own LOCAL_WORLD_SIZE, does not."""
    import datetime
    import os

    os.environ.update(LOCAL_WORLD_SIZE="1" if ctx.rank == 0 else "2", LOCAL_RANK=str(max(0, ctx.rank - 1)))
    try:
        ck = Checkpointer(lambda r: f"{base}/n{min(r, 1)}", peer_copies=1, timeout=datetime.timedelta(seconds=90))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return {"raised": type(e).__name__, "message": str(e)}
    ck.close()
    return {"raised": None}


def test_a_peer_plan_refused_on_some_ranks_is_an_error_on_every_rank(tmp_path: Path) -> None:
    """Before, the ranks that refused raised ValueError while rank 0 went on into the peer
    group's creation and waited there for the job's timeout (90 s here, 30 min by default),
    then raised a RuntimeError of gloo's."""
    results, failures = launch(__file__, "open_with_uneven_nodes", 3, tmp_path / "job", base=str(tmp_path))
    assert not failures, failures
    assert [r["raised"] for r in results] == ["RankFailures", "ValueError", "ValueError"], results
    assert "same node" in results[1]["message"] and "rank 1" in results[0]["message"], results


def open_on_one_host_without_local_world_size(ctx: Any, base: str) -> dict[str, Any]:
    """Two ranks of one host, a disk each, launched without LOCAL_WORLD_SIZE (srun, mpirun)."""
    import datetime
    import os

    os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        ck = Checkpointer(lambda r: f"{base}/disk{r}", peer_copies=1, timeout=datetime.timedelta(seconds=60))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return {"raised": type(e).__name__, "message": str(e)}
    ck.close()
    return {"raised": None}


def test_peer_copies_refuse_two_roots_of_one_host_without_local_world_size(tmp_path: Path) -> None:
    """Without LOCAL_WORLD_SIZE every rank was taken for a node of its own: each disk got
    the other's copy, recorded verified, and a loss of the host (the node) lost both, while
    the job believed it survived one. The host name tells the ranks' nodes apart now."""
    results, failures = launch(
        __file__, "open_on_one_host_without_local_world_size", 2, tmp_path / "job", base=str(tmp_path)
    )
    assert not failures, failures
    assert [r["raised"] for r in results] == ["ValueError", "ValueError"], results
    assert "on the same node" in results[0]["message"], results


def open_that_fails_after_the_peers(ctx: Any, base: str) -> dict[str, Any]:
    """Two ranks, a node each, peer copies on. The open is interrupted (a real SIGINT, Ctrl-C)
    after the peer-copy thread has started, on every rank: that thread must stop with the
    open, and the next open of the same roots must work."""
    import datetime
    import os
    import threading

    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
    timeout = datetime.timedelta(seconds=60)
    os.environ["CKPT_INTERRUPT"] = f"open-saver:{ctx.rank}:1"
    try:
        Checkpointer(lambda r: f"{base}/n{r}", peer_copies=1, timeout=timeout)
    except KeyboardInterrupt:
        pass
    else:
        ctx.check(False, "the open was interrupted")
    del os.environ["CKPT_INTERRUPT"]
    copiers = [t.name for t in threading.enumerate() if t.name == "ckpt-peers"]
    ctx.check(not copiers, f"the peer-copy thread outlived the failed open: {copiers}")
    with Checkpointer(lambda r: f"{base}/n{r}", peer_copies=1, timeout=timeout) as ck:
        ck.save(1, {"w": torch.full((8,), float(ctx.rank))})
    return {}


def test_an_open_that_fails_after_the_peer_copier_started_stops_it(tmp_path: Path) -> None:
    results, failures = launch(__file__, "open_that_fails_after_the_peers", 2, tmp_path / "job", base=str(tmp_path))
    assert not failures, failures


def milestones_passed_over(ctx: Any, base: str) -> dict[str, Any]:
    """Two ranks, a node each. Step 1's copies go slowly (a bandwidth cap), and meanwhile
    steps 2 (saved as a milestone), 3 and 6 (multiples of keep_every), 4, 5, 7 (saved as a
    milestone, then again as none: overwrite=True) and 9 commit: the next round copies step
    9, the newest, then the milestones it passed over, newest first; never 4, 5 or 7."""
    import datetime
    import os

    from ckpt._peer_status import peer_dirs
    from ckpt.store.versions import committed_steps

    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
    big = torch.full((1 << 20,), float(ctx.rank))  # 4 MiB a root: 4 s a copy at 1 MB/s
    small = torch.full((256,), float(ctx.rank))  # the later ones: quick copies
    with Checkpointer(
        lambda r: f"{base}/n{r}",
        peer_copies=1,
        peer_bwlimit_mbps=1.0,
        keep_last=10,
        keep_every=3,
        timeout=datetime.timedelta(seconds=90),
    ) as ck:
        for step in (1, 2, 3, 4, 5, 6, 7, 8, 9):  # 7: a milestone saved again as none
            overwrite = step == 8
            ck.save(
                7 if overwrite else step,
                {"w": (big if step == 1 else small) + step},
                milestone=step in (2, 7),
                overwrite=overwrite,
            )
            ck.wait()
    (held,) = peer_dirs(f"{base}/n{ctx.rank}").values()
    return {"copied": committed_steps(held)}


def test_a_milestone_a_newer_round_passed_over_is_copied_after_it(tmp_path: Path) -> None:
    """Before, the copier copied only the newest step of those waiting: a milestone saved
    while another step's copies were on their way had no peer copy, so a node's loss took
    its part of the version that retention keeps for good."""
    results, failures = launch(__file__, "milestones_passed_over", 2, tmp_path / "job", base=str(tmp_path))
    assert not failures, failures
    assert [r["copied"] for r in results] == [[1, 2, 3, 6, 9]] * 2, results


def milestone_unreadable_on_one_root(ctx: Any, base: str) -> dict[str, Any]:
    """As milestones_passed_over, but rank 1's root holds step 2 (the milestone) with a
    damaged manifest, and the job then waits longer than its group timeout before it
    closes. Every leader owes step 2 all the same (the save's tag, not a file one of them
    reads): its round runs at once, and the copier never waits for a round alone."""
    import datetime
    import json
    import os
    import time

    from ckpt._peer_status import PEER_STATUS, peer_dirs
    from ckpt.store.versions import committed_steps

    os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
    big = torch.full((1 << 20,), float(ctx.rank))
    mine = f"{base}/n{ctx.rank}"
    with Checkpointer(
        lambda r: f"{base}/n{r}", peer_copies=1, peer_bwlimit_mbps=2.0, timeout=datetime.timedelta(seconds=5)
    ) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": big + step}, milestone=step == 2)
            ck.wait()
        if ctx.rank == 1:  # while step 1's copies are on their way
            path = f"{mine}/v000000000002/manifest.json"
            with open(path, "rb") as f:
                raw = f.read()
            with open(path, "wb") as f:  # cut short: it no longer parses
                f.write(raw[: len(raw) // 2])
        time.sleep(14)  # longer than the group's timeout after the rounds of steps 1 and 3
    with open(f"{mine}/{PEER_STATUS}") as f:
        record = json.load(f)
    (held,) = peer_dirs(mine).values()
    return {"stopped": record.get("stopped"), "copied": committed_steps(held)}


def test_leaders_agree_on_a_milestone_one_of_them_cannot_read(tmp_path: Path) -> None:
    """Before, a leader that could not read the milestone's manifest did not owe it, and
    slept, while the other waited for it in the round's collective until the group's
    timeout: the copier stopped for good, and the peer rule with it."""
    results, failures = launch(__file__, "milestone_unreadable_on_one_root", 2, tmp_path / "job", base=str(tmp_path))
    assert not failures, failures
    assert [r["stopped"] for r in results] == [None, None], results
    assert results[0]["copied"] == [1, 3] and results[1]["copied"] == [1, 2, 3], results  # rank 1's step 2: refused
