"""`ckpt import`: a DCP checkpoint directory or a torch.save file becomes a ckpt version,
only with --trust (both formats are pickles); a pickle payload is never run without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from ckpt import Checkpointer
from ckpt.cli import main as cli
from ckpt.importers import UntrustedSourceError, import_checkpoint
from ckpt.store.errors import VersionExistsError
from tests._states import assert_bitwise


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16)},
        "optim": {"exp_avg": {"w": torch.randn(6, 4, generator=g)}, "lr": 0.25 * seed},
        "step": 10 + seed,
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _restored(root: Path, step: int) -> dict[str, Any]:
    target = _state(99)
    with Checkpointer(root) as ck:
        assert ck.restore(target, step=step) == step
    return target


def test_torch_save_file(tmp_path: Path) -> None:
    src = tmp_path / "model.pt"
    torch.save(_state(1), src)
    out = CliRunner().invoke(cli, ["import", str(src), str(tmp_path / "root"), "--step", "7", "--trust"])
    assert out.exit_code == 0, out.output
    assert "imported" in out.output and "step 7" in out.output
    assert CliRunner().invoke(cli, ["verify", str(tmp_path / "root")]).exit_code == 0
    assert _same(_restored(tmp_path / "root", 7), _state(1))


def test_dcp_directory(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    dcp.save(_state(2), checkpoint_id=str(src), no_dist=True)
    out = CliRunner().invoke(cli, ["import", str(src), str(tmp_path / "root"), "--step", "3", "--trust"])
    assert out.exit_code == 0, out.output
    assert CliRunner().invoke(cli, ["verify", str(tmp_path / "root")]).exit_code == 0
    assert _same(_restored(tmp_path / "root", 3), _state(2))


def _adam(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if seed == 0:  # the saved one has taken a step: a moment per parameter
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    return model, opt


def test_dcp_optimizer_state_comes_back_onto_its_parameters(tmp_path: Path) -> None:
    """DCP stores every dict key as a string, the optimizer's parameter ids too; imported
    and restored into a fresh optimizer, each moment belongs to its parameter again."""
    model, opt = _adam(0)
    src = tmp_path / "dcp"
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(src), no_dist=True)
    out = CliRunner().invoke(cli, ["import", str(src), str(tmp_path / "root"), "--step", "1", "--trust"])
    assert out.exit_code == 0, out.output
    model2, opt2 = _adam(1)
    with Checkpointer(tmp_path / "root") as ck:
        assert ck.restore({"model": model2, "optim": opt2}) == 1
    assert list(opt2.state_dict()["state"]) == [0, 1, 2, 3]  # parameter ids, not the strings "0", "1", ...
    assert_bitwise(opt2.state_dict(), opt.state_dict(), "optim")
    assert_bitwise(model2.state_dict(), model.state_dict(), "model")


class _Payload:
    """Unpickling this writes a file: what a hostile checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_a_pickle_is_not_unpickled_without_trust(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    src = tmp_path / "hostile.pt"
    torch.save({"model": {"w": torch.ones(2)}, "x": _Payload(str(marker))}, src)
    dcp_dir = tmp_path / "dcp"
    dcp.save(_state(3), checkpoint_id=str(dcp_dir), no_dist=True)
    for source in (src, dcp_dir):
        out = CliRunner().invoke(cli, ["import", str(source), str(tmp_path / "root"), "--step", "1"])
        assert out.exit_code == 3, out.output
        lines = out.output.strip().splitlines()
        assert len(lines) == 1 and "--trust" in lines[0] and "can run any code" in lines[0], out.output
        assert "trust=True" not in lines[0], lines[0]  # the API's name, not the command's
        with pytest.raises(UntrustedSourceError) as refused:
            import_checkpoint(str(source), tmp_path / "root", 1, trust=False)
        assert "trust=True" in str(refused.value) and "--trust" not in str(refused.value), refused.value
    assert not marker.exists()
    assert not (tmp_path / "root").exists()
    # The payload is real: trusted, the file is unpickled and its code runs.
    CliRunner().invoke(cli, ["import", str(src), str(tmp_path / "root2"), "--step", "1", "--trust"])
    assert marker.exists()


def test_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = CliRunner().invoke(cli, ["import", str(tmp_path / "empty"), str(tmp_path / "root"), "--step", "1", "--trust"])
    assert out.exit_code == 3 and "without .metadata" in out.output
    src = tmp_path / "list.pt"
    torch.save([torch.ones(1)], src)
    out = CliRunner().invoke(cli, ["import", str(src), str(tmp_path / "root"), "--step", "1", "--trust"])
    assert out.exit_code == 3 and "not a dict" in out.output
    assert not (tmp_path / "root").exists()


# -- found by review, 2026-12-05: each failed on the code before its fix --------------------


def test_a_damaged_dcp_checkpoint_is_one_line_without_a_traceback(tmp_path: Path) -> None:
    """DCP's loader logs a failed read of .metadata with its traceback (on the root logger:
    stderr, in the command), and its CheckpointException's text is the ranks' tracebacks:
    the error line held a traceback's frames. Now the one line says what failed."""
    import os
    import shutil
    import subprocess
    import sys

    good = tmp_path / "dcp"
    dcp.save(_state(4), checkpoint_id=str(good), no_dist=True)
    truncated, no_data = tmp_path / "truncated", tmp_path / "no-data"
    shutil.copytree(good, truncated)
    (truncated / ".metadata").write_bytes((good / ".metadata").read_bytes()[:50])
    shutil.copytree(good, no_data)
    for data in no_data.glob("*.distcp"):
        data.unlink()
    repo = Path(__file__).resolve().parents[2]
    for source, words in ((truncated, ("truncated",)), (no_data, ("No such file", "__0_0.distcp"))):
        args = ["import", str(source), str(tmp_path / "root"), "--step", "1", "--trust"]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}  # DCP's warning that it runs in one process
        res = subprocess.run(
            [sys.executable, "-m", "ckpt.cli", *args], cwd=repo, capture_output=True, text=True, timeout=120, env=env
        )
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 3 and len(lines) == 1, res.stderr
        assert lines[0].startswith(f"ckpt: error: {source}: not a readable DCP checkpoint: "), lines[0]
        assert "Traceback" not in lines[0] and "File " not in lines[0] and all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "root").exists()


