"""The on-disk format as other readers see it, and the errors a user meets.

- a committed version is plain zarr v3: zarr-python and tensorstore read it alone;
- bad states, roots, steps and targets raise the documented error types;
- corrupt versions are detected and skipped for the next older one;
- crafted manifests are rejected before anything acts on them;
- bounded staging and if_busy="skip" keep the data exact.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr

import ckpt
from ckpt import Checkpointer, CheckpointerConfig
from ckpt.store.manifest import SCHEMA_VERSION, parse_manifest
from ckpt.store.rank_file import parse_rank_file
from tests._manifests import chunk_digests, crafted, vouch_rank_file
from tests._states import assert_bitwise, blank

REPO = Path(__file__).resolve().parents[2]


def vdir(root: Path, step: int) -> Path:
    return root / f"v{step:012d}"


def model_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return {"model": model}


def plain_state(step: int) -> dict[str, Any]:
    """Tensors of several types, derived from the step."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(40, 30, generator=g),
        "v": torch.randn(7, generator=g).to(torch.float64),
        "i": torch.randint(-(2**40), 2**40, (5, 3), generator=g, dtype=torch.int64),
        "s": torch.tensor(float(step)),
        "meta": {"step": step},
    }


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    return blank(state)


def save_one(root: Path, step: int, state: dict[str, Any], **kw: Any) -> None:
    with Checkpointer(root, **kw) as ck:
        ck.save(step, state)
        ck.wait()


# -- the format, read by other libraries -------------------------------------------------


