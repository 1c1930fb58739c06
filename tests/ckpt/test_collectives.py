"""What a steady-state save costs in collectives: a few all-reduces of fixed-size tensors,
the reports sent to rank 0 through the roots' leaders, and the manifest sent to the
roots' leaders only.

Before, every save all-gathered a Python tuple from every rank to every rank (O(world^2)
bytes in all), broadcast the whole manifest to every rank (each parsed it), and each of
the two commit agreements all-gathered again. A restore all-gathers only each rank's
listing. Real gloo jobs of 4 ranks, one root and a root per simulated node; the counts
come from each rank's `Comm.calls`.
"""

from __future__ import annotations

import datetime
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import launch

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=60)
COLLECTIVES = ("all_reduce", "all_gather", "gather", "broadcast")


def _calls(ck: Any) -> Counter[str]:
    return ck._ctl.calls + ck._data.calls  # type: ignore[no-any-return]


def count_job(ctx: Any, base: str, per_node: bool) -> dict[str, Any]:
    import ckpt

    root = f"{base}/node{ctx.rank // 2}" if per_node else f"{base}/one"
    torch.manual_seed(ctx.rank)
    cut = [0, 3, 500, 777, 1001][ctx.rank : ctx.rank + 2]  # an arbitrary split: slivers cross ranks
    full = torch.arange(1001 * 8, dtype=torch.float32).reshape(1001, 8)
    state = {
        "shared": torch.ones(64),
        "rows": ckpt.Shard(full[cut[0] : cut[1]].clone(), (1001, 8), (cut[0], 0)),
        "mine": {"step": ctx.rank},
    }
    out: dict[str, Any] = {}
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        ck.save(1, state)
        ck.wait()
        for step in (2, 3):  # the same layout again: the steady state
            before = _calls(ck)
            ck.save(step, state)
            ck.wait()
            out[f"steady{step}"] = dict(_calls(ck) - before)
        before = _calls(ck)
        odd = {"extra": torch.zeros(3)} if ctx.rank % 2 else {}  # a key only some ranks hold
        ck.save(4, {**state, **odd})  # a new layout: planned again
        ck.wait()
        out["relayout"] = dict(_calls(ck) - before)
        ck.save(5, state)  # newer, without that key
        ck.wait()
        target = {
            "shared": torch.zeros(64),
            "rows": ckpt.Shard(torch.zeros(cut[1] - cut[0], 8), (1001, 8), (cut[0], 0)),
        }
        before = _calls(ck)
        ck.restore(target, step=3, strict=False)
        out["restore"] = dict(_calls(ck) - before)
        ctx.check(torch.equal(target["rows"].local_tensor, full[cut[0] : cut[1]]), "rows restored wrong")
        # The newest version holding every rank's top-level keys (strict, no step): step 4,
        # on every rank, though the even ranks' keys are in step 5 too. The keys travel
        # with the listing.
        newest = {**target, "mine": {"step": -1}, **({"extra": torch.ones(3)} if ctx.rank % 2 else {})}
        before = _calls(ck)
        ctx.check(ck.restore(newest) == 4, "the newest version holding every rank's keys is step 4")
        out["restore_newest"] = dict(_calls(ck) - before)
        ctx.check(newest["mine"] == {"step": ctx.rank}, "step 4's values")
        ctx.check(not ctx.rank % 2 or torch.equal(newest["extra"], torch.zeros(3)), "step 4's extra")
    return out


@pytest.mark.parametrize("per_node", [False, True], ids=["one-root", "root-per-node"])
def test_steady_state_save_costs_few_small_collectives(tmp_path: Path, per_node: bool) -> None:
    results, failures = launch(THIS, "count_job", 4, tmp_path, timeout=180, base=str(tmp_path), per_node=per_node)
    assert not failures, failures
    groups = [[0, 1], [2, 3]] if per_node else [[0, 1, 2, 3]]
    leaders = {g[0] for g in groups}
    for rank, r in enumerate(results):
        group = next(g for g in groups if rank in g)
        for step in ("steady2", "steady3"):
            calls = Counter(r[step])
            assert calls["all_gather"] == calls["broadcast"] == calls["gather"] == 0, (rank, step, calls)
            assert sum(calls[k] for k in COLLECTIVES) <= 3, (rank, step, calls)
            # p2p: the reports (a member to its root's leader, a leader to rank 0), the
            # manifest from rank 0 to the other roots' leaders, and the sliver exchange
            # (at most one call: its sends and receives are posted together).
            if rank != group[0]:
                reports = 1
            else:
                reports = len(group) - 1 + (1 if rank != 0 else len(groups) - 1)
            manifest = 1 if (rank in leaders and len(leaders) > 1) else 0
            assert reports + manifest <= calls["p2p"] <= reports + manifest + 1, (rank, step, calls)
        assert Counter(r["relayout"])["all_gather"] == 1, (rank, r["relayout"])
        # A restore all-gathers each rank's listing (its candidates' writers as ranges);
        # only where chunks are then sent point to point (a root per node) what each rank
        # cannot reach follows (all_gather_few: the sizes, then a broadcast per rank that
        # lacks chunks) and what each reaches; the pin check and the manifest's holders
        # are all-reduces.
        for what in ("restore", "restore_newest"):
            calls = Counter(r[what])
            sent = calls["p2p"] > 0
            assert sent == per_node, (rank, what, calls)
            assert calls["all_gather"] == 1 + 2 * sent and calls["gather"] == 0, (rank, what, calls)
            assert 0 < calls["broadcast"] <= 4 if sent else calls["broadcast"] == 0, (rank, what, calls)


