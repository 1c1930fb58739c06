"""`ckpt verify`: recompute every checksum of a tier's versions, each pinned against GC
while it is read. Damage (a bad manifest, a bad or missing chunk) is reported per
version, and apart from it the files that failed every read with an I/O error (no proof
of damage: a version whose manifest cannot be read is reported so, and the others are
checked); a tier that cannot be listed raises (it is not damage)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ckpt._render import human
from ckpt.store.errors import CkptError, TierUnavailableError, VersionNotFoundError
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME
from ckpt.store.pins import pin_version
from ckpt.store.tier import Tier, join_key
from ckpt.store.verify import verify_chunks, verify_documents
from ckpt.store.versions import committed_steps, damaged_entries, read_manifest, root_info_verdict, version_dirname

__all__ = ["Checked", "verify_tier"]


@dataclass(frozen=True)
class Checked:
    step: int
    problems: tuple[str, ...]  # one line per bad chunk, or the bad manifest: damage
    summary: str  # "ok (N chunks, SIZE)" when there is no problem
    unreadable: tuple[str, ...] = ()  # one line per file no read of which succeeded (an I/O error)
    whole: bool = False  # the problem is the version itself (its manifest or directory), not chunks


def _check(tier: Tier, step: int, asked: bool) -> Checked | None:
    try:
        manifest = read_manifest(tier, step)
    except VersionNotFoundError:
        if asked:
            raise
        return None  # deleted (GC) since the listing
    except TierUnavailableError as e:  # an I/O error: no proof of damage, and the others are checked
        return Checked(step, (), "", (f"UNREADABLE {MANIFEST_NAME}: {e}",))
    except CkptError as e:
        return Checked(step, (f"BAD manifest: {e}",), "", whole=True)
    try:
        info = root_info_verdict(tier, step)
    except TierUnavailableError as e:
        return Checked(step, (), "", (f"UNREADABLE {ROOT_INFO_NAME}: {e}",))
    if isinstance(info, OSError):
        return Checked(step, (), "", (f"UNREADABLE {ROOT_INFO_NAME}: {info.strerror or info}",))
    if isinstance(info, str):  # a restore cannot choose it: which ranks' chunks it holds is unknown
        return Checked(step, (f"BAD {info}",), "", whole=True)
    held = set(info.writers)
    found = [*verify_chunks(tier, step, manifest, held), *verify_documents(tier, step, manifest)]
    n = sum(1 for a in manifest.arrays.values() for c in a.iter_chunks() if held is None or c.writer in held)
    return Checked(
        step,
        tuple(f"BAD {p.path}: {p.reason}" for p in found if not p.unreadable),
        f"ok ({n} chunks, {human(manifest.total_bytes)})",
        tuple(f"UNREADABLE {p.path}: {p.reason}" for p in found if p.unreadable),
    )


def verify_tier(tier: Tier, step: int | None = None) -> Iterator[Checked]:
    """Each version's check (or only `step`'s), oldest first."""
    damaged = {d.step: d for d in damaged_entries(tier) if step is None or d.step == step}
    steps = [step] if step is not None and step not in damaged else [] if step is not None else committed_steps(tier)
    if not steps and not damaged:
        raise CkptError(f"no committed versions in {tier.location}")
    for d in sorted(damaged.values(), key=lambda d: d.step):
        yield Checked(d.step, (f"BAD {d.name}: {d.why}",), "", whole=True)
    for s in steps:
        with pin_version(tier, s) as held:  # GC leaves it alone while it is checked
            # (or a GC deleted it meanwhile; a directory that cannot be looked into is no proof of that)
            try:
                there = held and tier.exists(join_key(version_dirname(s), MANIFEST_NAME))
            except TierUnavailableError as e:
                yield Checked(s, (), "", unreadable=(f"UNREADABLE {version_dirname(s)}: {e}",))
                continue
            if not there:
                if step is not None:
                    why = "does not exist" if held else "is being deleted (by a GC)"
                    raise VersionNotFoundError(f"step {s} {why} in {tier.location}")
                continue
            checked = _check(tier, s, asked=step is not None)
        if checked is not None:
            yield checked
