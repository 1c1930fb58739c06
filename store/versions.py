"""Committed versions on any tier: their names, listing, manifests and root info, and their
crash-safe deletion.

A version of step N is the directory `v<N:012d>/`; it is committed once it holds a
manifest (on a local root the directory appears whole, by one rename; on an object store
the manifest is written last, create-only, and is the commit marker). What a tier holds
of a version is in its `root.json` (RootInfo): a multi-root job's tier holds only the
chunks of some ranks.

Deleting depends on the tier's capabilities:
- atomic rename (local): one rename of `v<N>/` into `.trash/` unpublishes it, then its
  files are deleted; a crash leaves only trash, which `finish_deletions` empties;
- no rename (object stores): a `.deleting` marker is written, then the manifest removed
  (the version is invisible from then on), then the rest, the marker last; a killed
  deletion leaves a marked directory that `finish_deletions` completes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

import xxhash

from ckpt.store.errors import CorruptVersionError, ManifestError, TierUnavailableError, VersionNotFoundError
from ckpt.store.faults import fault_point
from ckpt.store.manifest import MANIFEST_NAME, MAX_WORLD, ROOT_INFO_NAME, SAVE_ID, Manifest, keys_of, parse_manifest
from ckpt.store.rank_ranges import RankRanges, ranges_of
from ckpt.store.rereads import REREADS, reread
from ckpt.store.root import ROOT_ID_NAME
from ckpt.store.tier import Tier, join_key, open_tier

__all__ = [
    "MAX_STEP",
    "TRASH_NAME",
    "DELETING_MARKER",
    "COMMIT_CLAIM",
    "Candidate",
    "Damaged",
    "RootInfo",
    "as_tier",
    "version_dirname",
    "parse_version_dirname",
    "check_step",
    "committed_steps",
    "newest_committed",
    "is_committed",
    "committed",
    "listing",
    "damaged_entries",
    "read_manifest",
    "ManifestFacts",
    "read_manifest_facts",
    "remember_manifest",
    "read_root_info",
    "root_info_verdict",
    "delete_version",
    "delete_uncommitted",
    "delete_damaged",
    "remove_marked",
    "finish_deletions",
    "marked_for_deletion",
]

log = logging.getLogger("ckpt")
T = TypeVar("T")
TRASH_NAME = ".trash"
DELETING_MARKER = ".deleting"
COMMIT_CLAIM = ".commit"
"""In a version directory of an object store: written create-only by whoever commits the
version (its save_id) or collects it as an abandoned upload ("gc"), so the two exclude
each other."""
_VERSION = re.compile(r"v([0-9]{12})")  # ASCII digits only, and nothing after them (fullmatch)
MAX_STEP = 10**12 - 1
"""The largest step: a version directory's name holds 12 digits."""


