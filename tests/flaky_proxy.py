"""A fault-injecting HTTP/1.1 proxy for tests: put it in front of a real S3 endpoint (the
moto server) and point s3fs's `endpoint_url` at it, exactly as production points it at S3.

Every request is forwarded unchanged (keep-alive connections from the client, request
bodies framed by Content-Length or `Transfer-Encoding: chunked` relayed byte for byte,
`Expect: 100-continue` answered by the proxy), except that, with probability `rate`
(seeded RNG), one fault is injected instead:

- `drop`: the connection is closed without an answer, either before the request reaches
  the server or after the server applied it (the client cannot tell which);
- `error500`: `500 InternalError` with an S3 XML error body; the request is not applied;
- `slowdown503`: `503 SlowDown` with an S3 XML error body; the request is not applied;
- `stall`: the server applies the request, then nothing (or the headers and half the
  body) reaches the client for `stall_s` seconds, longer than the client's read timeout;
  then the connection is closed;
- `slow`: the answer arrives complete and correct, trickled over up to `slow_s` seconds;
- `truncate`: the headers with the full Content-Length, a part of the body, then the
  connection closes (an answer without a body is cut in its headers);
- `corrupt` (weight 0 unless asked for): one bit of the body flipped, length unchanged,
  the connection kept; answers without a body are passed through untouched;
- `delete_errors` (weight 0 unless asked for): a DeleteObjects request (`POST ...?delete`)
  is not applied, and `200 OK` answers it with an `InternalError` for every key, as S3
  reports per-key failures of a batch delete; other requests are passed through untouched.

`faults()` counts the faults actually injected, per kind, so a test can assert that each
kind really happened. `only` (a regex on "METHOD /path?query") limits faults to some
requests, `scope` one kind to some requests (e.g. corrupt only chunk downloads), and
`max_faults` their number.

`opaque_etags = True` (not a fault: a store's behaviour) answers every upload (PUT, and the
POST that completes a multipart upload) with ETags that are no MD5 of the bytes, as S3
does under SSE-KMS or SSE-C encryption. Responses are buffered (chunked ones re-framed with a
Content-Length) so a fault can cut or flip at any byte; request bodies are streamed.

In-process: `with FlakyProxy(upstream_port, FaultPlan(rate=0.2, seed=1)) as proxy: ...`
(an asyncio loop in a daemon thread). As a subprocess: `python tests/flaky_proxy.py
--upstream http://127.0.0.1:PORT --rate 0.2 --seed 1 --counts-file F`; it prints its
endpoint on the first line of stdout, rewrites F (JSON fault counts) as they change,
and exits 0 on SIGTERM (`ProxyProcess` wraps this).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["KINDS", "FaultPlan", "FlakyProxy", "ProxyProcess"]

KINDS = ("drop", "error500", "slowdown503", "stall", "slow", "truncate", "corrupt", "delete_errors")
_ASKED_FOR = {"corrupt", "delete_errors"}  # kinds of weight 0 unless a plan asks for them
_DEFAULT_WEIGHTS = {k: (0.0 if k in _ASKED_FOR else 1.0) for k in KINDS}
_HEAD_LIMIT = 1 << 20
_PIECE = 1 << 16
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "upgrade", "expect"}

_ERROR_BODIES = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    rate: float = 0.0
    """Probability that a (matching) request gets a fault instead of a clean answer."""
    seed: int = 0
    """Seed of the RNG that decides which requests get which fault, where a body is cut, ..."""
    weights: Mapping[str, float] = field(default_factory=lambda: dict(_DEFAULT_WEIGHTS))
    """Relative weight of each kind in KINDS (missing kinds: 0)."""
    stall_s: float = 3.0
    """How long a stalled answer hangs before the connection closes: more than the client's read timeout."""
    slow_s: float = 0.3
    """The most a slow answer is spread over: less than the client's read timeout."""
    only: str | None = None
    """A regex searched in "METHOD /path?query": only matching requests get faults."""
    max_faults: int | None = None
    """Stop injecting after this many faults (None: no limit): e.g. exactly the first download fails."""
    scope: Mapping[str, str] = field(default_factory=dict)
    """kind -> regex as for `only`: that kind is injected only into matching requests (the
    other kinds share its weight elsewhere)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError("rate must be in [0, 1]")
        unknown = set(self.weights) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {KINDS}")
        if any(w < 0 for w in self.weights.values()) or (self.rate > 0 and not any(self.weights.values())):
            raise ValueError("weights must be >= 0 and not all 0")
        if set(self.scope) - set(KINDS):
            raise ValueError(f"unknown fault kinds in scope: {sorted(set(self.scope) - set(KINDS))}")
        if self.max_faults is not None and self.max_faults < 0:
            raise ValueError("max_faults must be >= 0")
        if self.stall_s < 0 or self.slow_s < 0:
            raise ValueError("stall_s and slow_s must be >= 0")


class _Closed(Exception):
    """The client went away (or a fault closed the connection): end this connection."""


@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def chunked(self) -> bool:
        return "chunked" in (self.header("transfer-encoding") or "").lower()

    @property
    def keep_alive(self) -> bool:
        conn = (self.header("connection") or "").lower()
        return "keep-alive" in conn if self.version == "HTTP/1.0" else "close" not in conn


def _parse_head(raw: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = raw.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers.append((k.strip(), v.strip()))
    return lines[0], headers


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    """One message head (through the blank line), or None at a clean end of stream."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial.strip():
            raise _Closed("truncated head") from None
        return None
    except (asyncio.LimitOverrunError, ConnectionError) as e:
        raise _Closed(str(e)) from None


