"""The first save of a layout: who holds what, agreed without any rank learning ranks x arrays.

Four collectives, only when some rank's layout changed since its last save (and a fifth
where ranks of different groups share a plain array's name: ckpt._replicas):
1. an all-gather of one int64 per rank: the signature of the rank's plain arrays (whole
   tensors, held alike by every rank of a group: data-parallel replicas, a pipeline
   stage). Ranks with equal signatures hold the same plain arrays; the lowest of them
   speaks for its group.
2. an all-to-all of each rank's listed regions (hand-made shards: only their holder knows
   them) to the owner of their array (a hash of its name over the ranks), which checks and
   plans the arrays it owns (`plan_owned`);
3. a gather to rank 0 of each rank's `Announcement`: the mesh arrays whose mesh it leads
   (a DTensor's pieces follow from its mesh and placements, so one rank describes it for
   all), its group's plain arrays if it speaks for the group, and the plans of the listed
   arrays it owns (`Owned`);
4. a broadcast of rank 0's plans (store.layout: O(arrays), writers as runs), or of the
   error that stopped it, which every rank then raises.

Rank 0 handles O(arrays + ranks); an owner the regions of its arrays (O(ranks) for an
array every rank holds a piece of); every rank O(arrays), and its own chunks come from
the plans' runs (`ArrayPlan.chunks_of`).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from ckpt._dist import Comm
from ckpt._replicas import check_shared_copies
from ckpt._tensors import LocalPiece
from ckpt.store import errors
from ckpt.store.errors import CkptError, StateMismatchError
from ckpt.store.layout import (
    REPLICATE,
    ArrayPlan,
    ArraySpec,
    HeldRegion,
    Mesh,
    MeshSpec,
    plan_arrays,
)
from ckpt.store.zarr_meta import DOCUMENT_FORMAT

__all__ = [
    "Announcement",
    "Owned",
    "announce",
    "merge",
    "owner_of",
    "plan_owned",
    "plans_of",
    "plain_signature",
    "agree_plans",
]

PlainEntry = tuple[str, str, tuple[int, ...]]  # name, dtype, shape
ListedEntry = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # name, dtype, shape, offsets, local


Claim = tuple[str, str, tuple[int, ...], int]  # name, dtype, shape, the first rank that holds it


@dataclass(frozen=True, slots=True)
class Owned:
    """What the owner of some listed arrays tells rank 0: each array's claim (rank 0 checks
    it against the other kinds), their plans, or why they cannot be planned."""

    claims: tuple[Claim, ...] = ()
    plans: tuple[ArrayPlan, ...] = ()
    error: tuple[str, str] | None = None  # (error type, message)


@dataclass(frozen=True, slots=True)
class Announcement:
    """What one rank tells rank 0 on the first save of a layout."""

    rank: int
    meshed: tuple[MeshSpec, ...]  # the mesh arrays whose mesh this rank leads (its lowest rank)
    listed: tuple[ListedEntry, ...]  # this rank's listed regions (sent to their owners, not to rank 0)
    plain: tuple[PlainEntry, ...] | None  # its group's plain arrays, when it speaks for the group
    error: str | None = None  # why this rank cannot describe its state
    owned: Owned | None = None  # the listed arrays this rank owns


def owner_of(name: str, world: int) -> int:
    """The rank that plans listed array `name`: the same on every rank, spread over the ranks."""
    return zlib.crc32(name.encode()) % world


def plan_owned(received: Iterable[tuple[int, Sequence[ListedEntry]]], split_bytes: int) -> Owned:
    """An owner's plans of the listed arrays whose regions it received ((sender, its
    entries), senders ascending), with each array's claim; a disagreement or a failed plan
    as the error."""
    claims = _Claims()
    held: dict[str, list[HeldRegion]] = {}

    def claimed() -> tuple[Claim, ...]:
        return tuple((n, *claims.first[n][1:3], claims.first[n][3]) for n in held)

    # Every failure goes to rank 0 in the Owned: this rank must reach the gather.
    try:
        for rank, entries in received:
            for name, dtype, shape, offsets, local in entries:
                claims.claim(name, "listed", dtype, shape, rank)
                held.setdefault(name, []).append(HeldRegion(rank, offsets, local))
        specs = [ArraySpec(n, claims.first[n][1], claims.first[n][2], tuple(regions)) for n, regions in held.items()]
        plans = plan_arrays(specs, split_bytes=split_bytes)
    except Exception as e:  # noqa: BLE001 - every rank raises it (a bug as a CkptError)
        return Owned(claimed(), (), (type(e).__name__ if isinstance(e, CkptError) else "CkptError", str(e)))
    return Owned(claimed(), tuple(plans))


def plain_signature(pieces: Mapping[str, LocalPiece]) -> int:
    """A digest of the rank's plain arrays (names, dtypes, shapes), as a non-negative int64."""
    entries = sorted((n, p.data_type, p.global_shape) for n, p in pieces.items() if p.kind == "plain")
    return xxhash.xxh3_64_intdigest(repr(entries).encode()) >> 1


