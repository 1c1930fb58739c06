"""Fail fast, and say so: dead S3 endpoints, final refusals, and a Checkpointer whose remote
is unreachable when its `with` block ends.

Real dead endpoints on 127.0.0.1, reached through s3fs as production reaches S3:
- `refused`: a closed port (connection refused);
- `blackhole`: a listening socket whose accept queue is full, so the kernel drops every
  further SYN (a blackholed address: the client's connect times out);
- `silent`: a socket that accepts connections (counted) and never answers (read timeout);
- `forbidden`: an HTTP server that answers every request (counted) with 403 AccessDenied.

Timing is never asserted (speed is measured in bench/): the tests count tries instead,
from the retry policy's log lines and from the connections an endpoint accepted, and check
the timeouts the S3 options configure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from click.testing import CliRunner
from prometheus_client import REGISTRY

from ckpt import Checkpointer
from ckpt.cli import main as cli_main
from ckpt.replicator.config import ReplicatorConfig
from ckpt.replicator.status import read_status
from ckpt.store._fsspec import CONNECT_TIMEOUT_S
from ckpt.store.errors import TierUnavailableError
from ckpt.store.retry import DEFAULT_POLICY
from ckpt.store.storage_options import parse_storage_options
from ckpt.store.tier import open_tier
from tests._states import save_steps

if TYPE_CHECKING:
    from tests.s3_server import S3Place

REPO = str(Path(__file__).resolve().parents[2])
URL = "s3://fail-fast/run"
RETRY_LINE = "trying again"
NOT_REPLICATED = "ckpt_versions_not_replicated"


# -- dead endpoints ---------------------------------------------------------------------------------


@pytest.fixture
def aws_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Fake credentials and no AWS config: nothing but the endpoint under test is reached."""
    env = {
        "AWS_ACCESS_KEY_ID": "AKIAFAILFASTFAKE0000",
        "AWS_SECRET_ACCESS_KEY": "fail-fast-fake-secret",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    return env


@contextlib.contextmanager
def refused() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield f"http://127.0.0.1:{port}"  # closed: nothing listens there


@contextlib.contextmanager
def blackhole() -> Iterator[str]:
    """A port whose SYNs are dropped: a listener with a backlog of 0 and one connection
    queued (never accepted) has a full accept queue, and Linux drops further SYNs."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        addr = srv.getsockname()
        with socket.create_connection(addr, timeout=5):
            with pytest.raises(TimeoutError), socket.create_connection(addr, timeout=0.5):
                pass  # the probe itself proves that a connect times out
            yield f"http://127.0.0.1:{addr[1]}"


def dead(kind: str) -> contextlib.AbstractContextManager[str]:
    return refused() if kind == "refused" else blackhole()


class Silent:
    """Accepts connections (counted) and never answers; the sockets stay open until closed."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(0.1)
        self.accepted = 0
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.srv.getsockname()[1]}"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            self.conns.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for c in self.conns:
            c.close()
        self.srv.close()


