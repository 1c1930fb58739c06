"""The CLI used carelessly: targets that must not be replaced or written into, one-line
errors with their exit codes, an explicit GC policy, a fast start, and output that cuts
no tensor name (issue 18). Real roots made by the Checkpointer; the CLI through click's
CliRunner, or a subprocess where the interpreter's own state is what is checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from ckpt import Checkpointer
from ckpt._listing import Row
from ckpt.cli import main as cli
from ckpt.replicator.status import CopyState
from ckpt.store import versions
from ckpt.store.tier import open_tier

REPO = Path(__file__).resolve().parents[2]


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "meta": {"seed": seed}}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1, 2 and 3."""
    where = tmp_path / "root"
    with Checkpointer(where) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(step))
    return where


def run(*args: str) -> Result:
    return CliRunner(env={"COLUMNS": "80"}).invoke(cli, [str(a) for a in args])


def one_line_error(r: Result, code: int, *words: str) -> str:
    """The result failed with `code` and exactly one `ckpt: error:` line on stderr, no traceback."""
    assert r.exit_code == code, (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), r.stderr
    assert "Traceback" not in r.output
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def flip_last_byte(root: Path, step: int) -> None:
    chunk = next((root / versions.version_dirname(step) / "state" / "model").rglob("c.*"))
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 1
    chunk.write_bytes(bytes(raw))


# 1. --to-torch replaces nothing by accident


