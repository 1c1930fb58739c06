"""Replication and restore through a flaky object store: a fault-injecting proxy
(tests/flaky_proxy.py) in front of the moto server, reached through s3fs with the proxy's
endpoint_url exactly as production reaches S3. The proxy drops connections (before the
request reaches the server, or after it was applied), answers 500 InternalError and 503
SlowDown, stalls longer than the read timeout, trickles answers, truncates bodies and
(for restores) flips bits in them, at random with a seeded RNG.

(a) Replication of a multi-version root completes through the faults; every version on
    the server, read directly (not through the proxy), equals the local one byte for
    byte, and each fault kind was really injected.
(b) Meanwhile a thread lists the server directly: whenever a manifest appears, every chunk
    it names is in that same listing at its size, and its bytes match the manifest xxh3.
(c) Restoring through the proxy (Checkpointer from the URL, `ckpt restore`) retries and
    verifies: bitwise equal to what was saved. Bodies that fail botocore's CRC32 are read
    again; chunk downloads that fail ckpt's xxh3 are downloaded again, and so are a manifest
    or root.json that fail their checks (neither a restore nor GC takes one bad download for
    damage). A body that is always corrupted or always truncated is never accepted: the
    restore fails instead.
Plus the proxy itself: keep-alive, chunked request bodies, the subprocess mode.
"""

from __future__ import annotations

import http.client
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import xxhash
from click.testing import CliRunner

from ckpt import Checkpointer, CorruptVersionError, TierUnavailableError
from ckpt.cli import main as cli_main
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.policy import KeepLast, KeepMilestones
from ckpt.replicator.service import Replicator
from ckpt.replicator.status import Status
from ckpt.store import versions
from ckpt.store._fsspec import FsspecTier
from ckpt.store.digest import chunk_digest
from ckpt.store.manifest import parse_manifest
from ckpt.store.rank_file import RankFiles, parse_rank_file, rank_file_path
from ckpt.store.retry import RetryPolicy
from ckpt.store.tier import open_tier
from ckpt.store.versions import committed
from tests._damage import flip_byte
from tests._disks import two_disks
from tests._states import assert_bitwise, blank, save_steps
from tests.flaky_proxy import KINDS, FaultPlan, FlakyProxy, ProxyProcess

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.s3_server import MotoServer, S3Place


READ_TIMEOUT = 1.0  # seconds; the proxy's stalls last longer
STALL_S = 2.5
STEPS = (1, 2, 3)
UPLOAD_KINDS = {k for k in KINDS if k not in ("corrupt", "delete_errors")}


# -- helpers --------------------------------------------------------------------------------------


