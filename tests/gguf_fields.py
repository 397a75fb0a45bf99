"""File positions of the fields of a GGUF's tensor directory entries, for tests that damage them."""

from __future__ import annotations

import struct
from pathlib import Path

from forge.layout.gguf_raw import open_gguf as open_raw


def directory_fields(path: Path) -> tuple[int, int, dict[str, dict[str, int]]]:
    """(KV block start, directory start, per tensor the file positions of its directory fields)."""
    with open_raw(path) as raw:
        kv_start, pos, n = raw.kv_start, raw.kv_end, len(raw.tensors)
        buf = bytes(raw.mm[: raw.dir_end])
    dir_start, out = pos, {}
    for _ in range(n):
        (length,) = struct.unpack_from("<Q", buf, pos)
        name = buf[pos + 8 : pos + 8 + length].decode()
        ndims_at = pos + 8 + length
        (n_dims,) = struct.unpack_from("<I", buf, ndims_at)
        type_at = ndims_at + 4 + 8 * n_dims
        out[name] = {"name": pos + 8, "n_dims": ndims_at, "dims": ndims_at + 4, "type": type_at,
                     "offset": type_at + 4}  # fmt: skip
        pos = type_at + 12
    return kv_start, dir_start, out
