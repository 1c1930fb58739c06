"""`FsspecTier`: a prefix on any filesystem fsspec reaches (S3 through s3fs, GCS, ...).

Object stores have no rename: `capabilities.atomic_rename` is False, so versions are
committed by a create-only manifest and deleted under a `.deleting` marker (store.versions).
Every call goes through store.retry's one policy; backend errors are classified by type
there, and every message is scrubbed of credentials (store.storage_options.redact).
fsspec filesystems cache listings per instance, and instances are shared process-wide:
every listing here drops that cache first, so versions committed or deleted since are seen.

The retries of the layers below (s3fs's, botocore's) are switched off where the user's
options do not set them: stacked, each of ckpt's tries became 5 of s3fs's, each of them 5
of botocore's, and one object answering 503 held a GC for minutes (measured: 218 s).
The connect timeout is CONNECT_TIMEOUT_S (s3fs's own is 5 s) where the options set none:
with the retry policy's 3 unanswered tries, a blackholed endpoint fails `ckpt ls` in about
7 s (measured before: 58 s, 8 tries of 5 s plus 16 s of waits). An endpoint_url botocore
would refuse is refused when the tier is opened, as TierUnavailableError.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import fsspec

from ckpt.store.errors import CkptError, TierUnavailableError
from ckpt.store.retry import DEFAULT_POLICY, RetryPolicy, retry
from ckpt.store.storage_options import redact
from ckpt.store.tier import Capabilities, ObjectInfo, Tier, join_key

__all__ = ["CONNECT_TIMEOUT_S", "FsspecTier"]

CONNECT_TIMEOUT_S = 2
"""botocore's connect timeout on S3 where the options set none (`config_kwargs.connect_timeout`):
as the AWS SDK for Java's default, far above a connect to a live endpoint (TCP and TLS)."""

T = TypeVar("T")
_MULTIPART = 16 << 20  # s3fs part size: objects of 32 MiB and more go up as multipart uploads
_BACKENDS = frozenset({"botocore", "aiobotocore", "boto3", "s3fs", "aiohttp", "gcsfs", "google", "adlfs", "azure"})
_CAPABILITIES = Capabilities(atomic_rename=False, range_reads=True, direct_io=False, local_files=False)
_SHARED = Capabilities(atomic_rename=False, range_reads=True, direct_io=False, local_files=False, shared=True)
# A store in this process's memory, or this machine's filesystem, is not another rank's.
_PRIVATE_PROTOCOLS = frozenset({"memory", "file", "local"})


READAHEAD = 32 << 20  # one GET brings this much: readers ask for 1 MiB pieces in order


class _RangeHandle:
    """Range reads of one object. Readers go through a chunk in small pieces, in order; each
    GET fetches up to READAHEAD bytes from the first one asked for, so the following pieces
    are served from memory (one request per READAHEAD, not one per piece)."""

    def __init__(self, tier: FsspecTier, path: str, size: int) -> None:
        self._tier, self._path, self.size = tier, path, size
        self._buf, self._at = b"", 0  # bytes [_at, _at + len(_buf)) of the object

    def read_into(self, offset: int, out: memoryview) -> None:
        view = out.cast("B")
        end = offset + len(view)
        if end > self.size:
            raise EOFError(f"{self._path} ends at {self.size}, before {end}")
        if not view:
            return
        if not (self._at <= offset and end <= self._at + len(self._buf)):
            stop = min(self.size, max(end, offset + READAHEAD))
            # keywords: s3fs's cat_file takes version_id second
            data = self._tier._call(
                f"read {self._path}", lambda: self._tier.fs.cat_file(self._path, start=offset, end=stop)
            )
            if len(data) != stop - offset:
                raise EOFError(f"{self._path}: {len(data)} bytes at {offset}, wanted {stop - offset}")
            self._buf, self._at = data, offset
        start = offset - self._at
        view[:] = self._buf[start : start + len(view)]

    def read_shared(self, offset: int, out: memoryview) -> None:
        self.read_into(offset, out)

    def read_direct(self, offset: int, out: memoryview) -> int:
        n = max(0, min(len(out), self.size - offset))
        self.read_into(offset, out[:n])
        return n

    def close(self) -> None:
        self._buf = b""


