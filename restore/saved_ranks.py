"""What each saving rank left beside its tensors: its JSON state tree and RNG state, from
the manifest (schemas 1-2) or from its rank file on the first tier with a good copy (3)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt.restore.sources import Source, rank_file_from
from ckpt.store.manifest import Manifest

__all__ = ["SavedRank", "saved_rank", "saved_trees"]


@dataclass(frozen=True)
class SavedRank:
    tree: Any
    rng: dict[str, Any] | None


def saved_rank(manifest: Manifest, sources: Sequence[Source], rank: int) -> SavedRank:
    """Rank `rank`'s tree and RNG. CorruptVersionError if no source has a good copy (schema 3),
    TierUnavailableError if the ones that have it cannot be read."""
    if manifest.schema_version < 3:
        entry = manifest.ranks[rank]
        return SavedRank(manifest.trees[entry.tree], entry.rng)
    found = rank_file_from(sources, manifest, rank)
    return SavedRank(found.tree, found.rng)


def saved_trees(manifest: Manifest, sources: Sequence[Source]) -> Iterator[Any]:
    """Every rank's tree, rank 0's first (schemas 1-2: each distinct tree once)."""
    if manifest.schema_version < 3:
        yield manifest.trees[manifest.ranks[0].tree]
        yield from manifest.trees.values()
        return
    for rank in range(manifest.world_size):
        yield saved_rank(manifest, sources, rank).tree
