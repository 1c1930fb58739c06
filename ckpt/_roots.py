"""Opening the checkpointer's roots: which directory each rank writes, which ranks share
it (by the root's identity, not its path: one directory may be mounted on several hosts),
its writer lock, the replicator's lock, and the repair of what a crash left.

Every function here that takes `ctl` is collective: every rank calls it, and every rank
raises alike when any rank fails.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckpt._commit import RootContext
from ckpt._dist import Comm
from ckpt._peer_status import drop_overwritten_copies
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.daemon import lock_root
from ckpt.store import commit
from ckpt.store.errors import CkptError, RankFailures, RootLockedError, TierUnavailableError
from ckpt.store.fsio import makedirs
from ckpt.store.root import RootLock, root_id, version_above
from ckpt.store.tier import Tier, is_url, local_location, open_tier
from ckpt.store.versions import listing

__all__ = [
    "PathSpec",
    "RootSpec",
    "OpenedRoot",
    "resolve_root",
    "choose_root",
    "open_root",
    "lock_replicator",
    "recover",
    "replication_config",
    "replica_tiers",
    "open_tiers",
    "local_world",
    "node_of",
    "host_names",
]

log = logging.getLogger("ckpt")
PathSpec = str | os.PathLike[str] | Callable[[int], "str | os.PathLike[str]"]
RootSpec = PathSpec | Sequence[PathSpec]


def local_world() -> int:
    """Ranks per node (LOCAL_WORLD_SIZE, as torchrun sets it; 1 without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)


def node_of(rank: int) -> int:
    """A rank's node, as {node} in a root means it and peer copies place them."""
    return rank // local_world()


def resolve_root(root: PathSpec, rank: int) -> str:
    """A path, a callable of the rank, or a string with {rank}, {local_rank}, {node} or {hostname}.
    An empty one is refused: it would make the working directory the root (an unset
    environment variable, say)."""
    text = os.fspath(root(rank) if callable(root) else root)
    if not text:
        raise ValueError("checkpoint root is empty")
    if callable(root):
        return _local_root(text)
    fields = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank % local_world())),
        "node": node_of(rank),
        "hostname": platform.node(),
    }
    try:
        text = text.format(**fields) if "{" in text else text
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"checkpoint root {text!r} has an unknown field: {e}") from None
    return _local_root(text)


def _local_root(text: str) -> str:
    """The absolute path of a root: a path or a file:// URL (one of another scheme was made
    a local directory named like it, `./s3:/bucket/...`)."""
    local = local_location(text)  # (ValueError for a file: URL of no path of this machine)
    if local is None:
        raise ValueError(
            f"checkpoint root {text!r} is a URL: the root is a directory of this machine (node-local "
            "disk); give a remote as replicate_to= (copies) or tiers= (restore reads it)"
        )
    return os.path.abspath(local)


def host_names(ctl: Comm) -> list[str]:
    """Collective: every rank's host name, by rank."""
    return ctl.all_gather(platform.node())