def test_import_refuses_an_empty_root_an_ordinary_directory_and_a_version(tmp_path: Path) -> None:
    """An empty ROOT (an unset variable) and a ROOT inside a version were tracebacks (the
    Checkpointer's ValueError); an ordinary directory got a version written into it. Like
    every command that writes into a directory, import refuses them before writing."""
    src = tmp_path / "model.pt"
    torch.save(_state(1), src)
    root = tmp_path / "root"
    assert CliRunner().invoke(cli, ["import", str(src), str(root), "--step", "1", "--trust"]).exit_code == 0
    version = root / "v000000000001"
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    for target, code, words in (
        ("", 2, "ROOT is empty"),
        (str(version), 3, "inside the version"),
        (str(version / "state"), 3, "inside the version"),
        (str(home), 3, "neither empty nor a checkpoint root"),
    ):
        out = CliRunner().invoke(cli, ["import", str(src), target, "--step", "2", "--trust"])
        assert out.exit_code == code and words in out.output, (target, out.output)
        assert out.exception is None or isinstance(out.exception, SystemExit), repr(out.exception)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    assert [p.name for p in home.iterdir()] == ["notes.txt"]
    assert CliRunner().invoke(cli, ["verify", str(root)]).exit_code == 0


def test_an_import_that_fails_to_save_leaves_no_root_behind(tmp_path: Path) -> None:
    """A torch.save file read, then refused by the save (a sparse tensor): before, ROOT was
    left behind as a root with no version (its identity and lock files)."""
    src = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3), "sparse": torch.ones(3).to_sparse()}, src)
    root = tmp_path / "new" / "root"
    out = CliRunner().invoke(cli, ["import", str(src), str(root), "--step", "1", "--trust"])
    assert out.exit_code == 3 and "sparse" in out.output, out.output
    assert not root.exists()
    # A root that was there before keeps what it held.
    torch.save(_state(1), tmp_path / "good.pt")
    assert (
        CliRunner().invoke(cli, ["import", str(tmp_path / "good.pt"), str(root), "--step", "1", "--trust"]).exit_code
        == 0
    )
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != "lock")
    out = CliRunner().invoke(cli, ["import", str(src), str(root), "--step", "2", "--trust"])
    assert out.exit_code == 3, out.output
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != "lock") == before
    assert CliRunner().invoke(cli, ["verify", str(root)]).exit_code == 0


