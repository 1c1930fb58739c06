"""Text the CLI prints: sizes, the `ckpt ls` table (readable at 80 columns: long
explanations go below the table, not into its cells), and `ckpt inspect`'s report."""

from __future__ import annotations

import time
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from ckpt._listing import STATUS_HELP, Row
from ckpt.store.manifest import ArrayEntry, Manifest

__all__ = ["human", "print_rows", "print_inspect", "sharding"]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _copies(r: Row) -> str:
    if r.copies is None:
        return "-"
    ok = sum(1 for c in r.copies.values() if c.state == "verified")
    return f"{ok}/{len(r.copies)}" if r.copies else "none"


def _remote(r: Row) -> str:
    if r.remote is None:
        return "-"
    state = {"waiting for other nodes": "waiting"}.get(r.remote.state, r.remote.state)
    return state + (f" {r.lag_s:.0f}s" if r.lag_s is not None else "")


def print_rows(location: str, rows: list[Row], console: Console) -> None:
    """The table of versions, then a line per row that needs explaining."""
    console.print(f"versions in {location}", overflow="fold")
    # No vertical rules: 7 columns of at most 12, 11, 10, 5, 10, 6 and 12 characters and
    # their gaps fit 80 columns, so no cell is cut or wrapped.
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), show_edge=False)
    for col in ("step", "committed", "size", "ranks", "status", "copies", "remote"):
        table.add_column(col, justify="right" if col in ("step", "size", "ranks") else "left", no_wrap=True)
    for r in rows:
        when = time.strftime("%m-%d %H:%M", time.localtime(r.time)) if r.time is not None else "-"
        size = human(r.bytes) if r.bytes is not None else "-"
        world = str(r.world_size) if r.world_size is not None else "-"
        status = r.status + ("*" if r.milestone else "")
        table.add_row(str(r.step), when, size, world, status, _copies(r), _remote(r))
    console.print(table)
    if any(r.milestone for r in rows):
        console.print("*: a milestone (milestone retention keeps it)")
    for status in sorted({r.status for r in rows} & set(STATUS_HELP)):
        console.print(f"{status}: {STATUS_HELP[status]}")
    for r in rows:
        if r.detail and r.status in ("damaged", "unreadable"):
            console.print(f"step {r.step}: {r.detail}")


def sharding(array: ArrayEntry, world: int) -> str:
    """A short description of how the saving ranks held a tensor."""
    regions = array.regions
    if len(regions) <= 1:
        holders = len(regions[0]["ranks"]) if regions else 0
        return "replicated" + (f" on {holders} ranks" if holders != world else "")
    dims = sorted({d for r in regions for d, o in enumerate(r["offsets"]) if o})
    sizes = {tuple(r["shape"]) for r in regions}
    kind = "uneven " if len(sizes) > 1 else ""
    replicas = max(len(r["ranks"]) for r in regions)
    extra = f", {replicas} replicas each" if replicas > 1 else ""
    return f"{kind}sharded on dim {','.join(map(str, dims))} in {len(regions)} pieces{extra}"


def inspect_rows(manifest: Manifest) -> list[dict[str, Any]]:
    return [
        {
            "name": a.name,
            "dtype": a.data_type,
            "shape": list(a.shape),
            "chunk_shape": list(a.chunk_shape),
            "chunks": len(a.chunks),
            "bytes": a.nbytes,
            "sharding": sharding(a, manifest.world_size),
        }
        for a in manifest.arrays.values()
    ]


def print_inspect(manifest: Manifest, console: Console) -> None:
    rows = inspect_rows(manifest)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created))
    console.print(
        f"step {manifest.step}  saved {when}  world size {manifest.world_size}  roots {len(manifest.roots)}  "
        f"{len(rows)} tensors, {human(manifest.total_bytes)}"
    )
    for key in ("ckpt_version", "torch_version", "python", "cuda"):
        if manifest.meta.get(key):
            console.print(f"  {key}: {manifest.meta[key]}")
    git = manifest.meta.get("git")
    if isinstance(git, dict):
        dirty = " (dirty)" if git.get("dirty") else ""
        console.print(f"  training code: {git.get('path')} @ {git.get('commit')}{dirty}")
    hosts: dict[tuple[str, str, str], list[int]] = {}
    for rank, p in enumerate(manifest.meta.get("ranks", [])):
        if isinstance(p, dict):
            where = (str(p.get("host")), str(p.get("cpu")), ", ".join(p.get("gpus") or []) or "no GPU")
            hosts.setdefault(where, []).append(rank)
    for (host, cpu, gpus), ranks in hosts.items():
        console.print(f"  ranks {ranks}: {host}, {cpu}, {gpus}")
    table = Table()
    for col in ("tensor", "dtype", "shape", "chunks", "size", "sharding"):
        table.add_column(col, justify="right" if col in ("chunks", "size") else "left")
    for r in rows:
        table.add_row(r["name"], r["dtype"], str(r["shape"]), str(r["chunks"]), human(r["bytes"]), r["sharding"])
    console.print(table)
