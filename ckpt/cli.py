"""The `ckpt` command line: thin click commands over ckpt.store, ckpt.restore and
ckpt.replicator (listing: ckpt._listing, checks: ckpt._verify, text: ckpt._render).

Exit codes: 0 success, 1 damage (verification found bad chunks, or the version asked for
is corrupt), 2 usage error (click), 3 any other error (one readable line on stderr, never
a traceback; `verify` found no damage but files it could not read), 4 `ckpt gc` kept
versions it could not read (a transient error is no proof of damage: run it again), 141
(quietly, as a tool SIGPIPE ends) when the reader of its output went away (`ckpt ls | head`),
130 when interrupted (Ctrl-C).

Starting fast: `ckpt --help`, `ls` and `verify` never import torch (about 2 s) nor rich's
progress bars; `inspect` and `restore` import them when they run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from ckpt._cli_console import WARNINGS, progress
from ckpt._cli_policies import gc_policy, replicate_policy
from ckpt._cli_targets import check_writable_root
from ckpt._listing import peer_copies_held, version_rows
from ckpt._peer_status import peer_dirs
from ckpt._render import human, inspect_lines, inspect_rows, ls_lines
from ckpt._verify import verify_tier
from ckpt.store.errors import CkptError, CorruptVersionError, VersionNotFoundError
from ckpt.store.storage_options import parse_storage_options, redact
from ckpt.store.tier import Tier, is_url, local_location, open_tier
from ckpt.store.versions import MAX_STEP, committed_steps

if TYPE_CHECKING:
    from ckpt.restore.locate import Located, Needs
    from ckpt.store.manifest import Manifest

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
EXIT_BAD_CHUNKS = 1
EXIT_CKPT_ERROR = 3
EXIT_UNJUDGED = 4
EXIT_OUTPUT_GONE = 128 + 13  # as the shell reports a process SIGPIPE ended
EXIT_INTERRUPTED = 128 + 2  # SIGINT's, as the shell reports it
ABANDON_AFTER_S = 6 * 3600.0


def _fail(message: str, code: int) -> None:
    click.echo(f"ckpt: error: {message}", err=True)
    sys.exit(code)


def _output_gone() -> NoReturn:
    # The rest of stdout's buffer would fail again when the interpreter exits.
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(EXIT_OUTPUT_GONE)


def _os_error(e: OSError) -> str:
    """An OSError as one line: `No such file or directory: /x/y` (its path, not its repr)."""
    if e.strerror and e.filename is not None:
        return f"{e.strerror}: {e.filename}"
    return str(e)


def _errors_to_exit(fn: F) -> F:
    """Every failure as one line on stderr and its exit code (see the module docstring)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:  # the reader of the output went away: not an error to report
            _output_gone()
        except KeyboardInterrupt:  # (click would say "Aborted!" and exit 1, damage's code)
            _fail("interrupted: what it committed before stays committed (ckpt ls shows it)", EXIT_INTERRUPTED)
        except CorruptVersionError as e:  # a damaged version: as `verify`'s bad chunks
            _fail(e.cli or str(e), EXIT_BAD_CHUNKS)
        except CkptError as e:
            _fail(e.cli or str(e), EXIT_CKPT_ERROR)
        except OSError as e:  # a path given to the command: missing, not a directory, read-only, full
            _fail(_os_error(e), EXIT_CKPT_ERROR)

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
    for pair in pairs:
        key, sep, _ = pair.partition("=")
        if sep and not all(part.strip() for part in key.split(".")):
            raise click.UsageError(f"--storage-option {pair!r}: the key is empty (give KEY=VALUE)")
    try:
        return parse_storage_options(pairs)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _is_directory(tier: Tier) -> bool:
    """False for a local path or file:// URL that is no directory (a typo is no empty root)."""
    path = tier.local_path("")
    return path is None or os.path.isdir(path)


def _local(location: str, option: str) -> str | None:
    """local_location(), a malformed file:// URL a usage error."""
    try:
        return local_location(location)
    except ValueError as e:
        raise click.UsageError(f"{option}: {e}") from None


def _root(location: str, options: dict[str, Any]) -> Tier:
    """The tier of a ROOT argument: a local one (a path or a file:// URL) must exist."""
    if not location:
        raise click.UsageError("ROOT is empty")
    _local(location, "ROOT")
    tier = open_tier(location, options)
    if not _is_directory(tier):
        raise CkptError(f"{location} is not a directory")
    return tier


