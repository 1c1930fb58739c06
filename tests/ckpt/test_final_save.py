"""The save on preemption is the job's last: the whole state, whatever full_every's schedule
says; after a save in flight that failed; nothing again for a step just saved whole; and a
MultiTier closes every tier before a late notice ends the process. Real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ckpt import Checkpointer, MultiTier, NonFiniteError, VersionExistsError
from ckpt.store.manifest import parse_manifest
from ckpt.store.tier import open_tier
from ckpt.store.versions import committed_steps, version_dirname
from tests._states import assert_bitwise

REPO = Path(__file__).resolve().parents[2]


def _state(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, generator=g)}, "optim": {"m": torch.randn(64, generator=g)}}


def _partial(root: Path, step: int) -> bool | None:
    return parse_manifest((root / version_dirname(step) / "manifest.json").read_bytes()).partial


def _newest(root: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """The state a restart restores; it must be `step`'s."""
    state = _state(99)
    with Checkpointer(root) as ck:
        assert ck.restore(state) == step
    return state


def _watching(root: Path, **options: object) -> Checkpointer:
    return Checkpointer(root, preemption_signals=(signal.SIGUSR1,), **options)  # type: ignore[arg-type]


def _preempted(ck: Checkpointer) -> None:
    os.kill(os.getpid(), signal.SIGUSR1)
    assert ck.reached_preemption()


def test_the_save_on_preemption_replaces_a_params_only_version_of_its_step(tmp_path: Path) -> None:
    """The schedule saved step 2 params-only; the preemption at step 2 saves it whole. Before,
    the README's loop left step 2 params-only and the restart went back to step 1."""
    root = tmp_path / "root"
    with Checkpointer(root, preemption_signals=(signal.SIGUSR1,), full_every=2, partial_keys=("model",)) as ck:
        ck.save(1, _state(1))
        ck.save(2, _state(2))
        ck.wait()
        assert _partial(root, 2) is True
        _preempted(ck)
        assert ck.save(2, _state(2)) is True
        ck.wait()
        assert ck.save(2, _state(2)) is False  # held whole now: nothing again
    assert _partial(root, 2) is False
    assert_bitwise(_newest(root, 2), _state(2))


def test_a_step_just_saved_whole_is_not_saved_again_on_preemption(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with _watching(root) as ck:
        ck.save(3, _state(3))
        _preempted(ck)
        assert ck.save(3, _state(3)) is False  # no VersionExistsError: the loop saves unconditionally
        assert ck.save(4, _state(4)) is True
    assert committed_steps(open_tier(str(root))) == [3, 4]


def test_a_failed_save_in_flight_does_not_stop_the_save_on_preemption(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The periodic save failed (a NaN check here; a disk error alike): save() used to raise
    its error and the job exited with nothing of its last state. The error is logged."""
    root = tmp_path / "root"
    bad = _state(4)
    bad["optim"]["m"][0] = float("nan")
    with Checkpointer(root, preemption_signals=(signal.SIGUSR1,), check_finite=True) as ck:
        ck.save(4, bad)
        _preempted(ck)
        assert ck.save(5, _state(5)) is True
        ck.wait()
    assert committed_steps(open_tier(str(root))) == [5]
    assert any(r.exc_info and r.exc_info[0] is NonFiniteError for r in caplog.records), caplog.text
    # Without preemption the error is the next save's, as documented.
    with Checkpointer(tmp_path / "other", check_finite=True) as ck:
        ck.save(4, bad)
        with pytest.raises(NonFiniteError):
            ck.save(5, _state(5))


def test_a_forced_save_replaces_a_tiers_params_only_version_of_its_step(shm_root: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    ram = Checkpointer(shm_root, full_every=2, partial_keys=("model",))
    with MultiTier((ram, 1), (Checkpointer(disk), 10)) as ck:
        assert ck.save(1, _state(1)) == [str(shm_root)]
        assert ck.save(2, _state(2)) == [str(shm_root)]  # params-only
        ck.wait()
        assert ck.save(2, _state(2), force=True) == [str(shm_root), str(disk)]
        ck.wait()
    assert _partial(shm_root, 2) is False and _partial(disk, 2) is False


def test_a_late_notice_ends_the_process_only_after_every_tier_committed(tmp_path: Path) -> None:
    """A SIGTERM while MultiTier.close() waits for the last saves: the tier with the watch
    passes it on (SIGTERM's default: the process ends) only after the other tier, whose
    writes are slow, committed. Before, the first tier's close() ended the process with the
    second tier's last version half-written."""
    script = f"""
        import os, signal, threading, torch
        from ckpt import Checkpointer, MultiTier
        os.environ["CKPT_DELAY"] = "write:0:0.5"  # each chunk write takes 0.5 s
        state = {{k: torch.ones(1000) for k in "abcd"}}
        ram = Checkpointer({str(tmp_path / "ram")!r}, preemption_signals=(signal.SIGTERM,))
        disk = Checkpointer({str(tmp_path / "disk")!r}, writer_threads=1)
        with MultiTier((ram, 1), (disk, 1)) as ck:
            ck.save(1, state)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        print("not reached")
    """
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert run.returncode == -signal.SIGTERM, (run.returncode, run.stdout, run.stderr[-2000:])
    assert "not reached" not in run.stdout
    for tier in ("ram", "disk"):
        assert committed_steps(open_tier(str(tmp_path / tier))) == [1], (tier, os.listdir(tmp_path / tier))


def test_a_step_saved_before_a_restore_is_saved_again_on_preemption(tmp_path: Path) -> None:
    """Saved step 5, went back to step 3, trained to step 5 again: the preemption's save of
    step 5 is the new state. Before, it returned False and step 5 kept the old values."""
    root = tmp_path / "root"
    with _watching(root) as ck:
        ck.save(3, _state(3))
        ck.save(5, _state(5))
        ck.wait()
        again = _state(0)
        assert ck.restore(again, step=3) == 3
        _preempted(ck)
        with pytest.raises(VersionExistsError):  # as without preemption: not this state's version
            ck.save(5, _state(55))
        assert ck.save(5, _state(55), overwrite=True) is True
    assert_bitwise(_newest(root, 5), _state(55))


def test_a_milestone_asked_for_on_preemption_is_saved_as_one(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with _watching(root) as ck:
        ck.save(6, _state(6))
        _preempted(ck)
        assert ck.save(6, _state(6), milestone=True) is True  # its own version of step 6, tagged now
    meta = parse_manifest((root / version_dirname(6) / "manifest.json").read_bytes()).meta
    assert meta.get("milestone") is True, meta


def test_a_late_notice_is_passed_on_once_however_often_multitier_closes(tmp_path: Path) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))
    try:
        ram = Checkpointer(tmp_path / "a", preemption_signals=(signal.SIGUSR2,))
        with MultiTier((ram, 1), (Checkpointer(tmp_path / "b"), 1)) as ck:
            ck.save(1, _state(1))
            os.kill(os.getpid(), signal.SIGUSR2)  # after the last reached_preemption()
            ck.close()
        # Once, by the watch's handler as it came, as without ckpt: not again at close()
        # (before, it was: twice, and a third time at __exit__'s close() before that).
        assert seen == [signal.SIGUSR2], seen
    finally:
        signal.signal(signal.SIGUSR2, previous)
