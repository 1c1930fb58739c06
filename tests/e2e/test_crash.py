"""Real crashes: a child process is SIGKILLed in the middle of a save, then the parent
checks that only complete versions are listed, that they restore bitwise, and that
opening the root again removes every leftover tmp directory.

Two kinds of crash:
- at a named point of the commit protocol (store/faults.py, armed through CKPT_FAULT);
- from the outside, at a random moment, while the child saves step after step.
"""

from __future__ import annotations

import glob
import inspect
import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt import Checkpointer
from tests._states import assert_bitwise

REPO = Path(__file__).resolve().parents[2]
FAULT_POINTS = ["after-stage", "after-write", "after-prepare", "after-publish"]


# -- helpers shared with the child processes (inlined into their scripts) ----------------


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()


def state_for(step: int) -> dict[str, Any]:
    """The state the looping child saves at `step`: a pure function of the step."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.full((64, 1024), float(step)),
        "r": torch.randn(300, 70, generator=g),
        "i": torch.arange(1000, dtype=torch.int64) * step,
        "h": torch.randn(33, generator=g).to(torch.float16),
        "s": torch.tensor(step),
        "meta": {"step": step, "tag": f"s{step}"},
    }


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CKPT_FAULT", None)
    env.pop("CKPT_FAULT_RANK", None)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _script(tmp_path: Path, name: str, body: str) -> Path:
    helpers = "\n\n".join(inspect.getsource(f) for f in (build, train, state_for))
    header = "from __future__ import annotations\nimport os, sys\nfrom typing import Any\nimport torch\n"
    path = tmp_path / name
    path.write_text(header + "\n" + helpers + "\n\n" + textwrap.dedent(body))
    return path


def tmp_dirs(root: Path) -> list[str]:
    return glob.glob(os.path.join(root, "*.tmp-*"))


# -- crashes at the protocol's fault points --------------------------------------------

FAULT_CHILD = """
fault = os.environ.pop("CKPT_FAULT")  # armed for step 2 only
from ckpt import Checkpointer

root, expected, overlap = sys.argv[1], sys.argv[2], sys.argv[3] == "overlap"
model, opt = build(0)
train(model, opt, 3)
state = {"model": model, "optim": opt, "extra": {"step": 1, "note": "one"}}
with Checkpointer(root, overlap_writes=overlap) as ck:
    ck.save(1, state)
    ck.wait()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "extra": dict(state["extra"])}, expected + ".1")
    train(model, opt, 2)
    state["extra"] = {"step": 2, "note": "two"}
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "extra": dict(state["extra"])}, expected + ".2")
    os.environ["CKPT_FAULT"] = fault
    if overlap:  # a slow copy: the writers are at work on the first chunks when it ends
        os.environ["CKPT_DELAY"] = "stage:0:0.05"
    ck.save(2, state)
    ck.wait()
sys.exit(17)  # the fault point should have killed us before this
"""


@pytest.mark.parametrize(
    ("point", "overlap"), [(p, False) for p in FAULT_POINTS] + [("after-stage", True)], ids=lambda x: str(x)
)
def test_sigkill_at_fault_point(tmp_path: Path, point: str, overlap: bool) -> None:
    """With overlap_writes, the kill at the end of save()'s copy lands while the writers
    already write the version's chunks."""
    root = tmp_path / "root"
    expected = tmp_path / "expected"
    script = _script(tmp_path, "child.py", FAULT_CHILD)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), str(expected), "overlap" if overlap else "sequential"],
        env=_child_env(CKPT_FAULT=point),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"child exited {proc.returncode}\n{out}\n{err}"

    # Before recovery: an unpublished save leaves at most a tmp dir, never a listed version.
    committed_before = sorted(int(p.name[1:]) for p in root.iterdir() if p.name.startswith("v") and "." not in p.name)
    want_step = 2 if point == "after-publish" else 1
    if point in ("after-write", "after-prepare"):
        assert tmp_dirs(root), "the crash should have left the unfinished save behind"
    if overlap:
        chunks = [f for d in tmp_dirs(root) for f in glob.glob(os.path.join(d, "**", "c.*"), recursive=True)]
        assert chunks, "the writers should have started before save() returned"
    assert committed_before == ([1, 2] if point == "after-publish" else [1])

    with Checkpointer(root) as ck:
        assert tmp_dirs(root) == [], "recovery must remove unfinished saves"
        assert ck.steps() == ([1, 2] if point == "after-publish" else [1])
        assert ck.latest_step() == want_step
        model, opt = build(1234)  # other initial values, no optimizer state yet
        state: dict[str, Any] = {"model": model, "optim": opt, "extra": {"step": 0, "note": ""}}
        assert ck.restore(state) == want_step
        # The root takes new saves, also of the step whose save was torn.
        assert ck.save(want_step + 1, state) is True
        ck.wait()
        assert ck.steps() == list(range(1, want_step + 2))
    ref = torch.load(f"{expected}.{want_step}", weights_only=True)
    assert_bitwise(model.state_dict(), ref["model"], "model")
    assert_bitwise(opt.state_dict(), ref["optim"], "optim")
    assert state["extra"] == ref["extra"]
    if point == "after-publish":  # the older version is still there and intact
        model1, opt1 = build(99)
        with Checkpointer(root) as ck:
            assert ck.restore({"model": model1, "optim": opt1, "extra": None}, step=1) == 1
        ref1 = torch.load(f"{expected}.1", weights_only=True)
        assert_bitwise(model1.state_dict(), ref1["model"], "model")
        assert_bitwise(opt1.state_dict(), ref1["optim"], "optim")
    assert tmp_dirs(root) == []