def few_job(ctx: Any) -> dict[str, Any]:
    from ckpt._dist import make_comms

    ctl, _ = make_comms(TIMEOUT)
    said = {"rank": ctx.rank, "asks": [("w", (ctx.rank, 0))] * (100 * ctx.rank)} if ctx.rank in (1, 3) else None
    out: dict[str, Any] = {}
    for most in (2, 1):  # two speakers: each broadcasts; more than `most`: one all_gather
        before = Counter(ctl.calls)
        got = ctl.all_gather_few(said, most=most)
        out[str(most)] = dict(ctl.calls - before)
        want = [{"rank": r, "asks": [("w", (r, 0))] * (100 * r)} if r in (1, 3) else None for r in range(ctx.world)]
        ctx.check(got == want, f"most={most}: {got!r:.200}")
    return out


def test_all_gather_few_sends_only_what_the_speakers_say(tmp_path: Path) -> None:
    """Ranks 1 and 3 of 4 have something to say, the others nothing: every rank gets every
    part (None for the silent), through the sizes and one broadcast per speaker, or one
    all_gather where there are more speakers than `most`."""
    results, failures = launch(THIS, "few_job", 4, tmp_path, timeout=120)
    assert not failures, failures
    for r in results:
        assert r["2"] == {"all_gather": 1, "broadcast": 2}, r
        assert r["1"] == {"all_gather": 2}, r


def test_packed_reports_come_back_whole() -> None:
    """What a root's leader sends rank 0: every rank's rank-file reference and timings, the
    group's hosts, keys and inline values, and any rank's error."""
    from ckpt._job import RankReport, RankTimings
    from ckpt._reports import pack, unpack

    reports = [
        RankReport(
            error="OSError: disk gone" if i == 2 else None,
            rank_file=(100 + i, f"{(i + 1) * 0x0123456789ABCDE:016x}"),
            inline={"optim/step": ("0a00000000000000", "ab" * 8)} if i == 1 else {},
            keys=("model", "optim") if i else ("model", "extra"),
            host=f"node{i % 2}",
            root="/nvme/a",
            root_index=5,
            timings=RankTimings(0.5 + i, 0.25, 1.0, 0.125, (1 << 33) + i, 1.7e9 + i / 8),
        )
        for i in range(3)
    ]
    back = unpack(pack(reports), 5)
    assert [b.rank_file for b in back] == [r.rank_file for r in reports]
    assert [b.error for b in back] == [None, None, "OSError: disk gone"]
    assert [b.host for b in back] == ["node0", "node1", "node0"]
    assert back[0].keys == ("extra", "model", "optim") and back[0].inline == {
        "optim/step": ("0a00000000000000", "ab" * 8)
    }
    assert all(b.root == "/nvme/a" and b.root_index == 5 for b in back)
    for b, r in zip(back, reports):
        assert (b.timings.stage_s, b.timings.bytes) == (r.timings.stage_s, r.timings.bytes)
        assert abs(b.timings.started - r.timings.started) < 1e-3


def _gloo_threads() -> int:
    """Threads of this process that gloo groups run (torch names them)."""
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    return sum(n in ("gloo_tcp_loop", "pt_gloo_runloop") for n in names)


def groups_job(ctx: Any, base: str) -> dict[str, Any]:
    import ckpt

    before = _gloo_threads()
    # A root per rank with peer copies: the ctl and data groups and the leaders' group.
    with ckpt.Checkpointer(f"{base}/rank{ctx.rank}", timeout=TIMEOUT, peer_copies=1) as ck:
        ck.save(1, {"w": torch.full((256,), float(ctx.rank))})
        ck.wait()
        opened = _gloo_threads()
    deadline = time.monotonic() + 10  # a group's threads end after its destruction returns
    while _gloo_threads() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"before": before, "opened": opened, "closed": _gloo_threads()}


def test_close_frees_the_gloo_groups_it_opened(tmp_path: Path) -> None:
    """A job that opens and closes Checkpointers must not pile up gloo groups (each holds
    sockets and threads); close() leaves only what the job had before."""
    results, failures = launch(THIS, "groups_job", 2, tmp_path, base=str(tmp_path))
    assert not failures, failures
    for rank, r in enumerate(results):
        assert r["opened"] > r["before"], (rank, r)  # the count sees the groups Checkpointer opens
        assert r["closed"] == r["before"], (rank, r)