class Forbidden:
    """An S3 endpoint that answers every request (counted) with 403 AccessDenied."""

    def __init__(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _deny(self) -> None:
                owner.requests.append(f"{self.command} {self.path}")
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _deny

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()


def retry_lines(records: list[logging.LogRecord], thread: str | None = None) -> list[str]:
    return [
        r.getMessage() for r in records if RETRY_LINE in r.getMessage() and (thread is None or r.threadName == thread)
    ]


def run_cli(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`ckpt ARGS` in a subprocess (the timeout is a hang guard, not a measurement)."""
    full = {**os.environ, **env, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "ckpt.cli", *args],
        cwd=REPO,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


# -- (a) connect timeouts and the retry budget ---------------------------------------------------------


def test_s3_options_set_a_short_connect_timeout_and_keep_the_users(aws_env: dict[str, str]) -> None:
    with refused() as endpoint:
        tier: Any = open_tier(URL, {"endpoint_url": endpoint})
        config = tier.fs.config_kwargs
        assert config["connect_timeout"] == CONNECT_TIMEOUT_S <= 5
        assert config["retries"]["total_max_attempts"] == 1  # (s3fs adds its retry mode as it connects)
        own: Any = open_tier(
            URL, {"endpoint_url": endpoint, "config_kwargs": {"connect_timeout": 7, "retries": {"max_attempts": 2}}}
        )
        assert own.fs.config_kwargs["connect_timeout"] == 7
        # the user's 2 retries, as botocore counts them once it has the client: 3 attempts in all
        assert own.fs.config_kwargs["retries"]["total_max_attempts"] == 3


def test_a_decimal_timeout_on_the_command_line_is_a_number() -> None:
    options = parse_storage_options(["config_kwargs.connect_timeout=0.5", "config_kwargs.read_timeout=30"])
    assert options == {"config_kwargs": {"connect_timeout": 0.5, "read_timeout": 30}}


def test_the_policy_gives_an_endpoint_that_never_answers_few_tries() -> None:
    assert DEFAULT_POLICY.attempts == 8  # for answers that say "again" (503, 429, a cut body)
    assert DEFAULT_POLICY.no_answer_attempts == 3


@pytest.mark.parametrize("kind", ["refused", "blackhole"])
def test_a_dead_endpoint_fails_after_three_tries(
    kind: str, aws_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with dead(kind) as endpoint:
        tier = open_tier(URL, {"endpoint_url": endpoint})
        with caplog.at_level(logging.WARNING, logger="ckpt"), pytest.raises(TierUnavailableError) as caught:
            tier.listdir("")
    cause = "ConnectTimeoutError" if kind == "blackhole" else "EndpointConnectionError"
    assert cause in str(caught.value) and "3 tries" in str(caught.value)
    assert len(retry_lines(caplog.records)) == DEFAULT_POLICY.no_answer_attempts - 1


def test_an_endpoint_that_accepts_and_never_answers_gets_three_connections(
    aws_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    silent = Silent()
    try:
        options = {"endpoint_url": silent.endpoint, "config_kwargs": {"read_timeout": 1}}
        tier = open_tier(URL, options)
        with caplog.at_level(logging.WARNING, logger="ckpt"), pytest.raises(TierUnavailableError, match="Timeout"):
            tier.listdir("")
        assert silent.accepted == DEFAULT_POLICY.no_answer_attempts
    finally:
        silent.close()


@pytest.mark.parametrize("kind", ["forbidden", "no-credentials", "invalid-endpoint"])
def test_final_refusals_surface_at_once(
    kind: str, aws_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server = Forbidden()
    try:
        endpoint = server.endpoint
        if kind == "no-credentials":
            monkeypatch.delenv("AWS_ACCESS_KEY_ID")
            monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        if kind == "invalid-endpoint":
            endpoint = "127.0.0.1-no-scheme"
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            if kind == "forbidden":
                with pytest.raises(PermissionError):
                    open_tier(URL, {"endpoint_url": endpoint}).listdir("")
                assert len(server.requests) == 1, server.requests
            else:
                want = "NoCredentialsError" if kind == "no-credentials" else "Invalid endpoint"
                with pytest.raises(TierUnavailableError, match=want):
                    open_tier(URL, {"endpoint_url": endpoint}).listdir("")
                assert server.requests == []
        assert retry_lines(caplog.records) == []
    finally:
        server.close()


def test_cli_refuses_an_invalid_endpoint_in_one_line(aws_env: dict[str, str]) -> None:
    result = CliRunner().invoke(cli_main, ["ls", URL, "--storage-option", "endpoint_url=nohost"])
    assert result.exit_code == 3, result.output
    assert "Invalid endpoint" in result.output and "Traceback" not in result.output


@pytest.fixture(scope="module")
def three_versions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fail-fast") / "root"
    save_steps(root, {s: {"w": torch.full((256,), float(s))} for s in (2, 4, 6)})
    return root


@pytest.mark.parametrize("command", ["ls", "restore", "replicate"])
def test_cli_fails_fast_on_a_blackholed_endpoint(
    command: str, three_versions: Path, aws_env: dict[str, str], tmp_path: Path
) -> None:
    with blackhole() as endpoint:
        option = ["--storage-option", f"endpoint_url={endpoint}"]
        args = {
            "ls": ["ls", URL, *option],
            "restore": ["restore", URL, "--to", str(tmp_path / "out"), *option],
            "replicate": ["replicate", str(three_versions), "--once", "--to", URL, *option],
        }[command]
        done = run_cli(args, aws_env)
    assert done.returncode == 3, done.stderr
    assert "ConnectTimeoutError" in done.stderr and "Traceback" not in done.stderr
    # one operation meets the dead endpoint, with its few tries; nothing after it tries again
    assert len([line for line in done.stderr.splitlines() if RETRY_LINE in line]) == 2, done.stderr


# -- (b) close() with an unreachable remote --------------------------------------------------------------


def not_replicated() -> float | None:
    return REGISTRY.get_sample_value(NOT_REPLICATED)


@pytest.mark.parametrize("kind", ["refused", "blackhole"])
def test_close_reports_versions_not_uploaded(
    kind: str, aws_env: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    with dead(kind) as endpoint:
        with caplog.at_level(logging.INFO, logger="ckpt"):
            with Checkpointer(root, replicate_to=URL, storage_options={"endpoint_url": endpoint}) as ck:
                for step in (2, 4, 6):
                    ck.save(step, {"w": torch.full((64,), float(step))})
                ck.wait()
                before = len(caplog.records)
            closing = caplog.records[before:]
    # the final pass met the dead remote once, with its few tries, and went no further
    assert len(retry_lines(closing, threading.current_thread().name)) == DEFAULT_POLICY.no_answer_attempts - 1
    warnings = [r.getMessage() for r in closing if r.levelno == logging.WARNING and "not uploaded" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in closing]
    assert f"3 versions not uploaded to {URL}: steps 2, 4, 6" in warnings[0]
    assert not_replicated() == 3

    status = read_status(str(root))
    assert status is not None and sorted(status.versions) == [2, 4, 6]
    assert all(v.remote is not None and v.remote.state == "failed" for v in status.versions.values())

    listed = CliRunner().invoke(cli_main, ["ls", str(root), "--json"])
    assert listed.exit_code == 0, listed.output
    assert [row["remote"]["state"] for row in json.loads(listed.output)] == ["failed"] * 3
    table = CliRunner().invoke(cli_main, ["ls", str(root)])
    assert sum(" failed" in line for line in table.output.splitlines()) == 3, table.output


def test_the_final_pass_ends_at_its_deadline(s3: S3Place, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A remote that answers, but slowly (a 20 KB/s cap, 1 MiB to send): the last pass stops
    after drain_timeout_s; what it did not upload is reported, and a later run finishes it."""
    root = tmp_path / "root"
    config = ReplicatorConfig(
        remote=s3.url, storage_options=s3.options, bwlimit_mbps=0.02, drain_timeout_s=0.5, interval_s=60
    )
    with caplog.at_level(logging.INFO, logger="ckpt"):
        with Checkpointer(root, replication=config) as ck:
            ck.save(1, {"w": torch.randn(1 << 18)})
            ck.wait()
            before = len(caplog.records)
        closing = caplog.records[before:]
    warnings = [r.getMessage() for r in closing if "not uploaded" in r.getMessage()]
    assert len(warnings) == 1 and f"1 version not uploaded to {s3.url}: step 1" in warnings[0], warnings
    assert not_replicated() == 1
    status = read_status(str(root))
    assert status is not None and status.versions[1].remote is not None
    assert status.versions[1].remote.state == "pending"
    assert not any(k.endswith("manifest.json") for k in s3.objects())

    with Checkpointer(root, replication=ReplicatorConfig(remote=s3.url, storage_options=s3.options)):
        pass
    done = read_status(str(root))
    assert done is not None and done.versions[1].remote is not None and done.versions[1].remote.state == "verified"
    assert not_replicated() == 0


def test_drain_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="drain_timeout_s"):
        ReplicatorConfig(drain_timeout_s=0)


@pytest.mark.parametrize(
    "option",
    ["region_nam=us-east-1", "client_kwargs=3", "profile=no-such-profile", "config_kwargs.s3.addressing_style=x"],
)
@pytest.mark.parametrize("command", [["ls"], ["verify"], ["gc", "--keep-last", "1"]])
def test_a_misspelled_storage_option_is_one_line_and_exit_3(s3: S3Place, option: str, command: list[str]) -> None:
    """Before, s3fs built its client on the first request, and a misspelled option came out
    of it as a TypeError: an 80-line traceback and exit code 1, the code of damage."""
    args = [command[0], s3.url, *command[1:], *s3.cli_options, "--storage-option", option]
    out = CliRunner().invoke(cli_main, args)
    assert out.exit_code == 3, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit), out.exception
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and "cannot open" in lines[0], out.output
