"""Single-process behaviour: round trips, the sampler, the plan, the CLI."""

from __future__ import annotations

import gc
import json
import random
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckpt
import ckpt._listing
from ckpt import Checkpointer, DistributedSampler
from ckpt.cli import main as cli
from ckpt.store import versions
from ckpt.store.errors import ReshardError
from ckpt.store.layout import ArraySpec, HeldRegion, Sliver, plan_arrays
from tests._states import assert_bitwise


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
    return {"model": model, "optim": opt, "sched": sched}


def _train_step(state: dict) -> None:
    x = torch.randn(4, 6)
    state["model"](x).pow(2).mean().backward()
    state["optim"].step()
    state["sched"].step()


def test_round_trip_is_bitwise_and_fills_in_place(tmp_path):
    src = _state(0)
    _train_step(src)
    sampler = DistributedSampler(list(range(50)), num_replicas=1, rank=0, seed=3)
    it = iter(sampler)
    consumed = [next(it) for _ in range(11)]
    src.update(
        sampler=sampler,
        epoch=4,
        extra={"bf16": torch.randn(5, 3).to(torch.bfloat16), "flags": torch.tensor([True, False]), "t": (1, None, "x")},
        nd=np.arange(6, dtype=np.int32).reshape(2, 3),
        inf=float("inf"),
    )
    with Checkpointer(tmp_path) as ck:
        ck.save(7, src)
    expected_rng = (random.random(), np.random.rand(), torch.rand(2))

    dst = _state(1)
    weight = dst["model"][0].weight
    dst_sampler = DistributedSampler(list(range(50)), num_replicas=1, rank=0, seed=0)
    dst.update(sampler=dst_sampler, epoch=0, extra=None, nd=np.zeros((2, 3), np.int32), inf=0.0)
    with Checkpointer(tmp_path) as ck:
        assert ck.steps() == [7] and ck.latest_step() == 7
        assert ck.restore(dst) == 7
    assert (random.random(), np.random.rand()) == expected_rng[:2]
    assert_bitwise(torch.rand(2), expected_rng[2], "torch RNG draw")
    assert dst["model"][0].weight is weight  # loaded in place
    for k in ("model", "optim", "sched"):
        assert_bitwise(dst[k].state_dict(), src[k].state_dict(), k)
    assert_bitwise(
        {k: dst[k] for k in ("epoch", "inf", "extra", "nd")}, {k: src[k] for k in ("epoch", "inf", "extra", "nd")}
    )
    # the sampler continues exactly where the saved one stood
    reference = list(DistributedSampler(list(range(50)), num_replicas=1, rank=0, seed=3))
    assert consumed == reference[:11]
    assert list(iter(dst_sampler)) == reference[11:]