def _tiers(root: str, extra: tuple[str, ...], options: dict[str, Any]) -> list[Tier]:
    if not root or not all(extra):
        raise click.UsageError("a ROOT or --tier is empty")
    for p, option in ((root, "ROOT"), *((t, "--tier") for t in extra)):
        _local(p, option)
    tiers = {p: open_tier(p, options) for p in (root, *extra)}
    usable = [p for p, t in tiers.items() if _is_directory(t)]
    for path in tiers:
        if path not in usable:
            if not extra or not usable:
                raise CkptError(f"{path} is not a directory")
            click.echo(f"ckpt: warning: {path} is not a directory; reading the other tiers", err=True)
    # Then the peer copies those roots' disks hold (other nodes' parts of this job's versions),
    # as a Checkpointer's restore reads them: a node's part may survive only there. (Not the
    # replicator's copies under replicas/: those may be another root's or job's; --tier names them.)
    held: list[Tier] = []
    for p in usable:
        local = tiers[p].local_path("")
        try:
            held += [] if local is None else [open_tier(d) for d in peer_dirs(local).values()]
        except OSError as e:  # (replicas/ unreadable: the roots given are still read)
            click.echo(f"ckpt: warning: the peer copies on {p} cannot be listed: {_os_error(e)}", err=True)
    return [tiers[p] for p in usable] + held


@click.group()
@click.version_option(package_name="ckpt")
def main() -> None:
    """Inspect, verify and restore ckpt checkpoint roots."""
    if WARNINGS not in logging.getLogger("ckpt").handlers:
        logging.getLogger("ckpt").addHandler(WARNINGS)


_STEP_OPTION = click.IntRange(min=0, max=MAX_STEP)


@main.command("ls")
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_STORAGE_OPTION
@_errors_to_exit
def ls_cmd(root: str, as_json: bool, storage_options: tuple[str, ...]) -> None:
    """List the versions under ROOT (a path or a URL): step, time, size, world size, status, copies."""
    options = _options(storage_options)
    tier = _root(root, options)
    rows = version_rows(tier)
    if as_json:
        click.echo(json.dumps([r.to_json() for r in rows], indent=2, default=lambda o: o.__dict__))
        return
    local = tier.local_path("")
    held = None if local is None else peer_copies_held(local)
    for line in ls_lines(redact(root, options), rows, shutil.get_terminal_size().columns, held):
        click.echo(line)


@main.command("verify")
@click.argument("root")
@click.option("--step", type=_STEP_OPTION, default=None, help="Verify only this step (default: every committed step).")
@_STORAGE_OPTION
@_errors_to_exit
def verify_cmd(root: str, step: int | None, storage_options: tuple[str, ...]) -> None:
    """Recompute every chunk's xxh3 (ROOT: a path or a URL); exit 1 naming each bad chunk,
    else 3 naming each file that failed every read with an I/O error (no proof of damage)."""
    bad = damaged = unreadable = 0
    for checked in verify_tier(_root(root, _options(storage_options)), step):
        for line in (*checked.problems, *checked.unreadable):
            click.echo(f"step {checked.step}: {line}")
        if not checked.problems and not checked.unreadable:
            click.echo(f"step {checked.step}: {checked.summary}")
        if checked.whole:
            damaged += 1
        else:
            bad += len(checked.problems)
        unreadable += len(checked.unreadable)
    if unreadable:
        click.echo(f"{unreadable} unreadable file{'s' if unreadable != 1 else ''} (I/O errors: run it again)", err=True)
    if bad or damaged:
        found = [
            f"{n} {what}{'s' if n != 1 else ''}" for n, what in ((bad, "bad chunk"), (damaged, "damaged version")) if n
        ]
        click.echo(", ".join(found), err=True)
        sys.exit(EXIT_BAD_CHUNKS)
    if unreadable:
        sys.exit(EXIT_CKPT_ERROR)  # not damage: a disk that fails reads now may read later


def _manifest_of(located: Located) -> Manifest:
    from ckpt.restore.locate import first_manifest

    manifest = first_manifest(located)
    if manifest is None:
        raise CorruptVersionError(f"no readable manifest of step {located.step}")
    return manifest


