"""The `ckpt` command line: thin click commands over store/restore.

Exit codes: 0 success, 1 verification found bad chunks, 2 usage error (click),
3 any other ckpt error (one readable line on stderr).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from ckpt.replicator.core import REMOTE_DONE, ReplicatorConfig, read_status
from ckpt.replicator.daemon import run_daemon
from ckpt.replicator.gc import gc_local, gc_remote
from ckpt.replicator.policy import KeepLast, KeepMilestones, Policy, Union
from ckpt.restore.export import assemble, copy_version, open_version
from ckpt.restore.tiers import LocalTier, RemoteTier, Tier, open_tier
from ckpt.store import commit
from ckpt.store.chunk_read import verify_chunks
from ckpt.store.errors import CkptError, CorruptVersionError, TierUnavailableError, VersionNotFoundError
from ckpt.store.fsio import FILE_MODE
from ckpt.store.objstore import is_url, parse_storage_options, redact

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


def _version_rows(root: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    if is_url(root):
        tier = RemoteTier(root, options)
        rows = []
        for c in tier.committed():
            m = tier.manifest(c.step)
            rows.append(_row(c.step, m, "committed", list(c.writers)))
        return rows
    if not os.path.isdir(root):
        raise CkptError(f"{root} is not a directory")
    status = read_status(root).get("versions", {})
    rows = []
    for step in commit.committed_steps(root):
        try:
            m = commit.read_manifest(root, step)
        except VersionNotFoundError:
            continue  # deleted (GC) since the listing
        except TierUnavailableError:
            raise  # the disk fails (I/O error): one error line, not a table of them
        except CkptError as e:
            rows.append({"step": step, "status": f"unreadable: {e}"})
            continue
        version_dir = os.path.join(root, commit.version_dirname(step))
        info = commit.read_root_info(version_dir)
        writers = info.get("writers", [])
        writers = writers if isinstance(writers, list) else []
        local = all(w in writers for w in range(m.world_size))
        if not local and not os.path.isdir(version_dir):
            continue  # GC unpublished it between the manifest and the root info: gone, not partial
        row = _row(step, m, "committed" if local else "committed (part: other ranks' chunks on other roots)", writers)
        entry = status.get(str(step))
        if entry and entry.get("save_id") == m.save_id:
            row["copies"] = entry.get("copies", {})
            row["remote"] = entry.get("remote")
            row["replicate_s"] = {
                dest: round(c["at"] - m.created, 3)
                for dest, c in [*row["copies"].items(), ("remote", entry.get("remote") or {})]
                if c.get("state") == "verified" and "at" in c
            }
            remote = entry.get("remote") or {}
            done = float(remote.get("at") or 0.0) if remote.get("state") == "verified" else time.time()
            row["lag_s"] = round(max(0.0, done - m.created), 3) if remote else None
        rows.append(row)
    # A live writer's tmp directories are saves in flight, not versions: only the leftovers of
    # a writer that died are shown (the next writer to open the root removes them).
    for p in [] if commit.writer_active(root) else commit.prepared_versions(root):
        rows.append({"step": p.step, "status": "incomplete (not committed)", "dir": p.dirname})
    return sorted(rows, key=lambda r: r["step"])


def _row(step: int, m: Any, status: str, writers: list[Any]) -> dict[str, Any]:
    timings = [dict(t) for t in m.meta.get("timings", []) if isinstance(t, dict)]
    for t in timings:  # per rank: from save() to the manifest being built, minus the measured phases
        if isinstance(t.get("started"), (int, float)):
            copied = max(t.get("stage_s", 0), t.get("staged_s", 0))  # deferred staging: its copy ends later
            t["commit_s"] = round(max(0.0, m.created - t["started"] - copied - t.get("write_s", 0)), 4)
    return {
        "step": step,
        "time": m.created,
        "bytes": m.total_bytes,
        "world_size": m.world_size,
        "arrays": len(m.arrays),
        "status": status,
        "writers_here": writers,
        "milestone": bool(m.meta.get("milestone")),
        "timings": timings,
    }


def _copies(r: dict[str, Any]) -> str:
    copies = r.get("copies")
    if copies is None:
        return "-"
    ok = sum(1 for c in copies.values() if c.get("state") == "verified")
    return f"{ok}/{len(copies)} verified" if copies else "none"


def _remote(r: dict[str, Any]) -> str:
    remote = r.get("remote")
    if not remote:
        return "-"
    lag = r.get("lag_s")
    return f"{remote.get('state')}" + (f" (lag {lag:.1f}s)" if lag is not None else "")


_STORAGE_OPTION = click.option(
    "--storage-option",
    "storage_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec option for URL roots, e.g. endpoint_url=http://127.0.0.1:9000 (repeatable).",
)


def _options(pairs: tuple[str, ...]) -> dict[str, Any]:
    try:
        return parse_storage_options(pairs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


@click.group()
@click.version_option(package_name="ckpt")
def main() -> None:
    """Inspect, verify and restore ckpt checkpoint roots."""


def _tiers(root: str, extra: tuple[str, ...], options: dict[str, Any] | None = None) -> list[Tier]:
    usable = [p for p in (root, *extra) if is_url(p) or os.path.isdir(p)]
    for path in (root, *extra):
        if path not in usable:
            if not extra or not usable:
                raise CkptError(f"{path} is not a directory")
            click.echo(f"ckpt: warning: {path} is not a directory; reading the other tiers", err=True)
    return [open_tier(p, options) for p in usable]


@contextlib.contextmanager
def _pinned(tiers: list[Tier], step: int) -> Iterator[bool]:
    """Hold `step` against GC on every local tier while it is read (commit.pin_version);
    yields False if a GC is deleting it."""
    with contextlib.ExitStack() as stack:
        held = True
        for t in tiers:
            if isinstance(t, LocalTier):
                held = stack.enter_context(commit.pin_version(t.root, step)) and held
        yield held


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
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_STORAGE_OPTION
@_errors_to_exit
def ls_cmd(root: str, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """List the versions under ROOT (a path or a URL): step, time, size, world size, status, copies."""
    rows = _version_rows(root, _options(storage_options))
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"ckpt versions in {root}")
    for col in ("step", "time", "size", "world", "status", "copies", "remote"):
        table.add_column(col, justify="right" if col in ("step", "size", "world") else "left")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if "time" in r else "-"
        size = _human(r["bytes"]) if "bytes" in r else "-"
        table.add_row(str(r["step"]), when, size, str(r.get("world_size", "-")), r["status"], _copies(r), _remote(r))
    Console().print(table)


@main.command("verify")
@click.argument("root")
@click.option("--step", type=int, default=None, help="Verify only this step (default: every committed step).")
@_STORAGE_OPTION
@_errors_to_exit
def verify_cmd(root: str, step: int | None, storage_options: tuple[str, ...]) -> None:
    """Recompute every chunk's xxh3 (ROOT: a path or a URL); exit 1 naming each bad chunk."""
    if is_url(root):
        # A private cache: verify what the remote holds now, never chunks an earlier restore cached.
        with tempfile.TemporaryDirectory(prefix="ckpt-verify-") as cache:
            _verify_remote(RemoteTier(root, _options(storage_options), cache_dir=cache), step)
        return
    tier = LocalTier(root)
    if not os.path.isdir(root):
        raise CkptError(f"{root} is not a directory")
    steps = [step] if step is not None else commit.committed_steps(root)
    if not steps:
        raise CkptError(f"no committed versions in {root}")
    bad = 0
    for s in steps:
        with commit.pin_version(root, s) as held:  # GC leaves it alone while it is checked
            held = held and os.path.isdir(tier.version_dir(s))  # or a GC deleted it meanwhile
            if held:
                bad += _verify_local(tier, s, asked=step is not None)
            elif step is not None:
                raise VersionNotFoundError(f"step {s} is being deleted")
    if bad:
        click.echo(f"{bad} bad chunk(s)", err=True)
        sys.exit(EXIT_BAD_CHUNKS)


