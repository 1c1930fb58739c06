"""ckpt as the storage of torch.distributed.checkpoint (DCP): one argument in code that uses DCP.

    dcp.save(state_dict, storage_writer=ckpt.dcp.StorageWriter("/nvme/run", step))
    dcp.async_save(state_dict, storage_writer=ckpt.dcp.StorageWriter("/nvme/run", step))
    dcp.load(state_dict, storage_reader=ckpt.dcp.StorageReader("/nvme/run"))  # newest intact

What DCP saves becomes an ordinary committed ckpt version: atomic, every byte checksummed,
and listed, verified, inspected, restored, replicated and retained like any other. A
tensor is stored under `tensors/` by its fully qualified name split at its dots
(`model.layers.0.weight` -> `tensors/model/layers/0/weight`); each rank stores the pieces
DCP's plan gives it (DTensor and ShardedTensor shards, and the whole tensors DCP assigns
it) as `ckpt.Shard`s. DCP's "bytes" items (objects DCP serializes itself, with
torch.save) are stored under `bytes/` as opaque uint8 arrays: ckpt never unpickles them;
dcp.load hands them back to DCP's planner, which does, as it does from its own files
(each first checked by torch's weights-only unpickler unless the reader is told to trust
the root: StorageReader).

No DCP metadata file is written: StorageReader builds DCP's Metadata from the manifest,
each tensor one chunk of its whole shape, so DCP plans reads for any layout and ckpt
reads only the bytes each rank asks for (verified, from whichever tier holds them). With
no step, a version with a chunk that no tier holds intact is passed over for the next
older one, as in restore().

The commit: ckpt's commit is collective (every rank's data is durable before any root
publishes), while DCP calls `finish()` on its coordinator alone. So `write_data` saves on
every rank and waits for ckpt's commit: the version is committed when write_data has
returned on every rank, and `finish()` has nothing left to do. A crash before then
leaves no trace of the version among the committed ones.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import threading
import urllib.parse
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _StorageReader
from torch.distributed.checkpoint.storage import StorageWriter as _StorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ckpt import _roots
from ckpt._dist import destroy_comms, make_comm
from ckpt._load import locate, read_agreed
from ckpt._roots import RootSpec
from ckpt._tensors import _dtensor_layout
from ckpt.checkpointer import Checkpointer
from ckpt.config import CheckpointerConfig
from ckpt.restore.execute import ReadRequest, full_tensor
from ckpt.restore.locate import Located
from ckpt.restore.torch_dtypes import ZARR_TO_TORCH
from ckpt.shard import Shard
from ckpt.store.errors import (
    CorruptVersionError,
    RootLockedError,
    StateMismatchError,
    UnsupportedStateError,
    VersionNotFoundError,
)
from ckpt.store.manifest import ArrayEntry, Manifest, escape_component
from ckpt.store.tier import Tier, is_url, open_tier
from ckpt.store.versions import check_step

__all__ = ["StorageWriter", "StorageReader"]

TENSORS = "tensors"
BYTES = "bytes"


def _components(fqn: str) -> list[str]:
    parts = fqn.split(".")
    for p in parts:
        # The name must come back from its array's: a long part is stored hashed, and a
        # "__" prefix escaped (which makes a part of MAX_COMPONENT characters longer).
        if not p or urllib.parse.unquote(escape_component(p)) != p:
            raise UnsupportedStateError(
                f"{fqn!r}: ckpt.dcp stores a name by its dot-separated parts, and {p!r} cannot be one"
            )
    return parts


def array_name(kind: str, fqn: str) -> str:
    """The manifest name of a DCP item: its kind, then its FQN's dot-separated parts."""
    return "/".join([kind, *(escape_component(p) for p in _components(fqn))])


def _fqn(name: str) -> tuple[str, str]:
    kind, _, path = name.partition("/")
    return kind, ".".join(urllib.parse.unquote(p) for p in path.split("/"))


