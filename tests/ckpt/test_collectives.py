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
        # reaches follows, and two all-to-alls: what each rank asks of the ranks it picked
        # to send it chunks, and their answers (restore.handoff); the pin check and the
        # manifest's holders are all-reduces.
        for what in ("restore", "restore_newest"):
            calls = Counter(r[what])
            sent = calls["p2p"] > 0
            assert sent == per_node, (rank, what, calls)
            assert calls["all_gather"] == 1 + sent and calls["gather"] == 0, (rank, what, calls)
            assert calls["all_to_all"] == 2 * sent, (rank, what, calls)
            assert calls["broadcast"] == 0, (rank, what, calls)


def _keys_in(obj: Any, out: set[tuple[str, tuple[int, ...]]]) -> None:
    """Every (array name, chunk index) pair inside what a collective returned."""
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], tuple):
        out.add(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _keys_in(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _keys_in(x, out)


ARRAYS, ROWS = 24, 8  # the hand-off jobs' state: 24 arrays of 4 x 8 rows, a rank's rows a chunk


def _full() -> dict[str, torch.Tensor]:
    return {
        f"a{i:02d}": torch.arange(4 * ROWS * 16, dtype=torch.float32).reshape(4 * ROWS, 16) + i for i in range(ARRAYS)
    }


def _rows(k: int, fill: bool = True) -> dict[str, Any]:
    """Rank k's rows of every array (zeros where not `fill`), as ckpt.Shards."""
    import ckpt

    return {
        n: ckpt.Shard(
            t[k * ROWS : (k + 1) * ROWS].clone() if fill else torch.zeros(ROWS, 16), tuple(t.shape), (k * ROWS, 0)
        )
        for n, t in _full().items()
    }


def _saved_by_nodes(ctx: Any, base: str, timeout: datetime.timedelta = TIMEOUT, **overrides: Any) -> Any:
    """A Checkpointer on this rank's node's root (2 ranks a node), with step 1 of its rows saved."""
    import ckpt

    ck = ckpt.Checkpointer(f"{base}/node{ctx.rank // 2}", timeout=timeout, **overrides)
    ck.save(1, {"m": _rows(ctx.rank)})
    ck.wait()
    return ck


def handoff_job(ctx: Any, base: str) -> dict[str, Any]:
    import ckpt.restore.execute as execute

    full = _full()
    out: dict[str, Any] = {}
    with _saved_by_nodes(ctx, base) as ck:
        # The ranks of each node take the other node's rows: every rank needs chunks it
        # cannot reach. One chunk a round a holder: rounds count the hand-off's serial steps.
        execute.SEND_ROUND_BYTES = 1
        seen: set[tuple[str, tuple[int, ...]]] = set()
        for kind in ("all_gather", "all_gather_few", "all_to_all", "broadcast"):
            real = getattr(ck._ctl, kind, None)
            if real is None:
                continue

            def counted(*a: Any, _real: Any = real, **k: Any) -> Any:
                got = _real(*a, **k)
                if isinstance(got, list) and len(got) == ctx.world:
                    _keys_in([x for r, x in enumerate(got) if r != ctx.rank], seen)
                else:
                    _keys_in(got, seen)
                return got

            setattr(ck._ctl, kind, counted)
        other = (ctx.rank + 2) % 4
        target = {"m": _rows(other, fill=False)}
        before = _calls(ck)
        ck.restore(target, step=1)
        out["calls"] = dict(_calls(ck) - before)
        for n, t in full.items():
            ctx.check(
                torch.equal(target["m"][n].local_tensor, t[other * ROWS : (other + 1) * ROWS]), f"{n} restored wrong"
            )
        # The keys this rank learnt of: chunks it reads for the ranks that asked it (on its node).
        out["foreign"] = sorted(f"{n}{list(i)}" for n, i in seen if i[0] // 2 != ctx.rank // 2)[:5]
        out["keys"] = len(seen)
    return out


def test_a_world_change_across_nodes_hands_chunks_over_in_parallel_rounds(tmp_path: Path) -> None:
    """Four ranks, a root per node of two; on restore each node's ranks take the other
    node's rows, so every rank needs 24 chunks it cannot reach (96 in all, one a round per
    holder). Each rank learns only of chunks asked of it (on its own node's disk), never
    of other ranks' requests; and the holders send side by side: the rounds (one
    all-reduce each) number about a holder's share, not one per chunk of the whole job.
    Before, every rank received every needy rank's list and the job sent one round of
    64 MiB at a time: at 16,384 ranks with a root per node, each rank received ranks x
    the neediest rank's list, and the job's hand-off ran one holder's read at a time."""
    results, failures = launch(THIS, "handoff_job", 4, tmp_path, timeout=180, base=str(tmp_path))
    assert not failures, failures
    for rank, r in enumerate(results):
        assert not r["foreign"], (rank, r["foreign"])
        assert 0 < r["keys"] <= 48, (rank, r["keys"])
        # 96 chunks over 4 holders (each chunk held by the 2 ranks of its node): a fair
        # share is 24 rounds; the rest of the restore's all-reduces are a handful.
        assert r["calls"]["all_reduce"] <= 24 + 16, (rank, r["calls"])


def failing_holder_job(ctx: Any, base: str) -> dict[str, Any]:
    import time

    import ckpt.restore.execute as execute

    out: dict[str, Any] = {}
    with _saved_by_nodes(ctx, base, timeout=datetime.timedelta(seconds=20)) as ck:
        if ctx.rank == 3:  # this holder cannot plan its sends (e.g. MemoryError): it answers nothing

            def boom(*a: Any, **k: Any) -> Any:
                raise MemoryError("planning the sends")

            execute.plan_sends = boom
        t0 = time.monotonic()
        try:  # each rank takes the other node's rows: it asks ranks 2 and 3 (or 0 and 1)
            ck.restore({"m": _rows((ctx.rank + 2) % 4, fill=False)}, step=1)
            out["err"] = None
        except Exception as e:  # noqa: BLE001
            out["err"] = f"{type(e).__name__}: {e}"[:300]
        out["seconds"] = time.monotonic() - t0
    return out


def test_a_holder_that_cannot_plan_fails_the_restore_promptly_on_every_rank(tmp_path: Path) -> None:
    """A holder whose hand-off plan fails (restore.handoff.plan_sends raising) answers its
    askers nothing; they still receive what the other holders send them, so every rank
    fails at once. Before, the askers dropped every chunk they had asked of any holder,
    and the other holders' sends waited for the group's timeout (20 s here)."""
    results, failures = launch(THIS, "failing_holder_job", 4, tmp_path, timeout=240, base=str(tmp_path))
    assert not failures, failures
    for rank, r in enumerate(results):
        assert r["err"] is not None, (rank, r)
        assert r["seconds"] < 10, (rank, r)  # well under the group's timeout
        assert "Timed out" not in r["err"] and "timeout" not in r["err"].lower(), (rank, r)


def broken_rounds_job(ctx: Any, base: str) -> dict[str, Any]:
    import threading

    import ckpt
    import ckpt.restore.execute as execute

    full = _full()
    names = sorted(full)
    other = (ctx.rank + 2) % 4
    out: dict[str, Any] = {"own_reads": 0}
    with _saved_by_nodes(ctx, base, reader_threads=1) as ck:
        execute.SEND_ROUND_BYTES = 1  # one chunk a round a holder: many rounds
        real = execute._read_whole
        reading = threading.Event()

        def slow(*a: Any, **k: Any) -> Any:
            if not threading.current_thread().name.startswith("ckpt-send"):  # this rank's own reads, not the sends
                out["own_reads"] += 1
                reading.set()
                time.sleep(0.25)
            return real(*a, **k)

        execute._read_whole = slow

        def gone(*a: Any, **k: Any) -> None:  # the group broke: every rank's first round raises, mid-read
            reading.wait(10)
            raise RuntimeError("a peer left the group")

        execute._finish_round = gone  # (the plan's all-to-all before the rounds still works)
        # The first half of the arrays: this rank's own rows (its node's disk, 12 reads);
        # the rest: the other node's rows (the hand-off's rounds).
        target = {
            "m": {
                n: ckpt.Shard(torch.zeros(ROWS, 16), tuple(full[n].shape), ((ctx.rank if i < 12 else other) * ROWS, 0))
                for i, n in enumerate(names)
            }
        }
        try:
            ck.restore(target, step=1)
            out["err"] = None
        except Exception as e:  # noqa: BLE001
            out["err"] = f"{type(e).__name__}: {e}"[:300]
    return out


def test_rounds_that_raise_stop_the_rest_of_this_ranks_own_reads(tmp_path: Path) -> None:
    """A hand-off whose rounds raise (a peer gone from the group) fails the restore; the
    rank's own reads not begun by then are not made (each here takes 0.25 s: 12 of them),
    so the failure comes back without waiting for them. Before, every own read was made
    first, into a state the restore was about to give up on."""
    results, failures = launch(THIS, "broken_rounds_job", 4, tmp_path, timeout=180, base=str(tmp_path))
    assert not failures, failures
    for rank, r in enumerate(results):
        assert r["err"] is not None and "a peer left the group" in r["err"], (rank, r)
        assert 1 <= r["own_reads"] <= 2, (rank, r)


def swapped_nodes_job(ctx: Any, base: str) -> dict[str, Any]:
    import ckpt

    full = torch.arange(4 * 8 * 16, dtype=torch.float32).reshape(32, 16)
    with ckpt.Checkpointer(f"{base}/node{ctx.rank // 2}", timeout=TIMEOUT) as ck:
        ck.save(1, {"w": ckpt.Shard(full[ctx.rank * 8 : ctx.rank * 8 + 8].clone(), (32, 16), (ctx.rank * 8, 0))})
        ck.wait()
    out: dict[str, Any] = {"files": 0}
    # The job comes back with its nodes in the other order: each rank's part (chunks and
    # rank file) is on the other node's disk.
    with ckpt.Checkpointer(f"{base}/node{1 - ctx.rank // 2}", timeout=TIMEOUT) as ck:
        for kind in ("all_gather", "all_to_all", "broadcast"):
            real = getattr(ck._ctl, kind)

            def counted(*a: Any, _real: Any = real, **k: Any) -> Any:
                got = _real(*a, **k)
                parts = [x for r, x in enumerate(got) if r != ctx.rank] if isinstance(got, list) else [got]
                out["files"] += sum(1 for x in parts if isinstance(x, tuple) and any(isinstance(y, bytes) for y in x))
                return got

            setattr(ck._ctl, kind, counted)
        target = {"w": ckpt.Shard(torch.zeros(8, 16), (32, 16), (ctx.rank * 8, 0))}
        before = _calls(ck)
        ck.restore(target, step=1)
        out["calls"] = dict(_calls(ck) - before)
        ctx.check(torch.equal(target["w"].local_tensor, full[ctx.rank * 8 : ctx.rank * 8 + 8]), "w restored wrong")
    return out


def test_a_rank_file_on_another_node_reaches_only_the_rank_that_needs_it(tmp_path: Path) -> None:
    """Four ranks, a root per node of two, resumed with the nodes in the other order: each
    rank's rank file (its tree and RNG) and chunks are on the other node's disk. Each rank
    receives its own rank file only, from a rank that reaches it, point to point. Before,
    each file a rank lacked was broadcast to every rank, one broadcast a file: at 16,384
    ranks, every rank received all 16,384 files."""
    results, failures = launch(THIS, "swapped_nodes_job", 4, tmp_path, timeout=180, base=str(tmp_path))
    assert not failures, failures
    for rank, r in enumerate(results):
        assert r["files"] == 1, (rank, r)
        assert r["calls"].get("broadcast", 0) == 0, (rank, r)


def to_all_job(ctx: Any) -> dict[str, Any]:
    from ckpt._dist import make_comms

    ctl, _ = make_comms(TIMEOUT)
    # Rank 1 asks rank 3 for 300 keys and rank 0 for one; rank 3 asks rank 1 for 100; rank 2
    # addresses only itself (kept, not sent); rank 0 asks nobody.
    asks = {
        1: {3: [("w", (i, 1)) for i in range(300)], 0: [("v", (1,))]},
        2: {2: [("u", (2,))]},
        3: {1: [("w", (i, 3)) for i in range(100)]},
    }
    mine = asks.get(ctx.rank, {})
    parts = [mine.get(r) for r in range(ctx.world)]
    before = Counter(ctl.calls)
    got = ctl.all_to_all(parts)
    out: dict[str, Any] = {"calls": dict(ctl.calls - before)}
    want = [asks.get(r, {}).get(ctx.rank) for r in range(ctx.world)]
    ctx.check(got == want, f"rank {ctx.rank} got {got!r:.200}")
    try:
        ctl.all_to_all(parts[:-1])
    except ValueError as e:
        out["short"] = str(e)
    return out


def test_all_to_all_hands_each_rank_only_its_parts(tmp_path: Path) -> None:
    """Each rank receives exactly what the others addressed to it (None from the silent),
    through one all-to-all of sizes and one point-to-point call; a list of the wrong
    length is refused before any rank is waited for."""
    results, failures = launch(THIS, "to_all_job", 4, tmp_path, timeout=120)
    assert not failures, failures
    for r in results:
        assert r["calls"] == {"all_to_all": 1, "p2p": 1}, r
        assert "3 for 4 ranks" in r["short"], r


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