def _newest(sources: list[Tier], load: Callable[[Located], T], step: int | None, needs: Needs = None) -> tuple[int, T]:
    """restore.locate's choice of version (the newest intact one holding `needs`, or `step`), loaded."""
    from ckpt._dist import Comm  # imports torch
    from ckpt.restore.locate import restore_newest

    found = restore_newest(Comm.solo(), lambda: sources, load, step=step, missing_ok=False, needs=needs)
    assert found is not None  # missing_ok=False: VersionNotFoundError instead
    return found


@main.command("restore")
@click.argument("root")
@click.option("--step", type=_STEP_OPTION, default=None, help="The step (default: the newest intact one).")
@click.option("--to", "to_dir", type=click.Path(file_okay=False), help="Copy the verified version into this root.")
@click.option("--to-torch", "to_torch", type=click.Path(dir_okay=False), help="Write one torch.save state dict.")
@click.option(
    "--to-safetensors",
    "to_safetensors",
    type=click.Path(file_okay=False),
    help="Write the tensors under --prefix as Hugging Face safetensors files (and their index) into this directory.",
)
@click.option("--prefix", default="model", show_default=True, help="--to-safetensors: the state key to export.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="--to-safetensors: the largest file.")
@click.option(
    "--dtype", type=click.Choice(sorted(("bf16", "fp16", "fp32"))), default=None, help="--to-safetensors: cast floats."
)
@click.option(
    "--force",
    is_flag=True,
    help="--to-torch: replace an existing regular file; --to-safetensors: write into a non-empty directory.",
)
@click.option(
    "--keys",
    default=None,
    help="Top-level state keys to restore, comma-separated (e.g. model): the newest version holding "
    "them (a params-only one too); --to-torch writes only them. Default: every key, so params-only "
    "versions are passed over.",
)
@_TIER_OPTION
@_STORAGE_OPTION
@_errors_to_exit
def restore_cmd(
    root: str,
    step: int | None,
    to_dir: str | None,
    to_torch: str | None,
    to_safetensors: str | None,
    prefix: str,
    max_shard_size: str,
    dtype: str | None,
    force: bool,
    keys: str | None,
    tiers: tuple[str, ...],
    storage_options: tuple[str, ...],
) -> None:
    """Copy a verified version out of ROOT (a path or URL; and --tier copies), or assemble it into one file.

    --to-torch never replaces an existing file without --force, nor anything that is not a
    regular file (a device, a directory) even with it. --to-safetensors writes files named
    as transformers names them (model.safetensors, or model-0000K-of-0000N.safetensors and
    model.safetensors.index.json), every byte read verified.
    """
    from ckpt.restore.export import TorchFile, assemble, copy_version, selected
    from ckpt.restore.locate import ALL_KEYS

    wanted = None if keys is None else frozenset(k for k in keys.split(",") if k)
    if wanted is not None and not wanted:
        raise click.UsageError("--keys names no key")

    if sum(x is not None for x in (to_dir, to_torch, to_safetensors)) != 1:
        raise click.UsageError("give exactly one of --to DIR, --to-torch FILE or --to-safetensors DIR")
    to_dir, to_torch, to_safetensors = (
        None if target is None else _local_target(target, option)
        for target, option in ((to_dir, "--to"), (to_torch, "--to-torch"), (to_safetensors, "--to-safetensors"))
    )
    if force and to_dir is not None:
        raise click.UsageError("--force applies to --to-torch and --to-safetensors only")
    if to_safetensors is None:
        ctx = click.get_current_context()
        given = [
            f"--{name.replace('_', '-')}"
            for name in ("prefix", "max_shard_size", "dtype")
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
        ]
        if given:
            raise click.UsageError(f"{', '.join(given)} applies to --to-safetensors only")
    if to_safetensors is not None:
        if keys is not None:
            raise click.UsageError("--keys does not apply to --to-safetensors (--prefix chooses the tensors)")
        _export_safetensors(root, step, to_safetensors, prefix, max_shard_size, dtype, force, tiers, storage_options)
        return
    if to_dir is not None:
        check_writable_root(to_dir)
    with contextlib.ExitStack() as stack:
        # created before anything is read: a target that cannot be written fails at once
        out = None if to_torch is None else stack.enter_context(TorchFile(to_torch, force=force))
        sources = _tiers(root, tiers, _options(storage_options))

        def export(located: Located) -> tuple[int, str]:
            manifest = _manifest_of(located)
            if to_dir is not None:  # a copy of every file: no tree is merged
                with progress(f"step {located.step}", manifest.total_bytes) as advance:
                    return manifest.total_bytes, copy_version(manifest, located.sources, to_dir, advance)
            tree, names = selected(manifest, located.sources, wanted)
            missing = sorted(wanted - set(tree)) if wanted is not None and isinstance(tree, dict) else []
            if missing:  # (without --step, only a version that holds them is chosen)
                raise VersionNotFoundError(f"step {located.step} holds no {', '.join(missing)}: --keys names them")
            total = sum(manifest.arrays[n].nbytes for n in names if n in manifest.arrays)
            with progress(f"step {located.step}", total) as advance:
                from ckpt._dist import Comm

                state = assemble(Comm.solo(), manifest, located.sources, advance, wanted)
            assert out is not None
            out.write(state)
            return total, out.path

        chosen, (total, where) = _newest(sources, export, step, None if step is not None else wanted or ALL_KEYS)
    click.echo(f"restored step {chosen} ({human(total)}) to {where}")


def _local_target(target: str, option: str) -> str:
    """A place to write on this machine: a path, or a `file://` URL's path. Any other URL is
    a usage error (its path would be written as a local relative one, `./s3:/...`)."""
    if not target:
        raise click.UsageError(f"{option} is empty")
    if target.startswith("file:"):
        return _local(target, option) or target
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", target):
        raise click.UsageError(f"{option} writes to this machine: give a path or a file:// URL, not {target}")
    return target


@main.command("import")
@click.argument("source", type=click.Path(exists=True))
@click.argument("root")
@click.option("--step", type=_STEP_OPTION, required=True, help="The step to save it as.")
@click.option("--trust", is_flag=True, help="Unpickle SOURCE: DCP and torch.save files are pickles, which run code.")
@click.option("--overwrite", is_flag=True, help="Replace an existing version of the step.")
@_errors_to_exit
def import_cmd(source: str, root: str, step: int, trust: bool, overwrite: bool) -> None:
    """Save a DCP checkpoint directory, a torch.save file or a .safetensors file (its
    tensors under the state key "model") as version STEP under ROOT.

    DCP and torch.save are pickles, so they are not read without --trust; the version
    written holds none.
    """
    from ckpt.importers import import_checkpoint

    if not root:
        raise click.UsageError("ROOT is empty")
    root = _local_target(root, "ROOT")
    check_writable_root(root)
    nbytes = import_checkpoint(source, root, step, trust=trust, overwrite=overwrite)
    click.echo(f"imported {source} as step {step} ({human(nbytes)}) under {root}")


def _export_safetensors(
    root: str,
    step: int | None,
    out_dir: str,
    prefix: str,
    max_shard_size: str,
    dtype: str | None,
    force: bool,
    tiers: tuple[str, ...],
    storage_options: tuple[str, ...],
) -> None:
    from ckpt.restore.to_safetensors import export_needs, parse_size, tensor_names, write_safetensors

    try:
        parse_size(max_shard_size)
    except ValueError as e:
        raise click.UsageError(f"--max-shard-size: {e}") from None
    sources = _tiers(root, tiers, _options(storage_options))

    def export(located: Located) -> tuple[int, list[str]]:
        manifest = _manifest_of(located)
        total = sum(a.nbytes for a in tensor_names(manifest, located.sources, prefix).values())
        with progress(f"step {located.step}", total) as advance:
            return total, write_safetensors(
                manifest,
                located.sources,
                out_dir,
                prefix=prefix,
                max_shard_size=max_shard_size,
                dtype=dtype,
                force=force,
                progress=advance,
            )

    chosen, (total, written) = _newest(sources, export, step, export_needs(step, prefix))
    click.echo(f"exported step {chosen} ({human(total)}) to {out_dir}: {len(written)} files")


INSPECT_RANKS = 64  # ranks whose provenance inspect reads from their rank files (schema 3)


def _rank_provenance(manifest: Manifest, located: Located) -> list[dict[str, Any]]:
    """Host, CPU and GPUs of the first INSPECT_RANKS saving ranks ({} where unreadable)."""
    if manifest.schema_version < 3:
        return [p if isinstance(p, dict) else {} for p in manifest.meta.get("ranks", [])]
    from ckpt.restore.sources import rank_file_from

    out: list[dict[str, Any]] = []
    for rank in range(min(manifest.world_size, INSPECT_RANKS)):
        try:
            out.append(rank_file_from(located.sources, manifest, rank).provenance)
        except CkptError as e:
            logging.getLogger("ckpt").warning("rank %d's provenance: %s", rank, e)
            out.append({})
    return out


@main.command("inspect")
@click.argument("root")
@click.option("--step", type=_STEP_OPTION, default=None, help="The step (default: the newest).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@_TIER_OPTION
@_STORAGE_OPTION
@_errors_to_exit
def inspect_cmd(
    root: str, step: int | None, as_json: bool, tiers: tuple[str, ...], storage_options: tuple[str, ...]
) -> None:
    """List a version's tensors with their dtypes, shapes and sharding (names are never cut)."""
    sources = _tiers(root, tiers, _options(storage_options))

    def load(located: Located) -> tuple[Manifest, list[dict[str, Any]]]:
        manifest = _manifest_of(located)
        return manifest, _rank_provenance(manifest, located)

    manifest, ranks = _newest(sources, load, step)[1]
    if as_json:
        doc = {
            "step": manifest.step,
            "world_size": manifest.world_size,
            "meta": {**manifest.meta, "ranks": ranks},
            "arrays": inspect_rows(manifest),
        }
        click.echo(json.dumps(doc))
        return
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    for line in inspect_lines(manifest, ranks, width):
        click.echo(line)


@main.command("gc")
@click.argument("root")
@click.option("--keep-last", type=click.IntRange(min=0), default=None, help="Keep the newest N versions.")
@click.option(
    "--keep-last-full", type=click.IntRange(min=0), default=None, help="Keep the newest N versions of the whole state."
)
@click.option(
    "--keep-last-partial",
    type=click.IntRange(min=0),
    default=None,
    help="Keep the newest M versions that hold only some keys (params-only).",
)
@click.option("--milestone-every", type=click.IntRange(min=1), default=None, help="Keep every step divisible by K.")
@click.option("--milestone", "milestones", type=_STEP_OPTION, multiple=True, help="Keep this step too (repeatable).")
@click.option(
    "--all-but-milestones",
    is_flag=True,
    help="Keep only the milestones (and the newest intact version); no --keep-last.",
)
@_ABANDONED_OPTION
@click.option("--dry-run", is_flag=True, help="Only print what would be deleted.")
@_STORAGE_OPTION
@_errors_to_exit
def gc_cmd(
    root: str,
    keep_last: int | None,
    keep_last_full: int | None,
    keep_last_partial: int | None,
    milestone_every: int | None,
    milestones: tuple[int, ...],
    all_but_milestones: bool,
    abandoned_after: float,
    dry_run: bool,
    storage_options: tuple[str, ...],
) -> None:
    """Delete the versions of ROOT (a path or URL) that the policy does not keep.

    The policy is --keep-last N, or --keep-last-full N and --keep-last-partial M (params-only
    versions), with milestones (--milestone-every K, --milestone STEP), or
    --all-but-milestones; it is printed first. Never deletes a version saved with
    milestone=True, the newest intact version, the newest intact full version (a full-state
    restore needs it), a version it cannot read (exit 4), (where a replicator runs) a
    version whose copies are not verified yet, or (where the job makes peer copies) the
    newest version whose peer copies are verified and any newer one.
    """
    from ckpt._peer_status import with_peer_rule
    from ckpt.replicator.gc import collect
    from ckpt.replicator.status import read_status, redundant_saves

    try:
        policy, said = gc_policy(
            keep_last, milestone_every, milestones, all_but_milestones, keep_last_full, keep_last_partial
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    tier = _root(root, _options(storage_options))
    local = tier.local_path("")
    if local is not None:
        check_writable_root(local, root)
    click.echo(said)
    unknown = sorted(set(milestones) - set(committed_steps(tier)))
    if unknown:
        what = "these steps" if len(unknown) > 1 else "this step"
        click.echo(f"ckpt: warning: --milestone {', '.join(map(str, unknown))}: no version of {what}", err=True)
    status = None if local is None else read_status(local)
    result = collect(
        tier,
        policy,
        redundant=None if local is None else with_peer_rule(local, None if status is None else redundant_saves(status)),
        dry_run=dry_run,
        abandon_after_s=abandoned_after if is_url(root) else None,
    )
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb} {len(result.deleted)} version(s): {result.deleted}; kept {result.kept}")
    if result.abandoned:
        click.echo(f"{verb} {len(result.abandoned)} abandoned upload(s): {result.abandoned}")
    if result.damaged:
        click.echo(
            f"{verb} {len(result.damaged)} damaged entr{'y' if len(result.damaged) == 1 else 'ies'}: {result.damaged}"
        )
    for step, why in result.unjudged.items():
        click.echo(f"ckpt: warning: step {step} could not be read and was kept: {why}", err=True)
    if result.unjudged:
        sys.exit(EXIT_UNJUDGED)


@main.command("replicate")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--to", "remote", default=None, help="The shared tier: s3://bucket/prefix, file:///path, any fsspec URL.")
@click.option("--replicas", type=click.IntRange(min=1), default=1, help="Copies of each chunk on distinct disks.")
@click.option("--replica-root", "replica_roots", multiple=True, help="A place for copies: another disk or a peer URL.")
@click.option("--bwlimit", type=click.FloatRange(min=0, min_open=True), default=None, help="Cap in MB/s.")
@click.option("--once", is_flag=True, help="Make one pass and exit.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.05, max=threading.TIMEOUT_MAX),
    default=0.5,
    help="Seconds between passes.",
)
@click.option("--keep-last", type=click.IntRange(min=0), default=None, help="Local retention: newest N.")
@click.option("--remote-keep-last", type=click.IntRange(min=0), default=None, help="Remote retention: newest N.")
@click.option("--milestone-every", type=click.IntRange(min=1), default=None, help="Remote: keep every K-th step.")
@_ABANDONED_OPTION
@click.option("--no-readback", is_flag=True, help="Verify copies by size only, not by their checksums.")
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
    from ckpt.replicator.config import ReplicatorConfig
    from ckpt.replicator.daemon import run_daemon

    if not root:
        raise click.UsageError("ROOT is empty")
    if remote == "" or "" in replica_roots:  # an unset variable (`--to "$REMOTE"`)
        raise click.UsageError(f"{'--to' if remote == '' else '--replica-root'} is empty")
    if replicas - 1 > len(replica_roots):
        raise click.UsageError(f"--replicas {replicas} needs {replicas - 1} --replica-root, got {len(replica_roots)}")
    if replica_roots and replicas == 1:
        raise click.UsageError("--replica-root makes no copy without --replicas N (the copies in all, 2 or more)")
    if interval != interval:  # (FloatRange lets nan through)
        raise click.UsageError("--interval nan is no number of seconds")
    if not os.path.isdir(root):
        raise CkptError(f"{root} is not a directory")
    check_writable_root(root)
    for where, option in ((remote, "--to"), *((r, "--replica-root") for r in replica_roots)):
        local = _local(where, option) if where else None  # where copies go: never into an ordinary directory
        if local is not None:
            check_writable_root(local, where)
    options = _options(storage_options)
    if metrics_port is not None:
        from ckpt.store.metrics import serve

        serve(metrics_port)
    try:
        config = ReplicatorConfig(
            replicas=replicas,
            replica_roots=replica_roots,
            remote=remote,
            storage_options=options,
            bwlimit_mbps=bwlimit,
            interval_s=interval,
            readback=not no_readback,
            local_policy=replicate_policy(keep_last, None, remote=False),
            remote_policy=replicate_policy(remote_keep_last, milestone_every, remote=True),
            abandon_after_s=abandoned_after,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    logging.getLogger("ckpt").removeHandler(WARNINGS)  # the daemon logs everything, with times
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    places = ", ".join(redact(r, options) for r in replica_roots) or "none given"
    copies = "no replicas" if replicas == 1 else f"{replicas} copies of each chunk (replica roots: {places})"
    target = redact(remote, options) if remote else "none"
    logging.getLogger("ckpt.replicator").info("replicating %s: %s; remote: %s", root, copies, target)
    rep = run_daemon([root], config, once=once)
    click.echo(f"replicator stopped; {human(rep.bytes_sent)} sent")


if __name__ == "__main__":
    main()
