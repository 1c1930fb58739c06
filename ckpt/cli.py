"""The `ckpt` command line: thin click commands over ckpt.store, ckpt.restore and
ckpt.replicator (listing: ckpt._listing, checks: ckpt._verify, text: ckpt._render).

Exit codes: 0 success, 1 verification found bad chunks, 2 usage error (click),
3 any other ckpt error (one readable line on stderr), 4 `ckpt gc` kept versions it could
not read (a transient error is no proof of damage: run it again).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ckpt._dist import Comm
from ckpt._listing import version_rows
from ckpt._render import human, inspect_rows, print_inspect, print_rows
from ckpt._verify import verify_tier
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.daemon import run_daemon
from ckpt.replicator.gc import collect
from ckpt.replicator.policy import KeepLast, KeepMilestones, Policy, Union
from ckpt.replicator.status import read_status, redundant_steps
from ckpt.restore.export import assemble, copy_version
from ckpt.restore.locate import Located, first_manifest, restore_newest
from ckpt.store.errors import CkptError, CorruptVersionError
from ckpt.store.fsio import FILE_MODE
from ckpt.store.manifest import Manifest
from ckpt.store.storage_options import parse_storage_options, redact
from ckpt.store.tier import Tier, is_url, open_tier

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])
EXIT_BAD_CHUNKS = 1
EXIT_CKPT_ERROR = 3
EXIT_UNJUDGED = 4
ABANDON_AFTER_S = 6 * 3600.0


def _errors_to_exit(fn: F) -> F:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (CkptError, PermissionError) as e:
            click.echo(f"ckpt: error: {e}", err=True)
            sys.exit(EXIT_CKPT_ERROR)

    return wrapper  # type: ignore[return-value]


_STORAGE_OPTION = click.option(
    "--storage-option",
    "storage_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec option for URL roots, e.g. endpoint_url=http://127.0.0.1:9000 (repeatable).",
)
_ABANDONED_OPTION = click.option(
    "--abandoned-after",
    type=click.FloatRange(min=0, min_open=True),
    default=ABANDON_AFTER_S,
    show_default=True,
    help="Remote: seconds without a write after which an upload that never committed is collected.",
)
_TIER_OPTION = click.option(
    "--tier", "tiers", multiple=True, type=click.Path(file_okay=False), help="Another root or copy to read from."
)


def _options(pairs: tuple[str, ...]) -> dict[str, Any]:
    try:
        return parse_storage_options(pairs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _root(location: str, options: dict[str, Any]) -> Tier:
    """The tier of a ROOT argument: a local directory must exist (a typo is no empty root)."""
    if not is_url(location) and not os.path.isdir(location):
        raise CkptError(f"{location} is not a directory")
    return open_tier(location, options)


def _tiers(root: str, extra: tuple[str, ...], options: dict[str, Any]) -> list[Tier]:
    usable = [p for p in (root, *extra) if is_url(p) or os.path.isdir(p)]
    for path in (root, *extra):
        if path not in usable:
            if not extra or not usable:
                raise CkptError(f"{path} is not a directory")
            click.echo(f"ckpt: warning: {path} is not a directory; reading the other tiers", err=True)
    return [open_tier(p, options) for p in usable]


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


class _ToStderr(logging.Handler):
    """ckpt's warnings as `ckpt: warning: ...` lines on the command's stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"ckpt: {record.levelname.lower()}: {record.getMessage()}", err=True)


_WARNINGS = _ToStderr(logging.WARNING)


@click.group()
@click.version_option(package_name="ckpt")
def main() -> None:
    """Inspect, verify and restore ckpt checkpoint roots."""
    if _WARNINGS not in logging.getLogger("ckpt").handlers:
        logging.getLogger("ckpt").addHandler(_WARNINGS)


