"""The chunk checksum as docs/FORMAT.md defines it, recomputed here from the file bytes
without ckpt's code; streaming in any piece sizes; and versions written under schema 1
(whole-file digests) still restore and verify."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
import zarr
from click.testing import CliRunner

from ckpt import Checkpointer, CorruptVersionError
from ckpt.cli import main as cli
from ckpt.store.digest import ChunkHasher, chunk_digest
from ckpt.store.errors import ManifestError
from ckpt.store.layout import BLOCK_BYTES, LEGACY_BLOCK_BYTES
from ckpt.store.manifest import SCHEMA_VERSION, parse_manifest
from ckpt.store.rank_file import parse_rank_file
from tests._manifests import as_schema_2, as_schema_3, chunk_digests, crafted, legacy
from tests._states import assert_bitwise

BIG = "state/big/c.0.0"  # 3000 x 1000 float32: 12 MB, twelve ~1 MiB blocks (schema 3: three ~4 MiB)
BIG_V1 = "state/big/c/0/0"  # the same chunk's key in schema 1


def vdir(root: Path, step: int) -> Path:
    return root / f"v{step:012d}"


def make_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"big": torch.randn(3000, 1000, generator=g), "w": torch.randn(40, 30, generator=g)}


def documented_digests(data: bytes, block_bytes: int) -> tuple[str, list[str]]:
    """FORMAT.md: blocks[i] = xxh3_64 of each block; the chunk's xxh3 = xxh3_64 of the
    blocks' 8-byte big-endian digests, concatenated."""
    blocks = [xxhash.xxh3_64(data[i : i + block_bytes]) for i in range(0, len(data), block_bytes)]
    combined = xxhash.xxh3_64_hexdigest(b"".join(b.digest() for b in blocks))
    return combined, [b.hexdigest() for b in blocks]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    root = tmp_path / "root"
    state = make_state()
    with Checkpointer(root) as ck:
        ck.save(1, state)
        ck.wait()
    return root, state


def test_manifest_digests_follow_the_documented_rule(saved: tuple[Path, dict[str, Any]]) -> None:
    root, _ = saved
    doc = json.loads((vdir(root, 1) / "manifest.json").read_bytes())
    assert doc["schema_version"] == SCHEMA_VERSION == 4
    big = doc["arrays"]["big"]
    row_bytes = big["chunk_shape"][1] * 4
    block_bytes = big["block_rows"] * row_bytes
    assert block_bytes == BLOCK_BYTES // row_bytes * row_bytes == 262 * 4000
    digests = chunk_digests(vdir(root, 1))  # since schema 3: in the writers' rank files
    xxh3, chunk_blocks = digests["big"][0]
    combined, blocks = documented_digests((vdir(root, 1) / BIG).read_bytes(), block_bytes)
    assert len(blocks) == 12 and chunk_blocks == blocks
    assert xxh3 == combined
    small, small_blocks = digests["w"][0]
    assert small_blocks == []
    assert small == xxhash.xxh3_64_hexdigest((vdir(root, 1) / "state/w/c.0.0").read_bytes())
    # ... and the manifest covers each rank file by its size and xxh3
    raw = (vdir(root, 1) / "ranks" / "0.json").read_bytes()
    assert doc["ranks"] == [[len(raw), xxhash.xxh3_64_hexdigest(raw)]]


