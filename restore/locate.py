"""The one restore loop: choose the newest version every rank can read, pin it, load it,
and fall back past damage. Checkpointer.restore, `ckpt restore`, `ckpt inspect` and the
exports all go through `restore_newest`; only what "load" means differs.

Each round:
1. every rank lists the committed versions on each of its tiers (an unreachable tier is
   a warning: the others may hold copies), but a shared one (an object store, the same
   for every rank) is listed by rank 0 alone, for every rank: one LIST, not one per rank;
2. the ranks exchange what they found (Listing: the round's one all-gather, each
   version's writers as ranges, so O(ranks x versions) in all at any world size) and
   choose the newest step whose every writer's chunks some rank holds, with one save_id
   (restore.discover);
3. each rank pins its copies against GC (store.pins) and checks they are still there: a
   version GC deleted since the listing is gone, not damaged; choose again;
4. load. A damaged version (CorruptVersionError, on any rank: the caller's load agrees
   across ranks) is skipped with a warning for the next older one, unless a step was asked
   for. Anything else (a tier that stops answering mid-read) ends the restore: a read
   that failed is no proof of damage.

Nothing found is an answer only when every tier could be listed: a tier that could not
be read may hold the versions, so a fresh start would be a silent loss
(TierUnavailableError instead). Nor when versions are committed but some ranks' part of
each is on no tier searched (a node replaced with empty disks): IncompleteVersionError
names them, unless the caller asked to start fresh then (`if_incomplete="fresh"`).
A complete older version is restored in their stead, with a warning naming them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, TypeVar

from ckpt.restore.discover import (
    Holdings,
    Needed,
    OneOf,
    choose_step,
    holdings,
    missing_writers,
    partial_steps,
    reachable_steps,
)
from ckpt.restore.sources import Source
from ckpt.store.errors import (
    CkptError,
    CorruptVersionError,
    IncompleteVersionError,
    RankFailures,
    TierUnavailableError,
    VersionNotFoundError,
    for_cli,
)
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME, Manifest
from ckpt.store.pins import pin_version
from ckpt.store.rank_ranges import expand
from ckpt.store.tier import Tier, join_key
from ckpt.store.versions import Candidate, damaged_entries, full_steps, listing, read_manifest, version_dirname

__all__ = ["ALL_KEYS", "AllKeys", "ExportPrefix", "Needs", "Listing", "Located", "restore_newest", "first_manifest"]

log = logging.getLogger("ckpt")
T = TypeVar("T")


class _Comm(Protocol):
    rank: int

    def all_gather(self, obj: Any) -> list[Any]: ...
    def any(self, flag: bool) -> bool: ...


@dataclass(frozen=True)
class Located:
    """The version chosen for this round, and this rank's copies of it, in tier order."""

    step: int
    save_id: str
    sources: tuple[Source, ...]
    unreachable: set[str] = field(default_factory=set, compare=False)
    """Locations of sources this rank found it cannot reach while loading (a store rank 0
    listed for every rank, say): left out of its later reads, which ranks that reach them
    serve over the group (ckpt._load). restore_newest passes one set to every round, so a
    fallback to an older version does not wait out a dead store's retries again."""


class Listing(NamedTuple):
    """What one rank found, as every rank receives it (the one all-gather of a restore):
    O(versions x tiers) small records, each candidate's writers as ranges."""

    candidates: list[Candidate]  # on the tiers only this rank's node reaches
    failure: str | None  # this rank's listing failed (not a tier's failure: a bug)
    locations: list[str]  # the tiers it searched
    keys: list[str] | None  # its state's top-level keys (None: the restore asks for none)
    shared: list[
        tuple[str, list[Candidate] | None]
    ]  # per shared tier (Tier.store_id): what it holds; None: left to rank 0
    step: int | None = None  # the step this rank asks for (the same on every rank, or an error)