async def _relay_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None) -> bytes:
    """Read one chunked body (chunks, last chunk, trailers); relay its bytes verbatim to
    `writer` as they come (if given); return the decoded payload."""
    payload = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if writer is not None:
            writer.write(size_line)
        if size == 0:
            while True:  # trailers, then the blank line
                line = await reader.readuntil(b"\r\n")
                if writer is not None:
                    writer.write(line)
                if line == b"\r\n":
                    break
            if writer is not None:
                await writer.drain()
            return bytes(payload)
        data = await reader.readexactly(size + 2)
        payload += data[:-2]
        if writer is not None:
            writer.write(data)
            await writer.drain()


async def _relay_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, n: int) -> None:
    while n > 0:
        data = await reader.read(min(n, _PIECE))
        if not data:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(data)
        if writer is not None:
            writer.write(data)
            await writer.drain()


_ETAG_XML = re.compile(rb"<ETag>(.*?)</ETag>", re.S)
_KEY_XML = re.compile(rb"<Key>(.*?)</Key>", re.S)


class FlakyProxy:
    """The proxy, run by an asyncio loop in a daemon thread of this process."""

    def __init__(
        self, upstream_port: int, plan: FaultPlan | None = None, *, upstream_host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._plan = plan or FaultPlan()
        self._rng = random.Random(self._plan.seed)
        self._only = re.compile(self._plan.only) if self._plan.only else None
        self._scope = {k: re.compile(v) for k, v in self._plan.scope.items()}
        self._lock = threading.Lock()
        self._faults: Counter[str] = Counter()
        self._requests = 0
        self._decided = 0  # faults chosen since the plan was set (for max_faults)
        self._want_port = port
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.on_change: Any = None  # called (no arguments, in the proxy's thread) after each fault
        self.opaque_etags = False  # uploads answered with ETags that are no MD5 (module docstring)
        self._etags: dict[bytes, bytes] = {}  # opaque ETag -> the server's, for CompleteMultipartUpload

    # -- control, from any thread -----------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    def set_plan(self, plan: FaultPlan | None = None, **changes: Any) -> None:
        """Replace the plan (or some of its fields, e.g. rate=0); the RNG is reseeded."""
        new = replace(plan or self._plan, **changes)
        with self._lock:
            self._plan = new
            self._rng = random.Random(new.seed)
            self._only = re.compile(new.only) if new.only else None
            self._scope = {k: re.compile(v) for k, v in new.scope.items()}
            self._decided = 0

    def faults(self) -> dict[str, int]:
        """Faults injected so far, per kind (kinds never injected are absent)."""
        with self._lock:
            return dict(self._faults)

    @property
    def requests(self) -> int:
        with self._lock:
            return self._requests

    def reset_counts(self) -> None:
        with self._lock:
            self._faults.clear()
            self._requests = 0

    def start(self) -> FlakyProxy:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._serve, "127.0.0.1", self._want_port, limit=_HEAD_LIMIT)
                )
                self.port = int(self._server.sockets[0].getsockname()[1])
            except BaseException as e:  # noqa: BLE001 - reported to start()
                errors.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=run, name="flaky-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop = self._thread = None

    def __enter__(self) -> FlakyProxy:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- the proxy, in the loop's thread ------------------------------------------------------------

    def _decide(self, req: _Request) -> tuple[str | None, random.Random]:
        with self._lock:
            self._requests += 1
            plan, rng = self._plan, self._rng
            line = f"{req.method} {req.target}"
            if self._only is not None and not self._only.search(line):
                return None, rng
            kinds = [
                k for k in KINDS if plan.weights.get(k, 0) > 0 and (k not in self._scope or self._scope[k].search(line))
            ]
            if plan.max_faults is not None and self._decided >= plan.max_faults:
                return None, rng
            if not kinds or plan.rate <= 0 or rng.random() >= plan.rate:
                return None, rng
            self._decided += 1
            return rng.choices(kinds, [plan.weights[k] for k in kinds])[0], rng

    def _count(self, kind: str) -> None:
        with self._lock:
            self._faults[kind] += 1
        if self.on_change is not None:
            self.on_change()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                raw = await _read_head(reader)
                if raw is None:
                    break
                line, headers = _parse_head(raw)
                method, target, version = line.split(" ", 2)
                req = _Request(method, target, version, headers)
                if not await self._one(req, reader, writer) or not req.keep_alive:
                    break
        except (_Closed, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            writer.transport.abort()
            self._tasks.discard(task)

    async def _one(self, req: _Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the client connection must be closed."""
        kind, rng = self._decide(req)
        if (req.header("expect") or "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        length = int(req.header("content-length") or 0)
        if kind == "drop" and rng.random() < 0.5:  # before the request reaches the server
            self._count("drop")
            return False
        if kind in ("error500", "slowdown503"):  # the server never sees the request
            if req.chunked:
                await _relay_chunked(reader, None)
            else:
                await _relay_exact(reader, None, length)
            self._count(kind)
            await self._send_error(writer, req, 500 if kind == "error500" else 503)
            return True
        if kind == "delete_errors" and req.method == "POST" and re.search(r"\?delete(=|&|$)", req.target):
            body = await _relay_chunked(reader, None) if req.chunked else await reader.readexactly(length)
            self._count(kind)
            await self._send_delete_errors(writer, req, _KEY_XML.findall(body))
            return True

        sent = None
        if self.opaque_etags and req.method == "POST" and not req.chunked and "uploadId=" in req.target:
            # CompleteMultipartUpload names its parts by the (opaque) ETags the client was given
            sent = _ETAG_XML.sub(
                lambda m: b"<ETag>" + self._etags.get(m[1], m[1]) + b"</ETag>", await reader.readexactly(length)
            )
        status_line, headers, body = await self._forward(req, reader, writer, sent)
        if self.opaque_etags and req.method in ("PUT", "POST"):
            headers = [(k, self._opaque(v)) if k.lower() == "etag" else (k, v) for k, v in headers]
            if body is not None:
                body = _ETAG_XML.sub(lambda m: b"<ETag>" + self._opaque(m[1].decode()).encode() + b"</ETag>", body)
        has_body = req.method != "HEAD" and body is not None
        if kind == "drop":  # applied by the server, the answer lost
            self._count("drop")
            return False
        head = self._head(status_line, headers, None if body is None else len(body), req.keep_alive)
        data = body if has_body and body is not None else b""
        if kind == "truncate":  # cut in the body if there is one, else in the headers
            self._count("truncate")
            writer.write(head + data[: rng.randrange(len(data))] if data else head[: rng.randrange(1, len(head) - 1)])
            await writer.drain()
            return False
        if kind == "stall":
            self._count("stall")
            if data and rng.random() < 0.5:  # the headers and half the body, then nothing
                writer.write(head + data[: len(data) // 2])
                await writer.drain()
            await asyncio.sleep(self._plan.stall_s)
            return False
        if kind == "corrupt" and data:
            self._count("corrupt")
            flipped = bytearray(data)
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            data = bytes(flipped)
        if kind == "slow":
            self._count("slow")
            step = len(data) // 4 + 1
            pieces = [data[i : i + step] for i in range(0, len(data), step)]
            delays = [rng.uniform(0, self._plan.slow_s / (len(pieces) + 1)) for _ in range(len(pieces) + 1)]
            await asyncio.sleep(delays[0])
            writer.write(head)
            await writer.drain()
            for piece, delay in zip(pieces, delays[1:]):
                await asyncio.sleep(delay)
                writer.write(piece)
                await writer.drain()
            return True
        writer.write(head + data)
        await writer.drain()
        return True

    def _opaque(self, etag: str) -> str:
        """An ETag as an encrypting store gives it: 32 hex digits, but not the bytes' MD5."""
        out = '"' + hashlib.sha256(etag.encode()).hexdigest()[:32] + '"'
        self._etags[out.encode()] = etag.encode()
        return out

    async def _forward(
        self, req: _Request, reader: asyncio.StreamReader, client: asyncio.StreamWriter, body: bytes | None = None
    ) -> tuple[str, list[tuple[str, str]], bytes | None]:
        """Send the request to the server (one connection per request), streaming its body
        (or sending `body` in its place); return the server's answer: status line, headers,
        body (None: no body)."""
        up_reader, up_writer = await asyncio.open_connection(*self.upstream, limit=_HEAD_LIMIT)
        try:
            head = [f"{req.method} {req.target} {req.version}"]
            skip = _HOP_BY_HOP | ({"content-length"} if body is not None else set())
            head += [f"{k}: {v}" for k, v in req.headers if k.lower() not in skip]
            if body is not None:
                head.append(f"Content-Length: {len(body)}")
            head.append("Connection: close")
            up_writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
            if body is not None:
                up_writer.write(body)
            elif req.chunked:
                await _relay_chunked(reader, up_writer)
            else:
                await _relay_exact(reader, up_writer, int(req.header("content-length") or 0))
            await up_writer.drain()
            while True:
                raw = await _read_head(up_reader)
                if raw is None:
                    raise _Closed("the server closed without an answer")
                status_line, headers = _parse_head(raw)
                status = int(status_line.split(" ", 2)[1])
                if status >= 200:
                    break  # 1xx: interim answers are not relayed (the proxy answered Expect itself)
            names = {k.lower(): v for k, v in headers}
            if req.method == "HEAD" or status in (204, 304):
                body: bytes | None = None
            elif "chunked" in names.get("transfer-encoding", "").lower():
                body = await _relay_chunked(up_reader, None)
            elif "content-length" in names:
                body = await up_reader.readexactly(int(names["content-length"]))
            else:
                body = await up_reader.read()
            return status_line, headers, body
        finally:
            up_writer.transport.abort()

    @staticmethod
    def _head(status_line: str, headers: list[tuple[str, str]], length: int | None, keep_alive: bool) -> bytes:
        skip = _HOP_BY_HOP | {"transfer-encoding"} | ({"content-length"} if length is not None else set())
        lines = [status_line] + [f"{k}: {v}" for k, v in headers if k.lower() not in skip]
        if length is not None:
            lines.append(f"Content-Length: {length}")
        lines.append("Connection: " + ("keep-alive" if keep_alive else "close"))
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    @staticmethod
    async def _send_delete_errors(writer: asyncio.StreamWriter, req: _Request, keys: list[bytes]) -> None:
        errors = "".join(
            f"<Error><Key>{k.decode()}</Key><Code>InternalError</Code>"
            "<Message>We encountered an internal error. Please try again.</Message></Error>"
            for k in keys
        )
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f'<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{errors}</DeleteResult>'
        ).encode()
        head = (
            f"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"Connection: {'keep-alive' if req.keep_alive else 'close'}\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + body)
        await writer.drain()

    @staticmethod
    async def _send_error(writer: asyncio.StreamWriter, req: _Request, status: int) -> None:
        code, message = _ERROR_BODIES[status]
        request_id = uuid.uuid4().hex[:16].upper()
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<RequestId>{request_id}</RequestId><HostId>flaky-proxy</HostId></Error>"
        ).encode()
        reason = "Internal Server Error" if status == 500 else "Slow Down"
        payload = b"" if req.method == "HEAD" else body
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nx-amz-request-id: {request_id}\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: {'keep-alive' if req.keep_alive else 'close'}\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + payload)
        await writer.drain()


