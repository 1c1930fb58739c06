"""Export to Hugging Face safetensors: files the real safetensors and transformers packages
read back bitwise, sharded with an index, cast on request, from a version split over two
roots, and never a partial export (a damaged chunk fails before any file is in place)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as safetensors_torch  # in the test extra: a missing package fails, never skips
import torch
import transformers
from safetensors import safe_open

import ckpt
from ckpt.store.errors import CkptError
from tests._dist import launch
from tests._states import bitwise_diff

THIS = os.path.abspath(__file__)
REPO = Path(__file__).resolve().parents[2]


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def _ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckpt.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    import ckpt

    root = tmp_path_factory.mktemp("st") / "root"
    model = _gpt2()
    opt = torch.optim.Adam(model.parameters())
    model(torch.arange(8).unsqueeze(0), labels=torch.arange(8).unsqueeze(0)).loss.backward()
    opt.step()
    with ckpt.Checkpointer(str(root)) as ck:
        ck.save(3, {"model": model, "optim": opt, "step": 3})
    return root, model


def test_sharded_export_loads_in_transformers_bitwise(saved: tuple[Path, Any], tmp_path: Path) -> None:
    root, model = saved
    out = tmp_path / "hf"
    res = _ckpt("restore", str(root), "--to-safetensors", str(out), "--max-shard-size", "40KB")
    assert res.returncode == 0, res.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files), files
    for p in out.glob("*.safetensors"):  # at most the limit (plus the file's header), or one larger tensor
        assert p.stat().st_size <= 40_000 + 4096 or len(safetensors_torch.load_file(p)) == 1, p
    want = model.state_dict()
    assert set(index["weight_map"]) == set(want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    model.config.save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    got = loaded.state_dict()
    for name, t in want.items():
        assert not bitwise_diff(got[name], t), name
    assert not list(out.glob(".ckpt-export-*")), "the temporary directory was left behind"


def test_single_file_export_with_cast(saved: tuple[Path, Any], tmp_path: Path) -> None:
    import ckpt

    root, model = saved
    paths = ckpt.export_safetensors(str(root), str(tmp_path / "one"), dtype="bf16")
    assert [os.path.basename(p) for p in paths] == ["model.safetensors"]
    got = safetensors_torch.load_file(paths[0])
    for name, t in model.state_dict().items():
        assert got[name].dtype == torch.bfloat16 and not bitwise_diff(got[name], t.to(torch.bfloat16)), name
    from safetensors import safe_open

    with safe_open(paths[0], "pt") as f:
        assert f.metadata() == {"format": "pt", "ckpt_step": "3"}


def test_a_cast_leaves_float8_and_integer_tensors_as_saved(tmp_path: Path) -> None:
    """--dtype casts the floats of 16 bits and more; a float8 tensor's scale is another
    tensor, so it is exported bitwise as float8, as integers are as they are."""
    import ckpt

    state = {
        "w": torch.linspace(-3, 3, 64, dtype=torch.float32),
        "w8": torch.linspace(-3, 3, 64).to(torch.float8_e4m3fn),
        "scale": torch.tensor([0.5], dtype=torch.float64),
        "ids": torch.arange(5),
    }
    with ckpt.Checkpointer(str(tmp_path / "root")) as ck:
        ck.save(1, {"model": state})
    paths = ckpt.export_safetensors(str(tmp_path / "root"), str(tmp_path / "out"), dtype="fp16")
    got = safetensors_torch.load_file(paths[0])
    assert got["w"].dtype == torch.float16 and torch.equal(got["w"], state["w"].half())
    assert got["scale"].dtype == torch.float16 and torch.equal(got["scale"], state["scale"].half())
    assert not bitwise_diff({k: got[k] for k in ("w8", "ids")}, {k: state[k] for k in ("w8", "ids")})


def test_an_export_killed_part_way_leaves_nothing_that_stops_the_next(saved: tuple[Path, Any], tmp_path: Path) -> None:
    """A SIGKILLed export left its temporary directory in the target: the next export was
    refused ("not empty"), and one with --force left the directory there for good. Now a
    temporary directory no live export locks is removed first; a live one's is not."""
    import fcntl

    root, model = saved
    out = tmp_path / "hf"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPT_FAULT": "export-file"}
    args = [sys.executable, "-m", "ckpt.cli", "restore", str(root), "--to-safetensors", str(out)]
    killed = subprocess.run([*args, "--max-shard-size", "100KB"], env=env, capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    assert [p.name.startswith(".ckpt-export-") for p in out.iterdir()] == [True]
    live = out / ".ckpt-export-live"  # another export's, running: its lock is held
    live.mkdir()
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        res = _ckpt("restore", str(root), "--to-safetensors", str(out))
        assert res.returncode == 3 and "is not empty" in res.stderr, res.stderr  # the live one's directory
        assert "--force" in res.stderr and "force=True" not in res.stderr, res.stderr
        with pytest.raises(CkptError, match="is not empty") as refused:  # the API names its own argument
            ckpt.export_safetensors(str(root), str(out))
        assert "force=True" in str(refused.value) and "--force" not in str(refused.value), refused.value
        res = _ckpt("restore", str(root), "--to-safetensors", str(out), "--force")
        assert res.returncode == 0, res.stderr
        assert sorted(p.name for p in out.iterdir()) == [".ckpt-export-live", "model.safetensors"]
    finally:
        os.close(fd)
    got = safetensors_torch.load_file(out / "model.safetensors")
    assert not bitwise_diff(got, dict(model.state_dict()))


def test_a_file_read_in_several_batches_is_whole_and_reports_progress_per_batch(
    saved: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single-process export reads a file's tensors a batch at a time (one read each):
    with small batches, the one file still holds every tensor bitwise, and progress
    comes once a batch, adding up to the model's bytes."""
    from ckpt._dist import Comm
    from ckpt.restore import to_safetensors
    from ckpt.restore.locate import Located, first_manifest, restore_newest
    from ckpt.store.tier import open_tier

    root, model = saved
    monkeypatch.setattr(to_safetensors, "READ_BATCH_BYTES", 20_000)
    steps: list[int] = []

    def load(located: Located) -> list[str]:
        manifest = first_manifest(located)
        assert manifest is not None
        return to_safetensors.write_safetensors(manifest, located.sources, str(tmp_path / "one"), progress=steps.append)

    found = restore_newest(Comm.solo(), lambda: [open_tier(str(root))], load, step=None, missing_ok=False)
    assert found is not None
    [path] = found[1]
    want = model.state_dict()
    batches: list[int] = []  # in saved order, runs of at most 20,000 bytes (a larger tensor alone)
    for t in want.values():
        n = t.numel() * t.element_size()
        if not batches or batches[-1] + n > 20_000:
            batches.append(0)
        batches[-1] += n
    assert steps == batches and len(steps) > 3, (steps, batches)
    got = safetensors_torch.load_file(path)
    assert set(got) == set(want)
    for name, t in want.items():
        assert not bitwise_diff(got[name], t), name


def test_force_replaces_an_earlier_export_whole(saved: tuple[Path, Any], tmp_path: Path) -> None:
    """A single-file export, then a sharded one over it: no model.safetensors may be left,
    since transformers would load it instead of the index."""
    root, model = saved
    out = tmp_path / "hf"
    assert _ckpt("restore", str(root), "--to-safetensors", str(out)).returncode == 0
    res = _ckpt("restore", str(root), "--to-safetensors", str(out), "--max-shard-size", "40KB", "--force")
    assert res.returncode == 0, res.stderr
    assert not (out / "model.safetensors").exists() and (out / "model.safetensors.index.json").exists()
    res = _ckpt("restore", str(root), "--to-safetensors", str(out), "--force")
    assert res.returncode == 0 and sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_refusals_are_one_line_and_leave_nothing(saved: tuple[Path, Any], tmp_path: Path) -> None:
    root, _ = saved
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "README").write_text("mine")
    res = _ckpt("restore", str(root), "--to-safetensors", str(busy))
    assert res.returncode == 3 and "not empty" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in busy.iterdir()) == ["README"]
    res = _ckpt("restore", str(root), "--to-safetensors", str(tmp_path / "x"), "--max-shard-size", "lots")
    assert res.returncode == 2 and "--max-shard-size" in res.stderr
    res = _ckpt("restore", str(root), "--to-safetensors", str(tmp_path / "y"), "--prefix", "ema")
    assert res.returncode == 3 and "'ema'" in res.stderr, res.stderr


