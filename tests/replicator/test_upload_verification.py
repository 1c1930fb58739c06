"""How the replicator knows an upload to S3 arrived whole (moto server, reached through s3fs).

The bytes sent are hashed on the way (xxh3, against the manifest) and with MD5, the ETag S3
gives an object of those bytes (of their parts' MD5s for a multipart upload). Where the
store's ETag is that MD5, the copy counts as verified without being read back; where it
is not (damage on the way, or a store whose ETags are no MD5s), the copy is read back and
checked against the manifest, and sent again while it reads back wrong.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import s3fs
import torch

from ckpt import Checkpointer
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.service import Replicator
from ckpt.store import versions
from ckpt.store._fsspec import FsspecTier

if TYPE_CHECKING:
    from tests.s3_server import S3Place

MiB = 1 << 20


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(10 * MiB, generator=g),  # 40 MiB: a multipart upload
        "small": torch.randn(1000, 33, generator=g),  # one PUT
        "ids": torch.arange(5, dtype=torch.int64),
    }


def _saved(root: Path) -> dict[str, bytes]:
    """The version's chunk files as the source root holds them."""
    vdir = root / versions.version_dirname(1)
    return {str(p.relative_to(vdir)): p.read_bytes() for p in vdir.rglob("c.*") if p.is_file()}


def _remote(s3: S3Place) -> dict[str, bytes]:
    fs = s3fs.S3FileSystem(endpoint_url=s3.options["endpoint_url"])
    fs.invalidate_cache()
    base = f"{s3.url[len('s3://') :]}/{versions.version_dirname(1)}/"
    return {p[len(base) :]: fs.cat_file(p) for p in fs.find(base) if p.rsplit("/", 1)[-1].startswith("c.")}


def _replicate(root: Path, s3: S3Place) -> str:
    rep = Replicator([str(root)], ReplicatorConfig(remote=s3.url, storage_options=s3.options))
    remote = rep.run_once()[str(root)].versions[1].remote
    return remote.state if remote is not None else "none"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Keys of the remote objects opened for reading (a read back opens each it checks)."""
    opened: list[str] = []
    real = FsspecTier.open_read

    def open_read(self: FsspecTier, key: str) -> Any:
        opened.append(key)
        return real(self, key)

    monkeypatch.setattr(FsspecTier, "open_read", open_read)
    return opened


def test_an_upload_the_store_confirms_is_not_read_back(s3: S3Place, tmp_path: Path, reads: list[str]) -> None:
    root = tmp_path / "root"
    with Checkpointer(root) as ck:
        ck.save(1, _state())
    saved = _saved(root)
    assert max(len(b) for b in saved.values()) >= 32 * MiB  # the multipart path is taken
    assert _replicate(root, s3) == "verified"
    assert _remote(s3) == saved
    assert not [k for k in reads if "/c." in k]  # no chunk was read back


def test_a_copy_damaged_on_the_way_is_sent_again(
    s3: S3Place, tmp_path: Path, reads: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bit flipped after ckpt hashed the bytes (where no transport checksum saw it): the
    ETag is not the MD5 of what was sent, the copy reads back wrong, and goes up again."""
    root = tmp_path / "root"
    with Checkpointer(root) as ck:
        ck.save(1, _state())
    saved = _saved(root)
    damaged: list[str] = []
    real_pipe = s3fs.S3FileSystem._pipe_file  # the sync pipe_file each instance gets calls it

    async def pipe_file(self: s3fs.S3FileSystem, path: str, data: bytes, *args: Any, **kwargs: Any) -> Any:
        if "/c." in path and not damaged:
            damaged.append(path)
            data = bytes([data[0] ^ 1]) + data[1:]
        return await real_pipe(self, path, data, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", pipe_file)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance binds its sync methods when made
    with caplog.at_level(logging.WARNING, logger="ckpt.replicator"):
        assert _replicate(root, s3) == "verified"
    assert len(damaged) == 1
    assert _remote(s3) == saved  # the damaged copy was replaced
    assert [k for k in reads if "/c." in k] == [k for k in reads if damaged[0].endswith(k)] != []  # read back: that one
    assert "sending it again" in caplog.text
