"""What a rank holds of each tensor-like leaf: its local data and where it sits globally."""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ckpt._keys import KeyPath
from ckpt.restore.torch_dtypes import TORCH_TO_ZARR, ZARR_TO_TORCH
from ckpt.shard import Shard
from ckpt.store.errors import UnsupportedStateError
from ckpt.store.layout import REPLICATE, Mesh
from ckpt.store.manifest import MAX_NDIM

__all__ = [
    "TENSOR_LIKE",
    "TORCH_TO_ZARR",
    "ZARR_TO_TORCH",
    "ARRAY_TYPES",
    "Described",
    "Describer",
    "LocalPiece",
    "LocalSpec",
    "describe",
    "is_tensor_like",
]


@dataclass(slots=True, eq=False)
class LocalPiece:
    """A rank's view of one leaf; not changed once made. (Not frozen: a frozen dataclass's
    __init__ costs ~0.5 us more per object, and save() makes one per tensor.)"""

    data: torch.Tensor  # the local tensor (plain, never a DTensor)
    data_type: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]  # of `data`
    # How the other ranks' pieces are known when the layout is planned: from a DTensor's
    # mesh and placements ("mesh"), from every holder's listed region ("listed": hand-made
    # shards, unusual placements), or as a whole array its rank group holds ("plain").
    kind: str = "plain"
    mesh: Mesh | None = None
    placements: tuple[int, ...] = ()


try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


TENSOR_LIKE = (torch.Tensor, Shard, np.ndarray)  # what a state stores as an array (DTensor is a Tensor)
# The leaf types a state_dict() holds, whose JSON node is an array reference and nothing
# else ({TENSOR: name}): ckpt._tree.EncodeMemo finds a mapping of them again by its keys.
ARRAY_TYPES = frozenset(t for t in (torch.Tensor, DTensor) if t is not None)


def is_tensor_like(value: Any) -> bool:
    return isinstance(value, TENSOR_LIKE)


@functools.lru_cache(maxsize=1 << 10)
def _mesh_of(device_mesh: Any) -> Mesh:
    """A DeviceMesh as plain data (cached: one object per mesh, so a plan sent to other
    ranks carries each mesh's rank list once)."""
    ranks = device_mesh.mesh
    return Mesh(tuple(int(n) for n in ranks.shape), tuple(int(r) for r in ranks.flatten().tolist()))


def _mesh_placements(placements: tuple[Any, ...]) -> tuple[int, ...] | None:
    """Shard(d) -> d and Replicate -> REPLICATE; None when some placement is another kind
    (a strided shard): such arrays are planned from their listed regions."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    out = []
    for p in placements:
        if type(p) is DShard:
            out.append(p.dim)
        elif type(p) is Replicate:
            out.append(REPLICATE)
        else:
            return None
    return tuple(out)


_DTensorLayout = tuple[tuple[int, ...], str, Mesh | None, tuple[int, ...]]


@functools.lru_cache(maxsize=1 << 16)
def _dtensor_layout(shape: tuple[int, ...], device_mesh: Any, placements: tuple[Any, ...]) -> _DTensorLayout | None:
    """Where this rank's piece of a DTensor starts, and how the plan learns the other
    pieces: (offsets, "mesh", its Mesh, placements as dims) or (offsets, "listed", None,
    ()); None for a Partial placement. Cached: a pure function of shape and layout, and one
    lookup per leaf (DeviceMesh and placements hash in Python; isinstance on placements
    alone costs ~50 us)."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in placements):
        return None
    _, found = compute_local_shape_and_global_offset(torch.Size(shape), device_mesh, placements)
    offsets = tuple(int(o) for o in found)
    placed = _mesh_placements(placements)
    if placed is None:
        if not _one_box(shape, device_mesh, placements):
            return offsets, "scattered", None, ()
        return offsets, "listed", None, ()
    return offsets, "mesh", _mesh_of(device_mesh), placed


