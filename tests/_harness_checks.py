"""The crash harness's invariant checks (tests/crash_harness.py drives them).

Owns: the layout of the harness's directories, listings of every tier, the model of
what the retention policies may delete, reading the training job's journals, and the
checks themselves (`ckpt verify`, completeness of remote versions, bitwise comparison
of every version's tensors with what the job recorded). It starts no process.

Tiers, by name: `root0`/`root1` (each rank's own root, on its node's disk0),
`replica0`/`replica1` (the copies node k's replicator made on its disk1), `peer0`/`peer1`
(root k's part as the job's peer copies keep it on the other node's root), `peer<k>-<id>`
(copies of a root k that a node's loss replaced: another disk, `<id>` its identity's
first 8 digits; deleted as the root holding them deletes its own steps) and `remote` (a
`file://` directory shared by both nodes).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from click.testing import CliRunner

from ckpt._dist import Comm
from ckpt._peer_status import peer_dirs
from ckpt.cli import main as ckpt_cli
from ckpt.replicator.placement import source_label
from ckpt.restore.discover import choose_step, holdings, reachable_steps
from ckpt.restore.export import assemble
from ckpt.restore.locate import Located, first_manifest, restore_newest
from ckpt.store.manifest import MANIFEST_NAME, ROOT_INFO_NAME, parse_manifest
from ckpt.store.root import ROOT_ID_NAME
from ckpt.store.tier import open_tier
from ckpt.store.versions import Candidate, committed, committed_steps
from tests._harness_worker import ROWS, digest, flatten

WORLD = 2
Snapshot = dict[str, dict[int, str]]  # tier name -> {step: save_id}


@dataclass(frozen=True)
class Layout:
    out: str

    def root(self, k: int) -> str:
        return os.path.join(self.out, f"node{k}", "disk0", "ckpt")

    def disk(self, k: int, d: int) -> str:
        return os.path.join(self.out, f"node{k}", f"disk{d}")

    def replica(self, k: int) -> str:
        return os.path.join(self.disk(k, 1), "replicas", source_label(self.root(k)))

    def peers_on(self, k: int) -> dict[str, str]:
        """The peer copies node k's root holds, of root 1 - k (root indices follow ranks: one
        root per rank), tier name -> path: `peer<1 - k>` those of that root's disk now, and
        `peer<1 - k>-<id>` those of a disk a node's loss replaced."""
        try:
            with open(os.path.join(self.root(1 - k), ROOT_ID_NAME)) as f:
                current = f.read().strip()
        except FileNotFoundError:  # a replaced disk the job has not opened yet
            current = ""
        return {
            f"peer{1 - k}" if source == current else f"peer{1 - k}-{source[:8]}": path
            for source, path in peer_dirs(self.root(k)).items()
        }

    def node_tiers(self, k: int) -> list[str]:
        """The tiers on node k's disks: a node's loss takes them all."""
        return [f"root{k}", f"replica{k}", f"peer{1 - k}"]

    @property
    def remote_dir(self) -> str:
        return os.path.join(self.out, "remote")

    @property
    def remote_url(self) -> str:
        return "file://" + self.remote_dir

    @property
    def journal(self) -> str:
        return os.path.join(self.out, "journal")

    def tiers(self) -> dict[str, str]:
        """Tier name -> its path or URL."""
        out = {f"root{k}": self.root(k) for k in range(WORLD)}
        out.update({f"replica{k}": self.replica(k) for k in range(WORLD)})
        for k in range(WORLD):
            out.update(self.peers_on(k))
        out["remote"] = self.remote_url
        return out

    def create(self) -> None:
        for k in range(WORLD):
            self.create_node(k)
        os.makedirs(self.journal, exist_ok=True)

    def create_node(self, k: int) -> None:
        for d in (0, 1):
            os.makedirs(self.disk(k, d), exist_ok=True)
            with open(os.path.join(self.disk(k, d), ".ckpt-disk"), "w") as f:
                f.write(f"node{k}-disk{d}")  # two disks per node: copies must not share one
        os.makedirs(self.root(k), exist_ok=True)

    def replace_node(self, k: int) -> None:
        """Node k is lost and replaced: its disks come back empty."""
        shutil.rmtree(os.path.join(self.out, f"node{k}"))
        self.create_node(k)


def candidates(location: str) -> list[Candidate]:
    if not location.startswith("file://") and not os.path.isdir(location):
        return []
    return committed(open_tier(location))