class _Md5Parts:
    """The MD5s of the bytes fed here as S3 gives them in its answers: of them all (one PUT),
    or of each part of a multipart upload. Parts follow s3fs's buffer: its file sends what
    it holds once that reaches the block size (`fixed`: exactly that many bytes per part),
    and the rest at close. A guess that s3fs ever breaks only costs a read back: a
    mismatch is never taken for a good copy."""

    def __init__(self, multipart: bool, fixed: int | None) -> None:
        self._multipart = multipart
        self._fixed = fixed
        self._parts: list[bytes] = []
        self._md5 = hashlib.md5(usedforsecurity=False)
        self._held = 0  # bytes of the part being filled

    def update(self, block: bytes | memoryview) -> None:
        view = memoryview(block).cast("B")
        if not self._multipart:
            self._md5.update(view)
            return
        while len(view):
            room = (self._fixed - self._held) if self._fixed else len(view)
            piece, view = view[:room], view[room:]
            self._md5.update(piece)
            self._held += len(piece)
            if self._held >= (self._fixed or _MULTIPART):
                self._parts.append(self._md5.digest())
                self._md5, self._held = hashlib.md5(usedforsecurity=False), 0

    def matches(self, etags: list[Any]) -> bool:
        """Whether S3's ETags of the upload (one for a PUT, one per part) are the MD5s of
        the bytes fed here, part by part."""
        if self._multipart:
            mine = self._parts + ([self._md5.digest()] if self._held else [])
        else:
            mine = [self._md5.digest()]
        got = [e.strip('"') for e in etags if isinstance(e, str)]
        return len(got) == len(etags) == len(mine) and got == [m.hex() for m in mine]


# The longest object key (bytes, below the bucket) of the stores whose protocols these are:
# S3 refuses a longer one (KeyTooLongError), as do GCS and Azure Blob Storage.
OBJECT_KEY_BYTES = 1024
_OBJECT_KEY_BYTES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