SPARE_CHILD = """
fault = os.environ.pop("CKPT_FAULT")  # armed for step 3 only
import time
from ckpt import Checkpointer
from ckpt.store.spare import spares

root = sys.argv[1]
with Checkpointer(root, keep_last=1) as ck:
    for step in (1, 2):
        ck.save(step, state_for(step))
        ck.wait()
    deadline = time.monotonic() + 60
    while not spares(root):  # retention retired step 1's tree
        assert time.monotonic() < deadline, "no spare tree"
        time.sleep(0.02)
    os.environ["CKPT_FAULT"] = fault
    ck.save(3, state_for(3))  # into step 1's tree
    ck.wait()
sys.exit(17)
"""


@pytest.mark.parametrize("point", ["after-write", "after-prepare"])
def test_sigkill_while_a_save_overwrites_a_spare_tree(tmp_path: Path, point: str) -> None:
    """A save that writes into a retired version's tree (store.spare) and dies leaves the
    previous version intact and nothing partial listed; the next save of the step commits."""
    root = tmp_path / "root"
    script = _script(tmp_path, "child.py", SPARE_CHILD)
    proc = subprocess.run(
        [sys.executable, str(script), str(root)],
        env=_child_env(CKPT_FAULT=point),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, f"child exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    (torn,) = tmp_dirs(root)
    assert not glob.glob(os.path.join(root, ".spare*")), "the save should have taken the spare tree"
    assert glob.glob(os.path.join(torn, "**", "c.*"), recursive=True), "the save should have written chunks"
    with Checkpointer(root, keep_last=1) as ck:
        assert tmp_dirs(root) == [], "recovery must remove unfinished saves"
        assert ck.steps() == [2]
        got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state_for(2).items()}
        assert ck.restore(got) == 2
        assert_bitwise(got, state_for(2))
        ck.save(3, state_for(3))
        ck.wait()
        got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state_for(3).items()}
        assert ck.restore(got, step=3) == 3
        assert_bitwise(got, state_for(3))


# -- crashes at random moments ----------------------------------------------------------

LOOP_CHILD = """
from ckpt import Checkpointer

root = sys.argv[1]
with Checkpointer(root) as ck:
    start = (ck.latest_step() or 0) + 1
    for step in range(start, start + 1_000_000):
        ck.save(step, state_for(step))
        if step == start:
            ck.wait()
            print("ready", step, flush=True)
"""


def _wait_ready(proc: subprocess.Popen[str], timeout: float) -> int:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("ready "):
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the child did not get ready: {line!r}\n{err}")
    return int(line.split()[1])


def test_sigkill_at_random_moments(tmp_path: Path) -> None:
    root = tmp_path / "root"
    script = _script(tmp_path, "loop.py", LOOP_CHILD)
    rng = random.Random(20240601)
    checked: set[int] = set()
    for iteration in range(5):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(root)],
            env=_child_env(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            first = _wait_ready(proc, 60)
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"iteration {iteration}: child exited {proc.returncode}"

        with Checkpointer(root) as ck:
            assert tmp_dirs(root) == [], "recovery must remove unfinished saves"
            steps = ck.steps()
            assert first in steps, f"step {first} was committed (waited for) before the kill"
            assert steps == list(range(1, steps[-1] + 1)), f"steps must be contiguous: {steps}"
            for step in steps:
                target = {
                    k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state_for(0).items()
                }
                assert ck.restore(target, step=step) == step
                assert_bitwise(target, state_for(step), f"step {step}")
                checked.add(step)
            latest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state_for(0).items()}
            assert ck.restore(latest) == steps[-1]
            assert_bitwise(latest, state_for(steps[-1]), "latest")
        assert tmp_dirs(root) == []
    assert len(checked) >= 5