# -- as a subprocess ----------------------------------------------------------------------------------


class ProxyProcess:
    """`python tests/flaky_proxy.py ...` in a subprocess: its endpoint, its fault counts, stop()."""

    def __init__(self, upstream_port: int, plan: FaultPlan, workdir: Path) -> None:
        self.counts_file = workdir / f"flaky-proxy-{uuid.uuid4().hex[:8]}.json"
        args = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--upstream",
            f"http://127.0.0.1:{upstream_port}",
            "--rate",
            str(plan.rate),
            "--seed",
            str(plan.seed),
            "--stall-s",
            str(plan.stall_s),
            "--slow-s",
            str(plan.slow_s),
            "--weights",
            ",".join(f"{k}={w}" for k, w in plan.weights.items()),
            "--counts-file",
            str(self.counts_file),
        ]
        if plan.only:
            args += ["--only", plan.only]
        if plan.max_faults is not None:
            args += ["--max-faults", str(plan.max_faults)]
        for kind, regex in plan.scope.items():
            args += ["--scope", f"{kind}={regex}"]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("http://"):
            self.proc.kill()
            raise RuntimeError(f"flaky proxy did not start: {line!r}")
        self.endpoint = line

    def faults(self) -> dict[str, int]:
        try:
            doc = json.loads(self.counts_file.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): int(v) for k, v in doc.get("faults", {}).items()}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return int(self.proc.returncode)

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A fault-injecting HTTP/1.1 proxy (see the module docstring).")
    ap.add_argument("--upstream", required=True, help="http://HOST:PORT of the real server")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stall-s", type=float, default=3.0)
    ap.add_argument("--slow-s", type=float, default=0.3)
    ap.add_argument(
        "--weights", default="", help="kind=weight,... (default: every kind but corrupt and delete_errors, equally)"
    )
    ap.add_argument("--only", default=None)
    ap.add_argument("--max-faults", type=int, default=None)
    ap.add_argument("--scope", action="append", default=[], help="kind=regex (repeatable)")
    ap.add_argument("--counts-file", default=None)
    a = ap.parse_args(argv)
    m = re.fullmatch(r"http://([^:/]+):(\d+)/?", a.upstream)
    if not m:
        ap.error("--upstream must be http://HOST:PORT")
    weights = dict(_DEFAULT_WEIGHTS)
    if a.weights:
        weights = {k: 0.0 for k in KINDS}
        for pair in a.weights.split(","):
            k, _, w = pair.partition("=")
            weights[k.strip()] = float(w)
    scope = dict(pair.split("=", 1) for pair in a.scope)
    plan = FaultPlan(
        rate=a.rate,
        seed=a.seed,
        weights=weights,
        stall_s=a.stall_s,
        slow_s=a.slow_s,
        only=a.only,
        scope=scope,
        max_faults=a.max_faults,
    )
    proxy = FlakyProxy(int(m.group(2)), plan, upstream_host=m.group(1), port=a.port)
    counts_lock = threading.Lock()

    def write_counts() -> None:
        # Called from the proxy's thread on every change and from the loop below: one at a
        # time, or one rename finds the shared tmp file already renamed by the other.
        if a.counts_file:
            with counts_lock:
                tmp = f"{a.counts_file}.tmp-{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump({"faults": proxy.faults(), "requests": proxy.requests}, f)
                os.replace(tmp, a.counts_file)

    proxy.on_change = write_counts
    # No handler: SIGTERM and SIGINT are blocked (in the proxy's thread too, which inherits
    # the mask) and taken here by sigtimedwait. A handler that sets an Event deadlocks where
    # this thread was interrupted inside that Event's own lock (see replicator/daemon.py).
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    with proxy:
        write_counts()
        print(proxy.endpoint, flush=True)
        while signal.sigtimedwait(stop_signals, 0.5) is None:
            write_counts()
        write_counts()
    with contextlib.suppress(OSError):
        sys.stdout.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