def check_step(step: object) -> int:
    """`step` if it is a step (an int in 0..MAX_STEP); ValueError otherwise."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"step must be an int, not {type(step).__name__} {step!r}")
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in 0..{MAX_STEP}, not {step}")
    return step


def version_dirname(step: int) -> str:
    return f"v{step:012d}"


def parse_version_dirname(name: str) -> int | None:
    m = _VERSION.fullmatch(name)
    return int(m.group(1)) if m else None


def as_tier(where: Tier | str | os.PathLike[str]) -> Tier:
    return where if isinstance(where, Tier) else open_tier(os.fspath(where))


@dataclass(frozen=True, slots=True)
class RootInfo:
    """`root.json`: what one tier holds of a version."""

    save_id: str
    step: int
    world_size: int
    writers: tuple[int, ...]  # ranks whose chunks this tier holds
    keys: tuple[str, ...] | None = None  # the state's top-level keys the version holds (None: all)
    created: float = 0.0  # the manifest's: which of two saves of a step is the later (0: not recorded)
    partial: bool | None = None  # the manifest's: a params-only version (None: not recorded)

    def to_json(self) -> bytes:
        doc: dict[str, object] = {
            "save_id": self.save_id,
            "step": self.step,
            "world_size": self.world_size,
            "writers": list(self.writers),
        }
        if self.keys is not None:
            doc["keys"] = list(self.keys)
        if self.created:
            doc["created"] = self.created
        if self.partial is not None:
            doc["partial"] = self.partial
        return json.dumps(doc).encode()


def parse_root_info(raw: bytes) -> RootInfo | None:
    """The root info, or None where it is not one (a torn or foreign file)."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    save_id, step, world, writers = doc.get("save_id"), doc.get("step"), doc.get("world_size"), doc.get("writers")
    if not (isinstance(save_id, str) and SAVE_ID.fullmatch(save_id)):
        return None
    if type(world) is not int or not 1 <= world <= MAX_WORLD or not isinstance(writers, list):
        return None
    if not all(type(w) is int and 0 <= w < world for w in writers):
        return None
    created = doc.get("created", 0.0)
    if type(created) is not float or not 0.0 <= created < 1e12:  # (written by time.time(): a float)
        created = 0.0
    partial = doc.get("partial")
    return RootInfo(
        save_id,
        step if type(step) is int else -1,
        world,
        tuple(writers),
        keys_of(doc.get("keys")),
        created,
        partial if isinstance(partial, bool) else None,
    )


class Candidate(NamedTuple):
    """A committed version as one tier sees it. A tuple: every rank unpickles every rank's
    candidates (restore.locate.Listing), 16,384 x 14 of them in bench/scale.py's listing,
    where a frozen dataclass (restored by field name) made choosing the version take 1.08 s
    of CPU, and a tuple 0.66-0.77 s."""

    step: int
    save_id: str
    world_size: int  # ranks that saved it
    writers: RankRanges  # ranks whose chunks this tier holds
    keys: frozenset[str] | None = None  # the state's top-level keys it holds (None: all)
    created: float = 0.0  # when it was saved (RootInfo.created; 0: not recorded)
    partial: bool | None = None  # a params-only version (RootInfo.partial; None: not recorded)


class _Kind(Protocol):
    @property
    def step(self) -> int: ...
    @property
    def keys(self) -> Collection[str] | None: ...
    @property
    def partial(self) -> bool | None: ...


def full_steps(versions: Iterable[_Kind]) -> set[int]:
    """The steps of the versions that hold the whole training state, as a restore with no
    state to go by (an export) and retention's "full" take them: those not saved as
    params-only versions (`partial`, whatever their keys: a state's keys may change between
    saves). Versions written before it was recorded: those holding every top-level key any
    of them holds."""
    vs = list(versions)
    unrecorded = [v for v in vs if v.partial is None]
    every = frozenset(k for v in unrecorded if v.keys is not None for k in v.keys)
    return {v.step for v in vs if v.partial is False} | {
        v.step for v in unrecorded if v.keys is None or every.issubset(v.keys)
    }


def _version_names(tier: Tier) -> Iterator[tuple[int, str]]:
    for name in tier.listdir(""):
        step = parse_version_dirname(name)
        if step is not None and _may_be_version(tier, name):
            yield step, name


def _may_be_version(tier: Tier, name: str) -> bool:
    """A version is a directory of the tier, never a link to elsewhere (nor a file)."""
    path = tier.local_path(name)
    return path is None or (not os.path.islink(path) and os.path.isdir(path))


def _holds_commit(tier: Tier, name: str) -> bool:
    """Whether a version's directory holds a committed version: its manifest, and no
    `.deleting` marker (an object store's GC killed before removing the manifest leaves one)."""
    try:
        inside = tier.listdir(name)  # one request on an object store
    except TierUnavailableError:
        if tier.local_path(name) is None:
            raise  # (a store that does not answer after the retries: no listing at all)
        # A local directory that cannot be looked into (a permission, an I/O error) is no
        # proof that it holds no commit, and must not stop the listing of the others: it is
        # listed, and each reader meets its unreadable manifest as it meets any (`ls`:
        # unreadable; verify, gc: kept, reported; restore: not passed over).
        return True
    return MANIFEST_NAME in inside and DELETING_MARKER not in inside