@pytest.mark.parametrize("seed", range(5))
def test_streaming_in_any_pieces(seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(rng.randrange(1, 50_000))
    block = rng.choice([0, 1, 7, 4096, 10_000, 60_000])
    hasher = ChunkHasher(block)
    at = 0
    while at < len(data):
        n = rng.choice([1, 3, 4096, 10_000, 30_000])
        hasher.update(memoryview(data)[at : at + n])
        at += n
    want = xxhash.xxh3_64_hexdigest(data) if block == 0 else documented_digests(data, block)[0]
    assert hasher.hexdigest() == want == chunk_digest(data, block)


def test_inconsistent_block_digests_are_rejected(saved: tuple[Path, dict[str, Any]]) -> None:
    root, _ = saved
    manifest = parse_manifest((vdir(root, 1) / "manifest.json").read_bytes())
    rank = json.loads((vdir(root, 1) / "ranks" / "0.json").read_bytes())
    (entry,) = rank["chunks"]["big"]
    entry[2][1] = "0" * 16
    with pytest.raises(ManifestError, match="does not match its blocks"):
        parse_rank_file(json.dumps(rank).encode(), manifest, 0)
    as_schema_2(vdir(root, 1))  # and where schema 2 listed them
    doc = json.loads((vdir(root, 1) / "manifest.json").read_bytes())
    doc["arrays"]["big"]["chunks"][0]["blocks"][1] = "0" * 16
    with pytest.raises(ManifestError, match="does not match its blocks"):
        parse_manifest(crafted(doc))


def test_schema_2_versions_still_restore_and_verify(saved: tuple[Path, dict[str, Any]]) -> None:
    root, state = saved
    as_schema_2(vdir(root, 1))
    assert json.loads((vdir(root, 1) / "manifest.json").read_bytes())["schema_version"] == 2
    assert not (vdir(root, 1) / "ranks").exists()
    _restores_bitwise_and_verifies(root, state)


def test_schema_3_versions_with_4_mib_blocks_still_restore_and_verify(saved: tuple[Path, dict[str, Any]]) -> None:
    """A version written before blocks shrank to ~1 MiB: its ~4 MiB blocks are checked as such."""
    root, state = saved
    as_schema_3(vdir(root, 1))
    doc = json.loads((vdir(root, 1) / "manifest.json").read_bytes())
    assert doc["schema_version"] == 3
    assert doc["arrays"]["big"]["block_rows"] * 4000 == LEGACY_BLOCK_BYTES // 4000 * 4000
    assert len(chunk_digests(vdir(root, 1))["big"][0][1]) == 3
    _restores_bitwise_and_verifies(root, state)


@pytest.mark.parametrize("schema", [3, 4])
def test_block_rows_must_follow_the_rule_of_the_manifests_schema(
    saved: tuple[Path, dict[str, Any]], schema: int
) -> None:
    """Each schema has one block rule: a manifest whose blocks follow the other schema's is refused."""
    root, _ = saved
    if schema == 3:
        as_schema_3(vdir(root, 1))
    doc = json.loads((vdir(root, 1) / "manifest.json").read_bytes())
    parse_manifest(crafted(doc))
    other = {3: BLOCK_BYTES, 4: LEGACY_BLOCK_BYTES}[schema]
    doc["arrays"]["big"]["block_rows"] = other // 4000
    with pytest.raises(ManifestError, match="block_rows .* does not follow"):
        parse_manifest(crafted(doc))


def _restores_bitwise_and_verifies(root: Path, state: dict[str, Any]) -> None:
    """Version 1 restores bitwise and `ckpt verify` passes it; with a byte of BIG flipped, it fails it."""
    with Checkpointer(root) as ck:
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.restore(got) == 1
    assert_bitwise(got, state)
    result = CliRunner().invoke(cli, ["verify", str(root)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    _flip_last_byte(vdir(root, 1) / BIG)
    result = CliRunner().invoke(cli, ["verify", str(root)], catch_exceptions=False)
    assert result.exit_code == 1 and "BAD" in result.output, result.output


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _as_schema_1(root: Path) -> None:
    """Rewrite version 1 as an older ckpt wrote it: "/" chunk keys, every xxh3 over the whole file."""
    as_schema_2(vdir(root, 1))
    path = vdir(root, 1) / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc["schema_version"] = 1
    for name, array in doc["arrays"].items():
        meta = vdir(root, 1) / "state" / name / "zarr.json"
        zdoc = json.loads(meta.read_bytes())
        zdoc["chunk_key_encoding"]["configuration"]["separator"] = "/"
        meta.write_text(json.dumps(zdoc))
        for chunk in array["chunks"]:
            if "inline" not in chunk:
                index = [str(i) for i in chunk["index"]]
                old = vdir(root, 1) / "state" / name / ("c." + ".".join(index))
                new = vdir(root, 1) / "state" / name / "c" / "/".join(index)
                os.renames(old, new)
                chunk["xxh3"] = xxhash.xxh3_64_hexdigest(new.read_bytes())
    path.write_bytes(legacy(doc))  # schema 1 manifests had no manifest_xxh3


def test_schema_1_versions_still_restore_and_verify(saved: tuple[Path, dict[str, Any]]) -> None:
    root, state = saved
    _as_schema_1(root)
    with Checkpointer(root) as ck:
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ck.restore(got) == 1
    assert_bitwise(got, state)
    result = CliRunner().invoke(cli, ["verify", str(root)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    # zarr-python reads it as well, through its "/" chunk keys.
    big = zarr.open_array(str(vdir(root, 1) / "state" / "big"), mode="r")
    assert_bitwise(torch.from_numpy(big[...]), state["big"], "big through zarr-python")
    # ... and their checksums still catch a flipped byte.
    with open(vdir(root, 1) / BIG_V1, "r+b") as f:
        f.seek(5 << 20)
        b = f.read(1)[0]
        f.seek(5 << 20)
        f.write(bytes([b ^ 1]))
    result = CliRunner().invoke(cli, ["verify", str(root)], catch_exceptions=False)
    assert result.exit_code == 1 and f"BAD {BIG_V1}" in result.output, result.output
    with Checkpointer(root) as ck, pytest.raises(CorruptVersionError):
        ck.restore({k: torch.zeros_like(v) for k, v in state.items()})


def test_manifest_checksum_follows_the_documented_rule(saved: tuple[Path, dict[str, Any]]) -> None:
    """FORMAT.md: the manifest's last member is manifest_xxh3, the xxh3_64 of the document
    as it reads without that member."""
    root, _ = saved
    raw = (vdir(root, 1) / "manifest.json").read_bytes()
    body, sep, tail = raw.rpartition(b',"manifest_xxh3":"')
    assert sep and len(tail) == 18 and tail.endswith(b'"}')
    assert xxhash.xxh3_64_hexdigest(body + b"}") == tail[:16].decode()


def test_a_manifest_edited_in_place_is_refused(tmp_path: Path) -> None:
    """One changed digit that still parses (an epoch counter in a rank file, a flag in the
    manifest) would otherwise be restored silently: verify reports the file, restore falls
    back to the older version."""
    root = tmp_path / "root"
    with Checkpointer(root) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((4, 3), float(step)), "epoch": step + 40})
        ck.wait()
    path = vdir(root, 2) / "ranks" / "0.json"  # schema 3: the state tree is in the rank file
    raw = path.read_bytes()
    assert raw.count(b'"epoch":42') == 1
    path.write_bytes(raw.replace(b'"epoch":42', b'"epoch":43'))
    json.loads(path.read_bytes())  # still a valid document
    verify = CliRunner().invoke(cli, ["verify", str(root)])
    assert verify.exit_code == 1 and "BAD ranks/0.json" in verify.output and "checksum" in verify.output
    assert "step 1: ok" in verify.output
    got = {"w": torch.zeros(4, 3), "epoch": 0}
    with Checkpointer(root) as ck:
        assert ck.restore(got) == 1
        with pytest.raises(CorruptVersionError, match="checksum"):
            ck.restore(got, step=2)
    assert_bitwise(got, {"w": torch.full((4, 3), 1.0), "epoch": 41}, "step 1")
    path.write_bytes(raw)
    manifest = vdir(root, 2) / "manifest.json"
    raw = manifest.read_bytes()
    assert raw.count(b'"milestone":false') == 1
    manifest.write_bytes(raw.replace(b'"milestone":false', b'"milestone":true'))
    verify = CliRunner().invoke(cli, ["verify", str(root)])
    assert verify.exit_code == 1 and "step 2: BAD manifest" in verify.output and "checksum" in verify.output
    with Checkpointer(root) as ck, pytest.raises(ManifestError, match="checksum"):
        ck.restore(got, step=2)


def test_a_checksummed_manifest_must_end_as_written(saved: tuple[Path, dict[str, Any]]) -> None:
    """Trailing bytes after the checksum member (still valid JSON) are refused; so is a
    schema-2 manifest without the member: only schema 1 was written without it."""
    root, _ = saved
    raw = (vdir(root, 1) / "manifest.json").read_bytes()
    parse_manifest(raw)
    with pytest.raises(ManifestError, match="manifest_xxh3"):
        parse_manifest(raw + b"  \n")
    stripped = json.loads(raw)
    del stripped["manifest_xxh3"]
    assert stripped["schema_version"] == SCHEMA_VERSION
    with pytest.raises(ManifestError, match="lacks its manifest_xxh3"):
        parse_manifest(json.dumps(stripped).encode())


@pytest.mark.parametrize("save_id", ["../../../planted", "ABCDEF" * 6, "", 7, "0" * 31 + "/"], ids=str)
def test_a_save_id_that_is_not_32_hex_digits_is_refused(saved: tuple[Path, dict[str, Any]], save_id: Any) -> None:
    """The save_id becomes part of paths (tmp directories, replicator journals): a crafted
    one is refused when the manifest is parsed, checksum or not."""
    root, _ = saved
    doc = json.loads((vdir(root, 1) / "manifest.json").read_bytes())
    parse_manifest(crafted(doc))
    with pytest.raises(ManifestError, match="save_id"):
        parse_manifest(crafted({**doc, "save_id": save_id}))


def test_publishing_over_a_committed_step_is_version_exists(tmp_path: Path) -> None:
    from ckpt import VersionExistsError
    from ckpt.store import commit

    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.ones(4)})
    (tmp_path / commit.tmp_dirname(1, "a" * 32)).mkdir()
    with pytest.raises(VersionExistsError, match="step 1 is already committed"):
        commit.publish(str(tmp_path), commit.tmp_dirname(1, "a" * 32), 1, overwrite=False)


@pytest.mark.parametrize(
    "bad", ["0" * 15, "0" * 17, "A" * 16, "g" * 16, 123, None], ids=["short", "long", "upper", "not-hex", "int", "null"]
)
def test_a_malformed_block_digest_is_refused(saved: tuple[Path, dict[str, Any]], bad: Any) -> None:
    """Block digests are checked together (one pattern over their concatenation, with each
    one's type and length), not one by one: each way one can be malformed is still refused."""
    root, _ = saved
    manifest = parse_manifest((vdir(root, 1) / "manifest.json").read_bytes())
    rank = json.loads((vdir(root, 1) / "ranks" / "0.json").read_bytes())
    (entry,) = rank["chunks"]["big"]
    entry[2][3] = bad
    with pytest.raises(ManifestError, match="malformed block checksums"):
        parse_rank_file(json.dumps(rank).encode(), manifest, 0)
    if isinstance(bad, str) and len(bad) in (15, 17):  # lengths that add up: 15 + 17 = 32
        entry[2][3], entry[2][4] = "0" * 15, "0" * 17
        with pytest.raises(ManifestError, match="malformed block checksums"):
            parse_rank_file(json.dumps(rank).encode(), manifest, 0)
