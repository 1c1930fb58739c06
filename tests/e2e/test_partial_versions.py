"""Params-only intermediate versions between full ones (issue 20).

A version may hold a subset of the state's top-level keys (`save(..., only=...)`, or a
`full_every` schedule). Restore picks the newest version that holds every key of the
state and says which newer ones it passed over; retention never deletes the newest full
version, so a job can always resume.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpt import Checkpointer
from ckpt.cli import main as cli
from ckpt.store.errors import StateMismatchError, VersionExistsError
from ckpt.store.versions import committed_steps
from tests._dist import can_isolate, in_private_mounts, launch
from tests._states import bitwise_diff

THIS = os.path.abspath(__file__)


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def full_then_params_only(ctx: Any, root: str) -> dict[str, Any]:
    model, opt = _build(0)  # data-parallel replicas: the same on every rank
    refs: dict[int, Any] = {}
    with Checkpointer(root) as ck:
        for step in (2, 3, 4):
            _train(model, opt, 100 * step)
            state = {"model": model, "optim": opt, "step": step}
            if step == 2:
                ck.save(step, state)
            else:
                ck.save(step, state, only=("model",))
            ck.wait()
            refs[step] = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
            if step == 2:
                refs[step]["optim"] = opt.state_dict()
                refs[step]["optim"]["state"] = {
                    k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()
                }

    lines = _Lines()
    logging.getLogger("ckpt").addHandler(lines)
    m2, o2 = _build(99)
    full = {"model": m2, "optim": o2, "step": 0}
    with Checkpointer(root) as ck:
        got_full = ck.restore(full)
        ctx.check(full["step"] == 2, f"step key {full['step']}")
        diff = bitwise_diff({"model": m2.state_dict(), "optim": o2.state_dict()}, refs[2])
        ctx.check(not diff, f"full restore differs: {diff[:3]}")
        m3, _ = _build(98)
        got_model = ck.restore({"model": m3})
        diff = bitwise_diff(m3.state_dict(), refs[4]["model"])
        ctx.check(not diff, f"model-only restore differs: {diff[:3]}")
        try:
            ck.restore({"model": _build(97)[0], "optim": _build(97)[1], "step": 0}, step=4)
            ctx.check(False, "a full restore of the params-only step 4 did not raise")
        except StateMismatchError as e:
            ctx.check("optim" in str(e), f"unexpected message: {e}")
    logging.getLogger("ckpt").removeHandler(lines)
    passed = [line for line in lines.lines if "passed over" in line]
    return {"full": got_full, "model": got_model, "passed": passed}


def test_restore_picks_the_newest_version_with_every_key_and_gc_keeps_it(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    results, failures = launch(THIS, "full_then_params_only", 2, tmp_path, root=root)
    assert not failures, failures
    assert [r["full"] for r in results] == [2, 2]
    assert [r["model"] for r in results] == [4, 4]
    skipped = results[0]["passed"]
    assert len(skipped) == 2 and "step 4" in skipped[0] and "step 3" in skipped[1], skipped
    ls = CliRunner().invoke(cli, ["ls", root, "--json"])
    assert ls.exit_code == 0, ls.output
    keys = {r["step"]: r["keys"] for r in json.loads(ls.output)}
    assert keys == {2: None, 3: ["model"], 4: ["model"]}, keys  # None: every key
    table = CliRunner().invoke(cli, ["ls", root])
    assert "committed~" in table.output and "step 3, 4 holds only model" in table.output, table.output
    inspect = CliRunner().invoke(cli, ["inspect", root, "--step", "3"])
    assert inspect.exit_code == 0 and "keys: model" in inspect.output, inspect.output
    out = Path(root).parent / "model.pt"
    export = CliRunner().invoke(cli, ["restore", root, "--keys", "model", "--to-torch", str(out)])
    assert export.exit_code == 0 and "restored step 4" in export.output, export.output
    assert list(torch.load(out, weights_only=True)) == ["model"]
    export = CliRunner().invoke(cli, ["restore", root, "--to-torch", str(out), "--force"])
    assert export.exit_code == 0 and "restored step 2" in export.output, export.output  # every key: the full one
    gc = CliRunner().invoke(cli, ["gc", root, "--keep-last", "1"])
    assert gc.exit_code == 0, gc.output
    assert committed_steps(root) == [2, 4]  # 2: the newest a full restore can use
    gc = CliRunner().invoke(cli, ["gc", root, "--keep-last-full", "1", "--keep-last-partial", "0"])
    assert gc.exit_code == 0, gc.output
    assert committed_steps(root) == [2, 4]  # 4: the newest intact version is never deleted


def _kinds(root: Path) -> dict[int, Any]:
    ls = CliRunner().invoke(cli, ["ls", str(root), "--json"])
    assert ls.exit_code == 0, ls.output
    return {r["step"]: r["keys"] for r in json.loads(ls.output)}


def test_full_every_schedule_and_retention_keep_resume_possible(tmp_path: Path) -> None:
    model, opt = _build(0)
    state = {"model": model, "optim": opt, "step": 0}
    with Checkpointer(tmp_path, full_every=3, partial_keys=("model",)) as ck:
        for step in range(1, 9):
            _train(model, opt, step)
            state["step"] = step
            ck.save(step, state, milestone=step == 5)
    kinds = _kinds(tmp_path)
    full = sorted(s for s, k in kinds.items() if k is None)
    assert full == [1, 4, 5, 7], kinds  # the first save, every 3rd after it, and the milestone
    assert all(k == ["model"] for s, k in kinds.items() if s not in full)

    root2 = tmp_path / "kept"
    with Checkpointer(root2, full_every=3, partial_keys=("model",), keep_last=1) as ck:
        for step in range(1, 9):
            ck.save(step, state, milestone=step == 5)
    assert committed_steps(root2) == [5, 7, 8]  # newest, newest full, the milestone

    m2, o2 = _build(1)
    with Checkpointer(root2) as ck:
        assert ck.restore({"model": m2, "optim": o2, "step": 0}) == 7


def _run(root: Path, stop_after: int | None) -> tuple[int | None, dict[int, dict[str, torch.Tensor]]]:
    """The README's params-only loop: resume, train, save every 2nd step; stop after a step
    (a crash) or run to step 19. What it restored, and the model it saved at each step."""
    model, opt = _build(0)
    state: dict[str, Any] = {"model": model, "optim": opt, "step": 0}
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(root, full_every=5, partial_keys=("model",), keep_last=3) as ck:
        got = ck.restore(state)
        for step in range(state["step"] + 1, 20):
            _train(model, opt, step)
            state["step"] = step
            if step % 2 == 0:
                ck.save(step, state)
                saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            if step == stop_after:
                break
    return got, saved


def test_a_run_resumed_from_a_full_version_saves_over_the_params_only_ones_it_passed(tmp_path: Path) -> None:
    """Full versions at 2 and 12, params-only ones at 14 and 16, then a crash: the resumed run
    restores 12 and saves its own 14 (full: the first save after a restore) and 16, each
    replacing the one the restore passed over (after its commit), and 18. Before, its first save raised VersionExistsError, and the run
    could not go on without overwrite=True on every save."""
    _run(tmp_path, stop_after=17)
    assert {s: k for s, k in _kinds(tmp_path).items() if s >= 12} == {12: None, 14: ["model"], 16: ["model"]}
    got, saved = _run(tmp_path, stop_after=None)
    assert got == 12
    kinds = _kinds(tmp_path)
    assert kinds == {14: None, 16: ["model"], 18: ["model"]}, kinds  # its first save is full; keep_last=3
    for step in (14, 16, 18):
        model, _ = _build(1)
        with Checkpointer(tmp_path) as ck:
            ck.restore({"model": model}, step=step)
        assert not bitwise_diff(model.state_dict(), saved[step]), step
    # A step passed over is replaced once: a second save of it is refused as before.
    model, opt = _build(0)
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(VersionExistsError):
            ck.save(18, {"model": model})


def test_a_milestone_is_never_partial_and_only_names_real_keys(tmp_path: Path) -> None:
    state = {"model": torch.nn.Linear(2, 2), "step": 1}
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(ValueError, match="milestone"):
            ck.save(1, state, only=("model",), milestone=True)
        with pytest.raises(ValueError, match="nope"):
            ck.save(1, state, only=("nope",))
    with pytest.raises(ValueError, match="partial_keys"):
        Checkpointer(tmp_path, full_every=3)


def test_strict_false_loads_a_params_only_version_into_a_full_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As documented, with a warning naming what it left (before, an INFO line alone)."""
    model, opt = _build(0)
    _train(model, opt, 1)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": model, "optim": opt})
        _train(model, opt, 2)
        ck.save(2, {"model": model, "optim": opt}, only=("model",))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    m2, o2 = _build(5)
    with Checkpointer(tmp_path) as ck, caplog.at_level(logging.WARNING, logger="ckpt"):
        assert ck.restore({"model": m2, "optim": o2}, strict=False) == 2
    assert not bitwise_diff(m2.state_dict(), want)
    assert not o2.state  # the params-only version has no optimizer state: left as it was
    assert "step 2 is a params-only version without ['optim']: left as they were" in caplog.text, caplog.text