@pytest.fixture
def saved_formats(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    tensors = {
        "scalar": torch.tensor(-3.140625),  # 0-d: inline, as the array's fill_value
        "count": torch.tensor(-(2**62) - 5),  # 0-d int64, inline
        "ids": torch.arange(-6, 6, dtype=torch.int64).reshape(3, 4) * (2**40 + 3),
        "mask": torch.tensor([[True, False, True], [False, False, True]]),
        "half": torch.randn(5, 7).to(torch.float16),
        "bf": torch.randn(4, 9).to(torch.bfloat16),
    }
    root = tmp_path / "root"
    save_one(root, 3, {"model": model, **tensors})
    expected = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    expected.update(tensors)
    return root, expected


def test_zarr_python_reads_a_version(saved_formats: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, expected = saved_formats
    assert (vdir(root, 3) / "state" / "model" / "0.weight" / "zarr.json").is_file()
    for name, want in expected.items():
        if want.dtype == torch.bfloat16:
            continue  # numpy has no bfloat16: zarr-python cannot read it
        arr = zarr.open_array(f"{vdir(root, 3)}/state/{name}", mode="r")
        assert tuple(arr.shape) == tuple(want.shape), name
        got = torch.from_numpy(np.asarray(arr[...]).copy())
        assert got.dtype == want.dtype, f"{name}: {got.dtype} vs {want.dtype}"
        assert_bitwise(got, want, f"{name} through zarr-python")
    # The 0-d tensors have no chunk file: their value is the fill_value.
    for name in ("scalar", "count"):
        assert sorted(os.listdir(vdir(root, 3) / "state" / name)) == ["zarr.json"]
        doc = json.loads((vdir(root, 3) / "state" / name / "zarr.json").read_text())
        assert doc["shape"] == []
    assert json.loads((vdir(root, 3) / "state" / "count" / "zarr.json").read_text())["fill_value"] == -(2**62) - 5


def test_tensorstore_reads_a_version(saved_formats: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, expected = saved_formats
    for name, want in expected.items():
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{vdir(root, 3)}/state/{name}"}}
        got_np = ts.open(spec, open=True, read=True).result().read().result()
        assert tuple(got_np.shape) == tuple(want.shape), name
        if want.dtype == torch.bfloat16:
            assert str(got_np.dtype) == "bfloat16"
            bits = torch.from_numpy(np.array(got_np, order="C").view(np.int16))
            assert_bitwise(bits, want.view(torch.int16), f"{name} through tensorstore")
            continue
        got = torch.from_numpy(np.array(got_np, order="C"))  # not ascontiguousarray: it makes 0-d 1-d
        assert got.dtype == want.dtype, f"{name}: {got.dtype} vs {want.dtype}"
        assert_bitwise(got, want, f"{name} through tensorstore")


def test_round_trip_through_ckpt(saved_formats: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, expected = saved_formats
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    target: dict[str, Any] = {"model": model}
    target.update({k: torch.zeros_like(v) for k, v in expected.items() if "/" not in k})
    with Checkpointer(root) as ck:
        assert ck.restore(target) == 3
    assert_bitwise(model.state_dict(), {k[6:]: v for k, v in expected.items() if k.startswith("model/")}, "model")
    assert_bitwise(
        {k: v for k, v in target.items() if k != "model"}, {k: v for k, v in expected.items() if "/" not in k}
    )


# -- bad inputs ---------------------------------------------------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(
    ("bad", "key"),
    [
        ({"hook": lambda x: x}, "state['hook']"),
        ({"extra": {"nested": [1, Opaque()]}}, "state['extra']['nested'][1]"),
    ],
)
def test_unsupported_state_names_the_key(tmp_path: Path, bad: dict[str, Any], key: str) -> None:
    with Checkpointer(tmp_path / "root") as ck:
        with pytest.raises(ckpt.UnsupportedStateError) as info:
            ck.save(1, {"w": torch.ones(3), **bad})
        assert key in str(info.value)
        assert isinstance(info.value, TypeError)
        assert ck.steps() == []
        # The checkpointer stays usable.
        assert ck.save(2, {"w": torch.ones(3)}) is True
        ck.wait()
        assert ck.steps() == [2]


def test_root_under_a_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ckpt.TierUnavailableError) as info:
        Checkpointer(blocker / "root")
    assert str(blocker) in str(info.value)
    with pytest.raises(ckpt.TierUnavailableError):
        Checkpointer(blocker)  # the root itself is a file


_RO_CHILD = """
import sys
import ckpt
try:
    ckpt.Checkpointer(sys.argv[1])
except ckpt.TierUnavailableError as e:
    print("TierUnavailableError", e)
    sys.exit(0)
print("opened")
sys.exit(1)
"""


def test_root_not_writable(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    if os.geteuid() != 0:
        root.chmod(0o500)
        try:
            with pytest.raises(ckpt.TierUnavailableError, match="not writable"):
                Checkpointer(root)
        finally:
            root.chmod(0o755)
        return
    # root ignores permission bits: mount the root read-only in a private mount namespace.
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("running as root without unshare/mount: cannot make an unwritable root")
    probe = subprocess.run(
        ["unshare", "-m", "mount", "--bind", "-o", "ro", str(root), str(root)], check=False, capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"running as root and read-only bind mounts are not allowed: {probe.stderr.decode().strip()}")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = f'mount --bind -o ro "{root}" "{root}" && exec "{sys.executable}" -c "$0" "{root}"'
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd, _RO_CHILD], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("TierUnavailableError") and str(root) in out.stdout


def test_existing_step_and_overwrite(tmp_path: Path) -> None:
    root = tmp_path / "root"
    first, second = plain_state(1), plain_state(2)
    with Checkpointer(root) as ck:
        ck.save(5, first)
        ck.wait()
        with pytest.raises(ckpt.VersionExistsError):
            ck.save(5, second)
        ck.wait()
        assert ck.steps() == [5]
        got = zeros_like_state(first)
        assert ck.restore(got) == 5
        assert_bitwise(got, first)

        assert ck.save(5, second, overwrite=True) is True
        ck.wait()
        assert ck.steps() == [5]
        got = zeros_like_state(second)
        assert ck.restore(got) == 5
        assert_bitwise(got, second)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["v000000000005"]
    assert not (root / ".trash").exists() or list((root / ".trash").iterdir()) == []
    assert not list(root.glob("*.tmp-*"))
    with Checkpointer(root) as ck:  # and it survives reopening
        got = zeros_like_state(second)
        assert ck.restore(got) == 5
        assert_bitwise(got, second)


def test_restore_into_other_shapes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    save_one(root, 1, model_state(0))
    other = {"model": torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))}
    before = {k: v.clone() for k, v in other["model"].state_dict().items()}
    with Checkpointer(root) as ck, pytest.raises(ckpt.StateMismatchError) as info:
        ck.restore(other)
    assert "state['model']['2.weight']" in str(info.value)
    assert_bitwise(other["model"].state_dict(), before, "model")  # nothing was half-loaded


