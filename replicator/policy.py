"""Retention policies: pure functions from version metadata to the set of steps to keep.

A policy never sees the filesystem. GC asks each tier's policy which steps to keep, adds
the safety rules (the newest intact version, versions whose required copies are not yet
made, pinned versions), and deletes only the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ckpt.store.versions import full_steps

__all__ = [
    "VersionInfo",
    "Policy",
    "KeepLast",
    "KeepMilestones",
    "KeepAll",
    "Union",
    "resumable_steps",
    "plan_deletions",
    "expired",
]


@dataclass(frozen=True)
class VersionInfo:
    """What a policy may look at."""

    step: int
    created: float = 0.0  # unix time of the commit
    intact: bool | None = True  # manifest valid (True), proven damaged (False), or unread: a transient error (None)
    tagged: bool = False  # the user marked it as a milestone
    redundant: bool = True  # every required copy exists and is verified
    keys: frozenset[str] | None = None  # the state's top-level keys it holds (None: all, or unknown)
    partial: bool | None = None  # a params-only version (None: not recorded)


class Policy(Protocol):
    def keep(self, versions: Sequence[VersionInfo]) -> set[int]:
        """Steps to keep, out of `versions` (sorted by step)."""
        ...


def resumable_steps(versions: Sequence[VersionInfo]) -> set[int]:
    """Intact versions some restore would choose: a restore that needs keys K takes the
    newest intact version holding K, so a version is never chosen only when a newer intact
    one holds all its keys. These are the newest version, the newest holding every key,
    and (where the state's keys changed) the newest of each key set no newer one covers;
    and the newest full one (full_steps), which a restore with no state to go by (an
    export) takes, though a newer params-only version may hold as many keys."""
    out: set[int] = set()
    covers: set[frozenset[str] | None] = set()  # key sets of newer intact versions (None: every key)
    intact = [v for v in versions if v.intact]
    for v in sorted(intact, key=lambda v: v.step, reverse=True):
        if None not in covers and (v.keys is None or not any(c is not None and v.keys <= c for c in covers)):
            out.add(v.step)
        covers.add(v.keys)
    full = full_steps(intact)
    if full:
        out.add(max(full))
    return out


@dataclass(frozen=True)
class KeepLast:
    """The newest `n` versions, and the newest `n` not proven damaged: a damaged version
    does not take the place of one a restore can fall back to. of="full": of the versions
    holding every key (full_steps), of="partial": of the others (params-only versions)."""

    n: int
    of: Literal["all", "full", "partial"] = "all"

    def __post_init__(self) -> None:
        if type(self.n) is not int or self.n < 0:
            raise ValueError(f"KeepLast.n must be an int >= 0, not {self.n!r}")
        if self.of not in ("all", "full", "partial"):
            raise ValueError(f"KeepLast.of must be 'all', 'full' or 'partial', not {self.of!r}")

    def keep(self, versions: Sequence[VersionInfo]) -> set[int]:
        return self._newest(versions) | self._newest([v for v in versions if v.intact is not False])

    def _newest(self, versions: Sequence[VersionInfo]) -> set[int]:
        steps = sorted(v.step for v in versions)
        if self.of != "all":
            full = full_steps(versions)
            steps = [s for s in steps if (s in full) == (self.of == "full")]
        return set(steps[max(0, len(steps) - self.n) :]) if self.n else set()


@dataclass(frozen=True)
class KeepMilestones:
    """Every step that is a multiple of `every` (if set), plus every tagged step."""

    every: int | None = None
    steps: frozenset[int] = field(default_factory=frozenset)  # explicitly tagged steps

    def __post_init__(self) -> None:
        if self.every is not None and (type(self.every) is not int or self.every <= 0):
            raise ValueError(f"KeepMilestones.every must be a positive int or None, not {self.every!r}")

    def keep(self, versions: Sequence[VersionInfo]) -> set[int]:
        return {
            v.step
            for v in versions
            if v.tagged or v.step in self.steps or (self.every is not None and v.step % self.every == 0)
        }


@dataclass(frozen=True)
class KeepAll:
    def keep(self, versions: Sequence[VersionInfo]) -> set[int]:
        return {v.step for v in versions}


@dataclass(frozen=True)
class Union:
    """Keep what any of the policies keeps."""

    policies: tuple[Policy, ...]

    def keep(self, versions: Sequence[VersionInfo]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep(versions)
        return out


def plan_deletions(
    versions: Iterable[VersionInfo], policy: Policy, *, pinned: Iterable[int] = (), require_redundant: bool = True
) -> list[int]:
    """Steps GC may delete: not kept by the policy, never a version some restore would
    choose (resumable_steps: the newest intact version, and the newest intact full one
    when params-only versions are newer), never a version that could not be judged
    (intact None: it may be the newest intact one, and so may the newest proven intact
    one, which is kept too), never a pinned one, and (for tiers whose copies are required)
    never one whose copies do not exist yet. Oldest first."""
    vs = sorted(versions, key=lambda v: v.step)
    keep = set(policy.keep(vs)) | set(pinned)
    keep |= {v.step for v in vs if v.intact is None}
    keep |= resumable_steps(vs)
    if require_redundant:
        keep |= {v.step for v in vs if v.intact is not False and not v.redundant}
    return [v.step for v in vs if v.step not in keep]


def expired(versions: Iterable[VersionInfo], candidate: VersionInfo, policy: Policy) -> bool:
    """Whether GC would delete `candidate`, a version the tier does not hold, as soon as it
    arrived among `versions` (what the tier holds): then there is no point in sending it."""
    vs = list(versions)
    if any(v.step == candidate.step for v in vs):
        return False
    return candidate.step in plan_deletions([*vs, candidate], policy, require_redundant=False)
