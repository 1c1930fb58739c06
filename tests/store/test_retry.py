"""The one retry policy (ckpt.store.retry): only transient failures are tried again, by type;
a bug or a refusal surfaces at once as itself. The errors are the real types the stacks
under fsspec raise (botocore, aiohttp, s3fs's translation), built as those stacks build them."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable

import aiohttp
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError
from s3fs.errors import translate_boto_error

from ckpt.store.errors import StoppedError, TierUnavailableError, VersionNotFoundError
from ckpt.store.retry import RetryPolicy, is_transient, retry

FAST = RetryPolicy(attempts=3, first_wait_s=0.0, max_wait_s=0.0)


def _client_error(status: int, code: str) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


def _failing(error: Callable[[], BaseException], then: object = None, times: int = 10**9) -> Callable[[], object]:
    calls = {"n": 0}

    def fn() -> object:
        calls["n"] += 1
        if calls["n"] <= times:
            raise error()
        return then

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


@pytest.mark.parametrize(
    "make",
    [
        lambda: translate_boto_error(_client_error(503, "SlowDown")),  # OSError(EBUSY), cause ClientError
        lambda: translate_boto_error(_client_error(500, "InternalError")),
        lambda: translate_boto_error(_client_error(429, "TooManyRequests")),
        lambda: EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        lambda: ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
        lambda: aiohttp.ClientPayloadError("Response payload is not completed"),
        lambda: ConnectionResetError(errno.ECONNRESET, "reset"),
        lambda: TimeoutError("timed out"),
        lambda: OSError(errno.EAGAIN, "try again"),
    ],
    ids=["503-slowdown", "500", "429", "endpoint", "read-timeout", "cut-body", "reset", "timeout", "eagain"],
)
def test_transient_failures_are_retried_then_become_tier_unavailable(make: Callable[[], BaseException]) -> None:
    assert is_transient(make())
    fn = _failing(make, then="ok", times=2)
    assert retry(fn, "read x", FAST) == "ok" and fn.calls["n"] == 3  # type: ignore[attr-defined]
    always = _failing(make)
    with pytest.raises(TierUnavailableError, match="read x"):
        retry(always, "read x", FAST)
    assert always.calls["n"] == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "make, kind",
    [
        (lambda: TypeError("a bug"), TypeError),
        (lambda: translate_boto_error(_client_error(403, "AccessDenied")), PermissionError),
        (lambda: translate_boto_error(_client_error(404, "NoSuchKey")), FileNotFoundError),
        (lambda: translate_boto_error(_client_error(400, "InvalidArgument")), OSError),
        (lambda: OSError(errno.EIO, "bad sector"), OSError),
        (lambda: VersionNotFoundError("step 3"), VersionNotFoundError),
    ],
    ids=["type-error", "403", "404", "400", "eio", "ckpt-error"],
)
def test_final_failures_surface_at_once_as_themselves(make: Callable[[], BaseException], kind: type) -> None:
    assert not is_transient(make())
    fn = _failing(make)
    with pytest.raises(kind) as caught:
        retry(fn, "read x", FAST)
    assert type(caught.value) is type(make()) and fn.calls["n"] == 1  # type: ignore[attr-defined]


def test_a_stop_ends_the_waits() -> None:
    stop = threading.Event()
    fn = _failing(lambda: ConnectionResetError(errno.ECONNRESET, "reset"))
    policy = RetryPolicy(attempts=50, first_wait_s=30.0, max_wait_s=30.0, stop=stop)
    threading.Timer(0.1, stop.set).start()
    with pytest.raises(StoppedError):
        retry(fn, "upload", policy)
    assert fn.calls["n"] == 1  # type: ignore[attr-defined]