def test_a_damaged_chunk_fails_the_export_before_any_file_lands(tmp_path: Path) -> None:
    import ckpt

    root = tmp_path / "root"
    w = torch.arange(4096, dtype=torch.float32)
    with ckpt.Checkpointer(str(root)) as ck:
        ck.save(1, {"model": {"w": w, "b": torch.ones(3)}})
    chunk = next((root / "v000000000001" / "state" / "model" / "w").glob("c*"))
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 1
    chunk.write_bytes(bytes(raw))
    out = tmp_path / "out"
    res = _ckpt("restore", str(root), "--step", "1", "--to-safetensors", str(out))
    assert res.returncode == 1 and "checksum" in res.stderr, res.stderr
    assert not list(out.glob("*.safetensors")) and not list(out.glob(".ckpt-export-*"))


def test_a_failed_export_leaves_no_directory_it_made(tmp_path: Path) -> None:
    """The directories an export creates for its target go when it fails; one that was there stays."""
    import ckpt

    root = tmp_path / "root"
    with ckpt.Checkpointer(str(root)) as ck:
        ck.save(1, {"model": {"w": torch.arange(4096, dtype=torch.float32)}})
    chunk = next((root / "v000000000001" / "state" / "model" / "w").glob("c*"))
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 1
    chunk.write_bytes(bytes(raw))
    res = _ckpt("restore", str(root), "--to-safetensors", str(tmp_path / "new" / "out"))
    assert res.returncode == 1 and "checksum" in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]
    (tmp_path / "mine").mkdir()
    res = _ckpt("restore", str(root), "--to-safetensors", str(tmp_path / "mine"))
    assert res.returncode == 1 and (tmp_path / "mine").is_dir() and not list((tmp_path / "mine").iterdir())
    with ckpt.Checkpointer(str(root)) as ck, pytest.raises(ckpt.CkptError):  # the job's export too
        ck.export_safetensors(str(tmp_path / "new" / "out"), step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "root"]
    # `..` after a symlink: the kernel resolves it where the link points, and so does the cleanup
    (tmp_path / "m" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "m" / "sub")
    res = _ckpt("restore", str(root), "--to-safetensors", str(tmp_path / "link" / ".." / "new"))
    assert res.returncode == 1 and sorted(p.name for p in (tmp_path / "m").iterdir()) == ["sub"]
    # making the target fails part-way (a name too long for the filesystem): its parent goes too
    res = _ckpt("restore", str(root), "--to-safetensors", str(tmp_path / "made" / ("x" * 300)))
    assert res.returncode != 0 and not (tmp_path / "made").exists(), res.stderr