def listing(location: str) -> dict[int, str]:
    """A tier's committed versions, {step: save_id}.

    A retention pass publishes a version, then deletes or retires an older one. A listing
    that runs across it can name the old one, find its record gone when it reads it, and
    miss the new one, named too late: then neither shows, and the old one's deletion looks
    like one with fewer newer versions than it had. So when a version named at the start
    is gone by its read, the tier is listed again and what that adds counts too (it was
    there before the deletion the first listing ran into)."""
    if not location.startswith("file://") and not os.path.isdir(location):
        return {}
    tier = open_tier(location)
    named = set(committed_steps(tier))
    found = {c.step: c.save_id for c in committed(tier)}
    if named - set(found):
        found.update({c.step: c.save_id for c in committed(tier) if c.step not in found})
    return found


def snapshot(layout: Layout) -> Snapshot:
    return {name: listing(loc) for name, loc in layout.tiers().items()}


# -- retention -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Retention:
    """What may delete a version of a tier: keep the newest `keep_last` (by step) plus, if
    `milestone_every` is set, every multiple of it and every tagged step (or, with
    `keep_tagged`, every tagged step)."""

    keep_last: int
    milestone_every: int | None = None
    keep_tagged: bool = False
    """Every tagged step is kept even without `milestone_every` (the job's own retention)."""

    def may_delete(self, step: int, known: Iterable[int], tagged: set[int]) -> bool:
        if self.milestone_every is not None and step % self.milestone_every == 0:
            return False
        if (self.milestone_every is not None or self.keep_tagged) and step in tagged:
            return False
        return sum(1 for s in set(known) if s > step) >= self.keep_last


# -- journals --------------------------------------------------------------------------------


@dataclass
class Journals:
    """What the training job recorded, read incrementally (complete lines only)."""

    layout: Layout
    expected: dict[tuple[int, int], list[dict[str, str]]] = field(default_factory=dict)  # (step, rank) -> sums
    committed: set[int] = field(default_factory=set)
    tagged: set[int] = field(default_factory=set)
    restored: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)  # (incarnation, rank) -> record
    _offsets: dict[str, int] = field(default_factory=dict)

    def _lines(self, name: str) -> list[dict[str, Any]]:
        path = os.path.join(self.layout.journal, name)
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(name, 0))
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offsets[name] = self._offsets.get(name, 0) + end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]

    def refresh(self) -> None:
        for rank in range(WORLD):
            for rec in self._lines(f"expected.rank{rank}.jsonl"):
                if "committed" in rec:
                    if rec["committed"] is not None:
                        self.committed.add(int(rec["committed"]))
                    continue
                sums = self.expected.setdefault((rec["step"], rank), [])
                if rec["sums"] not in sums:
                    sums.append(rec["sums"])
                if rec.get("milestone"):
                    self.tagged.add(rec["step"])
            for rec in self._lines(f"restored.rank{rank}.jsonl"):
                self.restored[(rec["inc"], rank)] = rec
                if rec["step"] is not None:
                    self.committed.add(int(rec["step"]))

    def newest_saved(self) -> set[int]:
        """The newest step the job saved: committed perhaps, though only its next save (or
        close) journals that, while retention acts on the commit at once."""
        return {max(s for s, _ in self.expected)} if self.expected else set()

    def nondeterministic(self) -> list[tuple[int, int]]:
        """(step, rank) pairs recorded twice with different sums: the job is not reproducible."""
        return sorted(k for k, v in self.expected.items() if len(v) > 1)


def compare(got: dict[str, str], want: Sequence[dict[str, str]]) -> str | None:
    """None when `got` equals one of the recorded sums; else what differs."""
    if not want:
        return "nothing was recorded for this step"
    if any(got == w for w in want):
        return None
    w = want[-1]
    keys = sorted(k for k in set(got) | set(w) if got.get(k) != w.get(k))
    return "differs in " + ", ".join(f"{k} ({got.get(k)} vs {w.get(k)})" for k in keys[:4])


# -- checks ----------------------------------------------------------------------------------


