"""Peer copies (Checkpointer(peer_copies=K)): a node that comes back with empty disks
restores from the copies the other nodes hold, over the process group, without a remote.

Real gloo jobs of 4 ranks on 2 simulated nodes, each rank in a private mount namespace
that sees only its own node's disk (tests._dist.Nodes): nothing can pass through a
shared filesystem. Without peer copies the same loss ends in IncompleteVersionError
(tests/e2e/test_lost_node.py).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpt._peer_status import PEER_STATUS, peer_dirs
from ckpt.cli import main as cli
from ckpt.store.root import ROOT_ID_NAME
from tests._dist import Nodes, can_isolate, launch

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=60)
pytestmark = pytest.mark.skipif(not can_isolate(), reason="needs root and mount namespaces (unshare -m)")


def _full(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved arrays whole: rows of a (64, 6) tensor, and random bits (4 ranks' 1000 each)."""
    w = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6) * (step + 1)
    own = torch.cat([torch.randn(1000, generator=torch.Generator().manual_seed(1000 * step + r)) for r in range(4)])
    return w, own


BIG_ROWS = 4 * 1100  # x 1000 float32: 4.4 MB a rank at world 4, five ~1 MiB blocks, the last short


SMALL = 40  # `small` tensors of 8 float32 a rank: chunk files of 32 bytes


def _state(rank: int, step: int, world: int = 4, big: bool = False, small: bool = False) -> dict[str, Any]:
    """`big` adds an array whose chunks span several checksummed blocks; `small` adds SMALL
    sharded tensors of tiny chunks and a tensor every rank holds whole (saved once)."""
    import ckpt

    w, own = _full(step)
    rows, n = 64 // world, 4000 // world
    extra: dict[str, Any] = {}
    if small:
        k = 32 // world
        for i in range(SMALL):
            whole = torch.arange(32, dtype=torch.float32) * (i + 1) + step
            extra[f"s{i}"] = ckpt.Shard(whole[k * rank : k * (rank + 1)].clone(), (32,), (k * rank,))
        extra["shared"] = torch.arange(3000, dtype=torch.float64) + step
    if big:
        k = BIG_ROWS // world
        part = torch.arange(k * 1000, dtype=torch.float32).reshape(k, 1000) + (1e6 * rank + step)
        extra["big"] = ckpt.Shard(part, (BIG_ROWS, 1000), (k * rank, 0))
    return {
        **extra,
        "w": ckpt.Shard(w[rows * rank : rows * (rank + 1)].clone(), (64, 6), (rows * rank, 0)),
        "own": ckpt.Shard(own[n * rank : n * (rank + 1)].clone(), (4000,), (n * rank,)),
        "step": step,
        # one element, the same on every rank: stored inline in the manifest (as an optimizer's
        # step count is), which a rank whose node was replaced holds no tier of
        "scale": torch.tensor(0.5 * step),
    }


def _two_steps_copied(ctx: Any, ck: Any, mine: str) -> None:
    """Save steps 1 and 2; a leader waits (up to a minute) until step 2's copies are verified."""
    import time

    from ckpt._peer_status import verified_peer_steps

    ck.save(1, _state(ctx.rank, 1))
    ck.save(2, _state(ctx.rank, 2))
    ck.wait()
    deadline = time.monotonic() + 60
    while ctx.rank % 2 == 0 and 2 not in verified_peer_steps(mine) and time.monotonic() < deadline:
        time.sleep(0.05)


def _view(ctx: Any, view: str) -> str:
    node = ctx.rank // 2
    ctx.check(os.path.isdir(f"{view}/node{node}"), "its own node's disk is there")
    ctx.check(not os.path.exists(f"{view}/node{1 - node}"), "the other node's disk is not visible")
    return f"{view}/node{{node}}"


def save_job(
    ctx: Any, view: str, steps: list[int], keep_last: int | None, big: bool = False, small: bool = False
) -> dict[str, Any]:
    import ckpt

    root = _view(ctx, view)
    with ckpt.Checkpointer(root, peer_copies=1, keep_last=keep_last, timeout=TIMEOUT) as ck:
        for step in steps:
            ck.save(step, _state(ctx.rank, step, big=big, small=small))
        ck.wait()
    return {}


def save_a_rank_a_node(ctx: Any, view: str, steps: list[int]) -> dict[str, Any]:
    """One rank a node, `keep_last=1`; the state restored at the end, compared bitwise."""
    import ckpt

    ctx.check(os.listdir(view) == [f"node{ctx.rank}"], "only its own node's disk is visible")
    root = f"{view}/node{{node}}"
    with ckpt.Checkpointer(root, peer_copies=1, keep_last=1, timeout=TIMEOUT) as ck:
        for step in steps:
            ck.save(step, _state(ctx.rank, step, world=ctx.world))
        ck.wait()
    return {}


