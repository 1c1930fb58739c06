"""Choosing the version to restore from what every rank's tiers hold. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence

from ckpt.store.versions import Candidate

__all__ = ["reachable_steps", "partial_steps", "missing_writers", "choose_step"]


def reachable_steps(per_rank: Sequence[Sequence[Candidate]]) -> dict[int, str]:
    """Steps whose every writer's chunks some current rank holds, with one save_id
    throughout, and that save_id."""
    held: dict[tuple[int, str, int], set[int]] = {}
    for cands in per_rank:
        for c in cands:
            held.setdefault((c.step, c.save_id, c.world_size), set()).update(c.writers)
    by_step: dict[int, list[str]] = {}
    for (s, sid, world), writers in held.items():
        if writers >= set(range(world)):
            by_step.setdefault(s, []).append(sid)
        else:
            by_step.setdefault(s, [])
    return {s: ids[0] for s, ids in by_step.items() if len(ids) == 1}


def partial_steps(per_rank: Sequence[Sequence[Candidate]]) -> list[int]:
    """Steps some tier holds whose chunks the tiers together do not cover."""
    listed = {c.step for cands in per_rank for c in cands}
    return sorted(listed - set(reachable_steps(per_rank)))


def missing_writers(per_rank: Sequence[Sequence[Candidate]], step: int) -> list[int]:
    """The ranks whose part of `step` no tier holds (of the save of it that misses fewest,
    when the tiers hold several)."""
    held: dict[tuple[str, int], set[int]] = {}
    for cands in per_rank:
        for c in cands:
            if c.step == step:
                held.setdefault((c.save_id, c.world_size), set()).update(c.writers)
    return min((sorted(set(range(world)) - writers) for (_, world), writers in held.items()), key=len, default=[])


def choose_step(
    per_rank: Sequence[Sequence[Candidate]], step: int | None = None, exclude: frozenset[int] = frozenset()
) -> int | None:
    """The requested step if reachable, else the newest reachable step not excluded."""
    ok = sorted((s for s in reachable_steps(per_rank) if s not in exclude), reverse=True)
    if step is not None:
        return step if step in ok else None
    return ok[0] if ok else None