def verify(location: str, step: int | None = None) -> tuple[bool, str]:
    """`ckpt verify` (in-process through click): (ok, output)."""
    args = ["verify", location] + ([] if step is None else ["--step", str(step)])
    result = CliRunner().invoke(ckpt_cli, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return False, f"{type(result.exception).__name__}: {result.exception}"
    return result.exit_code == 0, result.output


def remote_problems(remote_dir: str) -> tuple[int, list[str]]:
    """(versions listed, problems): every remote version with a manifest must hold every
    file it names at the right size. A file found missing counts only if the manifest is
    still there afterwards (GC removes the manifest before anything else)."""
    problems = []
    listed = 0
    try:
        names = sorted(os.listdir(remote_dir))
    except FileNotFoundError:
        return 0, []
    for name in names:
        vdir = os.path.join(remote_dir, name)
        mpath = os.path.join(vdir, MANIFEST_NAME)
        try:
            with open(mpath, "rb") as f:
                manifest = parse_manifest(f.read())
        except FileNotFoundError:
            continue
        except Exception as e:  # noqa: BLE001 - a torn or invalid manifest is itself a problem
            if os.path.exists(mpath):
                problems.append(f"{name}: unreadable manifest: {e}")
            continue
        listed += 1
        missing = []
        wanted = [(ROOT_INFO_NAME, None)] + [
            (a.chunk_path(c), c.nbytes) for a in manifest.arrays.values() for c in a.iter_chunks() if c.inline is None
        ]
        for rel, size in wanted:
            try:
                got = os.path.getsize(os.path.join(vdir, rel))
            except FileNotFoundError:
                got = -1
            if got < 0 or (size is not None and got != size):
                missing.append(f"{rel} ({'missing' if got < 0 else f'{got} bytes, want {size}'})")
        if missing and os.path.exists(mpath):
            problems.append(f"{name}: committed but incomplete: {', '.join(missing[:3])}")
    return listed, problems


def _views(layout: Layout) -> list[list[Candidate]]:
    """What each rank's restore lists: its root, its node's replica copies and the peer
    copies its root holds, the remote."""
    views = []
    for k in range(WORLD):
        locs = (layout.root(k), layout.replica(k), *layout.peers_on(k).values(), layout.remote_url)
        views.append([c for loc in locs for c in candidates(loc)])
    return views


def expected_restore(layout: Layout) -> tuple[int | None, set[tuple[int, str]]]:
    """The step a restart must restore at least (the newest one the ranks together can
    reach), and the newer saves, (step, save_id), committed only in part (a lost node's
    part): the job's next saves of their steps may replace what is left of them."""
    held = holdings(_views(layout))
    chosen = choose_step(held)
    return chosen, {(h.step, h.save_id) for h in held if not h.whole and (chosen is None or h.step > chosen)}


def groups(layout: Layout) -> dict[str, list[str]]:
    """Sets of tiers that together hold whole versions (each root holds one rank's part)."""
    return {
        "local": [layout.root(k) for k in range(WORLD)],
        "replicas": [layout.replica(k) for k in range(WORLD)],
        "peers": [path for k in range(WORLD) for path in layout.peers_on(k).values()],
        "remote": [layout.remote_url],
    }


def reachable(locations: Sequence[str]) -> dict[int, str]:
    return reachable_steps(holdings([[c for loc in locations for c in candidates(loc)]]))


def version_sums(locations: Sequence[str], step: int) -> dict[int, dict[str, str]]:
    """Per saved rank, the sums of the version's tensors, read back (and verified) from the tiers."""
    tiers = [open_tier(loc) for loc in locations if loc.startswith("file://") or os.path.isdir(loc)]

    def load(located: Located) -> tuple[int, Any]:
        manifest = first_manifest(located)
        assert manifest is not None
        return manifest.world_size, assemble(Comm.solo(), manifest, located.sources)

    found = restore_newest(Comm.solo(), lambda: tiers, load, step=step, missing_ok=False)
    assert found is not None
    world, tree = found[1]
    full = dict(flatten(tree))
    shard = full.pop("shard")
    common = {k: digest(v) for k, v in full.items()}
    return {r: {**common, "shard": digest(shard[r * ROWS : (r + 1) * ROWS])} for r in range(world)}


def deep_check(locations: Sequence[str], step: int, journals: Journals) -> str | None:
    """None if every rank's tensors of `step` are bitwise what the job recorded."""
    per_rank = version_sums(locations, step)
    for rank, got in per_rank.items():
        problem = compare(got, journals.expected.get((step, rank), []))
        if problem:
            return f"rank {rank}: {problem}"
    return None