def _verify_local(tier: LocalTier, s: int, *, asked: bool) -> int:
    """Check one version of a local root, printing a line per problem; the number of problems."""
    version_dir = tier.version_dir(s)
    try:
        manifest = tier.manifest(s)
    except VersionNotFoundError:
        if asked:
            raise
        return 0  # deleted (GC) since the listing
    except TierUnavailableError:
        raise  # the disk fails (I/O error): one error line and exit 3, not a bad chunk
    except CkptError as e:
        click.echo(f"step {s}: BAD manifest: {e}")
        return 1
    info = commit.read_root_info(version_dir)
    writers = info.get("writers")
    held = set(writers) if isinstance(writers, list) else None
    problems = list(verify_chunks(version_dir, manifest, held))
    for p in problems:
        click.echo(f"step {s}: BAD {p.path}: {p.reason}")
    n = sum(1 for a in manifest.arrays.values() for c in a.chunks if held is None or c.writer in held)
    if not problems:
        click.echo(f"step {s}: ok ({n} chunks, {_human(manifest.total_bytes)})")
    return len(problems)


def _verify_remote(tier: RemoteTier, step: int | None) -> None:
    steps = [step] if step is not None else [c.step for c in tier.committed()]
    if not steps:
        raise CkptError(f"no committed versions in {tier.url}")
    bad = 0
    for s in steps:
        manifest = tier.manifest(s)
        fetch = tier.fetcher(s)
        for a in manifest.arrays.values():
            for c in a.chunks:
                if c.inline is None:
                    fetch(a.chunk_path(c), c.nbytes)
        problems = list(verify_chunks(tier.version_dir(s), manifest))
        for p in problems:
            click.echo(f"step {s}: BAD {p.path}: {p.reason}")
        bad += len(problems)
        if not problems:
            click.echo(f"step {s}: ok ({_human(manifest.total_bytes)})")
    tier.clear_cache()
    if bad:
        click.echo(f"{bad} bad chunk(s)", err=True)
        sys.exit(EXIT_BAD_CHUNKS)