@dataclass(frozen=True, slots=True)
class Damaged:
    """An entry of a local tier named like a version that is no committed version."""

    step: int
    name: str
    why: str
    lost_manifest: bool = False  # a version directory without its manifest (else a file or a link)


def damaged_entries(where: Tier | str | os.PathLike[str]) -> list[Damaged]:
    """Entries named like versions that are none, on a local tier: a file or a link where a
    version directory belongs, and, on a Checkpointer's root (it has a root id), a version
    directory without a manifest: such a root publishes a version whole, by one rename, so
    a directory without its manifest lost it. Elsewhere (a replica disk, the remote) such a
    directory is a copy in progress. Absence is proven by the filesystem only: an entry
    that cannot be examined (a permission, an I/O error) is not listed here."""
    tier = as_tier(where)
    root = tier.local_path("")
    if root is None:
        return []
    whole = os.path.exists(os.path.join(root, ROOT_ID_NAME))
    out = []
    for name in tier.listdir(""):
        step = parse_version_dirname(name)
        if step is None:
            continue
        path = os.path.join(root, name)
        try:
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                why = "a symbolic link where a version directory belongs"
            elif not stat.S_ISDIR(mode):
                why = "a file where a version directory belongs"
            elif not whole:
                continue
            else:
                try:
                    os.lstat(os.path.join(path, MANIFEST_NAME))
                    continue
                except FileNotFoundError:
                    os.lstat(path)  # still there: not deleted (moved into the trash) meanwhile
                why = f"a version directory without {MANIFEST_NAME}"
        except FileNotFoundError:
            continue  # deleted since the listing
        except OSError:
            continue  # cannot be examined: proves nothing
        out.append(Damaged(step, name, why, why.startswith("a version directory")))
    return out


def committed_steps(where: Tier | str | os.PathLike[str]) -> list[int]:
    """Steps with a version directory holding a manifest, oldest first. On an object store
    a directory that carries the `.deleting` marker is no longer listed: its deletion was
    decided (a GC killed before removing the manifest leaves it so)."""
    tier = as_tier(where)
    return [step for step, name in _version_names(tier) if _holds_commit(tier, name)]


def newest_committed(where: Tier | str | os.PathLike[str]) -> int | None:
    """committed_steps(where)[-1] (None: none), looking into version directories from the
    newest down only until one holds a commit: two requests on an object store, not one
    per version."""
    tier = as_tier(where)
    for step, name in sorted(_version_names(tier), reverse=True):
        if _holds_commit(tier, name):
            return step
    return None


def is_committed(where: Tier | str | os.PathLike[str], step: int) -> bool:
    """Whether committed_steps(where) holds `step`, from that version's directory alone
    (save() asks before every save: one listing, not one per version)."""
    tier = as_tier(where)
    name = version_dirname(step)
    path = tier.local_path(name)
    if path is not None:
        try:
            os.lstat(path)
        except FileNotFoundError:
            return False
        except OSError as e:  # the root is a file (ENOTDIR), a dead disk: as committed_steps' listing fails
            raise TierUnavailableError(e.errno, f"cannot examine {path}: {e.strerror}") from None
    return _may_be_version(tier, name) and _holds_commit(tier, name)


def read_root_info(where: Tier | str | os.PathLike[str], step: int) -> RootInfo | None:
    """The version's root info on this tier; None if it has none or it does not parse."""
    info = _root_info(as_tier(where), step)
    return None if isinstance(info, OSError) else info


