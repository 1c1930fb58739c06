"""Careless and hostile use of the API: the edges where data was lost silently (issue 18).

Steps beyond the 12-digit range, version directories that lost their manifest (or files
named like versions), restore into something that is not a state or with a state of
another shape, state keys that collide with the format's names or exceed file-name
limits, roots inside versions, retention without a replicator, and tensors ckpt refuses.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner

from ckpt import Checkpointer
from ckpt._listing import version_rows
from ckpt.cli import main as cli
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.policy import KeepLast, KeepMilestones
from ckpt.store.errors import StateMismatchError, UnsupportedStateError, VersionNotFoundError
from ckpt.store.manifest import MANIFEST_NAME
from ckpt.store.tier import open_tier
from ckpt.store.versions import MAX_STEP, committed_steps, version_dirname
from tests._dist import can_isolate, in_private_mounts
from tests._states import assert_bitwise


def _save(root: Path, *steps: int, **config: object) -> None:
    with Checkpointer(root, **config) as ck:  # type: ignore[arg-type]
        for s in steps:
            ck.save(s, {"w": torch.full((4,), float(s)), "step": s})


# -- the step range -----------------------------------------------------------------------


def test_steps_beyond_twelve_digits_are_refused_up_front(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(ValueError, match="0..999999999999"):
            ck.save(MAX_STEP + 1, {"w": torch.ones(2)})
        with pytest.raises(ValueError):
            ck.restore({"w": torch.ones(2)}, step=MAX_STEP + 1)
    assert sorted(os.listdir(tmp_path)) == [".ckpt-root-id", ".ckpt.lock"]  # nothing written, no tmp left


def test_the_largest_step_round_trips(tmp_path: Path) -> None:
    _save(tmp_path, 1, MAX_STEP)
    assert committed_steps(tmp_path) == [1, MAX_STEP]
    got = {"w": torch.zeros(4), "step": 0}
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(got) == MAX_STEP
    assert_bitwise(got, {"w": torch.full((4,), float(MAX_STEP)), "step": MAX_STEP})
    result = CliRunner().invoke(cli, ["gc", str(tmp_path), "--keep-last", "1"])
    assert result.exit_code == 0, result.output
    assert committed_steps(tmp_path) == [MAX_STEP]


# -- version directories that are no versions ----------------------------------------------


@pytest.fixture(params=["lost-manifest", "stray-file", "dangling-link"])
def damaged_root(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, int]:
    """A root with steps 1 and 2 committed, and step 3's entry damaged."""
    root = tmp_path / "root"
    _save(root, 1, 2, 3)
    v3 = root / version_dirname(3)
    if request.param == "lost-manifest":
        (v3 / MANIFEST_NAME).unlink()
    else:
        shutil.rmtree(v3)
        if request.param == "stray-file":
            v3.write_bytes(b"not a version")
        else:
            v3.symlink_to(tmp_path / "nowhere")
    return root, 3


def test_a_damaged_entry_is_listed_verified_and_warned_about(
    damaged_root: tuple[Path, int], caplog: pytest.LogCaptureFixture
) -> None:
    root, step = damaged_root
    rows = {r.step: r for r in version_rows(open_tier(str(root)))}
    assert rows[step].status == "damaged" and rows[step].detail, rows
    assert [rows[1].status, rows[2].status] == ["committed", "committed"]
    ls = CliRunner().invoke(cli, ["ls", str(root), "--json"])
    assert ls.exit_code == 0, ls.output
    assert {r["step"]: r["status"] for r in json.loads(ls.output)}[step] == "damaged"
    verify = CliRunner().invoke(cli, ["verify", str(root)])
    assert verify.exit_code == 1, verify.output
    assert version_dirname(step) in verify.output
    got = {"w": torch.zeros(4), "step": 0}
    with caplog.at_level(logging.WARNING, logger="ckpt"), Checkpointer(root) as ck:
        assert ck.restore(got) == 2
    assert any(version_dirname(step) in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)


def test_saving_the_step_again_replaces_a_damaged_entry(damaged_root: tuple[Path, int]) -> None:
    root, step = damaged_root
    _save(root, step)
    assert committed_steps(root) == [1, 2, step]
    got = {"w": torch.zeros(4), "step": 0}
    with Checkpointer(root) as ck:
        assert ck.restore(got) == step
    assert_bitwise(got, {"w": torch.full((4,), float(step)), "step": step})
    assert os.listdir(root / ".trash") == []  # moved aside, then deleted
    assert (root.parent / "nowhere").exists() is False  # a link's target is never touched


