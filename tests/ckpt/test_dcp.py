"""ckpt.dcp: torch.distributed.checkpoint (DCP) saving to and loading from ckpt versions.

Real DCP (`dcp.save`, `dcp.async_save`, `dcp.load` with their default planners), real
gloo ranks with DTensors, real files; `ckpt verify` and `ckpt ls` run on what DCP saved.
"""

from __future__ import annotations

import datetime
import glob
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import ckpt.dcp
from ckpt import Checkpointer
from ckpt.cli import main as cli
from ckpt.store.errors import CorruptVersionError, UnsupportedStateError, VersionNotFoundError
from ckpt.store.pins import pinned_steps
from ckpt.store.versions import as_tier
from tests._dist import in_private_mounts, launch

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=60)


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer, epoch: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"epoch": epoch, "tag": f"run-{epoch}"}}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _verify(root: Path) -> None:
    out = CliRunner().invoke(cli, ["verify", str(root)])
    assert out.exit_code == 0, out.output


def test_save_verify_load_bitwise(tmp_path: Path) -> None:
    """dcp.save through ckpt is a committed ckpt version that `ckpt verify` accepts and
    dcp.load restores bitwise: parameters, buffers, optimizer state, non-tensor items."""
    root = tmp_path / "root"
    saved = _state(*_trained(0), epoch=7)
    dcp.save(saved, storage_writer=ckpt.dcp.StorageWriter(str(root), 100), no_dist=True)
    assert (root / "v000000000100" / "manifest.json").exists()
    _verify(root)
    listed = CliRunner().invoke(cli, ["ls", str(root)])
    assert listed.exit_code == 0 and "100" in listed.output, listed.output
    target = _state(*_trained(1), epoch=0)  # same structure, other values
    assert not _same(target, saved)
    reader = ckpt.dcp.StorageReader(str(root))
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert reader.step == 100
    assert _same(target, saved)


def test_async_save_through_ckpt(tmp_path: Path) -> None:
    root = tmp_path / "root"
    saved = _state(*_trained(2), epoch=3)
    fut = dcp.async_save(saved, storage_writer=ckpt.dcp.StorageWriter(str(root), 5), no_dist=True)
    fut.result(timeout=120)
    _verify(root)
    target = _state(*_trained(3), epoch=0)
    dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root), step=5), no_dist=True)
    assert _same(target, saved)


