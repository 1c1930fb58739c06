"""Scale of ckpt's metadata path from 8 to 16,384 ranks, and a real 16-process gloo job.

The simulation drives the real code with synthetic layouts (bench/_scale_layouts.py).
First save of a layout (ckpt._plan): the hand-made regions each owner receives and plans
(`plan_owned`), the announcements rank 0 gathers, `plans_of` on rank 0, the plans it
broadcasts, and on another rank their unpickling, its own chunks (`chunks_of`) and its
sliver schedule; and a job whose every rank holds a `ckpt.Shard` of every array. Every save: rank 0's commit work
(`ckpt._commit._decide`: the manifest built from every rank's report and serialized),
the bytes rank 0 and a root's leader receive (ckpt._reports packs), and on restore
`parse_manifest`, `plan_reads` and the rank files a restoring rank reads, and the
restore's one all-gather (each rank's listing, restore.locate.Listing) with the choice
every rank makes from all of them, and the hand-off where ranks lack their part (the
nodes in a new order: restore.handoff's plans, the asks and answers each rank receives,
the rank files). Each (layout, world) runs in its own process, with an address-space
limit, so its peak RSS is its own; a case over the time or memory budget is recorded
as such and the larger worlds of that layout are not run.

The real job: 16 gloo processes on this machine save a state of every layout kind,
count each rank's collective calls per steady-state save (`Comm.calls`), and resume
16 -> 12 -> 16, checking every tensor bitwise.

    python -m bench.scale [--worlds 8,64,512,2048,16384] [--arrays 1000] [--budget-s 300]

Writes bench/results/scale.json and bench/results/scale.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import pickle
import resource
import subprocess
import sys
import time
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
MEMORY_LIMIT = 16 << 30  # bytes of address space per simulated case
MiB = 1 << 20
T = TypeVar("T")


def _cost(fn: Callable[[], T]) -> tuple[float, int, T]:
    """(CPU seconds, peak bytes allocated, result) of fn: timed on a first run, its memory
    traced on a second (tracemalloc slows the run it watches)."""
    gc.collect()
    t0 = time.process_time()
    fn()
    seconds = time.process_time() - t0
    gc.collect()
    tracemalloc.start()
    try:
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return seconds, peak, result


def _tree(names: list[str]) -> dict[str, Any]:
    """A rank's state tree as ckpt._tree.encode_state makes it, for the given arrays."""
    tree: dict[str, Any] = {}
    for name in names:
        *path, leaf = name.split("/")
        node = tree
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = {"__tensor__": name}
    return tree