def test_gc_collects_a_damaged_entry_but_not_while_a_writer_holds_the_root(damaged_root: tuple[Path, int]) -> None:
    root, step = damaged_root
    with Checkpointer(root):
        held = CliRunner().invoke(cli, ["gc", str(root), "--keep-last", "5"])
        assert held.exit_code == 0, held.output
        assert os.path.lexists(root / version_dirname(step))  # the writer replaces it when it saves that step
    result = CliRunner().invoke(cli, ["gc", str(root), "--keep-last", "5"])
    assert result.exit_code == 0, result.output
    if (root / version_dirname(step)).is_dir() and not (root / version_dirname(step)).is_symlink():
        # A version that lost its manifest keeps its chunks: a damaged version, which the
        # policy keeps while keep_last counts it (it was deleted whatever the policy said).
        assert "damaged" not in result.output and committed_steps(root) == [1, 2], result.output
        _save(root, 4, 5)
        result = CliRunner().invoke(cli, ["gc", str(root), "--keep-last", "2"])
        assert result.exit_code == 0, result.output
        assert committed_steps(root) == [4, 5]
    assert "damaged" in result.output
    assert not os.path.lexists(root / version_dirname(step))
    assert committed_steps(root)[:2] in ([1, 2], [4, 5])


def test_a_replica_directory_without_a_manifest_is_a_copy_in_progress(tmp_path: Path) -> None:
    """Only a Checkpointer's root publishes by rename; a replica fills v<N>/ in place."""
    replica = tmp_path / "replica"
    (replica / version_dirname(4) / "state").mkdir(parents=True)
    assert [r.status for r in version_rows(open_tier(str(replica)))] == []


# -- what restore() accepts -------------------------------------------------------------


@pytest.mark.parametrize("state", [[torch.zeros(4)], (torch.zeros(4),), None, 42])
def test_restore_refuses_a_state_that_is_not_a_dict(tmp_path: Path, state: object) -> None:
    _save(tmp_path, 5)
    with Checkpointer(tmp_path) as ck, pytest.raises(UnsupportedStateError, match="must be a dict"):
        ck.restore(state)  # type: ignore[arg-type]


def test_restore_checks_the_type_of_step(tmp_path: Path) -> None:
    _save(tmp_path, 5)
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(ValueError, match="must be an int, not str"):
            ck.restore({"w": torch.zeros(4), "step": 0}, step="5")  # type: ignore[arg-type]
        assert ck.restore({"w": torch.zeros(4), "step": 0}, step=5) == 5


def test_restore_is_strict_both_ways_below_the_top_by_default(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.ones(3), "opt": {"lr": 0.1, "m": torch.ones(2)}, "n": 7})
        ck.wait()
        top = {"w": torch.zeros(3), "opt": {"lr": 0.0, "m": torch.zeros(2)}}
        assert ck.restore(top) == 1  # the state's top-level keys choose what is restored
        assert_bitwise(top, {"w": torch.ones(3), "opt": {"lr": 0.1, "m": torch.ones(2)}})
        with pytest.raises(VersionNotFoundError, match=r"holds every key of the state \['n', 'opt', 'w', 'x'\]") as e:
            ck.restore({"w": torch.zeros(3), "opt": {"lr": 0.0, "m": torch.zeros(2)}, "n": 0, "x": 1})
        assert "the newest holding ['n', 'opt', 'w'] is step 1" in str(e.value)
        with pytest.raises(StateMismatchError, match=r"\['x'\] are in the state but not in the checkpoint"):
            ck.restore({"w": torch.zeros(3), "opt": {"lr": 0.0, "m": torch.zeros(2)}, "n": 0, "x": 1}, step=1)
        with pytest.raises(StateMismatchError, match=r"\['m'\] are in the checkpoint"):
            ck.restore({"w": torch.zeros(3), "opt": {"lr": 0.0}, "n": 0})
        target = {"w": torch.zeros(3), "opt": {"lr": 0.0, "m": torch.zeros(2)}, "n": 0}
        assert ck.restore(target) == 1
    assert_bitwise(target, {"w": torch.ones(3), "opt": {"lr": 0.1, "m": torch.ones(2)}, "n": 7})


def test_a_slot_takes_only_a_saved_value_of_its_kind(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"a": 5, "b": [1, 2], "c": torch.ones(2), "d": {"k": 1}})
        ck.wait()
        live = {"a": 0, "b": [], "c": torch.zeros(2), "d": {"k": 0}}
        for key, wrong in [("a", torch.zeros(2)), ("b", {"x": 1}), ("d", [1]), ("c", 3)]:
            with pytest.raises(StateMismatchError, match=rf"state\['{key}'\]"):
                ck.restore({**live, key: wrong})
        swapped = {"a": 0, "b": [], "c": torch.zeros(2), "d": {"k": 0}}
        assert ck.restore(swapped) == 1  # a list of another length, scalars: values
        assert swapped["b"] == [1, 2] and swapped["a"] == 5
        placeholder = {"a": None, "b": None, "c": None, "d": None}  # None takes anything
        assert ck.restore(placeholder) == 1
        assert_bitwise(placeholder, {"a": 5, "b": [1, 2], "c": torch.ones(2), "d": {"k": 1}})