@functools.lru_cache(maxsize=1 << 10)
def _coordinate(mesh: Mesh, rank: int) -> tuple[int, ...]:
    flat = mesh.ranks.index(rank)
    out = []
    for k in reversed(mesh.shape):
        flat, c = divmod(flat, k)
        out.append(c)
    return tuple(reversed(out))


def _piece_at(
    shape: tuple[int, ...], mesh: Mesh, placements: tuple[int, ...], rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of the piece `rank` holds, by the rule store.layout plans with."""
    coord = _coordinate(mesh, rank)
    offsets, sizes = [0] * len(shape), list(shape)
    for m, d in enumerate(placements):
        if d != REPLICATE:
            size = -(-sizes[d] // mesh.shape[m])
            start = min(coord[m] * size, sizes[d])
            offsets[d] += start
            sizes[d] = max(0, min(size, sizes[d] - start))
    return tuple(offsets), tuple(sizes)


def announce(rank: int, pieces: Mapping[str, LocalPiece], speaks: bool) -> Announcement:
    """This rank's announcement. A mesh piece that is not where the layout rule puts it is
    refused here, before anything is planned from the rule."""
    meshed = []
    listed = []
    for name, p in pieces.items():
        local = tuple(p.data.shape)
        if p.kind == "mesh" and p.mesh is not None:
            if rank not in p.mesh.ranks:
                return Announcement(rank, (), (), None, f"{name}: rank {rank} is not in its DTensor's mesh")
            want = _piece_at(p.global_shape, p.mesh, p.placements, rank)
            if want[1] != local or (all(want[1]) and want[0] != p.offsets):
                return Announcement(
                    rank,
                    (),
                    (),
                    None,
                    f"{name}: rank {rank} holds {list(local)} at {list(p.offsets)}, but its DTensor placements "
                    f"{p.placements} put {list(want[1])} at {list(want[0])} there",
                )
            if min(p.mesh.ranks) == rank:
                meshed.append(MeshSpec(name, p.data_type, p.global_shape, p.mesh, p.placements))
        elif p.kind == "listed":
            listed.append((name, p.data_type, p.global_shape, p.offsets, local))
    plain = None
    if speaks:
        plain = tuple(sorted((n, p.data_type, p.global_shape) for n, p in pieces.items() if p.kind == "plain"))
    return Announcement(rank, tuple(meshed), tuple(listed), plain)


class _Claims:
    """Who declared each array first, so that a disagreement names both ranks."""

    def __init__(self) -> None:
        self.first: dict[str, tuple[str, str, tuple[int, ...], int]] = {}

    def claim(self, name: str, kind: str, dtype: str, shape: tuple[int, ...], rank: int) -> None:
        seen = self.first.setdefault(name, (kind, dtype, shape, rank))
        if seen[:3] == (kind, dtype, shape):
            return
        fkind, fdtype, fshape, frank = seen
        if fkind != kind:
            raise StateMismatchError(f"{name}: rank {rank} holds it as a {kind} array, rank {frank} as a {fkind} array")
        raise StateMismatchError(
            f"{name}: rank {rank} holds {dtype}{list(shape)}, rank {frank} holds {fdtype}{list(fshape)}"
        )


def merge(announcements: Sequence[Announcement], signatures: Sequence[int]) -> list[ArraySpec | MeshSpec]:
    """Rank 0: every array of the job to plan here, from the announcements and the plain
    signatures (not those their owners planned: their claims are checked against the
    others)."""
    failures = [a for a in announcements if a.error]
    if failures:
        raise StateMismatchError("; ".join(str(a.error) for a in failures))
    groups: dict[int, list[int]] = {}
    for rank, sig in enumerate(signatures):
        groups.setdefault(sig, []).append(rank)
    claims = _Claims()
    specs: dict[str, ArraySpec | MeshSpec] = {}
    held: dict[str, list[HeldRegion]] = {}
    plain: dict[str, list[int]] = {}  # name -> the signatures of the groups holding it
    for a in announcements:
        for m in a.meshed:
            claims.claim(m.name, "mesh", m.data_type, m.shape, a.rank)
            known = specs.get(m.name)
            if known is not None and known != m:
                first = claims.first[m.name][3]
                raise StateMismatchError(f"{m.name}: ranks {first} and {a.rank} place it on different DTensor meshes")
            specs[m.name] = m
        for name, dtype, shape, offsets, local in a.listed:
            claims.claim(name, "listed", dtype, shape, a.rank)
            held.setdefault(name, []).append(HeldRegion(a.rank, offsets, local))
            specs.setdefault(name, ArraySpec(name, dtype, shape, ()))
        for name, dtype, shape in a.plain or ():
            claims.claim(name, "plain", dtype, shape, a.rank)
            plain.setdefault(name, []).append(signatures[a.rank])
            specs.setdefault(name, ArraySpec(name, dtype, shape, ()))
        for name, dtype, shape, first in a.owned.claims if a.owned is not None else ():
            claims.claim(name, "listed", dtype, shape, first)
    # An owner's error after every claim: an array held as two kinds is named as such, not
    # as the gaps its listed regions alone leave.
    for a in announcements:
        if a.owned is not None and a.owned.error is not None:
            raise _error(a.owned.error)
    meshes: dict[tuple[int, ...], Mesh] = {}  # one object per holder set: sent once
    out: list[ArraySpec | MeshSpec] = []
    for name, spec in specs.items():
        if name in held:
            assert isinstance(spec, ArraySpec)
            out.append(ArraySpec(name, spec.data_type, spec.shape, tuple(held[name])))
        elif name in plain:
            key = tuple(sorted(set(plain[name])))
            if key not in meshes:
                ranks = tuple(sorted(r for sig in key for r in groups[sig]))
                meshes[key] = Mesh((len(ranks),), ranks)
            out.append(MeshSpec(name, spec.data_type, spec.shape, meshes[key], (REPLICATE,)))
        else:
            out.append(spec)
    return out


Outcome = tuple[list[ArrayPlan] | None, tuple[str, str] | None]  # (plans, (error type, message))


def _error(sent: tuple[str, str]) -> CkptError:
    """An error another rank sent as (type name, message): its ckpt type, else CkptError."""
    kind = getattr(errors, sent[0], CkptError)
    return (kind if isinstance(kind, type) and issubclass(kind, CkptError) else CkptError)(sent[1])


def plans_of(announcements: Sequence[Announcement], signatures: Sequence[int], split_bytes: int) -> list[ArrayPlan]:
    """Rank 0: the plans of every array, sorted by name: those it plans and its owners'."""
    plans = plan_arrays(merge(announcements, signatures), split_bytes=split_bytes)
    plans += [p for a in announcements if a.owned is not None for p in a.owned.plans]
    return sorted(plans, key=lambda p: p.spec.name)


def agree_plans(
    ctl: Comm, pieces: Mapping[str, LocalPiece], split_bytes: int, positional: Container[str] = frozenset()
) -> list[ArrayPlan]:
    """Collective: the plans of the job's layout, the same on every rank; raises alike on every
    rank. `positional`: the names whose key path holds an int key or a list index (compared
    across groups of ranks: ckpt._replicas)."""
    sig = plain_signature(pieces)
    signatures = ctl.all_gather_int(sig)
    try:
        mine = announce(ctl.rank, pieces, signatures.index(sig) == ctl.rank)
    except Exception as e:  # noqa: BLE001 - rank 0 reports it to every rank
        mine = Announcement(ctl.rank, (), (), None, f"rank {ctl.rank}: {type(e).__name__}: {e}")
    # Hand-made shards: each region to its array's owner, never to rank 0 (16,384 ranks
    # x 1,000 tensors would be 16 million regions there).
    by_owner: dict[int, list[ListedEntry]] = {}
    for entry in mine.listed:
        by_owner.setdefault(owner_of(entry[0], ctl.world), []).append(entry)
    received = ctl.all_to_all([by_owner.get(r) for r in range(ctl.world)])
    owned = plan_owned(((r, e) for r, e in enumerate(received) if e), split_bytes)
    got = ctl.gather(dataclasses.replace(mine, listed=(), owned=owned))
    outcome: Outcome = (None, None)
    if got is not None:
        try:
            outcome = (plans_of(got, signatures, split_bytes), None)
        except Exception as e:  # noqa: BLE001 - every rank raises it (a bug as a CkptError)
            outcome = (None, (type(e).__name__ if isinstance(e, CkptError) else "CkptError", str(e)))
    plans: list[ArrayPlan] | None
    plans, error = ctl.broadcast(outcome)
    if error is not None:
        raise _error(error)
    assert plans is not None
    check_shared_copies(ctl, plans, pieces, signatures, positional)
    return plans


def layout_key(plans: Sequence[ArrayPlan], root_groups: Sequence[Sequence[int]]) -> str:
    """What decides the files of a version on each root: every array's name, type, shape,
    chunks and writers, and which ranks write to which root (store.spare reuses a tree only
    for the same key)."""
    h = xxhash.xxh3_128()
    for p in plans:
        h.update(repr((p.spec.name, p.spec.data_type, p.spec.shape, p.chunk_shape, p.runs, p.inline)).encode())
    h.update(repr(tuple(tuple(g) for g in root_groups)).encode())
    h.update(DOCUMENT_FORMAT)  # a spare tree's zarr.json files are then byte for byte this save's
    return h.hexdigest()
