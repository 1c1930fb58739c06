"""A restore lists a shared store (S3) once for the job, not once per rank.

At 16,384 ranks every rank listing the remote was ~16k LIST requests, a GET of each
version's root info and a HEAD of the chosen manifest per rank, and a GET of the manifest
per rank restoring from it, in one burst against one prefix. Rank 0 now lists it, checks
the chosen version and reads its manifest there; the candidates travel in the restore's one
all-gather, the manifest in the broadcast it already had; the other ranks read their rank
files and chunks from it all the same.

A real gloo job of 4 ranks on 2 simulated nodes (a root per node), the remote on the moto
S3 server reached through s3fs; each rank counts its S3 requests per object at s3fs's one
call site (`S3FileSystem._call_s3`). Node 1's root is then replaced by an empty directory,
so its ranks read their part from the remote, from rank 0's listing. On the old code every
rank listed the remote. Then ranks as threads of one process, where a memory:// store is
one store for all of them: a store rank 0 cannot list or does not name, named twice, a
failed check, and the manifest's reader.
"""

from __future__ import annotations

import datetime
import errno
import os
import re
import shutil
import socket
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt._load import agreed_manifest
from ckpt.restore.locate import Located, restore_newest
from ckpt.restore.sources import Source
from ckpt.store._fsspec import FsspecTier
from ckpt.store.errors import TierUnavailableError
from ckpt.store.retry import RetryPolicy
from ckpt.store.tier import open_tier
from ckpt.store.versions import read_manifest
from tests._dist import launch
from tests.e2e.test_failure_modes import _save, _ThreadComm, _two_ranks
from tests.s3_server import S3Place

THIS = os.path.abspath(__file__)
TIMEOUT = datetime.timedelta(seconds=60)


def _state(rank: int, step: int) -> dict[str, Any]:
    import ckpt

    full = torch.arange(8 * 4096, dtype=torch.float32).reshape(8, 4096) + step
    return {"w": ckpt.Shard(full[2 * rank : 2 * rank + 2].clone(), (8, 4096), (2 * rank, 0)), "step": step}


def save_job(ctx: Any, base: str, url: str, options: dict[str, Any]) -> None:
    import ckpt

    with ckpt.Checkpointer(
        f"{base}/node{ctx.rank // 2}", replicate_to=url, storage_options=options, timeout=TIMEOUT
    ) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(ctx.rank, step))
        ck.wait()