class _Touches:
    """Pickles as a call of Path.touch(marker): what a hostile checkpoint's non-tensor item
    could run on load, here harmless and visible."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (self.marker,))


def test_a_non_tensor_item_that_would_run_code_loads_only_when_trusted(tmp_path: Path) -> None:
    """DCP unpickles non-tensor items with weights_only=False. The reader first gives each to
    torch's weights-only unpickler: plain values load as ever; an item whose pickle names
    code is UnsupportedStateError, nothing of the state is touched and the code never runs,
    unless the reader is told to trust the root."""
    root, marker = tmp_path / "root", tmp_path / "ran"
    saved = _state(*_trained(0), epoch=7)
    dcp.save({**saved, "hostile": _Touches(marker)}, storage_writer=ckpt.dcp.StorageWriter(str(root), 1), no_dist=True)
    assert not marker.exists()
    target = _state(*_trained(1), epoch=0)
    dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root)), no_dist=True)  # plain values: no trust needed
    assert _same(target, saved) and not marker.exists()
    target = {**_state(*_trained(1), epoch=0), "hostile": None}
    before = {k: v.clone() for k, v in target["model"].items()}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root)), no_dist=True)
    errors = [e for e, _ in info.value.failures.values()]
    assert any(isinstance(e, UnsupportedStateError) and "hostile" in str(e) for e in errors), errors
    assert not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in target["model"].items())  # untouched
    dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root), trust=True), no_dist=True)
    assert marker.exists() and _same(target["model"], saved["model"])  # trusted: DCP's own unpickling ran it


def _failures(e: CheckpointException) -> list[BaseException]:
    return [x[0] if isinstance(x, tuple) else x for x in e.failures.values()]  # (error, its traceback)


def test_a_load_with_no_version_to_read_fails_with_ckpts_type(tmp_path: Path) -> None:
    """DCP catches an error of read_metadata and raises an AssertionError with its message:
    before, a load from a root with no version (or without the step asked for) failed with
    AssertionError in CheckpointException.failures; now with VersionNotFoundError."""
    root = tmp_path / "root"
    root.mkdir()
    target = _state(*_trained(8), epoch=0)
    with pytest.raises(CheckpointException) as empty:
        dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root)), no_dist=True)
    assert [type(x) for x in _failures(empty.value)] == [VersionNotFoundError], _failures(empty.value)
    dcp.save(_state(*_trained(7), epoch=4), storage_writer=ckpt.dcp.StorageWriter(str(root), 1), no_dist=True)
    with pytest.raises(CheckpointException) as missing:
        dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root), step=2), no_dist=True)
    assert [type(x) for x in _failures(missing.value)] == [VersionNotFoundError], _failures(missing.value)
    assert "step 2" in str(_failures(missing.value)[0])


def test_reader_takes_the_newest_intact_version(tmp_path: Path) -> None:
    """With no step, the newest version whose manifest reads is chosen; a damaged newer one
    is passed over for the next older one."""
    root = tmp_path / "root"
    one, two = _state(*_trained(4), epoch=1), _state(*_trained(5), epoch=2)
    dcp.save(one, storage_writer=ckpt.dcp.StorageWriter(str(root), 1), no_dist=True)
    dcp.save(two, storage_writer=ckpt.dcp.StorageWriter(str(root), 2), no_dist=True)
    target = _state(*_trained(6), epoch=0)
    dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root)), no_dist=True)
    assert _same(target, two)
    manifest = root / "v000000000002" / "manifest.json"
    raw = bytearray(manifest.read_bytes())
    raw[len(raw) // 2] ^= 0x20
    manifest.write_bytes(bytes(raw))
    target = _state(*_trained(6), epoch=0)
    reader = ckpt.dcp.StorageReader(str(root))
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert reader.step == 1 and _same(target, one)


def test_a_failed_load_or_save_leaves_the_root_usable(tmp_path: Path) -> None:
    """DCP calls nothing more on a storage layer once its planning fails (here: a key the
    version lacks), or once reset() refuses a checkpoint_id: what the reader or writer
    opened must not stay open. Before, the root stayed locked for the rest of the process
    (every later load or save: RootLockedError) and the version stayed pinned against GC."""
    root = tmp_path / "root"
    saved = _state(*_trained(7), epoch=4)
    dcp.save(saved, storage_writer=ckpt.dcp.StorageWriter(str(root), 1), no_dist=True)
    lacking = {**_state(*_trained(8), epoch=0), "other": {"w": torch.zeros(2)}}
    with pytest.raises(CheckpointException, match="Missing key"):
        dcp.load(lacking, storage_reader=ckpt.dcp.StorageReader(str(root)), no_dist=True)
    target = _state(*_trained(8), epoch=0)
    dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root)), no_dist=True)  # the retry
    assert _same(target, saved)
    with pytest.raises(ValueError, match="checkpoint_id"):
        dcp.save(
            saved, checkpoint_id=str(tmp_path / "x"), storage_writer=ckpt.dcp.StorageWriter(str(root), 2), no_dist=True
        )
    again = _state(*_trained(9), epoch=5)
    dcp.save(again, storage_writer=ckpt.dcp.StorageWriter(str(root), 2), no_dist=True)
    with Checkpointer(str(root)) as ck:  # an open Checkpointer (as torchtitan's manager holds one)
        with pytest.raises(CheckpointException, match="Missing key"):
            dcp.load(lacking, storage_reader=ckpt.dcp.StorageReader(str(root), checkpointer=ck), no_dist=True)
        assert pinned_steps(as_tier(str(root))) == set()  # GC may delete it again
        target = _state(*_trained(8), epoch=0)
        dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root), checkpointer=ck), no_dist=True)
        assert _same(target, again)


class _FailsToPlan(dcp.DefaultSavePlanner):
    """A save planner that fails on the ranks named: DCP then fails the save on every rank
    and calls nothing more on the storage writer."""

    def __init__(self, ranks: tuple[int, ...] = (0,)) -> None:
        super().__init__()
        self.ranks = ranks

    def create_local_plan(self) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank in self.ranks:
            raise RuntimeError("the planner broke")
        return super().create_local_plan()


def test_a_save_whose_planning_failed_does_not_hold_the_root(tmp_path: Path) -> None:
    """Before, the writer's Checkpointer stayed open after DCP's planning failed, so the retry
    raised RootLockedError for the rest of the process."""
    root = tmp_path / "root"
    saved = _state(*_trained(7), epoch=4)
    with pytest.raises(CheckpointException, match="the planner broke"):
        dcp.save(saved, storage_writer=ckpt.dcp.StorageWriter(str(root), 1), planner=_FailsToPlan(), no_dist=True)
    dcp.save(saved, storage_writer=ckpt.dcp.StorageWriter(str(root), 1), no_dist=True)  # the retry
    _verify(root)
    target = _state(*_trained(8), epoch=0)
    dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root)), no_dist=True)
    assert _same(target, saved)
    # An async_save plans on DCP's executor thread: close() releases what its writer opened.
    writer = ckpt.dcp.StorageWriter(str(root), 2)
    fut = dcp.async_save(saved, storage_writer=writer, planner=_FailsToPlan(), no_dist=True)
    with pytest.raises(CheckpointException, match="the planner broke"):
        fut.result(timeout=120)
    writer.close()
    dcp.save(saved, storage_writer=ckpt.dcp.StorageWriter(str(root), 2), no_dist=True)
    with Checkpointer(str(root)) as ck:
        assert ck.steps() == [1, 2]


class _BrokenStateful:
    """A Stateful whose state_dict() raises: DCP's save fails before it calls the writer."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("the loader's state_dict broke")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_a_writer_dropped_after_a_save_failed_before_using_it_does_not_hold_the_root(tmp_path: Path) -> None:
    """A save that fails before DCP calls its writer (a Stateful's state_dict() raising)
    leaves the writer unused; once the caller no longer holds it, the next writer for that
    root closes what it opened. Before, every later writer for the root raised
    RootLockedError for the rest of the process unless the caller had kept the old writer
    to close() it."""
    root = tmp_path / "root"
    saved = _state(*_trained(7), epoch=4)
    with pytest.raises(RuntimeError, match="state_dict broke"):
        dcp.save(
            {**saved, "loader": _BrokenStateful()}, storage_writer=ckpt.dcp.StorageWriter(str(root), 1), no_dist=True
        )
    dcp.save(saved, storage_writer=ckpt.dcp.StorageWriter(str(root), 1), no_dist=True)  # the retry
    target = _state(*_trained(8), epoch=0)
    dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root)), no_dist=True)
    assert _same(target, saved)
    # A writer the caller still holds is not taken for abandoned: it may still be used.
    kept = ckpt.dcp.StorageWriter(str(root), 2)
    from ckpt.store.errors import RootLockedError

    with pytest.raises(RootLockedError):
        ckpt.dcp.StorageWriter(str(root), 2)
    dcp.save(saved, storage_writer=kept, no_dist=True)
    with Checkpointer(str(root)) as ck:
        assert ck.steps() == [1, 2]