def test_strict_false_loads_the_keys_both_sides_have(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.ones(3), "opt": {"m": torch.ones(2)}, "n": 7})
        ck.wait()
        partial = {"w": torch.zeros(3), "mine": torch.full((2,), 9.0)}
        assert ck.restore(partial, strict=False) == 1
    assert_bitwise(partial, {"w": torch.ones(3), "mine": torch.full((2,), 9.0)})  # nothing added, nothing lost


# -- state keys ------------------------------------------------------------------------


def test_keys_that_collide_with_the_format_or_exceed_name_limits_round_trip(tmp_path: Path) -> None:
    long = "k" * 300
    state = {
        "zarr.json": torch.arange(3.0),
        "g": {"zarr.json": torch.arange(4.0), long: torch.arange(5.0), "c.0": torch.arange(2.0)},
        long + "x": torch.arange(6.0),
        long + "y": {"n": 1},
    }
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state)
        ck.wait()
        got = {
            "zarr.json": torch.zeros(3),
            "g": {"zarr.json": torch.zeros(4), long: torch.zeros(5), "c.0": torch.zeros(2)},
            long + "x": torch.zeros(6),
            long + "y": {"n": 0},
        }
        assert ck.restore(got) == 1
    assert_bitwise(got, state)
    for _, dirs, files in os.walk(tmp_path):
        assert all(len(n.encode()) <= 255 for n in dirs + files)
    # zarr-python reads every array of the version through the zarr.json documents
    group = zarr.open_group(str(tmp_path / version_dirname(1) / "state"), mode="r")
    arrays = sorted(float(a[...].sum()) for _, a in group.arrays())
    assert arrays == [3.0, 15.0], arrays  # state/zarr.json and the long-named one at the top
    assert CliRunner().invoke(cli, ["verify", str(tmp_path)]).exit_code == 0


def _keys(n: int, letter: str = "k") -> list[str]:
    """Keys of at most 127 characters (none escaped or hashed) whose array name is n bytes."""
    keys = []
    while n > 128:
        keys.append(letter * 127)
        n -= 128
    return [*keys, letter * n]


def _chain(keys: list[str], leaf: object) -> dict[str, object]:
    """{keys[0]: {keys[1]: ... leaf}}."""
    for k in reversed(keys):
        leaf = {k: leaf}
    return leaf  # type: ignore[return-value]


@pytest.mark.parametrize("over", [1, 2200])  # just over the limit; over PATH_MAX under any root
def test_a_key_path_too_long_for_a_file_path_is_refused_at_save(tmp_path: Path, over: int) -> None:
    """Such a key path failed the save as TierUnavailableError (ENAMETOOLONG), blaming the
    root; one just over the limit saved a version that a longer root cannot hold."""
    limit = 2048  # ckpt.store.manifest.MAX_NAME_BYTES
    keys = _keys(limit + over)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.arange(4.0)})
        ck.wait()
        with pytest.raises(UnsupportedStateError) as info:
            ck.save(2, {"w": torch.ones(4), **_chain(keys, torch.ones(2))})
        ck.wait()
        msg = str(info.value)
        assert msg.startswith(f"state[{keys[0]!r}]") and f"[{keys[-1]!r}]: " in msg, msg
        assert f"array name of {limit + over} bytes" in msg and f"at most {limit}" in msg, msg
        assert ck.steps() == [1]
        got = {"w": torch.zeros(4)}
        assert ck.restore(got) == 1
    assert_bitwise(got, {"w": torch.arange(4.0)})
    assert [n for n in os.listdir(tmp_path) if n.startswith("v")] == [version_dirname(1)]  # no tmp left


def test_the_longest_key_path_that_fits_round_trips(tmp_path: Path) -> None:
    from ckpt.store.manifest import MAX_NAME_BYTES

    keys = _keys(MAX_NAME_BYTES)
    state = {"w": torch.arange(3.0), **_chain(keys, torch.arange(5.0)), **_chain(_keys(9000, "j"), {"n": 1})}
    with Checkpointer(tmp_path) as ck:  # (a deep path to JSON values names no file: any length)
        ck.save(1, state)
        ck.wait()
        got = {"w": torch.zeros(3), **_chain(keys, torch.zeros(5)), **_chain(_keys(9000, "j"), {"n": 0})}
        assert ck.restore(got) == 1
    assert_bitwise(got, state)
    manifest = json.loads((tmp_path / version_dirname(1) / MANIFEST_NAME).read_text())
    assert sorted(map(len, manifest["arrays"])) == [1, MAX_NAME_BYTES]


