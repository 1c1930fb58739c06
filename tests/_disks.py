"""Simulated disks for placement: directories with a `.ckpt-disk` marker above them, which
placement (replicator.placement.disk_id) takes for distinct disks on one filesystem."""

from __future__ import annotations

from pathlib import Path


def two_disks(tmp_path: Path) -> tuple[Path, Path]:
    """Two directories that placement treats as two disks (a `.ckpt-disk` marker above each)."""
    roots = []
    for name in ("disk0", "disk1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".ckpt-disk").write_text(name)
        roots.append(tmp_path / name / "ckpt")
    return roots[0], roots[1]