class FsspecTier(Tier):
    capabilities = _CAPABILITIES

    def __init__(
        self, url: str, storage_options: Mapping[str, Any] | None = None, *, retry: RetryPolicy = DEFAULT_POLICY
    ) -> None:
        self.options = dict(storage_options or {})
        self.location = redact(url, self.options)
        self.policy = retry
        if "::" in url.split("://", 1)[0]:
            # simplecache::s3://... (or ::/a/path): the options would reach the outer layer, not
            # the store (an endpoint dropped, credentials not passed), and none of its checks apply.
            raise TierUnavailableError(
                errno.EINVAL, f"cannot open {self.location}: chained URLs are not supported; give the store's own URL"
            )
        s3 = url.startswith(("s3://", "s3a://"))
        try:
            if s3:
                _check_endpoint(self.options)
            self.fs, prefix = fsspec.core.url_to_fs(url, **(_s3_options(self.options) if s3 else self.options))
        except (ImportError, ValueError, TypeError, OSError) as e:  # an unknown protocol, bad options
            raise TierUnavailableError(f"cannot open {self.location}: {redact(str(e), self.options)}") from None
        self._s3 = s3
        if s3:
            self.fs.retries = 1  # s3fs's own loop (an instance of these options only)
            try:  # its client now, not on the first request: a misspelled option is the URL's error
                self.fs.connect()
            except (TypeError, ValueError, AttributeError, OSError) as e:
                why = redact(f"{type(e).__name__}: {e}", self.options)
                raise TierUnavailableError(
                    errno.EINVAL, f"cannot open {self.location}: bad storage options: {why}"
                ) from None
            except Exception as e:  # botocore's own (an unknown profile, a bad addressing style)
                if type(e).__module__.split(".")[0] not in _BACKENDS:
                    raise
                why = redact(f"{type(e).__name__}: {e}", self.options)
                raise TierUnavailableError(errno.EINVAL, f"cannot open {self.location}: {why}") from None
        endpoint = _endpoint(self.options) if s3 else None  # one bucket name behind two endpoints: two stores
        self._store_id = (
            self.location if endpoint is None else f"{self.location} at {redact(str(endpoint), self.options)}"
        )
        self.prefix = str(prefix).rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        if _PRIVATE_PROTOCOLS.isdisjoint(protocols):
            self.capabilities = _SHARED

    @property
    def store_id(self) -> str:
        return self._store_id

    @property
    def key_room(self) -> int | None:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        if _OBJECT_KEY_BYTES.isdisjoint(protocols):
            return None
        _, _, below_bucket = self.prefix.partition("/")
        return OBJECT_KEY_BYTES - (len(below_bucket.encode()) + 1 if below_bucket else 0)

    def _path(self, key: str) -> str:
        return join_key(self.prefix, key) if key else self.prefix

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return retry(
                fn,
                f"{self.location}: {what}",
                self.policy,
                describe=lambda e: redact(f"{type(e).__name__}: {e}", self.options),
            )
        except (CkptError, OSError):
            raise
        except Exception as e:
            # The backend's own failures that are no OSError (botocore's NoCredentialsError,
            # CredentialRetrievalError, EndpointResolutionError...): this tier cannot be
            # used, which callers handle. Anything else (a TypeError) is a bug: as itself.
            if type(e).__module__.split(".")[0] not in _BACKENDS:
                raise
            why = redact(f"{type(e).__name__}: {e}", self.options)
            raise TierUnavailableError(errno.EIO, f"{self.location}: {what}: {why}") from None

    def _fresh(self, path: str) -> None:
        self.fs.invalidate_cache(path)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        return bytes(self._call(f"read {key}", lambda: self.fs.cat_file(path)))

    def open_read(self, key: str) -> _RangeHandle:
        path = self._path(key)
        self._fresh(path)
        info = self._call(f"stat {key}", lambda: self.fs.info(path))
        if info.get("type") == "directory":
            raise IsADirectoryError(path)
        return _RangeHandle(self, path, int(info["size"]))

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self._call(f"write {key}", lambda: self.fs.pipe_file(path, data))

    def put_stream(self, key: str, blocks: Callable[[], Iterable[bytes | memoryview]], size: int) -> bool:
        path = self._path(key)
        confirmed = [False]

        def upload() -> None:
            md5 = _Md5Parts(size >= 2 * _MULTIPART, self._part_bytes()) if self._s3 else None  # S3's ETags only
            confirmed[0] = False
            if size < 2 * _MULTIPART:  # one PUT
                body = b"".join(bytes(b) for b in blocks())
                if md5 is not None:
                    md5.update(body)
                answer = self.fs.pipe_file(path, body)
                confirmed[0] = md5 is not None and isinstance(answer, dict) and md5.matches([answer.get("ETag")])
                return
            out = self.fs.open(path, "wb", block_size=_MULTIPART)
            try:
                for block in blocks():
                    if md5 is not None:
                        md5.update(block)
                    out.write(block)
            except BaseException:
                # Abandon the multipart upload: closing would publish a truncated object, and
                # so would the file's __del__ if it were left open. Marked closed whatever the
                # abort does (an abort that fails leaves parts for the bucket's lifecycle rule).
                try:
                    with contextlib.suppress(Exception):
                        out.discard()
                finally:
                    out.closed = True
                raise
            out.close()
            parts = getattr(out, "parts", None)  # s3fs: each part's ETag as S3 answered its upload
            confirmed[0] = md5 is not None and isinstance(parts, list) and md5.matches([p.get("ETag") for p in parts])

        self._call(f"upload {key}", upload)
        return confirmed[0]

    def _part_bytes(self) -> int | None:
        """The size of each part but the last of s3fs's multipart uploads, where fixed; None
        where a part is whatever the buffer held once it reached the block size."""
        return _MULTIPART if getattr(self.fs, "fixed_upload_size", False) else None

    def put_if_absent(self, key: str, data: bytes) -> None:
        """S3: a PUT with `If-None-Match: *` (412 -> FileExistsError). A retry after an
        answer lost on the way may find the caller's own object: callers compare contents."""
        path = self._path(key)
        self._call(f"create {key}", lambda: self.fs.pipe_file(path, data, mode="create"))

    def _listing(self, prefix: str, how: Callable[[str], T], empty: T) -> T:
        """A fresh listing of `prefix` (`how(path)`), `empty` where there is nothing."""
        path = self._path(prefix)
        self._fresh(path)
        try:
            return self._call(f"list {prefix or '/'}", lambda: how(path))
        except FileNotFoundError:
            if not prefix and self._s3:
                self._check_bucket()
            return empty

    def _check_bucket(self) -> None:
        """TierUnavailableError where the tier's bucket does not exist: a typo in its URL
        would otherwise read as a store that holds no version, and a restore would start
        afresh. A bucket that cannot be asked about (refused, unreachable) is no proof."""
        bucket = self.fs._strip_protocol(self.prefix).split("/", 1)[0]
        try:
            self._call(f"head bucket {bucket}", lambda: self.fs.call_s3("head_bucket", Bucket=bucket))
        except FileNotFoundError:
            raise TierUnavailableError(errno.ENOENT, f"{self.location}: bucket {bucket!r} does not exist") from None
        except (CkptError, OSError):
            pass

    def listdir(self, prefix: str = "") -> list[str]:
        names: list[str] = self._listing(prefix, lambda p: self.fs.ls(p, detail=False), [])
        return sorted({str(n).rstrip("/").rsplit("/", 1)[-1] for n in names} - {""})

    def find(self, prefix: str) -> list[ObjectInfo]:
        found: dict[str, dict[str, Any]] = self._listing(prefix, lambda p: self.fs.find(p, detail=True), {})
        base = self.fs._strip_protocol(self.prefix).rstrip("/")
        out = []
        for name, info in found.items():
            full = self.fs._strip_protocol(name)
            if info.get("type") == "directory" or not full.startswith(base + "/"):
                continue
            out.append(ObjectInfo(full[len(base) + 1 :], int(info.get("size") or 0), _mtime(info)))
        return sorted(out, key=lambda o: o.key)

    def exists(self, key: str) -> bool:
        path = self._path(key)
        self._fresh(path)
        try:
            self._call(f"stat {key}", lambda: self.fs.info(path))
        except FileNotFoundError:
            return False
        return True

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            self._call(f"delete {key}", lambda: self.fs.rm_file(path))

    def delete_many(self, keys: Iterable[str]) -> None:
        paths = [self._path(k) for k in keys]
        if not paths:
            return
        try:
            self._call("delete objects", lambda: self.fs.rm(paths))  # one batch where the store has one
        except FileNotFoundError:
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    self._call(f"delete {p}", functools.partial(self.fs.rm_file, p))

    def delete_tree(self, prefix: str) -> None:
        self.delete_many(o.key for o in self.find(prefix))