# -- roots -----------------------------------------------------------------------------


def test_a_root_inside_a_version_is_refused(tmp_path: Path) -> None:
    _save(tmp_path, 5)
    inside = tmp_path / version_dirname(5) / "inner"
    with pytest.raises(ValueError, match="inside the version directory"):
        Checkpointer(inside)
    assert not inside.exists()
    assert CliRunner().invoke(cli, ["verify", str(tmp_path)]).exit_code == 0


# -- retention without a replicator -----------------------------------------------------


def test_keep_last_applies_after_each_commit_and_keeps_milestones(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep_last=2, keep_every=5) as ck:
        for s in range(1, 13):
            ck.save(s, {"w": torch.full((4,), float(s))}, milestone=s == 3)
    assert committed_steps(tmp_path) == [3, 5, 10, 11, 12]
    with pytest.raises(ValueError, match="keep_every needs keep_last"):
        Checkpointer(tmp_path, keep_every=5)
    with pytest.raises(ValueError, match="keep_last must be"):
        Checkpointer(tmp_path, keep_last=0)


def test_keep_last_never_deletes_the_newest_intact_version(tmp_path: Path) -> None:
    _save(tmp_path, 1, 2)
    (tmp_path / version_dirname(2) / "state" / "w" / "c.0").write_bytes(b"garbage!" * 2)
    with Checkpointer(tmp_path, keep_last=1) as ck:
        ck.save(3, {"w": torch.ones(4), "step": 3})
    # 3 is the newest; the damaged 2 goes; 1 goes as well: 3 is intact
    assert committed_steps(tmp_path) == [3]
    (tmp_path / version_dirname(3) / "state" / "w" / "c.0").write_bytes(b"garbage!" * 2)
    with Checkpointer(tmp_path, keep_last=1) as ck:
        ck.save(4, {"w": torch.ones(4), "step": 4})
    assert committed_steps(tmp_path) == [4]


@pytest.mark.skipif(not can_isolate(), reason="needs root, unshare(1) and mount namespaces")
def test_low_free_space_is_warned_about(tmp_path: Path) -> None:
    """On a real 4 MiB tmpfs (in a private mount namespace), a 1.5 MiB version leaves room
    for fewer than two more."""
    script = textwrap.dedent(
        f"""
        import logging, torch
        from ckpt import Checkpointer
        from ckpt.store import metrics
        logging.basicConfig(level=logging.WARNING)
        with Checkpointer({str(tmp_path / "small")!r}, direct_io=False) as ck:
            ck.save(1, {{"w": torch.ones(3 << 17)}})
        print("warnings", metrics.LOW_SPACE_WARNINGS._value.get())
        """
    )
    (tmp_path / "small").mkdir()
    out = in_private_mounts(f"mount -t tmpfs -o size=4m tmpfs {tmp_path / 'small'}", script)
    assert out.returncode == 0, out.stderr
    assert "room for fewer than two more versions" in out.stderr
    assert "warnings 1.0" in out.stdout


# -- tensors ckpt refuses ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensors"),
        (lambda: torch.ones(2, device="meta"), "meta tensor"),
        (lambda: torch.ones(2, 2).to_sparse(), "sparse_coo tensors"),
        (lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8), "quantized"),
        (lambda: _two(4), "a TwoTensor wraps other tensors"),
        (lambda: _two(1 << 18), "a TwoTensor wraps other tensors"),  # (large enough for the memcpy path)
    ],
)
def test_unsupported_tensors_raise_the_documented_type(tmp_path: Path, value: object, why: str) -> None:
    with Checkpointer(tmp_path) as ck, pytest.raises(UnsupportedStateError, match=why) as info:
        ck.save(1, {"t": value()})  # type: ignore[operator]
    assert "torch.strided" not in str(info.value)
    assert str(info.value).startswith("state['t']: ")


def _two(n: int) -> torch.Tensor:
    """A wrapper tensor subclass (torch's own test one, built as torchao's are): no memory of
    its own. Before, a save stored whatever its copy_ made of it (here its second tensor,
    silently), or failed in the copy with RuntimeError; a restore into one failed so."""
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.arange(float(n)), torch.arange(float(n)) * 2)


def test_a_restore_into_a_wrapper_subclass_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"t": torch.arange(4.0), "u": torch.ones(2)})
        ck.wait()
        target = {"t": _two(4), "u": torch.zeros(2)}
        with pytest.raises(UnsupportedStateError, match=r"state\['t'\]: a TwoTensor wraps other tensors"):
            ck.restore(target)
    assert torch.equal(target["u"], torch.zeros(2))
    assert torch.equal(target["t"].a, torch.arange(4.0)) and torch.equal(target["t"].b, torch.arange(4.0) * 2)  # type: ignore[attr-defined]