class _WritesBeside:
    """An object of the imported state whose state_dict() leaves a file of someone else's
    beside the new root (a job writing into the same new directory), then fails the save."""

    def __init__(self, path: str) -> None:
        self.path = path

    def state_dict(self) -> dict[str, object]:
        Path(self.path).write_text("another job's file")
        raise RuntimeError("this state cannot be saved")

    def load_state_dict(self, sd: dict[str, object]) -> None:
        pass


def test_a_failed_import_removes_only_what_it_made(tmp_path: Path) -> None:
    """The directories a failed import made are removed only while they hold nothing but
    the path to its empty root: before, a file another process put beside the root, in a
    directory the import had made, was deleted with it."""
    src = tmp_path / "model.pt"
    beside = tmp_path / "new" / "notes.txt"
    torch.save({"w": torch.ones(3), "obj": _WritesBeside(str(beside))}, src)
    root = tmp_path / "new" / "root"
    out = CliRunner().invoke(cli, ["import", str(src), str(root), "--step", "1", "--trust"])
    assert out.exit_code != 0, out.output
    assert beside.read_text() == "another job's file"
    assert not root.exists()  # its own part is gone


# -- found by review, 2026-12-07: each failed on the code before its fix --------------------


def test_a_dcp_tensor_whose_chunks_do_not_cover_it_is_refused(tmp_path: Path) -> None:
    """A .metadata that names fewer chunks than the tensor holds (a save that left a rank's
    shard out, a damaged or edited file): DCP's loader handed the rest back as torch.empty's
    memory, which the import checksummed and committed as if it were the state."""
    import pickle

    from torch.distributed.checkpoint.filesystem import FileSystemReader

    src = tmp_path / "dcp"
    dcp.save(_state(5), checkpoint_id=str(src), no_dist=True)
    metadata = FileSystemReader(str(src)).read_metadata()
    item = metadata.state_dict_metadata["model.w"]
    chunk = item.chunks[0]
    item.chunks[0] = type(chunk)(offsets=chunk.offsets, sizes=torch.Size([3, 4]))  # rows 3-5 missing
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    out = CliRunner().invoke(cli, ["import", str(src), str(tmp_path / "root"), "--step", "1", "--trust"])
    assert out.exit_code == 3 and "model.w: its chunks hold 12 of its 24 elements" in out.output, out.output
    assert not (tmp_path / "root").exists()


def save_dtensors_per_rank(ctx: Any, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    w = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    torch.save({"model": {"w": w}}, f"{out}/rank{ctx.rank}.pt")


def test_a_rank_s_torch_save_file_of_sharded_dtensors_is_refused_before_writing(tmp_path: Path) -> None:
    """FSDP2's `torch.save(model.state_dict())` on each rank: a file holds that rank's
    shards. Before, the import wrote its chunks and then failed with exit 1 (damage's code)
    and 'a writer run goes beyond rank 0', leaving the new root behind."""
    from tests._dist import launch

    _, failures = launch(__file__, "save_dtensors_per_rank", 2, tmp_path / "job", out=str(tmp_path))
    assert not failures, failures
    root = tmp_path / "new" / "root"
    out = CliRunner().invoke(cli, ["import", str(tmp_path / "rank0.pt"), str(root), "--step", "1", "--trust"])
    assert out.exit_code == 3 and "holds DTensors over 2 ranks" in out.output, out.output
    assert not (tmp_path / "new").exists()


def test_an_import_whose_write_fails_leaves_no_root_behind(tmp_path: Path) -> None:
    """The disk fills while the version is written (here: a file size limit): the failed
    write leaves its files in the root's trash. Before, that trash kept the import from
    removing the root it made: an empty root stayed, for the next command to take as one."""
    import os
    import subprocess
    import sys

    src = tmp_path / "model.pt"
    torch.save({"w": torch.randn(64, 64)}, src)
    root = tmp_path / "new" / "root"
    limited = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
        "from ckpt.cli import main; sys.argv[0] = 'ckpt'; main()"
    )
    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-c", limited, "import", str(src), str(root), "--step", "1", "--trust"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert res.returncode == 3 and "cannot write step 1" in res.stderr, res.stderr
    assert not (tmp_path / "new").exists(), sorted(p.name for p in root.iterdir())


