"""The one retry policy: which failures may pass if tried again, and how long to keep trying.

Transient, by type: dropped or refused connections, timeouts, a cut or corrupted
response body (aiohttp, botocore), HTTP 5xx and throttling (S3 SlowDown, 429), and the
EAGAIN/EINTR class of I/O errors. Anything else is final at once and surfaces as itself:
a missing object (FileNotFoundError), refused access (a 403: PermissionError), a bug
(TypeError), ckpt's own verdicts (CkptError). s3fs turns S3 error responses into
OSErrors whose `__cause__` is botocore's ClientError, so the HTTP status and the error
code are read from there, never from the message text.

A transient failure that outlasts the policy becomes TierUnavailableError. A request the
endpoint never answered (refused, a connect or read timeout, an unknown host) gets fewer
tries than one it answered with "again" (503, 429, a cut body): a dead or blackholed
endpoint does not come back within the backoff, and each of its tries costs a timeout.
"""

from __future__ import annotations

import errno
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.client import HTTPException  # IncompleteRead, RemoteDisconnected
from typing import Any, TypeVar

from ckpt.store.errors import CkptError, StoppedError, TierUnavailableError

__all__ = ["RetryPolicy", "is_transient", "is_unanswered", "retry"]

log = logging.getLogger("ckpt")
T = TypeVar("T")

_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EINTR,
        errno.EBUSY,  # s3fs: 503 SlowDown, 409 OperationAborted
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.EPIPE,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EHOSTUNREACH,
        getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: 500 InternalError
    }
)
_THROTTLING = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)


def _backend_transient_types() -> tuple[type[BaseException], ...]:
    """Exception types of the HTTP stacks under fsspec that mean a failed exchange, not an
    answer. Read from modules already imported: an error cannot come from a stack that
    was never loaded, and a local-only job pays nothing for them."""
    found: list[type[BaseException]] = []
    bc = sys.modules.get("botocore.exceptions")
    if bc is not None:
        for name in (
            "ConnectionError",  # botocore's: endpoint unreachable, connect timeout, proxy
            "HTTPClientError",  # connection closed, read timeout
            "IncompleteReadError",
            "ResponseStreamingError",
            "ChecksumError",
            "FlexibleChecksumError",
        ):
            found += [getattr(bc, name)] if isinstance(getattr(bc, name, None), type) else []
    parsers = sys.modules.get("botocore.parsers")
    if parsers is not None and isinstance(getattr(parsers, "ResponseParserError", None), type):
        found.append(parsers.ResponseParserError)  # a garbled answer
    aio = sys.modules.get("aiohttp")
    if aio is not None:
        found += [aio.ClientConnectionError, aio.ClientPayloadError]
    return tuple(found)


_NO_ANSWER_ERRNOS = frozenset(
    {errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN}
)


def _backend_unanswered_types() -> tuple[type[BaseException], ...]:
    """The backends' types for a request that got no answer at all: no connection (refused,
    connect timeout, unknown host, proxy or TLS failure) or no reply within the read timeout."""
    found: list[type[BaseException]] = []
    bc = sys.modules.get("botocore.exceptions")
    if bc is not None:
        # botocore's ConnectionError: EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError, SSLError
        found += [
            t
            for t in (getattr(bc, "ConnectionError", None), getattr(bc, "ReadTimeoutError", None))
            if isinstance(t, type)
        ]
    aio = sys.modules.get("aiohttp")
    if aio is not None:
        found.append(aio.ClientConnectorError)
    return tuple(found)


def is_unanswered(e: BaseException) -> bool:
    """Whether `e` (or an error it was raised from) is a request the endpoint never answered."""
    backend = _backend_unanswered_types()
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (ConnectionRefusedError, TimeoutError)) or isinstance(cur, backend):
            return True
        if isinstance(cur, OSError) and cur.errno in _NO_ANSWER_ERRNOS:
            return True
        cur = cur.__cause__
    return False


def _http_status(e: BaseException) -> tuple[int, str] | None:
    """(status, code) of a botocore ClientError (`response` is its documented structured answer)."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code", "")
    return (status if isinstance(status, int) else 0), str(code)


def is_transient(e: BaseException) -> bool:
    """Whether the failure may pass if the operation is tried again."""
    if isinstance(e, (CkptError, FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    backend = _backend_transient_types()
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:  # s3fs keeps botocore's error as the cause
        seen.add(id(cur))
        if isinstance(cur, (ConnectionError, TimeoutError, HTTPException)) or isinstance(cur, backend):
            return True
        answer = _http_status(cur)
        if answer is not None:
            status, code = answer
            return status >= 500 or status == 429 or code in _THROTTLING
        if isinstance(cur, OSError) and cur.errno in _TRANSIENT_ERRNOS:
            return True
        cur = cur.__cause__
    return False


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often a transient failure is tried again, with exponential backoff between tries."""

    attempts: int = 8
    """Tries in all (1: no retry). With the defaults the waits add up to about 16 s. The
    fsspec tier switches the backend's own retries off: this is the one policy."""
    no_answer_attempts: int = 3
    """Of those, the most that may go unanswered (is_unanswered: refused, connect or read
    timeout, unknown host) before the endpoint is given up: a refused endpoint fails in
    under a second, a blackholed one in 3 connect timeouts (the S3 tier's: 2 s each) plus
    0.6 s of waits, where the full budget took a minute."""
    first_wait_s: float = 0.2
    max_wait_s: float = 5.0
    stop: threading.Event | None = field(default=None, compare=False)
    """Set: the waits end at once and StoppedError is raised (a replicator shutting down)."""

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.first_wait_s < 0 or self.max_wait_s < self.first_wait_s:
            raise ValueError("RetryPolicy needs attempts >= 1 and 0 <= first_wait_s <= max_wait_s")
        if self.no_answer_attempts < 1:
            raise ValueError("RetryPolicy needs no_answer_attempts >= 1")


DEFAULT_POLICY = RetryPolicy()


def retry(
    fn: Callable[[], T],
    what: str,
    policy: RetryPolicy = DEFAULT_POLICY,
    *,
    describe: Callable[[BaseException], str] = lambda e: f"{type(e).__name__}: {e}",
) -> T:
    """fn(), tried again while it fails transiently; a final failure is raised as itself,
    a transient one that outlasts the policy as TierUnavailableError(`what`: cause).
    `describe` renders an error for messages (the fsspec tier scrubs credentials there)."""
    wait = policy.first_wait_s
    unanswered = 0
    for attempt in range(policy.attempts):
        if policy.stop is not None and policy.stop.is_set():
            raise StoppedError(f"stopped before {what}")
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise
            cause: Any = describe(e)
            unanswered += is_unanswered(e)
            if attempt == policy.attempts - 1 or unanswered == policy.no_answer_attempts:
                err = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
                tries = "1 try" if attempt == 0 else f"{attempt + 1} tries"
                raise TierUnavailableError(err, f"{what}: {cause} ({tries})") from None
            log.warning("%s failed (%s); trying again in %.1fs", what, str(cause)[:200], wait)
            if policy.stop is not None:
                if policy.stop.wait(wait):
                    raise StoppedError(f"stopped while retrying {what}") from None
            else:
                time.sleep(wait)
            wait = min(wait * 2, policy.max_wait_s)
    raise AssertionError("unreachable")