@main.command("ls")
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_STORAGE_OPTION
@_errors_to_exit
def ls_cmd(root: str, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """List the versions under ROOT (a path or a URL): step, time, size, world size, status, copies."""
    options = _options(storage_options)
    rows = version_rows(_root(root, options))
    if as_json:
        click.echo(json.dumps([r.to_json() for r in rows], indent=2, default=lambda o: o.__dict__))
        return
    print_rows(redact(root, options), rows, Console())


@main.command("verify")
@click.argument("root")
@click.option("--step", type=int, default=None, help="Verify only this step (default: every committed step).")
@_STORAGE_OPTION
@_errors_to_exit
def verify_cmd(root: str, step: int | None, storage_options: tuple[str, ...]) -> None:
    """Recompute every chunk's xxh3 (ROOT: a path or a URL); exit 1 naming each bad chunk."""
    bad = 0
    for checked in verify_tier(_root(root, _options(storage_options)), step):
        for line in checked.problems:
            click.echo(f"step {checked.step}: {line}")
        if not checked.problems:
            click.echo(f"step {checked.step}: {checked.summary}")
        bad += len(checked.problems)
    if bad:
        click.echo(f"{bad} bad chunk(s)", err=True)
        sys.exit(EXIT_BAD_CHUNKS)


def _manifest_of(located: Located) -> Manifest:
    manifest = first_manifest(located)
    if manifest is None:
        raise CorruptVersionError(f"no readable manifest of step {located.step}")
    return manifest


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
    sources = _tiers(root, tiers, _options(storage_options))

    def export(located: Located) -> tuple[int, str]:
        manifest = _manifest_of(located)
        total = manifest.total_bytes if to_dir else sum(a.nbytes for a in manifest.arrays.values())
        with _progress(f"step {located.step}", total) as bar:
            task = bar.task_ids[0]

            def advance(n: int) -> None:
                bar.advance(task, n)

            if to_dir is not None:
                return total, copy_version(manifest, located.sources, to_dir, advance)
            assert to_torch is not None
            import torch

            state = assemble(Comm.solo(), manifest, located.sources, advance)
            tmp = f"{to_torch}.tmp-{os.getpid()}"
            # an explicit mode: torch.save(path) would create it 0o666 & ~umask
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
            with os.fdopen(os.open(tmp, flags, FILE_MODE), "wb") as f:
                torch.save(state, f)
            os.replace(tmp, str(to_torch))
            return total, str(to_torch)

    found = restore_newest(Comm.solo(), lambda: sources, export, step=step, missing_ok=False)
    assert found is not None
    chosen, (total, where) = found
    click.echo(f"restored step {chosen} ({human(total)}) to {where}")


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
    sources = _tiers(root, tiers, _options(storage_options))
    found = restore_newest(Comm.solo(), lambda: sources, _manifest_of, step=step, missing_ok=False)
    assert found is not None
    manifest = found[1]
    if as_json:
        doc = {
            "step": manifest.step,
            "world_size": manifest.world_size,
            "meta": manifest.meta,
            "arrays": inspect_rows(manifest),
        }
        click.echo(json.dumps(doc))
        return
    print_inspect(manifest, Console())


def _policy(keep_last: int | None, milestone_every: int | None, milestones: tuple[int, ...]) -> Policy | None:
    parts: list[Policy] = []
    if keep_last is not None:
        parts.append(KeepLast(keep_last))
    if milestone_every is not None or milestones:
        parts.append(KeepMilestones(milestone_every, frozenset(milestones)))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else Union(tuple(parts))


@main.command("gc")
@click.argument("root")
@click.option("--keep-last", type=click.IntRange(min=0), default=None, help="Keep the newest N versions.")
@click.option("--milestone-every", type=click.IntRange(min=1), default=None, help="Keep every step divisible by K.")
@click.option("--milestone", "milestones", type=int, multiple=True, help="Keep this step too (repeatable).")
@_ABANDONED_OPTION
@click.option("--dry-run", is_flag=True, help="Only print what would be deleted.")
@_STORAGE_OPTION
@_errors_to_exit
def gc_cmd(
    root: str,
    keep_last: int | None,
    milestone_every: int | None,
    milestones: tuple[int, ...],
    abandoned_after: float,
    dry_run: bool,
    storage_options: tuple[str, ...],
) -> None:
    """Delete the versions of ROOT (a path or URL) that the policy does not keep.

    Never deletes the newest intact version, a milestone, a version it cannot read (exit 4),
    or (where a replicator runs) a version whose copies are not verified yet.
    """
    policy = _policy(keep_last, milestone_every, milestones)
    if policy is None:
        raise click.UsageError("give --keep-last and/or --milestone-every / --milestone")
    tier = _root(root, _options(storage_options))
    status = None if is_url(root) else read_status(root)
    result = collect(
        tier,
        policy,
        redundant=None if status is None else redundant_steps(status),
        dry_run=dry_run,
        abandon_after_s=abandoned_after if is_url(root) else None,
    )
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb} {len(result.deleted)} version(s): {result.deleted}; kept {result.kept}")
    if result.abandoned:
        click.echo(f"{verb} {len(result.abandoned)} abandoned upload(s): {result.abandoned}")
    for step, why in result.unjudged.items():
        click.echo(f"ckpt: step {step} could not be read and was kept: {why}", err=True)
    if result.unjudged:
        sys.exit(EXIT_UNJUDGED)


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
@_ABANDONED_OPTION
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
    abandoned_after: float,
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
            abandon_after_s=abandoned_after,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    logging.getLogger("ckpt").removeHandler(_WARNINGS)  # the daemon logs everything, with times
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    target = redact(remote, options) if remote else "no remote"
    logging.getLogger("ckpt.replicator").info(
        "replicating %s to %s, %d copies over %s", root, target, replicas, list(replica_roots)
    )
    rep = run_daemon([root], config, once=once)
    click.echo(f"replicator stopped; {human(rep.bytes_sent)} sent")


if __name__ == "__main__":
    main()
