"""The format on an fsspec filesystem (S3 through s3fs, `file://`, anything fsspec reaches).

A remote version has the same layout as a local one: `<prefix>/v<N>/...`, chunk files
byte-identical to local ones, `root.json`, and `manifest.json` written last with a
create-only write (S3 `If-None-Match: *`; on a local filesystem a hard link of a fully
written temp file). Object stores have no rename, so the manifest is the commit marker:
a remote version without one is invisible.

Credentials never reach logs or error messages: `redact` scrubs any secret value.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ckpt.store.errors import TierUnavailableError
from ckpt.store.fsio import fsync_dir, makedirs, write_durable

__all__ = [
    "is_url",
    "open_fs",
    "parse_storage_options",
    "redact",
    "create_only",
    "is_local",
    "join",
    "put_durable",
    "SECRET_KEYS",
]

SECRET_KEYS = ("key", "secret", "token", "password", "aws_secret_access_key", "aws_access_key_id", "aws_session_token")
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_url(path: str) -> bool:
    return bool(_URL.match(path))


def parse_storage_options(pairs: Iterable[str]) -> dict[str, Any]:
    """`key=value` strings (the CLI's --storage-option) into fsspec keyword arguments.

    Dotted keys nest (`client_kwargs.region_name=us-east-1`); true/false/ints are typed.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"storage option {pair.split('=')[0]!r} must be key=value")
        key, value = pair.split("=", 1)
        typed: Any = value
        if value.lower() in ("true", "false"):
            typed = value.lower() == "true"
        elif re.fullmatch(r"-?\d+", value):
            typed = int(value)
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = typed
    return out


def _secrets(options: Mapping[str, Any]) -> list[str]:
    found = []
    for k, v in options.items():
        if isinstance(v, Mapping):
            found += _secrets(v)
        elif isinstance(v, str) and (k.lower() in SECRET_KEYS or "secret" in k.lower() or "token" in k.lower()):
            found.append(v)
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        if os.environ.get(name):
            found.append(os.environ[name])
    return [s for s in found if len(s) >= 4]


def redact(text: str, options: Mapping[str, Any] | None = None) -> str:
    """`text` with every credential value (from options or AWS_* variables) replaced by ***."""
    for s in _secrets(options or {}):
        text = text.replace(s, "***")
    return re.sub(r"(?i)(aws_secret_access_key|secret|token|signature)=([^&\s]+)", r"\1=***", text)


def open_fs(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path prefix) for a URL; S3 is configured by AWS_* variables and config files
    unless storage options say otherwise. Errors carry no credentials."""
    opts = dict(storage_options or {})
    try:
        fs, path = fsspec.core.url_to_fs(url, **opts)
    except Exception as e:  # noqa: BLE001 - any backend failure becomes one documented type
        raise TierUnavailableError(f"cannot open {url}: {redact(str(e), opts)}") from None
    return fs, path.rstrip("/")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)


def create_only(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `path` only if it does not exist; raise FileExistsError otherwise. Atomic:
    readers see nothing or all of it."""
    if is_local(fs):
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        write_durable(tmp, data)
        try:
            os.link(tmp, path)  # fails with EEXIST: create-only and atomic
        finally:
            os.unlink(tmp)
        fsync_dir(os.path.dirname(path))
        return
    fs.pipe_file(path, data, mode="create")


def put_durable(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write (replacing) `path`; on a local filesystem through temp file, fsync and rename."""
    if is_local(fs):
        makedirs(os.path.dirname(path))
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        write_durable(tmp, data)
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))
        return
    fs.pipe_file(path, data)