# -- found by a review: retention when the state's keys change, schedules, selection ------


def test_retention_keeps_the_newest_version_of_each_key_set_a_restore_could_choose() -> None:
    from ckpt.replicator.policy import KeepLast, VersionInfo, plan_deletions

    def v(step: int, *keys: str) -> VersionInfo:
        return VersionInfo(step, keys=frozenset(keys))

    # the job dropped its grad scaler at step 10: step 10 is what a restore of today's state takes
    versions = [v(0, "m", "o", "scaler"), v(10, "m", "o"), v(11, "m"), v(12, "m"), v(13, "m")]
    assert plan_deletions(versions, KeepLast(2)) == [11]
    # two full versions of different key sets, then a params-only one: neither full goes
    versions = [v(1, "m", "o", "sched"), v(2, "m", "o", "ema"), v(3, "m")]
    assert plan_deletions(versions, KeepLast(1)) == []
    # a smaller dict saved without only= (the example) does not make step 2 expendable
    versions = [v(2, "model", "optim", "step"), v(3, "model", "step")]
    assert plan_deletions(versions, KeepLast(1)) == []


def test_keep_every_steps_are_saved_in_full_by_the_schedule(tmp_path: Path) -> None:
    model, opt = _build(0)
    state = {"model": model, "optim": opt, "step": 0}
    with Checkpointer(tmp_path, full_every=3, partial_keys=("model",), keep_last=2, keep_every=4) as ck:
        for step in range(1, 10):
            ck.save(step, state)
    kinds = _kinds(tmp_path)
    assert kinds[4] is None and kinds[8] is None, kinds  # the milestones retention keeps are full
    assert committed_steps(tmp_path) == [4, 8, 9], kinds  # the milestone 4, and the newest two (8 full)