def make_state(step: int) -> dict[str, Any]:
    """Eight tensors of several dtypes (eight chunk files), one of 256 KiB, and plain values."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {f"w{i}": torch.randn(48, 16 + i, generator=g) for i in range(4)},
        "big": torch.randn(256 << 8, generator=g),  # 256 KiB: a body long enough to cut mid-way
        "ids": torch.randint(-(2**40), 2**40, (33,), generator=g, dtype=torch.int64),
        "half": torch.randn(10, 3, generator=g).to(torch.bfloat16),
        "mask": torch.rand(77, generator=g) > 0.5,
        "step": step,
        "lr": 0.1 * step,
    }


def options(proxy_endpoint: str, **config: Any) -> dict[str, Any]:
    """The storage options a production job would pass: the endpoint and a read timeout
    (plus botocore `config` settings)."""
    return {
        "endpoint_url": proxy_endpoint,
        "config_kwargs": {"read_timeout": READ_TIMEOUT, "connect_timeout": 1, **config},
    }


# botocore checks the CRC32 S3 sends with a whole object; not with a range, nor for objects
# uploaded without one. Switched off, a flipped bit reaches ckpt's own xxh3 check.
NO_TRANSPORT_CHECKSUM = {"response_checksum_validation": "when_required"}
# ckpt's checksums cover chunk data; listings, root.json and the manifest rely on the
# transport (TLS, botocore's CRC32), so random flipped bits are aimed at chunk downloads
# (a manifest or root.json that arrives damaged once is read again: its own tests below).
CHUNK_GET = r"^GET /[^?]*/c\.[0-9.]+(\?|$)"
BIG_CHUNK_GET = r"^GET /[^?]*/state/big/c\.0(\?|$)"


def cli_options(proxy_endpoint: str) -> list[str]:
    return [
        "--storage-option",
        f"endpoint_url={proxy_endpoint}",
        "--storage-option",
        f"config_kwargs.read_timeout={READ_TIMEOUT:g}",
        "--storage-option",
        "config_kwargs.connect_timeout=1",
    ]


def cli(*args: object) -> Any:
    return CliRunner().invoke(cli_main, [str(a) for a in args], catch_exceptions=False)


def replicate(root: Path, url: str, endpoint: str) -> Status:
    rep = Replicator([str(root)], ReplicatorConfig(remote=url, storage_options=options(endpoint)))
    return rep.run_once()[str(root)]


def get(server: MotoServer, client: Any, key: str) -> bytes:
    return bytes(client.get_object(Bucket=server.bucket, Key=key)["Body"].read())


@pytest.fixture
def proxy(moto_server: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FlakyProxy]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # `ckpt restore` downloads afresh
    if not moto_server.alive:
        moto_server.start()
    with FlakyProxy(moto_server.port, FaultPlan(rate=0.0, stall_s=STALL_S)) as p:
        yield p


@pytest.fixture(scope="module")
def replicated(
    moto_server: MotoServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, dict[int, dict[str, Any]]]]:
    """A root of three versions, replicated cleanly (directly to moto) for the restore tests:
    (url, prefix, states)."""
    root = tmp_path_factory.mktemp("replicated") / "root"
    states = {s: make_state(s) for s in STEPS}
    save_steps(root, states)
    prefix = f"restore-{os.getpid()}-{time.monotonic_ns()}"
    url = f"s3://{moto_server.bucket}/{prefix}"
    status = replicate(root, url, moto_server.endpoint)
    assert all(v.remote is not None and v.remote.state == "verified" for v in status.versions.values())
    yield url, prefix, states


class ManifestWatch:
    """Lists the server directly (not through the proxy) in a thread. The first listing that
    shows a version's manifest must also show every chunk the manifest names, at its size;
    the chunks' bytes (read right after) must match the manifest's xxh3."""

    def __init__(self, place: S3Place) -> None:
        self.place = place
        self.client = place.server.client()
        self.polls = 0
        self.absent_polls: dict[str, int] = {}  # version dir -> polls that saw it without a manifest
        self.checked: dict[str, int] = {}  # version dir -> chunks checked when its manifest appeared
        self.problems: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ManifestWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()  # one last look at the final state

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll()
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(e))
            self._stop.wait(0.01)

    def _poll(self) -> None:
        listing = self.place.objects()  # one listing: the snapshot every check below uses
        self.polls += 1
        base = self.place.prefix + "/"
        vdirs = {k[len(base) :].split("/", 1)[0] for k in listing if k.startswith(base)}
        for vdir in sorted(vdirs - set(self.checked)):
            mkey = f"{base}{vdir}/manifest.json"
            if mkey not in listing:
                self.absent_polls[vdir] = self.absent_polls.get(vdir, 0) + 1
                continue
            manifest = parse_manifest(get(self.place.server, self.client, mkey))
            n = 0
            digests: dict[int, Any] = {}  # rank -> its rank file (schema 3: the chunks' digests)
            for rank, ref in enumerate(manifest.rank_files):
                key = f"{base}{vdir}/{rank_file_path(rank)}"
                n += 1
                if key not in listing:
                    self.problems.append(f"{vdir}: manifest listed before {key}")
                    continue
                raw = get(self.place.server, self.client, key)
                if len(raw) != ref.size or xxhash.xxh3_64_hexdigest(raw) != ref.xxh3:
                    self.problems.append(f"{vdir}: {key} does not match the manifest")
                    continue
                digests[rank] = parse_rank_file(raw, manifest, rank).digests
            for array in manifest.arrays.values():
                for chunk in array.iter_chunks():
                    if chunk.inline is not None:
                        continue
                    key = f"{base}{vdir}/{array.chunk_path(chunk)}"
                    n += 1
                    want = digests.get(chunk.writer, {}).get(array.name, {}).get(array.flat(chunk.index))
                    if key not in listing:
                        self.problems.append(f"{vdir}: manifest listed before {key}")
                    elif listing[key]["size"] != chunk.nbytes:
                        self.problems.append(f"{vdir}: {key} has {listing[key]['size']} bytes, want {chunk.nbytes}")
                    elif want is None or (
                        chunk_digest(get(self.place.server, self.client, key), array.digest_block_bytes(chunk))
                        != want[0]
                    ):
                        self.problems.append(f"{vdir}: {key} does not match its xxh3")
            if f"{base}{vdir}/root.json" not in listing:
                self.problems.append(f"{vdir}: manifest listed before root.json")
            self.checked[vdir] = n


# -- the proxy itself ---------------------------------------------------------------------------------


def test_proxy_keepalive_chunked_and_subprocess(moto_server: MotoServer, proxy: FlakyProxy, tmp_path: Path) -> None:
    """Clean forwarding: several requests on one kept-alive connection, a chunked (streamed)
    request body, an Expect: 100-continue upload; then the proxy as a subprocess, injecting."""
    import boto3

    client = moto_server.client()
    signer = boto3.client("s3", endpoint_url=proxy.endpoint, region_name="us-east-1")

    def url(method: str, key: str) -> str:  # a presigned path: the server checks it like any request
        full = signer.generate_presigned_url(method, Params={"Bucket": moto_server.bucket, "Key": key})
        return str(full).split(f":{proxy.port}", 1)[1]

    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    key = "proxy-self-test/chunked"
    body = os.urandom(300_000)
    conn.request("PUT", url("put_object", key), body=iter([body[:1000], body[1000:200_000], body[200_000:]]))
    r = conn.getresponse()
    assert (r.status, r.read()) == (200, b""), r.status
    sock = conn.sock
    conn.request("PUT", url("put_object", f"{key}-2"), body=body[:5000], headers={"Expect": "100-continue"})
    r = conn.getresponse()
    assert (r.status, r.read()) == (200, b""), r.status
    for k, want in ((key, body), (f"{key}-2", body[:5000])):
        conn.request("GET", url("get_object", k))
        r = conn.getresponse()
        assert r.status == 200 and r.read() == want
        assert get(moto_server, client, k) == want  # what the server really holds
    assert conn.sock is sock, "the proxy did not keep the connection alive"
    conn.close()
    assert proxy.requests == 4 and proxy.faults() == {}

    proxy.set_plan(rate=1.0, weights={"slowdown503": 1})
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("GET", url("get_object", key))
    r = conn.getresponse()
    assert r.status == 503 and b"<Code>SlowDown</Code>" in r.read()
    conn.close()

    import s3fs

    # the first three requests get a 500, a dropped connection and a truncated answer
    weights = {"error500": 1.0, "drop": 1.0, "truncate": 1.0}
    with ProxyProcess(moto_server.port, FaultPlan(rate=1.0, seed=3, weights=weights, max_faults=3), tmp_path) as sub:
        fs = s3fs.S3FileSystem(**options(sub.endpoint))
        for i in range(2):
            fs.pipe_file(f"{moto_server.bucket}/proxy-self-test/sub{i}", body[: 50_000 + i])
            assert fs.cat_file(f"{moto_server.bucket}/proxy-self-test/sub{i}") == body[: 50_000 + i]
        assert sub.stop() == 0
        assert sum(sub.faults().values()) == 3, sub.faults()


# -- (a) and (b): replication ---------------------------------------------------------------------------


def test_replication_through_faults(s3: S3Place, proxy: FlakyProxy, tmp_path: Path) -> None:
    root = tmp_path / "root"
    states = {s: make_state(s) for s in STEPS}
    save_steps(root, states)
    proxy.set_plan(FaultPlan(rate=0.25, seed=7, stall_s=STALL_S))
    t0 = time.monotonic()
    with ManifestWatch(s3) as watch:
        status = replicate(root, s3.url, proxy.endpoint)
    took = time.monotonic() - t0
    faults = proxy.faults()
    print(f"\nreplicated {len(STEPS)} versions in {took:.1f}s, {proxy.requests} requests, faults {faults}")
    assert {s: v.remote.state if v.remote else None for s, v in status.versions.items()} == dict.fromkeys(
        STEPS, "verified"
    )
    missing = UPLOAD_KINDS - {k for k, n in faults.items() if n > 0}
    assert not missing, f"fault kinds never injected: {sorted(missing)} ({faults})"

    # (a) every version on the server, read directly, equals the local one
    client = s3.server.client()
    objects = s3.objects()
    for step in STEPS:
        vdir = versions.version_dirname(step)
        local = versions.read_manifest(str(root), step)
        remote_manifest = parse_manifest(get(s3.server, client, f"{s3.prefix}/{vdir}/manifest.json"))
        assert remote_manifest.to_json() == local.to_json()
        files = [p for p in (root / vdir).rglob("*") if p.is_file() and p.name not in ("manifest.json", "root.json")]
        assert len(files) >= 8
        for path in files:
            rel = path.relative_to(root / vdir).as_posix()
            key = f"{s3.prefix}/{vdir}/{rel}"
            assert key in objects, f"{key} was not uploaded"
            assert get(s3.server, client, key) == path.read_bytes(), f"{key} differs from the local file"
        book = RankFiles(open_tier(str(root)))
        for array in local.arrays.values():
            for chunk in array.iter_chunks():
                if chunk.inline is None:
                    chunk = book.resolve(step, local, array, chunk)
                    data = get(s3.server, client, f"{s3.prefix}/{vdir}/{array.chunk_path(chunk)}")
                    assert chunk_digest(data, array.digest_block_bytes(chunk)) == chunk.xxh3

    # (b) no manifest was ever listed before all of its chunks
    assert watch.errors == [], watch.errors[:3]
    assert watch.problems == [], watch.problems
    assert set(watch.checked) == {versions.version_dirname(s) for s in STEPS}
    assert all(n >= 8 for n in watch.checked.values()), watch.checked
    # the watch really watched the uploads: it saw each version before its manifest was there
    assert all(watch.absent_polls.get(v, 0) > 0 for v in watch.checked), watch.absent_polls
    print(f"watch: {watch.polls} listings; polls without a manifest per version: {watch.absent_polls}")


@pytest.mark.parametrize("size", [20, 33 << 20], ids=["put", "multipart"])
def test_an_upload_is_confirmed_only_by_etags_that_are_its_md5(s3: S3Place, proxy: FlakyProxy, size: int) -> None:
    """Where S3's ETags are the bytes' MD5 (unencrypted), put_stream confirms the upload
    from the answers alone; where they are not (SSE-KMS, here the proxy's opaque ETags), it
    does not, and the caller reads the copy back."""
    tier = FsspecTier(s3.url, options(proxy.endpoint))
    piece = bytes(range(256)) * 4096 if size > 1 << 20 else b"x" * size

    def blocks() -> Iterator[bytes]:
        for _ in range(size // len(piece)):
            yield piece

    assert tier.put_stream("v/md5", blocks, size) is True
    proxy.opaque_etags = True
    assert tier.put_stream("v/opaque", blocks, size) is False
    assert tier.get("v/opaque") == tier.get("v/md5") == piece * (size // len(piece))


@pytest.fixture
def etags_no_md5(proxy: FlakyProxy) -> None:
    """A store whose ETags are no MD5 of the bytes (S3 with SSE-KMS): it never confirms an
    upload (Tier.put_stream returns False), so every copy is read back to be verified."""
    proxy.opaque_etags = True


@pytest.mark.usefixtures("etags_no_md5")
def test_copy_read_back_wrong_is_sent_again(s3: S3Place, proxy: FlakyProxy, tmp_path: Path) -> None:
    """The replicator's first two read-backs of a chunk arrive with a flipped bit that no
    transport checksum covers: the chunk is sent again and the version completes, exact."""
    root = tmp_path / "root"
    save_steps(root, {1: make_state(1)})
    proxy.set_plan(FaultPlan(rate=1.0, weights={"corrupt": 1.0}, only=BIG_CHUNK_GET, max_faults=2))
    rep = Replicator(
        [str(root)], ReplicatorConfig(remote=s3.url, storage_options=options(proxy.endpoint, **NO_TRANSPORT_CHECKSUM))
    )
    status = rep.run_once()[str(root)]
    remote = status.versions[1].remote
    assert remote is not None and remote.state == "verified"
    assert proxy.faults() == {"corrupt": 2}
    vdir = versions.version_dirname(1)
    local = (root / vdir / "state" / "big" / "c.0").read_bytes()
    assert get(s3.server, s3.server.client(), f"{s3.prefix}/{vdir}/state/big/c.0") == local


@pytest.mark.usefixtures("etags_no_md5")
def test_copy_that_never_reads_back_right_is_never_committed(s3: S3Place, proxy: FlakyProxy, tmp_path: Path) -> None:
    root = tmp_path / "root"
    save_steps(root, {1: make_state(1)})
    proxy.set_plan(FaultPlan(rate=1.0, weights={"corrupt": 1.0}, only=BIG_CHUNK_GET))
    rep = Replicator(
        [str(root)], ReplicatorConfig(remote=s3.url, storage_options=options(proxy.endpoint, **NO_TRANSPORT_CHECKSUM))
    )
    try:
        remote = rep.run_once()[str(root)].versions[1].remote
        state = remote.state if remote is not None else None
    except CorruptVersionError:
        state = None
    assert state != "verified"
    assert proxy.faults()["corrupt"] >= 3
    objects = s3.objects()
    assert f"{s3.prefix}/{versions.version_dirname(1)}/state/model/w0/c.0.0" in objects  # it did upload
    assert not [k for k in objects if k.endswith("manifest.json")], "an unverified version was committed"


# -- (c): restore -----------------------------------------------------------------------------------


def test_checkpointer_restore_through_faults(
    replicated: tuple[str, str, dict[int, dict[str, Any]]], proxy: FlakyProxy, tmp_path: Path
) -> None:
    """Every kind of fault, and corrupted bodies that only ckpt's xxh3 can catch: the newest
    version still comes back bit for bit (a bad download is downloaded again)."""
    url, _, states = replicated
    weights = dict.fromkeys(UPLOAD_KINDS, 1.0) | {"corrupt": 1.0, "truncate": 2.0, "stall": 0.5}
    proxy.set_plan(FaultPlan(rate=0.3, seed=11, stall_s=STALL_S, weights=weights, scope={"corrupt": CHUNK_GET}))
    t0 = time.monotonic()
    opts = options(proxy.endpoint, **NO_TRANSPORT_CHECKSUM)
    with Checkpointer(tmp_path / "fresh", tiers=[url], storage_options=opts) as ck:
        target = blank(states[3])
        assert ck.restore(target) == 3
        assert_bitwise(target, states[3])
        target = blank(states[1])
        assert ck.restore(target, step=1) == 1
        assert_bitwise(target, states[1])
    faults = proxy.faults()
    print(f"\nrestored 2 versions in {time.monotonic() - t0:.1f}s, {proxy.requests} requests, faults {faults}")
    assert faults.get("truncate", 0) > 0, faults
    assert sum(faults.values()) >= 8, faults


def test_transport_checksum_failures_are_retried(
    replicated: tuple[str, str, dict[int, dict[str, Any]]], proxy: FlakyProxy, tmp_path: Path
) -> None:
    """botocore catches a flipped bit in a whole-object body by its CRC32, but s3fs does not
    retry that error: the tier must, or one bad read of a root.json hides the whole remote
    (restore would start from scratch) and one of a manifest skips the version."""
    url, _, states = replicated
    metadata = r"^GET /[^?]*/(manifest|root)\.json(\?|$)"
    proxy.set_plan(FaultPlan(rate=1.0, weights={"corrupt": 1.0}, only=metadata, max_faults=2))
    with Checkpointer(tmp_path / "fresh", tiers=[url], storage_options=options(proxy.endpoint)) as ck:
        target = blank(states[3])
        assert ck.restore(target) == 3
        assert_bitwise(target, states[3])
    assert proxy.faults() == {"corrupt": 2}


def test_corrupted_downloads_are_downloaded_again(
    replicated: tuple[str, str, dict[int, dict[str, Any]]], proxy: FlakyProxy, tmp_path: Path
) -> None:
    """The first two downloads of a chunk come with a flipped bit that no transport checksum
    catches: ckpt's xxh3 refuses them, the third download is good, the state is exact."""
    url, _, states = replicated
    proxy.set_plan(FaultPlan(rate=1.0, weights={"corrupt": 1.0}, only=BIG_CHUNK_GET, max_faults=2))
    opts = options(proxy.endpoint, **NO_TRANSPORT_CHECKSUM)
    with Checkpointer(tmp_path / "fresh", tiers=[url], storage_options=opts, verify_on_restore=False) as ck:
        target = blank(states[3])
        assert ck.restore(target) == 3
        assert_bitwise(target, states[3])
    assert proxy.faults() == {"corrupt": 2}


def test_cli_restore_through_faults(
    replicated: tuple[str, str, dict[int, dict[str, Any]]], proxy: FlakyProxy, tmp_path: Path
) -> None:
    url, _, states = replicated
    weights = dict.fromkeys(UPLOAD_KINDS, 1.0) | {"truncate": 2.0, "corrupt": 2.0, "stall": 0.5}
    proxy.set_plan(FaultPlan(rate=0.3, seed=13, stall_s=STALL_S, weights=weights, scope={"corrupt": CHUNK_GET}))
    out = tmp_path / "restored.pt"
    r = cli("restore", url, "--to-torch", out, *cli_options(proxy.endpoint))
    assert r.exit_code == 0, r.output
    assert "restored step 3" in r.output
    assert_bitwise(torch.load(out, weights_only=True), states[3])
    assert sum(proxy.faults().values()) > 0, proxy.faults()
    print(f"\nckpt restore: {proxy.requests} requests, faults {proxy.faults()}")


@pytest.mark.parametrize("kind", ["corrupt", "truncate"])
def test_bad_bodies_never_accepted(
    replicated: tuple[str, str, dict[int, dict[str, Any]]], proxy: FlakyProxy, tmp_path: Path, kind: str
) -> None:
    """Every download of one chunk is corrupted (with no transport checksum) or cut short:
    the restore fails after its retries; it never loads those bytes. A corrupted body is
    damage (CorruptVersionError, after two more reads); a body always cut short is a store
    that does not answer (TierUnavailableError: no proof of damage, so no fallback either)."""
    url, _, states = replicated
    proxy.set_plan(FaultPlan(rate=1.0, seed=5, weights={kind: 1.0}, only=BIG_CHUNK_GET))
    opts = options(proxy.endpoint, **NO_TRANSPORT_CHECKSUM)
    with Checkpointer(tmp_path / "fresh", tiers=[url], storage_options=opts, verify_on_restore=False) as ck:
        target = blank(states[2])
        with pytest.raises(CorruptVersionError if kind == "corrupt" else TierUnavailableError, match="big"):
            ck.restore(target, step=2)
    n = proxy.faults().get(kind, 0)
    if kind == "corrupt":
        assert n == 3, n  # downloaded, and downloaded again twice, each time refused
    else:
        assert n == RetryPolicy().attempts, n  # the one retry policy's tries, and no more
    assert proxy.requests - n >= 8  # the other chunks came through untouched
    if kind == "truncate":
        return  # (the CLI shares the tier: once is enough for the slow case)

    out = tmp_path / "restored.pt"
    extra = ["--storage-option", "config_kwargs.response_checksum_validation=when_required"]
    r = cli("restore", url, "--step", "2", "--to-torch", out, *cli_options(proxy.endpoint), *extra)
    assert r.exit_code != 0, r.output
    assert "big" in r.output
    assert not out.exists()
    assert proxy.faults()[kind] == 6


def test_gc_keeps_a_version_it_could_not_read(s3: S3Place, proxy: FlakyProxy, tmp_path: Path) -> None:
    """Versions 2, 4 and 5 on S3; every GET of v5's manifest answers 503 SlowDown (a transient
    fault: the object is intact). `ckpt gc --milestone-every 2` must not take v5 for damaged
    (then it is no longer "the newest intact version" and goes): it keeps it, says why, and
    exits 4; so does the replicator's own remote GC. Once the store answers, GC judges v5
    intact and keeps it as the newest."""
    root = tmp_path / "root"
    save_steps(root, {s: make_state(s) for s in (2, 4, 5)})
    replicate(root, s3.url, s3.server.endpoint)  # directly, no faults
    assert remote_steps(s3) == [2, 4, 5]
    proxy.set_plan(FaultPlan(rate=1.0, weights={"slowdown503": 1.0}, only=rf"^GET /[^?]*/{vname(5)}/manifest\.json"))
    quick = cli_options(proxy.endpoint)
    t0 = time.monotonic()
    r = CliRunner().invoke(cli_main, ["gc", s3.url, "--milestone-every", "2", "--all-but-milestones", *quick])
    print(f"gc with a 503 took {time.monotonic() - t0:.1f}s")
    assert r.exit_code == 4, r.output
    assert "step 5 could not be read and was kept" in r.stderr and "reduce your request rate" in r.stderr, r.output
    assert remote_steps(s3) == [2, 4, 5]
    opts = options(proxy.endpoint)
    rep = Replicator(
        [str(root)], ReplicatorConfig(remote=s3.url, storage_options=opts, remote_policy=KeepMilestones(every=2))
    )
    t0 = time.monotonic()
    rep.run_once()
    print(f"replicator pass with a 503 took {time.monotonic() - t0:.1f}s")
    assert remote_steps(s3) == [2, 4, 5]
    assert proxy.faults()["slowdown503"] >= 12  # every try of both GCs, s3fs's own retries on top
    proxy.set_plan(FaultPlan(rate=0.0))
    r = CliRunner().invoke(cli_main, ["gc", s3.url, "--milestone-every", "2", "--all-but-milestones", *quick])
    assert r.exit_code == 0, r.output
    assert remote_steps(s3) == [2, 4, 5]  # v5 is the newest intact version: kept


def test_gc_reads_again_a_manifest_that_arrives_damaged(s3: S3Place, proxy: FlakyProxy, tmp_path: Path) -> None:
    """Versions 2, 4 and 5 on S3; the first download of v5's manifest arrives with a flipped
    bit that no transport checksum catches (checksum validation off, as stores without
    flexible checksums need). One bad download is no proof of damage: GC reads it again and
    keeps v5, the newest intact version, which `--milestone-every 2` would delete as damaged."""
    root = tmp_path / "root"
    save_steps(root, {s: make_state(s) for s in (2, 4, 5)})
    replicate(root, s3.url, s3.server.endpoint)  # directly, no faults
    proxy.set_plan(
        FaultPlan(rate=1.0, weights={"corrupt": 1.0}, only=rf"^GET /[^?]*/{vname(5)}/manifest\.json", max_faults=1)
    )
    extra = ["--storage-option", "config_kwargs.response_checksum_validation=when_required"]
    r = cli("gc", s3.url, "--milestone-every", "2", "--all-but-milestones", *cli_options(proxy.endpoint), *extra)
    assert r.exit_code == 0, r.output
    assert proxy.faults() == {"corrupt": 1}
    assert remote_steps(s3) == [2, 4, 5]


@pytest.mark.parametrize("name", ["manifest.json", "root.json"])
def test_restore_reads_again_metadata_that_arrives_damaged(
    replicated: tuple[str, str, dict[int, dict[str, Any]]], proxy: FlakyProxy, tmp_path: Path, name: str
) -> None:
    """The first download of step 3's manifest or root.json arrives with a flipped bit that
    no transport checksum catches: restore reads it again and restores step 3, rather than
    take step 3 for damaged and restore step 2."""
    url, _, states = replicated
    proxy.set_plan(FaultPlan(rate=1.0, weights={"corrupt": 1.0}, only=rf"^GET /[^?]*/{vname(3)}/{name}", max_faults=1))
    opts = options(proxy.endpoint, **NO_TRANSPORT_CHECKSUM)
    with Checkpointer(tmp_path / "fresh", tiers=[url], storage_options=opts) as ck:
        target = blank(states[3])
        assert ck.restore(target) == 3
    assert_bitwise(target, states[3])
    assert proxy.faults() == {"corrupt": 1}


def test_replica_kept_while_the_remote_cannot_read_its_copy(s3: S3Place, proxy: FlakyProxy, tmp_path: Path) -> None:
    """Steps 1-4 on the source, its replica disk and S3; step 1 then deleted from the source
    by hand, and every GET of the remote's step 1 manifest answers 503 SlowDown: the remote's
    copy may be fine, but nothing proves it, so replica GC (keep_last 2) keeps the replica's
    copy, the last one known good. Once the store answers, it goes."""
    from ckpt.replicator.placement import source_label

    d0, d1 = two_disks(tmp_path)
    replica = str(d1 / "replicas" / source_label(str(d0)))
    save_steps(d0, {s: make_state(s) for s in (1, 2, 3, 4)})

    def replicator(policy: KeepLast | None = None) -> Replicator:
        config = ReplicatorConfig(
            replicas=2,
            replica_roots=(str(d1),),
            remote=s3.url,
            storage_options=options(proxy.endpoint),
            local_policy=policy,
        )
        return Replicator([str(d0)], config)

    replicator().run_once()
    assert versions.committed_steps(replica) == remote_steps(s3) == [1, 2, 3, 4]
    versions.delete_version(str(d0), 1)
    proxy.set_plan(FaultPlan(rate=1.0, weights={"slowdown503": 1.0}, only=rf"^GET /[^?]*/{vname(1)}/manifest\.json"))
    replicator(KeepLast(2)).run_once()
    assert proxy.faults()["slowdown503"] >= 1
    assert 1 in versions.committed_steps(replica)
    proxy.set_plan(FaultPlan(rate=0.0))
    replicator(KeepLast(2)).run_once()
    assert 1 not in versions.committed_steps(replica)  # the remote's copy is read, and intact


def test_a_damaged_manifest_beside_an_unreachable_copy_is_not_damage(
    s3: S3Place, proxy: FlakyProxy, tmp_path: Path
) -> None:
    """Step 2's manifest is damaged on the local root, and every GET of its copy on S3
    answers 503 SlowDown: that copy may be good, so restore() raises TierUnavailableError
    rather than take step 2 for damaged and fall back to step 1. Once S3 answers, step 2
    comes from its copy there."""
    root = tmp_path / "root"
    states = {s: make_state(s) for s in (1, 2)}
    save_steps(root, states)
    replicate(root, s3.url, s3.server.endpoint)  # directly, no faults
    manifest = root / vname(2) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-9] + b"0" * 9)
    proxy.set_plan(FaultPlan(rate=1.0, weights={"slowdown503": 1.0}, only=rf"^GET /[^?]*/{vname(2)}/manifest\.json"))
    with Checkpointer(root, tiers=[s3.url], storage_options=options(proxy.endpoint)) as ck:
        with pytest.raises(TierUnavailableError, match="no readable manifest of step 2"):
            ck.restore(blank(states[2]))
        assert proxy.faults()["slowdown503"] >= 1
        proxy.set_plan(FaultPlan(rate=0.0))
        target = blank(states[2])
        assert ck.restore(target) == 2
    assert_bitwise(target, states[2])