def _layout(kind: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {
        "big": torch.randn(600, 1024, generator=g),  # 2.3 MiB: chunks of ~1 MiB, an edge chunk
        "small": torch.randn(7, generator=g),
        "scalar": torch.tensor(float(seed)),
        "strided": torch.randn(64, 48, generator=g).t(),  # not contiguous
        "bf16": torch.randn(3000, generator=g).to(torch.bfloat16),
    }
    if kind == "b":  # another layout: an array more, one reshaped
        state["extra"] = torch.randn(5000, generator=g)
        state["small"] = torch.randn(9, generator=g)
    return state


def test_saves_that_change_layout_and_back_restore_bitwise(tmp_path):
    """Each save of a layout reuses the staging slots its first save computed: a save of
    another layout, then of the first again with new values, restores each bitwise."""
    saves = {1: _layout("a", 1), 2: _layout("a", 2), 3: _layout("b", 3), 4: _layout("a", 4), 5: _layout("b", 5)}
    with Checkpointer(tmp_path, split_bytes=1 << 20, max_staging_bytes=3 << 20, keep_last=None) as ck:
        for step, state in saves.items():
            ck.save(step, state)
        ck.wait()
        for step, state in saves.items():
            out = {k: torch.zeros_like(v) for k, v in state.items()}
            assert ck.restore(out, step=step) == step
            assert_bitwise(out, state, f"step {step}")


def _small_kinds(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(6, 2, dtype=torch.complex64, generator=g)
    return {
        "f32": torch.randn(48, 48, generator=g),
        "bias": torch.randn(48, generator=g),
        "step": torch.tensor(float(seed)),  # 0-d: stored inline
        "one": torch.tensor([seed], dtype=torch.int64),  # single element: inline
        "strided": torch.randn(20, 30, generator=g).t(),  # not contiguous
        "expanded": torch.randn(1, 16, generator=g).expand(8, 16),  # stride 0
        "conj": z.conj(),  # a conjugate view: its bytes are not its values
        "neg": z.conj().imag,  # a negative view
        "bool": torch.rand(33, generator=g) > 0.5,
        "bf16": torch.randn(100, generator=g).to(torch.bfloat16),
        "f8": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
        "i16": torch.randint(-(2**15), 2**15, (7, 3), dtype=torch.int16, generator=g),
        "empty": torch.empty(0, 4),
    }


def test_small_tensors_of_every_kind_are_copied_together_and_restore_bitwise(tmp_path):
    """Small chunks that their tensors fill go through one batched copy: views, strides,
    conjugate and negative bits, every dtype, across saves of the same layout."""
    saves = {step: _small_kinds(step) for step in (1, 2, 3)}
    with Checkpointer(tmp_path, keep_last=None) as ck:
        for step, state in saves.items():
            ck.save(step, state)
        ck.wait()
        tasks = [t for batch in ck._saver._batches or [] for t in batch.tasks]
        assert sum(t.batched for t in tasks) >= 10  # the batched path, not the per-chunk one, ran
        for step, state in saves.items():
            out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
            assert ck.restore(out, step=step) == step
            assert_bitwise(out, state, f"step {step}")


def test_runs_of_small_tensors_of_every_kind_are_copied_in_one_call_and_restore_bitwise(tmp_path):
    """Several small tensors of each kind, dtype and shape lie back to back in the staging
    buffer and are copied by one call per kind (torch.cat, torch.stack for 0-d ones): views,
    strides, conjugate and negative bits, every dtype, across saves of the same layout."""
    saves = {
        step: {f"{k}/{i}": v for i in range(5) for k, v in _small_kinds(step * 10 + i).items()} for step in (1, 2, 3)
    }
    with Checkpointer(tmp_path, keep_last=None) as ck:
        for step, state in saves.items():
            ck.save(step, state)
        ck.wait()
        runs = [r for batch in ck._saver._batches or [] for r in batch.runs]
        assert len(runs) >= 10  # each kind's five tensors (the empty ones excepted) form a run
        assert any(not r.tasks[0].piece_shape for r in runs)  # 0-d ones too
        for step, state in saves.items():
            out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
            assert ck.restore(out, step=step) == step
            assert_bitwise(out, state, f"step {step}")


def test_the_state_is_not_kept_alive_once_the_save_is_committed(tmp_path):
    """Nothing of a save holds the user's tensors once wait() returns, even with the cyclic
    collector off: a reference cycle would keep them (and their memory) until it runs."""
    was = gc.isenabled()
    gc.disable()
    try:
        state = {"w": torch.randn(100), "deep": {"b": [torch.randn(3), (torch.tensor(1.0),)]}}
        refs = [weakref.ref(state["w"]), weakref.ref(state["deep"]["b"][1][0])]
        with Checkpointer(tmp_path) as ck:
            for step in (1, 2):
                ck.save(step, state)
                ck.wait()
            del state
            assert [r() is None for r in refs] == [True, True]
    finally:
        if was:
            gc.enable()


def test_the_state_is_not_kept_alive_after_restore(tmp_path):
    """Nothing of a restore holds the tensors it filled once it returns, with the cyclic
    collector off (a reference cycle in the saved tree's binding would)."""
    was = gc.isenabled()
    gc.disable()
    try:
        with Checkpointer(tmp_path) as ck:
            ck.save(1, {"w": torch.randn(100), "deep": {"b": [torch.randn(3)]}, "n": np.arange(4.0)})
            ck.wait()
            into = {"w": torch.zeros(100), "deep": {"b": [torch.zeros(3)]}, "n": np.zeros(4)}
            refs = [weakref.ref(into["w"]), weakref.ref(into["deep"]["b"][0]), weakref.ref(into["n"])]
            assert ck.restore(into) == 1
            del into
            assert [r() is None for r in refs] == [True, True, True]
    finally:
        if was:
            gc.enable()


def test_a_saved_state_dict_restores_into_the_object_and_an_object_into_its_state_dict(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})  # DCP-style state dicts
        ck.save(2, {"model": model, "optim": opt})
        ck.wait()
        fresh = torch.nn.Linear(16, 8)
        fresh_opt = torch.optim.Adam(fresh.parameters())  # no state yet: restore creates it
        state = {"model": fresh, "optim": fresh_opt}
        assert ck.restore(state, step=1) == 1
        assert state["model"] is fresh and state["optim"] is fresh_opt
        assert_bitwise(fresh.state_dict(), model.state_dict(), "model")
        assert_bitwise(fresh_opt.state_dict(), opt.state_dict(), "optim")
        into = {"weight": torch.zeros(8, 16), "bias": torch.zeros(8)}
        target = {"model": into, "optim": torch.optim.Adam(torch.nn.Linear(16, 8).parameters())}
        ck.restore(target, step=2)
        assert target["model"] is into
        assert_bitwise(into, model.state_dict(), "model into a dict")


class _StatefulDict(dict):
    """A dict that is also Stateful (as some containers are): restored through load_state_dict."""

    loads = 0

    def state_dict(self) -> dict:
        return dict(self)

    def load_state_dict(self, sd: dict) -> None:
        type(self).loads += 1
        self.update(sd)


def test_a_dict_that_has_state_dict_restores_through_it(tmp_path):
    saved = _StatefulDict(w=torch.arange(6.0))
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"box": saved})
        ck.save(2, {"box": {"w": torch.arange(6.0) + 1}})  # a plain dict, restored into the same object
        ck.wait()
        target = _StatefulDict(w=torch.zeros(6))
        ck.restore({"box": target}, step=1)
        assert _StatefulDict.loads == 1
        assert_bitwise(target, saved, "box")
        ck.restore({"box": target}, step=2)
        assert_bitwise(target, {"w": torch.arange(6.0) + 1}, "box")