def first_manifest(located: Located, shared: bool = True) -> Manifest | None:
    """The manifest from the first source whose copy reads and validates; None if this rank
    has no copy. CorruptVersionError if every copy is damaged, TierUnavailableError if
    none is damaged but some could not be read.

    Without `shared`, copies on shared tiers are left to another rank (None where this rank
    has no other good copy): one rank reads the remote's manifest for the job."""
    damaged: list[CorruptVersionError] = []
    unreachable: list[TierUnavailableError] = []
    left = False
    for src in located.sources:
        if not shared and src.tier.capabilities.shared:
            left = True
            continue
        try:
            return read_manifest(src.tier, located.step)
        except CorruptVersionError as e:
            damaged.append(e)
            log.warning("manifest of step %d on %s: %s", located.step, src.name, e)
        except TierUnavailableError as e:
            unreachable.append(e)
            log.warning("manifest of step %d on %s: %s", located.step, src.name, e)
        except VersionNotFoundError as e:  # deleted since it was listed
            damaged.append(CorruptVersionError(str(e)))
    if left:
        return None
    if unreachable:  # a copy out of reach may be good: no proof that the version is damaged
        detail = "; ".join(map(str, [*unreachable, *damaged]))
        raise TierUnavailableError(unreachable[0].errno, f"no readable manifest of step {located.step}: {detail}")
    if len(damaged) == 1:
        raise damaged[0]  # as itself (a ManifestError says what is wrong)
    if damaged:
        raise CorruptVersionError(f"no readable manifest of step {located.step}: {'; '.join(map(str, damaged))}")
    return None


class _Found(NamedTuple):
    candidates: list[tuple[int, Candidate]]  # (the tier's position, a version on it)
    failed: dict[int, str]  # the positions of the tiers that could not be listed, and why
    damaged: dict[int, str]  # steps whose entry is damaged (no root info, no manifest...): what is
    unreadable: dict[int, str]  # steps whose root info failed to read (an I/O error): which, and why


def _list(tiers: Sequence[Tier], rank: int, warned: set[str], skip: frozenset[int], dead: dict[str, str]) -> _Found:
    """The committed versions on each tier but those in `skip` (by position); a tier whose
    store is in `dead` (rank 0 failed to list it this restore) fails as it did then."""
    found: list[tuple[int, Candidate]] = []
    failed: dict[int, str] = {}
    damaged: dict[int, str] = {}
    unreadable: dict[int, str] = {}
    for i, tier in enumerate(tiers):
        if i in skip:
            continue
        if tier.store_id in dead:
            failed[i] = dead[tier.store_id]
            continue
        try:
            candidates, without, unread = listing(tier)
            found += [(i, c) for c in candidates]
            for step, why in unread.items():  # (listing logged each)
                unreadable[step] = f"{tier.location}/{version_dirname(step)}/{ROOT_INFO_NAME} cannot be read: {why}"
            for step in without:
                where = f"{tier.location}/{version_dirname(step)}/{ROOT_INFO_NAME}"
                damaged[step] = f"{where} is missing or damaged"
                if where not in warned:
                    warned.add(where)
                    log.warning("rank %d: step %d skipped, %s", rank, step, damaged[step])
            for d in damaged_entries(tier):
                where = f"{tier.location}/{d.name}"
                damaged[d.step] = f"{where} is damaged: {d.why}"
                if where not in warned:
                    warned.add(where)
                    log.warning("rank %d: step %d skipped, %s", rank, d.step, damaged[d.step])
        except (CkptError, OSError) as e:
            failed[i] = f"{tier.location}: {e}"
            log.warning("rank %d: tier %s is unavailable: %s", rank, tier.location, e)
    return _Found(found, failed, damaged, unreadable)


