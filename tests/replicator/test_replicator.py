"""The replicator against a real S3 endpoint (a moto server subprocess, reached through s3fs).

1. `ckpt replicate --once` uploads committed versions; `ckpt ls/verify/restore` read them
   back from the s3:// URL (a damaged object makes verify fail); a Checkpointer restores
   from the URL alone after the local root is gone; AWS_ENDPOINT_URL works too.
2. The S3 server is killed mid-upload and restarted (losing every object): the daemon
   retries and completes, and no poll ever sees a listed version with a missing chunk.
3. The daemon is SIGKILLed mid-upload and restarted: it resumes without sending the
   chunks it had verified again (their LastModified stays, the bytes sent shrink).
4. With two disks, one replica disk deleted: restore comes from the other's replicas.
5. Retention over 50 saves: local keep-last 3, remote milestones every 10 (+ a tagged
   step); plus the pure policy functions.
6. GC SIGKILLed mid-run (local and remote): nothing listed is half-deleted; the next GC
   finishes.
7. The daemon picks up a new version within about its interval; SIGTERM mid-upload
   exits 0 promptly, leaving nothing half-visible.
8. Credentials never appear in the daemon's or the CLI's output.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from click.testing import CliRunner

from ckpt import Checkpointer
from ckpt.cli import main as cli_main
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.policy import KeepAll, KeepLast, KeepMilestones, Policy, Union, VersionInfo, plan_deletions
from ckpt.replicator.service import Replicator
from ckpt.replicator.status import read_status
from ckpt.store import pins, versions
from ckpt.store.manifest import parse_manifest
from ckpt.store.tier import open_tier
from ckpt.store.versions import as_tier, committed
from tests._disks import two_disks
from tests._states import assert_bitwise, blank, save_steps

if TYPE_CHECKING:
    from tests.s3_server import MotoServer, S3Place

MiB = 1 << 20


# -- helpers --------------------------------------------------------------------------------------


def small_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "ids": torch.randint(-(2**40), 2**40, (7,), generator=g, dtype=torch.int64),
        "half": torch.randn(10, 3, generator=g).to(torch.bfloat16),
        "lr": torch.tensor(0.5 + step),
        "step": step,
    }


def tiny_state(step: int) -> dict[str, Any]:
    """One small tensor: four files per version, so 50 versions replicate quickly."""
    return {"w": torch.arange(16, dtype=torch.float32) * step}


def big_state(step: int, tensors: int = 10, mib_each: int = 4) -> dict[str, Any]:
    """`tensors` float32 tensors of `mib_each` MiB: one chunk file each."""
    g = torch.Generator().manual_seed(1000 + step)
    return {f"t{i}": torch.randn(mib_each * MiB // 4, generator=g) for i in range(tensors)} | {"step": step}


def cli(*args: object) -> Any:
    return CliRunner().invoke(cli_main, [str(a) for a in args], catch_exceptions=False)


def vname(step: int) -> str:
    return versions.version_dirname(step)


def chunk_sizes(manifest: Any) -> dict[str, int]:
    """Relative path -> bytes of every chunk file of a manifest."""
    return {a.chunk_path(c): c.nbytes for a in manifest.arrays.values() for c in a.iter_chunks() if c.inline is None}


def remote_problems(place: S3Place) -> tuple[list[int], list[str]]:
    """(steps the remote lists as committed, problems): a listed version whose manifest names
    a chunk that is missing or of another size is a problem. Chunk presence is checked with
    botocore, independently of s3fs and its listing cache."""
    listed = [c.step for c in committed(open_tier(place.url, place.options))]
    problems = []
    objects = place.objects()
    for step in listed:
        key = f"{place.prefix}/{vname(step)}/manifest.json"
        if key not in objects:
            continue  # deleted (GC) between the listing and now
        body = place.server.client().get_object(Bucket=place.server.bucket, Key=key)["Body"].read()
        for rel, size in chunk_sizes(parse_manifest(body)).items():
            got = objects.get(f"{place.prefix}/{vname(step)}/{rel}")
            if got is None or got["size"] != size:
                problems.append(f"step {step}: {rel} is {'missing' if got is None else got['size']} (want {size})")
    return listed, problems


class RemoteWatch:
    """Polls the remote in a thread; records what was listed and every inconsistency seen
    while the server was up and not restarted in between (a restart loses objects mid-poll)."""

    def __init__(self, place: S3Place, period: float = 0.1) -> None:
        self.place = place
        self.period = period
        self.seen: list[tuple[float, list[int]]] = []
        self.problems: list[str] = []
        self.polls = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RemoteWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        server = self.place.server
        while not self._stop.is_set():
            starts = server.starts
            try:
                listed, problems = remote_problems(self.place)
            except Exception as e:  # noqa: BLE001 - the server is down or restarting
                self.errors.append(repr(e))
                listed, problems = None, []
            if listed is not None and server.alive and server.starts == starts:
                self.polls += 1
                self.seen.append((time.monotonic(), listed))
                self.problems += problems
            self._stop.wait(self.period)

    def first_seen(self, step: int) -> float | None:
        return next((t for t, steps in self.seen if step in steps), None)


def wait_for(pred: Any, timeout: float, what: str, period: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(period)


def remote_steps(place: S3Place) -> list[int]:
    """What the remote tier lists, in this long-lived process (s3fs instances and their listing
    caches are shared process-wide: the listing must still be fresh)."""
    return [c.step for c in committed(open_tier(place.url, place.options))]


def chunk_objects(place: S3Place, step: int) -> dict[str, dict[str, Any]]:
    """The chunk objects (not metadata) of a step on the remote."""
    base = f"{place.prefix}/{vname(step)}/"
    return {k[len(base) :]: v for k, v in place.objects().items() if k.startswith(base) and "/c." in k[len(base) :]}


def local_chunks(root: Path, step: int) -> dict[str, int]:
    return chunk_sizes(versions.read_manifest(str(root), step))


def daemon_args(root: Path, place: S3Place, *extra: str) -> list[str]:
    return ["replicate", str(root), "--to", place.url, *place.cli_options, *extra]


def stop_daemon(p: subprocess.Popen[bytes], timeout: float = 15) -> tuple[int, float]:
    """SIGTERM; (returncode, seconds until exit)."""
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout)
    return rc, time.monotonic() - t0


# -- 1. upload, list, verify, restore ---------------------------------------------------------------


def test_cli_replicate_ls_verify_restore_from_s3(s3: S3Place, tmp_path: Path) -> None:
    root = tmp_path / "root"
    states = {step: small_state(step) for step in (1, 2, 3)}
    save_steps(root, states)

    r = cli("replicate", root, "--to", s3.url, "--once", *s3.cli_options)
    assert r.exit_code == 0, r.output
    assert "replicator stopped" in r.output

    r = cli("ls", s3.url, "--json", *s3.cli_options)
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["status"] == "committed" and row["world_size"] == 1 for row in rows)
    # the local root's view: every version is verified on the remote
    local_rows = json.loads(cli("ls", root, "--json").output)
    assert [(row["step"], row["remote"]["state"]) for row in local_rows] == [(s, "verified") for s in (1, 2, 3)]

    r = cli("verify", s3.url, *s3.cli_options)
    assert r.exit_code == 0, r.output
    assert [line.split(":")[0] for line in r.output.splitlines()] == ["step 1", "step 2", "step 3"]

    for step, args in ((3, []), (2, ["--step", "2"])):
        out = tmp_path / f"restored-{step}.pt"
        r = cli("restore", s3.url, "--to-torch", out, *args, *s3.cli_options)
        assert r.exit_code == 0, r.output
        assert f"restored step {step}" in r.output
        assert_bitwise(torch.load(out, weights_only=True), states[step])

    # A Checkpointer with nothing local: the root is deleted, the URL is the only tier.
    shutil.rmtree(root)
    with Checkpointer(root, tiers=[s3.url], storage_options=s3.options) as ck:
        assert ck.steps() == []
        target = blank(states[3])
        assert ck.restore(target) == 3
        assert_bitwise(target, states[3])
        target = blank(states[1])
        assert ck.restore(target, step=1) == 1
        assert_bitwise(target, states[1])

    # A damaged object on the remote makes verify fail (and name it).
    objs = chunk_objects(s3, 2)
    rel = next(k for k in sorted(objs) if k.startswith("state/model/w/"))
    client = s3.server.client()
    key = f"{s3.prefix}/{vname(2)}/{rel}"
    data = bytearray(client.get_object(Bucket=s3.server.bucket, Key=key)["Body"].read())
    data[100] ^= 0x01
    client.put_object(Bucket=s3.server.bucket, Key=key, Body=bytes(data))
    r = cli("verify", s3.url, *s3.cli_options)
    assert r.exit_code == 1, r.output
    assert f"step 2: BAD {rel}" in r.output and "step 3: ok" in r.output


def test_a_version_whose_keys_the_remote_cannot_take_fails_alone(s3: S3Place, tmp_path: Path) -> None:
    """S3 takes object keys of at most 1,024 bytes (moto takes longer ones). A version whose
    array names make a longer key below the remote's prefix is recorded failed, naming the
    key, and nothing of it is sent; the version after it is copied in the same pass. Before,
    S3's refusal of one version failed the remote for the pass, and each pass met it first."""
    root = tmp_path / "root"
    deep: dict[str, Any] = {}
    node = deep
    for i in range(8):  # 8 levels of 125-byte keys: array names of ~1,010 bytes
        node = node.setdefault(f"{i}" + "k" * 124, {})
    node["w"] = torch.arange(4.0)
    save_steps(root, {1: {"deep": deep}, 2: small_state(2)})

    r = cli("replicate", root, "--to", s3.url, "--once", *s3.cli_options)
    assert r.exit_code == 3, r.output  # a copy failed
    assert "k" * 124 in r.output and "bytes, and this store takes" in r.output, r.output
    assert remote_steps(s3) == [2]
    assert not [k for k in s3.objects() if k.startswith(f"{s3.prefix}/{vname(1)}/")]
    status = read_status(str(root))
    failed, copied = status.versions[1].remote, status.versions[2].remote
    assert failed is not None and failed.state == "failed", failed
    assert "bytes, and this store takes" in (failed.error or "") and "k" * 124 in (failed.error or ""), failed
    assert copied is not None and copied.state == "verified", copied