def save_two_roots(ctx: Any, base: str) -> None:
    import ckpt

    full = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    lo = [0, 2, 6][ctx.rank : ctx.rank + 2]
    state = {"model": {"emb": ckpt.Shard(full[lo[0] : lo[1]].clone(), (6, 8), (lo[0], 0)), "bias": torch.ones(8)}}
    state["model"][f"stage{ctx.rank}.w"] = torch.full((3,), float(ctx.rank))  # pipeline stages: other keys per rank
    with ckpt.Checkpointer(f"{base}/node{ctx.rank}", timeout=datetime.timedelta(seconds=60)) as ck:
        ck.save(5, state)


def test_a_version_split_over_two_roots_exports_from_both(tmp_path: Path) -> None:
    _, failures = launch(THIS, "save_two_roots", 2, tmp_path, base=str(tmp_path))
    assert not failures, failures
    out = tmp_path / "hf"
    res = _ckpt("restore", str(tmp_path / "node0"), "--tier", str(tmp_path / "node1"), "--to-safetensors", str(out))
    assert res.returncode == 0, res.stderr
    got = safetensors_torch.load_file(out / "model.safetensors")
    assert torch.equal(got["emb"], torch.arange(48, dtype=torch.float32).reshape(6, 8)) and torch.equal(
        got["bias"], torch.ones(8)
    )
    assert torch.equal(got["stage0.w"], torch.zeros(3)) and torch.equal(got["stage1.w"], torch.ones(3))
    alone = _ckpt("restore", str(tmp_path / "node0"), "--to-safetensors", str(tmp_path / "alone"))
    assert alone.returncode != 0 and "lacks the part of ranks [1]" in alone.stderr, alone.stderr
    # In the CLI's words: the API's if_incomplete= is no option of the command.
    assert "--tier" in alone.stderr and "if_incomplete" not in alone.stderr, alone.stderr