def measure(layout: str, world: int, arrays: int) -> dict[str, Any]:
    """One simulated (layout, world): every figure of the metadata path, from the real code."""
    import torch

    from bench._scale_layouts import LAYOUTS
    from ckpt._commit import RootContext, _decide
    from ckpt._exchange import schedule
    from ckpt._job import RankReport, RankTimings, SaveJob, SaveRequest
    from ckpt._plan import Announcement, ListedEntry, announce, merge, owner_of, plan_owned, plans_of
    from ckpt._reports import pack
    from ckpt.provenance import rank_provenance
    from ckpt.restore.reshard import Box, Request, plan_reads
    from ckpt.rng import capture_rng
    from ckpt.store.digest import combine_blocks
    from ckpt.store.dtypes import itemsize
    from ckpt.store.layout import GRID_BYTES, ArrayPlan, block_rows, flat_index, plan_arrays
    from ckpt.store.manifest import parse_manifest
    from ckpt.store.rank_file import parse_rank_file, rank_file_bytes

    out: dict[str, Any] = {"layout": layout, "world": world, "arrays": arrays}
    lay = LAYOUTS[layout]
    anns, sigs = lay.announcements(world, arrays)
    for r in sorted({0, 1 % world, world // 2, world - 1}):  # the simulation says what the real code would
        real = announce(r, lay.pieces(world, arrays, r), sigs.index(sigs[r]) == r)
        if real != anns[r]:
            raise AssertionError(f"{layout}: the simulated announcement of rank {r} is not what announce() gives")
    # First save of a layout (ckpt._plan): each rank's listed regions go to their arrays'
    # owners (an all-to-all), which plan them; rank 0 gathers the announcements and the
    # owners' plans, plans the rest, and broadcasts the plans; every rank takes its own
    # chunks and its sliver schedule.
    inbox: dict[int, dict[int, list[ListedEntry]]] = {}
    for a in anns:
        for entry in a.listed:
            inbox.setdefault(owner_of(entry[0], world), {}).setdefault(a.rank, []).append(entry)
    owned, owner_s, owner_bytes = {}, 0.0, 0
    for o, by in inbox.items():  # each owner on its own rank: the slowest one counts
        seconds, peak, owned[o] = _cost(lambda by=by: plan_owned(sorted(by.items()), 64 << 20))
        owner_s, owner_bytes = max(owner_s, seconds), max(owner_bytes, peak)
    out["owner_plan_s"], out["owner_plan_bytes"] = owner_s, owner_bytes
    out["owner_received_bytes"] = max(
        (sum(len(pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)) for e in by.values()) for by in inbox.values()),
        default=0,
    )
    gathered = [Announcement(a.rank, a.meshed, (), a.plain, a.error, owned.get(a.rank)) for a in anns]
    out["announce_gather_bytes"] = sum(len(pickle.dumps(a, protocol=pickle.HIGHEST_PROTOCOL)) for a in gathered)
    out["announce_gather_bytes_before"] = sum(len(pickle.dumps(a, protocol=pickle.HIGHEST_PROTOCOL)) for a in anns)

    def rank0_plan() -> bytes:
        plans = plans_of(gathered, sigs, 64 << 20)
        return pickle.dumps((plans, None), protocol=pickle.HIGHEST_PROTOCOL)

    out["rank0_plan_s"], out["rank0_plan_bytes"], sent = _cost(rank0_plan)
    out["plan_broadcast_bytes"] = len(sent)
    last = world - 1

    def rank_plan() -> list[ArrayPlan]:
        plans: list[ArrayPlan] = pickle.loads(sent)[0]
        [c for p in plans for c in p.chunks_of(last)]
        schedule(plans, last)
        return plans

    out["rank_plan_s"], out["rank_plan_bytes"], plans = _cost(rank_plan)
    out["plan_s"] = max(out["rank0_plan_s"], out["rank_plan_s"], out["owner_plan_s"])
    out["plan_bytes"] = max(out["rank0_plan_bytes"], out["rank_plan_bytes"], out["owner_plan_bytes"])
    out["chunks"] = sum(p.chunk_count for p in plans)
    out["writer_runs"] = sum(len(p.runs) for p in plans)
    worst = 0.0
    for p in plans:
        nbytes = math.prod(p.spec.shape) * itemsize(p.spec.data_type)
        worst = max(worst, p.chunk_count / (p.sharding.pieces + math.ceil(nbytes / GRID_BYTES)))
    out["chunks_over_bound"] = worst
    if layout == "zero1":  # the arbitrary-boundary case: planning time per array
        one = [dataclasses.replace(a, listed=tuple(e for e in a.listed if e[0].endswith("/p7"))) for a in anns]
        t0 = time.process_time()
        plan_arrays(merge(one, sigs))
        out["arbitrary_ms_per_array"] = 1000 * (time.process_time() - t0)
    # Every save: each rank writes its rank file (digests of its chunks, tree, RNG) and sends
    # rank 0 an O(1) report; rank 0 builds and serializes the manifest. Rank files are made
    # for the ranks the figures need (rank 0's, and those a restoring rank reads).
    digest = "0123456789abcdef"
    inline: dict[int, dict[str, tuple[str, str]]] = {}
    for p in plans:
        if p.inline:
            inline.setdefault(p.runs[0].first, {})[p.spec.name] = ("00" * itemsize(p.spec.data_type), digest)

    def own_chunks(r: int) -> dict[str, list[tuple[int, str, tuple[str, ...]]]]:
        mine: dict[str, list[tuple[int, str, tuple[str, ...]]]] = {}
        for p in plans:
            if p.inline:
                continue
            rows = block_rows(p.chunk_shape, itemsize(p.spec.data_type))
            blocks = (digest,) * (-(-p.chunk_shape[0] // rows) if rows else 0)
            whole = combine_blocks(blocks) if blocks else digest
            for c in p.chunks_of(r):
                mine.setdefault(p.spec.name, []).append((flat_index(c.index, p.grid), whole, blocks))
        return mine

    rng = capture_rng()
    prov = rank_provenance()
    trees: dict[int, Any] = {}

    def tree_of(r: int) -> Any:
        if r not in trees:
            trees[r] = _tree(sorted(lay.pieces(world, arrays, r)))
        return trees[r]

    def rank_file(r: int) -> bytes:
        return rank_file_bytes(
            step=1,
            save_id="0" * 32,
            rank=r,
            host=f"node{r // 8}",
            root=r // 8,
            tree=tree_of(r),
            rng=rng,
            provenance=prov,
            chunks=own_chunks(r),
        )

    timings = RankTimings(0.1, 0.1, 0.5, 0.1, 1 << 30, time.time())
    size0 = len(rank_file(0))
    keys = tuple(sorted(tree_of(0)))  # the top-level keys: the same on every rank of these layouts
    reports = [
        RankReport(
            None,
            (size0, digest),
            inline.get(r, {}),
            keys,
            f"node{r // 8}",
            f"/nvme/node{r // 8}",
            r // 8,
            timings,
        )
        for r in range(world)
    ]
    # GATHER (ckpt._reports): a rank to its root's leader (8 ranks a node here), a leader's
    # packed group to rank 0.
    groups = [list(range(g, min(g + 8, world))) for g in range(0, world, 8)]
    out["rank0_gather_bytes"] = sum(len(pack([reports[r]])) for r in groups[0][1:]) + sum(
        len(pack([reports[r] for r in g])) for g in groups[1:]
    )
    out["leader_gather_bytes"] = sum(len(pack([reports[r]])) for r in groups[-1][1:])
    out["rank_file_bytes"] = size0
    request = SaveRequest(1, "0" * 32, False, False, False, plans, schedule(plans, 0), tree_of(0), rng, False, False)
    job = SaveJob(request, torch.empty(0, dtype=torch.uint8))
    groups = tuple(tuple(range(g, min(g + 8, world))) for g in range(0, world, 8))
    ctx = RootContext("/nvme/node0", 0, True, 0, groups)
    t0 = time.process_time()
    raw, failure = _decide(job, reports, ctx, world, 10.0)
    out["rank0_commit_cpu_s"] = time.process_time() - t0
    if failure is not None:
        raise failure
    out["manifest_bytes"] = len(raw)
    del reports, job, request
    # Restore: a rank parses the manifest, plans its reads (rank 0's regions here) and parses
    # the rank files of the ranks whose chunks it reads (its tree and RNG are in its own).
    requests = [
        Request(name, Box.at(p.offsets, tuple(p.data.shape)))
        for name, p in lay.pieces(world, arrays, 0).items()
        if p.data.numel()
    ]
    first = parse_manifest(raw)
    touched = {0} | {
        first.arrays[c.name].chunk_at(c.index).writer
        for c in plan_reads(first.arrays, requests)
        if first.arrays[c.name].inline is None
    }
    files = {r: rank_file(r) for r in sorted(touched)}
    out["restore_rank_files"] = len(files)
    del first

    def restore_meta() -> None:
        manifest = parse_manifest(raw)
        plan_reads(manifest.arrays, requests)
        for r, data in files.items():
            parse_rank_file(data, manifest, r)

    out["restore_meta_s"], out["restore_meta_bytes"], _ = _cost(restore_meta)
    out.update(measure_listing(world))
    out.update(measure_handoff(world, arrays, size0))
    out.update(measure_handmade(world, arrays))
    return out


def measure_handmade(world: int, arrays: int) -> dict[str, Any]:
    """The first save of a layout where every rank hands over a `ckpt.Shard` of every array
    (equal row ranges, as hand-sharded tensor-parallel code makes): each rank's regions go
    to their arrays' owners (ckpt._plan), which plan them, and rank 0 receives the owners'
    plans. The real
    announce, plan_owned and plans_of: one rank's announcement (every rank's is alike in
    size), the busiest owner's regions and planning, and what rank 0 receives; before, every
    rank's regions went to rank 0."""
    import torch

    from ckpt._plan import Announcement, announce, owner_of, plan_owned
    from ckpt._tensors import LocalPiece

    names = [f"layers.{i}.w" for i in range(arrays)]
    rows = 4 * world

    def piece(r: int) -> LocalPiece:
        return LocalPiece(torch.empty((4, 8), device="meta"), "float32", (rows, 8), (4 * r, 0), (4, 8), "listed")

    def dumps(obj: Any) -> int:
        return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    one = announce(world - 1, {n: piece(world - 1) for n in names}, False)
    owners: dict[int, list[str]] = {}
    for n in names:
        owners.setdefault(owner_of(n, world), []).append(n)
    busiest, owned_names = max(owners.items(), key=lambda kv: len(kv[1]))
    inbox = [
        (r, [(n, "float32", (rows, 8), piece(r).offsets, piece(r).shape) for n in owned_names]) for r in range(world)
    ]
    seconds, peak, owned = _cost(lambda: plan_owned(inbox, 64 << 20))
    assert owned.error is None, owned.error
    per_array = dumps(owned.plans[0]) + dumps(owned.claims[0])  # an owner's result, per array it owns
    return {
        "handmade_rank0_received_bytes": world * dumps(Announcement(0, (), (), None)) + arrays * per_array,
        "handmade_rank0_received_bytes_before": world * dumps(one),
        "handmade_owner_arrays": len(owned_names),
        "handmade_owner_received_bytes": sum(dumps(e) for _, e in inbox),
        "handmade_owner_plan_s": seconds,
        "handmade_owner_plan_bytes": peak,
    }


def measure_handoff(world: int, arrays: int, rank_file_bytes: int) -> dict[str, Any]:
    """A restore's hand-off (restore.handoff) when the job comes back with its nodes in a new
    order, a root per node of 8 ranks: every rank lacks its own part (a chunk of each array,
    and its rank file), which the 8 ranks now on its old node hold. The real planning code
    and the pickled parts Comm.all_to_all sends: what a rank (both asker and holder here)
    receives, against the all-gather of every rank's list that it replaced (padded to the
    longest) and the broadcast of every rank file a rank lacked."""
    from ckpt.restore.execute import SEND_ROUND_BYTES
    from ckpt.restore.handoff import Ask, Holders, ask_holders, incoming, plan_sends
    from ckpt.store.rank_ranges import contains, ranges_of

    def dumps(obj: Any) -> int:
        return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) if obj is not None else 0

    per_node = 8
    nodes = -(-world // per_node)
    node_ranks = list(range(min(per_node, world)))  # node 0's ranks, whose disk node 1's ranks now hold

    def reach(r: int) -> Any:
        """Rank r's node's disk: the node before it in the old order (one node: every rank but r)."""
        if nodes == 1:
            return ranges_of(w for w in range(world) if w != r)
        node = (r // per_node - 1) % nodes
        return ranges_of(range(node * per_node, min(world, node * per_node + per_node)))

    views = [(reach(r), ()) for r in range(world)]
    index = Holders(views)
    needs = {r: [(f"layers.{i}.w", (r, 0)) for i in range(arrays)] for r in node_ranks}
    asks = {r: ask_holders(needs[r], lambda k: k[1][0], index.of, r)[0] for r in node_ranks}
    parts = {r: {x: Ask(SEND_ROUND_BYTES // len(by), keys) for x, keys in by.items()} for r, by in asks.items()}
    planned = {}  # per holder rank 0 asks: (its sends, its answers), from what node 0's ranks ask of it
    for x in asks[0]:
        asked = [parts[r].get(x) if r in parts else None for r in range(world)]
        planned[x] = (asked, *plan_sends(asked, lambda k: 1 << 20, SEND_ROUND_BYTES))
    got, error = incoming(asks[0], [planned[x][2][0] if x in planned else None for x in range(world)])
    sizes = 8 * world  # an int64 a rank pair, in each of the two all-to-alls
    reach = dumps((ranges_of(range(per_node)), ranges_of(())))
    h = next(iter(planned))  # rank 0 as an asker receives its holders' answers; holder h, the asks
    answers_in = sum(dumps(p[2][0]) for p in planned.values())
    asks_in = sum(dumps(a) for a in planned[h][0])
    sends = planned[h][1]

    # A rank that needs a chunk of every writer (a tensor sharded 16k ways, restored whole):
    # the holders of each, from every rank's view. Before: a scan of every rank's view per
    # writer, timed on a sample of writers and scaled up.
    def every_writer() -> list[list[int]]:
        found = Holders(views)
        return [found.of(w) for w in range(world)]

    holders_s, holders_bytes, _ = _cost(every_writer)
    sample = range(0, world, max(1, world // 64))
    t0 = time.process_time()
    for w in sample:
        [r for r, (rch, _) in enumerate(views) if contains(rch, w)]
    before_s = (time.process_time() - t0) * world / len(sample)
    return {
        "handoff_holders_s": holders_s,
        "handoff_holders_bytes": holders_bytes,
        "handoff_holders_s_before": before_s,
        "handoff_asks_sent_bytes": sum(dumps(v) for v in parts[0].values()),
        "handoff_received_bytes": asks_in + answers_in + 2 * sizes + world * reach,
        "handoff_received_bytes_before": world * dumps(needs[0]) + world * reach,
        "handoff_holder_sends": len(sends),
        "handoff_rank_files_received_bytes": rank_file_bytes,
        "handoff_rank_files_received_bytes_before": world * rank_file_bytes,
        "handoff_answers_ok": error is None and sorted(i.key for i in got) == sorted(needs[0]),
    }


def measure_listing(world: int) -> dict[str, Any]:
    """A restore's one all-gather (restore.locate.Listing): every rank's candidates to
    every rank, and the choice each rank then makes from all of them (restore.discover).

    Each rank lists a root per node of 8 ranks (3 versions), that node's replica disk (the
    same 3) and a peer copy of the next node's root (3); rank 0 also lists the remote (5
    versions, every rank's part) for every rank. `before`: each candidate's writers as a
    tuple of ranks, and every rank listing the remote, as until writers travelled as
    ranges and the remote was listed once."""
    from ckpt.restore.discover import choose_step, holdings, partial_steps, reachable_steps
    from ckpt.restore.locate import Listing
    from ckpt.store.rank_ranges import ranges_of
    from ckpt.store.versions import Candidate

    nodes = -(-world // 8)
    keys = frozenset({"data", "model", "optim", "rng"})

    remote = "s3://bucket/job"

    def listing(r: int, writers: Callable[[range], Any], everyone_lists: bool = False) -> Listing:
        node, peer = r // 8, (r // 8 + 1) % nodes
        here, there = range(node * 8, min(world, node * 8 + 8)), range(peer * 8, min(world, peer * 8 + 8))
        # one writers object per candidate, as each tier's root info gives
        cands = [Candidate(s, f"{s:032x}", world, writers(here), keys) for _ in "rr" for s in (8, 9, 10)]
        cands += [Candidate(s, f"{s:032x}", world, writers(there), keys) for s in (8, 9, 10)]
        shared = [Candidate(s, f"{s:032x}", world, writers(range(world)), keys) for s in (2, 4, 6, 8, 10)]
        places = [f"/nvme/node{node}/ckpt", f"/nvme1/node{node}/replicas", f"/nvme/node{node}/peers/{peer}"]
        if everyone_lists:
            return Listing(cands + shared, None, [*places, remote], sorted(keys), [])
        return Listing(cands, None, [*places, remote], sorted(keys), [(remote, shared if r == 0 else None)])

    sample = sorted({0, world - 1})
    sizes = [len(pickle.dumps(listing(r, ranges_of))) for r in sample]
    before = [len(pickle.dumps(listing(r, tuple, everyone_lists=True))) for r in sample]
    # all_gather_object pads every rank's bytes to the largest
    out: dict[str, Any] = {"listing_rank_bytes": max(sizes), "listing_rank_bytes_before": max(before)}
    out["listing_received_bytes"] = world * max(sizes)
    out["listing_received_bytes_before"] = world * max(before)
    found: dict[range, Any] = {}

    def ranges(ranks: range) -> Any:  # ranges_of, computed once per set, a new object per candidate
        if ranks not in found:
            found[ranks] = ranges_of(ranks)
        return tuple((lo, hi) for lo, hi in found[ranks])

    # a node's ranks list alike, but for rank 0, which lists the remote too
    per_node = [pickle.dumps(listing(n * 8 + 1, ranges)) for n in range(nodes)]
    payloads = [pickle.dumps(listing(0, ranges)), *(per_node[r // 8] for r in range(1, world))]

    def choose() -> int | None:  # as restore_newest: a strict restore, and the steps newer than the chosen
        gathered = [pickle.loads(b) for b in payloads]
        needs = frozenset(k for g in gathered for k in g.keys)
        held = holdings([g.candidates for g in gathered] + [c for g in gathered for _, c in g.shared if c])
        chosen = choose_step(held, None, frozenset(), needs)
        if chosen is not None:
            reachable_steps(held)[chosen]
        partial_steps(held)
        return chosen

    out["listing_choice_s"], out["listing_choice_bytes"], chosen = _cost(choose)
    if chosen != 10:
        raise AssertionError(f"the simulated listing chose step {chosen}, not 10")
    return out


def run_case(layout: str, world: int, arrays: int, budget_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.scale", "--case", layout, str(world), str(arrays)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        return {"layout": layout, "world": world, "arrays": arrays, "failed": f"over the {budget_s:.0f} s budget"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        why = "over the memory limit" if "MemoryError" in done.stderr else tail[:200]
        return {"layout": layout, "world": world, "arrays": arrays, "failed": why}
    res: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    return res


# --- the real 16-process job ------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _meshes(world: int) -> tuple[Any, Any]:
    """The real job's DeviceMeshes: all ranks, and 2 replicas x world/2 shards."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,)), init_device_mesh("cpu", (2, world // 2))


def _real_state(world: int, rank: int, step: int) -> dict[str, Any]:
    """A small state holding one array of each layout kind, a function of (world, rank, step)."""
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    import ckpt

    def full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{step}".encode()))
        return torch.randn(shape, generator=g)

    def rows(name: str, shape: tuple[int, ...], parts: int, i: int, cut: list[int] | None = None) -> Any:
        t = full(name, shape)
        size = -(-shape[0] // parts)
        lo, hi = (cut[i], cut[i + 1]) if cut else (min(i * size, shape[0]), min((i + 1) * size, shape[0]))
        return ckpt.Shard(t[lo:hi].clone(), shape, (lo,) + (0,) * (len(shape) - 1))

    flat = 100_003
    cuts = [0, *(k * (flat // world) + (k * k * 31) % 97 for k in range(1, world)), flat]  # no common divisor
    one_d, two_d = _meshes(world)
    return {
        "dt_fsdp": distribute_tensor(full("dt_fsdp", (4099, 16)), one_d, [DShard(0)], src_data_rank=None),
        "dt_hsdp": distribute_tensor(full("dt_hsdp", (1001, 8)), two_d, [Replicate(), DShard(0)], src_data_rank=None),
        "fsdp": rows("fsdp", (4099, 16), world, rank),
        "hsdp": rows("hsdp", (1001, 8), max(1, world // 2), rank % max(1, world // 2)),
        "zero1": rows("zero1", (flat,), world, rank, cuts),
        "moe": {f"e{rank % 4}": full(f"e{rank % 4}", (64, 32))},
        "replicated": full("replicated", (257,)),
        "step": step,
    }


def real_rank(workdir: str, world: int, phase: str) -> None:
    """One rank of the real job (run under torch.distributed env vars)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ckpt

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    root = os.path.join(workdir, f"node{rank // (world // 4)}")  # 4 nodes, world/4 ranks each
    out: dict[str, Any] = {}
    with ckpt.Checkpointer(root) as ck:
        if phase == "save":
            counts = []
            for step in (1, 2, 3):
                before = ck._ctl.calls + ck._data.calls
                ck.save(step, _real_state(world, rank, step))
                ck.wait()
                counts.append(dict(ck._ctl.calls + ck._data.calls - before))
            out["calls"] = counts
        else:
            step = int(phase.split(":")[1])
            # step 13 is what the 12 ranks restored from step 3 and saved again: step 3's values
            want = _real_state(world, rank, step - 10 if step > 10 else step)
            got = {k: v for k, v in _real_state(world, rank, 99).items()}
            got["moe"] = {k: torch.zeros_like(v) for k, v in want["moe"].items()}
            restored = ck.restore(got, step=step)
            same = restored == step
            for key in ("fsdp", "hsdp", "zero1"):
                same = same and torch.equal(
                    got[key].local_tensor.view(torch.int32), want[key].local_tensor.view(torch.int32)
                )
            for key in ("dt_fsdp", "dt_hsdp"):
                same = same and torch.equal(
                    got[key].to_local().view(torch.int32), want[key].to_local().view(torch.int32)
                )
            same = same and all(torch.equal(got["moe"][k], v) for k, v in want["moe"].items())
            same = same and torch.equal(got["replicated"], want["replicated"])
            out["bitwise"] = bool(same)
            ck.save(step + 10, got)
            ck.wait()
    with open(os.path.join(workdir, f"{phase.replace(':', '_')}.{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _launch_real(workdir: str, world: int, phase: str) -> list[dict[str, Any]]:
    from ckpt._job_store import job_store

    store, rendezvous = job_store(world)
    procs = []
    for rank in range(world):
        per_node = str(world // 4)
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=per_node, **rendezvous)
        env.update(LOCAL_RANK=str(rank % (world // 4)))
        env.update(OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "bench.scale", "--real-rank", workdir, str(world), phase]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env))
    codes = [p.wait(timeout=900) for p in procs]
    del store  # (served until every rank has ended)
    if any(codes):
        raise RuntimeError(f"real job {phase} at world {world} failed: exit codes {codes}")
    tag = phase.replace(":", "_")
    return [json.loads(Path(workdir, f"{tag}.{r}.json").read_text()) for r in range(world)]


def real_job(workdir: str) -> dict[str, Any]:
    """16 ranks on 4 nodes save (a root per node); 12 ranks on the same 4 nodes resume from
    step 3 and save step 13; 16 ranks resume from that."""
    t0 = time.perf_counter()
    saved = _launch_real(workdir, 16, "save")
    steady = [c for r in saved for c in r["calls"][1:]]
    collectives = ("all_reduce", "all_gather", "gather", "broadcast")
    to12 = _launch_real(workdir, 12, "restore:3")
    to16 = _launch_real(workdir, 16, "restore:13")
    return {
        "max_collectives_per_steady_save": max(sum(c.get(k, 0) for k in collectives) for c in steady),
        "max_p2p_per_steady_save": max(c.get("p2p", 0) for c in steady),
        "all_gathers_in_steady_saves": sum(c.get("all_gather", 0) for c in steady),
        "resume_16_12_16_bitwise": all(r["bitwise"] for r in to12 + to16),
        "seconds": time.perf_counter() - t0,
    }


# --- report -----------------------------------------------------------------------------


def targets(cases: list[dict[str, Any]], real: dict[str, Any] | None, top: int) -> list[dict[str, Any]]:
    out = []

    def add(name: str, value: Any, target: str, ok: bool) -> None:
        out.append({"name": name, "value": value, "target": target, "pass": bool(ok)})

    for layout in sorted({c["layout"] for c in cases}):
        at = next((c for c in cases if c["layout"] == layout and c["world"] == top), None)
        if at is None or "failed" in at:
            why = "not run" if at is None else at["failed"]
            add(f"{layout} @ {top} ranks", why, "every figure within target", False)
            continue
        add(f"{layout}: planning s per rank", round(at["plan_s"], 3), "<= 2 s", at["plan_s"] <= 2)
        add(
            f"{layout}: planning MB per rank", round(at["plan_bytes"] / MiB), "<= 256 MB", at["plan_bytes"] <= 256 * MiB
        )
        add(
            f"{layout}: rank 0 commit CPU s",
            round(at["rank0_commit_cpu_s"], 3),
            "<= 1 s",
            at["rank0_commit_cpu_s"] <= 1,
        )
        add(
            f"{layout}: manifest MB", round(at["manifest_bytes"] / MiB, 2), "<= 16 MB", at["manifest_bytes"] <= 16 * MiB
        )
        received = max(at["rank0_gather_bytes"], at["leader_gather_bytes"] + at["manifest_bytes"])
        add(f"{layout}: MB any rank receives per save", round(received / MiB, 2), "<= 1 MB", received <= MiB)
        add(f"{layout}: restore metadata s", round(at["restore_meta_s"], 3), "<= 0.5 s", at["restore_meta_s"] <= 0.5)
        add(
            f"{layout}: restore metadata MB",
            round(at["restore_meta_bytes"] / MiB),
            "<= 256 MB",
            at["restore_meta_bytes"] <= 256 * MiB,
        )
    listed = next((c for c in cases if c["world"] == top and "failed" not in c), None)
    if listed is not None:  # the listing exchange does not depend on the layout
        mb = listed["listing_received_bytes"] / MiB
        add(f"restore listing @ {top} ranks: MB each rank receives", round(mb, 1), "<= 32 MB", mb <= 32)
        add(
            f"restore listing @ {top} ranks: CPU s to choose",
            round(listed["listing_choice_s"], 2),
            "<= 1 s",
            listed["listing_choice_s"] <= 1,
        )
        if "handoff_received_bytes" in listed:
            mb = listed["handoff_received_bytes"] / MiB
            add(
                f"restore hand-off, nodes in a new order @ {top} ranks: MB each rank receives",
                round(mb, 2),
                "<= 4 MB",
                mb <= 4 and listed["handoff_answers_ok"],
            )
        if "handmade_rank0_received_bytes" in listed:
            mb = listed["handmade_rank0_received_bytes"] / MiB
            add(
                f"hand-made shards of every array @ {top} ranks: MB rank 0 receives", round(mb, 1), "<= 32 MB", mb <= 32
            )
            add(
                f"hand-made shards of every array @ {top} ranks: the busiest owner's planning s",
                round(listed["handmade_owner_plan_s"], 2),
                "<= 2 s",
                listed["handmade_owner_plan_s"] <= 2,
            )
        if "handoff_holders_s" in listed:
            add(
                f"restore hand-off @ {top} ranks: CPU s to find the holders of every writer",
                round(listed["handoff_holders_s"], 3),
                "<= 0.5 s",
                listed["handoff_holders_s"] <= 0.5,
            )
    zero = [c for c in cases if c["layout"] == "zero1" and "failed" not in c]
    if zero:
        worst = max(c["chunks_over_bound"] for c in zero)
        add("zero1: chunks / (regions + bytes/16 MiB), worst array", round(worst, 3), "<= 1", worst <= 1)
        ms = max(c["arbitrary_ms_per_array"] for c in zero)
        add("zero1: planning ms per array (largest world)", round(ms, 2), "<= 10 ms", ms <= 10)
    if real is not None:
        add(
            "real 16 ranks: collectives per steady save",
            real["max_collectives_per_steady_save"],
            "<= 4",
            real["max_collectives_per_steady_save"] <= 4,
        )
        add(
            "real 16 -> 12 -> 16 resume bitwise",
            real["resume_16_12_16_bitwise"],
            "true",
            real["resume_16_12_16_bitwise"],
        )
    return out


def markdown(cases: list[dict[str, Any]], tg: list[dict[str, Any]], real: dict[str, Any] | None) -> str:
    lines = ["# Scale: metadata path, simulated (real code, synthetic layouts)", ""]
    lines += [
        "| layout | ranks | chunks | writer runs | plan s | plan MB | plan sent KB | rank 0 commit s | manifest MB | rank 0 gathers MB | restore meta s | restore meta MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in sorted(cases, key=lambda c: (c["layout"], c["world"])):
        if "failed" in c:
            lines.append(f"| {c['layout']} | {c['world']} | {c['failed']} | | | | | | | | | |")
            continue
        lines.append(
            f"| {c['layout']} | {c['world']} | {c['chunks']} | {c['writer_runs']} | {c['plan_s']:.2f} | "
            f"{c['plan_bytes'] / MiB:.0f} | {c['plan_broadcast_bytes'] / 1024:.0f} | "
            f"{c['rank0_commit_cpu_s']:.2f} | {c['manifest_bytes'] / MiB:.1f} | {c['rank0_gather_bytes'] / MiB:.1f} | "
            f"{c['restore_meta_s']:.2f} | {c['restore_meta_bytes'] / MiB:.0f} |"
        )
    lines += [
        "",
        "## A restore's listing exchange",
        "",
        "Every rank all-gathers what its tiers hold (restore.locate.Listing: a root per node of 8 ranks, its",
        "replica disk and a peer copy, 3 versions each; rank 0 also the remote's 5, for every rank), then",
        "chooses from every rank's (restore.discover). Before: each candidate's writers as a tuple of ranks,",
        "and every rank listing the remote.",
        "",
        "| ranks | bytes a rank sends | MB each rank receives | before: bytes a rank sends | before: MB each receives | CPU s to choose | MB to choose |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    seen: set[int] = set()
    for c in sorted(cases, key=lambda c: c["world"]):
        if "failed" in c or c["world"] in seen:
            continue
        seen.add(c["world"])
        lines.append(
            f"| {c['world']} | {c['listing_rank_bytes']} | {c['listing_received_bytes'] / MiB:.1f} | "
            f"{c['listing_rank_bytes_before']} | {c['listing_received_bytes_before'] / MiB:.1f} | "
            f"{c['listing_choice_s']:.2f} | {c['listing_choice_bytes'] / MiB:.0f} |"
        )
    lines += [
        "",
        "## A restore's hand-off",
        "",
        "The job resumed with its nodes in a new order, a root per node of 8 ranks: every rank lacks its",
        "part (a chunk of each array, the arrays of the case, and its rank file), held by the 8 ranks now",
        "on its old node (restore.handoff's real planning; the parts pickled as Comm.all_to_all sends them).",
        "A rank both asks and holds. Before: every rank's list all-gathered (padded to the longest), and",
        "every rank file a rank lacked broadcast to every rank.",
        "",
        "The holders: CPU seconds for a rank that needs a chunk of every writer to find who reaches",
        "each (restore.handoff.Holders); before, a scan of every rank's view per writer (timed on 64",
        "writers, scaled up).",
        "",
        "| ranks | asks a rank sends KB | MB each rank receives | before: MB | rank files received MB | before: MB "
        "| holders CPU s | before: s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    seen = set()
    for c in sorted(cases, key=lambda c: c["world"]):
        if "failed" in c or c["world"] in seen or "handoff_received_bytes" not in c:
            continue
        seen.add(c["world"])
        lines.append(
            f"| {c['world']} | {c['handoff_asks_sent_bytes'] / 1024:.0f} | {c['handoff_received_bytes'] / MiB:.2f} | "
            f"{c['handoff_received_bytes_before'] / MiB:.0f} | {c['handoff_rank_files_received_bytes'] / MiB:.2f} | "
            f"{c['handoff_rank_files_received_bytes_before'] / MiB:.0f} | "
            f"{c.get('handoff_holders_s', float('nan')):.3f} | {c.get('handoff_holders_s_before', float('nan')):.1f} |"
        )
    lines += ["", "## Targets", "", "| target | value | goal | pass |", "| --- | --- | --- | --- |"]
    lines += [f"| {t['name']} | {t['value']} | {t['target']} | {'yes' if t['pass'] else 'NO'} |" for t in tg]
    if real is not None:
        lines += ["", f"Real gloo job: {json.dumps(real)}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="8,64,512,2048,16384")
    ap.add_argument("--arrays", type=int, default=1000)
    ap.add_argument("--layouts", default="fsdp,hsdp,tp_fsdp,zero1,moe")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--no-real", action="store_true", help="skip the real 16-process job")
    ap.add_argument(
        "--reuse-sim",
        action="store_true",
        help="take the simulated cases from bench/results/scale.json; run the real job",
    )
    ap.add_argument("--workdir", default="/tmp/ckpt-scale")
    ap.add_argument("--case", nargs=3, metavar=("LAYOUT", "WORLD", "ARRAYS"), help=argparse.SUPPRESS)
    ap.add_argument("--real-rank", nargs=3, metavar=("DIR", "WORLD", "PHASE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        print(json.dumps(measure(args.case[0], int(args.case[1]), int(args.case[2]))))
        return
    if args.real_rank:
        real_rank(args.real_rank[0], int(args.real_rank[1]), args.real_rank[2])
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    cases = json.loads((RESULTS / "scale.json").read_text())["cases"] if args.reuse_sim else []
    for layout in [] if args.reuse_sim else args.layouts.split(","):
        for world in worlds:
            res = run_case(layout, world, args.arrays, args.budget_s)
            print(json.dumps(res), flush=True)
            cases.append(res)
            if "failed" in res:
                break  # the larger worlds of this layout would only fail slower
    real = None
    if not args.no_real:
        import shutil

        shutil.rmtree(args.workdir, ignore_errors=True)
        os.makedirs(args.workdir)
        real = real_job(args.workdir)
        print(json.dumps(real), flush=True)
    tg = targets(cases, real, max(worlds))
    RESULTS.mkdir(exist_ok=True)
    doc = {"cases": cases, "real": real, "targets": tg, "arrays": args.arrays}
    (RESULTS / "scale.json").write_text(json.dumps(doc, indent=1) + "\n")
    (RESULTS / "scale.md").write_text(markdown(cases, tg, real))
    print(markdown(cases, tg, real))


if __name__ == "__main__":
    main()