def restore_job(ctx: Any, base: str, url: str, options: dict[str, Any]) -> dict[str, Any]:
    import s3fs

    import ckpt

    calls: Counter[str] = Counter()
    steps: Counter[str] = Counter()  # requests for an object of each version, by step
    real = s3fs.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        key = str(kwargs.get("Key", ""))
        what = next((n for n in ("manifest.json", "root.json", "/ranks/") if n in key), "chunk" if key else "")
        calls[f"{method} {what}".strip()] += 1
        version = re.search(r"(?:^|/)v(\d{12})/", key)
        if version:
            steps[str(int(version.group(1)))] += 1
        return await real(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counted  # type: ignore[method-assign]
    state = _state(ctx.rank, 0)
    with ckpt.Checkpointer(f"{base}/node{ctx.rank // 2}", tiers=[url], storage_options=options, timeout=TIMEOUT) as ck:
        calls.clear()
        steps.clear()
        got = ck.restore(state)
        during = dict(calls)
    same = got is not None and torch.equal(state["w"].local_tensor, _state(ctx.rank, got)["w"].local_tensor)
    return {"step": got, "bitwise": same and state["step"] == got, "calls": during, "steps": dict(steps)}


def test_only_rank_0_lists_the_remote(tmp_path: Path, s3: S3Place) -> None:
    base = str(tmp_path / "disks")
    _, failures = launch(THIS, "save_job", 4, tmp_path, timeout=240, base=base, url=s3.url, options=s3.options)
    assert not failures, failures
    assert any(k.startswith(f"{s3.prefix}/v000000000003/") for k in s3.objects()), "step 3 was not uploaded"
    shutil.rmtree(f"{base}/node1")  # node 1 replaced with empty disks: its part is on the remote only
    os.makedirs(f"{base}/node1")
    results, failures = launch(THIS, "restore_job", 4, tmp_path, timeout=240, base=base, url=s3.url, options=s3.options)
    assert not failures, failures
    for rank, r in enumerate(results):
        assert r["step"] == 3 and r["bitwise"], (rank, r)
    lists = [r["calls"].get("list_objects_v2", 0) for r in results]
    assert lists[0] >= 1 and lists[1:] == [0, 0, 0], lists
    # Rank 0 alone reads the versions' root info and checks the chosen manifest; its own
    # part is on its node's root, so it reads no manifest, rank file or chunk there.
    assert set(results[0]["calls"]) == {"list_objects_v2", "get_object root.json", "head_object manifest.json"}
    assert results[1]["calls"] == {}, results[1]  # its part is on its node's root: no request at all
    for rank in (2, 3):  # their rank files and chunks come from the remote, as rank 0 listed it
        calls = results[rank]["calls"]
        assert calls.get("get_object chunk", 0) >= 1 and calls.get("get_object /ranks/", 0) == 1, (rank, calls)
        assert {k.split()[1] for k in calls} <= {"chunk", "/ranks/"}, (rank, calls)  # no manifest, no root info


def cut_off_restore_job(ctx: Any, base: str, url: str, options: dict[str, Any], cut: list[int], dead: str) -> Any:
    """restore_job, where the ranks in `cut` reach the store through a proxy that is not
    there (a closed port): a broken network path from their node to the same store."""
    if ctx.rank in cut:
        options = {**options, "config_kwargs": {"proxies": {"http": dead, "https": dead}}}
    return restore_job(ctx, base, url, options)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def other_endpoint_restore_job(ctx: Any, base: str, url: str, options: dict[str, Any], other: str) -> Any:
    """restore_job, where every rank but 0 names the store's endpoint another way."""
    return restore_job(ctx, base, url, options if ctx.rank == 0 else {**options, "endpoint_url": other})


def test_one_bucket_behind_two_endpoints_is_two_stores(tmp_path: Path, s3: S3Place) -> None:
    """Ranks whose S3 URL is rank 0's but whose endpoint is not may reach another store with
    a bucket of that name: they list it themselves rather than take rank 0's listing. (Here
    both endpoints reach the one moto server, so every rank still restores step 3.) On the
    old code the stores were matched by URL alone and ranks 1-3 listed nothing."""
    base = str(tmp_path / "disks")
    _, failures = launch(THIS, "save_job", 4, tmp_path, timeout=240, base=base, url=s3.url, options=s3.options)
    assert not failures, failures
    other = s3.options["endpoint_url"].replace("127.0.0.1", "localhost")
    assert other != s3.options["endpoint_url"]
    results = _restore_every_rank(tmp_path, "other_endpoint_restore_job", base, s3, other=other)
    lists = [r["calls"].get("list_objects_v2", 0) for r in results]
    assert all(n >= 1 for n in lists), lists


def _restore_every_rank(
    tmp_path: Path, scenario: str, base: str, s3: S3Place, step: int = 3, **kwargs: Any
) -> list[dict[str, Any]]:
    """`scenario` on 4 ranks; every rank must restore `step` bitwise."""
    results, failures = launch(
        THIS, scenario, 4, tmp_path, timeout=240, base=base, url=s3.url, options=s3.options, **kwargs
    )
    assert not failures, failures
    for rank, r in enumerate(results):
        assert r["step"] == step and r["bitwise"], (rank, r)
    return results


def _restore_cut_off(tmp_path: Path, base: str, s3: S3Place, cut: list[int], step: int = 3) -> list[dict[str, Any]]:
    return _restore_every_rank(tmp_path, "cut_off_restore_job", base, s3, step, cut=cut, dead=_closed_port())


@pytest.mark.parametrize("cut", [[2], [1, 2, 3]], ids=["one-rank", "all-but-rank-0"])
def test_a_rank_cut_off_from_the_store_gets_its_part_over_the_group(
    tmp_path: Path, s3: S3Place, cut: list[int]
) -> None:
    """Rank 0 lists the store for every rank, so a rank that cannot reach it learns so only
    when it reads its rank file or a chunk there: it then leaves the store out, and ranks
    that reach it send its part over the group, as when it could not list the store itself.
    On the old code the restore failed (TierUnavailableError on the cut ranks)."""
    base = str(tmp_path / "disks")
    _, failures = launch(THIS, "save_job", 4, tmp_path, timeout=240, base=base, url=s3.url, options=s3.options)
    assert not failures, failures
    shutil.rmtree(f"{base}/node1")  # node 1 replaced with empty disks: its part is on the remote only
    os.makedirs(f"{base}/node1")
    results = _restore_cut_off(tmp_path, base, s3, cut)
    assert any(k.endswith("/ranks/") for k in results[2]["calls"]), results[2]  # it tried the store first


def test_a_cut_off_rank_whose_own_copy_is_damaged_reads_it_from_ranks_that_reach_the_store(
    tmp_path: Path, s3: S3Place
) -> None:
    """Rank 2's chunk on its node's disk is damaged and the store, which holds a good copy,
    is out of its reach: the chunk comes from a rank that reaches the store, and step 3 is
    restored. On the first version of the fallback the second read took the damaged copy
    again and the restore fell back to step 2."""
    base = str(tmp_path / "disks")
    _, failures = launch(THIS, "save_job", 4, tmp_path, timeout=240, base=base, url=s3.url, options=s3.options)
    assert not failures, failures
    chunk = Path(f"{base}/node1/v000000000003/state/w/c.2.0")  # rank 2's: rows 4-5 of w
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    _restore_cut_off(tmp_path, base, s3, [2])


def test_a_store_a_rank_cannot_reach_is_not_tried_again_after_a_fallback(tmp_path: Path, s3: S3Place) -> None:
    """Step 3 is damaged on every copy (rank 0's chunk, on its node's disk and on the
    store), so every rank falls back to step 2. Rank 2, cut off from the store, found so
    while loading step 3, and gets its part of step 2 over the group without trying the
    store again: each try of a store that does not answer costs a retry budget (~6.6 s
    when it is blackholed). On the old code it tried step 2's rank file there too."""
    base = str(tmp_path / "disks")
    _, failures = launch(THIS, "save_job", 4, tmp_path, timeout=240, base=base, url=s3.url, options=s3.options)
    assert not failures, failures
    shutil.rmtree(f"{base}/node1")  # node 1 replaced with empty disks: its part is on the remote only
    os.makedirs(f"{base}/node1")
    chunk = "v000000000003/state/w/c.0.0"  # rank 0's: rows 0-1 of w
    local = Path(f"{base}/node0/{chunk}")
    data = bytearray(local.read_bytes())
    data[100] ^= 0xFF
    local.write_bytes(bytes(data))
    s3.server.client().put_object(Bucket=s3.server.bucket, Key=f"{s3.prefix}/{chunk}", Body=bytes(data))
    results = _restore_cut_off(tmp_path, base, s3, [2], step=2)
    steps = results[2]["steps"]
    assert steps.get("3", 0) >= 1, steps  # it tried the store while loading step 3
    assert steps.get("2", 0) == 0, steps


# -- ranks as threads of one process: a memory:// store is then one store for all of them ------


class _Shared(FsspecTier):
    """A memory:// store, which the ranks (threads of this process) do share, marked so."""

    def __init__(self, url: str) -> None:
        super().__init__(url, retry=RetryPolicy(attempts=1))
        self.capabilities = replace(self.capabilities, shared=True)
        self.listed_by: list[str] = []

    def listdir(self, prefix: str = "") -> list[str]:
        self.listed_by.append(threading.current_thread().name)
        return super().listdir(prefix)


def _shared_copy(tmp_path: Path, *steps: int) -> _Shared:
    root = tmp_path / "saved"
    _save(root, *steps)
    src, remote = open_tier(str(root)), _Shared(f"memory://shared-{os.getpid()}-{time.time_ns()}/ckpt")
    for s in steps:
        for o in src.find(f"v{s:012d}"):
            remote.put(o.key, src.get(o.key))
    return remote


def test_rank_0_lists_the_shared_tier_for_both(tmp_path: Path) -> None:
    remote = _shared_copy(tmp_path, 1, 2)
    out = _two_ranks(lambda comm, rank: restore_newest(comm, lambda: [remote], lambda loc: len(loc.sources)))
    assert out == {0: "(2, 1)", 1: "(2, 1)"}, out  # step 2, from one source on each rank
    assert set(remote.listed_by) == {"rank0"}, remote.listed_by


def test_a_shared_tier_rank_0_does_not_name_is_listed_by_the_ranks_that_do(tmp_path: Path) -> None:
    """A configuration that differs between ranks: each rank lists its own tiers again."""
    local = tmp_path / "local"
    _save(local, 1)
    remote = _shared_copy(tmp_path, 1, 2)

    def tiers(rank: int) -> list[Any]:
        return [open_tier(str(local))] + ([remote] if rank else [])

    out = _two_ranks(
        lambda comm, rank: restore_newest(comm, lambda: tiers(rank), lambda loc: [s.name for s in loc.sources])
    )
    assert out[0].startswith("(2, []") and out[1].startswith("(2, ['memory://"), out
    assert set(remote.listed_by) == {"rank1"}, remote.listed_by


def test_a_failed_check_of_the_shared_tier_fails_every_rank(tmp_path: Path) -> None:
    """The HEAD after the pin is made on rank 0 only; its failure is both ranks'."""
    remote = _shared_copy(tmp_path, 1)

    def exists(key: str) -> bool:
        if key.endswith("manifest.json"):
            raise TierUnavailableError(errno.ECONNRESET, f"stat on {threading.current_thread().name}: reset")
        return FsspecTier.exists(remote, key)

    remote.exists = exists  # type: ignore[method-assign]
    out = _two_ranks(lambda comm, rank: restore_newest(comm, lambda: [remote], lambda loc: loc.step))
    assert all(o.startswith("TierUnavailableError") for o in out.values()), out
    assert "on rank0" in out[0] and "on rank0" in out[1], out  # rank 1 never checked it


def test_a_shared_tier_rank_0_cannot_list_is_listed_by_every_rank(tmp_path: Path) -> None:
    """Rank 0 alone cannot reach the store: the others list it, and the newest version there
    is restored (not the older one on the local tier)."""
    local = tmp_path / "local"
    _save(local, 1)
    remote = _shared_copy(tmp_path, 1, 2)
    real = remote.listdir

    def listdir(prefix: str = "") -> list[str]:
        if threading.current_thread().name == "rank0":
            remote.listed_by.append("rank0")
            raise TierUnavailableError(errno.ECONNRESET, "list: connection reset")
        return real(prefix)

    remote.listdir = listdir  # type: ignore[method-assign]
    out = _two_ranks(
        lambda comm, rank: restore_newest(comm, lambda: [open_tier(str(local)), remote], lambda loc: len(loc.sources))
    )
    assert out == {0: "(2, 0)", 1: "(2, 1)"}, out  # rank 0's part is read by rank 1 (load's business)
    assert remote.listed_by.count("rank1") >= 1, remote.listed_by
    assert remote.listed_by.count("rank0") == 1, remote.listed_by  # a dead store: one retry budget, not two


def test_which_stores_are_shared(tmp_path: Path, s3: S3Place) -> None:
    assert open_tier(s3.url, s3.options).capabilities.shared
    for private in ("memory://x/ckpt", f"file://{tmp_path}", str(tmp_path)):
        assert not open_tier(private).capabilities.shared, private
        assert open_tier(private).store_id == open_tier(private).location, private
    other = {"endpoint_url": "http://127.0.0.2:9"}
    assert open_tier(s3.url, s3.options).store_id != open_tier(s3.url, other).store_id
    assert open_tier(s3.url, s3.options).store_id == open_tier(s3.url, dict(s3.options)).store_id


def test_a_store_named_twice_is_one_listing(tmp_path: Path) -> None:
    """Two positions of one store (a URL given as a tier and as the remote): each rank has a
    source at each, as when every rank listed both."""
    remote = _shared_copy(tmp_path, 1, 2)
    out = _two_ranks(lambda comm, rank: restore_newest(comm, lambda: [remote, remote], lambda loc: len(loc.sources)))
    assert out == {0: "(2, 2)", 1: "(2, 2)"}, out
    assert set(remote.listed_by) == {"rank0"}, remote.listed_by


class _ManifestComm(_ThreadComm):
    """What agreed_manifest needs besides: an all-reduce of maxima and a broadcast."""

    def reduce_max(self, values: list[int]) -> list[int]:
        return [max(v) for v in zip(*self._gather("all_reduce", list(values)))]

    def broadcast(self, obj: Any, src: int) -> Any:
        return self._gather("broadcast", obj)[src]


def test_the_manifest_of_a_shared_copy_is_read_by_rank_0_alone(tmp_path: Path) -> None:
    """Rank 1's own copy of the manifest is damaged and the store holds a good one: rank 0
    reads the store's and broadcasts it (rank 1 does not read the store); when rank 0 has
    no copy at all, a second round lets rank 1 read the store's."""
    remote = _shared_copy(tmp_path, 1)
    reads: list[str] = []
    real_get = remote.get

    def get(key: str) -> bytes:
        if key.endswith("manifest.json"):
            reads.append(threading.current_thread().name)
        return real_get(key)

    remote.get = get  # type: ignore[method-assign]
    damaged = tmp_path / "damaged"
    _save(damaged, 1)
    (damaged / "v000000000001" / "manifest.json").write_bytes(b"{not json")
    save_id = read_manifest(remote, 1).save_id
    reads.clear()

    def job(rank0_has_the_store: bool) -> dict[int, str]:
        def run(comm: Any, rank: int) -> str:
            sources = [Source(open_tier(str(damaged)), 1, frozenset({0})), Source(remote, 1, frozenset({0}))]
            if rank == 0:
                sources = sources[1:] if rank0_has_the_store else []
            return agreed_manifest(comm, Located(1, save_id, tuple(sources))).save_id

        return _two_ranks(run, comm=_ManifestComm)

    assert job(rank0_has_the_store=True) == {0: repr(save_id), 1: repr(save_id)}
    assert reads == ["rank0"], reads
    reads.clear()
    assert job(rank0_has_the_store=False) == {0: repr(save_id), 1: repr(save_id)}
    assert reads == ["rank1"], reads