def test_sampler_resumes_mid_epoch_and_reshuffles():
    data = list(range(37))
    full = DistributedSampler(data, num_replicas=3, rank=1, seed=5)
    full.set_epoch(2)
    order = list(full)
    ref = torch.utils.data.DistributedSampler(data, num_replicas=3, rank=1, seed=5)
    ref.set_epoch(2)
    assert order == list(ref)  # drop-in: identical order to torch's sampler

    s = DistributedSampler(data, num_replicas=3, rank=1, seed=5)
    s.set_epoch(2)
    it = iter(s)
    head = [next(it) for _ in range(4)]
    saved = s.state_dict()
    assert saved["position"] == 4 and saved["epoch"] == 2
    r = DistributedSampler(data, num_replicas=3, rank=1, seed=0)
    r.load_state_dict(json.loads(json.dumps(saved)))
    r.set_epoch(2)  # a resumed loop re-enters the same epoch: the position stays
    assert head + list(r) == order
    r.set_epoch(3)
    reshuffled = list(r)
    assert reshuffled != order and len(reshuffled) == len(order)


def test_sampler_len_follows_the_restored_drop_last():
    data = list(range(10))
    saved = DistributedSampler(data, num_replicas=4, rank=0, drop_last=True)
    r = DistributedSampler(data, num_replicas=4, rank=0)  # torch sized it for drop_last=False
    r.load_state_dict(saved.state_dict())
    for epoch in (0, 1):
        r.set_epoch(epoch)
        assert len(r) == len(list(r)) == len(list(saved)) == 2


