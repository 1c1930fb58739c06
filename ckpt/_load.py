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

from ckpt._dist import Comm
from ckpt._gc import no_cyclic_gc
from ckpt._tensors import describe
from ckpt._tree import bind
from ckpt.config import CheckpointerConfig
from ckpt.restore.execute import ReadRequest, full_tensor, load_arrays
from ckpt.restore.locate import Located, first_manifest
from ckpt.rng import restore_rng, seed_new_rank
from ckpt.store.errors import CorruptVersionError, StateMismatchError
from ckpt.store.manifest import Manifest, parse_manifest

__all__ = ["load_version"]

log = logging.getLogger("ckpt")


def _agreed_manifest(ctl: Comm, located: Located) -> Manifest:
    """The manifest on every rank: from this rank's copies, or broadcast from one that has it."""
    found: Manifest | None = None
    error: BaseException | None = None
    try:
        found = first_manifest(located)
    except Exception as e:  # noqa: BLE001 - every rank learns it in agree()
        error = e
    ctl.agree(error)
    haves = ctl.all_gather(found is not None)
    if not any(haves):
        raise CorruptVersionError(f"no rank holds a manifest of step {located.step}")
    if not all(haves):  # ranks without a copy get it from one that has it
        src = haves.index(True)
        raw = ctl.broadcast(found.to_json() if found is not None and ctl.rank == src else None, src=src)
        if found is None:
            found = parse_manifest(raw)
    assert found is not None
    return found


def load_version(
    ctl: Comm, config: CheckpointerConfig, located: Located, state: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Fill `state` in place from the located version (collective); `strict`: see ckpt._tree.bind."""
    with no_cyclic_gc():  # thousands of manifest objects: see ckpt/_gc.py
        manifest = _agreed_manifest(ctl, located)
        saved_world = manifest.world_size
        entry = manifest.ranks[ctl.rank % saved_world]
        bound = None
        requests: list[ReadRequest] = []
        error: BaseException | None = None
        try:
            bound = bind(manifest.trees[entry.tree], state, strict=strict)
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
        error = None
        try:
            load_arrays(
                ctl,
                located.sources,
                manifest,
                requests,
                verify=config.verify_on_restore,
                threads=config.reader_threads,
            )
        except Exception as e:  # noqa: BLE001 - every rank learns it in agree()
            error = e
        ctl.agree(error)
    assert bound is not None
    bound.finish()
    if config.capture_rng:
        if ctl.rank < saved_world and manifest.ranks[ctl.rank].rng is not None:
            restore_rng(manifest.ranks[ctl.rank].rng)  # type: ignore[arg-type]
        else:
            seed_new_rank(manifest.save_id, ctl.rank)
    how = "" if saved_world == ctl.world else f" (saved by {saved_world} ranks, resharded)"
    log.info("rank %d step %d: restored%s", ctl.rank, located.step, how)
