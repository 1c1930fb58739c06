"""Loading a chosen version into a live state, on every rank together: restore.locate
chooses and pins the version; this is its `load`.

Each rank reads the manifest from its first good copy (a rank with no copy gets it from
one that has it), binds the saved tree to the live state (ckpt._tree: modules and
optimizers load in place), turns every tensor into read requests for its own layout,
reads (restore.execute: resharded, verified), and restores its RNG. Every phase ends in
an agreement, so a failure on one rank fails the restore on all of them, and damage
anywhere makes every rank fall back together.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ckpt._cores import rank_cores
from ckpt._dist import Comm, describe_error
from ckpt._gc import no_cyclic_gc
from ckpt._tensors import describe
from ckpt._tree import bind
from ckpt.config import CheckpointerConfig
from ckpt.restore.execute import ReadRequest, ReadsUnreached, full_tensor, load_arrays
from ckpt.restore.handoff import ChunkKey, Holders
from ckpt.restore.locate import Located, first_manifest, restore_newest
from ckpt.restore.saved_ranks import SavedRank, saved_rank
from ckpt.restore.sources import Source, SourcesUnreachable, rank_file_bytes_from
from ckpt.rng import check_rng, restore_rng, seed_new_rank
from ckpt.store.errors import CkptError, CorruptVersionError, RankFailures, StateMismatchError, TierUnavailableError
from ckpt.store.manifest import Manifest, parse_manifest
from ckpt.store.rank_file import parse_rank_file
from ckpt.store.tier import Tier
from ckpt.store.versions import version_dirname

__all__ = ["load_version", "agreed_manifest", "read_agreed", "saved_rank_of"]

_RANK_FILE_HOLDERS = 3  # ranks tried in turn for a rank file the asking rank cannot read
_Outcome = Literal["ok", "unreachable", "damaged", "failed"]  # of a holder's read of a rank file


log = logging.getLogger("ckpt")


def agreed_manifest(ctl: Comm, located: Located) -> Manifest:
    """The manifest on every rank: from this rank's copies, or broadcast from one that has it.
    A copy on a shared tier (the remote) is read by rank 0 alone, unless no rank has another.
    A rank whose every copy is damaged gets it as a rank without one does: the version is
    damaged only where no rank has a good copy."""
    found: Manifest | None = None
    damage: CorruptVersionError | None = None
    read_all = False  # this rank read every copy it has, on shared tiers too: nothing more to try
    for shared in (ctl.rank == 0, True):
        error: BaseException | None = None
        if not read_all:
            try:
                found = first_manifest(located, shared)
            except CorruptVersionError as e:  # (its copies are logged) another rank may hold a good one
                damage = e
            except Exception as e:  # noqa: BLE001 - every rank learns it in agree()
                error = e
            read_all = shared
        ctl.agree(error)
        # One all-reduce: whether any rank lacks a copy, and the lowest rank that has one.
        lacking, lowest = ctl.reduce_max([int(found is None), 0 if found is None else ctl.world - ctl.rank])
        if lowest or not lacking:
            break
    if lacking:  # ranks without a copy get it from one that has it
        if not lowest:
            if damage is not None:
                raise damage
            raise CorruptVersionError(f"no rank holds a good manifest of step {located.step}")
        src = ctl.world - lowest
        raw = ctl.broadcast(found.to_json() if found is not None and ctl.rank == src else None, src=src)
        if found is None:
            found = parse_manifest(raw)
    assert found is not None
    return found


def locate(
    ctl: Comm,
    tiers: Callable[[], Sequence[Tier]],
    step: int | None,
    read: Callable[[Manifest, Located], None] | None = None,
) -> tuple[Manifest, Located] | None:
    """Collective: the newest version whose manifest every rank can read (or `step`), for
    readers that read parts of it themselves (ckpt.dcp). `read` runs on it while it is
    pinned; its CorruptVersionError passes the version over for the next older one
    (unless `step` was given), as a failed load does in a restore."""

    def load(located: Located) -> tuple[Manifest, Located]:
        manifest = agreed_manifest(ctl, located)
        if read is not None:
            read(manifest, located)
        return manifest, located

    found = restore_newest(ctl, tiers, load, step=step)
    return None if found is None else found[1]


def _saved_rank(ctl: Comm, manifest: Manifest, located: Located) -> SavedRank:
    """The tree and RNG this rank restores (those of saved rank `rank % saved_world`)."""
    found = saved_rank_of(ctl, manifest, located, ctl.rank % manifest.world_size)
    assert found is not None
    return found


def saved_rank_of(ctl: Comm, manifest: Manifest, located: Located, want: int | None) -> SavedRank | None:
    """Collective: saved rank `want`'s tree and RNG (None for None), from this rank's tiers or
    sent by a rank whose tiers hold them (schema 3 keeps them beside the saving rank's
    chunks; a rank on another node, or a new one, may see none)."""
    found: SavedRank | None = None
    error: BaseException | None = None
    here: CorruptVersionError | None = None  # none here, or damaged here: another rank may hold a good copy
    try:
        if want is not None:
            found = saved_rank(manifest, _live(located), want)
    except CorruptVersionError as e:
        here = e
        log.info("rank %d: the rank file of saved rank %s is not on this rank's tiers: %s", ctl.rank, want, e)
    except SourcesUnreachable as e:  # a rank that reaches them sends it; the reads leave them out too
        log.warning("rank %d: %s; asking the other ranks", ctl.rank, e)
        located.unreachable.update(e.locations)
    except Exception as e:  # noqa: BLE001 - every rank learns it in agree()
        error = e
    ctl.agree(error)
    if not ctl.any(want is not None and found is None):  # the usual case: one all-reduce
        return found
    # The rank files some ranks lack (a node replaced with empty disks, a world-size change or
    # a new order of the nodes with a root per node): each such rank asks one rank that reaches
    # its file, point to point (an all-to-all), never every rank. Not from a rank with a copy
    # out of its reach: its other copy may be the bad one.
    lost = _lost(located)
    reach = frozenset().union(*(s.writers for s in _live(located))) - lost
    # A file found damaged here is offered to no one: another holder's copy may be good.
    offered = reach - {want} if here is not None and want is not None else reach
    index = Holders.gather(ctl, offered, lost)
    holders: list[int] = []
    if want is not None and found is None:
        # Not itself: it reaches the file only where its copy is damaged.
        holders = [r for r in index.of(want) if r != ctl.rank]
        at = want % len(holders) if holders else 0  # the askers of one file ask the same holder, each file another
        # The last try is the lowest holder, as before the all-to-all: rank 0 where it holds
        # the file, which listed the store, so reaches it. The rotation alone tried ranks of
        # one node (consecutive ranks), which a broken network path cuts off together.
        rotated = holders[at:] + holders[:at]
        picks = rotated[: _RANK_FILE_HOLDERS - 1]
        holders = picks + (
            [holders[0]] if holders and holders[0] not in picks else rotated[len(picks) : _RANK_FILE_HOLDERS]
        )
    what = f"the rank file of saved rank {want} of step {located.step}"
    if want is not None and found is None and not holders:
        if index.lost_by_any(want):  # not damage: a copy no rank reaches now
            error = TierUnavailableError(errno.EHOSTUNREACH, f"{what}: no rank reaches a copy")
        else:
            error = here if here is not None and want in reach else CorruptVersionError(f"no rank holds {what}")
    # A holder that finds it cannot reach its copy (a store rank 0 listed for it) hands over
    # to the next; a few at most, each costs a retry budget.
    tried: list[str] = []
    for turn in range(_RANK_FILE_HOLDERS):
        ask = holders[turn] if turn < len(holders) and found is None and error is None else None
        asked = ctl.all_to_all([want if r == ask else None for r in range(ctl.world)])
        served: dict[int, tuple[_Outcome, bytes | str]] = {}
        answers: list[tuple[_Outcome, bytes | str] | None] = [None] * ctl.world
        for asker, w in enumerate(asked):
            if w is None:
                continue
            if w not in served:
                served[w] = _serve(ctl, located, manifest, w)
            answers[asker] = served[w]
        replies = ctl.all_to_all(answers)  # every rank, asking or not
        if ask is not None and want is not None:
            kind, body = replies[ask] or ("failed", f"rank {ask} did not answer")
            if kind == "ok" and isinstance(body, bytes):
                try:  # the holder verified it against the manifest
                    got = parse_rank_file(body, manifest, want)
                    found = SavedRank(got.tree, got.rng)
                except Exception as e:  # noqa: BLE001 - every rank still joins the collectives below
                    error = e
            elif kind == "unreachable":
                tried.append(str(body))
            elif kind == "damaged":  # damage falls back (on every rank: agree), the rest does not
                error = CorruptVersionError(str(body))
            else:
                error = RankFailures({ask: str(body)})
        if not ctl.any(found is None and error is None and want is not None and turn + 1 < len(holders)):
            break
    if want is not None and found is None and error is None:
        error = TierUnavailableError(errno.EHOSTUNREACH, f"{what}: no rank tried reaches a copy ({'; '.join(tried)})")
    ctl.agree(error)
    return found


def _serve(ctl: Comm, located: Located, manifest: Manifest, w: int) -> tuple[_Outcome, bytes | str]:
    """This rank's read of saved rank `w`'s file for a rank that asked it: the verified bytes,
    or what went wrong, as the asking rank learns it."""
    try:
        return "ok", rank_file_bytes_from(_live(located), manifest, w)
    except SourcesUnreachable as e:
        located.unreachable.update(e.locations)
        return "unreachable", f"rank {ctl.rank}: {describe_error(e)}"
    except Exception as e:  # noqa: BLE001 - the asking rank must still get an answer
        if isinstance(e, CorruptVersionError) and w in _lost(located):
            # A copy is on a source this rank found out of its reach since it offered the
            # file (serving another ask, this turn or an earlier one): no proof of damage,
            # as first_good says where one copy could not be reached; the asker tries the next.
            return "unreachable", f"rank {ctl.rank}: {describe_error(e)} (a copy is out of its reach)"
        return ("damaged" if isinstance(e, CorruptVersionError) else "failed"), f"rank {ctl.rank}: {describe_error(e)}"


def _live(located: Located) -> list[Source]:
    """The sources of `located` this rank has not found out of its reach."""
    return [s for s in located.sources if s.name not in located.unreachable]


def _lost(located: Located) -> frozenset[int]:
    """Saved ranks with a copy on a source this rank could not reach."""
    return frozenset().union(*(s.writers for s in located.sources if s.name in located.unreachable))


def read_agreed(
    ctl: Comm, config: CheckpointerConfig, located: Located, manifest: Manifest, requests: list[ReadRequest]
) -> None:
    """Collective: read every rank's requests (restore.execute); a failure anywhere raises on
    every rank alike.

    Where the only failures are reads from sources the failing ranks could not reach (a
    rank cut off from the store rank 0 listed for it: it never contacted it before), those
    reads run once more without them, so ranks that reach them send the chunks over the
    group; a chunk no rank reaches is then TierUnavailableError, never damage."""

    received: tuple[int, ...] = ()

    def read(
        mine: list[ReadRequest],
        damaged: dict[ChunkKey, CorruptVersionError] | None = None,
        sharing: frozenset[int] = frozenset(),
    ) -> BaseException | None:
        nonlocal received
        try:
            received = load_arrays(
                ctl,
                located.sources,
                manifest,
                mine,
                verify=config.verify_on_restore,
                threads=config.reader_threads,
                cores=rank_cores(),
                unreachable=located.unreachable,
                damaged=damaged,
                sharing=sharing,
                report_damage=damaged is None,  # on the first read: the second's damage stands
                avoid_lost=damaged is not None,  # on the second: the copies here failed it
            )
        except Exception as e:  # noqa: BLE001 - every rank learns it in agree()
            return e
        return None

    error = read(requests)
    failed = ctl.any(error is not None)  # the usual case: this one all-reduce
    if failed and not ctl.any(error is not None and not isinstance(error, ReadsUnreached)):
        # Again: this rank's unreached reads (its damaged chunks from ranks with other
        # copies), and what other ranks sent (a sender that could not read a chunk sent
        # zeros in its place).
        damaged: dict[ChunkKey, CorruptVersionError] = {}
        if isinstance(error, ReadsUnreached):
            again, damaged = error.requests, dict(error.damaged)
            log.warning("rank %d: %s; reading %d tensors from ranks that reach them", ctl.rank, error, len(again))
        else:
            again = received
        sharing = _sharing_copies(ctl, located) if ctl.any(bool(damaged)) else frozenset()
        error = read([requests[i] for i in again], damaged, sharing)
        failed = ctl.any(error is not None)
    elif isinstance(error, ReadsUnreached) and error.damaged:  # no second read: the damage stands
        error = error.damaged[0][1]
    if failed:
        ctl.agree(error)


def _sharing_copies(ctl: Comm, located: Located) -> frozenset[int]:
    """Collective: the ranks whose sources are this rank's own copies (the ranks of its node
    that share its root): where a chunk is damaged on them, it is damaged for all of them."""
    mine = _copies(located)
    return frozenset(r for r, theirs in enumerate(ctl.all_gather(mine)) if theirs == mine)


def _copies(located: Located) -> tuple[tuple[str, int, int] | str, ...]:
    """The physical copies behind this rank's sources: a local version directory by machine
    and inode (the same path names other disks on other machines), a store by its location."""
    out: list[tuple[str, int, int] | str] = []
    for s in located.sources:
        path = s.tier.local_path(version_dirname(s.step))
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            st = None
        out.append((socket.gethostname(), st.st_dev, st.st_ino) if st is not None else s.name)
    return tuple(out)


def _shares_elements(data: Any) -> bool:
    """Whether writing `data` element by element would write some memory twice: a dimension
    of more than one element with stride 0 (torch's expand, NumPy's as_strided)."""
    strides = data.strides if isinstance(data, np.ndarray) else data.stride()
    return any(n > 1 and not st for n, st in zip(data.shape, strides))


def load_version(
    ctl: Comm,
    config: CheckpointerConfig,
    located: Located,
    state: Mapping[str, Any],
    *,
    strict: bool = True,
    written: set[str] | None = None,
) -> None:
    """Fill `state` in place from the located version (collective); `strict`: see ckpt._tree.bind.

    `written`: the state's top-level keys earlier attempts of this restore may have filled
    before they failed (added to here once reading begins). A version that does not hold
    them all is refused (CorruptVersionError): loading it would leave those keys holding
    a mix of the failed version's bytes and the state's own."""
    with no_cyclic_gc(promote=True):  # thousands of manifest objects: see ckpt/_gc.py
        manifest = agreed_manifest(ctl, located)
        saved_world = manifest.world_size
        mine = _saved_rank(ctl, manifest, located)
        bound = None
        requests: list[ReadRequest] = []
        error: BaseException | None = None
        held = manifest.keys
        touched = {str(k) for k in state if held is None or str(k) in held}
        try:
            lacking = sorted((written or set()) - touched)
            if lacking:
                raise CorruptVersionError(
                    f"step {located.step} does not hold {lacking}, which a newer version that failed part-way "
                    "may have filled; the state is partly overwritten"
                )
            if config.capture_rng and ctl.rank < saved_world and mine.rng is not None:
                check_rng(mine.rng)  # before anything is read into the state
            bound = bind(mine.tree, state, strict=strict)
            for leaf in bound.leaves:
                array = manifest.arrays.get(leaf.name)
                if array is None:
                    raise CorruptVersionError(f"{leaf.key}: the manifest has no array {leaf.name!r}")
                if leaf.value is None:
                    dest = full_tensor(array)
                    bound.results[leaf.name] = dest
                    requests.append(ReadRequest(array, dest, (0,) * len(array.shape)))
                    continue
                if isinstance(leaf.value, np.ndarray) and not leaf.value.flags.writeable:
                    raise StateMismatchError(f"{leaf.key}: the state's array is read-only (restore fills it in place)")
                piece = describe(leaf.value, leaf.key)
                if piece.mesh is not None and ctl.rank not in piece.mesh.ranks:  # as a save refuses it
                    raise StateMismatchError(f"{leaf.key}: rank {ctl.rank} is not in its DTensor's mesh")
                if isinstance(leaf.value, np.ndarray) and not leaf.value.ndim and array.shape == (1,):
                    piece = describe(leaf.value.reshape(1), leaf.key)  # saved as (1,) before 0-d arrays were kept 0-d
                if (piece.data_type, piece.global_shape) != (array.data_type, array.shape):
                    raise StateMismatchError(
                        f"{leaf.key}: the checkpoint holds {array.data_type}{list(array.shape)}, "
                        f"the state has {piece.data_type}{list(piece.global_shape)}"
                    )
                if _shares_elements(leaf.value if isinstance(leaf.value, np.ndarray) else piece.data):
                    raise StateMismatchError(
                        f"{leaf.key}: elements of the state's tensor share memory (an expanded view, stride 0): "
                        "restore cannot fill it in place; give it a tensor of its own (.clone())"
                    )
                bound.results[leaf.name] = piece.data if isinstance(leaf.value, np.ndarray) else leaf.value
                requests.append(ReadRequest(array, piece.data, piece.offsets))
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            error = e
        try:
            ctl.agree(error)
        except BaseException:
            if bound is not None:  # (bind undoes its own work where it fails)
                bound.undo()
            raise
        if written is not None:
            written |= touched  # from here on, a failure may leave these keys part-filled
        read_agreed(ctl, config, located, manifest, requests)
    assert bound is not None
    error = None
    try:
        bound.finish()  # load_state_dict of the state's objects, which may refuse what they get
    except Exception as e:  # noqa: BLE001 - every rank learns it in agree()
        error = (
            e if isinstance(e, CkptError) else StateMismatchError(f"loading into the state: {type(e).__name__}: {e}")
        )
    ctl.agree(error)
    if config.capture_rng and mine.rng is not None:  # (a version without RNG leaves every rank's as it is)
        if ctl.rank >= saved_world:  # a rank that did not exist: seeded, deterministically
            seed_new_rank(manifest.save_id, ctl.rank)
        else:
            restore_rng(mine.rng)
    how = "" if saved_world == ctl.world else f" (saved by {saved_world} ranks, resharded)"
    log.info("rank %d step %d: restored%s", ctl.rank, located.step, how)
    left = sorted(str(k) for k in state if held is not None and str(k) not in held)
    if left and ctl.rank == 0:  # (strict=False: the version chosen need not hold every key)
        kind = "a params-only version" if manifest.partial else "a version"
        log.warning("step %d is %s without %s: left as they were (strict=False)", located.step, kind, left)