class _Counted:
    """An object with state whose state_dict() calls are counted."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w, self.calls = w, 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {"w": self.w}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.w.copy_(sd["w"])


def test_a_dict_whose_later_keys_are_not_strings_round_trips(tmp_path: Path) -> None:
    """A dict whose later keys are not strings is encoded as keyed pairs, each tensor once,
    each object's state_dict() called once."""
    obj = _Counted(torch.arange(5.0))
    state = {
        "p": torch.arange(1.0),
        "x": {"a": torch.arange(2.0), "b": {"c": torch.arange(3.0), 2: obj}, 7: torch.arange(4.0), None: 5},
    }
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state)
        ck.wait()
        assert obj.calls == 1
        back = _Counted(torch.zeros(5))
        got = {
            "p": torch.zeros(1),
            "x": {"a": torch.zeros(2), "b": {"c": torch.zeros(3), 2: back}, 7: torch.zeros(4), None: 0},
        }
        assert ck.restore(got) == 1
    assert_bitwise(back.w, obj.w)
    got["x"]["b"][2] = state["x"]["b"][2] = None  # type: ignore[index]
    assert_bitwise(got, state)
    manifest = json.loads((tmp_path / version_dirname(1) / MANIFEST_NAME).read_text())
    names = sorted(manifest["arrays"])
    assert names == ["p", "x/7", "x/a", "x/b/2/w", "x/b/c"], names


def test_a_key_of_an_unsupported_type_is_named_before_any_value_is_encoded(tmp_path: Path) -> None:
    state = {"x": {"b": {"1": torch.ones(1), 1: torch.ones(1)}, (1,): 0}}
    with Checkpointer(tmp_path) as ck, pytest.raises(UnsupportedStateError) as info:
        ck.save(1, state)  # type: ignore[dict-item]
    assert str(info.value) == "state['x']: dict key (1,) of type tuple"


@pytest.mark.parametrize("where", ["top", "nested"])
def test_a_key_that_is_not_valid_unicode_is_refused_before_anything_is_written(tmp_path: Path, where: str) -> None:
    bad = "w\udcff"  # a lone surrogate, as os.fsdecode makes of undecodable bytes
    state = {bad: torch.ones(2)} if where == "top" else {"model": {bad: torch.ones(2)}}
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(UnsupportedStateError, match="not valid Unicode"):
            ck.save(1, state)
        assert ck.latest_step() is None
        ck.save(2, {"model": {"w": torch.ones(2)}})  # the next save is not hindered
        ck.wait()
        assert ck.latest_step() == 2