def vname(step: int) -> str:
    return versions.version_dirname(step)


def remote_steps(place: S3Place) -> list[int]:
    return [c.step for c in committed(open_tier(place.url, place.options))]


def test_a_batch_delete_with_per_key_errors_is_finished(s3: S3Place, proxy: FlakyProxy, tmp_path: Path) -> None:
    """S3 answers a batch delete (DeleteObjects) with 200 and per-key errors, which s3fs
    does not raise. Deleting a version must not then drop its `.deleting` marker over
    objects that are still there: it deletes what is left one key at a time, and while
    that fails too the marker stays, so a later GC (finish_deletions) completes it."""
    root = tmp_path / "root"
    save_steps(root, {s: make_state(s) for s in (1, 2, 3)})
    replicate(root, s3.url, s3.server.endpoint)  # directly, no faults
    direct = open_tier(s3.url, s3.options)
    assert len([o.key for o in direct.find(vname(1))]) > 3
    flaky = open_tier(s3.url, options(proxy.endpoint), retry=RetryPolicy(attempts=2, first_wait_s=0.01))
    batch = r"^POST /[^?]*\?delete"

    proxy.set_plan(FaultPlan(rate=1.0, weights={"delete_errors": 1.0}, only=batch, max_faults=1))
    versions.delete_version(flaky, 1)
    assert proxy.faults() == {"delete_errors": 1}
    assert [o.key for o in direct.find(vname(1))] == []
    assert remote_steps(s3) == [2, 3]

    proxy.reset_counts()  # every batch delete fails per key, and so does every single delete
    proxy.set_plan(
        FaultPlan(
            rate=1.0,
            weights={"delete_errors": 1.0, "error500": 1.0},
            scope={"error500": r"^DELETE "},
            only=r"DELETE |\?delete",
        )
    )
    with pytest.raises(TierUnavailableError):
        versions.delete_version(flaky, 2)
    assert proxy.faults()["delete_errors"] >= 1 and proxy.faults()["error500"] >= 1
    left = [o.key for o in direct.find(vname(2))]
    assert f"{vname(2)}/.deleting" in left and len(left) > 1, left  # marked, so not forgotten
    assert remote_steps(s3) == [3]

    proxy.set_plan(FaultPlan(rate=0.0))
    assert versions.finish_deletions(flaky) == [vname(2)]
    assert [o.key for o in direct.find(vname(2))] == []
    assert remote_steps(s3) == [3]


