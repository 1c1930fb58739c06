"""remove_tree: a version tree deleted outside the interpreter, links never followed, and
Python's own walk where the child cannot do it."""

from __future__ import annotations

import errno
import os
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt.store import removal
from ckpt.store.removal import remove_tree
from ckpt.store.tier import open_tier
from tests._dist import can_isolate, in_private_mounts

_counting: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _counting is not None and event in ("os.remove", "os.rmdir", "os.scandir"):
        _counting.append(event)


sys.addaudithook(_audit)  # (a hook cannot be removed: it records only inside `python_calls`)


@pytest.fixture
def python_calls() -> Iterator[list[str]]:
    """The unlink, rmdir and scandir calls this process makes meanwhile."""
    global _counting
    _counting = []
    try:
        yield _counting
    finally:
        _counting = None


def _version_like(root: Path, arrays: int = 60) -> Path:
    """A tree shaped like a version: a directory per array, a chunk file or two in each."""
    top = root / "v"
    for i in range(arrays):
        d = top / "tensors" / f"layer{i}" / "c"
        d.mkdir(parents=True)
        (d / "0").write_bytes(b"x" * 100)
        (d.parent / "zarr.json").write_text("{}")
    ro = top / "tensors" / "layer0" / "c" / "1"
    ro.write_bytes(b"y")
    ro.chmod(0o444)
    return top


@pytest.mark.skipif(shutil.which("rm") is None, reason="needs an rm binary")
def test_the_walk_runs_outside_the_interpreter(tmp_path: Path, python_calls: list[str]) -> None:
    top = _version_like(tmp_path)
    remove_tree(str(top))
    assert not top.exists()
    assert python_calls == [], f"{len(python_calls)} deletions ran in this process"


def test_links_go_and_their_targets_stay(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"k")
    top = _version_like(tmp_path, arrays=3)
    (top / "tensors" / "link").symlink_to(outside)
    remove_tree(str(top))
    assert not top.exists()
    assert (outside / "keep").read_bytes() == b"k"
    # The path itself a link: the link goes, never what it points at.
    alias = tmp_path / "alias"
    alias.symlink_to(outside)
    remove_tree(str(alias))
    assert not os.path.lexists(alias)
    assert (outside / "keep").read_bytes() == b"k"


def test_a_missing_path_or_a_file(tmp_path: Path) -> None:
    remove_tree(str(tmp_path / "none"))  # no error
    f = tmp_path / "file"
    f.write_bytes(b"f")
    remove_tree(str(f))
    assert not f.exists()


@pytest.mark.parametrize("rm", ["missing", "unstartable", "fails"])
def test_pythons_walk_finishes_without_rm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_calls: list[str], rm: str
) -> None:
    """No rm binary, one that cannot start, or one that deletes nothing and fails: the tree
    still goes, through shutil.rmtree (whose calls this process then makes)."""
    false = shutil.which("false")
    if rm == "fails" and false is None:
        pytest.skip("needs a false binary")
    binary = {"missing": None, "unstartable": str(tmp_path / "no-such-rm"), "fails": false}[rm]
    monkeypatch.setattr(removal, "_rm", lambda: binary)
    top = _version_like(tmp_path, arrays=5)
    remove_tree(str(top))
    assert not top.exists()
    assert "os.rmdir" in python_calls


def test_a_local_tiers_delete_tree(tmp_path: Path, python_calls: list[str]) -> None:
    """Retention and GC delete a version through the tier: outside the interpreter too."""
    _version_like(tmp_path / "tier", arrays=10)
    tier = open_tier(str(tmp_path / "tier"))
    tier.delete_tree("v")
    assert not (tmp_path / "tier" / "v").exists()
    if shutil.which("rm") is not None:
        assert "os.rmdir" not in python_calls


def test_what_cannot_go_raises_its_oserror_unless_ignored(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"f")
    with pytest.raises(NotADirectoryError):
        remove_tree(str(f / "below"))
    remove_tree(str(f / "below"), ignore_errors=True)
    assert f.exists()


@pytest.mark.skipif(not can_isolate(), reason="needs root, unshare(1) and mount namespaces")
def test_a_tree_on_a_read_only_mount_raises_erofs_and_stays(tmp_path: Path) -> None:
    """rm fails on a read-only bind mount (in a private mount namespace); Python's walk
    then raises the OSError with its errno, or nothing with ignore_errors, and the tree stays."""
    top = _version_like(tmp_path / "ro", arrays=3)
    script = textwrap.dedent(
        f"""
        from ckpt.store.removal import remove_tree
        remove_tree({str(top)!r}, ignore_errors=True)
        try:
            remove_tree({str(top)!r})
        except OSError as e:
            print("errno", e.errno)
        """
    )
    ro = tmp_path / "ro"
    out = in_private_mounts(f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro}", script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["errno", str(errno.EROFS)], out.stdout
    assert (top / "tensors" / "layer1" / "c" / "0").read_bytes() == b"x" * 100
