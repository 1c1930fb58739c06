"""The crash harness (tests/crash_harness.py) for CI: 20 seeded SIGKILLs of a real 2-rank
job, its replicator daemons and `ckpt gc` runs, with every invariant checked after each.
The long run is `python -m tests.crash_harness --kills 200 --seed 1 --out DIR`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.crash_harness import KINDS, Harness, HarnessConfig, summary


@pytest.mark.timeout(600)
def test_twenty_kills_lose_and_corrupt_nothing(tmp_path: Path) -> None:
    fig = Harness(HarnessConfig(out=str(tmp_path / "harness"), kills=20, seed=20240601)).run()
    print(summary(fig))
    where = f"(logs in {tmp_path / 'harness' / 'logs'})"
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
