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
from rich.table import Table

from restore.tiers import LocalTier
from store import commit
from store.chunk_read import verify_chunks
from store.errors import CkptError

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
    """Inspect and verify ckpt checkpoint roots."""


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


if __name__ == "__main__":
    main()