def _s3_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """S3 options with botocore's retries off and a short connect timeout, unless the user set them."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    config.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    return {**options, "config_kwargs": config}


def _endpoint(options: Mapping[str, Any]) -> Any:
    """The S3 endpoint these options reach, as botocore takes it (None: AWS's own)."""
    client = options.get("client_kwargs")
    endpoint = options.get("endpoint_url") or (client.get("endpoint_url") if isinstance(client, Mapping) else None)
    return endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def _check_endpoint(options: Mapping[str, Any]) -> None:
    """ValueError for an endpoint URL botocore would refuse (no scheme or host) on the first
    request, by its own rule: at open, rather than as a traceback from deep in a listing."""
    endpoint = _endpoint(options)
    if endpoint is None:
        return
    from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url

    if not isinstance(endpoint, str) or not (is_valid_endpoint_url(endpoint) or is_valid_ipv6_endpoint_url(endpoint)):
        raise ValueError(f"Invalid endpoint: {endpoint!r} (give scheme://host[:port])")


def _mtime(info: Mapping[str, Any]) -> float:
    """The object's last write as unix time, from what the backend reports (S3:
    LastModified, a datetime; local-like filesystems: mtime)."""
    for field in ("LastModified", "last_modified", "mtime", "updated", "created"):
        value = info.get(field)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return 0.0