def test_root_locked_in_process(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with Checkpointer(root):
        with pytest.raises(ckpt.RootLockedError) as info:
            Checkpointer(root)
        assert str(root) in str(info.value)
        with pytest.raises(ckpt.RootLockedError):
            Checkpointer(str(root) + "/")  # the same directory, spelled differently
    with Checkpointer(root) as ck:  # released on close
        assert ck.steps() == []


_LOCK_CHILD = """
import sys
import ckpt
try:
    ckpt.Checkpointer(sys.argv[1])
except ckpt.RootLockedError as e:
    print("RootLockedError", e)
    sys.exit(0)
print("opened")
sys.exit(1)
"""


def test_root_locked_across_processes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with Checkpointer(root):
        out = subprocess.run(
            [sys.executable, "-c", _LOCK_CHILD, str(root)],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("RootLockedError"), out.stdout


def test_bad_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="if_busy"):
        CheckpointerConfig(if_busy="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CheckpointerConfig(max_staging_bytes=0)
    with pytest.raises(ValueError, match="if_busy"):
        Checkpointer(tmp_path / "root", if_busy="bogus")
    assert not (tmp_path / "root").exists()  # refused before touching the root


def test_bad_step(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "root") as ck:
        for step in (-1, 1.0, True, "3"):
            with pytest.raises(ValueError):
                ck.save(step, {"w": torch.ones(2)})  # type: ignore[arg-type]
        with pytest.raises(ckpt.VersionNotFoundError):
            ck.restore({"w": torch.ones(2)}, step=4)
        assert ck.restore({"w": torch.ones(2)}) is None


# -- corruption ----------------------------------------------------------------------------


def _two_versions(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    old, new = plain_state(1), plain_state(2)
    with Checkpointer(root) as ck:
        ck.save(1, old)
        ck.save(2, new)
        ck.wait()
        assert ck.steps() == [1, 2]
    return old, new


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


CORRUPTIONS = {
    "flipped-chunk": lambda v: _flip_byte(v / "state" / "w" / "c.0.0"),
    "truncated-chunk": lambda v: _truncate(v / "state" / "w" / "c.0.0"),
    "missing-chunk": lambda v: (v / "state" / "i" / "c.0.0").unlink(),
    "flipped-small-chunk": lambda v: _flip_byte(v / "state" / "v" / "c.0"),
    "truncated-manifest": lambda v: _truncate(v / "manifest.json"),
    "unsafe-manifest": lambda v: (v / "manifest.json").write_bytes(
        (v / "manifest.json").read_bytes().replace(b'"w":{', b'"../w":{')
    ),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_newest_falls_back(tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    old, new = _two_versions(root)
    CORRUPTIONS[kind](vdir(root, 2))
    with Checkpointer(root) as ck:
        got = zeros_like_state(old)
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            assert ck.restore(got) == 1
        assert_bitwise(got, old)
        if 2 in ck.steps():
            assert any("step 2" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
            with pytest.raises(ckpt.CorruptVersionError):
                ck.restore(zeros_like_state(new), step=2)
        else:
            assert kind == "truncated-manifest"
            with pytest.raises((ckpt.CorruptVersionError, ckpt.VersionNotFoundError)):
                ck.restore(zeros_like_state(new), step=2)
        # The intact version is still restorable explicitly.
        got = zeros_like_state(old)
        assert ck.restore(got, step=1) == 1
        assert_bitwise(got, old)


def test_all_versions_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _two_versions(root)
    for step in (1, 2):
        _flip_byte(vdir(root, step) / "state" / "w" / "c.0.0")
    with Checkpointer(root) as ck:
        # Not None ("nothing saved, start afresh"): the state may be partly overwritten, and
        # the operator must learn that every committed version is damaged.
        with pytest.raises(ckpt.CorruptVersionError, match="no committed version is intact"):
            ck.restore(zeros_like_state(plain_state(0)))


# -- manifest validation -------------------------------------------------------------------


@pytest.fixture
def manifest_doc(tmp_path: Path) -> dict[str, Any]:
    root = tmp_path / "root"
    save_one(root, 1, plain_state(1))
    raw = (vdir(root, 1) / "manifest.json").read_bytes()
    parse_manifest(raw)  # the untouched manifest is valid
    return json.loads(raw)


def _rename_array(doc: dict[str, Any], new: str) -> dict[str, Any]:
    doc["arrays"][new] = doc["arrays"].pop("w")
    return doc


MANIFEST_EDITS = {
    "dotdot": lambda d: _rename_array(d, "../w"),
    "dotdot-inside": lambda d: _rename_array(d, "a/../../w"),
    "absolute": lambda d: _rename_array(d, "/etc/w"),
    "dot": lambda d: _rename_array(d, "./w"),
    "empty-component": lambda d: _rename_array(d, "a//w"),
    "schema-version": lambda d: {**d, "schema_version": SCHEMA_VERSION + 1},
    "no-schema-version": lambda d: {k: v for k, v in d.items() if k != "schema_version"},
    "unknown-dtype": lambda d: d["arrays"]["w"].update(data_type="float128") or d,
    "absurd-shape": lambda d: d["arrays"]["w"].update(shape=[1 << 30, 1 << 30], chunk_shape=[1 << 30, 1 << 30]) or d,
    "absurd-ndim": lambda d: d["arrays"]["w"].update(shape=[1] * 40, chunk_shape=[1] * 40) or d,
    "negative-shape": lambda d: d["arrays"]["w"].update(shape=[-40, 30]) or d,
    "inline-bad-xxh3": lambda d: d["arrays"]["w"].update(inline="00000000", xxh3="zz", shape=[1, 1]) or d,
    "no-rank-files": lambda d: {**d, "ranks": []},
    "rank-file-ref-size": lambda d: {**d, "ranks": [[0, d["ranks"][0][1]]]},
    "rank-file-ref-xxh3": lambda d: {**d, "ranks": [[d["ranks"][0][0], "nothex"]]},
    "not-ckpt": lambda d: {**d, "format": "other"},
}


RANK_FILE_EDITS = {
    "not-json": lambda d: b"{",
    "format": lambda d: {**d, "format": "other"},
    "other-step": lambda d: {**d, "step": d["step"] + 1},
    "other-save": lambda d: {**d, "save_id": "0" * 32},
    "other-rank": lambda d: {**d, "rank": 1},
    "unknown-array": lambda d: {**d, "chunks": {"../x": d["chunks"]["w"]}},
    "chunk-beyond-grid": lambda d: {**d, "chunks": {"w": [[7, d["chunks"]["w"][0][1]]]}},
    "chunk-index-not-int": lambda d: {**d, "chunks": {"w": [["0", d["chunks"]["w"][0][1]]]}},
    "bad-xxh3": lambda d: {**d, "chunks": {"w": [[0, "zz"]]}},
    "stray-blocks": lambda d: {**d, "chunks": {"w": [[0, d["chunks"]["w"][0][1], ["0" * 16]]]}},
    "bad-rng": lambda d: {**d, "rng": {"python": {"state": [1]}}},
    "bad-root": lambda d: {**d, "root": -1},
}


@pytest.mark.parametrize("edit", list(RANK_FILE_EDITS))
def test_parse_rank_file_rejects(tmp_path: Path, edit: str) -> None:
    """Hostile rank files are refused like hostile manifests, even when the manifest vouches for them."""
    root = tmp_path / "root"
    save_one(root, 1, plain_state(1))
    manifest = parse_manifest((vdir(root, 1) / "manifest.json").read_bytes())
    raw = (vdir(root, 1) / "ranks" / "0.json").read_bytes()
    parse_rank_file(raw, manifest, 0)  # the untouched file is valid
    out = RANK_FILE_EDITS[edit](json.loads(raw))
    crafted_raw = out if isinstance(out, bytes) else json.dumps(out).encode()
    with pytest.raises(ckpt.ManifestError):
        parse_rank_file(crafted_raw, manifest, 0)
    # ... and through a restore, with the manifest recomputed to vouch for it: never used,
    # and, with nothing older to fall back to, a clear error.
    vouch_rank_file(vdir(root, 1), 0, crafted_raw)
    with Checkpointer(root) as ck:
        with pytest.raises(ckpt.CorruptVersionError):
            ck.restore(zeros_like_state(plain_state(1)), step=1)


@pytest.mark.parametrize("edit", list(MANIFEST_EDITS))
def test_parse_manifest_rejects(manifest_doc: dict[str, Any], edit: str) -> None:
    doc = MANIFEST_EDITS[edit](manifest_doc)
    with pytest.raises(ckpt.ManifestError):
        parse_manifest(crafted(doc))


# Array "w" of a world-1 save, 1 chunk: each malformed list of writer runs, and what the
# refusal names (the one-test check of a run and the checks that word its error agree).
RUN_EDITS = {
    "malformed-run": ([[1, 0]], r"a writer run is not \[count, first, stride\]"),
    "run-not-a-list": (["100"], r"a writer run is not \[count, first, stride\]"),
    "run-count-bool": ([[True, 0, 0]], r"w\.writers count must be an integer in \[1, "),
    "run-absurd-count": ([[1 << 49, 0, 0]], r"w\.writers count must be an integer in \[1, "),
    "empty-run": ([[0, 0, 0], [1, 0, 0]], r"w\.writers count must be an integer in \[1, "),
    "run-first-float": ([[1, 0.0, 0]], r"w\.writers first must be an integer in \[0, 0\]"),
    "run-negative-first": ([[1, -1, 0]], r"w\.writers first must be an integer in \[0, 0\]"),
    "bad-writer": ([[1, 3, 0]], r"w\.writers first must be an integer in \[0, 0\]"),
    "run-negative-stride": ([[1, 0, -1]], r"w\.writers stride must be an integer in \[0, 1\]"),
    "run-stride-beyond-world": ([[1, 0, 2]], r"w\.writers stride must be an integer in \[0, 1\]"),
    "run-beyond-world": ([[2, 0, 1]], r"a writer run goes beyond rank 0"),
    "chunks-beyond-grid": ([[5, 0, 0]], r"writers do not cover the grid \[1, 1\] exactly once"),
}


@pytest.mark.parametrize("edit", list(RUN_EDITS))
def test_parse_manifest_names_what_is_wrong_with_a_writer_run(manifest_doc: dict[str, Any], edit: str) -> None:
    writers, message = RUN_EDITS[edit]
    manifest_doc["arrays"]["w"]["writers"] = writers
    with pytest.raises(ckpt.ManifestError, match=message):
        parse_manifest(crafted(manifest_doc))


def test_parse_manifest_names_the_writer_runs_before_the_fields_after_them(manifest_doc: dict[str, Any]) -> None:
    """An array wrong in its writer runs and in a later field: the runs are named (the
    checks run in the document's order, whatever a faster parse computes first)."""
    manifest_doc["arrays"]["w"]["writers"] = [[5, 0, 0]]
    manifest_doc["arrays"]["w"]["sharding"] = "not an object"
    with pytest.raises(ckpt.ManifestError, match=r"writers do not cover the grid \[1, 1\] exactly once"):
        parse_manifest(crafted(manifest_doc))


def test_manifest_of_another_step_is_rejected(tmp_path: Path) -> None:
    root = tmp_path / "root"
    old, _ = _two_versions(root)
    shutil.copy(vdir(root, 1) / "manifest.json", vdir(root, 2) / "manifest.json")
    with Checkpointer(root) as ck:
        with pytest.raises(ckpt.ManifestError):
            ck.restore(zeros_like_state(old), step=2)
        got = zeros_like_state(old)
        assert ck.restore(got) == 1
        assert_bitwise(got, old)


# -- bounded staging, if_busy -----------------------------------------------------------------


def test_bounded_staging_round_trips(tmp_path: Path) -> None:
    root = tmp_path / "root"
    state = plain_state(3)
    state["big"] = torch.randn(64, 100)  # 25600 bytes: larger than the whole bound
    state["small"] = [torch.arange(i + 1, dtype=torch.int32) for i in range(20)]
    model = model_state(5)["model"]
    state["model"] = model
    with Checkpointer(root, max_staging_bytes=4096) as ck:
        assert ck.config.max_staging_bytes == 4096
        ck.save(1, state)
        ck.wait()
        fresh = model_state(6)["model"]
        got = zeros_like_state({k: v for k, v in state.items() if k not in ("small", "model")})
        got["small"] = [torch.zeros(i + 1, dtype=torch.int32) for i in range(20)]
        got["model"] = fresh
        assert ck.restore(got) == 1
    assert_bitwise({k: v for k, v in got.items() if k != "model"}, {k: v for k, v in state.items() if k != "model"})
    assert_bitwise(fresh.state_dict(), model.state_dict(), "model")
    # The same bytes as an unbounded save.
    save_one(tmp_path / "unbounded", 1, state)
    a = json.loads((vdir(root, 1) / "manifest.json").read_bytes())["arrays"]
    b = json.loads((vdir(tmp_path / "unbounded", 1) / "manifest.json").read_bytes())["arrays"]
    assert {n: x["writers"] for n, x in a.items()} == {n: x["writers"] for n, x in b.items()}
    assert chunk_digests(vdir(root, 1)) == chunk_digests(vdir(tmp_path / "unbounded", 1))


def test_if_busy_skip(tmp_path: Path) -> None:
    gate = threading.Event()
    root = tmp_path / "root"
    with Checkpointer(root, if_busy="skip") as ck:
        ck._saver._committer.submit(gate.wait, 10)  # the commit thread is busy: step 1's commit queues behind
        first = plain_state(1)
        assert ck.save(1, first) is True
        skipped = ck.save(2, plain_state(2))
        assert skipped is False  # the first save is held in flight
        first["w"].add_(1.0)  # saving staged a copy: later changes do not leak in
        gate.set()
        ck.wait()
        assert ck.steps() == [1]
        assert ck.save(3, plain_state(3)) is True
        ck.wait()
        assert ck.steps() == [1, 3]
        got = zeros_like_state(plain_state(0))
        assert ck.restore(got, step=1) == 1
        assert_bitwise(got, plain_state(1))
        assert ck.restore(got) == 3
        assert_bitwise(got, plain_state(3))


def test_if_busy_skip_unthrottled(tmp_path: Path) -> None:
    """Without a held commit: every call returns a bool and what was committed is exact."""
    root = tmp_path / "root"
    with Checkpointer(root, if_busy="skip") as ck:
        results = {step: ck.save(step, plain_state(step)) for step in range(1, 6)}
        ck.wait()
        assert all(isinstance(r, bool) for r in results.values())
        assert results[1] is True
        assert ck.steps() == [s for s, r in results.items() if r]
        for step in ck.steps():
            got = zeros_like_state(plain_state(0))
            assert ck.restore(got, step=step) == step
            assert_bitwise(got, plain_state(step))