def test_an_import_that_finds_the_root_locked_leaves_the_writer_s_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the import's look at ROOT (not there) and its open, another writer makes the
    root and locks it. Before, the import's RootLockedError made it remove 'the root it
    made', under the writer that holds it."""
    import ckpt.importers

    src = tmp_path / "model.pt"
    torch.save(_state(1), src)
    root = tmp_path / "new" / "root"
    writers: list[Checkpointer] = []
    real = ckpt.importers.Checkpointer

    def another_writer_first(where: Any, **kwargs: Any) -> Checkpointer:
        writers.append(real(where))
        return real(where, **kwargs)

    monkeypatch.setattr(ckpt.importers, "Checkpointer", another_writer_first)
    try:
        out = CliRunner().invoke(cli, ["import", str(src), str(root), "--step", "1", "--trust"])
        assert out.exit_code == 3 and "in use" in out.output.lower(), out.output
        assert root.is_dir()
        writers[0].save(5, {"w": torch.ones(2)})
        writers[0].wait()
    finally:
        for ck in writers:
            ck.close()
    with Checkpointer(root) as ck:
        assert ck.steps() == [5]


def test_ctrl_c_ends_a_command_with_130_and_one_line(tmp_path: Path) -> None:
    """A real SIGINT while the import stages the state: before, click printed 'Aborted!' and
    exited 1, the code of damage."""
    import os
    import subprocess
    import sys

    src = tmp_path / "model.pt"
    torch.save(_state(1), src)
    root = tmp_path / "new" / "root"
    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-m", "ckpt.cli", "import", str(src), str(root), "--step", "1", "--trust"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "CKPT_INTERRUPT": "stage:0:1"},
    )
    assert res.returncode == 130, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("ckpt: error: interrupted"), res.stderr
    assert "Aborted" not in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "new").exists()


def test_a_step_already_there_is_refused_before_the_source_is_read(tmp_path: Path) -> None:
    """Before, the whole source was read (hours, for a large one) before the save found the
    step committed, and the message named the API's overwrite=True, not --overwrite."""
    src = tmp_path / "model.pt"
    torch.save(_state(1), src)
    root = tmp_path / "root"
    assert CliRunner().invoke(cli, ["import", str(src), str(root), "--step", "1", "--trust"]).exit_code == 0
    unreadable = tmp_path / "huge.pt"
    unreadable.write_bytes(b"not read at all")
    out = CliRunner().invoke(cli, ["import", str(unreadable), str(root), "--step", "1", "--trust"])
    assert out.exit_code == 3 and "already committed" in out.output and "--overwrite" in out.output, out.output
    with pytest.raises(VersionExistsError) as exists:  # the API names its own argument
        import_checkpoint(str(unreadable), root, 1, trust=True)
    assert "overwrite=True" in str(exists.value) and "--overwrite" not in str(exists.value), exists.value
    assert _same(_restored(root, 1), _state(1))


def test_a_safetensors_file_is_imported_without_trust_under_model(tmp_path: Path) -> None:
    """A safetensors file holds no pickle: before, the import asked for --trust ('importing
    unpickles a torch.save file') and then read it through torch.load's sniffing of the
    extension. Its tensors land under "model", where --to-safetensors takes them from."""
    from safetensors.torch import save_file

    module = torch.nn.Linear(4, 3).to(torch.bfloat16)
    tensors = {k: v.detach().clone() for k, v in module.state_dict().items()}
    src = tmp_path / "model.safetensors"
    save_file(tensors, str(src))
    root = tmp_path / "root"
    out = CliRunner().invoke(cli, ["import", str(src), str(root), "--step", "1"])
    assert out.exit_code == 0, out.output
    got = {"model": {k: torch.zeros_like(v) for k, v in tensors.items()}}
    with Checkpointer(root) as ck:
        assert ck.restore(got) == 1
    assert_bitwise(got["model"], tensors)
    fresh = torch.nn.Linear(4, 3).to(torch.bfloat16)
    with Checkpointer(root) as ck:
        assert ck.restore({"model": fresh}) == 1
    assert torch.equal(fresh.weight, module.weight) and torch.equal(fresh.bias, module.bias)
    garbled = tmp_path / "garbled.safetensors"
    garbled.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    out = CliRunner().invoke(cli, ["import", str(garbled), str(tmp_path / "root2"), "--step", "1"])
    assert out.exit_code == 3 and "not a readable safetensors file" in out.output, out.output
    assert not (tmp_path / "root2").exists()