def test_endpoint_from_aws_endpoint_url(s3: S3Place, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No storage option at all: AWS_ENDPOINT_URL (and the AWS_* credentials) reach the server."""
    import s3fs

    root = tmp_path / "root"
    states = {5: small_state(5)}
    save_steps(root, states)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.server.endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        r = cli("replicate", root, "--to", s3.url, "--once")
        assert r.exit_code == 0, r.output
        r = cli("ls", s3.url, "--json")
        assert r.exit_code == 0, r.output
        assert [row["step"] for row in json.loads(r.output)] == [5]
        out = tmp_path / "r.pt"
        r = cli("restore", s3.url, "--to-torch", out)
        assert r.exit_code == 0, r.output
        assert_bitwise(torch.load(out, weights_only=True), states[5])
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert set(chunk_objects(s3, 5)) == set(local_chunks(root, 5))  # it really went to moto


# -- 2. the S3 server dies mid-upload ---------------------------------------------------------------


def test_server_killed_mid_upload_daemon_retries(s3: S3Place, moto_server: MotoServer, tmp_path: Path) -> None:
    root = tmp_path / "root"
    state = big_state(1)  # 10 chunks of 4 MiB
    save_steps(root, {1: state})
    want = local_chunks(root, 1)
    # 40 MiB at 8 MB/s: the kill comes after 2 chunks with about 4 s of upload left, room for a
    # slow listing on a loaded machine (at 16 MB/s and 3 chunks, CI once missed the 1.8 s left).
    daemon = s3.popen(daemon_args(root, s3, "--bwlimit", "8", "--interval", "0.2"), "daemon")
    with RemoteWatch(s3) as watch:
        wait_for(lambda: len(chunk_objects(s3, 1)) >= 2 or daemon.poll() is not None, 60, "the first chunks")
        assert daemon.poll() is None, s3.output("daemon")
        before = len(chunk_objects(s3, 1))
        assert before < len(want), "the upload finished before the server could be killed"
        moto_server.kill()
        time.sleep(0.3)
        moto_server.start()  # an empty store: even the chunks sent before are gone
        t_restart = time.monotonic()
        wait_for(lambda: 1 in remote_steps(s3), 60, "step 1 on the remote after the restart", period=0.2)
        t_done = time.monotonic()
        time.sleep(0.5)  # a few more polls of the finished state
    print(f"server killed with {before}/{len(want)} chunks up; complete {t_done - t_restart:.1f}s after the restart")
    rc, took = stop_daemon(daemon)
    out, err = s3.output("daemon")
    assert rc == 0, err
    # It did notice the outage: a request tried again, files verified before and gone after
    # the restart, or (the server down through every try of a request) the copy failed and
    # the next pass made it again.
    noticed = ("trying again", "are gone", "failed (the other copies go on)")
    assert any(s in err for s in noticed), err
    assert watch.polls >= 5
    assert watch.problems == [], watch.problems
    assert {k: v["size"] for k, v in chunk_objects(s3, 1).items()} == want
    r = cli("verify", s3.url, *s3.cli_options)
    assert r.exit_code == 0, r.output
    shutil.rmtree(root)
    with Checkpointer(root, tiers=[s3.url], storage_options=s3.options) as ck:
        target = blank(state)
        assert ck.restore(target) == 1
        assert_bitwise(target, state)


# -- 3. the daemon dies mid-upload and resumes ------------------------------------------------------


def _journal(root: Path) -> tuple[Path, set[str]] | None:
    found = sorted((root / ".replicator").glob("*/v*.json"))
    if not found:
        return None
    try:
        return found[0], set(json.loads(found[0].read_text())["verified"])
    except (OSError, ValueError, KeyError):
        return None


def _sent(output: str) -> float:
    """Bytes from the daemon's last line 'replicator stopped; 12.3 MiB sent'."""
    line = next(x for x in output.splitlines() if x.startswith("replicator stopped; "))
    value, unit = line.split("; ", 1)[1].split()[:2]
    return float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def test_daemon_sigkilled_mid_upload_resumes(s3: S3Place, tmp_path: Path) -> None:
    root = tmp_path / "root"
    state = big_state(3)
    save_steps(root, {1: state})
    want = local_chunks(root, 1)
    vdir = root / vname(1)
    all_files = {
        str(p.relative_to(vdir)): p.stat().st_size
        for p in vdir.rglob("*")
        if p.is_file() and p.name not in ("manifest.json", "root.json")
    }
    # 8 MB/s: about 4 s of upload left at the kill (as in the server-killed test above).
    daemon = s3.popen(daemon_args(root, s3, "--bwlimit", "8"), "daemon1")
    wait_for(
        lambda: len((_journal(root) or (None, set()))[1] & set(want)) >= 2 or daemon.poll() is not None,
        60,
        "two chunks in the journal",
    )
    daemon.kill()  # SIGKILL: no cleanup of any kind
    assert daemon.wait(10) == -signal.SIGKILL
    journal_path, done = _journal(root)  # type: ignore[misc]
    assert len(done & set(want)) < len(want), "the upload finished before the daemon could be killed"
    assert remote_steps(s3) == []  # nothing committed
    before = {k: v for k, v in chunk_objects(s3, 1).items() if k in done}
    assert set(before) == done & set(want)  # journaled chunks are really there
    time.sleep(1.1)  # LastModified has one-second resolution: a re-upload would show

    rc, out, err = s3.run(daemon_args(root, s3, "--once"), "daemon2")
    assert rc == 0, err
    after = chunk_objects(s3, 1)
    assert {k: v["size"] for k, v in after.items()} == want
    for rel, obj in before.items():
        assert after[rel]["mtime"] == obj["mtime"], f"{rel} was uploaded again"
    resent = {rel: after[rel]["mtime"] for rel in set(want) - done}
    assert all(t > max(o["mtime"] for o in before.values()) for t in resent.values())
    total = sum(all_files.values())
    skipped = sum(all_files[r] for r in done)
    sent = _sent(out)
    print(
        f"\nresume: {len(done & set(want))}/{len(want)} chunks verified before the kill; the restarted daemon sent "
        f"{sent / MiB:.1f} MiB of {total / MiB:.1f} MiB (expected {(total - skipped) / MiB:.1f} MiB)"
    )
    assert abs(sent - (total - skipped)) <= 0.06 * MiB
    assert not journal_path.exists()  # removed once the version is committed
    assert remote_steps(s3) == [1]
    assert remote_problems(s3)[1] == []
    r = cli("verify", s3.url, *s3.cli_options)
    assert r.exit_code == 0, r.output


# -- 4. one replica disk lost ---------------------------------------------------------------------


def test_replica_disk_deleted_restore_from_the_other(s3: S3Place, tmp_path: Path) -> None:
    from ckpt.replicator.placement import source_label

    d0, d1 = two_disks(tmp_path)
    states = {step: small_state(step) for step in (1, 2, 3)}
    with Checkpointer([d0, d1], replicate_to=s3.url, storage_options=s3.options) as ck:
        assert Path(ck.root) == d0
        for step, state in states.items():
            ck.save(step, state)
        ck.wait()
    # close() drained the replicator: every version is on both disks and on the remote
    replica = d1 / "replicas" / source_label(str(d0))
    assert versions.committed_steps(str(d0)) == [1, 2, 3]
    assert versions.committed_steps(str(replica)) == [1, 2, 3]
    assert remote_steps(s3) == [1, 2, 3]
    status = read_status(str(d0))
    assert status is not None
    for key in (1, 2, 3):
        assert [c.state for c in status.versions[key].copies.values()] == ["verified"]
        remote = status.versions[key].remote
        assert remote is not None and remote.state == "verified"

    shutil.rmtree(tmp_path / "disk0")  # the whole disk is gone
    with Checkpointer([d0, d1]) as ck:  # no remote: only the replicas on disk1 can serve
        assert ck.steps() == []
        target = blank(states[3])
        assert ck.restore(target) == 3
        assert_bitwise(target, states[3])
        target = blank(states[1])
        assert ck.restore(target, step=1) == 1
        assert_bitwise(target, states[1])


# -- 5. retention ---------------------------------------------------------------------------------


def _retention_config(d1: Path, s3: S3Place, interval_s: float = 0.05) -> ReplicatorConfig:
    return ReplicatorConfig(
        replicas=2,
        replica_roots=(str(d1),),
        remote=s3.url,
        storage_options=s3.options,
        local_policy=KeepLast(3),
        remote_policy=KeepMilestones(every=10),
        interval_s=interval_s,
    )


def _check_retention(d0: Path, d1: Path, s3: S3Place, local: list[int], remote: list[int]) -> None:
    from ckpt.replicator.placement import source_label

    replica = d1 / "replicas" / source_label(str(d0))
    assert versions.committed_steps(str(d0)) == local
    assert versions.committed_steps(str(replica)) == local
    status = read_status(str(d0))
    assert status is not None and sorted(status.versions) == local
    assert remote_steps(s3) == remote
    assert {k.split("/")[1] for k in s3.objects()} == {vname(s) for s in remote}  # nothing left of the rest
    with Checkpointer([d0, d1], tiers=[s3.url], storage_options=s3.options) as ck:
        for step in (remote[-2], remote[-1]):
            target = blank(tiny_state(step))
            assert ck.restore(target, step=step) == step
            assert_bitwise(target, tiny_state(step))


def test_retention_over_50_saves(s3: S3Place, tmp_path: Path) -> None:
    """Local keep-last 3 (and its replicas), remote every 10th step plus a tagged one; a pass
    every 5 saves, checked after each pass."""
    d0, d1 = two_disks(tmp_path)
    tagged = 33
    rep = Replicator([str(d0)], _retention_config(d1, s3))
    with Checkpointer([d0, d1]) as ck:
        for step in range(1, 51):
            ck.save(step, tiny_state(step), milestone=step == tagged)
            if step % 5 == 0:
                ck.wait()
                rep.run_once()
                assert versions.committed_steps(str(d0)) == list(range(step - 2, step + 1))
                kept = sorted(set(range(10, step + 1, 10)) | {step} | ({tagged} if tagged <= step else set()))
                assert remote_steps(s3) == kept, step
        ck.wait()
    rep.run_once()
    _check_retention(d0, d1, s3, [48, 49, 50], [10, 20, 30, tagged, 40, 50])


def test_a_remote_copy_its_retention_deleted_is_expired_not_verified(tmp_path: Path) -> None:
    """The status (and `ckpt ls`) never claims a remote copy the remote's retention deleted."""
    remote = tmp_path / "remote"
    save_steps(tmp_path / "root", {step: tiny_state(step) for step in (1, 2, 3)})
    r = cli("replicate", tmp_path / "root", "--once", "--to", f"file://{remote}", "--remote-keep-last", "1")
    assert r.exit_code == 0, r.output
    assert versions.committed_steps(str(remote)) == [3]
    status = read_status(str(tmp_path / "root"))
    assert status is not None
    assert {step: v.remote.state for step, v in status.versions.items() if v.remote} == {
        1: "expired",
        2: "expired",
        3: "verified",
    }
    rows = json.loads(cli("ls", tmp_path / "root", "--json").stdout)
    assert [row["remote"]["state"] for row in rows] == ["expired", "expired", "verified"]


def test_replica_copies_of_versions_gc_deleted_elsewhere_are_collected(tmp_path: Path) -> None:
    """`ckpt gc ROOT` deletes versions behind the replicator's back: their replica copies
    go under the local policy in later passes (not only those the replicator deleted),
    never a copy the source still holds, nor one a reader has pinned."""
    from ckpt.replicator.placement import source_label

    d0, d1 = two_disks(tmp_path)
    replica = str(d1 / "replicas" / source_label(str(d0)))
    rep = Replicator([str(d0)], ReplicatorConfig(replicas=2, replica_roots=(str(d1),), local_policy=KeepLast(3)))
    with Checkpointer(d0) as ck:
        for step in range(1, 6):
            ck.save(step, tiny_state(step))
        ck.wait()
        rep.run_once()
        assert versions.committed_steps(str(d0)) == versions.committed_steps(replica) == [3, 4, 5]
        gc = CliRunner().invoke(cli_main, ["gc", str(d0), "--keep-last", "1"])
        assert gc.exit_code == 0, gc.output
        assert versions.committed_steps(str(d0)) == [5]
        for step in range(6, 9):
            ck.save(step, tiny_state(step))
        ck.wait()
        with pins.pin_version(as_tier(replica), 3) as present:  # a restore reading the replica's copy of 3
            assert present
            rep.run_once()
            assert versions.committed_steps(str(d0)) == [6, 7, 8]
            assert versions.committed_steps(replica) == [3, 6, 7, 8]  # 4 and 5 collected, 3 pinned
        rep.run_once()
    assert versions.committed_steps(replica) == [6, 7, 8]
    for step in (6, 8):
        target = blank(tiny_state(step))
        with Checkpointer(tmp_path / "reader", tiers=[replica]) as reader:
            assert reader.restore(target, step=step) == step
        assert_bitwise(target, tiny_state(step))


def test_replicas_of_a_lost_source_disk_are_kept(tmp_path: Path) -> None:
    """The source disk is replaced by an empty one: its replicas are now the only local
    copies, and replica GC leaves them all (a source that lists nothing is not evidence
    that its versions were deleted)."""
    from ckpt.replicator.placement import source_label

    d0, d1 = two_disks(tmp_path)
    replica = str(d1 / "replicas" / source_label(str(d0)))
    with Checkpointer(d0) as ck:
        for step in range(1, 5):
            ck.save(step, tiny_state(step))
    Replicator([str(d0)], ReplicatorConfig(replicas=2, replica_roots=(str(d1),))).run_once()
    assert versions.committed_steps(replica) == [1, 2, 3, 4]
    d0.rename(tmp_path / "dead-disk")
    d0.mkdir()  # an empty mount point where the disk was
    Replicator([str(d0)], ReplicatorConfig(replicas=2, replica_roots=(str(d1),), local_policy=KeepLast(2))).run_once()
    assert versions.committed_steps(replica) == [1, 2, 3, 4]


def test_replica_copies_the_remote_lacks_are_kept(tmp_path: Path) -> None:
    """A version deleted from the source by hand before it reached the remote: the
    replica's copy is its last one, and replica GC keeps it until the remote has it."""
    from ckpt.replicator.placement import source_label

    d0, d1 = two_disks(tmp_path)
    replica = str(d1 / "replicas" / source_label(str(d0)))
    broken = tmp_path / "remote"
    broken.write_text("a file where the remote directory should be: every upload fails")
    config = ReplicatorConfig(replicas=2, replica_roots=(str(d1),), remote=f"file://{broken}", local_policy=KeepLast(2))
    with Checkpointer(d0) as ck:
        for step in range(1, 6):
            ck.save(step, tiny_state(step))
    rep = Replicator([str(d0)], config)
    rep.run_once()
    assert versions.committed_steps(str(d0)) == versions.committed_steps(replica) == [1, 2, 3, 4, 5]  # none redundant
    versions.delete_version(str(d0), 1)  # by hand
    rep.run_once()
    assert versions.committed_steps(replica) == [1, 2, 3, 4, 5]
    target = blank(tiny_state(1))
    with Checkpointer(tmp_path / "reader", tiers=[replica]) as reader:
        assert reader.restore(target, step=1) == 1
    assert_bitwise(target, tiny_state(1))


def test_retention_by_the_checkpointer_thread(s3: S3Place, tmp_path: Path) -> None:
    """The same with the Checkpointer's own replicator thread: passes race the saves (and
    delete versions while new ones commit); close() drains."""
    d0, d1 = two_disks(tmp_path)
    with Checkpointer([d0, d1], replication=_retention_config(d1, s3, interval_s=0.2)) as ck:
        for step in range(1, 31):
            ck.save(step, tiny_state(step), milestone=step == 13)
    _check_retention(d0, d1, s3, [28, 29, 30], [10, 13, 20, 30])


def _v(step: int, intact: bool = True, tagged: bool = False, redundant: bool = True) -> VersionInfo:
    return VersionInfo(step, float(step), intact, tagged, redundant)


def test_policies() -> None:
    vs = [_v(s, tagged=s == 7) for s in range(1, 13)]
    assert KeepLast(3).keep(vs) == {10, 11, 12}
    assert KeepLast(0).keep(vs) == set()
    assert KeepLast(50).keep(vs) == set(range(1, 13))
    for n in range(1, 9):  # fewer versions than n, but more than n/2: len - n is a small negative slice start
        for k in range(0, n + 1):
            assert KeepLast(n).keep(vs[:k]) == set(range(1, k + 1)), (n, k)
    assert KeepLast(2).keep(list(reversed(vs))) == {11, 12}  # by step, not by order
    assert KeepMilestones(every=5).keep(vs) == {5, 7, 10}  # multiples and the tagged one
    assert KeepMilestones(steps=frozenset({3})).keep(vs) == {3, 7}
    assert KeepMilestones().keep(vs) == {7}
    assert Union((KeepLast(2), KeepMilestones(every=4))).keep(vs) == {4, 7, 8, 11, 12}
    assert KeepAll().keep(vs) == set(range(1, 13))
    for bad in (lambda: KeepLast(-1), lambda: KeepMilestones(every=0)):
        with pytest.raises(ValueError):
            bad()


def test_plan_deletions_rules() -> None:
    vs = [_v(s) for s in range(1, 6)]
    assert plan_deletions(vs, KeepLast(2)) == [1, 2, 3]  # oldest first
    assert plan_deletions(vs, KeepLast(0)) == [1, 2, 3, 4]  # never the newest intact
    # the newest is damaged: the newest intact one is kept instead, the damaged one may go
    damaged = [*vs[:4], _v(5, intact=False)]
    assert plan_deletions(damaged, KeepLast(0)) == [1, 2, 3, 5]
    # an intact version whose copies are not made yet stays; a damaged one need not
    pending = [_v(1, redundant=False), _v(2, intact=False, redundant=False), *vs[2:]]
    assert plan_deletions(pending, KeepLast(1)) == [2, 3, 4]
    assert plan_deletions(pending, KeepLast(1), require_redundant=False) == [1, 2, 3, 4]
    assert plan_deletions(vs, KeepLast(1), pinned=[2]) == [1, 3, 4]
    assert plan_deletions([], KeepLast(0)) == []


def test_plan_deletions_invariants_random() -> None:
    import random

    rng = random.Random(7)
    for _ in range(300):
        steps = sorted(rng.sample(range(200), rng.randint(0, 12)))
        vs = [_v(s, rng.random() > 0.2, rng.random() < 0.1, rng.random() > 0.3) for s in steps]
        policies: list[Policy] = [KeepLast(rng.randint(0, 4)), KeepMilestones(every=rng.randint(1, 20)), KeepAll()]
        policy = rng.choice(policies)
        pinned = set(rng.sample(steps, min(len(steps), rng.randint(0, 2))))
        require = rng.random() < 0.7
        doomed = plan_deletions(vs, policy, pinned=pinned, require_redundant=require)
        assert doomed == sorted(doomed) and set(doomed) <= set(steps)
        intact = [v.step for v in vs if v.intact]
        if intact:
            assert intact[-1] not in doomed
        assert not set(doomed) & pinned
        assert not set(doomed) & policy.keep(vs)
        if require:
            assert not {v.step for v in vs if v.intact and not v.redundant} & set(doomed)
        protected = policy.keep(vs) | pinned | set(intact[-1:])
        if require:
            protected |= {v.step for v in vs if v.intact and not v.redundant}
        assert set(doomed) == set(steps) - protected  # and nothing else is kept


# -- 6. GC killed mid-run ---------------------------------------------------------------------------


def test_gc_killed_mid_run(s3: S3Place, tmp_path: Path) -> None:
    """`ckpt gc --keep-last 1` SIGKILLed at its first deletion (CKPT_FAULT=gc-delete before
    it on a local root; gc-marked on S3, once its `.deleting` marker is written), at once: whatever is listed afterwards is whole, and the
    next GC finishes the job (on the remote, the interrupted deletion too)."""
    root = tmp_path / "root"
    states = {step: small_state(step) for step in (1, 2, 3, 4)}
    save_steps(root, states)
    assert cli("replicate", root, "--to", s3.url, "--once", *s3.cli_options).exit_code == 0
    assert remote_steps(s3) == [1, 2, 3, 4]
    local_gc = ["gc", str(root), "--keep-last", "1"]
    remote_gc = ["gc", s3.url, "--keep-last", "1", *s3.cli_options]
    procs = {
        "local": s3.popen(local_gc, "gc-local", s3.env(CKPT_FAULT="gc-delete")),
        "remote": s3.popen(remote_gc, "gc-remote", s3.env(CKPT_FAULT="gc-marked")),
    }
    for name, p in procs.items():
        assert p.wait(60) == -signal.SIGKILL, s3.output(f"gc-{name}")

    # local: every listed version verifies
    steps = versions.committed_steps(str(root))
    assert steps[-1] == 4 and set(steps) <= {1, 2, 3, 4}
    for step in steps:
        r = cli("verify", root, "--step", step)
        assert r.exit_code == 0, r.output
    # remote: killed inside the first deletion (marker written); nothing listed is incomplete
    assert [k.split("/")[1] for k in s3.objects() if k.endswith("/.deleting")] == [vname(1)]
    listed, problems = remote_problems(s3)
    assert problems == [] and listed[-1] == 4
    r = cli("verify", s3.url, *s3.cli_options)
    assert r.exit_code == 0, r.output
    # The state of a GC that died a little later, inside `rm` (marker there, manifest gone,
    # chunks partly left): invisible, and left for the next GC to finish.
    client = s3.server.client()
    client.delete_object(Bucket=s3.server.bucket, Key=f"{s3.prefix}/{vname(1)}/manifest.json")
    client.delete_object(Bucket=s3.server.bucket, Key=f"{s3.prefix}/{vname(1)}/root.json")
    assert remote_steps(s3) == [2, 3, 4] and remote_problems(s3)[1] == []

    r = cli(*local_gc)
    assert r.exit_code == 0, r.output
    assert versions.committed_steps(str(root)) == [4]
    assert cli("verify", root).exit_code == 0
    r = cli(*remote_gc)
    assert r.exit_code == 0, r.output
    assert remote_steps(s3) == [4]
    assert {k.split("/")[1] for k in s3.objects()} == {vname(4)}  # the interrupted one is finished too
    out_file = tmp_path / "r.pt"
    assert cli("restore", s3.url, "--to-torch", out_file, *s3.cli_options).exit_code == 0
    assert_bitwise(torch.load(out_file, weights_only=True), states[4])
    with Checkpointer(root) as ck:  # reopening empties the local trash of the killed run
        target = blank(states[4])
        assert ck.restore(target) == 4
        assert_bitwise(target, states[4])
    trash = root / versions.TRASH_NAME
    assert not trash.exists() or not list(trash.iterdir())


# -- 7. pickup lag and SIGTERM ----------------------------------------------------------------------


def test_daemon_pickup_lag_and_sigterm(s3: S3Place, tmp_path: Path) -> None:
    root = tmp_path / "root"
    save_steps(root, {1: small_state(1)})
    daemon = s3.popen(daemon_args(root, s3, "--bwlimit", "2"), "daemon")  # default --interval 0.5
    wait_for(lambda: remote_steps(s3) == [1] or daemon.poll() is not None, 60, "step 1 (daemon start)", 0.1)
    assert daemon.poll() is None, s3.output("daemon")
    with RemoteWatch(s3) as watch, Checkpointer(root) as ck:  # the training process beside the daemon
        ck.save(2, small_state(2))
        ck.wait()
        committed_at = time.time()
        assert versions.read_manifest(str(root), 2).created <= committed_at
        seen = wait_for(lambda: 2 in remote_steps(s3) and time.time(), 10, "step 2 on the remote", 0.02)
        lag = seen - committed_at
        recorded = json.loads(cli("ls", root, "--json").output)[-1]["lag_s"]
        print(f"\npickup: step 2 on the remote {lag:.2f}s after its commit (replicator's own figure {recorded}s)")
        assert lag < 10

        # 5 x 8 MiB at 2 MB/s: ~20 s of upload, its threads waiting on the bandwidth cap
        ck.save(3, big_state(3, tensors=5, mib_each=8))
        ck.wait()
        time.sleep(2.0)  # picked up (4 intervals), nowhere near done
        rc, took = stop_daemon(daemon)
    out, err = s3.output("daemon")
    print(f"SIGTERM mid-upload: exit {rc} after {took:.2f}s")
    assert rc == 0, err
    assert "replicator stopped" in out
    assert took < 5  # not after the throttled uploads in flight
    assert _journal(root) is not None  # it was inside step 3: its journal is kept for a resume
    listed, problems = remote_problems(s3)
    assert listed == [1, 2] and problems == []  # step 3 is not visible, half-uploaded
    assert watch.polls >= 5 and watch.problems == [], watch.problems
    want = local_chunks(root, 3)
    sent = {k: v["size"] for k, v in chunk_objects(s3, 3).items()}
    assert len(sent) < len(want)
    assert all(size == want[k] for k, size in sent.items()), sent  # abandoned uploads leave no stubs


# -- 8. credentials ---------------------------------------------------------------------------------

SECRETS = ("SEKRIT-xyz123", "SEKRIT-opt-456", "SEKRIT-tok-789", "AKIDSEKRIT0000", "AKIDSEKRIT-opt")


def test_credentials_never_logged(s3: S3Place, tmp_path: Path) -> None:
    from tests.s3_server import free_port

    env = s3.env(AWS_SECRET_ACCESS_KEY="SEKRIT-xyz123", AWS_ACCESS_KEY_ID="AKIDSEKRIT0000")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    opts = ["--storage-option", "key=AKIDSEKRIT-opt", "--storage-option", "secret=SEKRIT-opt-456"]
    targets = {
        # a dead endpoint: connection errors
        "dead": [
            s3.url,
            "--storage-option",
            f"endpoint_url={dead}",
            "--storage-option",
            "config_kwargs.retries.max_attempts=1",
        ],
        # the live endpoint and a bucket that does not exist
        "nobucket": ["s3://no-such-bucket-zz/p", *s3.cli_options],
    }
    procs = {}
    for name, target in targets.items():
        root = tmp_path / name
        save_steps(root, {1: small_state(1)})
        args = ["replicate", str(root), "--to", *target, *opts, "--storage-option", "token=SEKRIT-tok-789"]
        procs[name] = s3.popen(args, name, env)
    # The CLI's own error lines, meanwhile.
    r = CliRunner(env={"AWS_SECRET_ACCESS_KEY": "SEKRIT-xyz123"}).invoke(
        cli_main, ["ls", *targets["dead"], *opts, "--storage-option", "token=SEKRIT-tok-789"]
    )
    assert r.exit_code == 3 and "ckpt: error:" in r.output, r.output
    texts = {"ls": r.output}
    r = CliRunner().invoke(cli_main, ["gc", *targets["dead"], "--keep-last", "1", *opts])
    assert r.exit_code == 3 and "ckpt: error:" in r.output, r.output  # one line, not a traceback
    texts["gc"] = r.output
    for name in procs:  # wait for the errors to be logged
        wait_for(lambda n=name: "failed" in s3.output(n)[1], 60, f"{name}: a logged error", 0.2)
    for name, p in procs.items():
        rc, _ = stop_daemon(p, 30)
        assert rc == 0, s3.output(name)
        texts[name] = "\n".join(s3.output(name))
        for path in (tmp_path / name / ".replicator").rglob("*"):  # status and journals
            if path.is_file() and path.name != "lock":
                texts[str(path)] = path.read_text()
    assert "Could not connect" in texts["dead"], texts["dead"]
    assert "bucket" in texts["nobucket"].lower(), texts["nobucket"]
    for where, text in texts.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret} appears in {where}:\n{text}"