def _put(tree: dict[str, Any], fqn: str, value: Any) -> None:
    *path, leaf = _components(fqn)
    node = tree
    for p in path:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise UnsupportedStateError(f"{fqn!r}: a prefix of it is itself an item")
        node = child
    if leaf in node:
        what = "a prefix of other items" if isinstance(node[leaf], dict) else "given twice on this rank"
        raise UnsupportedStateError(f"{fqn!r} is {what} (ckpt.dcp keeps one piece of a tensor per rank)")
    node[leaf] = value


# DCP saves no RNG state: neither does ckpt here, and a load leaves the RNG alone.
_CONFIG = CheckpointerConfig(capture_rng=False)


def _checkpointer(root: RootSpec, checkpointer: Checkpointer | None, options: dict[str, Any]) -> Checkpointer:
    if checkpointer is not None:
        return checkpointer
    options.setdefault("config", _CONFIG)
    return Checkpointer(root, **options)


@dataclass(slots=True)
class _Unwritten:
    """A Checkpointer a StorageWriter opened, before DCP reached its write_data, the writer
    (weakly: dead once no caller and no DCP save holds it), and the thread DCP's save ran
    on (None until DCP's save calls the writer: storage_meta)."""

    ck: Checkpointer
    writer: weakref.ref[StorageWriter]
    thread: int | None = None


# DCP calls nothing more on a storage writer once its planning fails, so the Checkpointer
# the writer opened would hold the root's lock for the rest of the process (the retry: a
# RootLockedError). Keyed by the writer's token, removed once DCP writes or resets it.
_unwritten: dict[int, _Unwritten] = {}
_unwritten_lock = threading.Lock()
_tokens = itertools.count()


def _close_abandoned() -> bool:
    """Close the Checkpointers of writers whose DCP save ended before writing: those whose
    save ran on this thread, which is now making a new writer, so their dcp.save call has
    returned, and those no one holds any more (a save that failed before it called the
    writer: a Stateful's state_dict() raising). A writer still held that no save has called
    yet, or one an async_save runs on its executor's thread, is left alone. Whether it
    closed any."""
    me = threading.get_ident()
    with _unwritten_lock:
        gone = [k for k, u in _unwritten.items() if u.thread == me or u.writer() is None]
        abandoned = [_unwritten.pop(k).ck for k in gone]
    for ck in abandoned:
        ck.close()
    return bool(abandoned)


def _meshed(planner: SavePlanner) -> dict[str, DTensor]:
    """The DTensors of the state DCP saves (DefaultSavePlanner's flattened state_dict) that
    ckpt plans from their mesh and placements, passed to ckpt as themselves: their layout is
    then announced by one rank per mesh, not as hand-made shards, which every rank lists
    for every tensor (to the arrays' owners: ckpt._plan). Every rank
    holds every DTensor of the state, so each rank passes the same ones, also those whose
    replicated piece DCP's plan gives another rank."""
    found = getattr(planner, "state_dict", None)
    # Only where the local plan holds every item of that state_dict and the global plan
    # keeps them (DefaultSavePlanner's own create_local_plan, create_global_plan and
    # finish_plan): a planner that leaves items out plans them itself, as pieces.
    kind = type(planner)
    own = isinstance(planner, DefaultSavePlanner) and all(
        getattr(kind, f) is getattr(DefaultSavePlanner, f)
        for f in ("create_local_plan", "create_global_plan", "finish_plan")
    )
    if not own or not isinstance(found, dict):
        return {}
    out: dict[str, DTensor] = {}
    for fqn, value in found.items():
        if isinstance(fqn, str) and type(value) is DTensor:
            layout = _dtensor_layout(tuple(value.shape), value.device_mesh, tuple(value.placements))
            if layout is not None and layout[1] == "mesh":
                out[fqn] = value
    return out


def _is_local_piece(data: torch.Tensor, size: tuple[int, ...], offsets: tuple[int, ...], dt: DTensor) -> bool:
    """Whether the data DCP's planner resolved for an item of `dt` is its local piece, as
    ckpt places it (the same tensor, at the same offsets)."""
    local = dt._local_tensor
    layout = _dtensor_layout(tuple(dt.shape), dt.device_mesh, tuple(dt.placements))
    return (
        layout is not None
        and size == tuple(dt.shape)
        and offsets == layout[0]
        and data.dtype == local.dtype
        and data.shape == local.shape
        and data.stride() == local.stride()
        and data.device == local.device
        and data.data_ptr() == local.data_ptr()
    )