def test_sampler_refuses_another_dataset():
    s = DistributedSampler(list(range(10)), num_replicas=2, rank=0)
    with pytest.raises(ckpt.StateMismatchError):
        DistributedSampler(list(range(11)), num_replicas=2, rank=0).load_state_dict(s.state_dict())


def test_sampler_refuses_a_position_set_by_hand_that_is_none_and_a_state_that_is_not_its_own():
    """sampler.position set by hand (loader workers prefetch): -1 was saved, and the resumed
    rank yielded a sample of the epoch's end; a state lacking keys was a bare KeyError."""
    s = DistributedSampler(list(range(8)), num_replicas=2, rank=0)
    for bad in (-1, 2.0, True, None):
        s.position = bad  # type: ignore[assignment]
        with pytest.raises(ValueError, match="sampler.position"):
            s.state_dict()
    s.position = 3
    assert s.state_dict()["position"] == 3
    with pytest.raises(ckpt.StateMismatchError, match="dataset_len"):
        DistributedSampler(list(range(8)), num_replicas=2, rank=0).load_state_dict({"epoch": 0, "seed": 0})


@pytest.mark.parametrize("old,new", [(2, 3), (4, 1), (1, 4), (3, 2), (3, 5)])
def test_sampler_reshards_the_rest_of_the_epoch(old, new):
    data = list(range(53))
    olds = [DistributedSampler(data, num_replicas=old, rank=r, seed=9) for r in range(old)]
    consumed = []
    for s in olds:
        s.set_epoch(1)
        it = iter(s)
        consumed += [next(it) for _ in range(5)]
    epoch = list(DistributedSampler(data, num_replicas=old, rank=0, seed=9)._epoch_list_for(1))
    states = [json.loads(json.dumps(s.state_dict())) for s in olds]
    news = [DistributedSampler(data, num_replicas=new, rank=r, seed=0) for r in range(new)]
    rest = []
    for r, s in enumerate(news):
        s.load_state_dict(states[r % old])
        s.set_epoch(1)
        rest.append(list(s))
    assert sorted(consumed) == sorted(epoch[: 5 * old])
    assert sorted(x for part in rest for x in part) == sorted(epoch[5 * old :])  # none repeated, none skipped
    assert max(map(len, rest)) - min(map(len, rest)) <= 1
    # len() is an epoch at the new world size (loops size every epoch by it), not the rest
    assert [len(s) for s in news] == [len(DistributedSampler(data, num_replicas=new, rank=r)) for r in range(new)]
    # reshard twice in one epoch: 2 more samples per new rank, then back to the old size
    taken = []
    for r, s in enumerate(news):
        s.load_state_dict(states[r % old])
        it = iter(s)
        taken += [next(it) for _ in range(2)]
    mids = [s.state_dict() for s in news]
    back = [DistributedSampler(data, num_replicas=old, rank=r, seed=0) for r in range(old)]
    final = []
    for r, s in enumerate(back):
        s.load_state_dict(mids[r % new])
        final += list(s)
    assert sorted(consumed + taken + final) == sorted(epoch)


def test_sampler_even_after_reshard_gives_every_rank_the_same_count():
    data = list(range(53))
    olds = [DistributedSampler(data, num_replicas=2, rank=r, seed=1) for r in range(2)]
    for s in olds:
        it = iter(s)
        [next(it) for _ in range(4)]
    for drop_last in (False, True):
        news = [DistributedSampler(data, 3, r, drop_last=drop_last, even_after_reshard=True) for r in range(3)]
        parts = []
        for r, s in enumerate(news):
            s.load_state_dict(dict(olds[r % 2].state_dict(), drop_last=drop_last))
            parts.append(list(s))
        assert len({len(p) for p in parts}) == 1
        rest = set(olds[0]._epoch_list_for(0)[8:])
        got = {x for p in parts for x in p}
        assert got <= rest and (drop_last or got == rest)