def _one_box(shape: tuple[int, ...], device_mesh: Any, placements: tuple[Any, ...]) -> bool:
    """Whether this rank's piece is one box of the global array: along each dimension, the
    global indices of its elements one run. A strided shard (torch's _StridedShard) is so
    under FSDP2 with TP, not where it comes from flattening a Shard(1) DTensor (every
    split_factor-th run of rows). torch's own walk of the placements, which gives the
    indices (compute_local_shape_and_global_offset keeps only the first)."""
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    coordinate = device_mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: an empty piece
        return True
    local = list(shape)
    indices: dict[int, Any] = {}
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, (DShard, _StridedShard)):
            continue
        size, index = _get_shard_size_and_offsets(
            local[p.dim], device_mesh.size(mesh_dim), coordinate[mesh_dim], p, indices.get(p.dim), shape[p.dim], False
        )
        local[p.dim], indices[p.dim] = size, index
    return all(
        local[d] <= 1 or bool((index[1 : local[d]] - index[: local[d] - 1] == 1).all()) for d, index in indices.items()
    )


def _named(key: KeyPath | tuple[Any, ...] | str) -> str:
    """A leaf's name in an error: a key path rendered as state[...] (a plain tuple is one)."""
    return str(KeyPath(key)) if type(key) is tuple else str(key)


# Subclasses wrapping other tensors whose value is one of them, by (module, class name) ->
# its attribute: the rest is derived from it. torchao's float8 training keeps a weight so
# (the local shard of an FSDP2 parameter's DTensor), with a scale recomputed from it.
_VALUE_INSIDE = {("torchao.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor"): "_tensor"}


def _value_of(data: torch.Tensor) -> torch.Tensor:
    """The tensor holding a wrapper's value (_VALUE_INSIDE), saved and restored in its place;
    `data` itself otherwise."""
    attr = _VALUE_INSIDE.get((type(data).__module__, type(data).__qualname__))
    inner = getattr(data, attr, None) if attr is not None else None
    return inner if isinstance(inner, torch.Tensor) and inner.shape == data.shape else data


def _refuse_unusual(data: torch.Tensor, key: KeyPath | tuple[Any, ...] | str) -> None:
    if data.is_nested:
        raise UnsupportedStateError(f"{_named(key)}: nested tensors cannot be checkpointed; save their components")
    if data.layout != torch.strided:
        raise UnsupportedStateError(f"{_named(key)}: {data.layout} tensors cannot be checkpointed; save a dense copy")
    if data.is_quantized:
        raise UnsupportedStateError(
            f"{_named(key)}: quantized tensors cannot be checkpointed; save int_repr() and the scales"
        )
    if data.is_meta:
        raise UnsupportedStateError(f"{_named(key)}: a meta tensor has no data to checkpoint")
    if type(data) is not torch.Tensor and data.numel() and not data.data_ptr():
        # A subclass wrapping other tensors (torchao's, a DTensor's wrapped local shard): its
        # copy into plain memory is whatever its __torch_dispatch__ makes of copy_ (one inner
        # tensor, a dequantized value), which a restore could not put back bitwise.
        raise UnsupportedStateError(
            f"{_named(key)}: a {type(data).__qualname__} wraps other tensors and has no memory of its own; "
            "checkpoint its inner tensors (or a plain copy of its value) instead"
        )


def _check_ndim(shape: tuple[int, ...], key: KeyPath | tuple[Any, ...] | str) -> None:
    if len(shape) > MAX_NDIM:  # (a manifest holding more would not parse)
        raise UnsupportedStateError(f"{_named(key)}: {len(shape)} dimensions; a tensor may have at most {MAX_NDIM}")


_ZEROS = tuple((0,) * n for n in range(16))  # a plain tensor's offsets, shared (not one tuple per save)


