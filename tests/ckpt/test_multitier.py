"""MultiTier: a RAM root (real tmpfs, /dev/shm) saved often, a disk root less often; restore
takes the newest intact version of either; retention bounds what RAM holds."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from ckpt import Checkpointer, MultiTier, RootLockedError
from ckpt.store.errors import CorruptVersionError
from ckpt.store.tier import open_tier
from ckpt.store.versions import committed_steps, version_dirname
from tests._states import assert_bitwise


@pytest.fixture
def ram(shm_root: Path) -> Path:
    return shm_root


def _state(step: int) -> dict[str, torch.Tensor | int]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g), "step": step}  # 1 MiB: O_DIRECT would apply on a disk


def _run(ram: Path, disk: Path, steps: range) -> None:
    with MultiTier((Checkpointer(ram, keep_last=2), 2), (Checkpointer(disk, keep_last=2), 5)) as ck:
        for step in steps:
            saved = ck.save(step, _state(step))
            assert saved == [r for r, every in ((str(ram), 2), (str(disk), 5)) if step % every == 0]
        ck.wait()
        ram_stats = ck.tiers[0][0].stats()
    # tmpfs takes O_DIRECT on newer kernels and refuses it (EINVAL) on older ones: either way it saves.
    assert len(ram_stats) == 6 and all(s.bytes_written >= 1 << 20 for s in ram_stats)


def test_ram_and_disk_at_their_cadences(ram: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    _run(ram, disk, range(1, 13))
    assert committed_steps(open_tier(str(ram))) == [10, 12]  # keep_last bounds what RAM holds
    assert committed_steps(open_tier(str(disk))) == [5, 10]

    def restored(*tiers: tuple[Checkpointer, int]) -> tuple[int | None, dict[str, torch.Tensor | int]]:
        state = _state(0)
        with MultiTier(*tiers) as ck:
            got = ck.restore(state)
        return got, state

    got, state = restored((Checkpointer(ram), 2), (Checkpointer(disk), 5))
    assert got == 12 and torch.equal(state["w"], _state(12)["w"]) and state["step"] == 12  # type: ignore[arg-type]
    # The newest RAM version damaged: the next newest of any tier.
    manifest = ram / version_dirname(12) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"step"', b'"stap"', 1))
    got, state = restored((Checkpointer(ram), 2), (Checkpointer(disk), 5))
    assert got == 10 and torch.equal(state["w"], _state(10)["w"])  # type: ignore[arg-type]
    # The node rebooted: RAM is empty; the disk's newest.
    shutil.rmtree(ram)
    got, state = restored((Checkpointer(ram), 2), (Checkpointer(disk), 5))
    assert got == 10 and torch.equal(state["w"], _state(10)["w"])  # type: ignore[arg-type]


def test_a_newer_disk_version_wins_over_an_older_ram_one(ram: Path, tmp_path: Path) -> None:
    with Checkpointer(ram) as ck:
        ck.save(3, _state(3))
    with Checkpointer(tmp_path / "disk") as ck:
        ck.save(7, _state(7))
    state = _state(0)
    with MultiTier((Checkpointer(ram), 1), (Checkpointer(tmp_path / "disk"), 5)) as mt:
        assert mt.restore(state) == 7
    assert torch.equal(state["w"], _state(7)["w"])  # type: ignore[arg-type]


def test_two_tiers_cannot_share_a_root(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(RootLockedError):
            Checkpointer(tmp_path)
        with pytest.raises(ValueError, match="Checkpointer, every"):
            MultiTier((ck, 0))


def test_a_forced_save_at_a_step_a_tier_saved_saves_the_others(ram: Path, tmp_path: Path) -> None:
    """The preemption pattern: the cadence saved step 20 to RAM, then preemption forces a
    save of step 20 to every tier. RAM holds it already (it goes with the node): the disk
    must get it, not a VersionExistsError from the RAM tier before the disk is reached."""
    disk = tmp_path / "disk"
    with MultiTier((Checkpointer(ram), 10), (Checkpointer(disk), 100)) as ck:
        assert ck.save(20, _state(20)) == [str(ram)]
        assert ck.save(20, _state(20), force=True) == [str(disk)]
        ck.wait()
    state = _state(0)
    with Checkpointer(disk) as ck:
        assert ck.restore(state) == 20
    assert_bitwise(state, _state(20))


def test_reached_preemption_answers_for_the_signals_of_any_tier(ram: Path, tmp_path: Path) -> None:
    """A tier's handler only notes the signal (the process no longer dies of it): the
    notice must reach the loop whichever tier installed it."""
    ram_ck = Checkpointer(ram)
    disk_ck = Checkpointer(tmp_path / "disk", preemption_signals=(signal.SIGUSR1,))
    with MultiTier((ram_ck, 10), (disk_ck, 100)) as ck:
        assert not ck.reached_preemption()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ck.reached_preemption()


def test_a_tier_that_failed_part_way_is_not_mixed_with_an_older_tiers_version(ram: Path, tmp_path: Path) -> None:
    """RAM's only version (step 20, full) fails its checksum after its good chunks were
    read into the state; the disk holds a params-only step 10. With strict=False that one
    would fill "model" and leave "optim" holding part of step 20: a mix of two versions,
    which a single Checkpointer refuses (CorruptVersionError), and so must MultiTier."""

    def state(step: int) -> dict[str, dict[str, torch.Tensor]]:
        return {"model": {"w": torch.full((64,), float(step))}, "optim": {"m": torch.full((64,), float(step))}}

    disk = tmp_path / "disk"
    with Checkpointer(disk) as ck:
        ck.save(10, state(10), only=("model",))
    with Checkpointer(ram) as ck:
        ck.save(20, state(20))
    chunk = ram / version_dirname(20) / "state" / "model" / "w" / "c.0"
    chunk.write_bytes(b"\x00" * chunk.stat().st_size)  # "model" is damaged; "optim" reads well
    got = state(0)
    with MultiTier((Checkpointer(ram), 10), (Checkpointer(disk), 100)) as ck, pytest.raises(CorruptVersionError):
        ck.restore(got, strict=False)


# -- found by review (2026-12-07): what the tiers hold beyond their roots, and resumes ------


def test_a_tier_whose_newest_version_is_only_on_its_other_tiers_is_restored(ram: Path, tmp_path: Path) -> None:
    """The disk tier's root was replaced (empty); its newest version survives on the tier
    its Checkpointer also searches (`tiers=`, as a remote would be). MultiTier ranked the
    tiers by their roots alone: it returned None (a silent fresh start) or RAM's older step."""
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    with Checkpointer(disk) as ck:
        ck.save(100, _state(100))
    shutil.copytree(disk, copy)
    shutil.rmtree(disk)
    for ram_step in (None, 50):
        if ram_step is not None:
            with Checkpointer(ram) as ck:
                ck.save(ram_step, _state(ram_step))
        state = _state(0)
        with MultiTier((Checkpointer(ram), 10), (Checkpointer(disk, tiers=[str(copy)]), 100)) as mt:
            assert mt.restore(state) == 100, ram_step
        assert_bitwise(state, _state(100))


