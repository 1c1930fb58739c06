"""ckpt.dcp and the parts of DCP's contract that a plain save misses: a Checkpointer passed in
(its params-only schedule, its save in flight, its use from another thread), DCP's
use_collectives=False, a planner that drops an item in its global plan, and a version DCP
did not write as the newest. Real DCP; one process (no_dist=True), or 2 gloo ranks."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.api import CheckpointException

import ckpt.dcp
from ckpt import Checkpointer, StateMismatchError
from ckpt.cli import main as cli
from tests._dist import launch

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=60)


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((5,), float(step))}, "optim": {"m": torch.full((5,), 10.0 * step)}}


def _load(root: Path, step: int | None = None, **reader: Any) -> dict[str, Any]:
    got = _state(0)
    dcp.load(got, storage_reader=ckpt.dcp.StorageReader(str(root), step=step, **reader), no_dist=True)
    return got


def _errors(e: CheckpointException) -> list[BaseException]:
    return [v[0] if isinstance(v, tuple) else v for v in e.failures.values()]


def test_a_checkpointer_with_a_params_only_schedule_saves_every_item(tmp_path: Path) -> None:
    """DCP's state has no "model" key: the schedule's second save raised ValueError (on 2
    ranks it committed an empty version). Every DCP save holds everything DCP planned."""
    root = tmp_path / "root"
    with Checkpointer(root, full_every=2, partial_keys=("model",), capture_rng=False) as ck:
        for step in (1, 2, 3):
            dcp.save(
                _state(step), storage_writer=ckpt.dcp.StorageWriter(str(root), step, checkpointer=ck), no_dist=True
            )
    for step in (1, 2, 3):
        got = _load(root, step)
        assert torch.equal(got["optim"]["m"], _state(step)["optim"]["m"]), step


def test_the_first_save_after_a_dcp_load_through_the_checkpointer_is_full(tmp_path: Path) -> None:
    """A dcp.load through the Checkpointer loads another state than the one its full_every
    schedule last saved in full: the next save was params-only, resting on a full version
    of the abandoned run. The schedule starts again at the load, as at restore()."""
    root = tmp_path / "root"
    with Checkpointer(root, full_every=3, partial_keys=("model",), capture_rng=False) as ck:
        dcp.save(_state(1), storage_writer=ckpt.dcp.StorageWriter(str(root), 1, checkpointer=ck), no_dist=True)
        ck.save(2, _state(2))
        got = _state(0)
        dcp.load(got, storage_reader=ckpt.dcp.StorageReader(str(root), step=1, checkpointer=ck), no_dist=True)
        assert torch.equal(got["optim"]["m"], _state(1)["optim"]["m"])
        ck.save(3, got)
    ls = CliRunner().invoke(cli, ["ls", str(root), "--json"])
    assert ls.exit_code == 0, ls.output
    assert {r["step"]: r["keys"] for r in json.loads(ls.output)} == {1: None, 2: ["model"], 3: None}


def test_a_checkpointer_s_save_in_flight_does_not_make_the_dcp_save_skip(tmp_path: Path) -> None:
    """if_busy="skip" with the Checkpointer's own save in flight: DCP's save returned with
    nothing saved. It waits for that save, then saves."""
    root = tmp_path / "root"
    with Checkpointer(root, if_busy="skip", capture_rng=False) as ck:
        ck.save(1, {"big": torch.randn(4_000_000)})
        dcp.save(_state(2), storage_writer=ckpt.dcp.StorageWriter(str(root), 2, checkpointer=ck), no_dist=True)
        assert ck.steps() == [1, 2]
    assert torch.equal(_load(root, 2)["model"]["w"], _state(2)["model"]["w"])


def test_async_save_through_a_checkpointer_passed_in_is_refused(tmp_path: Path) -> None:
    """The training thread goes on using the Checkpointer; DCP's executor thread would run
    its collectives beside it on the same group (gloo aborted, or a rank hung)."""
    root = tmp_path / "root"
    with Checkpointer(root, capture_rng=False) as ck:
        writer = ckpt.dcp.StorageWriter(str(root), 1, checkpointer=ck)
        with pytest.raises(CheckpointException) as caught:
            dcp.async_save(_state(1), storage_writer=writer, no_dist=True).result(timeout=60)
        assert any(isinstance(e, ValueError) and "checkpointer=" in str(e) for e in _errors(caught.value))
        assert ck.steps() == []
    # Without checkpointer= the writer opens its own: async_save works.
    dcp.async_save(_state(2), storage_writer=ckpt.dcp.StorageWriter(str(root), 2), no_dist=True).result(timeout=60)
    assert torch.equal(_load(root)["optim"]["m"], _state(2)["optim"]["m"])


def test_a_save_on_the_thread_that_made_the_writer_is_not_refused(tmp_path: Path) -> None:
    """A training loop on a worker thread (as Ray Train runs one): the writer is made and
    used there. The first version of the refusal took every thread but the main one for
    async_save's."""
    import threading

    root = tmp_path / "root"
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            with Checkpointer(root, capture_rng=False) as ck:
                writer = ckpt.dcp.StorageWriter(str(root), 1, checkpointer=ck)
                dcp.save(_state(1), storage_writer=writer, no_dist=True)
        except BaseException as e:  # noqa: BLE001 - the test's thread asserts
            errors.append(e)

    worker = threading.Thread(target=loop)
    worker.start()
    worker.join(timeout=120)
    assert not errors, errors
    assert torch.equal(_load(root, 1)["model"]["w"], _state(1)["model"]["w"])


