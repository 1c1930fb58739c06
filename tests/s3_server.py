"""A real S3 endpoint for tests: a moto server subprocess on 127.0.0.1, reached through
s3fs exactly as production reaches S3 (fake AWS_* credentials, `endpoint_url` as a
storage option, `--storage-option endpoint_url=...` on the command line, or the
AWS_ENDPOINT_URL variable).

Fixtures (tests/conftest.py registers them for every test, through pytest_plugins):

- `moto_server` (session): the running server. Tests may `kill()` it (SIGKILL, like a
  crash) and `start()` it again on the same port; moto keeps everything in memory, so a
  restart loses every object and `start()` creates the bucket again.
- `s3` (function): an `S3Place` with a fresh prefix for the test, the storage options and
  the CLI arguments that reach it, and helpers to run `ckpt` in a subprocess. It restarts
  the server first if an earlier test left it down.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

REPO = str(Path(__file__).resolve().parent.parent)
BUCKET = "ckpt-test"
FAKE_KEY_ID = "AKIAFAKEFAKEFAKE0000"
FAKE_SECRET = "fake-secret-for-moto-0000"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The server runs in its own session (a signal to the tests' process group must not reach
# it), so it would outlive a test run that is killed: it asks for SIGKILL when its parent
# dies (prctl PR_SET_PDEATHSIG, kept across exec), then becomes moto.server.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # the parent died before prctl
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


class MotoServer:
    """`python -m moto.server` on 127.0.0.1:<port>, with the test bucket created."""

    def __init__(self, log_dir: Path, port: int | None = None, bucket: str = BUCKET) -> None:
        self.port = port or free_port()
        self.bucket = bucket
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 30.0) -> None:
        """Start on the same port (the daemon under test keeps its endpoint) and create the bucket."""
        assert not self.alive, "moto server already running"
        self.starts += 1
        self._log = open(self.log_dir / f"moto-{self.starts}.log", "wb")
        server = ["-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *server],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}; see {self._log.name}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"moto server did not answer within {timeout}s")
            time.sleep(0.1)
        # s3fs mkdir does not work against moto; botocore with region us-east-1 does.
        self.client().create_bucket(Bucket=self.bucket)

    def kill(self) -> None:
        """SIGKILL: connections in flight are cut, and every object is lost."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def _end(self, sig: int) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        _clear_s3fs_cache()

    def restart(self) -> None:
        self.kill()
        self.start()

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=FAKE_KEY_ID,
            aws_secret_access_key=FAKE_SECRET,
        )

    def objects(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every object under `prefix`: key -> {"size", "mtime" (LastModified), "etag"}."""
        out: dict[str, dict[str, Any]] = {}
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        for page in pages:
            for o in page.get("Contents", []):
                out[o["Key"]] = {"size": o["Size"], "mtime": o["LastModified"], "etag": o["ETag"]}
        return out


def _clear_s3fs_cache() -> None:
    """Forget cached s3fs instances (and their listings) of this process after a restart."""
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


@dataclass
class S3Place:
    """A fresh prefix in the test bucket and the ways to reach it."""

    server: MotoServer
    prefix: str
    workdir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"s3://{self.server.bucket}/{self.prefix}"

    @property
    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.server.endpoint}

    @property
    def cli_options(self) -> list[str]:
        return ["--storage-option", f"endpoint_url={self.server.endpoint}"]

    def objects(self) -> dict[str, dict[str, Any]]:
        return self.server.objects(self.prefix + "/")

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def popen(self, args: Sequence[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`ckpt ARGS` in a subprocess; its stdout and stderr go to <workdir>/<name>.out/.err."""
        out = open(self.workdir / f"{name}.out", "wb")
        err = open(self.workdir / f"{name}.err", "wb")
        try:
            p = subprocess.Popen(
                [sys.executable, "-m", "ckpt.cli", *args],
                cwd=REPO,
                env=env or self.env(),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        finally:
            out.close()
            err.close()
        self.procs.append(p)
        return p

    def run(
        self, args: Sequence[str], name: str, env: dict[str, str] | None = None, timeout: float = 60
    ) -> tuple[int, str, str]:
        """Run `ckpt ARGS` to the end: (returncode, stdout, stderr)."""
        p = self.popen(args, name, env)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
        return p.returncode, *self.output(name)

    def output(self, name: str) -> tuple[str, str]:
        return (
            (self.workdir / f"{name}.out").read_text(errors="replace"),
            (self.workdir / f"{name}.err").read_text(errors="replace"),
        )

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    base = tmp_path_factory.mktemp("moto")
    with pytest.MonkeyPatch.context() as mp:
        # Fake credentials, no config files, no endpoint from the environment: every test
        # reaches the server only through the storage option it passes (or sets the variable).
        mp.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
        mp.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
        mp.setenv("AWS_CONFIG_FILE", str(base / "no-aws-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(base / "no-aws-credentials"))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            mp.delenv(name, raising=False)
        server = MotoServer(base)
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3(moto_server: MotoServer, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[S3Place]:
    if not moto_server.alive:  # an earlier test killed it and failed before restarting it
        moto_server.start()
    workdir = tmp_path / "procs"
    workdir.mkdir()
    place = S3Place(
        moto_server, f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", ""), workdir
    )
    try:
        yield place
    finally:
        place.close()