@pytest.mark.parametrize("where", ["remote", "replica"])
def test_a_copy_deleted_since_it_was_verified_does_not_count(tmp_path: Path, where: str) -> None:
    """Step 1 is copied (to the remote, or to a replica disk) and verified; then that copy is
    deleted behind the replicator's back (by hand, a bucket's lifecycle rule, another job's
    GC). Local retention (keep the newest 1) must not delete the source's step 1 on the
    strength of the status's word: it checks the copy first, keeps step 1 and copies it
    again, and only then deletes it. Before, step 1 was deleted at once, while no copy of
    it was left anywhere."""
    from ckpt.replicator.placement import source_label

    d0, d1 = two_disks(tmp_path)
    if where == "remote":
        dest = str(d1 / "remote")
        config = ReplicatorConfig(remote=f"file://{dest}", local_policy=KeepLast(1))
    else:
        dest = str(d1 / "replicas" / source_label(str(d0)))
        config = ReplicatorConfig(replicas=2, replica_roots=(str(d1),), local_policy=KeepLast(1))
    rep = Replicator([str(d0)], config)
    with Checkpointer(d0) as ck:
        ck.save(1, tiny_state(1))
        ck.wait()
        rep.run_once()
        assert versions.committed_steps(dest) == [1]
        versions.delete_version(dest, 1)  # behind the replicator's back
        ck.save(2, tiny_state(2))
        ck.wait()
        rep.run_once()
        assert versions.committed_steps(str(d0)) == [1, 2]  # 1 kept: its copy is gone
        status = read_status(str(d0))
        assert status is not None
        entry = status.versions[1]
        copy = entry.remote if where == "remote" else next(iter(entry.copies.values()))
        assert copy is not None and copy.state != "verified", copy
        rep.run_once()
    assert versions.committed_steps(str(d0)) == [2]  # deleted here once copied again
    if where == "replica":  # replicas follow the local policy: that copy went in the same pass
        assert versions.committed_steps(dest) == [2]
        return
    assert versions.committed_steps(dest) == [1, 2]  # the remote keeps every version
    target = blank(tiny_state(1))
    with Checkpointer(tmp_path / "reader", tiers=[dest]) as reader:
        assert reader.restore(target, step=1) == 1
    assert_bitwise(target, tiny_state(1))