def restore_newest(
    comm: _Comm,
    tiers: Callable[[], Sequence[Tier]],
    load: Callable[[Located], T],
    *,
    step: int | None = None,
    missing_ok: bool = True,
    needs: Needs = None,
    if_incomplete: Literal["raise", "fresh"] = "raise",
    passed_over: set[int] | None = None,
) -> tuple[int, T] | None:
    """load(the chosen version); (its step, what load returned). None when no version is
    committed anywhere and every tier could be read (with `missing_ok`; otherwise that is
    VersionNotFoundError too). Collective: every rank of `comm` calls it.

    `needs`: this rank's state's top-level keys; a version must hold every rank's (ranks
    may hold different trees; their union travels with the listing, so every rank chooses
    the same version) to be chosen (ALL_KEYS: every key any listed version holds; an
    ExportPrefix: the top-level key a dotted prefix starts with); newer versions that hold
    fewer are passed over, each said in one log line.

    `if_incomplete`: when versions are committed but none is complete on the tiers searched,
    "raise" (IncompleteVersionError, naming them and the missing ranks' parts) or "fresh"
    (None, as when nothing is committed).

    `passed_over`: filled with the steps newer than the one chosen that are committed only in
    part on the tiers searched, and (no step asked for) the whole ones: they hold fewer keys
    than needed, or are damaged (the same on every rank); where none is chosen (None, or an
    error), with every such step."""
    excluded: set[int] = set()
    passed: set[int] = set()  # versions already reported as passed over
    vanished: set[int] = set()  # deleted by GC since they were listed
    warned: set[str] = set()  # damaged entries already reported
    damaged: dict[int, str] = {}  # steps this rank found damaged entries of (_Found.damaged)
    unread: dict[int, str] = {}  # steps whose root info this rank could not read (_Found.unreadable)
    one_lister = True  # rank 0 lists the shared tiers for every rank (False: each rank lists its own)
    dead: dict[str, str] = {}  # shared tiers rank 0 could not list (store_id: why): not tried again
    cut_off: set[str] = set()  # sources this rank found out of its reach while loading (Located.unreachable)
    while True:
        listed: list[Tier] = []
        mine: list[tuple[int, Candidate]] = []
        left: frozenset[int] = frozenset()  # the shared tiers (by position) rank 0 lists for this rank
        unlisted: dict[int, str] = {}  # the tiers (by position) that could not be listed, and why
        failure: Exception | None = None
        try:
            listed = list(tiers())
            if one_lister and comm.rank != 0:
                left = frozenset(i for i, t in enumerate(listed) if t.capabilities.shared)
            mine, unlisted, found_damaged, found_unread = _list(listed, comm.rank, warned, left, dead)
            damaged.update(found_damaged)
            unread.update(found_unread)
        except Exception as e:  # noqa: BLE001 - not a tier's failure (a bug): raised on every rank below
            failure = e
        unreachable = list(unlisted.values())
        gathered: list[Listing] = comm.all_gather(
            Listing(
                [c for i, c in mine if not listed[i].capabilities.shared],
                None if failure is None else f"{type(failure).__name__}: {failure}",
                [t.location for t in listed],
                sorted(needs) if isinstance(needs, frozenset) else None,
                _shared(listed, mine, left | unlisted.keys()),
                step,
            )
        )
        asks = {str(g.step) for g in gathered}
        if len(asks) > 1:  # on every rank alike: a job whose ranks would load different versions
            raise ValueError(f"restore(): the ranks ask for different steps ({', '.join(sorted(asks))})")
        failed = {r: g.failure for r, g in enumerate(gathered) if g.failure}
        if failed:
            if failure is not None:
                raise failure
            raise RankFailures(failed)
        by_lister = _by_store(gathered[0].shared)
        if one_lister and any(c is None and by_lister.get(w) is None for g in gathered[1:] for w, c in g.shared):
            # A rank names a shared tier rank 0 could not list, or does not name (a configuration
            # that differs between ranks): each rank lists its own, as a tier that fails one
            # rank may answer the others. The same on every rank, as all is gathered. Rank 0
            # does not try again what it could not list (a dead store: one retry budget).
            one_lister = False
            if comm.rank == 0:
                dead = {listed[i].store_id: why for i, why in unlisted.items() if listed[i].capabilities.shared}
            continue
        mine = sorted(
            mine + [(i, c) for i in left for c in by_lister.get(listed[i].store_id) or []], key=lambda m: m[0]
        )
        held = holdings([g.candidates for g in gathered] + [c for g in gathered for _, c in g.shared if c])
        searched = sorted({where for g in gathered for where in g.locations})
        sent = [g.keys for g in gathered if g.keys is not None]
        if sent and not isinstance(needs, AllKeys | ExportPrefix):  # every rank's keys: one choice on every rank
            needs = frozenset(k for keys in sent for k in keys)
        needed = _needed(held, needs)
        params_only = _params_only(held, needs)
        chosen = choose_step(held, step, frozenset(excluded | vanished | params_only), needed)
        _report_params_only(comm, chosen, params_only, passed)
        _report_passed(comm, held, chosen, needed, excluded | vanished, passed)
        _report_incomplete(comm, held, chosen, searched, passed)
        if chosen is None:
            if passed_over is not None:  # a fresh start (or, after an error, another tier) saves over them
                passed_over.update(partial_steps(held))
                if step is None:
                    passed_over.update(reachable_steps(held))
            if (
                needed is not None
                and step is None
                and reachable_steps(held)
                and not reachable_steps(held, needed)
                and not any(h.holds(needed) for h in held)  # (one there in part: _nothing names it)
            ):
                _lacking(held, needed, listed)
            if params_only and not set(reachable_steps(held)) - params_only - excluded - vanished:
                newest = max((params_only & set(reachable_steps(held))) - excluded - vanished or params_only)
                keys = ",".join(sorted(_holds(held).get(newest) or ()))
                what = (
                    f"every version in {', '.join(t.location for t in listed)} that can be read is a params-only "
                    f"version (steps {sorted(params_only)})"
                )
                raise for_cli(
                    VersionNotFoundError(f"{what}; restore a dict of the keys one holds (step {newest}: {keys})"),
                    f"{what}; --keys {keys} restores step {newest}" if keys else f"{what}; --keys names what to take",
                )
            # A damaged or unreadable entry of the step asked for, or (none asked for) of a
            # step no tier holds intact: an error, never "not committed" or a fresh start;
            # damage only where no read failed (an I/O error is no proof of it).
            asked = {step} if step is not None else {*damaged, *unread} - reachable_steps(held).keys()
            bad = "; ".join(damaged[s] for s in sorted(asked) if s in damaged)
            failed_reads = "; ".join(unread[s] for s in sorted(asked) if s in unread)
            if comm.any(bool(bad or failed_reads)):
                if comm.any(bool(failed_reads)):
                    what = f"step {step} cannot be read" if step is not None else "no version can be read"
                    why = failed_reads or "on another rank"
                    raise TierUnavailableError(errno.EIO, f"{what} ({why}); not starting from scratch")
                what = f"step {step} is damaged" if step is not None else "no version can be chosen"
                raise CorruptVersionError(f"{what} ({bad or 'on another rank'}); not starting from scratch")
            _nothing(comm, listed, held, step, excluded, vanished, unreachable, missing_ok, searched, if_incomplete)
            return None
        save_id = reachable_steps(held, needed)[chosen]
        sources = tuple(
            Source(listed[i], chosen, expand(c.writers)) for i, c in mine if c.step == chosen and c.save_id == save_id
        )
        try:
            with contextlib.ExitStack() as pins:
                # GC deleted it between the listing and the pin, or is deleting it: it is
                # gone, not damaged; choose again. Pinned and still there, it stays. The
                # check reads every tier (a HEAD on an object store): a failure on one rank
                # is every rank's, or the others would wait in the next collective.
                gone, failure = True, None
                try:
                    pinned = [pins.enter_context(pin_version(s.tier, chosen)) for s in sources]
                    key = join_key(version_dirname(chosen), MANIFEST_NAME)
                    # A shared tier is checked where it was listed: one HEAD for the job.
                    checked_here = [s for s in sources if not any(s.tier is listed[i] for i in left)]
                    gone = not all(pinned) or any(not s.tier.exists(key) for s in checked_here)
                except Exception as e:  # noqa: BLE001 - raised on every rank below
                    failure = e
                checks: list[tuple[bool, str | None]] = [(gone, None)]
                if comm.any(gone or failure is not None):  # the usual case: one all-reduce
                    checks = comm.all_gather(
                        (gone, None if failure is None else f"{type(failure).__name__}: {failure}")
                    )
                failed = {r: why for r, (_, why) in enumerate(checks) if why}
                if failed:
                    if failure is not None and not isinstance(failure, CorruptVersionError):
                        raise failure
                    raise TierUnavailableError(errno.EIO, f"step {chosen}: copies could not be checked: {failed}")
                if any(g for g, _ in checks):
                    vanished.add(chosen)
                    continue
                loaded = load(Located(chosen, save_id, sources, cut_off))
                if passed_over is not None:
                    passed_over.update(s for s in partial_steps(held) if s > chosen)
                    if step is None:  # (fewer keys, or damaged)
                        passed_over.update(s for s in reachable_steps(held) if s > chosen)
                return chosen, loaded
        except CorruptVersionError as e:
            if step is not None:
                raise
            log.warning("rank %d: step %d is not intact (%s); trying an older version", comm.rank, chosen, e)
            excluded.add(chosen)