def _w(step: int) -> torch.Tensor:
    return torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024) + step


def save_halves(ctx: Any, base: str) -> dict[str, Any]:
    """Step 4 of `w` saved by 2 ranks, each its part on its own root (`base`/r<rank>): rank
    0's rows 0-39 (160 KiB), rank 1's 40-63 (96 KiB, a small chunk: read after the large)."""
    from ckpt import Shard

    lo, hi = (0, 40) if ctx.rank == 0 else (40, 64)
    with Checkpointer(f"{base}/r{{rank}}", capture_rng=False) as ck:
        ck.save(4, {"w": Shard(_w(4)[lo:hi].clone(), (64, 1024), (lo, 0))})
    return {}


@pytest.mark.parametrize("step_2_remote", [False, True], ids=["step-2-local", "step-2-also-remote"])
def test_damage_beside_an_unreachable_part_falls_back(
    s3: S3Place, proxy: FlakyProxy, tmp_path: Path, step_2_remote: bool
) -> None:
    """Step 4's half on the local root is damaged (and gone from the remote), its other half is
    on the remote alone, which does not answer for it. The damage proves step 4 bad: the restore falls back to step 2.
    Before, once damaged chunks were asked of other ranks (none here), the unreachable half
    replaced the damage as the error: TierUnavailableError, and no resume. And where step 2
    is on the remote too: its local copy is read. Before, a store found unreachable while
    reading step 4 made every saved rank it holds a part of unreachable for the older
    versions as well, local copies or not (TierUnavailableError again)."""
    from tests._dist import launch

    base = tmp_path
    with Checkpointer(base / "r0", capture_rng=False) as ck:
        ck.save(2, {"w": _w(2)})
    _, failures = launch(__file__, "save_halves", 2, tmp_path / "job", base=str(base))
    assert not failures, failures
    for _ in range(2):  # a version's parts go up once every root's is there
        done = [replicate(base / r, s3.url, s3.server.endpoint).versions[4].remote for r in ("r0", "r1")]
    assert all(r is not None and r.state == "verified" for r in done), done
    client = s3.server.client()
    for key in [] if step_2_remote else s3.server.objects(f"{s3.prefix}/v000000000002/"):
        client.delete_object(Bucket=s3.server.bucket, Key=key)  # step 2: on the local root alone
    shutil.rmtree(base / "r1")  # rank 1's half: on the remote alone
    (chunk,) = (base / "r0" / "v000000000004" / "state" / "w").glob("c.*")
    flip_byte(chunk, 100)  # rank 0's half: damaged here, and gone from the remote
    client.delete_object(Bucket=s3.server.bucket, Key=f"{s3.prefix}/v000000000004/state/w/{chunk.name}")
    proxy.set_plan(
        FaultPlan(rate=1.0, seed=3, weights={"error500": 1.0}, only=r"^GET /[^?]*/v000000000004/state/w/c\.1\.0")
    )
    got = {"w": torch.zeros(64, 1024)}
    with Checkpointer(base / "r0", tiers=[s3.url], storage_options=options(proxy.endpoint), capture_rng=False) as ck:
        assert ck.restore(got) == 2
    assert_bitwise(got, {"w": _w(2)})
    assert proxy.faults().get("error500", 0) > 0  # (the test's premise: the remote's half was asked for)
