"""store.versions.full_steps: which versions hold the whole state, for an export and retention."""

from __future__ import annotations

from ckpt.replicator.policy import VersionInfo
from ckpt.store.versions import full_steps


def v(step: int, keys: set[str], partial: bool | None) -> VersionInfo:
    return VersionInfo(step, keys=frozenset(keys), partial=partial)


def test_recorded_versions_are_judged_by_the_record_and_older_ones_by_their_keys() -> None:
    full, params = {"model", "optim"}, {"model"}
    # Written before the record: a version holding every key any holds is full.
    assert full_steps([v(1, full, None), v(2, params, None), v(3, full, None)]) == {1, 3}
    # Recorded: by the record, whatever the keys (a state that dropped "ema" is still full).
    assert full_steps([v(1, full | {"ema"}, False), v(2, full, False), v(3, params, True)]) == {1, 2}
    # An upgrade between a params-only version and the next full one: the older versions
    # are still judged among themselves, so the old params-only one does not count as full.
    assert full_steps([v(1, full, None), v(2, params, None), v(3, params, True)]) == {1}


def test_retention_keeps_the_full_version_an_export_takes_beside_a_newer_params_only_one() -> None:
    """A params-only version holding as many keys as the full one before it (`only=` every
    key, or partial_keys covering a state of one key): an export takes the full one, so
    retention keeps it. Before, resumable_steps judged by keys alone, KeepLast(1) deleted
    the full version, and the export then found only a params-only one."""
    from ckpt.replicator.policy import KeepLast, plan_deletions, resumable_steps

    for keys in ({"model", "optim"}, {"model"}):
        versions = [v(100, keys, False), v(200, keys, True)]
        assert resumable_steps(versions) == {100, 200}
        assert plan_deletions(versions, KeepLast(1)) == []
