"""Restore from several tiers, and checkpoints written by an adversary.

- a corrupt, truncated or missing chunk (or manifest) of the newest version on the
  primary root is read from the next tier: restore() still returns the newest step,
  bit for bit; only when no tier holds a good copy does it fall back to an older one;
- chunks above 1 MiB are verified block by block, partial reads included;
- verify_on_restore=False skips checksums but not size checks;
- crafted manifests ('..' or absolute names, overflowing shapes, absurd chunk shapes)
  and symlinks or FIFOs in a version are refused before anything outside the version is
  read and before anything is allocated;
- a file that runs code under torch.load(weights_only=False) runs none here.

(Single-tier corruption fallback and the manifest field checks are in
tests/store/test_format_and_errors.py.)
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from click.testing import CliRunner

import ckpt
import ckpt._load as load_mod
import ckpt.restore.execute as execute_mod
from ckpt import Checkpointer
from ckpt.cli import main as cli
from ckpt.store.manifest import parse_manifest
from tests._manifests import chunk_digests, crafted, edit_rank_file
from tests._states import assert_bitwise, blank, save_steps

BIG = "state/big/c.0.0"  # 2048 x 1024 float32 = 8 MiB: eight checksummed 1 MiB blocks
BIG_BYTES = 2048 * 1024 * 4
LAST = 1792  # the first row of its last block
W = "state/w/c.0.0"  # 40 x 30 float32 = 4800 bytes


def vdir(root: Path, step: int) -> Path:
    return root / f"v{step:012d}"


def make_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(40, 30, generator=g),
        "i": torch.randint(-(2**40), 2**40, (5, 3), generator=g, dtype=torch.int64),
        "big": torch.randn(2048, 1024, generator=g),
        "s": torch.tensor(float(step)),  # 0-d: inline in the manifest, no file
        "model": {"weight": torch.randn(16, 8, generator=g), "bias": torch.randn(16, generator=g)},
        "meta": {"step": step},
    }


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x40]))


def flip_last_block(version: Path) -> None:
    """One byte in the last 1 MiB block of the 8 MiB chunk (the other blocks stay intact)."""
    flip_byte(version / BIG, BIG_BYTES - 4096 + 17)


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def edit_manifest(version: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    path = version / "manifest.json"
    doc = json.loads(path.read_bytes())
    fn(doc)
    path.write_bytes(crafted(doc))


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def cli_run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def two_tiers(tmp_path: Path) -> tuple[Path, Path, dict[str, Any], dict[str, Any]]:
    """Steps 1 and 2 on `root`; a second tier holding a copy of step 2."""
    root, tier = tmp_path / "root", tmp_path / "tier"
    old, new = make_state(1), make_state(2)
    assert save_steps(root, {1: old, 2: new}) == [1, 2]
    tier.mkdir()
    shutil.copytree(vdir(root, 2), vdir(tier, 2))
    big = json.loads((vdir(root, 2) / "manifest.json").read_bytes())["arrays"]["big"]
    blocks = chunk_digests(vdir(root, 2))["big"][0][1]
    assert big["block_rows"] == 2048 - LAST and len(blocks) == 8  # the blocks under test exist
    return root, tier, old, new


# -- 1. tier fallback ----------------------------------------------------------------------------


CHUNK_DAMAGE: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "flipped-byte": (lambda v: flip_byte(v / W, 2400), W, "checksum"),
    "flipped-byte-last-block": (flip_last_block, BIG, "rows (1792, 2048) fail their checksum"),
    "truncated": (lambda v: truncate(v / BIG), BIG, f"has {BIG_BYTES // 2} bytes"),
    "missing": (lambda v: (v / "state/i/c.0.0").unlink(), "state/i/c.0.0", "missing"),
}


@pytest.mark.parametrize("kind", list(CHUNK_DAMAGE))
def test_bad_chunk_is_read_from_the_next_tier(
    two_tiers: tuple[Path, Path, dict[str, Any], dict[str, Any]], kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    root, tier, _, new = two_tiers
    damage, chunk, why = CHUNK_DAMAGE[kind]
    damage(vdir(root, 2))
    with Checkpointer(root, tiers=[tier]) as ck:
        got = blank(new)
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            assert ck.restore(got) == 2  # the newest, not the older intact version
        assert_bitwise(got, new)
        msgs = [m for m in warnings_of(caplog) if "used the copy on" in m]
        assert len(msgs) == 1, warnings_of(caplog)
        assert str(tier) in msgs[0] and f"{vdir(root, 2)}/{chunk}" in msgs[0] and why in msgs[0], msgs[0]
        assert not any("older version" in m for m in warnings_of(caplog))
        got = blank(new)
        assert ck.restore(got, step=2) == 2
        assert_bitwise(got, new)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(truncate, id="truncated"),
        pytest.param(lambda p: p.write_bytes(b"\x00\xff{garbage"), id="garbage"),
        pytest.param(lambda p: p.write_text('{"format": "ckpt"}'), id="incomplete"),
    ],
)
def test_bad_manifest_is_read_from_the_next_tier(
    two_tiers: tuple[Path, Path, dict[str, Any], dict[str, Any]],
    damage: Callable[[Path], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    root, tier, old, new = two_tiers
    damage(vdir(root, 2) / "manifest.json")
    with Checkpointer(root, tiers=[tier]) as ck:
        got = blank(new)
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            assert ck.restore(got) == 2
        assert_bitwise(got, new)
        assert any(m.startswith(f"manifest of step 2 on {root}: ") for m in warnings_of(caplog))
    with Checkpointer(root) as ck:  # without the tier the version is lost
        got = blank(old)
        assert ck.restore(got) == 1
        assert_bitwise(got, old)


def test_newest_only_on_the_second_tier(two_tiers: tuple[Path, Path, dict[str, Any], dict[str, Any]]) -> None:
    root, tier, old, new = two_tiers
    shutil.rmtree(vdir(root, 2))
    with Checkpointer(root, tiers=[tier]) as ck:
        assert ck.steps() == [1]  # this rank's root
        got = blank(new)
        assert ck.restore(got) == 2
        assert_bitwise(got, new)
        got = blank(old)
        assert ck.restore(got, step=1) == 1
        assert_bitwise(got, old)


def test_every_tier_corrupt_falls_back_to_older(
    two_tiers: tuple[Path, Path, dict[str, Any], dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    root, tier, old, new = two_tiers
    flip_last_block(vdir(root, 2))
    flip_last_block(vdir(tier, 2))
    with Checkpointer(root, tiers=[tier]) as ck:
        got = blank(old)
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            assert ck.restore(got) == 1
        assert_bitwise(got, old)
        assert any("step 2 is not intact" in m for m in warnings_of(caplog)), warnings_of(caplog)
        with pytest.raises(ckpt.CorruptVersionError) as info:
            ck.restore(blank(new), step=2)
        assert f"{vdir(root, 2)}/{BIG}" in str(info.value) and f"{vdir(tier, 2)}/{BIG}" in str(info.value)


def test_partial_reads_verify_the_blocks_they_read(
    two_tiers: tuple[Path, Path, dict[str, Any], dict[str, Any]],
) -> None:
    """A piece of a large chunk reads (and checks) only the blocks it overlaps."""
    root, tier, old, new = two_tiers
    flip_last_block(vdir(root, 2))

    def target(rows: tuple[int, int]) -> dict[str, Any]:
        t: dict[str, Any] = blank(new)
        t["big"] = ckpt.Shard(torch.zeros(rows[1] - rows[0], 1024), (2048, 1024), (rows[0], 0))
        return t

    with Checkpointer(root) as ck:
        got = target((0, LAST))  # every block but the last: intact
        assert ck.restore(got) == 2
        assert_bitwise(got["big"].local_tensor, new["big"][:LAST], "big[:LAST]")
        got = target((1900, 2048))  # within the corrupt block, and no other tier
        assert ck.restore(got) == 1
        assert_bitwise(got["big"].local_tensor, old["big"][1900:], "big[1900:]")
    with Checkpointer(root, tiers=[tier]) as ck:
        got = target((1700, 1800))  # straddles the last two blocks
        assert ck.restore(got) == 2
        assert_bitwise(got["big"].local_tensor, new["big"][1700:1800], "big[1700:1800]")
        assert_bitwise(got["model"], new["model"])


def test_without_verification_only_sizes_are_checked(
    two_tiers: tuple[Path, Path, dict[str, Any], dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    root, tier, _, new = two_tiers
    flip_byte(vdir(root, 2) / W, 2400)  # element 600 of w
    with Checkpointer(root, tiers=[tier], verify_on_restore=False) as ck:
        got = blank(new)
        assert ck.restore(got) == 2
        # The flipped byte is not detected: it is restored from the primary, as is.
        differs = (got["w"] != new["w"]).flatten().nonzero().flatten().tolist()
        assert differs == [600]
        assert_bitwise({k: v for k, v in got.items() if k != "w"}, {k: v for k, v in new.items() if k != "w"})
        truncate(vdir(root, 2) / BIG)
        got = blank(new)
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            assert ck.restore(got) == 2
        assert_bitwise(got["big"], new["big"], "big")  # a truncated chunk is still caught: read from the tier
        assert any(f"has {BIG_BYTES // 2} bytes" in m and str(tier) in m for m in warnings_of(caplog))


# -- 2. hostile manifests and files ---------------------------------------------------------------


def tree_outside(tmp_path: Path, root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under tmp_path outside `root`, with (size, mtime) and for files atime (listing bumps a dir's)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(tmp_path):
        if Path(dirpath) == root or root in Path(dirpath).parents:
            dirnames[:] = []
            continue
        for n in dirnames + filenames:
            if Path(dirpath, n) == root:
                continue  # the root itself may change: restore pins the version it reads
            st = os.lstat(os.path.join(dirpath, n))
            out[os.path.join(dirpath, n)] = (st.st_size, st.st_mtime_ns, st.st_atime_ns if n in filenames else 0)
    return out


@pytest.mark.parametrize("name", ["w\n", "w\n/x"])
def test_array_name_with_a_line_break_is_refused(tmp_path: Path, name: str) -> None:
    """A component ending in a line break once passed the name check (a regex's '$' also
    matches before a final newline): the name would become a path with a newline in it."""
    root = tmp_path / "root"
    assert save_steps(root, {1: make_state(1)}) == [1]
    edit_manifest(vdir(root, 1), lambda doc: doc["arrays"].__setitem__(name, doc["arrays"].pop("w")))
    with pytest.raises(ckpt.ManifestError, match="not a safe relative path"):
        parse_manifest((vdir(root, 1) / "manifest.json").read_bytes())


@pytest.mark.parametrize("name", ["../../../planted", "model/../../../../planted", "ABSOLUTE"])
def test_array_name_leaving_the_version_is_refused(tmp_path: Path, name: str) -> None:
    """The manifest points 'w' at a planted file outside, with its true checksum: nothing reads it."""
    root = tmp_path / "root"
    old, new = make_state(1), make_state(2)
    assert save_steps(root, {1: old, 2: new}) == [1, 2]
    if name == "ABSOLUTE":
        name = str(tmp_path / "planted")
    else:  # it resolves to the planted file
        assert os.path.normpath(f"{vdir(root, 2)}/state/{name}/c.0.0") == str(tmp_path / "planted/c.0.0")
    planted = tmp_path / "planted/c.0.0"
    planted.parent.mkdir(parents=True)
    evil = torch.full((40, 30), 1234.5)
    planted.write_bytes(evil.numpy().tobytes())
    os.utime(planted, ns=(10**9, planted.stat().st_mtime_ns))  # atime < mtime: any read would bump it

    def aim_rank(doc: dict[str, Any]) -> None:  # the tree and the digests point at the planted file
        (entry,) = doc["chunks"].pop("w")
        doc["chunks"][name] = [[entry[0], xxhash.xxh3_64_hexdigest(evil.numpy().tobytes())]]
        doc["tree"]["w"] = {"__tensor__": name}

    def aim(doc: dict[str, Any]) -> None:
        doc["arrays"][name] = doc["arrays"].pop("w")

    edit_rank_file(vdir(root, 2), 0, aim_rank)
    edit_manifest(vdir(root, 2), aim)
    with pytest.raises(ckpt.ManifestError, match="not a safe relative path"):
        parse_manifest((vdir(root, 2) / "manifest.json").read_bytes())
    before = tree_outside(tmp_path, root)
    with Checkpointer(root) as ck:
        with pytest.raises(ckpt.ManifestError, match="not a safe relative path"):
            ck.restore(blank(new), step=2)
        got = blank(old)
        assert ck.restore(got) == 1
        assert_bitwise(got, old)
        got = dict.fromkeys(old)  # no live tensor for 'w': restore would create one from whatever it read
        assert ck.restore(got) == 1
        assert_bitwise(got["w"], old["w"], "w")
    result = cli_run("verify", str(root))
    assert result.exit_code == 1 and "step 2: BAD manifest" in result.output, result.output
    # The summary names a damaged version, not a bad chunk (a manifest is no chunk).
    assert "1 damaged version" in result.output and "bad chunk" not in result.output, result.output
    assert tree_outside(tmp_path, root) == before  # nothing outside opened for reading, created or changed


def _symlink_chunk(v: Path, outside: Path) -> None:
    shutil.copy(v / W, outside / "chunk")  # identical bytes: its checksum would pass
    (v / W).unlink()
    (v / W).symlink_to(outside / "chunk")


def _symlink_dir(rel: str) -> Callable[[Path, Path], None]:
    def go(v: Path, outside: Path) -> None:
        shutil.copytree(v / rel, outside / "copy")
        shutil.rmtree(v / rel)
        (v / rel).symlink_to(outside / "copy", target_is_directory=True)

    return go


def _symlink_manifest(v: Path, outside: Path) -> None:
    shutil.copy(v / "manifest.json", outside / "manifest.json")
    (v / "manifest.json").unlink()
    (v / "manifest.json").symlink_to(outside / "manifest.json")


SYMLINKS = {  # how, and what `ckpt verify` must name
    "chunk-file": (_symlink_chunk, [W]),
    "chunk-dir": (_symlink_dir("state/model"), ["state/model/weight/c.0.0", "state/model/bias/c.0"]),
    "state-dir": (_symlink_dir("state"), [W, BIG, "state/i/c.0.0", "state/model/bias/c.0"]),
    "manifest": (_symlink_manifest, ["manifest"]),
}


@pytest.mark.parametrize("with_tier", [False, True], ids=["alone", "tier"])
@pytest.mark.parametrize("kind", list(SYMLINKS))
def test_symlinks_in_a_version_are_refused(
    two_tiers: tuple[Path, Path, dict[str, Any], dict[str, Any]],
    tmp_path: Path,
    kind: str,
    with_tier: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root, tier, old, new = two_tiers
    outside = tmp_path / "outside"
    outside.mkdir()
    how, named = SYMLINKS[kind]
    how(vdir(root, 2), outside)
    with Checkpointer(root, tiers=[tier] if with_tier else []) as ck:
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            if with_tier:  # the good copy on the tier is used, never the link
                got = blank(new)
                assert ck.restore(got) == 2
                assert_bitwise(got, new)
                assert any(str(tier) in m or str(root) in m and "manifest" in m for m in warnings_of(caplog))
            else:
                got = blank(old)
                assert ck.restore(got) == 1
                assert_bitwise(got, old)
                with pytest.raises(ckpt.CorruptVersionError, match="symbolic link|symlink"):
                    ck.restore(blank(new), step=2)
    result = cli_run("verify", str(root))
    assert result.exit_code == 1, result.output
    assert "step 1: ok" in result.output
    for n in named:
        assert f"step 2: BAD {n}" in result.output, result.output


def _huge_shape(v: Path) -> None:
    def edit(doc: dict[str, Any]) -> None:  # 2**82 bytes; the chunk entry itself stays plausible
        doc["arrays"]["w"]["shape"] = [2**40, 2**40]

    edit_manifest(v, edit)


def _huge_chunk_shape(v: Path) -> None:
    nbytes = 2**21 * 2**20 * 4  # 8 TiB per chunk for a 40 x 30 array

    def edit(doc: dict[str, Any]) -> None:  # the file size follows from the chunk shape
        doc["arrays"]["w"]["chunk_shape"] = [2**21, 2**20]

    edit_manifest(v, edit)
    with contextlib.suppress(OSError):  # a sparse chunk file of that size, where the filesystem allows
        os.truncate(v / W, nbytes)


@pytest.mark.parametrize("craft", [_huge_shape, _huge_chunk_shape], ids=["shape", "chunk-shape"])
def test_absurd_sizes_are_refused_before_allocating(
    tmp_path: Path, craft: Callable[[Path], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    old, new = make_state(1), make_state(2)
    assert save_steps(root, {1: old, 2: new}) == [1, 2]
    craft(vdir(root, 2))
    with pytest.raises(ckpt.ManifestError, match="absurdly large|chunk_shape"):
        parse_manifest((vdir(root, 2) / "manifest.json").read_bytes())

    asked: list[int] = []
    real_full, real_get = execute_mod.full_tensor, execute_mod._Bounce.get

    def full_tensor(array: Any) -> torch.Tensor:
        asked.append(array.nbytes)
        assert array.nbytes < 1 << 30, f"allocating {array.nbytes} bytes for {array.name}"
        return real_full(array)

    def get(self: Any, nbytes: int) -> torch.Tensor:
        asked.append(nbytes)
        assert nbytes < 1 << 30, f"allocating a {nbytes}-byte buffer"
        return real_get(self, nbytes)

    monkeypatch.setattr(load_mod, "full_tensor", full_tensor)
    monkeypatch.setattr(execute_mod._Bounce, "get", get)
    with Checkpointer(root) as ck:
        with pytest.raises(ckpt.ManifestError):
            ck.restore(dict.fromkeys(new), step=2)  # no live 'w': restore would allocate it from the manifest's shape
        got: dict[str, Any] = dict.fromkeys(old)
        assert ck.restore(got) == 1
        assert_bitwise(got, old)
    assert asked and max(asked) < 1 << 30


# -- FIFOs: opening one for reading would block forever -------------------------------------------


@contextlib.contextmanager
def fifo_watchdog(paths: list[Path], after: float = 5.0) -> Iterator[list[bool]]:
    """Unblock any reader stuck opening one of the FIFOs (after `after` s); reports whether one was."""
    fired = [False]
    stop = threading.Event()

    def run() -> None:
        if stop.wait(after):
            return
        while not stop.is_set():
            for p in paths:
                try:
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
                    fired[0] = True
                except OSError as e:
                    assert e.errno in (errno.ENXIO, errno.ENOENT), e
            stop.wait(0.2)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield fired
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("kind", ["chunk", "manifest", "root-info"])
def test_fifos_in_a_version_do_not_hang(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "root"
    old, new = make_state(1), make_state(2)
    assert save_steps(root, {1: old, 2: new}) == [1, 2]
    path = vdir(root, 2) / {"chunk": W, "manifest": "manifest.json", "root-info": "root.json"}[kind]
    path.unlink()
    os.mkfifo(path)
    with fifo_watchdog([path]) as stuck:
        with Checkpointer(root) as ck:
            got = blank(old)
            assert ck.restore(got) == 1
            assert_bitwise(got, old)
            with pytest.raises((ckpt.CorruptVersionError, ckpt.VersionNotFoundError)):
                ck.restore(blank(new), step=2)
        verify = cli_run("verify", str(root), "--step", "2")
        listing = cli_run("ls", str(root), "--json")
    assert not stuck[0], "a reader blocked opening the FIFO"
    assert stat.S_ISFIFO(path.lstat().st_mode)
    assert listing.exit_code == 0, listing.output
    if kind == "chunk":
        assert verify.exit_code == 1 and f"BAD {W}" in verify.output and "regular file" in verify.output
    if kind == "manifest":
        assert verify.exit_code == 1 and "BAD manifest" in verify.output, verify.output


# -- 3. no code runs ------------------------------------------------------------------------------


class _RunsCode:
    """Unpickling this creates `marker`: what torch.load(weights_only=False) would do with it."""

    def __init__(self, marker: Path, pad: int = 0) -> None:
        self.marker, self.pad = marker, pad

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').close()  # " + "x" * self.pad,))


def _torch_file(obj: Any, legacy: bool) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


def _payload_of_size(marker: Path, size: int) -> bytes:
    """A legacy torch.save file of exactly `size` bytes (so it passes a chunk's size check)."""
    base = len(_torch_file(_RunsCode(marker), legacy=True))
    for pad in range(size - base - 8, size - base + 8):
        data = _torch_file(_RunsCode(marker, pad), legacy=True)
        if len(data) == size:
            return data
    raise AssertionError("could not size the payload")


def test_crafted_files_run_no_code(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / "CODE_RAN"
    chunk_payload = _payload_of_size(marker, 4800)  # the size of w's chunk
    manifest_payload = _torch_file(_RunsCode(marker), legacy=False)  # an ordinary .pt file
    for data in (chunk_payload, manifest_payload):  # both are live: torch.load runs them
        (tmp_path / "probe.pt").write_bytes(data)
        torch.load(tmp_path / "probe.pt", weights_only=False)
        assert marker.exists()
        marker.unlink()

    root = tmp_path / "root"
    states = {s: make_state(s) for s in (1, 2, 3)}
    assert save_steps(root, states) == sorted(states)
    (vdir(root, 2) / W).write_bytes(chunk_payload)
    (vdir(root, 3) / "manifest.json").write_bytes(manifest_payload)
    with Checkpointer(root) as ck:
        got = blank(states[1])
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            assert ck.restore(got) == 1
        assert_bitwise(got, states[1])
        msgs = warnings_of(caplog)
        assert any("step 3 is not intact" in m and "not valid JSON" in m for m in msgs), msgs
        assert any("step 2 is not intact" in m and W in m and "checksum" in m for m in msgs), msgs
        with pytest.raises(ckpt.ManifestError, match="not valid JSON"):
            ck.restore(blank(states[3]), step=3)
        with pytest.raises(ckpt.CorruptVersionError, match="state/w/c.0.0.*checksum"):
            ck.restore(blank(states[2]), step=2)
    verify = cli_run("verify", str(root))
    assert verify.exit_code == 1
    assert "step 1: ok" in verify.output
    assert f"step 2: BAD {W}" in verify.output
    assert "step 3: BAD manifest" in verify.output and "not valid JSON" in verify.output
    listing = cli_run("ls", str(root), "--json")
    assert listing.exit_code == 0, listing.output
    rows = {r["step"]: r for r in json.loads(listing.output)}
    assert rows[1]["status"] == rows[2]["status"] == "committed"
    assert rows[3]["status"] == "damaged" and "not valid JSON" in rows[3]["detail"]
    assert not marker.exists()

    # Even with a manifest that vouches for the payload's bytes, they are only ever data.
    edit_rank_file(
        vdir(root, 2), 0, lambda d: d["chunks"]["w"][0].__setitem__(1, xxhash.xxh3_64_hexdigest(chunk_payload))
    )
    with Checkpointer(root) as ck:
        got = blank(states[2])
        assert ck.restore(got, step=2) == 2
    assert got["w"].numpy().tobytes() == chunk_payload
    assert_bitwise({k: v for k, v in got.items() if k != "w"}, {k: v for k, v in states[2].items() if k != "w"})
    assert cli_run("verify", str(root), "--step", "2").exit_code == 0
    assert not marker.exists()
