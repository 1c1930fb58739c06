"""The retention policies the command line describes: `ckpt gc`'s (which must be explicit)
and `ckpt replicate`'s, each with what it keeps in words. Usage problems raise ValueError
(the CLI turns them into usage errors)."""

from __future__ import annotations

from ckpt.replicator.policy import KeepLast, KeepMilestones, Policy, Union

__all__ = ["replicate_policy", "gc_policy"]


def replicate_policy(keep_last: int | None, milestone_every: int | None, *, remote: bool) -> Policy | None:
    """`ckpt replicate`'s policy of one tier; None keeps everything. A local disk keeps the
    newest N only; the remote also keeps the milestones (the versions saved with
    milestone=True, and every K-th step), which add to keep_last as in `ckpt gc`: alone
    they would delete every other version."""
    if keep_last is None:
        if milestone_every is not None:
            raise ValueError("--milestone-every only adds versions to keep: give --remote-keep-last N as well")
        return None
    return Union((KeepLast(keep_last), KeepMilestones(milestone_every))) if remote else KeepLast(keep_last)


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def gc_policy(
    keep_last: int | None,
    every: int | None,
    steps: tuple[int, ...],
    all_but_milestones: bool,
    keep_full: int | None = None,
    keep_partial: int | None = None,
) -> tuple[Policy, str]:
    """`ckpt gc`'s policy, and what it keeps in words. The versions saved with
    milestone=True are always kept. Milestones add to --keep-last (or --keep-last-full /
    --keep-last-partial): alone they would delete everything else, so that must be said
    (--all-but-milestones)."""
    by_kind = keep_full is not None or keep_partial is not None
    if by_kind and (keep_full is None or keep_partial is None):  # the other kind would keep none
        raise ValueError("give --keep-last-full and --keep-last-partial together")
    if by_kind and keep_last is not None:
        raise ValueError("give --keep-last, or --keep-last-full and --keep-last-partial, not both")
    if all_but_milestones and (keep_last is not None or by_kind):
        raise ValueError("--all-but-milestones keeps no newest versions: give it without --keep-last")
    if keep_last is None and not by_kind and not all_but_milestones:
        if every is not None or steps:
            raise ValueError(
                "--milestone and --milestone-every only add versions to keep: give --keep-last N as well, "
                "or --all-but-milestones to delete every other version"
            )
        raise ValueError("give --keep-last N (and --milestone-every K / --milestone STEP), or --all-but-milestones")
    parts: list[Policy] = []
    kept: list[str] = []
    if by_kind:
        full, partial = keep_full or 0, keep_partial or 0  # (both given)
        parts += [KeepLast(full, of="full"), KeepLast(partial, of="partial")]
        kept += [f"the newest {full} full version(s)", f"the newest {partial} params-only version(s)"]
    elif keep_last is not None:
        parts.append(KeepLast(keep_last))
        if keep_last:
            kept.append("the newest version" if keep_last == 1 else f"the newest {keep_last} versions")
    parts.append(KeepMilestones(every, frozenset(steps)))
    if every is not None:
        kept.append(f"every step divisible by {every}")
    if steps:
        kept.append(f"step{'s' if len(set(steps)) > 1 else ''} {_listed([str(x) for x in sorted(set(steps))])}")
    kept += ["the versions saved with milestone=True", "the newest intact version and the newest full one"]
    policy = parts[0] if len(parts) == 1 else Union(tuple(parts))
    return policy, f"policy: keep {_listed(kept)}; delete the rest"
