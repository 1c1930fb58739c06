"""The storage interface's contract (ckpt.store.tier), run against every backend: a local
directory, a `file://` URL, and S3 on the moto server reached through s3fs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt.store._fsspec import FsspecTier
from ckpt.store.errors import TierUnavailableError
from ckpt.store.tier import Tier, open_tier
from tests.s3_server import S3Place


@pytest.fixture(params=["local", "file", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    if request.param == "local":
        yield open_tier(str(tmp_path / "tier"))
    elif request.param == "file":
        yield open_tier(f"file://{tmp_path / 'tier'}")
    else:
        place: S3Place = request.getfixturevalue("s3")
        yield open_tier(place.url, place.options)


def test_a_missing_key(tier: Tier) -> None:
    assert not tier.exists("v/none")
    with pytest.raises(FileNotFoundError):
        tier.get("v/none")
    with pytest.raises(FileNotFoundError):
        tier.open_read("v/none")
    assert tier.listdir("v") == []
    assert tier.find("v") == []
    tier.delete("v/none")  # no error: gone already
    tier.delete_many(["v/none", "v/other"])


def test_put_get_replace_and_ranges(tier: Tier) -> None:
    tier.put("v/a/x", b"0123456789")
    assert tier.exists("v/a/x") and tier.get("v/a/x") == b"0123456789"
    assert tier.get_range("v/a/x", 3, 4) == b"3456"
    handle = tier.open_read("v/a/x")
    try:
        assert handle.size == 10
        out = memoryview(bytearray(2))
        handle.read_into(8, out)
        assert bytes(out) == b"89"
        with pytest.raises(EOFError):
            handle.read_into(9, memoryview(bytearray(2)))
    finally:
        handle.close()
    tier.put("v/a/x", b"new")
    assert tier.get("v/a/x") == b"new"


def test_put_stream_from_a_reused_buffer(tier: Tier) -> None:
    buf = bytearray(4)

    def blocks() -> Iterator[memoryview]:
        for i in range(5):
            buf[:] = bytes([i]) * 4  # the same buffer each time: consumed before the next
            yield memoryview(buf)

    confirmed = tier.put_stream("v/s", blocks, 20)
    assert tier.get("v/s") == b"".join(bytes([i]) * 4 for i in range(5))
    assert confirmed is isinstance(tier, FsspecTier)  # S3's ETag is the MD5 of the bytes sent


def test_a_large_stream_goes_up_whole(tier: Tier) -> None:
    """33 MiB: on S3 a multipart upload."""
    piece = bytes(range(256)) * 4096  # 1 MiB

    def blocks() -> Iterator[bytes]:
        for _ in range(33):
            yield piece

    assert tier.put_stream("v/big", blocks, 33 << 20) is isinstance(tier, FsspecTier)  # multipart's ETag too
    handle = tier.open_read("v/big")
    try:
        assert handle.size == 33 << 20
        tail = memoryview(bytearray(1 << 20))
        handle.read_into(32 << 20, tail)
        assert bytes(tail) == piece
    finally:
        handle.close()


@pytest.mark.parametrize("size", [20, 33 << 20], ids=["one-put", "multipart"])
def test_an_abandoned_stream_leaves_nothing_and_the_old_object(tier: Tier, size: int) -> None:
    tier.put("v/o", b"old")

    class Stop(Exception):
        pass

    def blocks() -> Iterator[bytes]:
        yield b"x" * (size // 2)
        raise Stop

    with pytest.raises(Stop):
        tier.put_stream("v/o", blocks, size)
    with pytest.raises(Stop):
        tier.put_stream("v/p", blocks, size)
    assert tier.get("v/o") == b"old"
    assert not tier.exists("v/p")
    assert [o.key for o in tier.find("v")] == ["v/o"]  # no temp files, no half objects


def test_put_if_absent_has_one_winner(tier: Tier) -> None:
    tier.put_if_absent("v/m", b"first")
    with pytest.raises(FileExistsError):
        tier.put_if_absent("v/m", b"second")
    assert tier.get("v/m") == b"first"
    winners: list[int] = []
    errors: list[BaseException] = []

    def race(i: int) -> None:
        try:
            tier.put_if_absent("v/race", str(i).encode())
            winners.append(i)
        except FileExistsError:
            pass
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(winners) == 1
    assert tier.get("v/race") == str(winners[0]).encode()


def test_listing_find_and_deletes(tier: Tier) -> None:
    for key in ("v1/a", "v1/d/b", "v1/d/e/c", "v2/x"):
        tier.put(key, key.encode())
    assert tier.listdir("") == ["v1", "v2"]
    assert tier.listdir("v1") == ["a", "d"]
    found = tier.find("v1")
    assert [(o.key, o.size) for o in found] == [("v1/a", 4), ("v1/d/b", 6), ("v1/d/e/c", 8)]
    assert all(o.mtime > 0 for o in found)
    tier.delete("v1/a")
    tier.delete_many(["v1/d/b", "v1/gone"])
    assert [o.key for o in tier.find("v1")] == ["v1/d/e/c"]
    tier.delete_tree("v1")
    assert tier.find("v1") == [] and not tier.exists("v1/d/e/c")
    assert tier.listdir("") == ["v2"]
    tier.sync("v2")


def test_listings_are_fresh(tier: Tier, request: pytest.FixtureRequest) -> None:
    """What another writer (another process, another node) adds or deletes is seen at once."""
    tier.put("v/a", b"a")
    assert tier.listdir("v") == ["a"]
    other = open_tier(tier.location, getattr(tier, "options", None))
    other.put("v/b", b"b")
    assert tier.listdir("v") == ["a", "b"] and tier.exists("v/b")
    other.delete("v/a")
    assert tier.listdir("v") == ["b"] and not tier.exists("v/a")


def test_rename_matches_the_declared_capability(tier: Tier) -> None:
    tier.put("v/d/x", b"x")
    if tier.capabilities.atomic_rename:
        tier.rename("v/d", "trash/d")
        assert not tier.exists("v/d/x") and tier.get("trash/d/x") == b"x"
        assert tier.local_path("trash/d/x") is not None
    else:
        with pytest.raises(TierUnavailableError):
            tier.rename("v/d", "trash/d")
        assert tier.get("v/d/x") == b"x"
        assert tier.local_path("v/d/x") is None


def test_a_chained_url_is_refused_not_taken_for_a_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec's chained URLs (`simplecache::s3://...`) were taken for a relative path: a
    directory named `simplecache::s3:` was made in the working directory and nothing reached
    the store. Through fsspec, the options would reach the outer layer, not the store: they
    are refused with one clear line."""
    monkeypatch.chdir(tmp_path)
    for url in ("simplecache::s3://bucket/ckpt", "simplecache::memory://x/ckpt", "simplecache::/data/ckpt"):
        with pytest.raises(TierUnavailableError, match="chained URLs are not supported"):
            open_tier(url, {"endpoint_url": "http://127.0.0.1:9"})
    assert list(tmp_path.iterdir()) == []


