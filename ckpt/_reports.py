"""The GATHER phase of a commit: each rank's report reaches rank 0 through its root's leader.

A rank sends its `RankReport` to the leader of its root (the lowest rank writing there);
the leader packs its group's reports into one message for rank 0: a fixed 40-byte record
per rank (rank file size and xxh3, timings) and, once per group, what the group's ranks
share or rarely have (host, top-level keys, inline values, errors). Rank 0 so receives
O(ranks) bytes in O(roots) messages (about 0.7 MB at 16,384 ranks on 2,048 nodes), not
a pickled object per rank. Point-to-point on the commit thread's group: no collective.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ckpt._dist import Comm
from ckpt._job import RankReport, RankTimings

__all__ = ["gather_reports", "pack", "unpack"]

_TAG = (1 << 30) + 2  # above the sliver exchange's tags and the manifest's (1 << 30, + 1)
_RECORD = np.dtype(
    [
        ("size", "<u4"),
        ("xxh3", "<u8"),
        ("stage_s", "<f4"),
        ("staged_s", "<f4"),
        ("write_s", "<f4"),
        ("fsync_s", "<f4"),
        ("bytes", "<u8"),
        ("started", "<f4"),  # seconds after the group's first rank's start (`t0`)
    ]
)


def pack(reports: Sequence[RankReport]) -> bytes:
    """Reports of consecutive members of one group: a JSON head, then one record per report."""
    t0 = min(r.timings.started for r in reports)
    records = np.zeros(len(reports), dtype=_RECORD)
    for i, r in enumerate(reports):
        t = r.timings
        size, digest = r.rank_file
        records[i] = (
            size,
            int(digest or "0", 16),
            t.stage_s,
            t.staged_s,
            t.write_s,
            t.fsync_s,
            t.bytes,
            t.started - t0,
        )
    hosts = sorted({r.host for r in reports})
    head: dict[str, Any] = {
        "n": len(reports),
        "t0": t0,
        "hosts": hosts,
        "root": reports[0].root,
        "keys": sorted({k for r in reports for k in r.keys}),
        "inline": {k: list(v) for r in reports for k, v in r.inline.items()},
    }
    if len(hosts) > 1:
        head["host_of"] = [hosts.index(r.host) for r in reports]
    errors = {i: r.error for i, r in enumerate(reports) if r.error}
    if errors:
        head["errors"] = errors
    text = json.dumps(head, separators=(",", ":")).encode()
    return len(text).to_bytes(4, "little") + text + records.tobytes()


def unpack(data: bytes, root_index: int) -> list[RankReport]:
    """The reports `pack` packed; the group's keys and inline values go with its first report."""
    n = int.from_bytes(data[:4], "little")
    head = json.loads(data[4 : 4 + n])
    records = np.frombuffer(data[4 + n :], dtype=_RECORD)
    if len(records) != head["n"]:
        raise ValueError(f"a group's reports hold {len(records)} records, not {head['n']}")
    errors = {int(k): v for k, v in head.get("errors", {}).items()}
    host_of = head.get("host_of", [0] * len(records))
    out = []
    for i, rec in enumerate(records):
        first = i == 0
        out.append(
            RankReport(
                error=errors.get(i),
                rank_file=(int(rec["size"]), f"{int(rec['xxh3']):016x}"),
                inline={k: (v[0], v[1]) for k, v in head["inline"].items()} if first else {},
                keys=tuple(head["keys"]) if first else (),
                host=head["hosts"][host_of[i]],
                root=head["root"],
                root_index=root_index,
                timings=RankTimings(
                    float(rec["stage_s"]),
                    float(rec["staged_s"]),
                    float(rec["write_s"]),
                    float(rec["fsync_s"]),
                    int(rec["bytes"]),
                    head["t0"] + float(rec["started"]),
                ),
            )
        )
    return out


def gather_reports(
    comm: Comm, report: RankReport, groups: Sequence[Sequence[int]], group_index: int
) -> list[RankReport] | None:
    """Every rank's report, in rank order, on rank 0 (None elsewhere). `groups` are the
    roots' ranks, each led by its first (rank 0 leads its own)."""
    group = groups[group_index]
    leader = group[0]
    if comm.rank != leader:
        comm.send_bytes(pack([report]), [leader], _TAG)
        return None
    mine = [report] + [unpack(comm.recv_bytes(r, _TAG), group_index)[0] for r in group[1:]]
    if comm.rank != 0:
        comm.send_bytes(pack(mine), [0], _TAG)
        return None
    by_rank: dict[int, RankReport] = dict(zip(group, mine))
    for i, g in enumerate(groups):
        if g[0] != 0:
            by_rank.update(zip(g, unpack(comm.recv_bytes(g[0], _TAG), i)))
    return [by_rank[r] for r in range(comm.world)]