def _shared(
    listed: Sequence[Tier], mine: Sequence[tuple[int, Candidate]], unlisted: frozenset[int]
) -> list[tuple[str, list[Candidate] | None]]:
    """Listing.shared: for each shared tier, the candidates this rank found on it, or None
    where it did not list it (rank 0 lists it for this rank, or the listing failed)."""
    return [
        (t.store_id, None if i in unlisted else [c for j, c in mine if j == i])
        for i, t in enumerate(listed)
        if t.capabilities.shared
    ]


def _by_store(shared: Sequence[tuple[str, list[Candidate] | None]]) -> dict[str, list[Candidate] | None]:
    """A rank's Listing.shared by store (Tier.store_id): one listing each (a store named twice
    is one store), None if any listing of it failed."""
    out: dict[str, list[Candidate] | None] = {}
    for where, cands in shared:
        out[where] = None if cands is None or (where in out and out[where] is None) else out.get(where, cands)
    return out


class AllKeys:
    """`needs` of a restore with no state to go by (an export): every key any version holds."""


ALL_KEYS = AllKeys()


@dataclass(frozen=True)
class ExportPrefix:
    """`needs` of an export of what is under a dot-separated prefix: a version must hold
    the prefix's top-level key, which may itself hold dots ("ema.model")."""

    prefix: str

    def keys(self) -> OneOf:
        parts = self.prefix.split(".")
        return OneOf(frozenset(".".join(parts[:i]) for i in range(1, len(parts) + 1)))


