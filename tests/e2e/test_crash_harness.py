"""The crash harness (tests/crash_harness.py) for CI: 20 seeded SIGKILLs of a real 2-rank
job, its replicator daemons and `ckpt gc` runs, with every invariant checked after each.
The long run is `python -m tests.crash_harness --kills 200 --seed 1 --out DIR`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt.store import versions
from ckpt.store.versions import version_dirname
from tests._harness_checks import listing
from tests._states import save_steps
from tests.crash_harness import KINDS, Harness, HarnessConfig, summary


@pytest.mark.timeout(600)
def test_twenty_kills_lose_and_corrupt_nothing(tmp_path: Path) -> None:
    fig = Harness(HarnessConfig(out=str(tmp_path / "harness"), kills=20, seed=20240601)).run()
    print(summary(fig))
    where = f"(logs in {tmp_path / 'harness' / 'logs'})"
    if fig.failures:
        _print_stack_dumps(tmp_path / "harness" / "logs")
    assert fig.failures == [], f"{fig.failures} {where}"
    assert fig.lost == 0, f"{fig.lost_detail} {where}"
    assert fig.corruptions == 0, f"{fig.corruption_detail} {where}"
    assert fig.nondeterministic_steps == 0, "the job must redo a step bit for bit, or restores cannot be checked"
    assert sum(fig.kills.values()) == 20 and all(fig.kills[k] >= 1 for k in KINDS), fig.kills
    assert any(k.startswith("gc:") and k.endswith(": killed") for k in fig.kill_detail), fig.kill_detail
    # the checks had something to check
    assert fig.restores_checked >= 2 * 20, fig.restores_checked
    assert fig.versions_checked >= 50 and fig.versions_verified >= 100, (fig.versions_checked, fig.versions_verified)
    assert fig.deletions_seen >= 20, "retention never deleted anything: the lost-version check checked nothing"
    assert fig.remote_scans >= 20


def _print_stack_dumps(logs: Path) -> None:
    """The logs' tails where a hung process's threads were dumped (CI keeps no files)."""
    for log in sorted(logs.iterdir()):
        text = log.read_text(errors="replace")
        dump = text.find("most recent call first")
        if dump >= 0:
            start = max(text.rfind("=== ", 0, dump), 0)
            print(f"--- {log.name}, from its start before the dump:\n{text[start:][-20000:]}")


def test_a_listing_across_a_retention_pass_still_shows_what_it_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention publishes v239 and then retires v234 while the harness lists the tier: the
    listing names v234 and finds its record gone, and named the tier before v239 came. The
    listing must still show v239, or the harness calls 234's deletion premature (CI saw it:
    'peer0 step 234: deleted, but retention keeps it (known newer: [237, 238])')."""
    root = tmp_path / "root"
    save_steps(root, {s: {"w": torch.full((4,), float(s))} for s in (234, 237, 238, 239)})
    aside = tmp_path / "v239-not-yet-published"
    os.rename(root / version_dirname(239), aside)
    real = versions._root_info  # what versions.listing reads each root.json with

    def racing(where: Any, step: int) -> Any:
        if step == 234 and aside.exists():  # the pass runs now: publish 239, retire 234
            os.rename(aside, root / version_dirname(239))
            shutil.rmtree(root / version_dirname(234))
        return real(where, step)

    monkeypatch.setattr(versions, "_root_info", racing)
    assert sorted(listing(str(root))) == [237, 238, 239]


def test_a_copy_of_a_save_a_node_left_partial_may_be_replaced_rounds_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's loss leaves step 33's save X whole nowhere; node 0's replica keeps X's part.
    The next round saves 33 anew (Y) and its daemon is killed before it copies Y; a round
    later the replica's X becomes Y. That is no loss (CI saw it called one: 'replica0 step
    33: replaced by another save'), while a whole save's replacement still is."""
    from tests import crash_harness

    h = Harness(HarnessConfig(out=str(tmp_path / "harness"), kills=3, seed=1))
    rounds = iter(
        [  # (the listing, what expected_restore finds then)
            ({"replica0": {32: "W", 33: "X"}}, (32, {(33, "X")})),
            ({"replica0": {32: "W", 33: "X"}, "root0": {33: "Y"}}, (33, set())),
            ({"replica0": {32: "W", 33: "Y"}, "root0": {33: "Y"}}, (33, set())),
            ({"replica0": {32: "W", 33: "Z"}, "root0": {33: "Z"}}, (33, set())),
        ]
    )
    now: list[Any] = [None, None]  # this round's listing and expected_restore's answer
    monkeypatch.setattr(crash_harness, "snapshot", lambda layout: now[0])
    monkeypatch.setattr(crash_harness, "expected_restore", lambda layout: now[1])
    for listed, found in rounds:
        now[:] = [listed, found]
        h.check_deletions(None, quiet=True)
        h.take_stock()
    assert sorted(h.fig.lost_detail) == [
        "replica0 step 33: replaced by another save (Y -> Z)",
        "root0 step 33: replaced by another save (Y -> Z)",
    ]