def test_sampler_passes_after_a_resharded_resume_are_whole_epochs():
    """torch yields the whole epoch at every iter(), set_epoch or not. After a resume on
    another world size the first pass is the rest of the epoch; the later ones were the
    tail of the old list (or, for a sampler saved after a full pass, empty forever)."""
    data = list(range(12))
    olds = [DistributedSampler(data, 4, r, shuffle=False) for r in range(4)]
    for s in olds:
        next(iter(s))
    for r in range(2):
        s = DistributedSampler(data, 2, r, shuffle=False)
        s.load_state_dict(olds[r].state_dict())
        torch_pass = list(torch.utils.data.DistributedSampler(data, 2, r, shuffle=False))
        assert list(s) == torch_pass[2:]  # the rest: 4 samples of 12 consumed on 4 ranks
        assert list(s) == torch_pass and list(s) == torch_pass
    done = [DistributedSampler(data, 4, r, shuffle=False) for r in range(4)]
    for s in done:
        list(s)
    s = DistributedSampler(data, 2, 0, shuffle=False)
    s.load_state_dict(done[0].state_dict())
    assert list(s) == [] and list(s) == list(torch.utils.data.DistributedSampler(data, 2, 0, shuffle=False))


@pytest.mark.parametrize(("n", "old", "new", "drop_last"), [(10, 4, 3, True), (3, 8, 2, False), (3, 4, 2, True)])
def test_sampler_resumed_before_any_sample_takes_torch_s_layout_for_the_new_world(n, old, new, drop_last):
    """Nothing of the epoch consumed (a save at step 0, or right after set_epoch): torch's
    epoch for the new world. Before, the old world's padding or truncation stayed: 4->3
    with drop_last lost sample 7 and gave rank 2 two samples where len() said three."""
    data = list(range(n))
    saved = [DistributedSampler(data, old, r, seed=2, drop_last=drop_last) for r in range(old)]
    for s in saved:
        s.set_epoch(1)
    for even in (False, True):
        for r in range(new):
            s = DistributedSampler(data, new, r, seed=0, even_after_reshard=even)
            s.load_state_dict(saved[r % old].state_dict())
            ref = torch.utils.data.DistributedSampler(data, new, r, seed=2, drop_last=drop_last)
            ref.set_epoch(1)
            assert list(s) == list(ref) and len(s) == len(ref), (r, even)


def test_a_version_saved_without_rng_leaves_the_ranks_rng_as_it_is(tmp_path):
    """Only ranks that did not exist are seeded. Before, every rank was re-seeded when the
    version held no RNG (saved with capture_rng=False), over the job's own seeding."""
    with Checkpointer(tmp_path, capture_rng=False) as ck:
        ck.save(1, {"w": torch.ones(3)})
    random.seed(1234)
    torch.manual_seed(1234)
    want = (random.random(), torch.rand(2))
    random.seed(1234)
    torch.manual_seed(1234)
    with Checkpointer(tmp_path) as ck:
        assert ck.restore({"w": torch.zeros(3)}) == 1
    got = (random.random(), torch.rand(2))
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def _spec(name, shape, *regions, dtype="float32"):
    return ArraySpec(name, dtype, shape, tuple(HeldRegion(r, o, s) for r, o, s in regions))