def _collective(kwargs: Mapping[str, Any], what: str) -> None:
    """Refuse DCP's use_collectives=False: each rank then saves (loads) its own values under
    every name, where ckpt keeps one copy of a name for every rank."""
    if kwargs.get("use_collectives", True) is False:
        raise ValueError(f"ckpt.dcp does not {what} with use_collectives=False: every rank's values are one job's")


def _no_checkpoint_id(checkpoint_id: Any) -> None:
    if checkpoint_id is not None:
        raise ValueError("ckpt.dcp takes its root (and step) in its constructor, not as DCP's checkpoint_id")


class StorageWriter(_StorageWriter):
    """DCP's StorageWriter onto a ckpt root: the save becomes committed version `step`.

    Construct it on every rank (it opens a Checkpointer, which is collective), or pass an
    open `checkpointer` to reuse. Other keyword arguments go to Checkpointer (by default
    `config=CheckpointerConfig(capture_rng=False)`). With `overwrite`, an existing version
    of the step is replaced; `milestone` marks the version for retention. A `checkpointer`
    passed in is used on the thread that made the writer; `exclusive=True` says that
    nothing else uses it until this save has completed (its future, for async_save: as
    torchtitan's manager, which waits for a save before the next one), so that DCP may
    save on another thread."""

    def __init__(
        self,
        root: RootSpec,
        step: int,
        *,
        checkpointer: Checkpointer | None = None,
        overwrite: bool = False,
        milestone: bool = False,
        exclusive: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        check_step(step)
        self.step = step
        self._thread, self._exclusive = threading.get_ident(), exclusive
        self._overwrite, self._milestone = overwrite, milestone
        self._owned = checkpointer is None
        try:
            self._ck = _checkpointer(root, checkpointer, options)
        except RootLockedError:
            # Every rank: the lock is agreed, and DCP's failure reached every rank alike.
            if not (self._owned and _close_abandoned()):
                raise
            self._ck = _checkpointer(root, checkpointer, options)
        self._token = next(_tokens)
        if self._owned:
            with _unwritten_lock:
                _unwritten[self._token] = _Unwritten(self._ck, weakref.ref(self))

    def close(self) -> None:
        """Release the Checkpointer this writer opened (not one passed in), when DCP will not
        reach write_data and a new writer does not take it for abandoned: an async_save that
        failed on DCP's executor thread, or a save that failed before DCP called the writer
        (a Stateful's state_dict() raising) while the caller still holds the writer.
        write_data closes it itself."""
        if self._owned:
            self._written()
            self._ck.close()

    def _written(self) -> None:
        """DCP reached write_data, or reset() closed the Checkpointer: not abandoned."""
        with _unwritten_lock:
            _unwritten.pop(self._token, None)

    def reset(self, checkpoint_id: str | os.PathLike[Any] | None = None) -> None:
        if checkpoint_id is not None and self._owned:
            self._written()
            self._ck.close()  # DCP calls nothing more on this writer: its root must not stay locked
        _no_checkpoint_id(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def storage_meta(self) -> StorageMeta | None:
        # DCP's save calls this first, on the thread it saves on (async_save: its executor's).
        with _unwritten_lock:
            if self._token in _unwritten:
                _unwritten[self._token].thread = threading.get_ident()
        if not self._owned and not self._exclusive and threading.get_ident() != self._thread:
            # async_save: the training thread goes on using the Checkpointer (save,
            # reached_preemption), whose collectives would then run beside this thread's
            # on the same group, mismatched (gloo aborts, or a rank waits to its timeout).
            raise ValueError(
                "ckpt.dcp.StorageWriter: a Checkpointer passed in (checkpointer=) is used from the thread that "
                "made the writer; async_save saves on another: give the writer no checkpointer= (it opens its "
                "own), or exclusive=True if nothing else uses the Checkpointer until the save completes"
            )
        return None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        try:
            _collective(kwargs, "save")
        except ValueError:
            self.close()  # DCP calls nothing more on this writer
            raise

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Collective: this rank's items saved as version `step`, committed on every rank."""
        state: dict[str, Any] = {TENSORS: {}, BYTES: {}}
        results: list[WriteResult] = []
        self._written()
        try:
            meshed = _meshed(planner)
            error, mixed = self._describe(plan, planner, state, results, meshed)
            if self._ck._ctl.any(mixed):  # every rank then stores the pieces as DCP planned them
                state, results = {TENSORS: {}, BYTES: {}}, []
                error, _ = self._describe(plan, planner, state, results, {})
            self._ck._ctl.agree(error)  # raises alike on every rank
            # A Checkpointer passed in: its save in flight first (its error is this save's),
            # then every item DCP planned, whatever its full_every schedule would keep.
            self._ck.wait()
            self._ck._save_keys(
                self.step, state, None, self._overwrite, self._milestone
            )  # (none in flight: not skipped)
            self._ck.wait()
        finally:
            if self._owned:
                self._ck.close()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    @staticmethod
    def _describe(
        plan: SavePlan,
        planner: SavePlanner,
        state: dict[str, Any],
        results: list[WriteResult],
        meshed: dict[str, DTensor],
    ) -> tuple[Exception | None, bool]:
        """This rank's items as ckpt state, the DTensors of `meshed` as themselves; the
        failure, if any (every rank then learns it), and whether an item of a DTensor in
        `meshed` is not its local piece (a planner that hands DCP other data)."""
        mixed = False
        try:
            for fqn, whole in meshed.items():
                _put(state[TENSORS], fqn, whole)
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                    blob = (
                        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                        if raw
                        else torch.empty(0, dtype=torch.uint8)
                    )
                    _put(state[BYTES], item.index.fqn, Shard(blob, (len(raw),), (0,)))
                    nbytes = len(raw)
                else:
                    assert item.tensor_data is not None and isinstance(data, torch.Tensor)
                    td = item.tensor_data
                    dt = meshed.get(item.index.fqn)
                    if dt is None:
                        piece = Shard(data.detach(), tuple(td.size), tuple(td.chunk.offsets))
                        _put(state[TENSORS], item.index.fqn, piece)
                    elif not _is_local_piece(data, tuple(td.size), tuple(td.chunk.offsets), dt):
                        mixed = True
                    nbytes = data.numel() * data.element_size()
                results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=None))
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
            return e, mixed
        return None, mixed

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing left: the version committed in write_data (see the module docstring)."""
        return None


def _storage_metadata(kind: str, array: ArrayEntry) -> TensorStorageMetadata | BytesStorageMetadata:
    """DCP's description of one stored item: a tensor is one chunk of its whole shape."""
    if kind == BYTES:
        return BytesStorageMetadata()
    shape = torch.Size(array.shape)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)
    return TensorStorageMetadata(TensorProperties(dtype=ZARR_TO_TORCH[array.data_type]), shape, [chunk])


