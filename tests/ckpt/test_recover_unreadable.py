"""Crash recovery on opening, where a root cannot read a version now (2 real gloo ranks,
each with its own root): a prepared part of that step on another root is kept, not removed,
and rolled forward once the version reads again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import launch

THIS = os.path.abspath(__file__)


def _state(rank: int) -> dict[str, Any]:
    # a plain tensor per rank (its rank's own, not replicated) and one shared by every rank
    return {"mine": {rank: torch.arange(1000, dtype=torch.float32) * (rank + 1)}, "w": torch.ones(500)}


def recover_job(ctx: Any, base: str, phase: str) -> Any:
    from ckpt import Checkpointer

    root = f"{base}/root{ctx.rank}"
    with Checkpointer(root, capture_rng=False) as ck:
        if phase == "save":
            ck.save(6, _state(ctx.rank))
            ck.wait()
            return "saved"
        if phase == "open":
            return sorted(os.listdir(root))
        want = _state(ctx.rank)
        target = {"mine": {ctx.rank: torch.zeros(1000)}, "w": torch.zeros(500)}
        step = ck.restore(target)
        ctx.check(torch.equal(target["mine"][ctx.rank], want["mine"][ctx.rank]), "this rank's tensor differs")
        ctx.check(torch.equal(target["w"], want["w"]), "the shared tensor differs")
        return step


class _Bound:
    """Ranks run as root less the capabilities that override file permissions (setpriv).
    (No dataclass: tests._dist loads this module without registering it.)"""

    per_node = 1

    def command(self, rank: int, argv: list[str]) -> list[str]:
        drop = "-dac_override,-dac_read_search"
        return ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *argv]


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to drop the override"
)
def test_a_prepared_part_of_a_step_another_root_cannot_read_is_kept(tmp_path: Path) -> None:
    """Root 0 published step 6 and root 1 only prepared it (a crash between): opening rolls
    root 1's part forward. With root 0's v6 unreadable at that opening (a permission here;
    an I/O error alike), root 1 removed its part, as a save no root published: step 6 could
    never be whole again (found by review)."""
    from ckpt.store import commit
    from ckpt.store.versions import read_root_info, version_dirname

    base = str(tmp_path / "job")
    results, failures = launch(THIS, "recover_job", 2, tmp_path / "save", base=base, phase="save")
    assert not failures and results == ["saved", "saved"], (results, failures)
    root0, root1 = Path(base, "root0"), Path(base, "root1")
    save_id = read_root_info(str(root0), 6).save_id
    prepared = commit.tmp_dirname(6, save_id)
    os.rename(root1 / version_dirname(6), root1 / prepared)
    (root0 / version_dirname(6)).chmod(0)
    try:
        results, failures = launch(THIS, "recover_job", 2, tmp_path / "open", isolate=_Bound(), base=base, phase="open")
    finally:
        (root0 / version_dirname(6)).chmod(0o755)
    assert not failures, failures
    assert prepared in results[1], results[1]
    results, failures = launch(THIS, "recover_job", 2, tmp_path / "restore", base=base, phase="restore")
    assert not failures and results == [6, 6], (results, failures)
