"""Choosing the version to restore from what every rank's tiers hold. Pure functions.

Every rank receives every rank's candidates (restore.locate.Listing), O(ranks x versions)
of them; `holdings` merges them once a round, by save, each save's writers as ranges
(store.rank_ranges), and every question after that is asked of the few saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckpt.store.rank_ranges import RankRanges, missing, union
from ckpt.store.versions import Candidate

__all__ = [
    "Holding",
    "Holdings",
    "Needed",
    "OneOf",
    "holdings",
    "reachable_steps",
    "partial_steps",
    "missing_writers",
    "choose_step",
]


@dataclass(frozen=True)
class OneOf:
    """Top-level keys of which a version must hold one (an export's dotted prefix: its
    top-level key may itself hold dots, so it is one of the prefix's leading parts joined)."""

    keys: frozenset[str]


Needed = frozenset[str] | OneOf | None  # the keys a version must hold all of, or one of (None: any version)


@dataclass(frozen=True, slots=True)
class Holding:
    """One save of a version, as every rank's tiers hold it together."""

    step: int
    save_id: str
    world_size: int
    writers: RankRanges  # the ranks whose chunks some rank's tier holds
    keys: frozenset[str] | None  # its top-level keys (None: all); every copy of a save holds the same
    created: float = 0.0  # when it was saved (0: no copy's root info recorded it)
    partial: bool | None = None  # a params-only version (None: no copy's root info recorded it)

    @property
    def whole(self) -> bool:
        return not missing(self.writers, self.world_size)

    def holds(self, needs: Needed) -> bool:
        if needs is None or self.keys is None:
            return True
        if isinstance(needs, OneOf):
            return not needs.keys.isdisjoint(self.keys)
        return needs <= self.keys


Holdings = list[Holding]


def holdings(per_rank: Sequence[Sequence[Candidate]]) -> Holdings:
    """Every rank's candidates merged by save (step, save_id, world size)."""
    seen: dict[tuple[int, str, int], set[RankRanges]] = {}
    keys: dict[tuple[int, str, int], frozenset[str] | None] = {}
    created: dict[tuple[int, str, int], float] = {}
    partial: dict[tuple[int, str, int], bool | None] = {}
    for cands in per_rank:
        for c in cands:
            at = (c.step, c.save_id, c.world_size)
            if at not in seen:
                seen[at], keys[at], created[at], partial[at] = set(), c.keys, c.created, c.partial
            seen[at].add(c.writers)
            created[at] = max(created[at], c.created)
            if partial[at] is None:
                partial[at] = c.partial
    return [Holding(*at, union(parts), keys[at], created[at], partial[at]) for at, parts in seen.items()]


def reachable_steps(held: Holdings, needs: Needed = None) -> dict[int, str]:
    """Steps whose every writer's chunks some current rank holds, with one save_id
    throughout, and that save_id; with `needs`, only saves holding those keys.

    Where the tiers hold several whole saves of a step (an overwrite, while a copy made
    before it, on the remote, still holds the save it replaced), the one saved last; where
    that cannot be told (no root info recorded when), none of them."""
    by_step: dict[int, list[Holding]] = {}
    for h in held:
        whole = by_step.setdefault(h.step, [])
        if h.whole and h.holds(needs):
            whole.append(h)
    out = {}
    for s, saves in by_step.items():
        if len(saves) == 1:
            out[s] = saves[0].save_id
        elif saves:
            last = max(saves, key=lambda h: h.created)
            if last.created and sum(h.created == last.created for h in saves) == 1:
                out[s] = last.save_id
    return out


def partial_steps(held: Holdings) -> list[int]:
    """Steps some tier holds whose chunks the tiers together do not cover."""
    return sorted({h.step for h in held} - set(reachable_steps(held)))


def missing_writers(held: Holdings, step: int) -> list[int]:
    """The ranks whose part of `step` no tier holds (of the save of it that misses fewest,
    when the tiers hold several)."""
    gaps = [missing(h.writers, h.world_size) for h in held if h.step == step]
    fewest = min(gaps, key=lambda g: sum(hi - lo for lo, hi in g), default=())
    return [r for lo, hi in fewest for r in range(lo, hi)]


def choose_step(
    held: Holdings,
    step: int | None = None,
    exclude: frozenset[int] = frozenset(),
    needs: Needed = None,
) -> int | None:
    """The requested step if reachable, else the newest reachable step not excluded."""
    ok = sorted((s for s in reachable_steps(held, needs) if s not in exclude), reverse=True)
    if step is not None:
        return step if step in ok else None
    return ok[0] if ok else None