def _check_inert(data: bytes, fqn: str) -> None:
    """UnsupportedStateError unless torch's weights-only unpickler (tensors, containers and
    plain values: nothing that runs code) reads a non-tensor item: DCP's planner unpickles
    it with weights_only=False, which runs whatever the pickle names."""
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the restricted unpickler refuses
        why = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise UnsupportedStateError(
            f"{fqn}: a non-tensor item that torch.load(weights_only=True) refuses ({why}); loading it would run "
            "code from the checkpoint: pass StorageReader(..., trust=True) for a root you trust"
        ) from None


class _Unread(Metadata):
    """What StorageReader.read_metadata returns where it could describe no version. DCP's
    load catches an error of read_metadata and raises an AssertionError holding only its
    message (with a logged traceback of its search for other metadata); this carries the
    error to DCP's planning step (set_up_storage_reader), whose failures DCP reports as
    they are, so `CheckpointException.failures` holds the documented ckpt type. Any other
    use of it raises that error too."""

    def __init__(self, error: Exception) -> None:  # not the dataclass's: no fields to give
        self.error = error
        self.planner_data = self.storage_data = self.storage_meta = None

    @property
    def state_dict_metadata(self) -> Any:  # type: ignore[override]
        raise self.error

    def __repr__(self) -> str:
        return f"_Unread({self.error!r})"