def describe(value: Any, key: KeyPath | tuple[Any, ...] | str) -> LocalPiece:
    """The local piece of a tensor, DTensor, Shard or ndarray; refuses what cannot be stored.
    `key` names the leaf in errors (a key path, as a tuple, is rendered only for one)."""
    if type(value) is torch.Tensor:  # most leaves (a state_dict()'s): the checks below, inlined
        if value.is_nested or value.layout != torch.strided or value.is_quantized or value.is_meta:
            _refuse_unusual(value, key)
        dtype = value.dtype
        if dtype not in TORCH_TO_ZARR:
            raise UnsupportedStateError(f"{_named(key)}: dtype {dtype} is not supported")
        shape = tuple(value.shape)
        if len(shape) < len(_ZEROS):
            offsets = _ZEROS[len(shape)]
        else:
            _check_ndim(shape, key)
            offsets = (0,) * len(shape)
        return LocalPiece(value.detach() if value.requires_grad else value, TORCH_TO_ZARR[dtype], shape, offsets, shape)
    kind = "plain"
    mesh: Mesh | None = None
    placed: tuple[int, ...] = ()
    if isinstance(value, torch.Tensor) and not (DTensor is not None and isinstance(value, DTensor)):
        data = _value_of(value)
        _refuse_unusual(data, key)  # before .shape, which a nested tensor does not have
        shape = tuple(data.shape)
        offsets = (0,) * len(shape)
    elif isinstance(value, Shard):
        data, shape, offsets = value.local_tensor, tuple(value.global_shape), tuple(value.offsets)
        kind = "listed"
    elif DTensor is not None and isinstance(value, DTensor):
        # The local tensor without to_local(): an autograd op per call, and describe() runs for
        # every tensor of every save.
        local = getattr(value, "_local_tensor", None)
        data = _value_of(local if isinstance(local, torch.Tensor) else value.to_local())
        shape = tuple(value.shape)
        found = _dtensor_layout(shape, value.device_mesh, tuple(value.placements))
        if found is None:
            raise UnsupportedStateError(f"{_named(key)}: DTensor with Partial placement must be reduced before saving")
        offsets, kind, mesh, placed = found
        if kind == "scattered":
            raise UnsupportedStateError(
                f"{_named(key)}: this rank's piece of the DTensor (placements {list(value.placements)}) is not "
                "one block of the global tensor (a strided shard, as flattening a Shard(1) DTensor makes); "
                "checkpoint the DTensor before it was flattened, or redistribute it to Shard or Replicate"
            )
    elif isinstance(value, np.ndarray):
        try:
            # (np.require, not np.ascontiguousarray: that makes a 0-d array 1-d)
            data = torch.from_numpy(
                np.require(value, requirements="C").astype(value.dtype.newbyteorder("="), copy=False)
            )
        except TypeError:
            raise UnsupportedStateError(f"{_named(key)}: numpy dtype {value.dtype} cannot be checkpointed") from None
        shape, offsets = tuple(data.shape), (0,) * data.dim()
    else:
        raise UnsupportedStateError(f"{_named(key)}: not a tensor")
    if data is not value:  # (a plain tensor was checked above)
        _refuse_unusual(data, key)
    if data.dtype not in TORCH_TO_ZARR:
        raise UnsupportedStateError(f"{_named(key)}: dtype {data.dtype} is not supported")
    _check_ndim(shape, key)
    # Detached only where autograd tracks it: a state_dict() tensor is detached already, and
    # a second tensor object per leaf would cost its allocation here and its deallocation
    # (which releases the GIL) when the save's objects are freed.
    local = data.detach() if data.requires_grad else data
    local_shape = shape if data is value else tuple(data.shape)
    return LocalPiece(local, TORCH_TO_ZARR[data.dtype], shape, offsets, local_shape, kind, mesh, placed)


# What changes a rank's layout: name, dtype, global shape, offsets, local shape, kind,
# placements, mesh (by identity: _mesh_of keeps one object per DeviceMesh), and whether
# the tensor is on a GPU (the staging buffer is pinned for those, and the layout's staging
# tasks keep views of it: a new buffer comes with a new layout).
LocalSpec = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...], str, tuple[int, ...], int, bool]
_NO_SPEC: LocalSpec = ("", "", (), (), (), "", (), 0, False)  # (its dtype is None: never used)


class Described:
    """A save's leaves described: their names and local tensors, in the state's order, each
    one's spec, the hash of the specs (the rank's layout signature), and whether any piece is
    on a GPU. `pieces` (by name) are made only where asked for: a save of an unchanged layout
    needs the tensors alone."""

    __slots__ = ("names", "data", "specs", "signature", "cuda", "_pieces", "_meshes")

    def __init__(
        self,
        names: list[str],
        data: list[torch.Tensor],
        specs: list[LocalSpec],
        signature: int,
        cuda: bool,
        pieces: dict[str, LocalPiece] | None = None,
        meshes: list[Mesh | None] | None = None,
    ) -> None:
        self.names, self.data, self.specs, self.signature, self.cuda = names, data, specs, signature, cuda
        self._pieces = pieces
        self._meshes = meshes

    @property
    def pieces(self) -> dict[str, LocalPiece]:
        """Each leaf's piece, by name (made from the specs and each leaf's Mesh where the save
        did not make them)."""
        if self._pieces is None:
            meshes = self._meshes or itertools.repeat(None)
            self._pieces = {
                spec[0]: LocalPiece(data, spec[1], spec[2], spec[3], spec[4], spec[5], mesh, spec[6])
                for spec, data, mesh in zip(self.specs, self.data, meshes)
            }
        return self._pieces