def test_to_torch_refuses_an_existing_file_unless_forced(root: Path, tmp_path: Path) -> None:
    target = tmp_path / "weights.pt"
    target.write_bytes(b"precious")
    one_line_error(run("restore", root, "--to-torch", target), 3, "--force")
    assert target.read_bytes() == b"precious"
    r = run("restore", root, "--step", "2", "--to-torch", target, "--force")
    assert r.exit_code == 0, r.output
    assert torch.load(target, weights_only=True)["meta"] == {"seed": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root", "weights.pt"]  # no temporary file left


def test_to_torch_never_replaces_what_is_not_a_regular_file(root: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real = tmp_path / "real.pt"
    real.write_bytes(b"keep")
    link = tmp_path / "link.pt"
    link.symlink_to(real)
    for target, kind in ((fifo, "a FIFO"), (link, "a symbolic link")):
        one_line_error(run("restore", root, "--to-torch", target, "--force"), 3, kind, "not a regular file")
    assert fifo.is_fifo() and link.is_symlink() and real.read_bytes() == b"keep"
    assert run("restore", root, "--to-torch", tmp_path, "--force").exit_code == 2  # a directory: click refuses it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.pt", "real.pt", "root"]


def test_to_torch_through_a_link_and_dot_dot_checks_the_file_it_writes(root: Path, tmp_path: Path) -> None:
    """`L/../fifo` with L a link elsewhere: the kernel resolves it in L's target's parent.
    Before, the file checked was that one and the file replaced (os.path.abspath) the one
    beside L: the FIFO and the link were replaced with --force."""
    elsewhere = tmp_path / "elsewhere" / "sub"
    elsewhere.mkdir(parents=True)
    here = tmp_path / "here"
    here.mkdir()
    (here / "L").symlink_to(elsewhere)
    os.mkfifo(here / "fifo")
    (here / "real.pt").write_bytes(b"keep")
    (here / "precious.pt").symlink_to(here / "real.pt")
    for name in ("fifo", "precious.pt"):
        r = run("restore", root, "--to-torch", f"{here}/L/../{name}", "--force")
        assert r.exit_code == 0, r.output
        assert torch.load(tmp_path / "elsewhere" / name, weights_only=True)["meta"] == {"seed": 3}
    assert (here / "fifo").is_fifo() and (here / "precious.pt").is_symlink()
    assert (here / "real.pt").read_bytes() == b"keep"


def test_targets_that_are_urls_or_empty_are_usage_errors(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, `--to-torch file:///x` wrote `./file:/x`, and `import SRC s3://b/p` wrote a
    root under `./s3:/b/p` and said it had imported there."""
    monkeypatch.chdir(tmp_path)
    for option in ("--to", "--to-torch", "--to-safetensors"):
        r = run("restore", root, option, "s3://bucket/x")
        assert r.exit_code == 2 and "not s3://bucket/x" in r.output, r.output
        r = run("restore", root, option, "")
        assert r.exit_code == 2 and f"{option} is empty" in r.output, r.output
    assert run("restore", root, "--to-torch", f"file://{tmp_path}/out.pt").exit_code == 0
    assert (tmp_path / "out.pt").is_file()
    # file: URLs of this machine in every form, and a local name holding "::" (no URL)
    for target in (f"file://localhost{tmp_path}/out.pt", f"file:{tmp_path}/out.pt", "a::b.pt"):
        r = run("restore", root, "--to-torch", target, "--force")
        assert r.exit_code == 0, (target, r.output)
    assert (tmp_path / "a::b.pt").is_file()
    (tmp_path / "a::b.pt").unlink()
    r = run("restore", root, "--to-torch", "file://otherhost/x.pt")
    assert r.exit_code == 2 and "names no path of this machine" in r.output, r.output
    source = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, source)
    r = run("import", source, "s3://bucket/p", "--step", "1", "--trust")
    assert r.exit_code == 2 and "not s3://bucket/p" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pt", "plain.pt", "root"]  # no ./file: or ./s3:


def test_export_options_are_refused_where_they_do_nothing(root: Path, tmp_path: Path) -> None:
    for option, value in (("--dtype", "bf16"), ("--prefix", "model"), ("--max-shard-size", "1GB")):
        for target in ("--to-torch", "--to"):
            r = run("restore", root, target, tmp_path / "out", option, value)
            assert r.exit_code == 2 and f"{option} applies to --to-safetensors only" in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_to_torch_into_a_missing_directory_or_proc_is_one_line(root: Path, tmp_path: Path) -> None:
    one_line_error(run("restore", root, "--to-torch", tmp_path / "nope" / "x.pt"), 3, "is not a directory")
    one_line_error(run("restore", root, "--to-torch", "/proc/ckpt-test.pt"), 3, "/proc/ckpt-test.pt")
    one_line_error(run("restore", root, "--to-torch", "/proc/self/status", "--force"), 3, "/proc/self/status")


# 2. every failure one line and its exit code


def test_restore_into_its_own_root_or_a_version_is_one_line(root: Path) -> None:
    r = run("restore", root, "--to", root)
    one_line_error(r, 3, "step 3 is already committed")
    assert "bytes" not in r.output  # no progress bar left behind
    before = sorted(p.name for p in (root / versions.version_dirname(3)).iterdir())
    for inside in (root / versions.version_dirname(3), root / versions.version_dirname(3) / "sub"):
        one_line_error(run("restore", root, "--to", inside), 3, "inside the version")
        # an export there would go when GC deletes the version
        one_line_error(run("restore", root, "--to-safetensors", inside, "--force"), 3, "inside the version")
    one_line_error(
        run("restore", root, "--to-torch", root / versions.version_dirname(3) / "x.pt"), 3, "inside the version"
    )
    assert sorted(p.name for p in (root / versions.version_dirname(3)).iterdir()) == before
    assert run("verify", root).exit_code == 0


def test_restore_of_a_corrupt_step_exits_1_like_verify(root: Path, tmp_path: Path) -> None:
    flip_last_byte(root, 3)
    assert run("verify", root, "--step", "3").exit_code == 1
    r = run("restore", root, "--step", "3", "--to-torch", tmp_path / "x.pt")
    assert r.exit_code == 1, r.output
    assert r.stderr.splitlines()[-1].startswith("ckpt: error: ") and "Traceback" not in r.output
    assert not (tmp_path / "x.pt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["root"]  # no temporary file left


def test_a_copy_killed_part_way_is_made_again_and_a_failed_one_leaves_no_root(root: Path, tmp_path: Path) -> None:
    """`restore --to DIR` killed (SIGKILL) left its save's directory, named by the save, and
    every later copy of that version failed on it ("File exists"), the lock notwithstanding.
    A copy that failed (a damaged chunk) left DIR holding a lock and a trash, which later
    commands took for a checkpoint root."""
    dest = tmp_path / "copy"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPT_FAULT": "copy-chunk"}
    cmd = [sys.executable, "-m", "ckpt.cli", "restore", str(root), "--step", "2", "--to", str(dest)]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, (killed.returncode, killed.stderr)
    assert [p.name for p in dest.iterdir() if p.name.startswith("v")] == [
        f"{versions.version_dirname(2)}.tmp-{_save_id(root, 2)}"
    ]
    r = run("restore", root, "--step", "2", "--to", dest)
    assert r.exit_code == 0, r.output
    assert [p.name for p in dest.iterdir() if p.name.startswith("v")] == [versions.version_dirname(2)]
    assert run("verify", dest).exit_code == 0
    flip_last_byte(root, 3)
    for where in (tmp_path / "new", tmp_path / "a" / "b" / "new"):
        assert run("restore", root, "--step", "3", "--to", where).exit_code == 1
        assert not where.exists() and not (tmp_path / "a").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "root"]


def _save_id(root: Path, step: int) -> str:
    manifest = json.loads((root / versions.version_dirname(step) / "manifest.json").read_text())
    return str(manifest["save_id"])


def test_restore_where_every_version_is_params_only_names_the_keys_option(tmp_path: Path) -> None:
    """The message named the API's restore(state, strict=False); the command's way is --keys."""
    where = tmp_path / "root"
    with Checkpointer(where) as ck:
        ck.save(1, _state(1), only=("model",))
    r = run("restore", where, "--to-torch", tmp_path / "f.pt")
    assert r.exit_code == 3, r.output
    line = r.stderr.splitlines()[-1]
    assert line.startswith("ckpt: error: ") and "--keys model restores step 1" in line, r.stderr
    assert "the CLI" not in line and "restore(" not in line, line
    assert run("restore", where, "--keys", "model", "--to-torch", tmp_path / "f.pt").exit_code == 0


def test_restore_reads_no_replicator_copy_held_under_root(root: Path, tmp_path: Path) -> None:
    """ROOT/replicas/<label> may hold the replicator's copies of another root, another job's
    too (its --replica-root pointed here): restore and inspect read ROOT's own versions and
    the peer copies of its job, not those (a --tier names them)."""
    other = tmp_path / "other"
    with Checkpointer(other) as ck:
        ck.save(500, _state(9))
    shutil.copytree(other, root / "replicas" / "other-job")
    out = run("restore", root, "--to-torch", tmp_path / "f.pt")
    assert out.exit_code == 0 and "restored step 3" in out.output, out.output
    assert run("inspect", root).output.startswith("step 3,")
    named = run("restore", root, "--tier", root / "replicas" / "other-job", "--to-torch", tmp_path / "g.pt")
    assert named.exit_code == 0 and "restored step 500" in named.output, named.output


def test_verify_of_a_step_that_never_existed_says_so(root: Path) -> None:
    one_line_error(run("verify", root, "--step", "7"), 3, "step 7 does not exist")


def test_a_missing_file_url_and_an_empty_storage_option_key(tmp_path: Path, root: Path) -> None:
    plain = run("ls", tmp_path / "nonexistent")
    url = run("ls", f"file://{tmp_path / 'nonexistent'}")
    one_line_error(plain, 3, "is not a directory")
    one_line_error(url, 3, "is not a directory")
    for bad in ("=x", ".a=x", "a..b=x"):
        r = run("ls", root, "--storage-option", bad)
        assert r.exit_code == 2 and "key is empty" in r.output, r.output


# 4. gc says what it keeps


def test_gc_milestones_alone_are_refused_and_the_policy_is_printed(root: Path) -> None:
    for alone in (["--milestone", "1"], ["--milestone-every", "2"]):
        r = run("gc", root, *alone)
        assert r.exit_code == 2 and "--all-but-milestones" in r.output, r.output
    assert versions.committed_steps(str(root)) == [1, 2, 3]
    r = run("gc", root, "--keep-last", "1", "--milestone", "1", "--milestone", "9")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == (
        "policy: keep the newest version, steps 1 and 9, the versions saved with milestone=True "
        "and the newest intact version and the newest full one; delete the rest"
    )
    warned = [line for line in r.stderr.splitlines() if line.startswith("ckpt: warning: ")]
    assert len(warned) == 1 and "--milestone 9" in warned[0], r.stderr
    assert versions.committed_steps(str(root)) == [1, 3]
    r = run("gc", root, "--all-but-milestones")
    assert r.exit_code == 0 and r.stdout.startswith("policy: keep the versions saved with milestone=True"), r.output
    assert versions.committed_steps(str(root)) == [3]
    assert run("gc", root, "--all-but-milestones", "--keep-last", "2").exit_code == 2


def test_gc_keeps_the_versions_saved_as_milestones(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "r") as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(step), milestone=step == 1)
    r = run("gc", tmp_path / "r", "--keep-last", "1")
    assert r.exit_code == 0, r.output
    assert "the versions saved with milestone=True" in r.stdout.splitlines()[0]
    assert versions.committed_steps(str(tmp_path / "r")) == [1, 3]


# 5. commands that write refuse ordinary directories


def test_commands_that_write_refuse_an_ordinary_directory(root: Path, tmp_path: Path) -> None:
    ordinary = tmp_path / "home"
    ordinary.mkdir()
    (ordinary / "notes.txt").write_text("mine")
    one_line_error(run("replicate", ordinary, "--once"), 3, "neither empty nor a checkpoint root")
    one_line_error(run("restore", root, "--to", ordinary), 3, "neither empty nor a checkpoint root")
    one_line_error(run("gc", ordinary, "--keep-last", "1"), 3, "neither empty nor a checkpoint root")
    # Where copies go: the remote as a path or a file:// URL, a replica root.
    one_line_error(run("replicate", root, "--once", "--to", ordinary), 3, "neither empty nor a checkpoint root")
    one_line_error(run("replicate", root, "--once", "--to", f"file://{ordinary}"), 3, "neither empty nor")
    one_line_error(
        run("replicate", root, "--once", "--replicas", "2", "--replica-root", ordinary), 3, "neither empty nor"
    )
    assert [p.name for p in ordinary.iterdir()] == ["notes.txt"]  # nothing written: no .replicator, no lock
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("restore", root, "--to", empty).exit_code == 0
    assert run("restore", root, "--step", "2", "--to", empty).exit_code == 0  # a checkpoint root now
    assert versions.committed_steps(str(empty)) == [2, 3]
    assert run("replicate", root, "--once").exit_code == 0  # a root


def test_replicate_refuses_an_empty_remote_and_its_own_root_as_the_remote(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--to "$REMOTE"` with the variable unset: no upload into the working directory
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for option in ("--to", "--replica-root"):
        r = run("replicate", root, "--once", option, "")
        assert r.exit_code == 2 and f"{option} is empty" in r.output and "Traceback" not in r.output, r.output
    assert list(cwd.iterdir()) == []
    # Usage errors that named API arguments (replicas=2) or said nothing (ROOT ''), and a
    # replica root that, without --replicas, was taken in silence and given no copy.
    for args, words in (
        (["", "--once"], "ROOT is empty"),
        ([root, "--once", "--replicas", "2"], "--replicas 2 needs 1 --replica-root, got 0"),
        ([root, "--once", "--replica-root", tmp_path / "disk2"], "makes no copy without --replicas"),
    ):
        r = run("replicate", *args)
        assert r.exit_code == 2 and words in r.output and "=" not in r.stderr.splitlines()[-1], r.output
    # a wait no pass can make: a traceback (OverflowError) after the first pass, and exit 1
    for interval, words in (("inf", "inf is not in the range"), ("nan", "--interval nan is no number of seconds")):
        r = run("replicate", root, "--interval", interval)
        assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, r.output
    # a cap of nan was no cap at all, and 1e-300 MB/s failed each copy with OverflowError
    for option, value in (("--bwlimit", "nan"), ("--bwlimit", "1e-300"), ("--abandoned-after", "nan")):
        r = run("replicate", root, "--once", option, value)
        assert r.exit_code == 2 and "Traceback" not in r.output, (option, value, r.exit_code, r.output)
    assert not (tmp_path / "disk2").exists()
    # the source as its own remote: the remote's GC would delete the source's versions
    for remote in (str(root), f"file://{root}/"):
        one_line_error(run("replicate", root, "--once", "--to", remote, "--remote-keep-last", "1"), 3, "itself")
    assert versions.committed_steps(str(root)) == [1, 2, 3]


def test_replicate_refuses_another_job_s_root_as_the_remote(root: Path, tmp_path: Path) -> None:
    """Before, the remote's retention deleted the other job's versions (kept the newest)."""
    other = tmp_path / "other"
    with Checkpointer(other) as ck:
        for step in (10, 20, 30):
            ck.save(step, _state(step))
    one_line_error(
        run("replicate", root, "--once", "--to", other, "--remote-keep-last", "1"), 3, "another job's checkpoint root"
    )
    assert versions.committed_steps(str(other)) == [10, 20, 30]


def test_a_version_whose_root_json_is_damaged_is_damaged_to_gc_verify_and_ls(root: Path, tmp_path: Path) -> None:
    """A restore cannot choose it (which ranks' chunks the root holds is unknown). Before, gc
    took it for the newest intact version and deleted every version a restore could use,
    verify said ok and ls called it partial."""
    (root / versions.version_dirname(3) / "root.json").write_text("{bad")
    r = run("verify", root)
    assert r.exit_code == 1 and "step 3: BAD" in r.output and "root.json" in r.output, r.output
    assert "damaged" in next(line for line in run("ls", root).output.splitlines() if line.strip().startswith("3 "))
    r = run("gc", root, "--keep-last", "1")
    assert r.exit_code == 0, r.output
    assert 2 in versions.committed_steps(str(root)), r.output
    r = run("restore", root, "--to-torch", tmp_path / "out.pt")
    assert r.exit_code == 0 and "restored step 2" in r.output, r.output


@pytest.mark.parametrize("harm", ["missing", "truncated", "link", "rank-file"])
def test_gc_keeps_what_a_restore_falls_back_to_when_the_newest_lost_files(root: Path, harm: str) -> None:
    """gc judged a version intact by its manifest and root.json alone: with the newest one's
    chunk file gone (or cut short, or a link), `--keep-last 1` deleted every version a
    restore could fall back to. Its files are now checked against the manifest (a stat each)."""
    v3 = root / versions.version_dirname(3)
    chunk = next((v3 / "state" / "model").rglob("c.*"))
    if harm == "missing":
        chunk.unlink()
    elif harm == "truncated":
        chunk.write_bytes(chunk.read_bytes()[:-1])
    elif harm == "link":
        data = chunk.read_bytes()
        chunk.unlink()
        (root.parent / "elsewhere").write_bytes(data)
        chunk.symlink_to(root.parent / "elsewhere")
    else:
        (v3 / "ranks" / "0.json").unlink()
    # In a process of its own, as an operator runs it (this one wrote the versions whole).
    r = subprocess.run(
        [sys.executable, "-m", "ckpt.cli", "gc", str(root), "--keep-last", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert versions.committed_steps(str(root)) == [2, 3], r.stdout + r.stderr
    with Checkpointer(root) as ck:
        got = _state(0)
        assert ck.restore(got) == 2


def test_gc_by_kind_needs_both_counts(tmp_path: Path) -> None:
    """`--keep-last-partial 2` alone kept no full version (the other count was taken as 0)."""
    root = tmp_path / "root"
    with Checkpointer(root) as ck:
        ck.save(1, _state(1))
        ck.save(2, _state(2), only=("model",))
    for option in ("--keep-last-full", "--keep-last-partial"):
        r = run("gc", root, option, "2")
        assert r.exit_code == 2 and "together" in r.output, r.output
    assert versions.committed_steps(str(root)) == [1, 2]


def test_the_remote_keeps_the_milestones_and_milestones_alone_are_refused(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "r") as ck:
        for step in (1, 2, 3, 4, 5):
            ck.save(step, _state(step), milestone=step == 1)
    remote = tmp_path / "remote"
    # --milestone-every alone would make the remote keep only the milestones, not everything
    r = run("replicate", tmp_path / "r", "--once", "--to", f"file://{remote}", "--milestone-every", "2")
    assert r.exit_code == 2 and "--remote-keep-last" in r.output and "Traceback" not in r.output, r.output
    assert not remote.exists()
    for more, kept in (([], [1, 5]), (["--milestone-every", "4"], [1, 4, 5])):  # milestone=True: kept either way
        to = f"file://{remote}{len(more)}"
        ok = run("replicate", tmp_path / "r", "--once", "--to", to, "--remote-keep-last", "1", *more)
        assert ok.exit_code == 0, ok.output
        assert versions.committed_steps(f"{remote}{len(more)}") == kept


# 6. a fast start: no torch for --help, ls and verify


def test_the_cli_starts_without_torch(root: Path) -> None:
    check = f"""
import sys
import ckpt, ckpt.cli
assert "torch" not in sys.modules, "import ckpt.cli"
from click.testing import CliRunner
for args in (["--help"], ["ls", {str(root)!r}], ["ls", {str(root)!r}, "--json"], ["verify", {str(root)!r}]):
    r = CliRunner().invoke(ckpt.cli.main, args)
    assert r.exit_code == 0, (args, r.output)
    assert "torch" not in sys.modules, args
    assert "rich.progress" not in sys.modules, args
from ckpt import Checkpointer, Shard
assert Checkpointer.__name__ == "Checkpointer" and "torch" in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


# 7. output: names never cut, rows never wrapped


LONG = "model/transformer/layers/11/self_attention/q_proj/weight"


def test_inspect_never_cuts_a_tensor_name(tmp_path: Path) -> None:
    from ckpt._render import inspect_lines

    state = _state(0)
    state["transformer"] = {"layers": {"11": {"self_attention": {"q_proj": {"weight": torch.ones(3, 2)}}}}}
    with Checkpointer(tmp_path / "r") as ck:
        ck.save(5, {"model": state})
    r = run("inspect", tmp_path / "r")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    for name in (LONG, "model/optim/state/0/exp_avg", "model/optim/state/0/exp_avg_sq"):
        assert any(line.split()[:2] == [name, "float32"] for line in lines), r.stdout  # `| grep name` finds it
    assert not any(c in r.stdout for c in "…│┃━"), r.stdout  # plain text into a pipe: no boxes
    assert "step 5, saved " in lines[0] and "world size 1, 1 root" in lines[1], lines[:2]  # no value cut in two
    manifest = versions.read_manifest(str(tmp_path / "r"), 5)
    narrow = inspect_lines(manifest, [], width=60)  # a terminal too narrow for the table
    assert LONG in narrow and "model/optim/state/0/exp_avg_sq" in narrow
    table = narrow[narrow.index("tensor") :]
    assert all(len(line) <= 60 for line in table if line != LONG), "\n".join(narrow)


def test_ls_rows_fit_80_columns_in_every_state(root: Path) -> None:
    from ckpt._render import ls_lines

    r = run("ls", root)
    assert r.exit_code == 0
    assert all(line == line.rstrip() and len(line) <= 80 for line in r.stdout.splitlines()), r.stdout
    old = time.time() - 40 * 86400
    rows = [
        Row(
            10**12 - 1,
            "committed",
            time=old,
            bytes=1023 * 2**30,
            world_size=16384,
            milestone=True,
            copies={"a": CopyState("verified", old), "b": CopyState("pending", old)},
            remote=CopyState("waiting for other nodes", old),
            lag_s=40 * 86400.0,
        ),
        Row(5, "unreadable", "an I/O error " * 10),
        Row(6, "incomplete", "v000000000006.tmp-0123456789abcdef"),
    ]
    lines = ls_lines("/some/root", rows, 80)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    table = [line for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    assert [t.split()[0] for t in table] == [str(10**12 - 1), "5", "6"], "\n".join(lines)
    assert "waiting 40d" in table[0] and "1/2" in table[0] and "…" not in "".join(lines)


def test_no_progress_bar_text_before_a_fallback_message(root: Path, tmp_path: Path) -> None:
    flip_last_byte(root, 3)
    r = run("restore", root, "--to-torch", tmp_path / "x.pt")
    assert r.exit_code == 0, r.output
    warning = next(i for i, line in enumerate(r.stderr.splitlines()) if "is not intact" in line)
    assert not any("bytes" in line for line in r.stderr.splitlines()[:warning]), r.stderr
    assert "restored step 2" in r.stdout


# 8. wording


def test_replicate_says_what_it_does_in_words(root: Path) -> None:
    r = run("replicate", root, "--once")
    assert r.exit_code == 0, r.output
    assert "copies over" not in r.output and "1 copies" not in r.output, r.output
    listing = run("ls", root)
    assert "none" not in listing.stdout and " 0/0 " in listing.stdout, listing.stdout
    rows = json.loads(run("ls", root, "--json").stdout)
    assert [row["copies"] for row in rows] == [{}, {}, {}]


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_a_reader_that_stops_reading_ends_the_command_quietly(root: Path, command: str) -> None:
    """`ckpt verify ROOT | head -1`: the pipe's reader goes away. Before, the command printed
    'ckpt: error: [Errno 32] Broken pipe' and exited 3, as for a failure of its own."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from ckpt.cli import main; main()", command, str(root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes: its first write finds no reader
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


def test_a_file_url_of_no_absolute_path_is_a_usage_error_not_the_working_directory(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`file://$UNSET` named the working directory: from inside a root, `gc file://` deleted
    its versions, and `replicate --to file://` wrote copies where the shell stood."""
    monkeypatch.chdir(root)
    for args in (["ls", "file://"], ["gc", "file://", "--keep-last", "0"], ["ls", "file://rel"]):
        r = run(*args)
        assert r.exit_code == 2 and "names no path of this machine" in r.output, (args, r.exit_code, r.output)
    assert sorted(versions.committed_steps(open_tier(str(root)))) == [1, 2, 3]
    empty = tmp_path / "cwd"
    empty.mkdir()
    monkeypatch.chdir(empty)
    r = run("replicate", root, "--to", "file://", "--once")
    assert r.exit_code == 2 and "--to" in r.output, (r.exit_code, r.output)
    assert list(empty.iterdir()) == []
    r = run("ls", f"file://localhost{root}")
    assert r.exit_code == 0 and "committed" in r.output, (r.exit_code, r.output)


def test_a_checkpointer_root_that_is_a_url_is_its_path_or_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpointer("file:///abs") rooted itself at ./file:/abs, and Checkpointer("s3://b/x")
    at ./s3:/b/x, a local directory the user took for the bucket."""
    monkeypatch.chdir(tmp_path)
    with Checkpointer(f"file://{tmp_path / 'a'}") as ck:
        assert ck.root == str(tmp_path / "a")
    for bad in ("s3://bucket/run1", "file://", "file://relative", "file:relative"):
        with pytest.raises(ValueError, match="is a URL|no path of this machine"):
            Checkpointer(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def _without_root_s_override(*argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a user whom permissions bind: root, less the capabilities that override them."""
    drop = "-dac_override,-dac_read_search"
    return subprocess.run(
        ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", sys.executable, "-m", "ckpt.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to drop the override"
)
def test_a_version_directory_that_cannot_be_listed_stops_no_listing(root: Path) -> None:
    """v3's directory unreadable (mode 000, a user bound by permissions): ls, verify and gc
    stopped at it (exit 3, 'cannot list'), showing and checking nothing of steps 1 and 2;
    verify skipped it in silence where it was listed (os.path.lexists said it was gone)."""
    v3 = root / versions.version_dirname(3)
    v3.chmod(0)
    try:
        ls = _without_root_s_override("ls", str(root))
        rows = {line.split()[0]: line for line in ls.stdout.splitlines() if line.strip()[:1].isdigit()}
        assert ls.returncode == 0 and sorted(rows) == ["1", "2", "3"], ls
        assert "unreadable" in rows["3"] and "committed" in rows["1"] and "committed" in rows["2"], rows
        verify = _without_root_s_override("verify", str(root))
        assert verify.returncode == 3, verify
        assert "step 1: ok" in verify.stdout and "step 2: ok" in verify.stdout, verify.stdout
        assert "step 3: UNREADABLE" in verify.stdout, verify.stdout
        gc = _without_root_s_override("gc", str(root), "--keep-last", "1")
        # 3 cannot be judged: kept (exit 4), and so is 2, the newest intact version
        assert gc.returncode == 4 and "deleted 1 version(s): [1]; kept [2, 3]" in gc.stdout, gc
    finally:
        v3.chmod(0o755)
    assert sorted(versions.committed_steps(open_tier(str(root)))) == [2, 3]