def planning_fails_on_one_rank(ctx: Any, root: str) -> dict[str, Any]:
    """Rank 1's planner fails; both ranks then save again with new writers."""
    state = {"w": _full(f"w{ctx.rank}", (4, 3)), "step": 3}
    try:
        dcp.save(state, storage_writer=ckpt.dcp.StorageWriter(root, 3, timeout=TIMEOUT), planner=_FailsToPlan((1,)))
        ctx.check(False, "the save went through")
    except CheckpointException as e:
        ctx.check("the planner broke" in str(e), f"raised {e}")
    dcp.save(state, storage_writer=ckpt.dcp.StorageWriter(root, 3, timeout=TIMEOUT))
    return {}


def test_a_save_whose_planning_failed_on_one_rank_is_retried_on_two(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    _, failures = launch(THIS, "planning_fails_on_one_rank", 2, tmp_path / "job", timeout=180, root=root)
    assert not failures, failures
    _verify(Path(root))
    with Checkpointer(root) as ck:
        assert ck.steps() == [3]


def _damage_a_chunk(root: Path, step: int, tensor: str) -> None:
    """Flip one bit in the middle of the largest chunk file of `tensor` (a path under tensors/)."""
    pattern = str(root / f"v{step:012d}" / "state" / "tensors" / tensor / "c*")
    path = max(glob.glob(pattern), key=os.path.getsize)
    raw = bytearray(Path(path).read_bytes())
    raw[len(raw) // 2] ^= 0x10
    Path(path).write_bytes(bytes(raw))


def test_names_that_cannot_round_trip_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedStateError, match="dot-separated parts"):
        ckpt.dcp.array_name("tensors", "model..weight")
    with pytest.raises(UnsupportedStateError, match="dot-separated parts"):
        ckpt.dcp.array_name("tensors", "x" * 200 + ".w")
    with pytest.raises(UnsupportedStateError, match="dot-separated parts"):  # 128 characters once escaped
        ckpt.dcp.array_name("tensors", "__" + "a" * 125)
    assert ckpt.dcp.array_name("tensors", "__" + "a" * 124) == "tensors/%5F_" + "a" * 124
    assert ckpt.dcp.array_name("tensors", "model.layers.0.weight") == "tensors/model/layers/0/weight"


def _full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def two_ranks(ctx: Any, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world,))

    def state(fill: bool) -> dict[str, Any]:
        def make(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return _full(name, shape) if fill else torch.zeros(shape)

        return {
            "model": {
                "w": distribute_tensor(make("w", (11, 4)), mesh, [Shard(0)], src_data_rank=None),
                "v": distribute_tensor(make("v", (3, 9)), mesh, [Shard(1)], src_data_rank=None),
                "b": make("b", (5,)),  # a plain tensor every rank holds: DCP has one rank write it
            },
            "meta": {"lr": 0.5 if fill else 0.0, "name": "ok" if fill else ""},
        }

    saved = state(True)
    dcp.save(saved, storage_writer=ckpt.dcp.StorageWriter(root, 3, timeout=TIMEOUT))
    got = state(False)
    made = []
    new_group = torch.distributed.new_group

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(kwargs.get("backend"))
        return new_group(*args, **kwargs)

    torch.distributed.new_group = counted
    try:
        dcp.load(got, storage_reader=ckpt.dcp.StorageReader(root, timeout=TIMEOUT))
    finally:
        torch.distributed.new_group = new_group
    # one gloo group for each of the reader's collective calls, read_metadata and read_data
    # (each costs connections to every rank; before, two each, one unused)
    ctx.check(made == ["gloo", "gloo"], f"the load made these groups: {made}")
    for key in ("w", "v"):
        ctx.check(torch.equal(_bits(got["model"][key].to_local()), _bits(saved["model"][key].to_local())), key)
    ctx.check(torch.equal(_bits(got["model"]["b"]), _bits(saved["model"]["b"])), "b")
    ctx.check(got["meta"] == {"lr": 0.5, "name": "ok"}, f"meta {got['meta']}")
    return {}


class _Doubles(dcp.DefaultSavePlanner):
    """A planner that hands DCP other data than the state's tensors: twice their values."""

    def transform_object(self, write_item: Any, object: Any) -> Any:
        out = super().transform_object(write_item, object)
        return out * 2 if isinstance(out, torch.Tensor) else out


def dtensors_by_their_mesh(ctx: Any, root: str) -> dict[str, Any]:
    """What each rank announces on the first save of a layout, through DCP: a DTensor's
    pieces follow from its mesh, so no rank lists a region of one (before, every rank listed
    its piece of every DTensor, ranks x tensors at rank 0). A planner that transforms the
    data makes every rank store the pieces as DCP planned them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ckpt._plan

    mesh = init_device_mesh("cpu", (ctx.world,))
    announced: list[tuple[int, int]] = []  # (listed regions, meshed arrays) per first save
    announce = ckpt._plan.announce

    def counting(rank: int, pieces: Any, speaks: bool) -> Any:
        got = announce(rank, pieces, speaks)
        announced.append((len(got.listed), len(got.meshed)))
        return got

    ckpt._plan.announce = counting  # type: ignore[assignment]

    def state(tag: str) -> dict[str, Any]:
        def make(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return _full(name + tag, shape) if tag else torch.zeros(shape)

        return {
            "w": distribute_tensor(make("w", (11, 4)), mesh, [Shard(0)], src_data_rank=None),
            "v": distribute_tensor(make("v", (3, 9)), mesh, [Shard(1)], src_data_rank=None),
            "r": distribute_tensor(make("r", (6,)), mesh, [Replicate()], src_data_rank=None),
        }

    saved = state("1")
    dcp.save(saved, storage_writer=ckpt.dcp.StorageWriter(root, 1, timeout=TIMEOUT))
    later = state("3")  # async_save stages a copy of the state first: still DTensors, the same layout
    dcp.async_save(later, storage_writer=ckpt.dcp.StorageWriter(root, 3, timeout=TIMEOUT)).result(timeout=120)
    doubled = state("2")
    dcp.save(doubled, storage_writer=ckpt.dcp.StorageWriter(root, 2, timeout=TIMEOUT), planner=_Doubles())
    for step, want, factor in ((1, saved, 1), (3, later, 1), (2, doubled, 2)):
        got = state("")
        dcp.load(got, storage_reader=ckpt.dcp.StorageReader(root, step=step, timeout=TIMEOUT))
        for key in want:
            ctx.check(
                torch.equal(_bits(got[key].to_local()), _bits(want[key].to_local() * factor)), f"step {step} {key}"
            )
    return {"announced": announced}


def test_dtensors_saved_through_dcp_are_planned_from_their_mesh(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    results, failures = launch(THIS, "dtensors_by_their_mesh", 2, tmp_path / "job", timeout=180, root=root)
    assert not failures, failures
    first, staged, doubled = zip(*(r["announced"] for r in results))
    assert [tuple(x) for x in first] == [(0, 3), (0, 0)]  # rank 0 leads the mesh of the 3 DTensors
    assert [tuple(x) for x in staged] == [(0, 3), (0, 0)]  # async_save's staged copy: still DTensors
    # The doubling planner's save: each rank lists its pieces of w and v, and one of them r's
    # (DCP has one rank write a replicated piece).
    assert sorted(tuple(x) for x in doubled) == [(2, 0), (3, 0)]
    _verify(Path(root))


def test_two_ranks_then_resharded_to_one(tmp_path: Path) -> None:
    """2 gloo ranks save DTensors (uneven rows, columns), a replicated tensor and plain
    values through DCP; they load it back bitwise; one process then loads it through
    dcp.load into whole tensors (resharded 2 -> 1)."""
    root = str(tmp_path / "root")
    _, failures = launch(THIS, "two_ranks", 2, tmp_path / "job", timeout=180, root=root)
    assert not failures, failures
    _verify(Path(root))
    whole: dict[str, Any] = {
        "model": {"w": torch.zeros(11, 4), "v": torch.zeros(3, 9), "b": torch.zeros(5)},
        "meta": {"lr": 0.0, "name": ""},
    }
    dcp.load(whole, storage_reader=ckpt.dcp.StorageReader(root), no_dist=True)
    for key, shape in (("w", (11, 4)), ("v", (3, 9)), ("b", (5,))):
        assert torch.equal(_bits(whole["model"][key]), _bits(_full(key, shape))), key
    assert whole["meta"] == {"lr": 0.5, "name": "ok"}


def damaged_newest(ctx: Any, root: str) -> dict[str, Any]:
    """Steps 3 and 4 saved by 2 ranks; rank 0 then damages step 4's `w` in rows only rank 0
    reads (rank 1 learns of it in the ranks' agreement). A load of the newest intact version
    reads step 3 on both ranks; a load of step 4 raises CorruptVersionError on both and
    leaves the state as it was."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world,))

    def state(tag: str | None) -> dict[str, Any]:
        def make(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return _full(name + (tag or ""), shape) if tag else torch.zeros(shape)

        return {
            "model": {
                "w": distribute_tensor(make("w", (64, 16)), mesh, [Shard(0)], src_data_rank=None),
                "b": make("b", (5,)),
            },
            "meta": {"epoch": int(tag or 0)},
        }

    for step in (3, 4):
        dcp.save(state(str(step)), storage_writer=ckpt.dcp.StorageWriter(root, step, timeout=TIMEOUT))
    if ctx.rank == 0:
        _damage_a_chunk(Path(root), 4, "model/w")
    dist.barrier()
    got, want = state(None), state("3")
    reader = ckpt.dcp.StorageReader(root, timeout=TIMEOUT)
    dcp.load(got, storage_reader=reader)
    ctx.check(reader.step == 3, f"read step {reader.step}")
    ctx.check(torch.equal(_bits(got["model"]["w"].to_local()), _bits(want["model"]["w"].to_local())), "w")
    ctx.check(torch.equal(_bits(got["model"]["b"]), _bits(want["model"]["b"])), "b")
    ctx.check(got["meta"] == {"epoch": 3}, f"meta {got['meta']}")
    untouched = state(None)
    try:
        dcp.load(untouched, storage_reader=ckpt.dcp.StorageReader(root, step=4, timeout=TIMEOUT))
        ctx.check(False, "step 4 loaded")
    except CheckpointException as e:
        errors = [x[0] if isinstance(x, tuple) else x for x in e.failures.values()]  # (error, its traceback)
        ctx.check(errors and all(isinstance(x, CorruptVersionError) for x in errors), f"raised {errors!r}")
    ctx.check(not untouched["model"]["w"].to_local().any() and not untouched["model"]["b"].any(), "state changed")
    ctx.check(untouched["meta"] == {"epoch": 0}, f"meta {untouched['meta']}")
    return {}


def test_a_damaged_newest_version_is_passed_over(tmp_path: Path) -> None:
    """With no step, dcp.load reads the newest version every chunk of which is intact (a
    checksum failure with no good copy anywhere passes the version over, as restore() does);
    before, the load raised CorruptVersionError, so a job resuming through DCP (torchtitan)
    could not resume until someone removed the damaged version. Also resharded 2 -> 1."""
    root = str(tmp_path / "root")
    _, failures = launch(THIS, "damaged_newest", 2, tmp_path / "job", timeout=180, root=root)
    assert not failures, failures
    whole: dict[str, Any] = {"model": {"w": torch.zeros(64, 16), "b": torch.zeros(5)}, "meta": {"epoch": 0}}
    reader = ckpt.dcp.StorageReader(root)
    dcp.load(whole, storage_reader=reader, no_dist=True)
    assert reader.step == 3
    for key, shape in (("w", (64, 16)), ("b", (5,))):
        assert torch.equal(_bits(whole["model"][key]), _bits(_full(key + "3", shape))), key
    assert whole["meta"] == {"epoch": 3}


class _SlowSetUp(dcp.DefaultSavePlanner):
    """A planner whose set_up_planner takes a while (a big state to flatten): DCP calls it
    on async_save's executor thread before set_up_storage_writer."""

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        import time

        time.sleep(2)
        super().set_up_planner(*args, **kwargs)


def test_a_new_writer_does_not_close_the_writer_of_an_async_save_in_flight(tmp_path: Path) -> None:
    """While an async_save's writer is still in DCP's set_up_planner, a writer made for the
    same root on the caller's thread raises RootLockedError, and the save in flight commits.
    Before, the new writer took the writer of the save in flight for abandoned (it was
    registered under the thread that made it) and closed its Checkpointer."""
    from ckpt.store.errors import RootLockedError

    root = tmp_path / "root"
    saved = _state(*_trained(7), epoch=4)
    writer = ckpt.dcp.StorageWriter(str(root), 1)
    fut = dcp.async_save(saved, storage_writer=writer, planner=_SlowSetUp(), no_dist=True)
    try:
        with pytest.raises(RootLockedError):
            ckpt.dcp.StorageWriter(str(root), 2).close()
    finally:
        fut.result(timeout=120)  # the save in flight commits
    with Checkpointer(str(root)) as ck:
        assert ck.steps() == [1]


class _SkipsFrozen(dcp.DefaultSavePlanner):
    """A planner that leaves one tensor out of the save (as one saving trainable params only)."""

    def create_local_plan(self) -> Any:
        import dataclasses

        plan = super().create_local_plan()
        return dataclasses.replace(plan, items=[i for i in plan.items if i.index.fqn != "frozen"])


def planner_leaves_a_dtensor_out(ctx: Any, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world,))
    state = {
        "w": distribute_tensor(_full("w", (4, 2)), mesh, [Shard(0)], src_data_rank=None),
        "frozen": distribute_tensor(_full("f", (6, 2)), mesh, [Shard(0)], src_data_rank=None),
    }
    dcp.save(state, storage_writer=ckpt.dcp.StorageWriter(root, 1, timeout=TIMEOUT), planner=_SkipsFrozen())
    md = ckpt.dcp.StorageReader(root, timeout=TIMEOUT).read_metadata()
    return {"keys": sorted(md.state_dict_metadata)}


def test_a_dtensor_the_planner_leaves_out_is_not_saved(tmp_path: Path) -> None:
    """A planner that leaves a DTensor out of its plan: the DTensor is not saved. Before, every
    DTensor of the planner's state_dict went to ckpt as a DTensor, planned or not."""
    root = str(tmp_path / "root")
    results, failures = launch(THIS, "planner_leaves_a_dtensor_out", 2, tmp_path / "job", timeout=180, root=root)
    assert not failures, failures
    assert [r["keys"] for r in results] == [["w"], ["w"]]


def test_a_reader_neither_creates_nor_locks_the_root(tmp_path: Path) -> None:
    """StorageReader reads as a restore does, without a Checkpointer of its own. Before, it
    opened one for each call: loading beside the training job's open Checkpointer was
    RootLockedError, a mistyped root was created (lock and id files left there), and a
    read-only root was TierUnavailableError ("not writable")."""
    root = tmp_path / "root"
    saved = _state(*_trained(4), epoch=2)
    dcp.save(saved, storage_writer=ckpt.dcp.StorageWriter(str(root), 3), no_dist=True)
    with Checkpointer(root):  # the job, still running
        target = _state(*_trained(5), epoch=0)
        dcp.load(target, storage_reader=ckpt.dcp.StorageReader(str(root)), no_dist=True)
        assert _same(target, saved)
    typo = tmp_path / "typo" / "run"
    with pytest.raises(CheckpointException) as info:
        dcp.load(_state(*_trained(5), epoch=0), storage_reader=ckpt.dcp.StorageReader(str(typo)), no_dist=True)
    assert [type(x) for x in _failures(info.value)] == [VersionNotFoundError], _failures(info.value)
    assert not (tmp_path / "typo").exists()
    script = f"""
import torch.distributed.checkpoint as dcp, ckpt.dcp
from tests.ckpt.test_dcp import _state, _trained, _same
target = _state(*_trained(5), epoch=0)
dcp.load(target, storage_reader=ckpt.dcp.StorageReader({str(root)!r}), no_dist=True)
print("same", _same(target, _state(*_trained(4), epoch=2)))
"""
    out = in_private_mounts(f"mount --bind {root} {root} && mount -o remount,bind,ro {root}", script)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["same", "True"], out.stdout