Needs = frozenset[str] | AllKeys | ExportPrefix | None


def _needed(held: Holdings, needs: Needs) -> Needed:
    """The keys a version must hold. ALL_KEYS: none where the versions record which are
    params-only ones (_params_only passes over those), else every key any version holds.
    An ExportPrefix: one of its leading parts joined, whichever each version holds."""
    if isinstance(needs, ExportPrefix):
        return needs.keys()
    if not isinstance(needs, AllKeys):
        return needs
    if any(h.partial is not None for h in held):
        return None
    return frozenset(k for h in held if h.keys is not None for k in h.keys)


def _params_only(held: Holdings, needs: Needs) -> frozenset[int]:
    """ALL_KEYS: the steps saved as params-only versions, where the versions record it (none
    where they do not: _needed then asks for every key any holds)."""
    if not isinstance(needs, AllKeys) or all(h.partial is None for h in held):
        return frozenset()
    return frozenset({h.step for h in held} - full_steps(held))


def _report_params_only(comm: _Comm, chosen: int | None, steps: frozenset[int], passed: set[int]) -> None:
    """One line per newer params-only version passed over (rank 0; each once)."""
    if comm.rank != 0:
        return
    for s in sorted((s for s in steps if (chosen is None or s > chosen) and s not in passed), reverse=True):
        passed.add(s)
        log.warning(
            "step %d is a params-only version: passed over%s", s, "" if chosen is None else f" for step {chosen}"
        )


def _holds(held: Holdings) -> dict[int, frozenset[str] | None]:
    """Each listed step's keys (every copy of one save holds the same)."""
    return {h.step: h.keys for h in held}


def _report_passed(
    comm: _Comm,
    held: Holdings,
    chosen: int | None,
    needed: Needed,
    skip: set[int],
    passed: set[int],
) -> None:
    """One line per newer version passed over for lack of keys (rank 0; each once)."""
    if needed is None or comm.rank != 0:
        return
    holds = _holds(held)
    fewer = set(reachable_steps(held)) - set(reachable_steps(held, needed)) - skip - passed
    for s in sorted((s for s in fewer if chosen is None or s > chosen), reverse=True):
        passed.add(s)
        have = sorted(holds.get(s) or ())
        lacks = f"any of {sorted(needed.keys)}" if isinstance(needed, OneOf) else sorted(needed - set(have))
        log.warning(
            "step %d holds only %s, not %s: passed over%s",
            s,
            have,
            lacks,
            "" if chosen is None else f" for step {chosen}",
        )