def stream_breaks(ctx: Any, view: str) -> dict[str, Any]:
    """Root 0's copier announces step 1's files, then one of them shrinks before it is read
    (CKPT_DELAY holds the copier there): its copy must fail on root 1, the round end on
    every leader, and step 2 be copied both ways."""
    import glob
    import time

    import ckpt
    from ckpt._peer_status import read_peer_status

    root = _view(ctx, view)
    mine = root.format(node=ctx.rank // 2)
    ck = ckpt.Checkpointer(root, peer_copies=1, timeout=TIMEOUT)
    ck.save(1, _state(ctx.rank, 1))
    ck.wait()
    if ctx.rank == 0:  # inside the copier's delay, after its header went out
        time.sleep(1.0)
        chunks = [p for p in glob.glob(f"{mine}/v000000000001/state/**/c*", recursive=True) if os.path.isfile(p)]
        biggest = max(chunks, key=os.path.getsize)
        os.truncate(biggest, os.path.getsize(biggest) // 2)
    ck.save(2, _state(ctx.rank, 2))
    ck.wait()
    ck.close()  # lets the copies of committed versions finish
    status = read_peer_status(mine) if ctx.rank % 2 == 0 else {}
    return {"status": {str(s): v for s, v in status.items()}}


def overwrite_copied(ctx: Any, view: str) -> dict[str, Any]:
    """Save steps 1 and 2, let step 2's peer copies be verified, overwrite step 2 with other
    values; then restore in a new Checkpointer."""

    import ckpt
    from ckpt._peer_status import verified_peer_steps

    root = _view(ctx, view)
    mine = root.format(node=ctx.rank // 2)
    with ckpt.Checkpointer(root, peer_copies=1, timeout=TIMEOUT) as ck:
        _two_steps_copied(ctx, ck, mine)
        ck.save(2, _state(ctx.rank, 20), overwrite=True)
    fresh = _state(ctx.rank, 0, ctx.world)
    with ckpt.Checkpointer(root, peer_copies=1, timeout=TIMEOUT) as ck:
        got = ck.restore(fresh)
    want = _state(ctx.rank, 20)
    same = all(torch.equal(fresh[k].local_tensor, want[k].local_tensor) for k in ("w", "own"))
    return {"restored": got, "bitwise": bool(same), "verified": sorted(verified_peer_steps(mine))}


def save_then_lose_node(ctx: Any, view: str, steps: list[int]) -> dict[str, Any]:
    """Save, let the peer copies finish, then node 1's ranks die of SIGKILL (no close())."""
    import signal
    import time

    import torch.distributed as dist

    import ckpt
    from ckpt._peer_status import verified_peer_steps

    root = _view(ctx, view)
    ck = ckpt.Checkpointer(root, peer_copies=1, timeout=TIMEOUT)
    for step in steps:
        ck.save(step, _state(ctx.rank, step))
    ck.wait()
    if ctx.rank % 2 == 0:  # each root's leader: until its last version's peer copy is verified
        mine, deadline = root.format(node=ctx.rank // 2), time.monotonic() + 60
        while steps[-1] not in verified_peer_steps(mine) and time.monotonic() < deadline:
            time.sleep(0.05)
        ctx.check(steps[-1] in verified_peer_steps(mine), "the last peer copy was verified")
    dist.barrier()
    if ctx.rank // 2 == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return {}


def interrupted_copy(ctx: Any, view: str) -> dict[str, Any]:
    """Node 1's ranks die of SIGKILL while step 1's peer copies are on their way: 16 MiB a
    node, two 8 MiB pieces at 8 MB/s; node 1 dies once the first piece has arrived."""
    import time

    import ckpt

    root = _view(ctx, view)
    ck = ckpt.Checkpointer(root, peer_copies=1, peer_bwlimit_mbps=8.0, timeout=TIMEOUT)
    big = torch.full((1 << 21,), float(ctx.rank))  # 8 MiB a rank: 16 MiB a node, more than one piece
    ck.save(1, {**_state(ctx.rank, 1), "big": ckpt.Shard(big, (1 << 23,), ((1 << 21) * ctx.rank,))})
    ck.wait()
    node = ctx.rank // 2
    mine = root.format(node=node)
    deadline = time.monotonic() + 60
    if node == 1:  # once root 0's copy has begun to arrive here, this node dies
        while time.monotonic() < deadline:
            if sum(p.stat().st_size for p in Path(mine).glob("replicas/peer-*/.incoming/**/*") if p.is_file()) > 0:
                os.kill(os.getpid(), 9)
            time.sleep(0.01)
        ctx.check(False, "root 0's copy never began to arrive")
        return {}
    # The round fails on node 0: at once when the closed connection is seen, at the latest
    # after the group's timeout (a peer that stops answering), so wait longer than that.
    deadline = time.monotonic() + TIMEOUT.total_seconds() + 30
    while not read_peer_stopped(mine) and time.monotonic() < deadline:
        time.sleep(0.05)
    ctx.check(bool(read_peer_stopped(mine)), "node 0's copier stopped when node 1 died")
    return {}


def read_peer_stopped(root: str) -> str | None:
    """Why the root's copier stopped for good (recorded in its peer status), or None."""
    try:
        doc = json.loads((Path(root) / PEER_STATUS).read_text())
    except (OSError, ValueError):
        return None
    return doc.get("stopped") if isinstance(doc, dict) else None


def save_again(ctx: Any, view: str) -> dict[str, Any]:
    import ckpt

    root = _view(ctx, view)
    with ckpt.Checkpointer(root, peer_copies=1, timeout=TIMEOUT) as ck:
        ck.save(2, _state(ctx.rank, 2))
    return {}


def restore_job(ctx: Any, view: str, big: bool = False, small: bool = False) -> dict[str, Any]:
    import ckpt

    root = _view(ctx, view)
    state = _state(ctx.rank, 0, ctx.world, big=big, small=small)
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        try:
            got = ck.restore(state)
        except (ckpt.IncompleteVersionError, ckpt.CorruptVersionError) as e:
            return {"error": f"{type(e).__name__}: {e}"}
        messages = ck._ctl.messages + (ck._data.messages if ck._data is not ck._ctl else 0)
    want = _state(ctx.rank, got if got is not None else 0, ctx.world, big=big, small=small)
    shards = [k for k, v in want.items() if isinstance(v, ckpt.Shard)]
    same = all(torch.equal(state[k].local_tensor, want[k].local_tensor) for k in shards)
    same = same and torch.equal(state["scale"], want["scale"])
    if small:
        same = same and torch.equal(state["shared"], want["shared"])
    return {"step": got, "bitwise": bool(same) and state["step"] == got, "messages": messages}


def resume_and_save_again(ctx: Any, view: str) -> dict[str, Any]:
    """Restore past an incomplete newest version, save its step anew, restore that."""
    import ckpt

    root = _view(ctx, view)
    state = _state(ctx.rank, 0, ctx.world)
    with ckpt.Checkpointer(root, peer_copies=1, timeout=TIMEOUT) as ck:
        resumed = ck.restore(state)
        ck.save(6, _state(ctx.rank, 60))  # step 6 again, with other values
        ck.wait()
        try:  # once replaced, step 6 is a committed version like any other
            ck.save(6, _state(ctx.rank, 61))
            ck.wait()
            refused = False
        except ckpt.VersionExistsError:
            refused = True
    fresh = _state(ctx.rank, 0, ctx.world)
    with ckpt.Checkpointer(root, peer_copies=1, timeout=TIMEOUT) as ck:
        again = ck.restore(fresh)
    want = _state(ctx.rank, 60)
    same = all(torch.equal(fresh[k].local_tensor, want[k].local_tensor) for k in ("w", "own"))
    bitwise = bool(same) and torch.equal(fresh["scale"], want["scale"])
    return {"resumed": resumed, "again": again, "bitwise": bitwise, "refused": refused}


def one_way_copy_refused(ctx: Any, view: str) -> dict[str, Any]:
    """keep_last=1. Step 1 is copied both ways. Of step 2, root 0's copy reaches root 1,
    while root 1's copy is refused on node 0 (where it lands is made immutable, chattr +i,
    once step 1's copies are in); then the job ends, before a further save is copied."""
    import subprocess
    import time

    import torch.distributed as dist

    import ckpt
    from ckpt._peer_status import read_peer_status

    root = _view(ctx, view)
    mine = root.format(node=ctx.rank // 2)
    landing = ""  # root 1's copies, on node 0
    try:
        with ckpt.Checkpointer(root, peer_copies=1, keep_last=1, timeout=TIMEOUT) as ck:
            for step in (1, 2):
                ck.save(step, _state(ctx.rank, step))
                ck.wait()
                deadline = time.monotonic() + 60  # each step's round over before the next save
                while ctx.rank % 2 == 0 and step not in read_peer_status(mine) and time.monotonic() < deadline:
                    time.sleep(0.05)
                dist.barrier()
                if step == 1 and ctx.rank == 0:
                    (landing,) = peer_dirs(mine).values()
                    subprocess.run(["chattr", "+i", landing], check=True)
                dist.barrier()
    finally:
        if ctx.rank == 0 and landing:
            subprocess.run(["chattr", "-i", landing], check=False)
    status = read_peer_status(mine) if ctx.rank % 2 == 0 else {}
    return {"status": {str(s): v for s, v in status.items()}}


def overwrite_then_crash(ctx: Any, view: str) -> dict[str, Any]:
    """Steps 1 and 2 saved and copied; step 2 overwritten with other values, and every rank
    dies of SIGKILL once the overwrite commits, before it is copied (CKPT_DELAY holds root
    0's copier after its header)."""
    import signal

    import torch.distributed as dist

    import ckpt
    from ckpt._peer_status import verified_peer_steps

    root = _view(ctx, view)
    mine = root.format(node=ctx.rank // 2)
    ck = ckpt.Checkpointer(root, peer_copies=1, timeout=TIMEOUT)
    _two_steps_copied(ctx, ck, mine)
    ctx.check(ctx.rank % 2 or 2 in verified_peer_steps(mine), "step 2's copies were verified")
    dist.barrier()
    ck.save(2, _state(ctx.rank, 20), overwrite=True)
    ck.wait()
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


def restore_values_of(ctx: Any, view: str, values: int) -> dict[str, Any]:
    """Restore; whether the state is bitwise the one saved with `values`."""
    import ckpt

    root = _view(ctx, view)
    state = _state(ctx.rank, 0, ctx.world)
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        got = ck.restore(state)
    want = _state(ctx.rank, values, ctx.world)
    same = all(torch.equal(state[k].local_tensor, want[k].local_tensor) for k in ("w", "own"))
    return {"step": got, "bitwise": bool(same)}


def _versions(path: Path) -> list[str]:
    return sorted(e for e in os.listdir(path) if e.startswith("v") and "." not in e) if path.is_dir() else []


def _root_id(disk: Path) -> str:
    return (disk / ROOT_ID_NAME).read_text().strip()


def _held(disk: Path) -> Path:
    """The one directory of peer copies on a node's disk (of the other node's root)."""
    dirs = list(peer_dirs(str(disk)).values())
    assert len(dirs) == 1, dirs
    return Path(dirs[0])


def test_a_node_with_empty_disks_restores_from_its_peer(tmp_path: Path) -> None:
    nodes = Nodes(tmp_path / "disks", tmp_path / "view", per_node=2)
    for k in (0, 1):
        (nodes.disks / f"node{k}").mkdir(parents=True)
    nodes.view.mkdir()
    _, failures = launch(
        THIS, "save_job", 4, tmp_path / "job", isolate=nodes, view=str(nodes.view), steps=[2, 4], keep_last=None
    )
    assert not failures, failures
    for k in (0, 1):  # each node holds the other's part of both versions, verified
        held = _held(nodes.disks / f"node{k}")
        assert held.name == f"peer-{_root_id(nodes.disks / f'node{1 - k}')}"
        assert _versions(held) == ["v000000000002", "v000000000004"], os.listdir(held)
        status = json.loads((nodes.disks / f"node{k}" / PEER_STATUS).read_text())
        assert status["steps"] == {"2": {str(1 - k): "verified"}, "4": {str(1 - k): "verified"}}
    listed = CliRunner().invoke(cli, ["ls", str(nodes.disks / "node0")])
    assert listed.exit_code == 0, listed.output
    source = _root_id(nodes.disks / "node1")
    assert f"peer copies held here for the root with id {source} (its .ckpt-root-id): steps 2, 4" in " ".join(
        listed.output.split()
    ), listed.output
    rows = [line.split() for line in listed.output.splitlines() if line.strip().startswith(("2 ", "4 "))]
    assert len(rows) == 2 and all(r[-2] == "1/1" for r in rows), listed.output  # copies: 1 verified of 1
    shutil.rmtree(nodes.disks / "node1")  # node 1 is replaced: an empty disk
    (nodes.disks / "node1").mkdir()
    # The CLI on node 0's root reads the peer copies its disk holds, as a restore does
    # (before: "step 4 lacks the part of ranks [2, 3]" unless they were named with --tier).
    out = tmp_path / "whole.pt"
    exported = CliRunner().invoke(cli, ["restore", str(nodes.disks / "node0"), "--to-torch", str(out)])
    assert exported.exit_code == 0 and "restored step 4" in exported.output, exported.output
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["w"], _full(4)[0]) and torch.equal(got["own"], _full(4)[1]), got
    results, failures = launch(THIS, "restore_job", 4, tmp_path / "job2", isolate=nodes, view=str(nodes.view))
    assert not failures, failures
    assert [(r["step"], r["bitwise"]) for r in results] == [(4, True)] * 4, results


def test_a_peer_copy_left_between_its_rename_and_its_publish_is_removed_by_the_next_copy(tmp_path: Path) -> None:
    """A copier that dies between the rename out of .incoming and the publish leaves
    v<step>.tmp-<save id>: nothing removed it unless the same save of that step was copied
    again, so it held a rank's part for good (memory, on /dev/shm)."""
    nodes = _nodes(tmp_path)
    _, failures = launch(
        THIS, "save_job", 4, tmp_path / "job", isolate=nodes, view=str(nodes.view), steps=[2], keep_last=None
    )
    assert not failures, failures
    held = _held(nodes.disks / "node0")
    left = [held / f"v000000000001.tmp-{'a' * 32}", held / f"v000000000002.tmp-{'b' * 32}"]
    for d in left:  # an older step's, and another save of a step held
        shutil.copytree(held / "v000000000002", d)
    _, failures = launch(
        THIS, "save_job", 4, tmp_path / "job2", isolate=nodes, view=str(nodes.view), steps=[4], keep_last=None
    )
    assert not failures, failures
    assert not any(d.exists() for d in left), os.listdir(held)
    assert _versions(held) == ["v000000000002", "v000000000004"], os.listdir(held)


def _nodes(tmp_path: Path) -> Nodes:
    nodes = Nodes(tmp_path / "disks", tmp_path / "view", per_node=2)
    for k in (0, 1):
        (nodes.disks / f"node{k}").mkdir(parents=True)
    nodes.view.mkdir()
    return nodes


def _saved_2_and_4(tmp_path: Path, keep_last: int | None, big: bool = True, small: bool = False) -> Nodes:
    """Steps 2 and 4 of the state (by default the big one) saved by 4 ranks on 2 nodes, with
    peer copies."""
    nodes = _nodes(tmp_path)
    _, failures = launch(
        THIS,
        "save_job",
        4,
        tmp_path / "job",
        isolate=nodes,
        view=str(nodes.view),
        steps=[2, 4],
        keep_last=keep_last,
        big=big,
        small=small,
    )
    assert not failures, failures
    return nodes


def _wipe(path: Path) -> None:
    shutil.rmtree(path)
    path.mkdir()


def _saved_then_node_1_killed(tmp_path: Path) -> Nodes:
    """4 ranks on 2 nodes save steps 3 and 6 with peer copies; node 1's ranks then die of SIGKILL."""
    nodes = _nodes(tmp_path)
    _, failures = launch(
        THIS,
        "save_then_lose_node",
        4,
        tmp_path / "job",
        isolate=nodes,
        killed=frozenset({2, 3}),
        view=str(nodes.view),
        steps=[3, 6],
    )
    assert not failures, failures
    return nodes


def test_a_killed_node_restores_on_four_ranks_and_on_two(tmp_path: Path) -> None:
    """Node 1's ranks die of SIGKILL and its disk is replaced by an empty one; 4 ranks, and
    then 2 ranks on node 0 alone, restore the newest step bitwise, with no remote."""
    nodes = _saved_then_node_1_killed(tmp_path)
    _wipe(nodes.disks / "node1")
    results, failures = launch(THIS, "restore_job", 4, tmp_path / "job2", isolate=nodes, view=str(nodes.view))
    assert not failures, failures
    assert [(r.get("step"), r.get("bitwise")) for r in results] == [(6, True)] * 4, results
    results, failures = launch(THIS, "restore_job", 2, tmp_path / "job3", isolate=nodes, view=str(nodes.view))
    assert not failures, failures
    assert [(r.get("step"), r.get("bitwise")) for r in results] == [(6, True)] * 2, results


def test_a_version_left_incomplete_by_a_node_loss_is_replaced_by_the_next_save_of_its_step(tmp_path: Path) -> None:
    """Step 6's peer copy of node 1's part never arrived, and node 1 is lost: the job resumes
    from step 3 and saves step 6 again, which replaces node 0's surviving part of the old
    step 6 (before: VersionExistsError on node 0's root, and the job could not go on). Once
    replaced, a further save of step 6 is refused as for any committed step."""
    nodes = _saved_then_node_1_killed(tmp_path)
    shutil.rmtree(_held(nodes.disks / "node0") / "v000000000006")
    _wipe(nodes.disks / "node1")
    results, failures = launch(THIS, "resume_and_save_again", 4, tmp_path / "job2", isolate=nodes, view=str(nodes.view))
    assert not failures, failures
    assert [(r["resumed"], r["again"], r["bitwise"], r["refused"]) for r in results] == [(3, 6, True, True)] * 4, (
        results
    )


def test_both_copies_of_a_part_lost_is_an_error_not_a_partial_state(tmp_path: Path) -> None:
    nodes = _nodes(tmp_path)
    _, failures = launch(
        THIS, "save_job", 4, tmp_path / "job", isolate=nodes, view=str(nodes.view), steps=[2], keep_last=None
    )
    assert not failures, failures
    _wipe(nodes.disks / "node1")
    shutil.rmtree(nodes.disks / "node0" / "replicas")  # node 1's part, copied to node 0, lost too
    results, failures = launch(THIS, "restore_job", 4, tmp_path / "job2", isolate=nodes, view=str(nodes.view))
    assert not failures, failures
    for r in results:
        assert "step 2 lacks the part of ranks [2, 3]" in r.get("error", ""), r


def test_a_damaged_block_in_the_only_surviving_copy_falls_back_to_the_older_step(tmp_path: Path) -> None:
    """Node 1 is lost. Its part, chunks of five ~1 MiB blocks each, comes from node 0's copy
    (the holders read runs of blocks for node 1's ranks) and restores bitwise. Then a byte
    in a middle block of the newest step's copy is flipped: the holder finds it damaged, and
    every rank restores the older step bitwise instead (never step 4 with a wrong chunk)."""
    nodes = _saved_2_and_4(tmp_path, keep_last=None)
    _wipe(nodes.disks / "node1")
    results, failures = launch(THIS, "restore_job", 4, tmp_path / "job2", isolate=nodes, view=str(nodes.view), big=True)
    assert not failures, failures
    assert [(r.get("step"), r.get("bitwise")) for r in results] == [(4, True)] * 4, results
    copy = _held(nodes.disks / "node0") / "v000000000004" / "state" / "big"
    chunks = [p for p in copy.rglob("c.*") if p.is_file()]
    assert len(chunks) == 2 and all(p.stat().st_size == BIG_ROWS // 4 * 4000 for p in chunks), chunks
    raw = bytearray(chunks[0].read_bytes())
    raw[len(raw) // 2] ^= 0x01  # the third of its five blocks
    chunks[0].write_bytes(bytes(raw))
    results, failures = launch(THIS, "restore_job", 4, tmp_path / "job3", isolate=nodes, view=str(nodes.view), big=True)
    assert not failures, failures
    assert [(r.get("step"), r.get("bitwise")) for r in results] == [(2, True)] * 4, results


def test_small_chunks_travel_in_packs_and_one_damaged_falls_back(tmp_path: Path) -> None:
    """Node 1 is lost. Its ranks' many tiny chunks come from node 0's copy in a few messages
    a holder (restore.execute's packs), and the tensor every rank holds whole, needed by
    both of node 1's ranks from the same holder, reaches both, bitwise. Then one tiny chunk
    of the newest step's copy is damaged: its holder still sends the pack, and every rank
    restores the older step bitwise instead."""
    nodes = _saved_2_and_4(tmp_path, keep_last=None, big=False, small=True)
    whole, failures = launch(THIS, "restore_job", 4, tmp_path / "job1", isolate=nodes, view=str(nodes.view), small=True)
    assert not failures, failures
    assert [(r.get("step"), r.get("bitwise")) for r in whole] == [(4, True)] * 4, whole
    _wipe(nodes.disks / "node1")
    results, failures = launch(
        THIS, "restore_job", 4, tmp_path / "job2", isolate=nodes, view=str(nodes.view), small=True
    )
    assert not failures, failures
    assert [(r.get("step"), r.get("bitwise")) for r in results] == [(4, True)] * 4, results
    # Each of node 1's ranks needs SMALL + 3 chunks of its own and the shared one from node
    # 0's two ranks: from each, one message for its own and one for what both need, where
    # each chunk was a message of its own (the plan's two all-to-alls post a few more).
    assert all(w["messages"] == 0 for w in whole), whole
    assert all(r["messages"] < SMALL // 2 for r in results), results
    copy = _held(nodes.disks / "node0") / "v000000000004" / "state" / "s7"
    chunks = sorted(p for p in copy.rglob("c.*") if p.is_file())
    assert len(chunks) == 2 and all(p.stat().st_size == 32 for p in chunks), chunks
    raw = bytearray(chunks[1].read_bytes())
    raw[5] ^= 0x01
    chunks[1].write_bytes(bytes(raw))
    results, failures = launch(
        THIS, "restore_job", 4, tmp_path / "job3", isolate=nodes, view=str(nodes.view), small=True
    )
    assert not failures, failures
    assert [(r.get("step"), r.get("bitwise")) for r in results] == [(2, True)] * 4, results


def judge_with_peers(ctx: Any, view: str) -> dict[str, Any]:
    """Open the node's root with peer copies; what the peer rule lets a GC delete there."""
    import ckpt
    from ckpt._peer_status import peer_redundant

    root = _view(ctx, view).format(node=ctx.rank // 2)
    import torch.distributed as dist

    with ckpt.Checkpointer(_view(ctx, view), peer_copies=1, timeout=TIMEOUT):
        dist.barrier()  # every root's leader has opened it
        rule = peer_redundant(root)
    return {"rule": None if rule is None else sorted(rule)}


def test_a_job_with_peer_copies_holds_back_what_an_earlier_stopped_copier_verified(tmp_path: Path) -> None:
    """An earlier job's copier stopped for good (a peer stopped answering) and recorded it.
    Before, the next job with peer copies ran without the rule until its own first round was
    verified everywhere: meanwhile retention deleted the root's older versions, the ones a
    node's loss then needs (the newest were not copied yet). Now opening the root with peer
    copies lifts the stop: the rule applies at once, from the copies verified before."""
    from ckpt._peer_status import record_peers_stopped

    nodes = _saved_2_and_4(tmp_path, keep_last=None)
    record_peers_stopped(str(nodes.disks / "node0"), "node 1 stopped answering")
    results, failures = launch(THIS, "judge_with_peers", 4, tmp_path / "job2", isolate=nodes, view=str(nodes.view))
    assert not failures, failures
    assert [r["rule"] for r in results] == [[2]] * 4, results  # step 4 verified everywhere: older ones may go


@pytest.mark.parametrize("keep_last", [None, 1])
def test_a_chunk_damaged_on_its_node_is_read_from_the_peer_copy(tmp_path: Path, keep_last: int | None) -> None:
    """No node is lost: a byte of node 0's own copy of step 4 flips, while node 1 holds a
    verified peer copy of it. Before, the damage made every rank fall back to step 2 (with
    keep_last=1, nothing older: CorruptVersionError, no resume at all); the rank that found
    it now gets that chunk from a rank of node 1, and every rank restores step 4 bitwise.
    Then node 1's copy of it is damaged too: the damage stands, as before."""
    nodes = _saved_2_and_4(tmp_path, keep_last=keep_last)
    own = sorted(p for p in (nodes.disks / "node0" / "v000000000004" / "state" / "big").rglob("c.*") if p.is_file())
    peer = _held(nodes.disks / "node1") / "v000000000004" / "state" / "big" / own[0].name
    assert peer.read_bytes() == own[0].read_bytes()  # (the test's premise: the peer copy is there)
    for damaged, path in enumerate((own[0], peer), 1):
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))
        results, failures = launch(
            THIS, "restore_job", 4, tmp_path / f"job{damaged}", isolate=nodes, view=str(nodes.view), big=True
        )
        assert not failures, failures
        got = [(r.get("step"), r.get("bitwise")) for r in results]
        if damaged == 1:
            assert got == [(4, True)] * 4, results
        elif keep_last is None:
            assert got == [(2, True)] * 4, results
        else:
            assert all(r.get("error", "").startswith("CorruptVersionError") for r in results), results


def test_retention_keeps_what_the_peers_lack_and_prunes_peer_copies(tmp_path: Path) -> None:
    """keep_last=1 with peer copies: each root ends with its newest version, and each peer
    copy directory with the newest copy (older ones pruned once newer are verified)."""
    nodes = Nodes(tmp_path / "disks", tmp_path / "view", per_node=2)
    for k in (0, 1):
        (nodes.disks / f"node{k}").mkdir(parents=True)
    nodes.view.mkdir()
    _, failures = launch(
        THIS, "save_job", 4, tmp_path / "job", isolate=nodes, view=str(nodes.view), steps=[1, 2, 3], keep_last=1
    )
    assert not failures, failures
    for k in (0, 1):
        assert _versions(nodes.disks / f"node{k}") == ["v000000000003"]
        assert _versions(_held(nodes.disks / f"node{k}")) == ["v000000000003"]


def test_an_interrupted_peer_copy_is_never_listed_and_the_next_save_is_copied(tmp_path: Path) -> None:
    nodes = _nodes(tmp_path)
    _, failures = launch(
        THIS, "interrupted_copy", 4, tmp_path / "job", isolate=nodes, killed=frozenset({2, 3}), view=str(nodes.view)
    )
    assert not failures, failures
    for k in (0, 1):
        held = _held(nodes.disks / f"node{k}")
        assert _versions(held) == [], os.listdir(held)  # nothing published half-way
        listed = CliRunner().invoke(cli, ["ls", str(nodes.disks / f"node{k}")])
        assert listed.exit_code == 0 and "steps none" in listed.output, listed.output
    _, failures = launch(THIS, "save_again", 4, tmp_path / "job2", isolate=nodes, view=str(nodes.view))
    assert not failures, failures
    for k in (0, 1):
        held = _held(nodes.disks / f"node{k}")
        assert _versions(held) == ["v000000000002"]
        assert not (held / ".incoming").exists() or not any((held / ".incoming").iterdir())


def test_a_job_on_other_nodes_keeps_each_roots_copies_apart_and_prunes_the_rest(tmp_path: Path) -> None:
    """Peer copies are named by their source's disk, not its place in the job. A job of 4
    nodes (root i copied to root i + 1) saves steps 1-3; the next job runs on two of those
    disks, in the other order. Before, a disk's `peer-<index>` directory received another
    root's copies than it held (two roots' copies in one directory), and the copies of a
    root no longer copied there were never pruned. Now each disk holds exactly the other
    disk's copies, pruned like its own versions."""
    nodes = Nodes(tmp_path / "disks", tmp_path / "view", per_node=1)
    for k in range(4):
        (nodes.disks / f"node{k}").mkdir(parents=True)
    nodes.view.mkdir()
    _, failures = launch(
        THIS, "save_a_rank_a_node", 4, tmp_path / "job", isolate=nodes, view=str(nodes.view), steps=[1, 2, 3]
    )
    assert not failures, failures
    for k in range(4):
        assert _held(nodes.disks / f"node{k}").name == f"peer-{_root_id(nodes.disks / f'node{(k - 1) % 4}')}"
    disk0, disk2 = _root_id(nodes.disks / "node0"), _root_id(nodes.disks / "node2")
    for k in (1, 3):
        shutil.rmtree(nodes.disks / f"node{k}")
    (nodes.disks / "node2").rename(nodes.disks / "spare")
    (nodes.disks / "node0").rename(nodes.disks / "node1")
    (nodes.disks / "spare").rename(nodes.disks / "node0")  # disk 2 is node 0 now, disk 0 node 1
    _, failures = launch(
        THIS, "save_a_rank_a_node", 2, tmp_path / "job2", isolate=nodes, view=str(nodes.view), steps=[4, 5]
    )
    assert not failures, failures
    for k, other in ((0, disk0), (1, disk2)):
        disk = nodes.disks / f"node{k}"
        assert _versions(disk) == ["v000000000005"]
        held = _held(disk)
        assert held.name == f"peer-{other}" and _versions(held) == ["v000000000005"], os.listdir(held)


def test_a_sender_that_cannot_read_its_version_fails_that_copy_not_the_copier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that changes under the copier after its size was announced: the receiver
    refuses that copy (the bytes do not match the manifest), every leader finishes the
    round, and the next version is copied both ways (the copier goes on)."""
    nodes = _nodes(tmp_path)
    monkeypatch.setenv("CKPT_DELAY", "peer-stream:0:3")
    results, failures = launch(THIS, "stream_breaks", 4, tmp_path / "job", isolate=nodes, view=str(nodes.view))
    assert not failures, failures
    assert results[0]["status"] == {"1": {"1": "failed"}, "2": {"1": "verified"}}, results[0]
    assert results[2]["status"] == {"1": {"0": "verified"}, "2": {"0": "verified"}}, results[2]
    assert _versions(_held(nodes.disks / "node1")) == ["v000000000002"]


def test_an_overwritten_version_is_copied_again(tmp_path: Path) -> None:
    """A step overwritten after its peer copies were verified is copied again: the peers
    then hold the new save (before: they kept the old one, two complete saves of step 2
    made it ambiguous, and restore fell back to step 1)."""
    nodes = _nodes(tmp_path)
    results, failures = launch(THIS, "overwrite_copied", 4, tmp_path / "job", isolate=nodes, view=str(nodes.view))
    assert not failures, failures
    assert [(r["restored"], r["bitwise"]) for r in results] == [(2, True)] * 4, results
    assert results[0]["verified"] == [1, 2] and results[2]["verified"] == [1, 2], results
    for k in (0, 1):
        own = json.loads((nodes.disks / f"node{k}" / "v000000000002" / "root.json").read_text())
        held = _held(nodes.disks / f"node{1 - k}") / "v000000000002" / "root.json"
        assert json.loads(held.read_text())["save_id"] == own["save_id"]


def test_a_copy_refused_one_way_keeps_the_older_version_on_every_root(tmp_path: Path) -> None:
    """Step 2's copies are verified one way only (root 1's is refused on node 0). Node 1 is
    then lost: step 2 lacks its part, so step 1 must be whole on node 0 (its own part, and
    node 1's copy). Before: root 0 counted step 2 as verified and its keep_last=1 deleted
    its part of step 1, and the survivors held no whole version."""
    nodes = _nodes(tmp_path)
    results, failures = launch(THIS, "one_way_copy_refused", 4, tmp_path / "job", isolate=nodes, view=str(nodes.view))
    assert not failures, failures
    assert results[2]["status"]["2"] == {"0": "failed"}, results
    _wipe(nodes.disks / "node1")
    results, failures = launch(THIS, "restore_job", 4, tmp_path / "job2", isolate=nodes, view=str(nodes.view))
    assert not failures, failures
    assert [(r.get("step"), r.get("bitwise")) for r in results] == [(1, True)] * 4, results


def test_an_overwrite_not_yet_copied_is_restored_not_the_older_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 2 is overwritten after its peer copies were verified, and the whole job dies
    before the overwrite is copied; no node is lost. The new save of step 2 is whole on
    the roots and restores bitwise. Before: the old save's peer copies, whole together,
    stayed beside it, restore passed over step 2 as saved twice, and step 1 came back."""
    nodes = _nodes(tmp_path)
    monkeypatch.setenv("CKPT_DELAY", "peer-stream:0:5")
    _, failures = launch(
        THIS,
        "overwrite_then_crash",
        4,
        tmp_path / "job",
        isolate=nodes,
        killed=frozenset(range(4)),
        view=str(nodes.view),
    )
    assert not failures, failures
    monkeypatch.delenv("CKPT_DELAY")
    results, failures = launch(
        THIS, "restore_values_of", 4, tmp_path / "job2", isolate=nodes, view=str(nodes.view), values=20
    )
    assert not failures, failures
    assert [(r["step"], r["bitwise"]) for r in results] == [(2, True)] * 4, results
