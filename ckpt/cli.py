"""The `ckpt` command line: thin click commands over store/restore.

Exit codes: 0 success, 1 verification found bad chunks, 2 usage error (click),
3 any other ckpt error (one readable line on stderr).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from restore.export import assemble, copy_version, open_version
from restore.tiers import LocalTier, Tier
from store import commit
from store.chunk_read import verify_chunks
from store.errors import CkptError, CorruptVersionError

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])
EXIT_BAD_CHUNKS = 1
EXIT_CKPT_ERROR = 3


def _errors_to_exit(fn: F) -> F:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CkptError as e:
            click.echo(f"ckpt: error: {e}", err=True)
            sys.exit(EXIT_CKPT_ERROR)

    return wrapper  # type: ignore[return-value]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _version_rows(root: str) -> list[dict[str, Any]]:
    if not os.path.isdir(root):
        raise CkptError(f"{root} is not a directory")
    rows = []
    for step in commit.committed_steps(root):
        try:
            m = commit.read_manifest(root, step)
        except CkptError as e:
            rows.append({"step": step, "status": f"unreadable: {e}"})
            continue
        info = commit.read_root_info(os.path.join(root, commit.version_dirname(step)))
        writers = info.get("writers", [])
        local = all(w in writers for w in range(m.world_size)) if isinstance(writers, list) else False
        rows.append(
            {
                "step": step,
                "time": m.created,
                "bytes": m.total_bytes,
                "world_size": m.world_size,
                "arrays": len(m.arrays),
                "status": "committed" if local else "committed (part: other ranks' chunks on other roots)",
                "writers_here": writers,
                "timings": m.meta.get("timings", []),
            }
        )
    for p in commit.prepared_versions(root):
        rows.append({"step": p.step, "status": "incomplete (not committed)", "dir": p.dirname})
    return sorted(rows, key=lambda r: r["step"])


@click.group()
@click.version_option(package_name="ckpt")
def main() -> None:
    """Inspect, verify and restore ckpt checkpoint roots."""


def _tiers(root: str, extra: tuple[str, ...]) -> list[Tier]:
    for path in (root, *extra):
        if not os.path.isdir(path):
            raise CkptError(f"{path} is not a directory")
    return [LocalTier(root), *(LocalTier(p) for p in extra)]


def _progress(description: str, total: int) -> Progress:
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    bar.add_task(description, total=total)
    return bar


_TIER_OPTION = click.option(
    "--tier", "tiers", multiple=True, type=click.Path(file_okay=False), help="Another root or copy to read from."
)


@main.command("ls")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_errors_to_exit
def ls_cmd(root: str, as_json: bool) -> None:
    """List the versions under ROOT: step, time, size, world size, status."""
    rows = _version_rows(root)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"ckpt versions in {root}")
    for col in ("step", "time", "size", "world", "status"):
        table.add_column(col, justify="right" if col in ("step", "size", "world") else "left")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if "time" in r else "-"
        size = _human(r["bytes"]) if "bytes" in r else "-"
        table.add_row(str(r["step"]), when, size, str(r.get("world_size", "-")), r["status"])
    Console().print(table)


@main.command("verify")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--step", type=int, default=None, help="Verify only this step (default: every committed step).")
@_errors_to_exit
def verify_cmd(root: str, step: int | None) -> None:
    """Recompute every chunk's xxh3; exit 1 naming each bad chunk."""
    tier = LocalTier(root)
    if not os.path.isdir(root):
        raise CkptError(f"{root} is not a directory")
    steps = [step] if step is not None else commit.committed_steps(root)
    if not steps:
        raise CkptError(f"no committed versions in {root}")
    bad = 0
    for s in steps:
        version_dir = tier.version_dir(s)
        try:
            manifest = tier.manifest(s)
        except CkptError as e:
            click.echo(f"step {s}: BAD manifest: {e}")
            bad += 1
            continue
        info = commit.read_root_info(version_dir)
        writers = info.get("writers")
        held = set(writers) if isinstance(writers, list) else None
        problems = list(verify_chunks(version_dir, manifest, held))
        for p in problems:
            click.echo(f"step {s}: BAD {p.path}: {p.reason}")
        bad += len(problems)
        n = sum(1 for a in manifest.arrays.values() for c in a.chunks if held is None or c.writer in held)
        if not problems:
            click.echo(f"step {s}: ok ({n} chunks, {_human(manifest.total_bytes)})")
    if bad:
        click.echo(f"{bad} bad chunk(s)", err=True)
        sys.exit(EXIT_BAD_CHUNKS)