# What a save of an unchanged layout checks of each leaf, in one C loop per kind: its dtype,
# shape and whether it is on a GPU as before (as the per-leaf check below), and not made
# unusual (autograd, nested, sparse, meta); of a DTensor, that of its local tensor, and its
# mesh, placements and global shape. A strided nested tensor has no shape: the getter
# raises, and the leaves are described one by one.
_PLAIN_CHECK = operator.attrgetter("dtype", "shape", "is_cuda", "requires_grad", "is_nested", "layout", "is_meta")
_DTENSOR_CHECK = operator.attrgetter(
    "_spec.mesh",  # (DTensor.device_mesh and .placements are these, through a Python property)
    "_spec.placements",
    "shape",
    *(f"_local_tensor.{a}" for a in ("dtype", "shape", "is_cuda", "requires_grad", "is_nested", "layout", "is_meta")),
)
_LOCAL = operator.attrgetter("_local_tensor")
_JUST_TENSORS = {torch.Tensor}


class _Unchanged(NamedTuple):
    """What the last save's leaves were, where each was a plain tensor or a DTensor whose
    local tensor is one, none tracked by autograd: each leaf's type, the places of the
    DTensors and of the others, their checks (as above) and each leaf's Mesh. Holds no
    tensor of the state."""

    types: list[type]
    dtensors_at: list[int]
    plain_at: list[int] | None  # None: every leaf is a plain tensor
    dtensors: list[tuple[Any, ...]]
    plain: list[tuple[Any, ...]]
    meshes: list[Mesh | None] | None  # None: no leaf is a DTensor


class _Known(NamedTuple):
    """What lets a leaf's next save skip describe(): its local tensor's dtype, and for a
    DTensor what describe() derives its piece's place from (its mesh, placements and global
    shape, as a tuple) and the Mesh it found. Holds no tensor of the state."""

    dtype: torch.dtype
    dtensor_key: tuple[Any, ...] | None = None
    mesh: Mesh | None = None


def _known(value: Any, piece: LocalPiece) -> _Known | None:
    """The check a described leaf's next save makes instead of describe(), where it can."""
    if type(value) is torch.Tensor:
        return _Known(value.dtype) if piece.data is value and piece.kind == "plain" else None
    if DTensor is not None and type(value) is DTensor:
        return _Known(piece.data.dtype, (value.device_mesh, value.placements, value.shape), piece.mesh)
    return None


