"""Failure modes a review of the storage refactor found, each reproduced: a collector racing a
committer, an overwrite tearing a replica, one rank failing between collectives, a backend
error that is no OSError, a refused read taken for damage, an unreadable root.json, a
symlinked version, one GET per MiB, an abort that fails. Each test fails on 6105ef0."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import ckpt.store._local as local_mod
from ckpt import Checkpointer
from ckpt._commit import RootContext
from ckpt._dist import Comm as RealComm
from ckpt._roots import recover
from ckpt.replicator import gc as gcmod
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.journal import Journal
from ckpt.replicator.placement import Destination
from ckpt.replicator.policy import KeepLast
from ckpt.replicator.publish import publish
from ckpt.replicator.ratelimit import RateLimiter
from ckpt.replicator.service import Replicator
from ckpt.replicator.transfer import Transfer, copy_files
from ckpt.restore.locate import restore_newest
from ckpt.store._fsspec import FsspecTier
from ckpt.store.errors import TierUnavailableError
from ckpt.store.manifest import SCHEMA_VERSION
from ckpt.store.retry import RetryPolicy
from ckpt.store.tier import open_tier
from ckpt.store.verify import verify_chunks
from ckpt.store.versions import COMMIT_CLAIM, committed, committed_steps, read_manifest, read_root_info
from tests._disks import two_disks


class _ThreadComm:
    """Ranks as threads; all_gather and any as gloo's, but giving up after `timeout` (gloo: 30
    min), and refusing ranks that make different collectives at one point."""

    def __init__(self, rank: int, shared: dict[str, Any], timeout: float = 10.0) -> None:
        self.rank, self.world, self.s, self.timeout = rank, 2, shared, timeout

    def _gather(self, kind: str, obj: Any) -> list[Any]:
        self.s["slots"][self.rank] = (kind, obj)
        self.s["barrier"].wait(timeout=self.timeout)
        out = list(self.s["slots"])
        self.s["barrier"].wait(timeout=self.timeout)
        kinds = {k for k, _ in out}
        if len(kinds) > 1:  # gloo would pair them wrongly or hang
            raise AssertionError(f"ranks made different collectives: {sorted(kinds)}")
        return [o for _, o in out]

    def all_gather(self, obj: Any) -> list[Any]:
        return self._gather("all_gather", obj)

    def any(self, flag: bool) -> bool:
        return any(self._gather("all_reduce", flag))

    agree = RealComm.agree


def _two_ranks(fn: Any, comm: type[_ThreadComm] = _ThreadComm) -> dict[int, str]:
    shared = {"slots": [None, None], "barrier": threading.Barrier(2)}
    out: dict[int, str] = {}

    def run(rank: int) -> None:
        try:
            out[rank] = repr(fn(comm(rank, shared), rank))
        except BaseException as e:  # noqa: BLE001
            out[rank] = f"{type(e).__name__}: {e}"

    ths = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in (0, 1)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return out


def _save(root: Path, *steps: int) -> None:
    with Checkpointer(root) as ck:
        for s in steps:
            ck.save(s, {"a": torch.full((4096,), float(s)), "b": torch.arange(32) * s, "step": s})


# -- 1. the abandoned-upload collector steals a live committer's claim ------------------------


@pytest.mark.parametrize("preclaimed", [False, True])
def test_collector_does_not_delete_under_a_live_committer(tmp_path: Path, preclaimed: bool) -> None:
    """preclaimed: the committer claimed in an earlier pass (its claim is as old as the rest)."""
    root, remote_dir = tmp_path / "root", tmp_path / "remote"
    remote = f"file://{remote_dir}"
    _save(root, 1)
    src = open_tier(str(root))
    m = read_manifest(src, 1)
    writers = list(read_root_info(src, 1).writers)  # type: ignore[union-attr]
    collector_found, committer_checked, collector_done = threading.Event(), threading.Event(), threading.Event()

    class HookedDest(Destination):
        def check_disk(self) -> None:  # publish() calls it after missing_files(), before root.json
            if threading.current_thread().name == "committer":
                committer_checked.set()
                collector_done.wait(10)

    dest = HookedDest(remote, "shared", open_tier(remote))
    t = Transfer(
        src, 1, m, dest, Journal(str(tmp_path / "j.json"), str(tmp_path)), RateLimiter(None), threading.Event()
    )
    sizes = copy_files(t)
    if preclaimed:
        open_tier(remote).put_if_absent(f"v000000000001/{COMMIT_CLAIM}", m.save_id.encode())
    old = time.time() - 7200  # the upload stalled long ago
    for d, _, names in os.walk(remote_dir / "v000000000001"):
        for n in names:
            os.utime(os.path.join(d, n), (old, old))
    gtier = open_tier(remote)
    real_pia = gtier.put_if_absent

    def pia(key: str, data: bytes) -> None:
        if key.endswith(COMMIT_CLAIM) and threading.current_thread().name == "collector":
            collector_found.set()  # listed everything old; a committer claims and checks first
            committer_checked.wait(10)
        real_pia(key, data)

    gtier.put_if_absent = pia  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    tc = threading.Thread(target=lambda: out.update(c=gcmod.collect_abandoned(gtier, 3600)), name="collector")
    tc.start()
    collector_found.wait(10)
    tp = threading.Thread(target=lambda: out.update(p=publish(t, writers, 0, sizes)), name="committer")
    tp.start()
    tc.join(20)
    collector_done.set()
    tp.join(20)
    rt = open_tier(remote)
    if 1 in [c.step for c in committed(rt)]:
        assert not list(verify_chunks(rt, 1, read_manifest(rt, 1))), "a committed remote version lost its chunks"
    assert not (out.get("p") is True and out.get("c") == [1]), out


# -- 1b. overwrite: the new save's chunks are copied into the replica's committed old version ---


def test_overwrite_does_not_tear_a_replica(tmp_path: Path) -> None:
    root, disk2 = two_disks(tmp_path)  # (an unmarked directory beside the root is on its disk: no copy goes there)
    _save(root, 1)
    rep = Replicator([str(root)], ReplicatorConfig(replicas=2, replica_roots=(str(disk2),)))
    rep.run_once()
    with Checkpointer(root) as ck:
        ck.save(1, {"a": torch.full((4096,), 7.0), "b": torch.arange(32) * 7, "step": 1}, overwrite=True)
    for _ in range(2):
        st = rep.run_once()[str(root)]
    (label,) = os.listdir(disk2 / "replicas")
    rt = open_tier(str(disk2 / "replicas" / label))
    verified = any(c.state == "verified" for c in st.versions[1].copies.values())
    if 1 in committed_steps(rt):
        problems = list(verify_chunks(rt, 1, read_manifest(rt, 1)))
        assert not problems, f"replica is torn (verified={verified}): {problems[:1]}"
        assert read_manifest(rt, 1).save_id == read_manifest(open_tier(str(root)), 1).save_id or not verified


# -- 2. restore_newest: an exists() that raises on one rank between two collectives ------------


def test_restore_newest_fails_every_rank_together(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _save(root, 1)
    url = f"memory://review-{os.getpid()}-{time.time_ns()}/ckpt"
    src, remote = open_tier(str(root)), FsspecTier(url, retry=RetryPolicy(attempts=1))
    for o in src.find("v000000000001"):
        remote.put(o.key, src.get(o.key))
    calls = [0]

    class Flaky(FsspecTier):
        def exists(self, key: str) -> bool:
            # The listing reads each version directory with listdir(); this exists() is the
            # check after the pin, a HEAD on S3: it fails on rank 1 (retries exhausted).
            if key.endswith("manifest.json") and threading.current_thread().name == "rank1":
                calls[0] += 1
                raise TierUnavailableError(errno.ECONNRESET, "stat: connection reset")
            return super().exists(key)

    flaky = Flaky(url, retry=RetryPolicy(attempts=1))
    out = _two_ranks(lambda comm, rank: restore_newest(comm, lambda: [flaky], lambda loc: loc.step))
    assert "BrokenBarrierError" not in out[0] + out[1], out
    assert "different collectives" not in out[0] + out[1], out
    assert all(o.startswith("TierUnavailableError") for o in out.values()), out  # on both ranks alike


# -- 2b. a backend exception that is no OSError (no credentials) escapes the tier --------------


def test_missing_credentials_make_the_remote_unavailable_not_fatal(tmp_path: Path, monkeypatch: Any) -> None:
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    root = tmp_path / "root"
    _save(root, 1)
    state = {"a": torch.zeros(4096), "b": torch.zeros(32, dtype=torch.int64), "step": 0}
    opts = {"endpoint_url": "http://127.0.0.1:9", "client_kwargs": {"region_name": "us-east-1"}}
    with Checkpointer(root, tiers=["s3://no-such-bucket/ckpt"], storage_options=opts) as ck:
        assert ck.restore(state) == 1


# -- 2c. a refused read (S3 403) is taken for damage: silent rollback ---------------------------


def test_a_refused_remote_read_is_not_damage(tmp_path: Path, monkeypatch: Any) -> None:
    root = tmp_path / "root"
    _save(root, 1, 2)
    url = f"memory://review-{os.getpid()}-{time.time_ns()}/ckpt"
    remote, src = open_tier(url), open_tier(str(root))
    for s in (1, 2):
        for o in src.find(f"v{s:012d}"):
            remote.put(o.key, src.get(o.key))
    cls = type(fsspec.filesystem("memory"))
    real = cls.cat_file

    def cat_file(self: Any, path: str, start: Any = None, end: Any = None, **kw: Any) -> Any:
        if "v000000000002/state/" in path:
            raise PermissionError(errno.EACCES, "Access Denied (ExpiredToken)")
        return real(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(cls, "cat_file", cat_file)
    state = {"a": torch.zeros(4096), "b": torch.zeros(32, dtype=torch.int64), "step": 0}
    with Checkpointer(tmp_path / "fresh", tiers=[url]) as ck:
        try:
            got = ck.restore(state)
        except (TierUnavailableError, PermissionError):
            return
    assert got != 1, "restore() silently fell back to step 1 because of a 403"


# -- 2d. recover(): one unreadable root.json raises on the leader before agree() ---------------


def test_recover_with_an_unreadable_root_info(tmp_path: Path, monkeypatch: Any) -> None:
    root = tmp_path / "root"
    _save(root, 1, 2)
    real = local_mod.open_beneath

    def open_beneath(top: str, rel: str, top_fd: int | None = None) -> tuple[int, int]:
        if rel == "v000000000001/root.json":
            raise OSError(errno.EIO, "Input/output error")
        return real(top, rel, top_fd)

    monkeypatch.setattr(local_mod, "open_beneath", open_beneath)
    Checkpointer(root).close()  # the previous code skipped the unreadable version
    out = _two_ranks(
        lambda comm, rank: recover(comm, RootContext(str(root), rank, rank == 0, 0, ((0, 1),)), open_tier(str(root)))
    )
    assert "BrokenBarrierError" not in out[0] + out[1], out
    assert "different collectives" not in out[0] + out[1], out


# -- 3. a symlinked version directory wedges every GC pass ---------------------------------------


def test_a_symlinked_version_dir_does_not_wedge_gc(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _save(root, 1, 2)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(root / "v000000000001", elsewhere)
    os.symlink(elsewhere, root / "v000000000000")
    tier = open_tier(str(root))
    gcmod.collect(tier, KeepLast(1))
    gcmod.collect(tier, KeepLast(1))  # the second pass finishes what the first left
    assert (elsewhere / "manifest.json").exists()


# -- 3b. remote restore: one GET per MiB -----------------------------------------------------------


def test_remote_restore_reads_in_few_requests(tmp_path: Path, monkeypatch: Any) -> None:
    root = tmp_path / "root"
    n = 16 << 20
    with Checkpointer(root) as ck:
        ck.save(1, {"a": torch.zeros(n // 4), "step": 1})
    url = f"memory://review-{os.getpid()}-{time.time_ns()}/ckpt"
    remote, src = open_tier(url), open_tier(str(root))
    for o in src.find("v000000000001"):
        remote.put(o.key, src.get(o.key))
    cls = type(fsspec.filesystem("memory"))
    real = cls.cat_file
    gets = [0]

    def cat_file(self: Any, *a: Any, **k: Any) -> Any:
        gets[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(cls, "cat_file", cat_file)
    state = {"a": torch.ones(n // 4), "step": 0}
    with Checkpointer(tmp_path / "fresh", tiers=[url]) as ck:
        assert ck.restore(state) == 1
    assert gets[0] <= 6, f"{gets[0]} GETs to restore one 16 MiB chunk"


# -- 4. an abandoned multipart upload whose abort fails is completed by the file's __del__ -----


def test_a_failed_abort_publishes_no_truncated_object(request: pytest.FixtureRequest, monkeypatch: Any) -> None:
    import gc as pygc

    import s3fs

    place = request.getfixturevalue("s3")
    tier = open_tier(place.url, place.options)

    def discard(self: Any) -> None:
        raise ConnectionResetError(104, "abort_multipart_upload: connection reset")

    monkeypatch.setattr(s3fs.core.S3File, "discard", discard)

    class Stop(Exception):
        pass

    def blocks() -> Any:
        yield b"x" * (40 << 20)  # two parts uploaded, the rest buffered
        raise Stop

    with pytest.raises(Stop):
        tier.put_stream("v/p", blocks, 80 << 20)
    pygc.collect()
    assert not tier.exists("v/p"), f"a truncated object of {tier.open_read('v/p').size} bytes was published"


# -- 5. a version written by a newer ckpt (another schema) is not proven damaged ---------------


def test_gc_keeps_a_version_of_a_schema_it_does_not_read(tmp_path: Path) -> None:
    """In a fleet running mixed ckpt versions, an older GC must not take a newer-format
    version for damaged (then it would not count as the newest intact, nor as a milestone)."""
    import json

    from tests._manifests import crafted

    root = tmp_path / "root"
    _save(root, 1, 2, 3)
    path = root / "v000000000003" / "manifest.json"
    doc = json.loads(path.read_bytes())
    path.write_bytes(crafted({**doc, "schema_version": SCHEMA_VERSION + 1}))
    result = gcmod.collect(open_tier(str(root)), KeepLast(1))
    assert result.deleted == [1] and 3 in result.unjudged, result
    assert committed_steps(open_tier(str(root))) == [2, 3]  # 2: the newest proven intact