def root_info_verdict(where: Tier | str | os.PathLike[str], step: int) -> RootInfo | str | OSError:
    """The version's root info; or why none can be had, as a restore's listing judges it: a
    str where it is missing or does not parse (damage: the version cannot be chosen), the
    OSError of a local file that cannot be read (no proof of damage). TierUnavailableError
    where the store does not answer."""
    tier = as_tier(where)
    info = _root_info(tier, step)
    if info is None:
        return f"{version_dirname(step)}/{ROOT_INFO_NAME} is missing or damaged"
    return info


def _root_info(tier: Tier, step: int) -> RootInfo | OSError | None:
    """read_root_info's answer, or the error of a local file that cannot be read (logged)."""
    key = join_key(version_dirname(step), ROOT_INFO_NAME)
    try:
        return _read_checked(tier, key, lambda: tier.get(key), _valid_root_info)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, CorruptVersionError, ValueError):
        return None  # (ValueError: it did not parse, on every read)
    except TierUnavailableError:
        raise  # the store does not answer: the whole tier is unavailable, not this version
    except OSError as e:
        if not tier.capabilities.local_files:  # a refusal of the store: no version is readable
            raise TierUnavailableError(e.errno or errno.EIO, f"cannot read {tier.location}/{key}: {e}") from None
        # One version's file cannot be read (a bad sector, a permission): that version is
        # skipped, as when its root info does not parse; the tier's other versions are not.
        log.warning("%s/%s cannot be read; step %d skipped: %s", tier.location, key, step, e.strerror or e)
        return e


def _valid_root_info(raw: bytes) -> RootInfo:
    info = parse_root_info(raw)
    if info is None:
        raise ValueError(f"not a valid {ROOT_INFO_NAME}")
    return info


def _read_checked(tier: Tier, key: str, read: Callable[[], bytes], parse: Callable[[bytes], T]) -> T:
    """parse(read()), from a store read again (REREADS) while parse refuses the bytes (a
    ValueError: ManifestError is one); the last refusal is raised, a failed read (OSError) at once.
    This machine's files are read once: a re-read brings the same bytes from the page cache."""
    times = 0 if tier.capabilities.local_files else REREADS
    return reread(
        lambda: parse(read()), lambda e: isinstance(e, ValueError), times=times, what=f"{tier.location}/{key}: "
    )


def committed(where: Tier | str | os.PathLike[str]) -> list[Candidate]:
    """Committed versions with a valid root info, oldest first (see listing)."""
    return listing(where)[0]


def listing(where: Tier | str | os.PathLike[str]) -> tuple[list[Candidate], list[int], dict[int, str]]:
    """Committed versions with a valid root info, oldest first; the committed steps without
    one (missing or damaged); and those whose root info could not be read, with why (an I/O
    error: no proof of damage). Neither can be chosen for a restore (its holders cannot be
    known), and a restore that finds nothing else says which it was."""
    tier = as_tier(where)
    out, nameless, unreadable = [], [], {}
    for step in committed_steps(tier):
        info = _root_info(tier, step)
        if isinstance(info, OSError):
            unreadable[step] = info.strerror or str(info)
            continue
        if info is None:
            if not tier.exists(join_key(version_dirname(step), MANIFEST_NAME)):
                continue  # deleted since it was listed (a GC's rename into the trash): gone, not damaged
            nameless.append(step)
            continue
        keys = None if info.keys is None else frozenset(info.keys)
        out.append(
            Candidate(step, info.save_id, info.world_size, ranges_of(info.writers), keys, info.created, info.partial)
        )
    return out, nameless, unreadable


def read_manifest(where: Tier | str | os.PathLike[str], step: int) -> Manifest:
    """The parsed, validated manifest of `step`. VersionNotFoundError if it is not committed,
    ManifestError (a CorruptVersionError) if the manifest is damaged, TierUnavailableError
    if it cannot be read (an I/O error, a store that does not answer)."""
    tier = as_tier(where)
    return _read_checked(
        tier, _manifest_key(step), lambda: _manifest_bytes(tier, step), lambda raw: _parsed(tier, step, raw)
    )


