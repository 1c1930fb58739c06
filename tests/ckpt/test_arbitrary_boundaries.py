"""Shards cut at arbitrary boundaries (ZeRO-1 / Megatron distributed-optimizer flat buffers,
uneven hand-made row and column splits): a bounded number of chunk files, bitwise restores.

Before store.layout bounded its grids, the chunk size was the gcd of every boundary: a
1-D tensor of 10,000,019 elements cut at boundaries with no common divisor became one
chunk (one file) per element or two. Now such an array has at most
regions + bytes / GRID_BYTES chunks; a chunk that straddles two ranks' regions is
written by one of them, with its neighbours' parts sent over the job's group.

Real gloo jobs: 4 ranks save (twice, the second save reusing the plan and the exchange),
then 4, 3 and 1 ranks restore onto other arbitrary layouts and compare bitwise.
"""

from __future__ import annotations

import datetime
import math
import os
import random
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import launch
from tests._states import bitwise_diff

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=60)
FLAT = 10_000_019  # float32: a 40 MB flat optimizer buffer
PARAMS = [(4099, 13), (7,), (100_003,), (1, 5, 3), (333_333,), (2, 2)]  # packed into a ZeRO flat buffer


def source(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


def cuts(n: int, world: int, seed: int) -> list[int]:
    """`world` contiguous pieces of [0, n) cut at random points (no common divisor, as a rule)."""
    rnd = random.Random(seed)
    inner = sorted(rnd.sample(range(1, n), world - 1)) if world > 1 else []
    return [0, *inner, n]


def piece(full: torch.Tensor, dim: int, bounds: list[int], rank: int) -> Any:
    import ckpt

    lo, hi = bounds[rank], bounds[rank + 1]
    index = [slice(None)] * full.dim()
    index[dim] = slice(lo, hi)
    offsets = [0] * full.dim()
    offsets[dim] = lo
    return ckpt.Shard(full[tuple(index)].clone(), tuple(full.shape), tuple(offsets))


def zero_params(world: int, rank: int, seed: int, fill: Any) -> dict[str, Any]:
    """Each parameter's piece as a ZeRO-1 flat buffer partition gives it: the buffer (all
    parameters flattened, packed) is cut into `world` ranges; a rank holds each parameter's
    intersection with its range (a 1-D view of the flattened parameter)."""
    sizes = [math.prod(s) for s in PARAMS]
    total = sum(sizes)
    bounds = cuts(total, world, seed)
    lo, hi = bounds[rank], bounds[rank + 1]
    out: dict[str, Any] = {}
    start = 0
    import ckpt

    for i, n in enumerate(sizes):
        a, b = max(lo, start), min(hi, start + n)
        full = fill(f"p{i}", torch.float32, (n,))
        if a >= b:  # a rank that holds nothing of a parameter has an empty piece of it
            a = b = start
        out[f"p{i}"] = ckpt.Shard(full[a - start : b - start].clone(), (n,), (a - start,))
        start += n
    return out


def layout(world: int, rank: int, seed: int, fill: Any) -> dict[str, Any]:
    """The state of `rank` in a job of `world` ranks; `seed` picks the boundaries."""
    flat = fill("flat", torch.float32, (FLAT,))
    rows = fill("rows", torch.bfloat16, (1001, 67))
    cols = fill("cols", torch.int64, (64, 1001))
    return {
        "flat": piece(flat, 0, cuts(FLAT, world, seed), rank),
        "rows": piece(rows, 0, cuts(1001, world, seed + 1), rank),
        "cols": piece(cols, 1, cuts(1001, world, seed + 2), rank),
        "zero": zero_params(world, rank, seed + 3, fill),
    }


def _garbage(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The source's bitwise complement: an element that restore leaves alone is caught."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    return torch.bitwise_not(source(name, dtype, shape).view(as_int)).view(dtype)


def save_job(ctx: Any, root: str) -> dict[str, Any]:
    import ckpt
    from ckpt.store.errors import CkptError

    state = layout(ctx.world, ctx.rank, seed=1, fill=source)
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        ck.save(1, state)
        ck.wait()
        state["flat"].local_tensor.add_(1)  # the second save reuses the plan: it must send new values
        ck.save(2, state)
        ck.wait()
        sent = ck._saver._exchange  # type: ignore[attr-defined]
        # Ctrl-C in rank 1's staging copy: every rank's save fails, none waits in the exchange.
        if ctx.rank == 1:
            os.environ["CKPT_INTERRUPT"] = "stage:1:1"
        failed = []
        try:
            ck.save(3, state)
        except KeyboardInterrupt:
            failed.append("interrupted")
        finally:
            os.environ.pop("CKPT_INTERRUPT", None)
        try:
            ck.wait()
        except CkptError as e:
            failed.append(type(e).__name__)
        ctx.check(failed and ck.steps() == [1, 2], f"step 3 after an interrupted copy: {failed}, {ck.steps()}")
    # Bounded staging (batches written in save()) with writes overlapping the copy: the
    # exchanged chunks all go in the last batch.
    state["flat"].local_tensor.add_(1)
    with ckpt.Checkpointer(root, timeout=TIMEOUT, max_staging_bytes=1 << 20, overlap_writes=True) as ck:
        ck.save(3, state)
        ck.wait()
    return {"sends": len(sent.sends), "recvs": len(sent.recvs)}


def restore_job(ctx: Any, root: str, seed: int) -> None:
    import ckpt

    for step in (1, 2, 3):
        target = layout(ctx.world, ctx.rank, seed=seed, fill=_garbage)
        with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
            got = ck.restore(target, step=step)
        ctx.check(got == step, f"restored step {got}, expected {step}")
        _compare(ctx, target, step, seed)


def _compare(ctx: Any, target: dict[str, Any], step: int, seed: int) -> None:
    want = layout(ctx.world, ctx.rank, seed=seed, fill=source)
    for _ in range(step - 1):  # as the saving job did: (x + 1) + 1 is not always x + 2
        want["flat"].local_tensor.add_(1)
    for key in ("flat", "rows", "cols"):
        ctx.check(
            not bitwise_diff(target[key].local_tensor, want[key].local_tensor),
            f"step {step}: {key} at {target[key].offsets} differs",
        )
    for name, shard in target["zero"].items():
        ctx.check(
            not bitwise_diff(shard.local_tensor, want["zero"][name].local_tensor), f"step {step}: zero/{name} differs"
        )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    base = tmp_path_factory.mktemp("arbitrary")
    results, failures = launch(THIS, "save_job", 4, base, timeout=240, root=str(base / "root"))
    assert not failures, failures
    return base / "root", results


def test_chunk_files_are_bounded_and_exchange_happens(saved: tuple[Path, list[Any]]) -> None:
    from ckpt.store.layout import GRID_BYTES
    from ckpt.store.manifest import MANIFEST_NAME, parse_manifest
    from ckpt.store.versions import version_dirname

    root, results = saved
    assert sum(r["sends"] for r in results) == sum(r["recvs"] for r in results) > 0
    version = root / version_dirname(2)
    m = parse_manifest((version / MANIFEST_NAME).read_bytes())
    for name, a in m.arrays.items():
        regions = a.sharding["pieces"]  # the regions the ranks held (empty ones are none)
        bound = regions + math.ceil(a.nbytes / GRID_BYTES)
        files = list((version / "state" / name).glob("c*"))
        inline = all(c.inline is not None for c in a.iter_chunks())
        assert a.chunk_count <= bound and (inline or len(files) == a.chunk_count), (name, a.chunk_count, bound)
    # The arrays cut at arbitrary points did not fall back to the old one-chunk-per-gcd grid.
    assert m.arrays["flat"].chunk_count <= 4 + math.ceil(FLAT * 4 / GRID_BYTES)
    assert m.arrays["rows"].chunk_count < 1001 and m.arrays["cols"].chunk_count < 1001


@pytest.mark.parametrize("world,seed", [(4, 1), (4, 7), (3, 11), (1, 0)], ids=["4same", "4other", "3", "1"])
def test_restore_bitwise(saved: tuple[Path, list[Any]], tmp_path: Path, world: int, seed: int) -> None:
    root, _ = saved
    _, failures = launch(THIS, "restore_job", world, tmp_path, timeout=240, root=str(root), seed=seed)
    assert not failures, failures


def deferred_job(ctx: Any, root: str) -> None:
    """A ZeRO-style Parameter cut at 3 of 1001, owned by an optimizer, saved with deferred
    staging: rank 0's 3 elements are a sliver of rank 1's chunk. (Before the fix the sliver
    was never copied: the version held whatever the staging buffer held, checksummed.)"""
    import ckpt

    n = 1001
    cut = [0, 3, n][ctx.rank : ctx.rank + 2]
    full = torch.arange(n, dtype=torch.float32) + 1
    w = torch.nn.Parameter(full[cut[0] : cut[1]].clone())
    opt = torch.optim.SGD([w], lr=0.1)
    with ckpt.Checkpointer(root, timeout=TIMEOUT, deferred_staging=True) as ck:
        ck.save(1, {"w": ckpt.Shard(w, (n,), (cut[0],)), "optim": opt})
        ck.wait()
        ctx.check(ck._saver._exchange.sends or ck._saver._exchange.recvs, "no sliver crossed")  # type: ignore[attr-defined]
    got = torch.zeros(cut[1] - cut[0])
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        ck.restore({"w": ckpt.Shard(got, (n,), (cut[0],))}, step=1, strict=False)
    ctx.check(torch.equal(got, full[cut[0] : cut[1]]), f"restored {got[:4].tolist()}")


def test_deferred_staging_sends_copied_slivers(tmp_path: Path) -> None:
    _, failures = launch(THIS, "deferred_job", 2, tmp_path, timeout=120, root=str(tmp_path / "root"))
    assert not failures, failures


def exchange_buffers_fail(ctx: Any, root: str) -> None:
    """Rank 1 cannot allocate the buffer for the sliver it receives (out of memory) at the
    first save of the layout; then both save again."""
    import sys

    import ckpt

    n = 1001
    cut = [0, 3, n][ctx.rank : ctx.rank + 2]
    full = torch.arange(n, dtype=torch.float32) + 1
    w = full[cut[0] : cut[1]].clone()
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if sys._getframe(1).f_globals.get("__name__") == "ckpt._exchange":
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 12 bytes")
        return real(*args, **kwargs)

    # A timeout far beyond the test's: waiting for it is the failure.
    with ckpt.Checkpointer(root, timeout=datetime.timedelta(seconds=900)) as ck:
        if ctx.rank == 1:
            torch.empty = empty  # type: ignore[assignment]
        try:
            ck.save(1, {"w": ckpt.Shard(w, (n,), (cut[0],))})
            ck.wait()
            ctx.check(False, "the save went through")
        except ckpt.CkptError as e:
            told = [str(e), *map(str, getattr(e, "causes", {}).values())]
            ctx.check(any("can't allocate" in t for t in told), f"raised {e!r}")
        except RuntimeError as e:
            ctx.check(ctx.rank == 1 and "can't allocate" in str(e), f"raised {e!r}")
        finally:
            torch.empty = real  # type: ignore[assignment]
        ck.save(2, {"w": ckpt.Shard(w, (n,), (cut[0],))})
        ck.wait()
        ctx.check(ck.steps() == [2], f"steps {ck.steps()}")
    got = torch.zeros(cut[1] - cut[0])
    with ckpt.Checkpointer(root, timeout=TIMEOUT) as ck:
        ck.restore({"w": ckpt.Shard(got, (n,), (cut[0],))}, step=2)
    ctx.check(torch.equal(got, full[cut[0] : cut[1]]), f"restored {got[:4].tolist()}")


def test_a_rank_that_cannot_allocate_its_exchange_buffer_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    """Before, the rank failed in the exchange before posting its part, and the other rank
    waited for it until the Checkpointer's timeout (here 900 s: the test's 120 s end first)."""
    _, failures = launch(THIS, "exchange_buffers_fail", 2, tmp_path, timeout=120, root=str(tmp_path / "root"))
    assert not failures, failures