def test_an_exclusive_checkpointer_saves_through_async_save(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with Checkpointer(root, capture_rng=False) as ck:
        writer = ckpt.dcp.StorageWriter(str(root), 1, checkpointer=ck, exclusive=True)
        dcp.async_save(_state(1), storage_writer=writer, no_dist=True).result(timeout=60)
        assert ck.steps() == [1]


def test_use_collectives_false_is_refused(tmp_path: Path) -> None:
    """Each rank would save its own values under every name; ckpt keeps one copy of a name
    for the job (on 2 ranks, one rank's values were loaded into the other)."""
    root = tmp_path / "root"
    with pytest.raises(ValueError, match="use_collectives=False"):
        dcp.save(_state(1), storage_writer=ckpt.dcp.StorageWriter(str(root), 1), use_collectives=False)
    dcp.save(_state(1), storage_writer=ckpt.dcp.StorageWriter(str(root), 1), no_dist=True)  # the root is free


def test_a_newest_version_dcp_did_not_write_fails_with_ckpts_type(tmp_path: Path) -> None:
    """Before: AssertionError('metadata is None; global metadata read failed: ...')."""
    root = tmp_path / "root"
    dcp.save(_state(1), storage_writer=ckpt.dcp.StorageWriter(str(root), 1), no_dist=True)
    with Checkpointer(root) as ck:
        ck.save(2, {"model": {"w": torch.ones(3)}})
    with pytest.raises(CheckpointException) as caught:
        _load(root)
    assert any(
        isinstance(e, StateMismatchError) and "not saved through ckpt.dcp" in str(e) for e in _errors(caught.value)
    )


class _DropsFrozenGlobally(dcp.DefaultSavePlanner):
    """A planner that drops a DTensor in its global plan (its local plan keeps it)."""

    def create_global_plan(self, all_plans: Any) -> Any:
        plans, md = super().create_global_plan(all_plans)
        plans = [dataclasses.replace(p, items=[i for i in p.items if i.index.fqn != "frozen"]) for p in plans]
        md.state_dict_metadata.pop("frozen", None)
        self.metadata = md
        return plans, md


def planner_drops_a_dtensor_globally(ctx: Any, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world,))
    state = {
        "w": distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)], src_data_rank=None),
        "frozen": distribute_tensor(torch.ones(6, 2), mesh, [Shard(0)], src_data_rank=None),
    }
    writer = ckpt.dcp.StorageWriter(root, 1, timeout=TIMEOUT)
    dcp.save(state, storage_writer=writer, planner=_DropsFrozenGlobally())
    md = ckpt.dcp.StorageReader(root, timeout=TIMEOUT).read_metadata()
    return {"keys": sorted(md.state_dict_metadata)}


def test_a_dtensor_the_global_plan_drops_is_not_saved(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    results, failures = launch(THIS, "planner_drops_a_dtensor_globally", 2, tmp_path / "job", timeout=180, root=root)
    assert not failures, failures
    assert [r["keys"] for r in results] == [["w"], ["w"]]