def export_by_ranks(ctx: Any, view: str, out: str) -> dict[str, Any]:
    """4 ranks on 2 nodes save a version split over the nodes' roots (a sharded tensor, a
    replicated one, a pipeline stage's tensor per rank), then export it together."""
    import ckpt
    from ckpt.store.errors import CkptError

    node = ctx.rank // 2
    ctx.check(not os.path.exists(f"{view}/node{1 - node}"), "the other node's disk is not visible")
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    rows = slice(2 * ctx.rank, 2 * ctx.rank + 2)
    state = {
        "model": {
            "emb": ckpt.Shard(full[rows].clone(), (8, 6), (2 * ctx.rank, 0)),
            "bias": torch.ones(6),
            f"stage{ctx.rank}.w": torch.full((5,), float(ctx.rank)),
        },
        "step": 5,
    }
    with ckpt.Checkpointer(f"{view}/node{{node}}", timeout=datetime.timedelta(seconds=60)) as ck:
        ck.save(5, state)
        paths = ck.export_safetensors(out, max_shard_size="30B")
        try:  # a directory on one node's disk: the other node's ranks cannot write there
            ck.export_safetensors(f"{view}/node{node}/hf")
            refused = ""
        except CkptError as e:
            refused = str(e)
    return {"files": [os.path.basename(p) for p in paths], "refused": refused}