# -- crashes while overwriting a committed step -------------------------------------------

OVERWRITE_CHILD = """
point = os.environ.pop("CKPT_FAULT")
import signal
import ckpt.store.commit
from ckpt import Checkpointer

root = sys.argv[1]
armed = False
real_fsync_dir = ckpt.store.commit.fsync_dir


def fsync_then_die(path):
    # publish() fsyncs the root right after swapping the new version in: die there, before
    # the swapped-out old version is deleted.
    real_fsync_dir(path)
    if armed and os.path.abspath(path) == os.path.abspath(root):
        os.kill(os.getpid(), signal.SIGKILL)


ckpt.store.commit.fsync_dir = fsync_then_die
with Checkpointer(root) as ck:
    ck.save(5, state_for(1))
    ck.wait()
    if point == "after-exchange":
        armed = True
    else:
        os.environ["CKPT_FAULT"] = point
    ck.save(5, state_for(2), overwrite=True)
    ck.wait()
sys.exit(17)
"""


@pytest.mark.parametrize("point", ["after-write", "after-prepare", "after-exchange", "after-publish"])
def test_sigkill_during_overwrite(tmp_path: Path, point: str) -> None:
    root = tmp_path / "root"
    script = _script(tmp_path, "overwrite.py", OVERWRITE_CHILD)
    proc = subprocess.run(
        [sys.executable, str(script), str(root)],
        check=False,
        env=_child_env(CKPT_FAULT=point),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, f"child exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    # Before the swap the old version is the committed one; from the swap on, the new one.
    want = state_for(1) if point in ("after-write", "after-prepare") else state_for(2)
    with Checkpointer(root) as ck:
        assert tmp_dirs(root) == [], "recovery must remove unfinished saves"
        assert ck.steps() == [5]
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state_for(0).items()}
        assert ck.restore(target) == 5
    assert_bitwise(target, want, "the old version" if point in ("after-write", "after-prepare") else "the new version")
    assert not (root / ".trash").exists() or list((root / ".trash").iterdir()) == []


# -- a rank killed while another saves -------------------------------------------------

SURVIVOR_CHILD = """
import datetime, json, signal
import torch.distributed as dist
from ckpt import Checkpointer

rank, workdir = int(sys.argv[1]), sys.argv[2]
fault = os.environ.pop("CKPT_FAULT", None)  # rank 1's, armed for step 2 only
dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=2)
if fault == "before-open" and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
out: dict[str, Any] = {}
try:
    with Checkpointer(f"{workdir}/root{rank}", timeout=datetime.timedelta(seconds=20)) as ck:
        ck.save(1, state_for(1))
        ck.wait()
        if fault:
            os.environ["CKPT_FAULT"] = fault
        try:
            ck.save(2, state_for(2))
            ck.wait()
        except BaseException as e:
            out = {"mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}
        out["steps"] = ck.steps()
except BaseException as e:
    out = {"mro": [c.__name__ for c in type(e).__mro__], "message": str(e), "steps": None}
with open(f"{workdir}/rank{rank}.json", "w") as f:
    json.dump(out, f)
"""


@pytest.mark.parametrize("point", ["after-stage", "after-prepare", "before-open"])
def test_a_rank_killed_mid_save_is_a_collective_error_on_the_other(tmp_path: Path, point: str) -> None:
    """Rank 1 is SIGKILLed inside step 2's save: rank 0's save or wait raises the documented
    CollectiveError (it raised gloo's bare RuntimeError), and step 1 stays committed. Killed
    before the Checkpointer opens: rank 0's opening raises it (after the timeout)."""
    script = _script(tmp_path, "survivor.py", SURVIVOR_CHILD)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path)],
            env=_child_env(CKPT_FAULT=point, CKPT_FAULT_RANK="1"),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert procs[1].returncode == -signal.SIGKILL, f"rank 1 exited {procs[1].returncode}\n{outs[1]}"
    assert procs[0].returncode == 0, f"rank 0 exited {procs[0].returncode}\n{outs[0]}"
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen.get("mro", [None])[0] == "CollectiveError", seen
    assert {"CkptError", "RuntimeError"} <= set(seen["mro"]), seen
    assert "another rank died" in seen["message"] and "RuntimeError" in seen["message"], seen
    if point == "before-open":
        assert "in its creation" in seen["message"] and seen["steps"] is None, seen
    else:
        assert 1 in seen["steps"], seen
