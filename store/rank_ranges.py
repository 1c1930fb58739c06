"""Sets of ranks as sorted, disjoint, half-open ranges: what a tier holds of a version's
writers travels between ranks in this form, so its size follows the tier's layout (one
range for a remote that holds every rank, one for a node's disk), not the world size.

At 16,384 ranks the restore's listing exchange sends each rank's candidates to every
rank: with writers as tuples of ranks, a listing of a node's tiers and a remote of five
versions was 240 KB a rank, 3.7 GiB received by each; as ranges, 1 KB and 16 MiB
(bench/scale.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

__all__ = ["RankRanges", "ranges_of", "union", "missing", "expand", "contains"]

RankRanges = tuple[tuple[int, int], ...]
"""Sorted, disjoint, non-adjacent [lo, hi) ranges of ranks."""


def ranges_of(ranks: Iterable[int]) -> RankRanges:
    """The ranges of a collection of ranks (duplicates and order do not matter)."""
    out: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return tuple(out)


def union(sets: Iterable[RankRanges]) -> RankRanges:
    """The ranks in any of `sets`."""
    spans = sorted(span for ranges in sets for span in ranges)
    out: list[tuple[int, int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def missing(ranges: RankRanges, world: int) -> RankRanges:
    """The ranks of [0, world) that `ranges` lacks."""
    out: list[tuple[int, int]] = []
    pos = 0
    for lo, hi in ranges:
        if lo >= world:
            break
        if lo > pos:
            out.append((pos, lo))
        pos = max(pos, hi)
    if pos < world:
        out.append((pos, world))
    return tuple(out)


def expand(ranges: RankRanges) -> frozenset[int]:
    """Every rank of `ranges` (O(ranks): for one rank's own sources, never for every rank's)."""
    return frozenset(r for lo, hi in ranges for r in range(lo, hi))


def contains(ranges: RankRanges, rank: int) -> bool:
    """Whether `rank` is in `ranges` (a binary search)."""
    i = bisect.bisect_right(ranges, (rank, 1 << 62)) - 1
    return i >= 0 and ranges[i][0] <= rank < ranges[i][1]