@dataclass(frozen=True, slots=True)
class ManifestFacts:
    """What retention judges a version by: its manifest parsed and validated, and these."""

    step: int
    created: float
    milestone: bool
    keys: frozenset[str] | None  # the saved state's top-level keys (None: every key)
    layout: str | None  # the save layout's key (store.spare)
    save_id: str  # which save of the step it is (another, once the step is saved again)
    partial: bool | None = None  # a params-only version (None: not recorded)


_FACTS: OrderedDict[tuple[int, bytes], ManifestFacts] = OrderedDict()
_FACTS_LOCK = threading.Lock()
_FACTS_KEPT = 4096  # facts of this many manifests (~200 bytes each)


def read_manifest_facts(where: Tier | str | os.PathLike[str], step: int) -> ManifestFacts:
    """read_manifest's verdict on `step` (same errors), and the facts retention needs.

    Every retention pass judges every retained version, so the manifest is read each time,
    but parsed (for a large job ~35 ms of Python, competing with the training loop for the
    GIL) only when its bytes differ from those of a manifest parsed before: the facts are
    kept by the bytes' xxh3_128, and parsing is a pure function of them."""
    tier = as_tier(where)
    return _read_checked(
        tier, _manifest_key(step), lambda: _manifest_bytes(tier, step), lambda raw: _facts(tier, step, raw)
    )


def _facts(tier: Tier, step: int, raw: bytes) -> ManifestFacts:
    key = (step, xxhash.xxh3_128_digest(raw))
    with _FACTS_LOCK:
        facts = _FACTS.get(key)
        if facts is not None:
            _FACTS.move_to_end(key)
            return facts
    return remember_manifest(raw, _parsed(tier, step, raw), key[1])


def remember_manifest(raw: bytes, m: Manifest, digest: bytes | None = None) -> ManifestFacts:
    """Let read_manifest_facts know the facts of `raw`, whose parse is `m` (e.g. a manifest
    this process has just committed); `digest`: the xxh3_128 of `raw`, where known."""
    layout = m.meta.get("layout")
    facts = ManifestFacts(
        m.step,
        m.created,
        bool(m.meta.get("milestone")),
        None if m.keys is None else frozenset(m.keys),
        layout if isinstance(layout, str) else None,
        m.save_id,
        m.partial,
    )
    with _FACTS_LOCK:
        _FACTS[(m.step, digest or xxhash.xxh3_128_digest(raw))] = facts
        while len(_FACTS) > _FACTS_KEPT:
            _FACTS.popitem(last=False)
    return facts


def _manifest_key(step: int) -> str:
    return join_key(version_dirname(step), MANIFEST_NAME)


def _manifest_bytes(tier: Tier, step: int) -> bytes:
    key = _manifest_key(step)
    try:
        raw = tier.get(key)
    except (FileNotFoundError, NotADirectoryError):
        raise VersionNotFoundError(f"step {step} is not committed in {tier.location}") from None
    except CorruptVersionError as e:  # a symlink, a FIFO: planted, not a failing disk
        raise ManifestError(str(e), path=e.path) from None
    except (TierUnavailableError, ManifestError):
        raise
    except OSError as e:
        raise TierUnavailableError(e.errno, f"cannot read {tier.location}/{key}: {e.strerror or e}") from None
    return raw


def _parsed(tier: Tier, step: int, raw: bytes) -> Manifest:
    manifest = parse_manifest(raw)
    if manifest.step != step:
        key = _manifest_key(step)
        raise ManifestError(f"{tier.location}/{key} describes step {manifest.step}, not {step}", path=key)
    return manifest


