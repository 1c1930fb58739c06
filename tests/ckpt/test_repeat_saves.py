"""Saves of an unchanged layout reuse the last save's encoding, descriptions and staging
tasks (ckpt._tree.EncodeMemo, ckpt._tensors.Describer, ckpt._staging.StageBatch): what they
reuse must be exactly what a fresh pass would make, and any change between saves must be
seen as a fresh pass sees it."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import Checkpointer
from ckpt._staging import Arena, StageBatch, StageTask, assign_offsets, stage
from ckpt._tensors import Describer, describe
from ckpt._tree import DICT, OBJECT, EncodeMemo, encode_state
from ckpt.store.errors import UnsupportedStateError
from ckpt.store.layout import REPLICATE, Mesh, MeshSpec, plan_arrays
from tests._states import assert_bitwise, blank


def _model_and_adam(layers: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _same_encoding(state: dict[str, Any], memo: EncodeMemo) -> Any:
    """encode_state with the memo, checked against a fresh encoding; the tree."""
    tree, leaves = encode_state(state, memo)
    want_tree, want = encode_state(state)
    assert tree == want_tree
    assert list(leaves.paths.items()) == list(want.paths.items())
    assert len(leaves.values) == len(want.values)
    for a, b in zip(leaves.values, want.values):
        _same_tensor(a, b)
    return tree


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    """The same tensor, or a view of the same memory (a state_dict()'s, a detached one)."""
    assert a is b or (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


def test_a_second_encoding_reuses_the_nodes_of_tensor_mappings() -> None:
    model, opt = _model_and_adam()
    state = {"model": model, "optim": opt, "step": 3}
    memo = EncodeMemo()
    first = _same_encoding(state, memo)
    opt.step()  # new values, same names
    second = _same_encoding(state, memo)
    # A model's state_dict() and the optimizer's state by parameter are taken whole.
    assert second["model"][OBJECT] is first["model"][OBJECT]
    assert second["optim"][OBJECT]["state"] is first["optim"][OBJECT]["state"]
    assert second["optim"][OBJECT]["state"][DICT][0][1] is first["optim"][OBJECT]["state"][DICT][0][1]
    # Scalars are encoded anew: param_groups holds the learning rate.
    assert second["optim"][OBJECT]["param_groups"] is not first["optim"][OBJECT]["param_groups"]


@pytest.mark.parametrize(
    "change",
    [
        "key added",
        "key removed",
        "keys reordered",
        "tensor becomes a scalar",
        "int key becomes bool",
        "parameter dict becomes an OrderedDict",
        "parameter state gains a key",
        "mapping moves under another key",
    ],
)
def test_any_change_between_encodings_gives_the_fresh_encoding(change: str) -> None:
    t = [torch.full((2,), float(i)) for i in range(6)]
    state: dict[str, Any] = {
        "w": {"a": t[0], "b": t[1]},
        "opt": {0: {"m": t[2], "v": t[3]}, 1: {"m": t[4], "v": t[5]}},
    }
    memo = EncodeMemo()
    _same_encoding(state, memo)
    if change == "key added":
        state["w"]["c"] = t[2]
    elif change == "key removed":
        del state["w"]["b"]
    elif change == "keys reordered":
        state["w"] = {"b": t[1], "a": t[0]}
    elif change == "tensor becomes a scalar":
        state["opt"][1]["v"] = 0.5
    elif change == "int key becomes bool":  # 0 == False, but the array names differ
        state["opt"] = {False: state["opt"][0], True: state["opt"][1]}
    elif change == "parameter dict becomes an OrderedDict":
        state["opt"][0] = OrderedDict(state["opt"][0])
    elif change == "parameter state gains a key":
        state["opt"][0]["step"] = t[5]
    else:
        state = {"moved": state["w"], "opt": state["opt"]}
    _same_encoding(state, memo)
    _same_encoding(state, memo)  # and again, from what the changed encoding left


def test_a_reused_mapping_whose_names_an_earlier_one_took_is_refused() -> None:
    w = torch.ones(2)
    memo = EncodeMemo()
    encode_state({"p": {"1": {"w": w}}}, memo)
    # Key 1 comes first and takes "p/1/w"; key "1" then matches the memo's "p/1" exactly.
    with pytest.raises(UnsupportedStateError, match="same array name"):
        encode_state({"p": {1: {"w": torch.zeros(2)}, "1": {"w": w}}}, memo)


def _fresh(values: list[Any]) -> list[Any]:
    return [describe(v, (str(i),)) for i, v in enumerate(values)]


def _check(describer: Describer, values: list[Any]) -> tuple[list[Any], int]:
    """describer's pieces and signature, checked against describe() and a hash of the specs."""
    paths = {f"t{i}": (f"t{i}",) for i in range(len(values))}
    got = describer(paths, values)
    for name, piece, want in zip(paths, got.pieces.values(), _fresh(values)):
        _same_tensor(piece.data, want.data)
        assert piece.data.requires_grad == want.data.requires_grad
        assert (piece.data_type, piece.global_shape, piece.offsets, piece.shape, piece.kind) == (
            want.data_type,
            want.global_shape,
            want.offsets,
            want.shape,
            want.kind,
        )
        assert got.specs[list(paths).index(name)][:6] == (
            name,
            want.data_type,
            want.global_shape,
            want.offsets,
            want.shape,
            want.kind,
        )
    assert got.signature == hash(tuple(got.specs))
    return got.specs, got.signature


def test_describer_keeps_the_signature_of_an_unchanged_layout() -> None:
    d = Describer()
    specs, sig = _check(d, [torch.zeros(3), torch.ones(2, 2, dtype=torch.int64)])
    specs2, sig2 = _check(d, [torch.ones(3), torch.zeros(2, 2, dtype=torch.int64)])
    assert sig2 == sig
    assert all(a is b for a, b in zip(specs, specs2))  # kept, not made again


@pytest.mark.parametrize("change", ["dtype", "shape", "requires_grad", "ndarray", "count"])
def test_describer_sees_a_changed_leaf(change: str) -> None:
    d = Describer()
    _, sig = _check(d, [torch.zeros(3), torch.zeros(4)])
    second: list[Any] = {
        "dtype": [torch.zeros(3), torch.zeros(4, dtype=torch.float64)],
        "shape": [torch.zeros(3), torch.zeros(2, 2)],
        "requires_grad": [torch.zeros(3), torch.zeros(4, requires_grad=True)],
        "ndarray": [torch.zeros(3), torch.zeros(4).numpy()],
        "count": [torch.zeros(3)],
    }[change]
    _, sig2 = _check(d, second)
    if change in ("requires_grad", "ndarray"):  # the same layout, described anew
        assert sig2 == sig
        assert (
            not d({"t0": ("t0",), "t1": ("t1",)}, [torch.zeros(3), torch.zeros(4, requires_grad=True)])
            .pieces["t1"]
            .data.requires_grad
        )
    else:
        assert sig2 != sig


@pytest.mark.parametrize("kind", ["sparse", "meta", "nested"])
def test_describer_refuses_what_describe_refuses_after_a_plain_save(kind: str) -> None:
    d = Describer()
    d({"t": ("t",)}, [torch.zeros(2, 3)])
    bad = {
        "sparse": torch.zeros(2, 3).to_sparse(),
        "meta": torch.zeros(2, 3, device="meta"),
        "nested": torch.nested.nested_tensor([torch.zeros(3), torch.zeros(3)]),
    }[kind]
    with pytest.raises(UnsupportedStateError):
        d({"t": ("t",)}, [bad])


def test_saves_with_changing_leaves_restore_bitwise(tmp_path: Path) -> None:
    """Through a Checkpointer: between saves a tensor changes dtype, then shape, then is
    replaced by a scalar; each step restores bitwise with its own layout."""
    model, opt = _model_and_adam()
    extra: dict[str, Any] = {"t": torch.arange(6, dtype=torch.float32)}
    states = []
    with Checkpointer(tmp_path, capture_rng=False) as ck:
        for step, value in enumerate(
            [
                torch.arange(6, dtype=torch.float32),
                torch.arange(6, dtype=torch.float64),
                torch.arange(8, dtype=torch.float64).reshape(2, 4),
                7,
                torch.arange(3, dtype=torch.int16),
            ]
        ):
            opt.step()
            extra["t"] = value
            ck.save(step, {"model": model, "optim": opt, "extra": extra})
            ck.wait()
            states.append(
                {
                    "model": {k: v.clone() for k, v in model.state_dict().items()},
                    "extra": {"t": value.clone() if isinstance(value, torch.Tensor) else value},
                }
            )
    with Checkpointer(tmp_path, capture_rng=False) as ck:
        for step, want in enumerate(states):
            target = blank(want)
            ck.restore(target, step=step)
            assert_bitwise(target, want)


def test_an_unchanged_plain_layout_keeps_its_specs_and_gives_the_state_tensors() -> None:
    """A save whose leaves are again plain tensors of the same names, dtypes, shapes and
    devices keeps the last specs and signature, its tensors are the state's own, and its
    pieces, made only when asked for, are describe()'s."""
    d = Describer()
    specs, sig = _check(d, [torch.zeros(3), torch.ones(2, 2), torch.tensor(1.5)])
    values = [torch.ones(3), torch.zeros(2, 2), torch.tensor(2.5)]
    assert _check(d, values) == (specs, sig)
    again = d({f"t{i}": (f"t{i}",) for i in range(3)}, values)
    assert again.specs is specs
    assert all(a is b for a, b in zip(again.data, values))


def test_saves_whose_leaves_change_order_restore_bitwise(tmp_path: Path) -> None:
    """The layout's tasks find each tensor by its place among the save's leaves: a save
    naming the same leaves in another order is a new layout, and each restores bitwise (the
    leaves alike in dtype and shape, so only their places tell them apart)."""
    a, b = torch.arange(6, dtype=torch.float32), torch.arange(100, 106, dtype=torch.float32)
    states = [{"a": a, "b": b}, {"b": b + 1, "a": a + 1}, {"a": a + 2, "b": b + 2}]
    with Checkpointer(tmp_path, capture_rng=False) as ck:
        for step, state in enumerate(states):
            ck.save(step, state)
            ck.wait()
    with Checkpointer(tmp_path, capture_rng=False) as ck:
        for step, want in enumerate(states):
            target = blank(want)
            ck.restore(target, step=step)
            assert_bitwise(target, want)


def test_a_layouts_staging_tasks_are_reused_only_for_the_names_they_were_made_for(tmp_path: Path) -> None:
    """The tasks find each tensor by its place among the save's leaves: reused only where the
    names come in the same order (the signature says so, but for a hash collision), and made
    again from the names otherwise."""
    with Checkpointer(tmp_path, capture_rng=False) as ck:
        ck.save(1, {"a": torch.zeros(4), "b": torch.ones(4)})
        ck.wait()
        saver = ck._saver
        first = saver._placed(saver._describe({"a": ("a",), "b": ("b",)}, [torch.zeros(4), torch.ones(4)]))
        assert saver._placed(saver._describe({"a": ("a",), "b": ("b",)}, [torch.ones(4), torch.ones(4)])) is first
        swapped = saver._placed(saver._describe({"b": ("b",), "a": ("a",)}, [torch.ones(4), torch.zeros(4)]))
        assert {t.array.spec.name: t.leaf for batch in swapped for t in batch.tasks} == {"b": 0, "a": 1}


def test_staging_with_a_stage_batch_copies_what_staging_without_one_does() -> None:
    """stage() given the StageBatch its tasks are (positions, sources and cached views) fills
    the arena as stage() without it, and makes the views again for a new arena buffer."""
    torch.manual_seed(1)
    values = [torch.randn(n) for n in (5, 300, 70, 3, 40000, 70, 70, 70, 70)] + [
        torch.tensor(float(i)) for i in range(5)
    ]
    one = Mesh((1,), (0,))
    specs = [MeshSpec(f"a{i}", "float32", tuple(v.shape), one, (REPLICATE,)) for i, v in enumerate(values)]
    plans = plan_arrays(specs, split_bytes=1 << 20)
    pieces = [describe(v, (f"a{i}",)) for i, v in enumerate(values)]
    leaf = {f"a{i}": i for i in range(len(values))}  # (the plans come by name)
    tasks = [StageTask.of(p, c, leaf[n], pieces[leaf[n]]) for p in plans for c in p.chunks for n in (p.spec.name,)]
    placed, size = assign_offsets(tasks[::-1])  # (their leaves out of order)
    batch = StageBatch.of(placed, size)
    assert batch.runs and batch.joint and batch.single  # every kind of copy is exercised
    assert len(batch.joint) > 1  # (the sources of several batched tasks come in one call)
    for _ in range(2):
        arenas = [Arena().get(size, False) for _ in range(2)]
        for a in arenas:
            a.fill_(0xAB)
        stage(arenas[0], batch.tasks, values, None, gpu=False, batch=batch)
        stage(arenas[1], batch.tasks, values, None, gpu=False)
        assert torch.equal(arenas[0], arenas[1])
        for t in batch.tasks:
            got = arenas[0][t.offset : t.offset + t.staged_bytes].view(torch.float32)
            whole = values[t.leaf].reshape(-1)
            start, rows = (t.chunk.offsets[0], t.chunk.shape[0]) if t.chunk.shape else (0, 1)
            assert torch.equal(got[:rows], whole[start : start + rows])
        values[0].add_(1.0)  # new values, same layout


@pytest.mark.parametrize("mode", ["copy", "overlap_writes", "deferred_staging"])
def test_a_saved_tensor_can_still_grow_and_the_next_save_holds_it(tmp_path: Path, mode: str) -> None:
    """A save leaves the state's tensors as it found them: one that grows afterwards (by
    resize_(), or as the out= of an op of a larger result) grows, and the next save, of the
    new shapes, restores bitwise, as does the one before."""
    torch.manual_seed(0)
    # Each large enough to be copied as one block of memory (small ones go in one batch).
    w = torch.nn.Parameter(torch.randn(256, 256))  # (deferred_staging: the optimizer owns it, copied late)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.randn_like(w)
    opt.step()
    history = torch.arange(16384, dtype=torch.int64)
    order = torch.randperm(16384)
    state = {"w": w, "optim": opt, "history": history, "order": order}
    options = {mode: True} if mode != "copy" else {"overlap_writes": False}
    saved = []
    with Checkpointer(tmp_path, capture_rng=False, **options) as ck:
        for step in range(2):
            saved.append({"w": w.detach().clone(), "history": history.clone(), "order": order.clone()})
            ck.save(step, state)
            ck.wait()
            n = len(history)
            history.resize_(2 * n)  # a log the training loop appends to
            history[n:] = torch.arange(n, 2 * n)
            torch.randperm(2 * len(order), out=order)  # a new epoch's order, over more samples
            with torch.no_grad():
                w.detach().resize_(512, 256).normal_()  # the optimizer's parameter, grown by hand
        for step, want in enumerate(saved):
            got = {k: torch.zeros_like(v) for k, v in want.items()}
            ck.restore(got, step=step)
            assert_bitwise(got, want, f"step {step}")
            for t in got.values():  # a restore leaves its targets as it found them too
                t.resize_(2 * t.shape[0], *t.shape[1:])