def test_plan_uneven_shards_get_gcd_chunks_with_one_writer_each():
    spec = _spec("w", (10, 4), (0, (0, 0), (4, 4)), (1, (4, 0), (6, 4)))
    (plan,) = plan_arrays([spec])
    assert plan.chunk_shape == (4, 4) and not plan.replicated
    assert [c.writer for c in plan.chunks] == [0, 1, 1]
    assert [c.shape for c in plan.chunks] == [(4, 4), (4, 4), (2, 4)]  # the edge chunk is partial
    assert sum(np.prod(c.shape) for c in plan.chunks) == 40
    spec = _spec("w", (6, 4), (0, (0, 0), (2, 4)), (1, (2, 0), (3, 4)), (2, (5, 0), (1, 4)))
    (plan,) = plan_arrays([spec])
    # gcd 1 would make 6 chunks, over 3 regions + 1: a 2-row grid, rank 2's row sent to rank 1
    assert plan.chunk_shape == (2, 4) and [c.writer for c in plan.chunks] == [0, 1, 1]
    assert [c.slivers for c in plan.chunks] == [(), (), (Sliver(2, (5, 0), (1, 4)),)]


def test_plan_ceil_split_like_dtensor_keeps_one_chunk_per_rank():
    rows = [12565, 12565, 12565, 12562]  # 50257 rows over 4 ranks
    offsets = [0, 12565, 25130, 37695]
    spec = _spec("emb", (50257, 8), *[(r, (o, 0), (n, 8)) for r, (o, n) in enumerate(zip(offsets, rows))])
    (plan,) = plan_arrays([spec])
    assert plan.chunk_shape == (12565, 8) and [c.writer for c in plan.chunks] == [0, 1, 2, 3]
    assert plan.chunks[-1].shape == (12562, 8) and plan.chunks[-1].nbytes == 12565 * 8 * 4


def test_plan_spreads_replicated_writes_and_splits_large_arrays():
    specs = [_spec(f"t{i}", (100,), *[(r, (0,), (100,)) for r in range(4)]) for i in range(8)]
    big = _spec("big", (1000, 10), *[(r, (0, 0), (1000, 10)) for r in range(4)])
    plans = plan_arrays(specs + [big], split_bytes=10_000)
    writers = [c.writer for p in plans for c in p.chunks]
    assert {0, 1, 2, 3} <= set(writers)
    (bp,) = [p for p in plans if p.spec.name == "big"]
    assert len(bp.chunks) == 4 and bp.chunk_shape == (250, 10) and len({c.writer for c in bp.chunks}) == 4


def test_plan_rejects_overlaps_and_gaps():
    with pytest.raises(ReshardError, match="overlap"):
        plan_arrays([_spec("w", (8,), (0, (0,), (5,)), (1, (3,), (5,)))])
    with pytest.raises(ReshardError, match="gaps"):
        plan_arrays([_spec("w", (8,), (0, (0,), (3,)), (1, (4,), (4,)))])


def test_plan_inlines_single_elements():
    (p,) = plan_arrays([_spec("s", (), (0, (), ()))])
    assert p.chunks[0].inline and p.chunks[0].nbytes == 0