def test_the_ranks_of_a_job_export_together_what_one_process_exports(tmp_path: Path) -> None:
    """Checkpointer.export_safetensors: 4 ranks on 2 nodes (each sees only its node's disk)
    write a share of the files each (more files than ranks: two rounds), their tensors read
    through both nodes' roots over the group; the files are byte for byte the ones the CLI
    writes from one process that reads both roots. A target only some ranks reach is refused
    on every rank, and nothing is left in it."""
    from tests._dist import Nodes, can_isolate

    if not can_isolate():
        pytest.skip("needs root and mount namespaces (unshare -m)")
    nodes = Nodes(tmp_path / "disks", tmp_path / "view", per_node=2)
    for k in (0, 1):
        (nodes.disks / f"node{k}").mkdir(parents=True)
    nodes.view.mkdir()
    out = tmp_path / "hf"
    results, failures = launch(
        THIS, "export_by_ranks", 4, tmp_path / "job", isolate=nodes, view=str(nodes.view), out=str(out)
    )
    assert not failures, failures
    files = results[0]["files"]
    assert all(r["files"] == files for r in results), results
    assert len(files) == 7 and files[-1] == "model.safetensors.index.json", files
    for r in results:
        assert "every rank reaches" in r["refused"], r
    assert not list((nodes.disks / "node0").glob("hf/*")) and not list(out.glob(".ckpt-export-*"))
    alone = tmp_path / "alone"
    res = _ckpt(
        "restore", str(nodes.disks / "node0"), "--tier", str(nodes.disks / "node1"),
        "--to-safetensors", str(alone), "--max-shard-size", "30B",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in alone.iterdir()) == sorted(files)
    assert (out / files[-1]).read_text() == (alone / files[-1]).read_text()
    for name in files[:-1]:  # the same tensors and metadata (whose order in the header is the writer's hash map's)
        a, b = safetensors_torch.load_file(out / name), safetensors_torch.load_file(alone / name)
        assert a.keys() == b.keys() and not bitwise_diff(a, b), name
        with safe_open(out / name, "pt") as fa, safe_open(alone / name, "pt") as fb:
            assert fa.metadata() == fb.metadata() == {"format": "pt", "ckpt_step": "5"}
    got: dict[str, torch.Tensor] = {}
    for name in files[:-1]:
        got.update(safetensors_torch.load_file(out / name))
    assert torch.equal(got["emb"], torch.arange(48, dtype=torch.float32).reshape(8, 6))
    assert all(torch.equal(got[f"stage{r}.w"], torch.full((5,), float(r))) for r in range(4))
    assert torch.equal(got["bias"], torch.ones(6)) and len(got) == 6


# -- names (found by review, 2026-12-05: each failed on the code before its fix) -------------


@pytest.mark.parametrize(
    "inner",
    [(torch.zeros(1), torch.full((1,), 3.0)), {0: torch.zeros(1), 1: torch.full((1,), 3.0)}],
    ids=["tuple", "int-keys"],
)
def test_tensors_in_tuples_and_typed_key_dicts_are_exported(tmp_path: Path, inner: Any) -> None:
    """They were left out without a word (saved as __tuple__ / __dict__ nodes)."""
    import ckpt

    root = str(tmp_path / "root")
    state = {"model": {"w": torch.ones(2), "x": inner}}
    with ckpt.Checkpointer(root) as ck:
        ck.save(1, state)
    with ckpt.Checkpointer(root) as ck:
        job = ck.export_safetensors(str(tmp_path / "job"))
    for paths in (ckpt.export_safetensors(root, str(tmp_path / "cli")), job):
        got = safetensors_torch.load_file(paths[0])
        assert sorted(got) == ["w", "x.0", "x.1"]
        assert torch.equal(got["x.1"], torch.full((1,), 3.0))
    # A prefix goes by the exported names: into the tuple or the typed keys too.
    got = safetensors_torch.load_file(ckpt.export_safetensors(root, str(tmp_path / "x"), prefix="model.x")[0])
    assert sorted(got) == ["0", "1"] and torch.equal(got["1"], torch.full((1,), 3.0))
    got = safetensors_torch.load_file(ckpt.export_safetensors(root, str(tmp_path / "x1"), prefix="model.x.1")[0])
    assert list(got) == ["1"] and torch.equal(got["1"], torch.full((1,), 3.0))


def test_two_tensors_of_one_name_are_refused_by_the_job_export_too(tmp_path: Path) -> None:
    import ckpt

    root = str(tmp_path / "root")
    with ckpt.Checkpointer(root) as ck:
        ck.save(1, {"model": {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}})  # both "a.b"
    with pytest.raises(ckpt.CkptError, match="names two different tensors"):
        ckpt.export_safetensors(root, str(tmp_path / "cli"))
    with ckpt.Checkpointer(root) as ck, pytest.raises(ckpt.CkptError, match="names two different tensors"):
        ck.export_safetensors(str(tmp_path / "job"), prefix="model")
    assert not (tmp_path / "job").exists() or not os.listdir(tmp_path / "job")


