"""Element types of the format: zarr v3 `data_type` names, their sizes and numpy views.

bfloat16 and the float8 types are zarr v3 extension names that tensorstore reads;
numpy (and so zarr-python) has no native type for them, so they map to a same-size
unsigned integer view, documented in docs/FORMAT.md.
"""

from __future__ import annotations

import numpy as np

from ckpt.store.errors import ManifestError

__all__ = ["ITEMSIZE", "numpy_dtype", "itemsize", "is_native"]

# zarr v3 data_type -> bytes per element.
ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}

_RAW_VIEW = {1: "uint8", 2: "uint16"}


def itemsize(data_type: str) -> int:
    try:
        return ITEMSIZE[data_type]
    except KeyError:
        raise ManifestError(f"unsupported data_type {data_type!r}") from None


def is_native(data_type: str) -> bool:
    """True when numpy (and so zarr-python) understands the type natively."""
    return itemsize(data_type) > 0 and not (data_type == "bfloat16" or data_type.startswith("float8"))


def numpy_dtype(data_type: str) -> np.dtype:
    """Little-endian numpy dtype for the type, or an unsigned view of the same size."""
    size = itemsize(data_type)
    name = data_type if is_native(data_type) else _RAW_VIEW[size]
    return np.dtype(name).newbyteorder("<")