def test_cli_ls_and_verify(tmp_path):
    src = _state(0)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, src)
        ck.save(2, src)
    runner = CliRunner()
    out = runner.invoke(cli, ["ls", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [r["step"] for r in rows] == [1, 2] and all(r["status"] == "committed" for r in rows)
    assert rows[0]["world_size"] == 1 and rows[0]["bytes"] > 0
    table = runner.invoke(cli, ["ls", str(tmp_path)])
    assert table.exit_code == 0 and "committed" in table.output
    assert runner.invoke(cli, ["verify", str(tmp_path)]).exit_code == 0
    chunk = next((tmp_path / versions.version_dirname(2) / "state" / "model").rglob("c.0.0"))
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    bad = runner.invoke(cli, ["verify", str(tmp_path)])
    assert (
        bad.exit_code == 1 and "BAD" in bad.output and str(chunk.relative_to(tmp_path / "v000000000002")) in bad.output
    )
    assert runner.invoke(cli, ["verify", str(tmp_path), "--step", "1"]).exit_code == 0
    missing = runner.invoke(cli, ["ls", str(tmp_path / "nope")])
    assert missing.exit_code == 3 and "error" in missing.output


def test_cli_ls_skips_a_version_gc_deletes_while_listing(tmp_path, monkeypatch):
    """GC unpublishes a version between ls reading its manifest and its root info: the
    version is gone, not "committed in part" (a race the concurrent-readers test hit)."""
    src = _state(0)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, src)
        ck.save(2, src)
    read_manifest = versions.read_manifest

    def read_then_gc(root, step):
        manifest = read_manifest(root, step)
        if step == 1:
            versions.delete_version(root, step)  # the real unpublish (rename) and delete
        return manifest

    monkeypatch.setattr(ckpt._listing, "read_manifest", read_then_gc)
    out = CliRunner().invoke(cli, ["ls", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    assert [(r["step"], r["status"]) for r in json.loads(out.output)] == [(2, "committed")]


def test_restore_of_empty_root_returns_none_and_unknown_step_raises(tmp_path):
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(_state()) is None
        with pytest.raises(ckpt.VersionNotFoundError):
            ck.restore(_state(), step=3)


def test_restore_refuses_to_start_from_scratch_when_a_tier_cannot_be_read(tmp_path) -> None:
    """An empty local root and a second tier that cannot be listed (here a path that is a
    file, as a dead mount can be): the versions may be there, so no silent None."""
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("x")
    model = torch.nn.Linear(3, 2)
    with Checkpointer(str(tmp_path / "empty"), tiers=[str(blocked)]) as ck:
        with pytest.raises(ckpt.TierUnavailableError, match="not starting from scratch"):
            ck.restore({"model": model})
    with Checkpointer(str(tmp_path / "empty2")) as ck:  # nothing anywhere: a fresh start
        assert ck.restore({"model": model}) is None


def test_cli_ls_table_fits_80_columns(tmp_path):
    """Each version is one line of the table at 80 columns, whatever its status (a version
    held in part, a damaged one, a milestone with its replication states); explanations go
    below the table, one line each."""
    root = tmp_path / "a-rather-long-directory-name-for-a-checkpoint-root"
    with Checkpointer(root, replicate_to=f"file://{tmp_path / 'remote'}") as ck:
        for step in (1, 2, 10**11):
            ck.save(step, _state(step), milestone=step == 2)
    info = root / versions.version_dirname(1) / "root.json"
    doc = json.loads(info.read_text())
    info.write_text(json.dumps({**doc, "writers": []}))  # a root that holds another rank's part only
    (root / versions.version_dirname(10**11) / "manifest.json").write_text("{not json")
    out = CliRunner(env={"COLUMNS": "80"}).invoke(cli, ["ls", str(root)])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    rows = [line for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    assert [r.split()[0] for r in rows[:3]] == ["1", "2", str(10**11)], "\n".join(lines)
    assert "partial" in rows[0] and "committed*" in rows[1] and "damaged" in rows[2]
    assert any(line.startswith("partial: ") for line in lines)
    assert any(line.startswith(f"step {10**11}: ") and "not valid JSON" in line for line in lines)


@pytest.mark.parametrize("copy_threads", [2, 1])
def test_many_small_tensors_are_copied_by_copy_threads_and_restore_exactly(tmp_path, monkeypatch, copy_threads):
    """A state of hundreds of small tensors: their one batched copy is split between save()'s
    thread and the copy thread (torch releases the GIL inside it), or made by save()'s
    thread alone with copy_threads=1, and every byte lands."""
    threads: list[tuple[int, int]] = []
    real = torch._foreach_copy_

    def spy(dst, src, *args, **kwargs):
        threads.append((threading.get_ident(), len(dst)))
        return real(dst, src, *args, **kwargs)

    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(i + 1, 5) for i in range(600)}  # (no two alike: no run of them)
    state["ints"] = torch.arange(11, dtype=torch.int64)
    big = torch.randn(300_000)  # two chunks large enough for the lanes
    state["big"], state["big2"] = big, big + 1
    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    with Checkpointer(tmp_path, copy_threads=copy_threads, capture_rng=False) as ck:
        ck.save(1, state)
        ck.wait()
        used = {t for t, _ in threads}
        assert len(used) == copy_threads
        assert threading.get_ident() in used
        assert sum(n for _, n in threads) == 601
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.restore(into) == 1
    assert_bitwise(into, state, "state")


@pytest.mark.parametrize("copy_threads", [1, 2])
def test_a_large_run_of_alike_small_tensors_is_copied_in_two_halves(tmp_path, monkeypatch, copy_threads):
    """Hundreds of small tensors of one dtype and shape (a model's layers): one torch.cat
    copies each half of them, one on save()'s thread and one on the copy thread (or both on
    save()'s thread with copy_threads=1), and every byte lands."""
    threads: list[tuple[int, int]] = []
    real = torch.cat

    def spy(tensors, *args, **kwargs):
        threads.append((threading.get_ident(), len(tensors)))
        return real(tensors, *args, **kwargs)

    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(48, 48) for i in range(300)}
    state["one"] = torch.randn(48, 47)
    monkeypatch.setattr(torch, "cat", spy)
    with Checkpointer(tmp_path, copy_threads=copy_threads, capture_rng=False) as ck:
        ck.save(1, state)
        ck.wait()
        assert sorted(n for _, n in threads) == [150, 150]
        used = {t for t, _ in threads}
        assert len(used) == copy_threads
        assert threading.get_ident() in used
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.restore(into) == 1
    assert_bitwise(into, state, "state")


def test_an_interrupt_during_the_two_thread_copy_waits_for_the_other_half(tmp_path, monkeypatch):
    """Ctrl-C in save()'s half of the batched copy: save() raises it only once the copy
    thread's half has ended (no copy into the staging buffer outlives save()), the step is
    not committed, and the next save is exact."""
    ended: list[float] = []
    real = torch._foreach_copy_
    main = threading.get_ident()

    def spy(dst, src, *args, **kwargs):
        if threading.get_ident() == main:
            raise KeyboardInterrupt
        time.sleep(0.3)
        real(dst, src, *args, **kwargs)
        ended.append(time.monotonic())

    state = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(600)}  # (no two alike: no run of them)
    with Checkpointer(tmp_path, copy_threads=2, capture_rng=False) as ck:
        monkeypatch.setattr(torch, "_foreach_copy_", spy)
        with pytest.raises(KeyboardInterrupt):
            ck.save(1, state)
        raised = time.monotonic()
        monkeypatch.setattr(torch, "_foreach_copy_", real)
        assert len(ended) == 1 and ended[0] <= raised
        with pytest.raises(ckpt.CkptError):
            ck.wait()
        assert ck.steps() == []
        state["t0"] += 1
        ck.save(2, state)
        ck.wait()
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.restore(into) == 2
    assert_bitwise(into, state, "state")


def test_a_state_restores_into_conjugate_and_negative_views_of_its_own_kind(tmp_path):
    """The state restored into is made as the saved one was: a conjugate view, and a
    negative one (a complex tensor's conj().imag), small and large. Each reads back what was
    saved. Before, the copy viewed their bytes as integers, which torch refuses for such
    views: a RuntimeError, with part of the state already written."""
    g = torch.Generator().manual_seed(5)
    saved = {
        "conj": torch.randn(3000, dtype=torch.complex64, generator=g),
        "neg": torch.randn(3000, generator=g),
        "small_neg": torch.randn(5, generator=g),
    }
    with Checkpointer(tmp_path) as ck:
        ck.save(1, saved)
    out = {
        "conj": torch.zeros(3000, dtype=torch.complex64).conj(),
        "neg": torch.zeros(3000, dtype=torch.complex64).conj().imag,
        "small_neg": torch.zeros(5, dtype=torch.complex64).conj().imag,
    }
    assert out["conj"].is_conj() and out["neg"].is_neg()
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(out) == 1
    for k, v in saved.items():
        assert torch.equal(out[k].resolve_conj().resolve_neg(), v), k