def metadata_of(manifest: Manifest) -> Metadata:
    """DCP's Metadata of a version saved through StorageWriter: every tensor one chunk."""
    found: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for name, array in manifest.arrays.items():
        kind, fqn = _fqn(name)
        if kind in (BYTES, TENSORS):
            found[fqn] = _storage_metadata(kind, array)
    if manifest.arrays and not found:
        raise StateMismatchError(f"step {manifest.step} was not saved through ckpt.dcp: no {TENSORS}/ or {BYTES}/")
    return Metadata(state_dict_metadata=found)


class _Reading:
    """What a StorageReader given no Checkpointer reads with, for one collective call: the
    job's group and the tiers a restore searches (the root, the replicator's copies on this
    node's disks, `tiers`, the remote). Not a Checkpointer, which creates the root, takes
    its lock (RootLockedError beside the training job's Checkpointer) and needs it
    writable: a reader may run beside the job, or on a read-only copy."""

    def __init__(self, root: RootSpec, options: Mapping[str, Any]) -> None:
        rest = dict(options)
        tiers = list(rest.pop("tiers", ()))
        storage_options = rest.pop("storage_options", None)
        remote = rest.pop("replicate_to", None)
        replication = rest.pop("replication", None)
        if remote is None and replication is not None:
            remote = replication.remote
        self.config = replace(rest.pop("config", None) or _CONFIG, **rest)
        self._ctl = make_comm(self.config.timeout)  # (a restore reads on it alone)
        try:
            here, disks = _roots.choose_root(self._ctl, root)
            self._tier = open_tier(here, storage_options)
            self._disks = [d for d in (disks or [here]) if not is_url(d)]
            extra = tiers + ([remote] if remote else [])
            self._tiers = _roots.open_tiers(extra, self._ctl.rank, storage_options)
        except BaseException:
            self.close()
            raise

    def _search(self) -> list[Tier]:
        """In Checkpointer._search_tiers' order."""
        return [self._tier, *_roots.replica_tiers(self._disks), *self._tiers]

    def _locate(
        self, step: int | None, read: Callable[[Manifest, Located], None] | None = None
    ) -> tuple[Manifest, Located] | None:
        return locate(self._ctl, self._search, step, read)

    def close(self) -> None:
        destroy_comms(self._ctl)


