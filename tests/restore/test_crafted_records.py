"""Crafted or damaged records of a version (root.json, manifest fields, the RNG state in a
rank file) make restore() fall back past that version or raise a documented error: never
a raw Python exception, never a silent fresh start, and never a state left half from the
bad version."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from ckpt import Checkpointer
from ckpt.store.errors import CorruptVersionError, ManifestError
from ckpt.store.manifest import parse_manifest, with_checksum
from ckpt.store.versions import version_dirname
from tests._manifests import as_schema_2, crafted
from tests._states import assert_bitwise, blank


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(10, 4, generator=g), "b": torch.randn(300, 256, generator=g)}


def two_steps(root: Path) -> None:
    with Checkpointer(root) as ck:
        for step in (1, 2):
            random.seed(step)
            np.random.seed(step)
            torch.manual_seed(step)
            ck.save(step, state(step))


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.random()), float(torch.rand(1))


def restores_step_1(root: Path) -> None:
    """restore() falls back to step 1: its tensors and its RNG, bitwise."""
    target = blank(state(1))
    with Checkpointer(root) as ck:
        assert ck.restore(target) == 1
        assert_bitwise(target, state(1))
        got = draws()
        ck.restore(blank(state(1)), step=1)
    assert got == draws()


# -- root.json ---------------------------------------------------------------------------------


ROOT_INFO: dict[str, Callable[[Path], None]] = {
    "garbage": lambda p: p.write_bytes(b"\x00\x01 not json"),
    "missing": lambda p: p.unlink(),
    "nested": lambda p: p.write_bytes(b"[" * 200_000),  # RecursionError in json, caught
    "huge-world": lambda p: p.write_text(json.dumps({**json.loads(p.read_bytes()), "world_size": 1 << 40})),
}


@pytest.mark.parametrize("damage", sorted(ROOT_INFO))
def test_damaged_root_info_is_named_and_passed(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    two_steps(tmp_path)
    ROOT_INFO[damage](tmp_path / version_dirname(2) / "root.json")
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        restores_step_1(tmp_path)
    assert f"step 2 skipped, {tmp_path}/{version_dirname(2)}/root.json is missing or damaged" in caplog.text


def test_only_version_with_damaged_root_info_is_no_fresh_start(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state(1))
    (tmp_path / version_dirname(1) / "root.json").write_bytes(b"{torn")
    with Checkpointer(tmp_path) as ck:
        assert ck.steps() == [1]
        with pytest.raises(CorruptVersionError, match=r"root.json is missing or damaged\); not starting from scratch"):
            ck.restore(blank(state(1)))


# -- manifest fields ---------------------------------------------------------------------------


def _edit(path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads(path.read_bytes())
    fn(doc)
    path.write_bytes(crafted(doc))


@pytest.mark.parametrize(
    "case",
    [
        lambda d: d["arrays"]["w"].__setitem__("data_type", []),
        lambda d: d["ranks"][0].__setitem__("tree", [1]),  # schema 2
        lambda d: d["arrays"]["w"].__setitem__("regions", [{"offsets": [0, 0], "shape": [[10], 4], "ranks": [0]}]),
    ],
    ids=["data-type-a-list", "rank-tree-a-list", "region-shape-nested"],
)
def test_crafted_manifest_fields_are_manifest_errors(tmp_path: Path, case: Callable[[dict[str, Any]], None]) -> None:
    two_steps(tmp_path)
    version = tmp_path / version_dirname(2)
    as_schema_2(version)
    manifest = version / "manifest.json"
    parse_manifest(manifest.read_bytes())  # valid as converted
    _edit(manifest, case)
    with pytest.raises(ManifestError):
        parse_manifest(manifest.read_bytes())
    restores_step_1(tmp_path)


def test_created_beyond_a_float_is_no_overflow(tmp_path: Path) -> None:
    two_steps(tmp_path)
    manifest = tmp_path / version_dirname(2) / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    doc.pop("manifest_xxh3")
    body = json.dumps(doc, separators=(",", ":")).replace(f'"created":{doc["created"]}', '"created":1' + "0" * 400)
    manifest.write_bytes(with_checksum(body.encode()))
    assert parse_manifest(manifest.read_bytes()).created == 0.0
    target = blank(state(2))
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(target) == 2
    assert_bitwise(target, state(2))


# -- the RNG state in a rank file --------------------------------------------------------------


RNG: dict[str, Callable[[dict[str, Any]], None]] = {
    "numpy-keys-empty": lambda r: r["numpy"].__setitem__("keys", ""),
    "numpy-name": lambda r: r["numpy"].__setitem__("name", "PCG64"),
    "numpy-no-has-gauss": lambda r: r["numpy"].pop("has_gauss"),
    "python-version": lambda r: r["python"].__setitem__("version", 99),
    "torch-state-short": lambda r: r.__setitem__("torch", "AAAA"),
}


@pytest.mark.parametrize("case", sorted(RNG))
def test_crafted_rng_state_is_refused_before_restoring(tmp_path: Path, case: str) -> None:
    """A rank file whose RNG state passes the manifest's shape checks but that no generator
    takes, in a version whose checksums all match (crafted): the version is refused before
    any of it is restored, and step 1 restored whole."""
    two_steps(tmp_path)
    version = tmp_path / version_dirname(2)
    rank = json.loads((version / "ranks" / "0.json").read_bytes())
    RNG[case](rank["rng"])
    raw = json.dumps(rank, separators=(",", ":")).encode()
    (version / "ranks" / "0.json").write_bytes(raw)
    doc = json.loads((version / "manifest.json").read_bytes())
    doc.pop("manifest_xxh3")
    doc["ranks"][0] = [len(raw), xxhash.xxh3_64_hexdigest(raw)]
    (version / "manifest.json").write_bytes(with_checksum(json.dumps(doc, separators=(",", ":")).encode()))
    restores_step_1(tmp_path)


# -- falling back past a version that failed part-way ------------------------------------------


def _trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.ones(2, 16)).sum().backward()
        opt.step()
    return model, opt


def _damage_model_chunks(root: Path, step: int) -> None:
    for f in (root / version_dirname(step) / "state" / "model").rglob("c.*"):
        raw = bytearray(f.read_bytes())
        raw[0] ^= 0xFF
        f.write_bytes(bytes(raw))


def _saved_then_damaged(root: Path, *, params_only_first: bool) -> dict[str, torch.Tensor]:
    """Step 1 (params-only, or full), step 2 full with its model's chunks damaged; step 1's
    Adam state of the weight."""
    model, opt = _trained(1)
    with Checkpointer(root) as ck:
        ck.save(1, {"model": model, "optim": opt}, only=("model",) if params_only_first else None)
        want = {k: v.clone() for k, v in opt.state[model.weight].items()}
        model(torch.ones(2, 16)).sum().backward()
        opt.step()
        ck.save(2, {"model": model, "optim": opt})
    _damage_model_chunks(root, 2)
    return want


def test_no_fallback_to_a_version_lacking_keys_a_failed_attempt_filled(tmp_path: Path) -> None:
    """Step 1 is params-only, step 2 full with its model damaged: the read of step 2 fills the
    optimizer before it fails, so step 1 (no optimizer) would leave step 2's optimizer state
    beside step 1's model. restore(strict=False) raises instead of returning 1."""
    _saved_then_damaged(tmp_path, params_only_first=True)
    m2, o2 = _trained(1)
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(CorruptVersionError, match="partly overwritten"):
            ck.restore({"model": m2, "optim": o2}, strict=False)