def local_rank(ctl: Comm) -> int:
    """This rank's index among the ranks of its host (LOCAL_RANK when torchrun sets it)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    hosts = host_names(ctl)
    return sum(1 for h in hosts[: ctl.rank] if h == hosts[ctl.rank])


def choose_root(ctl: Comm, root: RootSpec) -> tuple[str, list[str] | None]:
    """(this rank's root, the node's disks when `root` lists several). The ranks of a node
    are spread over its disks by local rank."""
    if isinstance(root, (list, tuple)):
        if not root:
            raise ValueError("root list is empty")
        disks = [resolve_root(r, ctl.rank) for r in root]
        return disks[local_rank(ctl) % len(disks)], disks
    return resolve_root(root, ctl.rank), None  # type: ignore[arg-type]


@dataclass(frozen=True)
class OpenedRoot:
    ctx: RootContext
    lock: RootLock | None  # held by the root's leader


def open_root(ctl: Comm, root: str) -> OpenedRoot:
    """Create and identify the root, group the ranks that share it, and lock it (its leader)."""
    key: str | None = None
    error = None
    inside = version_above(root)
    if inside is not None:
        error = f"checkpoint root {root} lies inside the version directory {inside}; choose a root outside it"
    else:
        try:
            makedirs(root)
            if not os.access(root, os.W_OK | os.X_OK):
                raise PermissionError(f"{root} is not writable")
            key = root_id(root)
        except OSError as e:
            error = f"cannot use checkpoint root {root}: {e.strerror or e}"
    views = ctl.all_gather((key, error))
    failures = {r: err for r, (_, err) in enumerate(views) if err}
    if inside is not None and error is not None:
        raise ValueError(error)
    if ctl.rank in failures:
        raise TierUnavailableError(failures[ctl.rank])
    if failures:
        raise RankFailures(failures)
    keys: list[str] = []
    for k, _ in views:
        if k not in keys:
            keys.append(k)
    groups = tuple(tuple(r for r, (k, _) in enumerate(views) if k == key_) for key_ in keys)
    index = keys.index(key)  # type: ignore[arg-type]
    ctx = RootContext(root, ctl.rank, groups[index][0] == ctl.rank, index, groups)
    lock, lock_error = None, None
    if ctx.is_leader:
        lock = RootLock(root)
        try:
            lock.acquire()
        except (RootLockedError, OSError) as e:
            lock = None
            lock_error = str(e) if isinstance(e, RootLockedError) else f"cannot lock {root}: {e}"
    locks = ctl.all_gather(lock_error)
    if any(locks):
        if lock is not None:
            lock.release()
        raise RootLockedError(next(m for m in locks if m))
    return OpenedRoot(ctx, lock)


def lock_replicator(ctl: Comm, ctx: RootContext, replication: ReplicatorConfig | None) -> int | None:
    """The replicator thread takes the lock `ckpt replicate` takes: two replicators on one
    root would race on its status, journals and GC."""
    if replication is None:
        return None
    fd, error = None, None
    if ctx.is_leader:
        try:
            fd = lock_root(ctx.root)
        except OSError as e:
            error = (isinstance(e, RootLockedError), str(e))
    errors = [e for e in ctl.all_gather(error) if e]
    if errors:
        if fd is not None:
            os.close(fd)
        locked = [msg for is_locked, msg in errors if is_locked]
        raise RootLockedError(locked[0]) if locked else TierUnavailableError(errors[0][1])
    return fd


def recover(ctl: Comm, ctx: RootContext, tier: Tier) -> None:
    """Leftovers of a crash: prepared saves that another root published are rolled forward,
    those of a step some root cannot read now kept for the next opening, other tmp
    directories removed, the trash emptied."""
    mine: list[tuple[int, str | None]] = []
    error = None
    try:
        if ctx.is_leader:
            found, _, unread = listing(tier)
            # A step whose root info cannot be read now (an I/O error, a permission) may be
            # published, by any save: None, so no root removes its prepared part of it.
            mine = [(c.step, c.save_id) for c in found] + [(step, None) for step in unread]
    except (CkptError, OSError) as e:  # every rank raises it in agree(), none is left waiting
        error = e
    ctl.agree(error)
    published = {tuple(x) for view in ctl.all_gather(mine) for x in view}
    if not ctx.is_leader:
        return
    unknown = {step for step, save_id in published if save_id is None}
    for p in commit.prepared_versions(ctx.root):
        if p.has_manifest and (p.step, p.save_id) in published:
            log.warning("rank %d: rolling forward step %d, published on another root", ctx.rank, p.step)
            drop_overwritten_copies(ctx.root, p.step)
            commit.publish(ctx.root, p.dirname, p.step, overwrite=True)
        elif p.has_manifest and p.step in unknown:
            log.warning(
                "rank %d: step %d's unfinished save %s kept: a root cannot read its step %d, which may be "
                "that save's; the next opening judges it again",
                ctx.rank,
                p.step,
                p.dirname,
                p.step,
            )
        else:
            log.info("rank %d: removing unfinished save of step %d (%s)", ctx.rank, p.step, p.dirname)
            commit.remove_tmp(ctx.root, p.dirname)
    commit.empty_trash(ctx.root)


def replication_config(
    replication: ReplicatorConfig | None,
    replicate_to: str | None,
    storage_options: Mapping[str, Any] | None,
    root: str,
    disks: list[str] | None,
) -> ReplicatorConfig | None:
    """The replicator's config: the node's other disks are its replica roots by default."""
    if replication is None and replicate_to is None:
        return None
    others = tuple(r for r in (disks or []) if r != root)
    if replication is None:
        return ReplicatorConfig(
            replicas=2 if others else 1,
            replica_roots=others,
            remote=replicate_to,
            storage_options=dict(storage_options or {}),
        )
    return replace(
        replication, remote=replicate_to or replication.remote, replica_roots=replication.replica_roots or others
    )


def replica_tiers(disks: Sequence[str]) -> list[Tier]:
    """Copies the replicator made of any root of this node (found again on every restore)."""
    out: list[Tier] = []
    for r in disks:
        base = os.path.join(r, "replicas")
        try:
            names = sorted(os.listdir(base))
        except OSError:  # none there, or the disk has failed
            continue
        out += [open_tier(os.path.join(base, d)) for d in names if os.path.isdir(os.path.join(base, d))]
    return out


def open_tiers(specs: Sequence[PathSpec | Tier], rank: int, storage_options: Mapping[str, Any] | None) -> list[Tier]:
    """Further tiers restore reads: Tier objects, fsspec URLs, or local paths (PathSpec)."""
    out: list[Tier] = []
    for spec in specs:
        if isinstance(spec, Tier):
            out.append(spec)
        elif isinstance(spec, str) and is_url(spec):
            out.append(open_tier(spec, storage_options))
        else:
            out.append(open_tier(resolve_root(spec, rank)))
    return out