class StorageReader(_StorageReader):
    """DCP's StorageReader from a ckpt root: version `step`, or the newest intact one.

    Construct it on every rank; pass an open `checkpointer` to read through it. Without
    one, each of DCP's collective calls (read_metadata, read_data) reads as a restore
    does, through `tiers`, `storage_options` and the Checkpointer options that bear on
    reading (`timeout`, `reader_threads`, `verify_on_restore`, `replicate_to`), with no
    Checkpointer: the root is not created, locked or written (a reader beside the running
    job, or of a read-only copy). Nothing is held between the calls: DCP calls
    nothing more on a reader whose planning failed (a key the version lacks, on any rank).

    Choosing the version is ckpt's (restore.locate): read_metadata describes the newest
    version whose manifest reads; read_data chooses again, pinned, and reads. With no
    `step`, a version a chunk of which has no good copy on any tier is passed over for the
    next older one that holds every item as DCP planned it (the state is untouched until
    every read succeeded); a bad chunk is read from another tier that holds it.

    DCP unpickles non-tensor items with weights_only=False, which runs whatever a pickle
    names: unless `trust`, each is first read by torch's weights-only unpickler, and one it
    refuses is UnsupportedStateError, before anything of the state changes."""

    def __init__(
        self,
        root: RootSpec,
        step: int | None = None,
        *,
        checkpointer: Checkpointer | None = None,
        trust: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        if step is not None:
            check_step(step)
        self.step = step
        self._trust = trust
        self._asked = step
        self._root = root
        self._given = checkpointer
        self._options = options
        self._planned: Metadata | None = None  # what read_metadata described: DCP's plan rests on it

    def reset(self, checkpoint_id: str | os.PathLike[Any] | None = None) -> None:
        _no_checkpoint_id(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    @contextlib.contextmanager
    def _opened(self) -> Iterator[Checkpointer | _Reading]:
        """The given Checkpointer, or what reads without one (_Reading) for the length of
        one call (collective)."""
        if self._given is not None:
            yield self._given
            return
        reading = _Reading(self._root, self._options)
        try:
            yield reading
        finally:
            reading.close()

    def _nothing(self) -> VersionNotFoundError:
        where = self._root if isinstance(self._root, str) else "the root"
        return VersionNotFoundError(f"no committed version under {where}")

    def read_metadata(self) -> Metadata:
        """Collective (DCP calls it on every rank): choose the version, describe it. Where
        none can be (no version, every one damaged, a tier out of reach), the error comes
        from the first use of what this returns (see _Unread)."""
        try:
            with self._opened() as ck:
                found = ck._locate(self._asked)
            if found is None:
                raise self._nothing()
            planned = metadata_of(found[0])
        except Exception as e:  # noqa: BLE001 - raised from set_up_storage_reader, which DCP keeps
            return _Unread(e)
        self.step = found[0].step
        self._planned = planned
        return self._planned

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if isinstance(metadata, _Unread):
            raise metadata.error
        _collective(kwargs, "load")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Collective: read this rank's items (a chunk on another node's disk arrives over
        the group, as in restore), verified, then hand them to DCP's planner."""
        if self._planned is None:
            raise RuntimeError("read_metadata must come first")
        planned = self._planned
        read: list[ReadRequest] = []
        with self._opened() as ck:

            def into_buffers(manifest: Manifest, located: Located) -> None:
                read[:] = self._read(ck, planned, manifest, located, plan)

            found = ck._locate(self._asked, into_buffers)
        if found is None:  # deleted since read_metadata
            raise self._nothing()
        self.step = found[0].step
        raw = {
            i: req.dest.numpy().tobytes()
            for i, (item, req) in enumerate(zip(plan.items, read))
            if item.type == LoadItemType.BYTE_IO
        }
        if not self._trust:
            for i, data in raw.items():
                _check_inert(data, plan.items[i].storage_index.fqn)
        for i, (item, req) in enumerate(zip(plan.items, read)):
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(raw[i]))
                continue
            target = planner.resolve_tensor(item).detach()
            target.copy_(req.dest)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @staticmethod
    def _read(
        ck: Checkpointer | _Reading, planned: Metadata, manifest: Manifest, located: Located, plan: LoadPlan
    ) -> list[ReadRequest]:
        """This rank's items of the version, read and verified into buffers of their own (the
        state is untouched). A version that does not hold an item as `planned` describes it
        (an older one, after the planned one failed) is CorruptVersionError: passed over."""
        ctl, config = ck._ctl, ck.config
        requests: list[ReadRequest] = []
        error: BaseException | None = None
        try:
            for item in plan.items:
                kind = BYTES if item.type == LoadItemType.BYTE_IO else TENSORS
                fqn = item.storage_index.fqn
                array = manifest.arrays.get(array_name(kind, fqn))
                if array is None or _storage_metadata(kind, array) != planned.state_dict_metadata.get(fqn):
                    raise CorruptVersionError(
                        f"{fqn}: step {manifest.step} does not hold this {kind} item as DCP planned it "
                        "(from a newer version that is not intact)"
                    )
                if kind == BYTES:
                    requests.append(ReadRequest(array, full_tensor(array), (0,)))
                else:
                    dest = torch.empty(tuple(item.lengths), dtype=ZARR_TO_TORCH[array.data_type])
                    requests.append(ReadRequest(array, dest, tuple(item.storage_offsets)))
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            error = e
        ctl.agree(error)
        read_agreed(ctl, config, located, manifest, requests)
        return requests