@main.command("restore")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--step", type=int, default=None, help="The step (default: the newest intact one).")
@click.option("--to", "to_dir", type=click.Path(file_okay=False), help="Copy the verified version into this root.")
@click.option("--to-torch", "to_torch", type=click.Path(dir_okay=False), help="Write one torch.save state dict.")
@_TIER_OPTION
@_errors_to_exit
def restore_cmd(root: str, step: int | None, to_dir: str | None, to_torch: str | None, tiers: tuple[str, ...]) -> None:
    """Copy a verified version out of ROOT (and --tier copies), or assemble it into one file."""
    if (to_dir is None) == (to_torch is None):
        raise click.UsageError("give exactly one of --to DIR or --to-torch FILE")
    sources_tiers = _tiers(root, tiers)
    excluded: set[int] = set()
    while True:
        chosen, manifest, sources = open_version(sources_tiers, step, frozenset(excluded))
        total = manifest.total_bytes if to_dir else sum(a.nbytes for a in manifest.arrays.values())
        try:
            with _progress(f"step {chosen}", total) as bar:
                task = bar.task_ids[0]

                def advance(n: int, bar: Progress = bar, task: Any = task) -> None:
                    bar.advance(task, n)

                if to_dir is not None:
                    where = copy_version(manifest, sources, to_dir, advance)
                else:
                    import torch

                    state = assemble(manifest, sources, advance)
                    tmp = f"{to_torch}.tmp-{os.getpid()}"
                    torch.save(state, tmp)
                    os.replace(tmp, str(to_torch))
                    where = str(to_torch)
        except CkptError as e:
            if step is not None or not isinstance(e, CorruptVersionError):
                raise
            click.echo(f"step {chosen} is not intact ({e}); trying an older version", err=True)
            excluded.add(chosen)
            continue
        click.echo(f"restored step {chosen} ({_human(total)}) to {where}")
        return


@main.command("inspect")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--step", type=int, default=None, help="The step (default: the newest).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@_TIER_OPTION
@_errors_to_exit
def inspect_cmd(root: str, step: int | None, as_json: bool, tiers: tuple[str, ...]) -> None:
    """List a version's tensors with their dtypes, shapes and sharding."""
    chosen, manifest, _ = open_version(_tiers(root, tiers), step)
    rows: list[dict[str, Any]] = [
        {
            "name": a.name,
            "dtype": a.data_type,
            "shape": list(a.shape),
            "chunk_shape": list(a.chunk_shape),
            "chunks": len(a.chunks),
            "bytes": a.nbytes,
            "sharding": _sharding(a.regions, manifest.world_size),
        }
        for a in manifest.arrays.values()
    ]
    if as_json:
        click.echo(
            json.dumps({"step": chosen, "world_size": manifest.world_size, "meta": manifest.meta, "arrays": rows})
        )
        return
    console = Console()
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created))
    console.print(
        f"step {chosen}  saved {when}  world size {manifest.world_size}  roots {len(manifest.roots)}  "
        f"{len(rows)} tensors, {_human(manifest.total_bytes)}"
    )
    for key in ("ckpt_version", "torch_version", "python"):
        if key in manifest.meta:
            console.print(f"  {key}: {manifest.meta[key]}")
    table = Table()
    for col in ("tensor", "dtype", "shape", "chunks", "size", "sharding"):
        table.add_column(col, justify="right" if col in ("chunks", "size") else "left")
    for r in rows:
        table.add_row(r["name"], r["dtype"], str(r["shape"]), str(r["chunks"]), _human(r["bytes"]), r["sharding"])
    console.print(table)


def _sharding(regions: tuple[dict[str, Any], ...], world: int) -> str:
    """A short description of how the saving ranks held a tensor."""
    if len(regions) <= 1:
        holders = len(regions[0]["ranks"]) if regions else 0
        return "replicated" + (f" on {holders} ranks" if holders != world else "")
    dims = sorted({d for r in regions for d, o in enumerate(r["offsets"]) if o})
    sizes = {tuple(r["shape"]) for r in regions}
    kind = "uneven " if len(sizes) > 1 else ""
    replicas = max(len(r["ranks"]) for r in regions)
    extra = f", {replicas} replicas each" if replicas > 1 else ""
    return f"{kind}sharded on dim {','.join(map(str, dims))} in {len(regions)} pieces{extra}"


if __name__ == "__main__":
    main()