@main.command("restore")
@click.argument("root")
@click.option("--step", type=int, default=None, help="The step (default: the newest intact one).")
@click.option("--to", "to_dir", type=click.Path(file_okay=False), help="Copy the verified version into this root.")
@click.option("--to-torch", "to_torch", type=click.Path(dir_okay=False), help="Write one torch.save state dict.")
@_TIER_OPTION
@_STORAGE_OPTION
@_errors_to_exit
def restore_cmd(
    root: str,
    step: int | None,
    to_dir: str | None,
    to_torch: str | None,
    tiers: tuple[str, ...],
    storage_options: tuple[str, ...],
) -> None:
    """Copy a verified version out of ROOT (a path or URL; and --tier copies), or assemble it into one file."""
    if (to_dir is None) == (to_torch is None):
        raise click.UsageError("give exactly one of --to DIR or --to-torch FILE")
    sources_tiers = _tiers(root, tiers, _options(storage_options))
    excluded: set[int] = set()
    while True:
        chosen, _, _ = open_version(sources_tiers, step, frozenset(excluded))
        with _pinned(sources_tiers, chosen) as held:
            try:  # GC may have deleted it since the listing; pinned now, it stays if still there
                if not held:
                    raise VersionNotFoundError(f"step {chosen} is being deleted")
                chosen, manifest, sources = open_version(sources_tiers, chosen)
            except VersionNotFoundError:
                if step is not None:
                    raise
                excluded.add(chosen)  # gone: choose again
                continue
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
                        # an explicit mode: torch.save(path) would create it 0o666 & ~umask
                        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                        with os.fdopen(os.open(tmp, flags, FILE_MODE), "wb") as f:
                            torch.save(state, f)
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
@click.argument("root")
@click.option("--step", type=int, default=None, help="The step (default: the newest).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@_TIER_OPTION
@_STORAGE_OPTION
@_errors_to_exit
def inspect_cmd(
    root: str, step: int | None, as_json: bool, tiers: tuple[str, ...], storage_options: tuple[str, ...]
) -> None:
    """List a version's tensors with their dtypes, shapes and sharding."""
    chosen, manifest, _ = open_version(_tiers(root, tiers, _options(storage_options)), step)
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
    for key in ("ckpt_version", "torch_version", "python", "cuda"):
        if manifest.meta.get(key):
            console.print(f"  {key}: {manifest.meta[key]}")
    git = manifest.meta.get("git")
    if isinstance(git, dict):
        console.print(
            f"  training code: {git.get('path')} @ {git.get('commit')}" + (" (dirty)" if git.get("dirty") else "")
        )
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


def _policy(keep_last: int | None, milestone_every: int | None, milestones: tuple[int, ...]) -> Policy | None:
    parts: list[Policy] = []
    if keep_last is not None:
        parts.append(KeepLast(keep_last))
    if milestone_every is not None or milestones:
        parts.append(KeepMilestones(milestone_every, frozenset(milestones)))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else Union(tuple(parts))


def _status_redundant(root: str) -> set[int] | None:
    """Steps whose copies the replicator has verified (or that expired on the remote); None
    if no replicator ran here."""
    versions = read_status(root).get("versions")
    if versions is None:
        return None
    out = set()
    for step, entry in versions.items():
        copies_ok = all(c.get("state") == "verified" for c in entry.get("copies", {}).values())
        remote = entry.get("remote")
        if copies_ok and (remote is None or remote.get("state") in REMOTE_DONE):
            out.add(int(step))
    return out


@main.command("gc")
@click.argument("root")
@click.option("--keep-last", type=click.IntRange(min=0), default=None, help="Keep the newest N versions.")
@click.option("--milestone-every", type=click.IntRange(min=1), default=None, help="Keep every step divisible by K.")
@click.option("--milestone", "milestones", type=int, multiple=True, help="Keep this step too (repeatable).")
@click.option("--dry-run", is_flag=True, help="Only print what would be deleted.")
@_STORAGE_OPTION
@_errors_to_exit
def gc_cmd(
    root: str,
    keep_last: int | None,
    milestone_every: int | None,
    milestones: tuple[int, ...],
    dry_run: bool,
    storage_options: tuple[str, ...],
) -> None:
    """Delete the versions of ROOT (a path or URL) that the policy does not keep.

    Never deletes the newest intact version, a milestone, or (where a replicator runs) a
    version whose copies are not verified yet.
    """
    policy = _policy(keep_last, milestone_every, milestones)
    if policy is None:
        raise click.UsageError("give --keep-last and/or --milestone-every / --milestone")
    if is_url(root):
        result = gc_remote(root, policy, storage_options=_options(storage_options), dry_run=dry_run)
    else:
        if not os.path.isdir(root):
            raise CkptError(f"{root} is not a directory")
        result = gc_local(root, policy, redundant=_status_redundant(root), dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb} {len(result.deleted)} version(s): {result.deleted}; kept {result.kept}")


@main.command("replicate")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--to", "remote", default=None, help="The shared tier: s3://bucket/prefix, file:///path, any fsspec URL.")
@click.option("--replicas", type=click.IntRange(min=1), default=1, help="Copies of each chunk on distinct disks.")
@click.option("--replica-root", "replica_roots", multiple=True, help="A place for copies: another disk or a peer URL.")
@click.option("--bwlimit", type=click.FloatRange(min=0, min_open=True), default=None, help="Cap in MB/s.")
@click.option("--once", is_flag=True, help="Make one pass and exit.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=0.5, help="Seconds between passes.")
@click.option("--keep-last", type=click.IntRange(min=0), default=None, help="Local retention: newest N.")
@click.option("--remote-keep-last", type=click.IntRange(min=0), default=None, help="Remote retention: newest N.")
@click.option("--milestone-every", type=click.IntRange(min=1), default=None, help="Remote: keep every K-th step.")
@click.option("--no-readback", is_flag=True, help="Verify copies by size only, not by reading them back.")
@click.option("--metrics-port", type=click.IntRange(min=1, max=65535), default=None, help="Serve Prometheus metrics.")
@_STORAGE_OPTION
@_errors_to_exit
def replicate_cmd(
    root: str,
    remote: str | None,
    replicas: int,
    replica_roots: tuple[str, ...],
    bwlimit: float | None,
    once: bool,
    interval: float,
    keep_last: int | None,
    remote_keep_last: int | None,
    milestone_every: int | None,
    no_readback: bool,
    metrics_port: int | None,
    storage_options: tuple[str, ...],
) -> None:
    """Copy ROOT's committed versions to other disks and to a remote; runs until SIGTERM."""
    if metrics_port is not None:
        from ckpt.store.metrics import serve

        serve(metrics_port)
    if not os.path.isdir(root):
        raise CkptError(f"{root} is not a directory")
    options = _options(storage_options)
    try:
        config = ReplicatorConfig(
            replicas=replicas,
            replica_roots=replica_roots,
            remote=remote,
            storage_options=options,
            bwlimit_mbps=bwlimit,
            interval_s=interval,
            readback=not no_readback,
            local_policy=_policy(keep_last, None, ()),
            remote_policy=_policy(remote_keep_last, milestone_every, ()),
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    target = redact(remote, options) if remote else "no remote"
    logging.getLogger("ckpt.replicator").info(
        "replicating %s to %s, %d copies over %s", root, target, replicas, list(replica_roots)
    )
    rep = run_daemon([root], config, once=once)
    click.echo(f"replicator stopped; {_human(rep.bytes_sent)} sent")


if __name__ == "__main__":
    main()
