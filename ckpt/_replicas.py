"""Plain tensors that pipeline stages hold under one positional name, compared by value at
the first save of a layout.

A plain tensor is taken to be replicated and written once. Ranks with the same plain
arrays (one signature: ckpt._plan) are data-parallel replicas and are not compared: their
buffers may differ (BatchNorm statistics under DDP), and a save has always kept one
replica's. Ranks of different groups that share a name under a positional key (an integer
key or a list index) are what pipeline stages make: an optimizer's state is keyed 0, 1, ...
by parameter on every stage, and one stage's values would be saved for all of them. So the
lowest rank of each group digests every such tensor it holds, and one all-reduce of two
int64 per array that groups share (O(arrays) bytes, whatever the world size) tells every
rank whether the digests agree; different values are a StateMismatchError on every rank.
Names under string keys (a module's state dict, an optimizer state keyed by parameter
name) are not compared: a rank holding one tensor more than the others (a metric on rank
0) forms a group of its own, and its replicas' buffers may still differ from the others'.
A job whose ranks are all replicas of one another has no such array and makes no
collective.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence

import torch
import xxhash

from ckpt._dist import Comm
from ckpt._tensors import LocalPiece
from ckpt.store.errors import StateMismatchError
from ckpt.store.host_arrays import host_memory
from ckpt.store.layout import REPLICATE, ArrayPlan, MeshSpec

__all__ = ["check_shared_copies", "digest", "shared_across_groups"]

_SLICE = 64 << 20  # bytes hashed per slice (a CUDA tensor is copied to the host slice by slice)
_NONE = -(1 << 62)  # what a rank that holds no digest of an array gives the all-reduce


def shared_across_groups(plans: Sequence[ArrayPlan], signatures: Sequence[int]) -> list[int]:
    """The places in `plans` of the arrays that ranks of more than one signature group hold
    as copies (a 1-d replicated mesh, as ckpt._plan.merge makes of plain arrays). The same
    on every rank, as the plans and signatures are."""
    spans: dict[int, bool] = {}  # by mesh object: merge makes one per holder set
    out = []
    for i, plan in enumerate(plans):
        spec = plan.spec
        if not isinstance(spec, MeshSpec) or spec.placements != (REPLICATE,):
            continue
        mesh = spec.mesh
        if id(mesh) not in spans:
            first = signatures[mesh.ranks[0]]
            spans[id(mesh)] = any(signatures[r] != first for r in mesh.ranks)
        if spans[id(mesh)]:
            out.append(i)
    return out


def digest(t: torch.Tensor) -> int:
    """xxh3 of the tensor's bytes in row-major order, as a non-negative int below 2**62."""
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)  # (the values, as staging copies them)
    if not flat.is_contiguous():  # (reshape copies a tensor it cannot view; a view may still stride)
        flat = flat.contiguous()
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    h = xxhash.xxh3_64()
    for start in range(0, raw.numel(), _SLICE):
        part = raw[start : start + _SLICE]
        h.update(host_memory(part.cpu() if part.is_cuda else part))
    h.update(repr(tuple(t.shape)).encode())
    return h.intdigest() >> 2


def check_shared_copies(
    ctl: Comm,
    plans: Sequence[ArrayPlan],
    pieces: Mapping[str, LocalPiece],
    signatures: Sequence[int],
    positional: Container[str],
) -> None:
    """Collective (when the job has arrays that groups share): raise StateMismatchError on
    every rank if ranks of different groups hold different values under one plain array's
    name that is `positional` (its key path holds an int key or a list index) on them."""
    shared = shared_across_groups(plans, signatures)
    if not shared:
        return
    speaks = signatures.index(signatures[ctl.rank]) == ctl.rank
    mine = [_NONE] * len(shared)
    if speaks:
        for k, i in enumerate(shared):
            name = plans[i].spec.name
            piece = pieces.get(name)
            if piece is not None and piece.kind == "plain" and name in positional:
                mine[k] = digest(piece.data)
    highest = ctl.reduce_max([*mine, *(-d if d != _NONE else _NONE for d in mine)])
    n = len(shared)
    # (_NONE: no rank digested it, a name under string keys, or a DTensor's)
    bad = next((k for k in range(n) if highest[k] != _NONE and highest[k] != -highest[n + k]), None)
    if bad is None:
        return
    # Rare: which ranks, so that the error names two of them (one int per rank).
    held = ctl.all_gather_int(mine[bad])
    a = held.index(highest[bad])
    b = held.index(-highest[n + bad])
    a, b = min(a, b), max(a, b)
    name = plans[shared[bad]].spec.name
    raise StateMismatchError(
        f"{name}: ranks {a} and {b} hold different values under this name, and different other tensors "
        "(pipeline stages?); a plain tensor is taken to be replicated and is written once, so give each "
        "stage's tensors names of their own (an optimizer's state is keyed 0, 1, ... on every stage: save "
        "each stage's optimizer under a key of its own)"
    )