def test_an_overwrite_whose_old_save_the_remote_still_holds_is_the_step_restored(
    tmp_path: Path, s3: S3Place, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2 uploaded, then saved again with overwrite=True: the remote keeps the save it
    holds (another save of the step is not replaced there), so the tiers hold two whole saves
    of step 2. The restore loads the later one. Before, two saves of a step made it
    unusable: the restore fell back to step 1 ("lacks the part of ranks []"), and with no
    older version raised IncompleteVersionError, or with if_incomplete="fresh" started
    afresh beside an intact version."""
    root = tmp_path / "root"
    opts = {"replicate_to": s3.url, "storage_options": s3.options}
    with Checkpointer(root, **opts) as ck:
        ck.save(2, {"w": torch.full((4,), 2.0)})
    with Checkpointer(root, **opts) as ck:
        ck.save(2, {"w": torch.full((4,), 22.0)}, overwrite=True)
    with Checkpointer(root, **opts) as ck:
        for fresh in ("raise", "fresh"):
            state = {"w": torch.zeros(4)}
            assert ck.restore(state, if_incomplete=fresh) == 2  # type: ignore[arg-type]
            assert torch.equal(state["w"], torch.full((4,), 22.0))
    with Checkpointer(tmp_path / "elsewhere", tiers=[s3.url], storage_options=s3.options) as ck:
        state = {"w": torch.zeros(4)}
        assert ck.restore(state) == 2
        assert torch.equal(state["w"], torch.full((4,), 2.0)), "the remote alone holds the save it was sent"
