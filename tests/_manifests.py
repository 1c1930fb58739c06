"""Crafted manifests for tests: a document edited by a test, written as ckpt writes one."""

from __future__ import annotations

import json
from typing import Any

from ckpt.store.manifest import with_checksum


def crafted(doc: dict[str, Any]) -> bytes:
    """`doc` serialized with a valid `manifest_xxh3` (recomputed), as a hostile writer could:
    what a reader then refuses, it refuses for the edit, not for the checksum."""
    body = {k: v for k, v in doc.items() if k != "manifest_xxh3"}
    return with_checksum(json.dumps(body, separators=(",", ":")).encode())


def legacy(doc: dict[str, Any]) -> bytes:
    """`doc` as written before ckpt recorded `manifest_xxh3` (no checksum member)."""
    return json.dumps({k: v for k, v in doc.items() if k != "manifest_xxh3"}).encode()
