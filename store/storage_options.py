"""fsspec storage options: parsed from the CLI's `key=value` pairs, and scrubbed from every
message, so credentials never reach a log or an error."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["SECRET_KEYS", "parse_storage_options", "redact"]

SECRET_KEYS = ("key", "secret", "token", "password", "aws_secret_access_key", "aws_access_key_id", "aws_session_token")


def parse_storage_options(pairs: Iterable[str]) -> dict[str, Any]:
    """`key=value` strings (the CLI's --storage-option) into fsspec keyword arguments.

    Dotted keys nest (`client_kwargs.region_name=us-east-1`); true/false, ints and decimal
    numbers are typed (`config_kwargs.connect_timeout=0.5`).
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
        elif re.fullmatch(r"-?(\d+\.\d*|\.\d+)", value):
            typed = float(value)
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