def test_two_keys_that_name_one_array_are_refused_with_both_key_paths(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck, pytest.raises(UnsupportedStateError) as info:
        ck.save(1, {"x": {1: torch.ones(2), "1": torch.zeros(2)}})
    assert str(info.value) == "state['x']['1'] and state['x'][1] map to the same array name 'x/1'"
    assert ck.steps() == []


# -- found by review (2026-12-05): each failed on the code before its fix ---------------------


@pytest.mark.parametrize("key", ["__tensor__", "__dict__", "__float__", 1, None, True])
def test_top_level_keys_that_would_not_restore_are_refused_at_save(tmp_path: Path, key: object) -> None:
    """Such a key committed a version that no restore into the same state could read."""
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(UnsupportedStateError, match="top-level state key"):
            ck.save(1, {key: torch.ones(2), "b": torch.zeros(2)})  # type: ignore[dict-item]
        assert ck.steps() == []
        ck.save(1, {"w": {key: torch.ones(2)}})  # below the top, with its type
        got = {"w": {key: torch.zeros(2)}}
        assert ck.restore(got) == 1  # type: ignore[arg-type]
    assert_bitwise(got, {"w": {key: torch.ones(2)}})  # type: ignore[arg-type]


def test_a_read_only_array_in_the_state_is_a_mismatch_not_damage(tmp_path: Path) -> None:
    import numpy as np

    state = {"a": np.arange(12.0), "w": torch.ones(3)}
    with Checkpointer(tmp_path / "root") as ck:
        ck.save(1, state)
    np.save(tmp_path / "a.npy", np.zeros(12))
    mapped = np.load(tmp_path / "a.npy", mmap_mode="r")  # read-only: a read into it fails (EFAULT)
    frozen = np.zeros(12)
    frozen.flags.writeable = False
    for target in (mapped, frozen):
        with Checkpointer(tmp_path / "root") as ck:
            with pytest.raises(StateMismatchError, match="read-only"):
                ck.restore({"a": target, "w": torch.zeros(3)})
            assert ck.steps() == [1]
        assert not np.asarray(target).any()  # nothing written into it
    got = {"a": np.zeros(12), "w": torch.zeros(3)}
    with Checkpointer(tmp_path / "root") as ck:
        assert ck.restore(got) == 1  # the version is intact
    assert (got["a"] == np.arange(12.0)).all()


def test_an_empty_root_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unset environment variable made the working directory a checkpoint root."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="root is empty"):
        Checkpointer("")
    with pytest.raises(ValueError, match="root is empty"):
        Checkpointer(lambda rank: "")
    for args in (["ls", ""], ["verify", ""], ["restore", str(tmp_path), "--tier", "", "--to-torch", "x.pt"]):
        out = CliRunner().invoke(cli, args)
        assert out.exit_code == 2 and "is empty" in out.output, (args, out.output)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("content", [b"garbage bytes here\n", b""], ids=["not-a-pickle", "empty"])
def test_import_of_a_file_that_is_no_torch_save_file_is_one_line(tmp_path: Path, content: bytes) -> None:
    src = tmp_path / "x.pt"
    src.write_bytes(content)
    out = CliRunner().invoke(cli, ["import", str(src), str(tmp_path / "root"), "--step", "1", "--trust"])
    assert out.exit_code == 3, out.output
    assert out.stderr.startswith("ckpt: error: ") and out.stderr.count("\n") == 1, out.stderr
    assert "not a readable torch.save file" in out.stderr


def test_import_of_a_dcp_directory_with_a_damaged_metadata_is_one_line(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(b"junk\n")
    out = CliRunner().invoke(cli, ["import", str(src), str(tmp_path / "root"), "--step", "1", "--trust"])
    assert out.exit_code == 3, out.output
    assert "not a readable DCP checkpoint" in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.parametrize("cmd", ["inspect", "restore"])
def test_a_damaged_version_asked_for_by_step_is_damage(
    damaged_root: tuple[Path, int], tmp_path: Path, cmd: str
) -> None:
    """README, exit codes: 1 for a corrupt version asked for by restore/inspect --step; a
    version directory that lost its manifest (or a file in its place) is one."""
    root, step = damaged_root
    args = [cmd, str(root), "--step", str(step)] + (
        ["--to-torch", str(tmp_path / "out.pt")] if cmd == "restore" else []
    )
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 1, out.output
    assert out.stderr.splitlines()[-1].startswith(f"ckpt: error: step {step} is damaged"), out.stderr
    assert "Traceback" not in out.stderr
    got = {"w": torch.zeros(4), "step": 0}
    with Checkpointer(root) as ck:
        assert ck.restore(got, step=2) == 2  # the others are unaffected


def test_a_state_nested_beyond_the_recursion_limit_is_refused(tmp_path: Path) -> None:
    deep: dict[str, object] = {"w": torch.ones(2)}
    for _ in range(5_000):
        deep = {"d": deep}
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(UnsupportedStateError, match="nested deeper than"):
            ck.save(1, {"s": deep})
        assert ck.steps() == []


@pytest.mark.parametrize("port", [-1, 0, 65536, True, "9100"])
def test_a_metrics_port_that_is_no_port_is_refused(tmp_path: Path, port: object) -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        Checkpointer(tmp_path, metrics_port=port)  # type: ignore[arg-type]


@pytest.mark.parametrize("flags", [{"milestone": "no"}, {"overwrite": 1}, {"milestone": None}])
def test_save_flags_that_are_no_bools_are_refused(tmp_path: Path, flags: dict[str, object]) -> None:
    """milestone="no" was stored, and kept as a milestone."""
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(TypeError, match="must be bools"):
            ck.save(1, {"w": torch.ones(2)}, **flags)  # type: ignore[arg-type]
        assert ck.steps() == []


@pytest.mark.parametrize(
    "make",
    [
        lambda root: Checkpointer(root, keep_last=2.5),
        lambda root: Checkpointer(root, keep_last=3, keep_every=2.5),
        lambda root: Checkpointer(root, keep_last=3, keep_every=True),
        lambda root: Checkpointer(root, full_every=2.5, partial_keys=("model",)),
        lambda root: Checkpointer(root, preemption_signals=signal.SIGTERM),
        lambda root: KeepLast(2.5),
        lambda root: KeepMilestones(every=2.5),
        lambda root: ReplicatorConfig(replicas=2, replica_roots=str(root)),
    ],
    ids=[
        "keep_last-float",
        "keep_every-float",
        "keep_every-bool",
        "full_every-float",
        "signal-not-in-a-sequence",
        "KeepLast-float",
        "KeepMilestones-float",
        "replica_roots-a-string",
    ],
)
def test_a_setting_of_the_wrong_type_is_a_value_error_at_once(tmp_path: Path, make: Any) -> None:
    """Before, keep_last=2.5 was taken and every retention pass then failed in the background
    (TypeError, logged), so nothing was ever deleted; a bare signal raised UnboundLocalError;
    a string of replica roots was called empty."""
    with pytest.raises(ValueError, match="int|sequence|signal"):
        make(tmp_path / "root")
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())


def test_a_preemption_notice_after_the_last_check_is_sent_again_with_the_root_released(tmp_path: Path) -> None:
    """A Ctrl-C that arrives after the loop's last reached_preemption() is passed on at the end
    of close(); Python's handler raises KeyboardInterrupt there. Before, it was raised before
    the root's lock was released, and the root stayed locked for the rest of the process."""
    root = tmp_path / "root"
    with pytest.raises(KeyboardInterrupt):
        with Checkpointer(root, preemption_signals=(signal.SIGINT,)) as ck:
            ck.save(1, {"x": torch.ones(3)})
            assert not ck.reached_preemption()
            os.kill(os.getpid(), signal.SIGINT)
    with Checkpointer(root) as ck:
        assert ck.steps() == [1]


def test_a_state_nested_deeper_than_a_reader_takes_is_refused_at_save(tmp_path: Path) -> None:
    """A reader refuses trees nested beyond store.tree_format.MAX_TREE_DEPTH (binding one takes
    two Python frames a level), so a save refuses states nested deeper than MAX_SAVED_DEPTH
    levels, counting keys and objects whose state_dict() holds the next object, and anything
    nested up to that restores. Before, a chain of objects was saved at any depth and its
    version then refused as damaged."""
    from ckpt.store.tree_format import MAX_SAVED_DEPTH

    def nest(n: int, leaf: Any) -> Any:
        for i in range(n):  # a key each: int keys, tuples and string keys
            leaf = {i: leaf} if i % 3 == 0 else (leaf,) if i % 3 == 1 else {"k": leaf}
        return leaf

    class Holder:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def state_dict(self) -> Any:
            return self.inner

        def load_state_dict(self, sd: Any) -> None:
            pass  # (its tensor is filled in place)

    def chain(n: int, leaf: Any) -> Any:
        node = {"w": leaf}
        for _ in range(n):
            node = Holder(node)
        return node

    with Checkpointer(tmp_path / "root", capture_rng=False) as ck:
        deepest = nest(MAX_SAVED_DEPTH - 1, torch.arange(3.0))
        ck.save(1, {"s": deepest})
        got = {"s": nest(MAX_SAVED_DEPTH - 1, torch.zeros(3))}
        ck.restore(got)
        assert_bitwise(got, {"s": deepest})
        ck.save(2, {"s": chain(MAX_SAVED_DEPTH - 2, torch.arange(3.0))})
        target = torch.zeros(3)
        ck.restore({"s": chain(MAX_SAVED_DEPTH - 2, target)}, step=2)
        assert torch.equal(target, torch.arange(3.0))
        for state in ({"s": nest(MAX_SAVED_DEPTH + 1, 1)}, {"s": chain(MAX_SAVED_DEPTH + 1, torch.ones(1))}):
            with pytest.raises(UnsupportedStateError, match="nested deeper than"):
                ck.save(3, state)
        assert ck.steps() == [1, 2]


def test_a_checkpointer_refused_after_it_locked_the_root_leaves_the_root_free(tmp_path: Path) -> None:
    """peer_copies=1 on a job with one root is refused (ValueError) once the root is locked.
    Before, the lock stayed held: a corrected Checkpointer in the same process then raised
    RootLockedError naming this very process."""
    with pytest.raises(ValueError, match="needs more roots"):
        Checkpointer(tmp_path / "root", peer_copies=1)
    with Checkpointer(tmp_path / "root") as ck:
        assert ck.save(1, {"w": torch.ones(2)})


def test_a_destination_whose_elements_share_memory_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    """An expanded tensor (a buffer made with .expand) has one memory location for many
    elements: the restore wrote every row through it and returned, each row then holding
    the last one saved (torch's own copy_ refuses it)."""
    saved = {"pe": torch.arange(70, dtype=torch.float32).reshape(10, 7), "w": torch.ones(3)}
    with Checkpointer(tmp_path) as ck:
        ck.save(1, saved)
    row = torch.zeros(1, 7)
    got = {"pe": row.expand(10, 7), "w": torch.zeros(3)}
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(StateMismatchError, match="share memory"):
            ck.restore(got)
    assert not row.any() and not got["w"].any()  # nothing was written
    arr = np.lib.stride_tricks.as_strided(np.zeros(7, dtype=np.float32), (10, 7), (0, 4), writeable=True)
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(StateMismatchError, match="share memory"):
            ck.restore({"pe": arr, "w": torch.zeros(3)})


def test_a_list_of_another_length_is_a_mismatch_not_a_restore_into_new_tensors(tmp_path: Path) -> None:
    """{"params": list(model.parameters())} restored into a model with fewer parameters:
    restore() returned the step, swapped in a list of new tensors and left the model's own
    unfilled. A list or tuple of another length holding tensors is a StateMismatchError,
    strict or not (one of plain values takes the saved list whole, as before)."""
    saved = [torch.full((2,), float(i)) for i in range(4)]
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"params": saved, "pair": (torch.ones(2), 3)})
    for strict in (True, False):
        for slot, target in (("params", [torch.zeros(2), torch.zeros(2)]), ("pair", (torch.zeros(2),))):
            with Checkpointer(tmp_path) as ck, pytest.raises(StateMismatchError, match="a list of"):
                ck.restore({slot: target}, strict=strict)
            assert all(not t.any() for t in target)
    # Of the same length, each element is filled in place, and the state keeps its own list.
    params = [torch.zeros(2) for _ in range(4)]
    pair = [torch.zeros(2), 0]  # a list where a tuple was saved
    state = {"params": params, "pair": pair}
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(state) == 1
    assert state["params"] is params and state["pair"] is pair and pair[1] == 3
    assert_bitwise(params, saved)
    assert torch.equal(pair[0], torch.ones(2))