def test_a_prefix_naming_a_tensor_exports_it_by_that_name(tmp_path: Path) -> None:
    import ckpt

    root = str(tmp_path / "root")
    with ckpt.Checkpointer(root) as ck:
        ck.save(1, {"model": {"w": torch.ones(2)}, "ema": {"avg": torch.full((3,), 2.0)}})
    paths = ckpt.export_safetensors(root, str(tmp_path / "out"), prefix="ema.avg")
    got = safetensors_torch.load_file(paths[0])
    assert list(got) == ["avg"] and torch.equal(got["avg"], torch.full((3,), 2.0))


def test_a_top_level_key_holding_dots_is_chosen_by_prefix(tmp_path: Path) -> None:
    """A state key may hold dots ("ema.model"): --prefix finds it, and without --step the
    newest version that holds it is chosen (a newer one without it is passed over)."""
    import ckpt

    root = str(tmp_path / "root")
    ema = {"w": torch.arange(6.0), "b": torch.full((2,), 3.0)}
    with ckpt.Checkpointer(root) as ck:
        ck.save(1, {"model": {"w": torch.ones(2)}, "ema.model": ema})
        ck.save(2, {"model": {"w": torch.zeros(2)}})
    res = _ckpt("restore", root, "--to-safetensors", str(tmp_path / "cli"), "--prefix", "ema.model")
    assert res.returncode == 0 and "exported step 1" in res.stdout, res.stderr
    got = safetensors_torch.load_file(str(tmp_path / "cli" / "model.safetensors"))
    assert sorted(got) == ["b", "w"] and all(torch.equal(got[k], ema[k]) for k in ema)
    paths = ckpt.export_safetensors(root, str(tmp_path / "one"), prefix="ema.model.w")
    got = safetensors_torch.load_file(paths[0])
    assert list(got) == ["w"] and torch.equal(got["w"], ema["w"])
    paths = ckpt.export_safetensors(root, str(tmp_path / "step"), prefix="ema.model", step=1)
    assert sorted(safetensors_torch.load_file(paths[0])) == ["b", "w"]
    with ckpt.Checkpointer(root) as ck:  # the job export chooses alike
        paths = ck.export_safetensors(str(tmp_path / "job"), prefix="ema.model")
    got = safetensors_torch.load_file(paths[0])
    assert sorted(got) == ["b", "w"] and all(torch.equal(got[k], ema[k]) for k in ema)


@pytest.mark.parametrize("splits", [("nested", "dotted"), ("dotted", "nested", "dotted")])
def test_the_newest_intact_version_holding_a_dotted_prefix_is_exported_whatever_its_split(
    tmp_path: Path, splits: tuple[str, ...]
) -> None:
    """Each version holds the entry as {"ema.model": ...} or as {"ema": {"model": ...}}; the
    newest is damaged: the export takes the newest intact one, whichever way it holds it
    (found by review: the first way of choosing fixed the split from the newest version
    listed, so a damaged one made the export fail, or take an older version)."""
    import ckpt

    root = tmp_path / "root"

    def state(step: int, split: str) -> dict[str, Any]:
        w = torch.full((1024,), float(step))
        return {"ema.model": {"w": w}} if split == "dotted" else {"ema": {"model": {"w": w}}}

    with ckpt.Checkpointer(str(root)) as ck:
        for step, split in enumerate(splits, 1):
            ck.save(step, state(step, split))
    newest = len(splits)
    chunk = next((root / f"v{newest:012d}" / "state").rglob("c*"))
    raw = bytearray(chunk.read_bytes())
    raw[10] ^= 1
    chunk.write_bytes(bytes(raw))
    res = _ckpt("restore", str(root), "--to-safetensors", str(tmp_path / "out"), "--prefix", "ema.model")
    assert res.returncode == 0 and f"exported step {newest - 1}" in res.stdout, res.stderr
    got = safetensors_torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(got["w"], torch.full((1024,), float(newest - 1)))