def test_a_bucket_that_does_not_exist_is_no_empty_store(s3: S3Place, tmp_path: Path) -> None:
    """A typo in the bucket's name: listing it is TierUnavailableError (and a restore from it
    an error, not a fresh start), while an empty prefix of a real bucket lists as empty."""
    import torch
    from click.testing import CliRunner

    from ckpt import Checkpointer
    from ckpt.cli import main as cli_main

    typo = f"s3://{s3.server.bucket}-typo/{s3.prefix}"
    with pytest.raises(TierUnavailableError, match="does not exist"):
        open_tier(typo, s3.options).listdir("")
    assert open_tier(s3.url, s3.options).listdir("") == []  # nothing saved there yet: empty
    with Checkpointer(tmp_path / "local", tiers=[typo], storage_options=s3.options) as ck:
        with pytest.raises(TierUnavailableError, match="does not exist"):
            ck.restore({"w": torch.zeros(2)})
    r = CliRunner().invoke(cli_main, ["ls", typo, "--storage-option", f"endpoint_url={s3.server.endpoint}"])
    assert r.exit_code == 3 and "does not exist" in r.output and "Traceback" not in r.output, r.output


def test_the_key_room_of_each_store(s3: S3Place, tmp_path: Path) -> None:
    """S3's keys stop at 1,024 bytes, counted below the bucket: a tier's prefix takes its
    share. A path or an in-memory store has no such limit."""
    opts = s3.options
    assert FsspecTier(f"s3://{s3.server.bucket}", opts).key_room == 1024
    assert FsspecTier(f"s3://{s3.server.bucket}/a/bc", opts).key_room == 1024 - len("a/bc/")
    assert FsspecTier(f"s3://{s3.server.bucket}/ä", opts).key_room == 1024 - len("ä/".encode())
    assert FsspecTier("memory://ckpt-room/a").key_room is None
    assert open_tier(str(tmp_path)).key_room is None