def test_numpy_slots_are_filled_in_place_and_keep_their_kind(tmp_path: Path) -> None:
    """A tensor saved and restored into a non-contiguous array was read into a copy that never
    went back (the array kept its zeros, and restore returned the step), and into a contiguous
    one the slot became a tensor; an array saved and restored into a tensor slot became an array."""
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"t": torch.arange(6.0).reshape(2, 3), "a": np.arange(4.0)})
    arr = np.zeros((3, 2), dtype=np.float32).T  # (2, 3), not contiguous
    ten = torch.zeros(4, dtype=torch.float64)
    state = {"t": arr, "a": ten}
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(state) == 1
    assert state["t"] is arr and state["a"] is ten
    assert np.array_equal(arr, np.arange(6.0).reshape(2, 3)) and torch.equal(
        ten, torch.arange(4.0, dtype=torch.float64)
    )
    contiguous = np.zeros((2, 3), dtype=np.float32)
    state = {"t": contiguous}
    with Checkpointer(tmp_path) as ck:
        ck.restore(state, strict=False)
    assert state["t"] is contiguous and np.array_equal(contiguous, np.arange(6.0).reshape(2, 3))


def test_a_refused_restore_leaves_a_fresh_optimizer_fresh(tmp_path: Path) -> None:
    """Binding gives a fresh optimizer its state tensors (one step at lr 0) before the
    tensors' dtypes and shapes are checked: a restore refused there left Adam at step 1."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": model, "optim": opt, "extra": torch.zeros(3)})
    fresh_model = torch.nn.Linear(3, 2)
    fresh = torch.optim.Adam(fresh_model.parameters())
    with Checkpointer(tmp_path) as ck, pytest.raises(StateMismatchError, match="float32"):
        ck.restore({"model": fresh_model, "optim": fresh, "extra": torch.zeros(4)})
    assert len(fresh.state) == 0, fresh.state
    with Checkpointer(tmp_path) as ck:  # and the same optimizer then restores
        assert ck.restore({"model": fresh_model, "optim": fresh, "extra": torch.zeros(3)}) == 1
    assert_bitwise(fresh.state_dict(), opt.state_dict())


def test_what_a_save_cannot_keep_is_refused_at_save_naming_the_key(tmp_path: Path) -> None:
    """A masked array's mask was dropped in silence; an int beyond Python's int-to-text limit
    and a tensor of 33 dimensions were taken by save() and failed in wait() (ValueError, and
    ManifestError, the type of a damaged manifest), after the chunks were written."""
    cases = {
        "masked": np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False]),
        "huge": 10**5000,
        "hugekey": {10**5000: 1},
        "deep": torch.zeros((1,) * 33),
    }
    with Checkpointer(tmp_path) as ck:
        for key, value in cases.items():
            with pytest.raises(UnsupportedStateError, match=key):
                ck.save(1, {key: value})
        mapped = np.memmap(tmp_path / "mm", dtype=np.float32, mode="w+", shape=(4,))  # a subclass that keeps all
        mapped[:] = [1, 2, 3, 4]
        ck.save(1, {"ok": torch.zeros((1,) * 32), "big": 10**4000, "mm": mapped})
        ck.wait()
    into = np.memmap(tmp_path / "mm2", dtype=np.float32, mode="w+", shape=(4,))
    got: dict[str, Any] = {"ok": torch.ones((1,) * 32), "big": 0, "mm": into}
    with Checkpointer(tmp_path) as ck:
        assert ck.restore(got) == 1
    assert got["big"] == 10**4000 and not got["ok"].any()
    assert got["mm"] is into and np.array_equal(into, [1, 2, 3, 4])
