"""Safetensors headers: a checkpoint's tensors and their exact bytes, without its weights. PURE.

A `.safetensors` file starts with 8 bytes, the little-endian length N of the header, then N bytes of
JSON: for every tensor its dtype, shape and `data_offsets` [begin, end) into the data that
follows (plus an optional `__metadata__` object of strings). Reading bytes [0, 8 + N) of each shard
is enough to know every tensor's size; the offsets give it exactly, whatever the dtype (packed
4-bit formats included).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

# The format's own limit (safetensors refuses larger headers).
MAX_HEADER_BYTES = 100_000_000
LENGTH_BYTES = 8
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


class HeaderError(ValueError):
    """Not a safetensors header; the message says what is wrong."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # safetensors' name: BF16, F32, I32, F8_E4M3, U8, ...
    shape: tuple[int, ...]
    nbytes: int

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


def header_length(prefix: bytes, file: str) -> int:
    """N, from the file's first 8 bytes."""
    if len(prefix) < LENGTH_BYTES:
        raise HeaderError(f"{file}: {len(prefix)} bytes where the 8-byte header length should be")
    (length,) = struct.unpack("<Q", prefix[:LENGTH_BYTES])
    if not 2 <= length <= MAX_HEADER_BYTES:
        raise HeaderError(f"{file}: header length {length} is not a safetensors header's")
    return length


def _tensor(name: str, entry: object, file: str) -> Tensor:
    if not isinstance(entry, dict):
        raise HeaderError(f"{file}: tensor {name!r} is not described by an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if (
        not isinstance(dtype, str)
        or not isinstance(shape, list)
        or not all(isinstance(d, int) and d >= 0 for d in shape)
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise HeaderError(f"{file}: tensor {name!r} lacks a dtype, a shape or data_offsets")
    return Tensor(name, dtype, tuple(shape), offsets[1] - offsets[0])


def parse_header(data: bytes, file: str) -> list[Tensor]:
    """The tensors of one file's header (the N bytes after the length)."""
    try:
        header = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise HeaderError(f"{file}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{file}: the header is not a JSON object")
    return [_tensor(n, e, file) for n, e in header.items() if n != "__metadata__"]