def test_strict_false_falls_back_to_a_version_holding_what_was_filled(tmp_path: Path) -> None:
    want = _saved_then_damaged(tmp_path, params_only_first=False)
    m2, o2 = _trained(1)
    with Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": m2, "optim": o2}, strict=False) == 1
    assert all(torch.equal(o2.state[m2.weight][k], v) for k, v in want.items())


def _tree_state(v: int) -> dict[str, Any]:
    return {"w": torch.full((3,), float(v)), "h": torch.full((2,), float(v), dtype=torch.bfloat16), "cfg": {"a": v}}


def _two_steps_with_cfg(tmp_path: Path, node: Any) -> Path:
    """A root with steps 1 and 2 of _tree_state, step 2's rank file holding `node` as "cfg",
    its checksums recomputed (as a hostile writer could)."""
    root = tmp_path / "root"
    with Checkpointer(root) as ck:
        ck.save(1, _tree_state(1))
        ck.save(2, _tree_state(2))
        ck.wait()
    version = root / version_dirname(2)
    path = version / "ranks" / "0.json"
    doc = json.loads(path.read_bytes())
    doc["tree"]["cfg"] = node
    raw = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(raw)
    m = json.loads((version / "manifest.json").read_bytes())
    m["ranks"][0] = [len(raw), xxhash.xxh3_64_hexdigest(raw)]
    (version / "manifest.json").write_bytes(crafted(m))
    return root