def _incomplete(held: Holdings, searched: Sequence[str]) -> IncompleteVersionError:
    """Which versions are there only in part, whose part is missing, and where the ranks looked."""
    parts = [
        f"step {s} lacks the part of ranks {missing}"
        if missing
        else f"step {s} was saved twice (different tiers), and which save is the later is not recorded"
        for s in reversed(partial_steps(held))
        for missing in [missing_writers(held, s)]
    ]
    what = (
        f"committed versions are incomplete on the tiers searched: {'; '.join(parts)} "
        f"(searched: {', '.join(searched)}); not starting from scratch. Bring back a copy of the missing parts"
    )
    return for_cli(
        IncompleteVersionError(
            f"{what} (the remote, another node's disk), or restore(state, if_incomplete='fresh') to start fresh"
        ),
        f"{what} (--tier: the remote, another node's disk)",
    )


def _report_incomplete(
    comm: _Comm, held: Holdings, chosen: int | None, searched: Sequence[str], passed: set[int]
) -> None:
    """One line per newer version passed over because a part of it is missing (rank 0; each once)."""
    if chosen is None or comm.rank != 0:
        return
    for s in sorted((s for s in partial_steps(held) if s > chosen and s not in passed), reverse=True):
        passed.add(s)
        missing = missing_writers(held, s)
        what = f"lacks the part of ranks {missing}" if missing else "was saved twice (different tiers), not told apart"
        log.warning(
            "step %d %s on the tiers searched (%s): restoring step %d instead", s, what, ", ".join(searched), chosen
        )


def _lacking(held: Holdings, needed: frozenset[str] | OneOf, tiers: Sequence[Tier]) -> None:
    """Versions exist, but none holds every key the state needs: no silent fresh start."""
    holds = _holds(held)
    steps = sorted(reachable_steps(held))
    where = ", ".join(t.location for t in tiers)
    have = sorted({k for s in steps for k in (holds.get(s) or ())})
    if isinstance(needed, OneOf):  # an export's prefix
        raise VersionNotFoundError(
            f"no version in {where} holds any of {sorted(needed.keys)}: steps {steps} hold {have}"
        )
    # The newest version holding the most of the state's keys: restoring those keys loads it.
    best = max(steps, key=lambda s: (len(needed & (holds.get(s) or frozenset())), s))
    keys = sorted(needed & (holds.get(best) or frozenset()))
    what = f"no version in {where} holds every key of the state {sorted(needed)}: steps {steps} hold only {have}"
    raise for_cli(
        VersionNotFoundError(
            f"{what}; restore a dict of the keys a version holds (the newest holding {keys} is step {best}), "
            "or restore(state, strict=False) to load the newest version, whatever it holds, into the keys it has"
        ),
        f"{what}; --keys {','.join(keys)} restores step {best}"
        if keys
        else f"{what}; give --keys of keys a version holds",
    )


def _nothing(
    comm: _Comm,
    tiers: Sequence[Tier],
    held: Holdings,
    step: int | None,
    excluded: set[int],
    vanished: set[int],
    unreachable: list[str],
    missing_ok: bool,
    searched: Sequence[str],
    if_incomplete: Literal["raise", "fresh"],
) -> None:
    """Raise why no version can be chosen, unless nothing is committed anywhere (and
    `missing_ok`), or only incomplete versions are and the caller chose a fresh start."""
    where = ", ".join(t.location for t in tiers)
    partial = partial_steps(held)
    hint = (
        f" (steps {partial} are there only in part: other ranks' chunks are on tiers not searched)" if partial else ""
    )
    if step is not None and step in vanished:
        raise VersionNotFoundError(f"step {step} is being deleted (by a GC) in {where}")
    if step is not None and step in partial:
        raise _incomplete([h for h in held if h.step == step], searched)
    if step is not None:
        raise VersionNotFoundError(f"step {step} is not committed where every rank can reach it ({where}){hint}")
    if excluded:
        raise CorruptVersionError(
            f"no committed version is intact (steps {sorted(excluded)} failed their checks); "
            "the state may be partly overwritten"
        )
    if comm.any(bool(unreachable)):
        detail = "; ".join(unreachable) or "on another rank"
        raise TierUnavailableError(
            errno.EIO,
            f"no committed version on the reachable tiers, and some could not be read ({detail}); "
            "not starting from scratch",
        )
    if partial and if_incomplete == "raise":
        raise _incomplete(held, searched)
    if not missing_ok:
        raise VersionNotFoundError(f"no complete committed version in {where}{hint}")