def test_a_prefix_two_entries_answer_to_is_refused(tmp_path: Path) -> None:
    """{"a": {"b": ...}} and {"a.b": ...} in one state: "a.b" names both, so nothing is exported."""
    import ckpt

    root = str(tmp_path / "root")
    with ckpt.Checkpointer(root) as ck:
        ck.save(1, {"a": {"b": {"w": torch.ones(2)}}, "a.b": {"w": torch.zeros(2)}})
    res = _ckpt("restore", root, "--to-safetensors", str(tmp_path / "out"), "--prefix", "a.b")
    assert res.returncode == 3 and "'a.b' names 2 entries" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(ckpt.CkptError, match="'a.b.w' names 2 entries"):
        ckpt.export_safetensors(root, str(tmp_path / "one"), prefix="a.b.w")
    with ckpt.Checkpointer(root) as ck:  # a list's index is a name too
        ck.save(2, {"a": [{"b": torch.ones(2)}], "a.0": {"b": torch.zeros(2)}})
    with pytest.raises(ckpt.CkptError, match="'a.0.b' names 2 entries"):
        ckpt.export_safetensors(root, str(tmp_path / "two"), prefix="a.0.b")


# -- what safetensors cannot hold, and who can read the files (found by review, 2026-12-05) --


def _bits_of_every_dtype() -> dict[str, torch.Tensor]:
    """A tensor of random bits for every element type ckpt saves (complex128 aside)."""
    g = torch.Generator().manual_seed(0)
    kinds = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16]
    kinds += [torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64]
    kinds += [torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
    out = {}
    for kind in kinds:
        raw = torch.randint(0, 256, (3, 4 * kind.itemsize), dtype=torch.uint8, generator=g)
        out[str(kind).removeprefix("torch.")] = raw > 127 if kind == torch.bool else raw.view(kind)
    return out


def test_every_dtype_exports_bitwise_and_what_safetensors_cannot_hold_is_refused(tmp_path: Path) -> None:
    """complex128 (no safetensors type) was a KeyError from inside safetensors: a traceback
    and exit 1, the code for damage; a tensor named __metadata__ (the header's own entry)
    was written into a file no safetensors reader opens ("duplicate field"), exit 0. Both
    are refused now, by the CLI and the job's export, before anything is written."""
    import ckpt

    every = _bits_of_every_dtype()
    roots = {}
    for name, extra in (
        ("good", {}),
        ("complex128", {"z": torch.ones(2, dtype=torch.complex128)}),
        ("metadata", {"__metadata__": torch.ones(2)}),
    ):
        roots[name] = tmp_path / name
        with ckpt.Checkpointer(str(roots[name])) as ck:
            ck.save(1, {"model": {**every, **extra}})
    res = _ckpt("restore", str(roots["good"]), "--to-safetensors", str(tmp_path / "hf"), "--max-shard-size", "100B")
    assert res.returncode == 0, res.stderr
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for name in set(index["weight_map"].values()):
        got.update(safetensors_torch.load_file(tmp_path / "hf" / name))
    assert got.keys() == every.keys() and not bitwise_diff(got, every)
    for name, words in (("complex128", ("'z'", "complex128")), ("metadata", ("'__metadata__'",))):
        out = tmp_path / f"out-{name}"
        res = _ckpt("restore", str(roots[name]), "--to-safetensors", str(out))
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 3 and len(lines) == 1 and lines[0].startswith("ckpt: error: "), res.stderr
        assert all(w in lines[0] for w in words), lines[0]
        assert not out.exists() or not os.listdir(out), os.listdir(out)
        with ckpt.Checkpointer(str(roots[name])) as ck, pytest.raises(ckpt.CkptError, match=words[0]):
            ck.export_safetensors(str(tmp_path / f"job-{name}"))
        assert not (tmp_path / f"job-{name}").exists() or not os.listdir(tmp_path / f"job-{name}")


def test_the_exported_files_are_readable_as_ckpt_files_are(saved: tuple[Path, Any], tmp_path: Path) -> None:
    """safetensors (0.8 on) writes through a temporary file of mode 0600 and renames it into
    place: an export for a serving job (another user) was readable by its writer alone,
    while its index beside it was not. Every file now gets the mode ckpt's own files get."""
    import ckpt

    root, _ = saved
    umask = os.umask(0o022)
    os.umask(umask)
    want = 0o644 & ~umask  # store.fsio.FILE_MODE, as os.open gives it
    res = _ckpt("restore", str(root), "--to-safetensors", str(tmp_path / "hf"), "--max-shard-size", "40KB")
    assert res.returncode == 0, res.stderr
    with ckpt.Checkpointer(str(root)) as ck:
        ck.export_safetensors(str(tmp_path / "job"))
    for out in (tmp_path / "hf", tmp_path / "job"):
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
        assert len(modes) > 0 and set(modes.values()) == {oct(want)}, modes


def export_with_other_arguments(ctx: Any, base: str) -> dict[str, Any]:
    """Two ranks export the version saved by save_two_roots (reached through both roots)
    with a step rank 1 alone refuses, then other max_shard_size, dtype, prefixes: each
    is an error on every rank at once. Before, the first two waited for the group's timeout
    (a gloo error), and the third exported a mix of the two prefixes' trees."""
    import time

    import ckpt

    outcomes = []
    for kwargs in (
        {"step": 5 if ctx.rank == 0 else -1},  # refused on rank 1 alone: RankFailures on rank 0, at once
        {"max_shard_size": "40B" if ctx.rank == 0 else "5GB"},
        {"dtype": "bf16" if ctx.rank == 0 else torch.bfloat16},  # (which JSON would not take)
        {"prefix": "model" if ctx.rank else "model.emb"},
    ):
        with ckpt.Checkpointer(
            f"{base}/node{ctx.rank}", tiers=[f"{base}/node{1 - ctx.rank}"], timeout=datetime.timedelta(seconds=60)
        ) as ck:
            started = time.monotonic()
            try:
                ck.export_safetensors(f"{base}/hf-{len(outcomes)}", **kwargs)
                outcomes.append(("exported", 0.0))
            except (ValueError, ckpt.RankFailures) as e:
                outcomes.append((str(e), time.monotonic() - started))
    return {"outcomes": outcomes}


def test_ranks_that_pass_an_export_other_arguments_are_refused_together(tmp_path: Path) -> None:
    _, failures = launch(THIS, "save_two_roots", 2, tmp_path, base=str(tmp_path))
    assert not failures, failures
    results, failures = launch(THIS, "export_with_other_arguments", 2, tmp_path / "job", base=str(tmp_path))
    assert not failures, failures
    for r in results:
        assert all(s < 30 for _, s in r["outcomes"]), r
        assert all("different" in why for why, _ in r["outcomes"][1:]), r
    assert "step must be" in results[1]["outcomes"][0][0] and "rank 1" in results[0]["outcomes"][0][0], results


def test_a_shard_size_of_another_type_is_a_value_error() -> None:
    """Before, 5.5 raised AttributeError ('float' object has no attribute 'upper')."""
    from ckpt.restore.to_safetensors import parse_size

    for bad in (5.5, None, True, b"5GB"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)  # type: ignore[arg-type]
    assert parse_size("5GB") == 5 * 10**9 and parse_size(1000) == 1000
    # Exact, and no OverflowError (a traceback and exit 1 in the CLI) for a huge one.
    assert parse_size("0.3GB") == 3 * 10**8 and parse_size("1.1KB") == 1100
    assert parse_size("9" * 400 + "GB") == int("9" * 400) * 10**9