class Describer:
    """describe() for every leaf of a save, remembering what it found (names, specs,
    dtypes, a DTensor's mesh, placements and shape: no tensor of the state) for the next
    save.

    A save named as the last one, whose leaves were all plain tensors or DTensors over plain
    local tensors then (none tracked by autograd) and are again, of the same dtypes, shapes,
    devices, meshes and placements, is checked by C loops over its leaves (their types, an
    attrgetter map per kind and list comparisons) and keeps the last save's specs and
    signature: no object is made per leaf (~0.3-0.5 us a plain leaf and ~0.6 us a DTensor,
    against ~0.8 and ~1.6 us in the loop below). Otherwise each leaf named as in the last
    save that is again a plain tensor of the same dtype, shape and device, or a DTensor on
    the same mesh with the same placements and global shape whose local tensor is, is
    checked in one expression and keeps its spec; where every leaf does, the signature is
    the last one, not hashed again. Any other leaf goes through describe()."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._specs: list[LocalSpec] = []
        self._known: list[_Known | None] = []
        self._signature = 0
        self._cuda = False
        self._unchanged: _Unchanged | None = None  # where each leaf of the last save could be checked in C

    def _again(self, values: list[Any]) -> list[torch.Tensor] | None:
        """The save's local tensors if its leaves are as the last save's (_Unchanged), else None."""
        last = self._unchanged
        if last is None or list(map(type, values)) != last.types:
            return None
        try:
            if last.plain_at is None:
                return values if list(map(_PLAIN_CHECK, values)) == last.plain else None
            dtensors = list(map(values.__getitem__, last.dtensors_at))
            local = list(map(_LOCAL, dtensors))
            if (
                set(map(type, local)) != _JUST_TENSORS
                or list(map(_DTENSOR_CHECK, dtensors)) != last.dtensors
                or list(map(_PLAIN_CHECK, map(values.__getitem__, last.plain_at))) != last.plain
            ):
                return None
        except RuntimeError:  # a strided nested tensor's shape: described below, and refused
            return None
        data = list(values)
        for i, t in zip(last.dtensors_at, local):
            data[i] = t
        return data

    @staticmethod
    def _unchanged_of(values: list[Any], knowns: list[_Known | None]) -> _Unchanged | None:
        """What the next save's _again() compares with, where every leaf can be checked so."""
        if any(k is None for k in knowns):
            return None
        dtensors_at = [i for i, k in enumerate(knowns) if k is not None and k.dtensor_key is not None]
        if not dtensors_at:  # (a known plain leaf is not tracked by autograd: it is its own data)
            return _Unchanged(list(map(type, values)), [], None, [], list(map(_PLAIN_CHECK, values)), None)
        local = [values[i]._local_tensor for i in dtensors_at]
        if any(type(t) is not torch.Tensor or t.requires_grad for t in local):  # (those are detached, each save)
            return None
        taken = set(dtensors_at)
        plain_at = [i for i in range(len(values)) if i not in taken]
        return _Unchanged(
            list(map(type, values)),
            dtensors_at,
            plain_at,
            [_DTENSOR_CHECK(values[i]) for i in dtensors_at],
            [_PLAIN_CHECK(values[i]) for i in plain_at],
            [None if k is None else k.mesh for k in knowns],
        )

    def __call__(self, paths: dict[str, tuple[Any, ...]], values: list[Any]) -> Described:
        names = list(paths)
        again = names == self._names
        if again and (same := self._again(values)) is not None:
            assert self._unchanged is not None
            return Described(names, same, self._specs, self._signature, self._cuda, meshes=self._unchanged.meshes)
        pieces: dict[str, LocalPiece] = {}
        data: list[torch.Tensor] = []
        specs: list[LocalSpec] = []
        knowns: list[_Known | None] = []
        fresh = not again  # whether some leaf is described anew
        cuda = False
        strided, tensor, dtensor = torch.strided, torch.Tensor, DTensor
        known_all = zip(self._specs, self._known) if again else itertools.repeat((_NO_SPEC, None))
        for (name, path), value, (spec, known) in zip(paths.items(), values, known_all):
            # Each kind's checks are written out in one expression, not shared through a
            # call: this loop runs for every leaf of every save.
            if (
                known is not None
                and known.dtensor_key is None
                and type(value) is tensor
                and value.dtype is known.dtype
                and not value.is_nested
                and value.layout is strided
                and not value.is_meta
                and not value.requires_grad
                and value.is_cuda is spec[8]
                and value.shape == spec[4]
            ):
                p = LocalPiece(value, spec[1], spec[2], spec[3], spec[4])
            elif (
                known is not None
                and known.dtensor_key is not None
                and type(value) is dtensor
                and (value.device_mesh, value.placements, value.shape) == known.dtensor_key
                and type(local := value._local_tensor) is tensor
                and local.dtype is known.dtype
                and not local.is_nested
                and local.layout is strided
                and not local.is_meta
                and local.is_cuda is spec[8]
                and local.shape == spec[4]
            ):
                # (detached where autograd tracks it, as describe() does)
                own = local.detach() if local.requires_grad else local
                p = LocalPiece(own, spec[1], spec[2], spec[3], spec[4], spec[5], known.mesh, spec[6])
            else:
                fresh = True
                p = describe(value, path)
                spec = (
                    name,
                    p.data_type,
                    p.global_shape,
                    p.offsets,
                    p.shape,
                    p.kind,
                    p.placements,
                    id(p.mesh),
                    p.data.is_cuda,
                )
                known = _known(value, p)
            pieces[name] = p
            data.append(p.data)
            specs.append(spec)
            knowns.append(known)
            cuda |= spec[8]
        signature = hash(tuple(specs)) if fresh else self._signature
        self._names, self._specs, self._known, self._signature, self._cuda = names, specs, knowns, signature, cuda
        self._unchanged = self._unchanged_of(values, knowns)
        return Described(names, data, specs, signature, cuda, pieces)