def test_only_at_a_keep_every_step_saves_the_milestone_in_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A step keep_every keeps is a milestone, and a milestone is always full: `only=` by
    hand there saves the whole state and says so (it made a params-only milestone, kept
    for good, that no resume could take)."""
    model, opt = _build(0)
    _train(model, opt, 1)
    state = {"model": model, "optim": opt, "step": 0}
    with Checkpointer(tmp_path, keep_last=1, keep_every=4) as ck, caplog.at_level(logging.WARNING, logger="ckpt"):
        for step in range(1, 6):
            ck.save(step, state, only=("model",))
        with pytest.raises(ValueError, match="nope"):  # keys are still checked there
            ck.save(8, state, only=("nope",))
    kinds = _kinds(tmp_path)
    assert kinds == {4: None, 5: ["model"]}, kinds
    assert "step 4 is a milestone (keep_every=4): saved in full, not only ['model']" in caplog.text, caplog.text
    m2, o2 = _build(7)
    with Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": m2, "optim": o2, "step": 0}) == 4
    assert not bitwise_diff(o2.state_dict(), opt.state_dict())


def test_the_first_save_after_a_restore_is_full(tmp_path: Path) -> None:
    """A rollback (restore(step=N) in a running job) loads another state than the schedule's
    last full version holds: the params-only versions after it would rest on a version of
    the abandoned run. The schedule starts again at the restore."""
    model, opt = _build(0)
    state = {"model": model, "optim": opt, "step": 0}
    with Checkpointer(tmp_path, full_every=3, partial_keys=("model",)) as ck:
        ck.save(1, state)
        ck.save(2, state)
        assert ck.restore(state, step=1) == 1
        ck.save(3, state, overwrite=True)
        ck.save(4, state)
    assert _kinds(tmp_path) == {1: None, 2: ["model"], 3: None, 4: ["model"]}


def test_a_model_only_state_restores_from_a_full_version(tmp_path: Path) -> None:
    model, opt = _build(0)
    _train(model, opt, 1)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": model, "optim": opt, "step": 1})
    m2, _ = _build(3)
    with Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": m2}) == 1
    assert not bitwise_diff(m2.state_dict(), model.state_dict())


def test_keep_last_keeps_what_a_replicator_daemon_has_not_copied(tmp_path: Path) -> None:
    from ckpt.replicator.status import Status, write_status

    tmp_path.mkdir(exist_ok=True)
    write_status(str(tmp_path), Status(required_copies=1))  # a daemon that has verified nothing yet
    with Checkpointer(tmp_path, keep_last=1) as ck:
        for step in range(1, 5):
            ck.save(step, {"w": torch.full((3,), float(step))})
    assert committed_steps(tmp_path) == [1, 2, 3, 4]


def stages(ctx: Any, root: str) -> dict[str, Any]:
    """Pipeline-like ranks: each holds its own top-level keys besides the common ones."""
    mine = f"stage{ctx.rank}"
    with Checkpointer(root) as ck:
        ck.save(1, {mine: torch.full((3,), float(ctx.rank + 1)), "step": 1})
    got = {mine: torch.zeros(3), "step": 0}
    with Checkpointer(root) as ck:
        step = ck.restore(got)
    ctx.check(not bitwise_diff(got, {mine: torch.full((3,), float(ctx.rank + 1)), "step": 1}), f"rank {ctx.rank}")
    return {"step": step}


def test_ranks_with_different_top_level_keys_choose_the_same_version(tmp_path: Path) -> None:
    results, failures = launch(THIS, "stages", 2, tmp_path, root=str(tmp_path / "root"), timeout=90)
    assert not failures, failures
    assert [r["step"] for r in results] == [1, 1]


def only_every_key(ctx: Any, root: str) -> dict[str, Any]:
    """Pipeline-like ranks whose `only=` names every key of their state, or not."""
    mine = f"stage{ctx.rank}"
    state = {mine: torch.full((3,), float(ctx.rank + 1)), "step": 1}
    with Checkpointer(root) as ck:
        ck.save(1, state, only=(mine, "step"))  # every rank's whole state: a full version
        ck.save(2, state, only=(mine, "step") if ctx.rank else (mine,))  # rank 0 leaves "step" out
    return {}


def a_key_no_rank_holds(ctx: Any, root: str) -> dict[str, Any]:
    mine = f"stage{ctx.rank}"
    state = {mine: torch.full((3,), float(ctx.rank + 1)), "model": torch.ones(2), "step": 1}
    errors = []
    with Checkpointer(root, full_every=2, partial_keys=("modle",)) as ck:
        ck.save(1, state)  # the schedule's full save
        for step, only in ((2, None), (3, ("model", "modle")), (4, (mine,) if ctx.rank else (mine, "nope"))):
            try:
                ck.save(step, state, only=only)
            except ValueError as e:
                errors.append(str(e))
        ck.save(5, state, only=("stage0", "stage1"))  # each held by one rank: a pipeline's params-only version
    with Checkpointer(root + "-milestones", keep_last=1, keep_every=4) as ck:
        try:  # saved whole at a milestone step: the names are still checked
            ck.save(4, state, only=("modle",))
        except ValueError as e:
            errors.append(str(e))
    return {"errors": errors}


def test_a_key_no_rank_holds_is_refused_on_every_rank(tmp_path: Path) -> None:
    """On one rank a key the state lacks was refused, but on several each rank dropped the
    keys it lacked (as a pipeline stage's rank must), so a name no rank held committed an
    empty params-only version that keep_last counted. Now a key must be held by some rank;
    ranks naming different keys must each hold theirs."""
    results, failures = launch(THIS, "a_key_no_rank_holds", 2, tmp_path, root=str(tmp_path / "root"), timeout=90)
    assert not failures, failures
    for r in results:
        assert r["errors"][:2] == ["only= / partial_keys name keys no rank's state has: ['modle']"] * 2, r
        assert len(r["errors"]) == 4 and "the ranks name different keys in only=" in r["errors"][2], r
        assert r["errors"][3] == "only= / partial_keys name keys no rank's state has: ['modle']", r
    assert "this rank's state has no ['nope']" in results[0]["errors"][2], results
    kinds = _kinds(tmp_path / "root")
    assert kinds[1] is None and sorted(kinds[5]) == ["stage0", "stage1"] and set(kinds) == {1, 5}, kinds


def test_only_naming_every_key_of_every_rank_makes_a_full_version(tmp_path: Path) -> None:
    """Before, any `only=` recorded a params-only version, which an export without --keys
    and retention's count of full versions passed over; now one that names every key of
    the state on every rank is a full version, and one that leaves a key out on any rank
    is params-only on all of them."""
    model, opt = _build(0)
    _train(model, opt, 1)
    with Checkpointer(tmp_path / "one") as ck:
        ck.save(1, {"model": model, "optim": opt}, only=("optim", "model"))
        ck.save(2, {"model": model, "optim": opt}, only=("model",))
    assert _kinds(tmp_path / "one") == {1: None, 2: ["model"]}
    res = CliRunner().invoke(cli, ["restore", str(tmp_path / "one"), "--to-torch", str(tmp_path / "one.pt")])
    assert res.exit_code == 0 and "step 1" in res.output, res.output
    _, failures = launch(THIS, "only_every_key", 2, tmp_path, root=str(tmp_path / "two"), timeout=90)
    assert not failures, failures
    kinds = _kinds(tmp_path / "two")
    assert kinds[1] is None and sorted(kinds[2]) == ["stage0", "stage1", "step"], kinds


@pytest.mark.skipif(not can_isolate(), reason="needs root, unshare(1) and mount namespaces")
def test_a_full_save_that_fails_makes_the_next_save_full(tmp_path: Path) -> None:
    """The schedule's full save fails to commit (the root's real 1 MiB tmpfs is full); the
    job reports it and goes on once there is room. The next save must hold the whole state:
    params-only ones with no full version behind them leave nothing to resume from."""
    script = textwrap.dedent(
        f"""
        import os, subprocess, torch
        from ckpt import Checkpointer
        root = {str(tmp_path / "small")!r}
        state = {{"model": {{"w": torch.ones(64)}}, "optim": {{"m": torch.ones(1 << 19)}}}}  # 2 MiB
        with Checkpointer(root, full_every=3, partial_keys=("model",), direct_io=False) as ck:
            ck.save(1, state)
            try:
                ck.wait()
            except Exception as e:
                print("failed", type(e).__name__)
            subprocess.run(["mount", "-o", "remount,size=64m", root], check=True)
            for step in (2, 3):
                state["optim"]["m"].fill_(step)
                ck.save(step, state)
        got = {{"model": {{"w": torch.zeros(64)}}, "optim": {{"m": torch.zeros(1 << 19)}}}}
        with Checkpointer(root) as ck:
            print("restored", ck.restore(got), int(got["optim"]["m"][0]))
        """
    )
    (tmp_path / "small").mkdir()
    out = in_private_mounts(f"mount -t tmpfs -o size=1m tmpfs {tmp_path / 'small'}", script)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed TierUnavailableError" in out.stdout, out.stdout
    assert "restored 2 2" in out.stdout, (out.stdout, out.stderr[-3000:])  # step 2 was saved in full


def save_on_two_roots(ctx: Any, root: str) -> dict[str, Any]:
    with Checkpointer(f"{root}/r{{rank}}", capture_rng=False) as ck:
        ck.save(1, {"w": torch.full((4,), float(ctx.rank))})
    return {}


@pytest.mark.parametrize("attempt", ["fresh", "raise"])
def test_a_fresh_start_past_an_incomplete_version_saves_over_it(tmp_path: Path, attempt: str) -> None:
    """Step 1 was saved by 2 ranks on a root each; a job of 1 rank sees root 0 alone, where
    step 1 lacks rank 1's part. restore(if_incomplete="fresh") starts fresh, and so does a
    caller that catches IncompleteVersionError (MultiTier, going on to another tier). Before,
    the next save of step 1 then raised VersionExistsError: a restore that chose no version
    recorded none of the steps it passed over."""
    from ckpt import IncompleteVersionError

    _, failures = launch(__file__, "save_on_two_roots", 2, tmp_path / "job", root=str(tmp_path))
    assert not failures, failures
    with Checkpointer(tmp_path / "r0", capture_rng=False) as ck:
        if attempt == "fresh":
            assert ck.restore({"w": torch.zeros(4)}, if_incomplete="fresh") is None
        else:
            with pytest.raises(IncompleteVersionError):
                ck.restore({"w": torch.zeros(4)})
        assert ck.save(1, {"w": torch.full((4,), 7.0)})
        ck.wait()
        got = {"w": torch.zeros(4)}
        assert ck.restore(got) == 1
    assert not bitwise_diff(got, {"w": torch.full((4,), 7.0)})


@pytest.mark.parametrize("reported_by", ["wait", "restore", "export_safetensors"])
def test_a_full_save_whose_error_any_call_reports_makes_the_next_save_full(tmp_path: Path, reported_by: str) -> None:
    """The schedule's full save fails in the background (a NaN, check_finite), and the
    first call to report it is `reported_by`. Before, only wait() and save() restarted the
    schedule: after a restore() or an export that raised it, the next two saves held the
    model alone, and no full version stood behind them."""
    from ckpt import NonFiniteError

    state = {"model": {"w": torch.ones(8)}, "optim": {"m": torch.ones(8)}}
    with Checkpointer(tmp_path / "root", full_every=3, partial_keys=("model",), check_finite=True) as ck:
        state["optim"]["m"][0] = float("nan")
        ck.save(1, state)
        with pytest.raises(NonFiniteError):
            if reported_by == "wait":
                ck.wait()
            elif reported_by == "restore":
                ck.restore({"model": {"w": torch.zeros(8)}})
            else:
                ck.export_safetensors(str(tmp_path / "out"))
        state["optim"]["m"][0] = 1.0
        for step in (2, 3):
            ck.save(step, state)
        ck.wait()
    got = {"model": {"w": torch.zeros(8)}, "optim": {"m": torch.zeros(8)}}
    with Checkpointer(tmp_path / "root") as ck:
        assert ck.restore(got) == 2  # saved in full
    assert torch.equal(got["optim"]["m"], torch.ones(8))


def lost_full_version_part(ctx: Any, root: str, phase: str) -> dict[str, Any]:
    """One root a rank (node-local disks); full_every=4: step 2 full, 4, 6 and 8 params-only."""
    model, opt = _build(0)
    state = {"model": model, "optim": opt}
    with Checkpointer(root + "/r{rank}", full_every=4, partial_keys=("model",)) as ck:
        if phase == "train":
            for step in (2, 4, 6, 8):
                _train(model, opt, step)
                ck.save(step, state)
            return {}
        try:
            ck.restore(state)
        except Exception as e:  # noqa: BLE001 - what each rank saw
            return {"error": type(e).__name__, "message": str(e)}
        return {"error": None}


def test_a_full_version_missing_a_part_is_named_not_taken_for_one_no_version_holds(tmp_path: Path) -> None:
    """Rank 1's part of the one full version is gone; the newer params-only ones are whole.
    Before: VersionNotFoundError "no version holds every key", advising strict=False (which
    loads a params-only version and leaves the optimizer fresh)."""
    root = str(tmp_path / "root")
    _, failures = launch(THIS, "lost_full_version_part", 2, tmp_path / "a", root=root, phase="train")
    assert not failures, failures
    assert committed_steps(root + "/r1") == [2, 4, 6, 8]
    shutil.rmtree(root + "/r1/v000000000002")
    results, failures = launch(THIS, "lost_full_version_part", 2, tmp_path / "b", root=root, phase="resume")
    assert not failures, failures
    for r in results:
        assert r["error"] == "IncompleteVersionError" and "step 2 lacks the part of ranks [1]" in r["message"], r