def _deep(n: int) -> Any:
    node: Any = 1
    for _ in range(n):
        node = [node]
    return node


@pytest.mark.parametrize(
    "node",
    [
        {"__dict__": 5},
        {"__float__": "abc"},
        {"__float__": "1.5"},
        {"__dict__": [["a", 1, 2]]},
        {"__dict__": [[["a"], 1]]},
        {"__tuple__": {"a": 1}},
        {"__tensor__": 3},
        {"__object__": {}, "b": 1},
        {"__tensor__": "nope"},
        {"__ndarray__": "h"},
        _deep(600),
        _deep(450),
    ],
    ids=lambda n: json.dumps(n)[:60],
)
def test_a_crafted_state_tree_is_damage_and_the_older_version_is_restored(tmp_path: Path, node: dict[str, Any]) -> None:
    """A rank file (checksums valid) whose state tree holds a node ckpt never writes (an array
    the manifest lacks, an ndarray of bfloat16, nesting no save makes) is a ManifestError: restore falls back to the older version and `ckpt restore` exits with
    one line (exit 1, damage). Before, bind and the export's decoding raised TypeError or ValueError, and
    the restore neither fell back nor named the damage (RecursionError, KeyError, TypeError)."""
    from click.testing import CliRunner

    from ckpt.cli import main as cli

    root = _two_steps_with_cfg(tmp_path, node)
    got = _tree_state(0)
    with Checkpointer(root) as ck:
        assert ck.restore(got) == 1
        with pytest.raises(CorruptVersionError, match="state tree holds"):
            ck.restore(_tree_state(0), step=2)
    assert_bitwise(got, _tree_state(1))
    out = CliRunner().invoke(cli, ["restore", str(root), "--step", "2", "--to-torch", str(tmp_path / "out.pt")])
    assert out.exit_code == 1 and "state tree holds" in out.output, out.output  # 1: damage
    assert len(out.output.strip().splitlines()) == 1, out.output


def test_a_tree_nested_as_deep_as_saves_before_the_bound_wrote_is_read(tmp_path: Path) -> None:
    """Saves before MAX_SAVED_DEPTH nested trees up to Python's recursion limit (~450
    levels): a reader takes trees to MAX_TREE_DEPTH, so a 300-level one still restores."""
    deep: Any = 5
    for _ in range(300):
        deep = {"k": deep}
    root = _two_steps_with_cfg(tmp_path, deep)
    got = {**_tree_state(0), "cfg": None}
    with Checkpointer(root) as ck:
        assert ck.restore(got) == 2
    assert got["cfg"] == deep


def test_an_ndarray_of_bfloat16_is_refused_whatever_names_numpy_was_given() -> None:
    """ml_dtypes (tensorstore's dependency) registers "bfloat16" with NumPy when imported, so
    np.dtype("bfloat16") then answers; torch still cannot make an ndarray of one. Before,
    the check asked np.dtype(), and passed such a tree once tensorstore had been imported
    (the suite's order decided the outcome)."""
    import ml_dtypes
    import numpy as np

    from ckpt.store.tree_format import tree_problem

    assert np.dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)  # the name is registered now
    for data_type in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        assert tree_problem({"a": {"__ndarray__": "h"}}, {"h": data_type}) is not None, data_type
    assert tree_problem({"a": {"__ndarray__": "h"}}, {"h": "float32"}) is None
