"""A version's files as the peer copier streams them (ckpt._peers._Stream) and writes them back
on the receiving node (_Sink): bitwise copies, every chunk file checked against the manifest's
digests as it arrives, and a damaged or incomplete stream refused (the jobs around it:
tests/e2e/test_peer_copies.py)."""

from __future__ import annotations

import filecmp
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt import Checkpointer
from ckpt._peers import PIECE, _aligned, _files, _layout, _Sink, _Stream
from ckpt.store.errors import CorruptVersionError
from ckpt.store.fsio import DIRECT_ALIGN, DIRECT_MIN_BYTES
from ckpt.store.versions import version_dirname

Tamper = Callable[[int, memoryview], None]


def _version(tmp_path: Path) -> tuple[str, list[tuple[str, int]]]:
    """A committed version with chunks above and below O_DIRECT's size, and unaligned tails."""
    root = tmp_path / "root"
    g = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(3 * PIECE // 4 + 1001, generator=g),  # spans pieces; a partial last block
        "mid": torch.randn(DIRECT_MIN_BYTES // 4 + 7, generator=g),
        "small": torch.randn(33, generator=g),
        "step": torch.tensor(5),
    }
    with Checkpointer(root) as ck:
        ck.save(1, state)
    version = str(root / version_dirname(1))
    return version, _files(version)


def _copy(
    version: str,
    files: list[tuple[str, int]],
    dest: Path,
    tamper: Tamper | None = None,
    aligned: bool = True,
    step: int = 1,
    reuse: bool = False,
) -> _Sink:
    """Stream the version into a sink piece by piece, as a round does (PIECE-sized buffers,
    page-aligned as a round's are, or not: then O_DIRECT refuses them and the page cache takes over)."""
    stream = _Stream(version, files)
    sink = _Sink(str(dest / version_dirname(step)), step, files, reuse=reuse)
    buf = memoryview(_aligned(PIECE).numpy()) if aligned else memoryview(bytearray(PIECE + 1))[1:]
    r = 0
    try:
        while True:
            n = stream.readinto(buf)
            if not n:
                break
            if tamper is not None:
                tamper(r, buf[:n])
            sink.write(buf[:n], r * PIECE)
            r += 1
    finally:
        stream.close()
        sink.close()
    return sink


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_a_streamed_version_arrives_bitwise_and_verified(tmp_path: Path, aligned: bool) -> None:
    version, files = _version(tmp_path)
    assert files[0][0] == "manifest.json", "the head files (digests) come first"
    offsets, total = _layout(files)
    assert total > PIECE, "the test needs a stream of several pieces"
    for (rel, size), off in zip(files, offsets):
        if size >= DIRECT_MIN_BYTES:
            assert off % DIRECT_ALIGN == 0, f"{rel} starts unaligned in the stream"
    sink = _copy(version, files, tmp_path / "copy", aligned=aligned)
    sink.verified()
    copy = tmp_path / "copy" / version_dirname(1)
    for rel, _ in files:
        assert filecmp.cmp(os.path.join(version, rel), copy / rel, shallow=False), rel
    assert sorted(_files(str(copy))) == sorted(files)


def test_a_byte_changed_on_the_way_is_refused(tmp_path: Path) -> None:
    version, files = _version(tmp_path)
    offsets, _ = _layout(files)
    i = next(i for i, (rel, size) in enumerate(files) if size > PIECE // 2)  # the big chunk

    def flip(r: int, piece: memoryview) -> None:
        at = offsets[i] + files[i][1] - 3  # in its unaligned tail
        if r * PIECE <= at < r * PIECE + len(piece):
            piece[at - r * PIECE] ^= 0x01

    with pytest.raises(CorruptVersionError, match="xxh3"):
        _copy(version, files, tmp_path / "copy", flip)


def test_a_chunk_file_left_out_of_the_stream_is_refused(tmp_path: Path) -> None:
    version, files = _version(tmp_path)
    chunk = next(rel for rel, size in files if size >= DIRECT_MIN_BYTES and not rel.endswith(".json"))
    sink = _copy(version, [f for f in files if f[0] != chunk], tmp_path / "copy")
    with pytest.raises(CorruptVersionError, match="did not come"):
        sink.verified()


def test_a_chunk_of_another_size_than_the_manifest_says_is_refused(tmp_path: Path) -> None:
    version, files = _version(tmp_path)
    chunk = next(rel for rel, size in files if 0 < size < DIRECT_MIN_BYTES and "/c" in rel)
    with open(os.path.join(version, chunk), "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(CorruptVersionError, match="the manifest says"):
        _copy(version, _files(version), tmp_path / "copy")


def test_a_stream_without_its_head_files_is_refused(tmp_path: Path) -> None:
    version, files = _version(tmp_path)
    with pytest.raises(CorruptVersionError, match="without its manifest"):
        _copy(version, [f for f in files if f[0] != "manifest.json"], tmp_path / "copy").verified()


def test_a_file_outside_the_version_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CorruptVersionError, match="outside its version"):
        _Sink(str(tmp_path / "v"), 1, [("../escape", 4)])


def test_a_retired_copys_tree_is_rewritten_into_the_next_copy_exactly(tmp_path: Path) -> None:
    """The copier writes a new copy into the tree of one that retention retired (overwriting
    files is far cheaper than creating them): what the old version had and the new one does
    not is removed, and the result is the new version, bitwise."""
    version, files = _version(tmp_path)
    root = tmp_path / "root"
    g = torch.Generator().manual_seed(1)
    with Checkpointer(root) as ck:  # other arrays, other sizes: one gone, one new, one grown
        ck.save(2, {"big": torch.randn(PIECE // 4, generator=g), "new": {"w": torch.randn(9, generator=g)}})
    newer = str(root / version_dirname(2))
    newer_files = _files(newer)
    _copy(version, files, tmp_path / "copy").verified()
    tree = tmp_path / "next" / version_dirname(2)
    tree.parent.mkdir()
    (tmp_path / "copy" / version_dirname(1)).rename(tree)
    sink = _copy(newer, newer_files, tmp_path / "next", step=2, reuse=True)
    sink.verified()
    assert sorted(_files(str(tree))) == sorted(newer_files)
    for rel, _ in newer_files:
        assert filecmp.cmp(os.path.join(newer, rel), tree / rel, shallow=False), rel
    leftovers = [d for d, subdirs, names in os.walk(tree) if not subdirs and not names]
    assert not leftovers, f"directories of the old version left behind: {leftovers}"