def marked_for_deletion(where: Tier | str | os.PathLike[str]) -> list[str]:
    """Version directories an interrupted deletion left: trash entries of local tiers,
    `.deleting`-marked directories of object stores."""
    tier = as_tier(where)
    if tier.capabilities.atomic_rename:
        return [join_key(TRASH_NAME, n) for n in tier.listdir(TRASH_NAME) if ".del-" in n]
    return [name for _, name in _version_names(tier) if tier.exists(join_key(name, DELETING_MARKER))]


def delete_version(where: Tier | str | os.PathLike[str], step: int) -> None:
    """Unpublish, then delete: never a half-deleted version that still looks committed.
    A version already gone (another GC deleted it first) is no error."""
    tier = as_tier(where)
    fault_point("gc-delete")  # decided; on an object store the marker comes next
    _delete_dir(tier, version_dirname(step))


def delete_uncommitted(where: Tier | str | os.PathLike[str], name: str) -> None:
    """Delete a version directory that was never committed (an abandoned upload, a damaged
    entry), with the same crash safety as delete_version."""
    _delete_dir(as_tier(where), name)


def delete_damaged(where: Tier | str | os.PathLike[str], entry: Damaged) -> bool:
    """Move a damaged entry into the trash and delete it; False if what was moved turned out
    to be a committed version (a save of that step published it meanwhile): it goes back."""
    tier = as_tier(where)
    target = join_key(TRASH_NAME, f"{entry.name}.del-{uuid.uuid4().hex[:12]}")
    try:
        tier.rename(entry.name, target)
    except FileNotFoundError:
        return True
    moved = tier.local_path(target)
    if moved is not None and not os.path.islink(moved) and os.path.isfile(os.path.join(moved, MANIFEST_NAME)):
        tier.rename(target, entry.name)
        return False
    tier.delete_tree(target)
    return True


def _delete_dir(tier: Tier, name: str) -> None:
    if tier.capabilities.atomic_rename:
        target = join_key(TRASH_NAME, f"{name}.del-{uuid.uuid4().hex[:12]}")
        try:
            tier.rename(name, target)
        except FileNotFoundError:
            return
        fault_point("gc-mid-delete")  # unpublished, files not yet deleted
        tier.delete_tree(target)
        return
    try:
        tier.put_if_absent(join_key(name, DELETING_MARKER), b"")
    except FileExistsError:
        pass  # another GC (another node's replicator) is deleting it too: both finish it
    fault_point("gc-marked")
    remove_marked(tier, name)


def remove_marked(tier: Tier, name: str) -> None:
    """Delete an object-store version directory that carries the `.deleting` marker: the
    manifest first (the version is no longer listed), the marker last. GCs racing on one
    version (every node's replicator collects the shared remote) find objects already
    deleted by the other, which is no error.

    A batch delete may leave keys with no error raised (S3 answers per-key failures with
    200, and s3fs does not raise them): what a second listing still finds is deleted one
    key at a time, which raises, so the marker never goes while anything else is left."""
    tier.delete(join_key(name, MANIFEST_NAME))
    tier.delete_many(_unmarked(tier, name))
    for key in _unmarked(tier, name):
        tier.delete(key)
    fault_point("gc-mid-remove")
    tier.delete(join_key(name, DELETING_MARKER))


def _unmarked(tier: Tier, name: str) -> list[str]:
    """The keys under a version directory but its deletion marker."""
    return [o.key for o in tier.find(name) if o.key.rsplit("/", 1)[-1] != DELETING_MARKER]


def finish_deletions(where: Tier | str | os.PathLike[str]) -> list[str]:
    """Complete the deletions a killed GC left (see marked_for_deletion); what it finished."""
    tier = as_tier(where)
    done = marked_for_deletion(tier)
    for key in done:
        if tier.capabilities.atomic_rename:
            tier.delete_tree(key)
        else:
            remove_marked(tier, key)
        log.info("gc %s: finished an interrupted deletion of %s", tier.location, key)
    return done
