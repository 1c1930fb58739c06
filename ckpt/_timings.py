"""What a version records of its ranks' save timings: a summary per phase, O(1) in the ranks.

A manifest that kept every rank's timings grew by ~150 bytes a rank (2.4 MB at 16,384
ranks), and every root's leader receives the manifest on every save. Each phase keeps
its median, its maximum and the rank that took it (the straggler to look at); the
per-rank figures are in each rank's log line and `ck.stats()`. Versions written before
this summary keep a list per rank, which `summarize` reads alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PHASES", "summarize"]

PHASES = ("stage_s", "staged_s", "write_s", "fsync_s", "commit_s", "bytes")


def summarize(rows: Sequence[Any], created: float) -> dict[str, Any]:
    """Per phase {median, max, max_rank} over the ranks' timings (a rank's commit_s: from its
    save() to the manifest, less the phases measured before)."""
    out: dict[str, Any] = {"ranks": len(rows)}
    values: dict[str, list[tuple[float, int]]] = {p: [] for p in PHASES}
    for rank, t in enumerate(rows):
        if not isinstance(t, Mapping):
            continue
        row = {k: v for k, v in t.items() if isinstance(v, (int, float))}
        if "started" in row:
            copied = max(row.get("stage_s", 0), row.get("staged_s", 0))  # deferred staging: its copy ends later
            row["commit_s"] = max(0.0, created - row["started"] - copied - row.get("write_s", 0))
        for p in PHASES:
            if p in row:
                values[p].append((row[p], rank))
    for p, got in values.items():
        if got:
            top, who = max(got)
            out[p] = {"median": round(statistics.median(v for v, _ in got), 4), "max": round(top, 4), "max_rank": who}
    return out