def test_a_resume_through_tiers_saves_over_the_params_only_steps_it_passed(ram: Path, tmp_path: Path) -> None:
    """Tier A holds full step 110 and the crashed run's params-only 120 and 130; tier B full
    100 and params-only 125. B's attempt loads 100 over the state, so A's 110 is loaded
    again by step, and that second restore forgot the steps A's first had passed over: the
    resumed run's save of 120 raised VersionExistsError (one Checkpointer replaces it)."""
    a, b = tmp_path / "A", ram

    def full(step: int) -> dict[str, torch.Tensor | int]:
        return {"model": _state(step)["w"], "optim": _state(step + 1)["w"], "step": step}

    with Checkpointer(b) as ck:
        ck.save(100, full(100))
        ck.save(125, full(125), only=("model",))
    with Checkpointer(a) as ck:
        ck.save(110, full(110))
        for step in (120, 130):
            ck.save(step, full(step), only=("model",))
    state = full(0)
    with MultiTier((Checkpointer(a), 10), (Checkpointer(b), 25)) as mt:
        assert mt.restore(state) == 110
        assert_bitwise(state, full(110))
        assert mt.save(120, full(120)) == [str(a)]
        assert mt.save(125, full(125)) == [str(b)]
    with Checkpointer(a) as ck:
        got = full(0)
        assert ck.restore(got, step=120) == 120
    assert_bitwise(got, full(120))
