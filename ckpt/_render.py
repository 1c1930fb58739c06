"""Text the CLI prints: sizes, the `ckpt ls` table, and `ckpt inspect`'s report.

Plain text, no colours or boxes. `ls` fits 80 columns: every cell has a bounded width,
and long explanations go below the table, wrapped. `inspect` never cuts a tensor name (a
pipe into grep must find it): one line per tensor, as wide as the longest name; in a
terminal too narrow for that, the other columns go on a line of their own below the name.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence
from typing import Any

from ckpt._listing import STATUS_HELP, Row
from ckpt.store.manifest import ArrayEntry, Manifest

__all__ = ["human", "duration", "table", "ls_lines", "inspect_lines", "inspect_rows", "sharding"]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def duration(seconds: float) -> str:
    """`45s`, `12m`, `5h`, `3d`: at most 5 characters below 1000 days."""
    for unit, size, limit in (("s", 1, 120), ("m", 60, 120 * 60), ("h", 3600, 48 * 3600)):
        if seconds < limit:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds / 86400:.0f}d"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """Aligned columns two spaces apart, a rule under the header, no trailing spaces; a
    cell is never cut."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, max(width, 20), subsequent_indent="  ", break_on_hyphens=False) or [""]


def _copies(r: Row) -> str:
    """Verified copies over the copies made: the replicator's and the peer copies ("-": none made)."""
    if r.copies is None and r.peers is None:
        return "-"
    states = [c.state for c in (r.copies or {}).values()] + list((r.peers or {}).values())
    return f"{sum(s == 'verified' for s in states)}/{len(states)}"


def _remote(r: Row) -> str:
    """The upload's state and the time from the commit to it (or to now, if not done)."""
    if r.remote is None:
        return "-"
    state = {"waiting for other nodes": "waiting"}.get(r.remote.state, r.remote.state)
    return state + (f" {duration(r.lag_s)}" if r.lag_s is not None else "")


def ls_lines(location: str, rows: list[Row], width: int = 80, held: dict[str, list[int]] | None = None) -> list[str]:
    """The table of versions, then a line per row that needs explaining, each wrapped at
    `width`. The cells are at most 12, 11, 10, 5, 10, 5 and 12 characters wide: with their
    gaps, a row is under 80 columns."""
    out = _wrap(f"versions in {location}", width)
    cells = []
    for r in rows:
        when = time.strftime("%m-%d %H:%M", time.localtime(r.time)) if r.time is not None else "-"
        size = human(r.bytes) if r.bytes is not None else "-"
        world = str(r.world_size) if r.world_size is not None else "-"
        status = r.status + ("*" if r.milestone else "") + ("~" if r.keys is not None else "")
        cells.append([str(r.step), when, size, world, status, _copies(r), _remote(r)])
    out += table(("step", "committed", "size", "ranks", "status", "copies", "remote"), cells, right=(0, 2, 3))
    notes = []
    if any(r.milestone for r in rows):
        notes.append("*: a milestone (milestone retention keeps it)")
    for keys in sorted({r.keys for r in rows if r.keys is not None}):
        steps = ", ".join(str(r.step) for r in rows if r.keys == keys)
        notes.append(f"~: step {steps} holds only {', '.join(keys)} (a params-only version; the others hold all keys)")
    notes += [f"{status}: {STATUS_HELP[status]}" for status in sorted({r.status for r in rows} & set(STATUS_HELP))]
    notes += [f"step {r.step}: {r.detail}" for r in rows if r.detail and r.status in ("damaged", "unreadable")]
    if any(r.peers for r in rows):
        notes.append("copies: the replicator's copies and the peer copies on other nodes, verified / made")
    for source, copied in sorted((held or {}).items()):
        listed = ", ".join(map(str, copied)) or "none"
        notes.append(f"peer copies held here for the root with id {source} (its .ckpt-root-id): steps {listed}")
    for note in notes:
        out += _wrap(note, width)
    return out


def sharding(array: ArrayEntry, world: int) -> str:
    """A short description of how the saving ranks held a tensor (its manifest's summary)."""
    summary = array.sharding
    pieces, replicas = int(summary.get("pieces", 0) or 0), int(summary.get("replicas", 0) or 0)
    if pieces <= 1:
        return "replicated" + (f" on {replicas} ranks" if replicas != world else "")
    dims = ",".join(map(str, summary.get("dims", [])))
    kind = "uneven " if summary.get("uneven") else ""
    extra = f", {replicas} replicas each" if replicas > 1 else ""
    return f"{kind}sharded on dim {dims} in {pieces} pieces{extra}"


def inspect_rows(manifest: Manifest) -> list[dict[str, Any]]:
    return [
        {
            "name": a.name,
            "dtype": a.data_type,
            "shape": list(a.shape),
            "chunk_shape": list(a.chunk_shape),
            "chunks": a.chunk_count,
            "bytes": a.nbytes,
            "sharding": sharding(a, manifest.world_size),
        }
        for a in manifest.arrays.values()
    ]


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] as `0-2, 5`."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def inspect_lines(manifest: Manifest, ranks: list[dict[str, Any]], width: int | None = None) -> list[str]:
    """The version's provenance, then its tensors: one line each, whatever the names'
    length. `width`: the terminal's, when the output is one (None: a pipe or a file, never
    wrapped); a table wider than that puts each tensor's other columns on a line below it."""
    rows = inspect_rows(manifest)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created))
    roots = len(manifest.roots)
    out = [
        f"step {manifest.step}, saved {when}",
        f"{len(rows)} tensors, {human(manifest.total_bytes)}; world size {manifest.world_size}, "
        f"{roots} root{'s' if roots != 1 else ''}",
    ]
    if manifest.keys is not None:
        out.append(f"  keys: {', '.join(manifest.keys)}")
    for key in ("ckpt_version", "torch_version", "python", "cuda"):
        if manifest.meta.get(key):
            out.append(f"  {key}: {manifest.meta[key]}")
    git = manifest.meta.get("git")
    if isinstance(git, dict):
        dirty = " (dirty)" if git.get("dirty") else ""
        out.append(f"  training code: {git.get('path')} @ {git.get('commit')}{dirty}")
    hosts: dict[tuple[str, str, str], list[int]] = {}
    for rank, p in enumerate(ranks):  # the saving ranks' provenance (the first ones, at scale)
        if p:
            where = (str(p.get("host")), str(p.get("cpu")), ", ".join(p.get("gpus") or []) or "no GPU")
            hosts.setdefault(where, []).append(rank)
    for (host, cpu, gpus), members in hosts.items():
        out.append(f"  ranks [{_ranges(members)}]: {host}, {cpu}, {gpus}")
    if len(ranks) < manifest.world_size:
        out.append(f"  ranks [{len(ranks)}-{manifest.world_size - 1}]: see ranks/<rank>.json of each root")
    out.append("")
    headers = ("tensor", "dtype", "shape", "chunks", "size", "sharding")
    cells = [[r["name"], r["dtype"], str(r["shape"]), str(r["chunks"]), human(r["bytes"]), r["sharding"]] for r in rows]
    lines = table(headers, cells, right=(3, 4))
    if width is None or max(map(len, lines)) <= width:
        return out + lines
    details = table(headers[1:], [c[1:] for c in cells], right=(2, 3))
    out += ["tensor", "    " + details[0], "    " + details[1]]
    for name, detail in zip((c[0] for c in cells), details[2:]):
        out += [name, "    " + detail]
    return out
