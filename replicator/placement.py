"""Where copies go: destinations on distinct disks, and proof that a disk is the one it was.

"The same disk" is decided by `disk_id`: for a URL other than `file://`, its protocol and
host; for a local path, the content of the nearest `.ckpt-disk` file above it (bind
mounts, network filesystems and tests, where a device number says too little), else the
device. A replica root's identity is recorded the first time it is used (and a
`.ckpt-disk` is written at the root if there is none above it), and every later pass
(every later start too: it is kept in the source root's status) must find the same
identity there. An unmounted disk leaves its empty mount point, on another filesystem,
in its place: it then fails the check, is reported `failed`, and nothing is written there.
A root whose device tells its disk (`device_decides`: unmarked, or marked only by such a
claim, older code's included) is no second disk on a device a copy is on already.
"""

from __future__ import annotations

import errno
import hashlib
import os
import platform
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, NoReturn

import xxhash

from ckpt.store.errors import TierUnavailableError
from ckpt.store.fsio import makedirs, write_durable
from ckpt.store.tier import Capabilities, ObjectInfo, ReadHandle, Tier, is_url, local_location

__all__ = [
    "DISK_MARKER",
    "Destination",
    "UnopenedTier",
    "disk_id",
    "device_id",
    "device_decides",
    "claim_disk",
    "is_local_location",
    "source_label",
]

DISK_MARKER = ".ckpt-disk"


def is_local_location(location: str) -> bool:
    return not is_url(location) or location.startswith("file://")


def _path(location: str) -> str:
    """The real path: a symlink names the disk it points into, not the one it lies on."""
    return os.path.realpath(local_location(location) or location)


def disk_id(location: str) -> str:
    """The disk `location` is on, as placement compares them."""
    if not is_local_location(location):
        proto, rest = location.split("://", 1)
        return f"{proto}://{rest.split('/', 1)[0]}"
    marker = _marker(location)
    if marker is None:
        return device_id(location)
    with open(marker) as f:
        return f"marker:{f.read().strip()}"


def device_id(location: str) -> str:
    """The device of a local `location` (of its nearest existing directory), whatever
    `.ckpt-disk` lies above it: an unmarked root on a device a copy is on already is on
    that disk (a marker claim_disk wrote there would only hide it)."""
    return f"dev:{os.stat(_existing(location)).st_dev}"


def device_decides(location: str) -> bool:
    """Whether a local location's device, not a `.ckpt-disk`, tells its disk: no marker lies
    at or above it, or the one there is a claim (claim_disk's: at the root itself, a bare
    uuid4). A claim records a root's first use, wherever that was, so it proves no second
    disk on a device a copy is on; any other marker is the operator's word that the
    directory is a disk of its own, whatever its device (tests/_disks.py)."""
    marker = _marker(location)
    if marker is None:
        return True
    if os.path.dirname(marker) != _path(location):
        return False
    with open(marker) as f:
        text = f.read().strip()
    try:
        claim = uuid.UUID(hex=text)
    except ValueError:
        return False
    return claim.hex == text and claim.version == 4


def _marker(location: str) -> str | None:
    """The nearest `.ckpt-disk` at or above a local location's nearest existing directory."""
    probe = _existing(location)
    while True:
        marker = os.path.join(probe, DISK_MARKER)
        if os.path.isfile(marker):
            return marker
        if probe == os.path.dirname(probe):
            return None
        probe = os.path.dirname(probe)


def _existing(location: str) -> str:
    """The nearest existing directory of a local location's real path (itself, if it exists)."""
    path = _path(location)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def claim_disk(location: str) -> str:
    """The identity of a local replica root's disk, made provable: a `.ckpt-disk` holding a
    new id is written at the root when none lies above it. For other URLs: disk_id."""
    current = disk_id(location)
    if not is_local_location(location) or current.startswith("marker:"):
        return current
    root = _path(location)
    makedirs(root)
    marker = os.path.join(root, DISK_MARKER)
    tmp = f"{marker}.tmp-{uuid.uuid4().hex}"
    write_durable(tmp, uuid.uuid4().hex.encode())  # FILE_MODE, whatever the umask; device_decides knows it
    try:
        os.link(tmp, marker)  # create-only: a concurrent claimer's id wins alike for both
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return disk_id(location)


_LABEL_CHARS = 200  # a file name holds 255 bytes


def source_label(root: str) -> str:
    """A stable name for a source root in replica directories: host and path; a longer one
    cut, with the xxh3 of the whole, so two roots never share a name."""
    path = os.path.abspath(root).strip("/").replace("/", "_")
    label = f"{platform.node()}_{path}"
    if len(label) <= _LABEL_CHARS:
        return label
    return f"{label[: _LABEL_CHARS - 17]}~{xxhash.xxh3_64_hexdigest(label.encode())}"


class UnopenedTier(Tier):
    """A destination that failed to open in this pass (a peer node down, its disk failing):
    every call raises that error, so its copies fail and its versions are judged unknown
    (kept), never absent."""

    capabilities = Capabilities(atomic_rename=False, range_reads=False, direct_io=False, local_files=False)

    def __init__(self, location: str, why: str) -> None:
        self.location, self._why = location, why

    def _fail(self) -> NoReturn:
        raise TierUnavailableError(errno.EIO, f"{self.location}: {self._why}")

    def get(self, key: str) -> bytes:
        self._fail()

    def open_read(self, key: str) -> ReadHandle:
        self._fail()

    def put(self, key: str, data: bytes) -> None:
        self._fail()

    def put_stream(self, key: str, blocks: Callable[[], Iterable[bytes | memoryview]], size: int) -> bool:
        self._fail()

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._fail()

    def listdir(self, prefix: str = "") -> list[str]:
        self._fail()

    def find(self, prefix: str) -> list[ObjectInfo]:
        self._fail()

    def exists(self, key: str) -> bool:
        self._fail()

    def delete(self, key: str) -> None:
        self._fail()

    def delete_tree(self, prefix: str) -> None:
        self._fail()


@dataclass
class Destination:
    """A place copies of a source root's versions go."""

    url: str  # a local path or an fsspec URL, as configured
    kind: Literal["replica", "shared"]  # a replica of one source root, or the remote all nodes share
    tier: Tier
    disk: str | None = None  # the disk identity the copies must stay on (local replicas)
    id: str = field(init=False)  # names its journals

    def __post_init__(self) -> None:
        self.id = hashlib.sha1(self.url.encode()).hexdigest()[:12]

    def check_disk(self) -> None:
        """TierUnavailableError if the destination is not on its disk: a disk unmounted
        (before or during a copy) leaves its mount point, on another disk, in its place."""
        if self.disk is not None and (now := disk_id(self.url)) != self.disk:
            raise TierUnavailableError(errno.ENODEV, f"{self.url}: its disk ({self.disk}) is gone, found {now}")
