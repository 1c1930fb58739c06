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

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckpt._cores import rank_cores
from ckpt._dist import Comm, describe_error
from ckpt._gc import no_cyclic_gc
from ckpt._tensors import describe
from ckpt._tree import bind
from ckpt.config import CheckpointerConfig
from ckpt.restore.execute import ReadRequest, full_tensor, load_arrays
from ckpt.restore.locate import Located, first_manifest
from ckpt.restore.saved_ranks import SavedRank, saved_rank
from ckpt.restore.sources import rank_file_bytes_from
from ckpt.rng import restore_rng, seed_new_rank
from ckpt.store.errors import CorruptVersionError, RankFailures, StateMismatchError
from ckpt.store.manifest import Manifest, parse_manifest
from ckpt.store.rank_file import parse_rank_file

__all__ = ["load_version", "agreed_manifest", "read_agreed", "saved_rank_of"]

log = logging.getLogger("ckpt")


def agreed_manifest(ctl: Comm, located: Located) -> Manifest:
    """The manifest on every rank: from this rank's copies, or broadcast from one that has it.
    A copy on a shared tier (the remote) is read by rank 0 alone, unless no rank has another."""
    found: Manifest | None = None
    for shared in (ctl.rank == 0, True):
        error: BaseException | None = None
        try:
            found = first_manifest(located, shared)
        except Exception as e:  # noqa: BLE001 - every rank learns it in agree()
            error = e
        ctl.agree(error)
        # One all-reduce: whether any rank lacks a copy, and the lowest rank that has one.
        lacking, lowest = ctl.reduce_max([int(found is None), 0 if found is None else ctl.world - ctl.rank])
        if lowest or not lacking:
            break
    if lacking:  # ranks without a copy get it from one that has it
        if not lowest:
            raise CorruptVersionError(f"no rank holds a manifest of step {located.step}")
        src = ctl.world - lowest
        raw = ctl.broadcast(found.to_json() if found is not None and ctl.rank == src else None, src=src)
        if found is None:
            found = parse_manifest(raw)
    assert found is not None
    return found


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
    try:
        if want is not None:
            found = saved_rank(manifest, located.sources, want)
    except CorruptVersionError as e:  # none here, or damaged here: another rank may hold a good copy
        log.info("rank %d: the rank file of saved rank %s is not on this rank's tiers: %s", ctl.rank, want, e)
    except Exception as e:  # noqa: BLE001 - every rank learns it in agree()
        error = e
    ctl.agree(error)
    if not ctl.any(want is not None and found is None):  # the usual case: one all-reduce
        return found
    wanted = sorted({w for w in ctl.all_gather(None if found is not None else want) if w is not None})
    servable = [w for w in wanted if any(w in s.writers for s in located.sources)]
    offers = ctl.all_gather(servable)
    for w in wanted:
        holder = next((r for r, offer in enumerate(offers) if w in offer), None)
        if holder is None:
            raise CorruptVersionError(f"no rank holds the rank file of saved rank {w} of step {located.step}")
        sent: tuple[bool, bytes | str] | None = None
        if ctl.rank == holder:
            try:
                sent = (True, rank_file_bytes_from(located.sources, manifest, w))
            except Exception as e:  # noqa: BLE001 - every rank must still join the broadcast
                sent = (isinstance(e, CorruptVersionError), f"rank {holder}: {describe_error(e)}")
        ok, body = ctl.broadcast(sent, src=holder)
        if isinstance(body, str):  # every rank raises alike: damage falls back, the rest does not
            raise (CorruptVersionError(body) if ok else RankFailures({holder: body}))
        if w == want and found is None:  # the holder verified it against the manifest
            got = parse_rank_file(body, manifest, w)
            found = SavedRank(got.tree, got.rng)
    return found


def read_agreed(
    ctl: Comm, config: CheckpointerConfig, located: Located, manifest: Manifest, requests: list[ReadRequest]
) -> None:
    """Collective: read every rank's requests (restore.execute); a failure anywhere raises on
    every rank alike."""
    error: BaseException | None = None
    try:
        load_arrays(
            ctl,
            located.sources,
            manifest,
            requests,
            verify=config.verify_on_restore,
            threads=config.reader_threads,
            cores=rank_cores(),
        )
    except Exception as e:  # noqa: BLE001 - every rank learns it in agree()
        error = e
    ctl.agree(error)


def load_version(
    ctl: Comm, config: CheckpointerConfig, located: Located, state: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Fill `state` in place from the located version (collective); `strict`: see ckpt._tree.bind."""
    with no_cyclic_gc(promote=True):  # thousands of manifest objects: see ckpt/_gc.py
        manifest = agreed_manifest(ctl, located)
        saved_world = manifest.world_size
        mine = _saved_rank(ctl, manifest, located)
        bound = None
        requests: list[ReadRequest] = []
        error: BaseException | None = None
        try:
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
                piece = describe(leaf.value, leaf.key)
                if (piece.data_type, piece.global_shape) != (array.data_type, array.shape):
                    raise StateMismatchError(
                        f"{leaf.key}: the checkpoint holds {array.data_type}{list(array.shape)}, "
                        f"the state has {piece.data_type}{list(piece.global_shape)}"
                    )
                bound.results[leaf.name] = piece.data if isinstance(leaf.value, np.ndarray) else leaf.value
                requests.append(ReadRequest(array, piece.data, piece.offsets))
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            error = e
        ctl.agree(error)
        read_agreed(ctl, config, located, manifest, requests)
    assert bound is not None
    bound.finish()
    if config.capture_rng:
        if ctl.rank < saved_world and mine.rng is not None:
            restore_rng(mine.rng)
        else:
            seed_new_rank(manifest.save_id, ctl.rank)
    how = "" if saved_world == ctl.world else f" (saved by {saved_world} ranks, resharded)"
    log.info("rank %d step %d: restored%s", ctl.rank, located.step, how)
