"""Incremental builds: per-tensor reuse keys, and copying unchanged tensors from prior builds.

Every build stamps, per output tensor (KV arrays aligned with the file's tensor order):

- ``forge.reuse.keys``: fnv1a64 (16 hex digits) over the tensor's name, its source content digest,
  target type, shape, the encoder's version for that type and, only when that type reads importance
  weights, the digest of the importance rows this tensor used (per expert for expert tensors);
- ``forge.reuse.sources`` / ``forge.reuse.imatrix`` / ``forge.reuse.encoders``: those components,
  kept so that a rebuild can say *why* a tensor was regenerated;
- ``forge.reuse.digests``: xxh3-64 of the output tensor's bytes, checked while copying.

It also writes ds4's file-level keys ``quantize.reuse_key`` and ``quantize.reuse_key_weights``
(ds4's fnv1a64 over the source description, the imatrix file and a structural salt), so a ds4-style
tool can compare builds.

With ``--reuse PRIOR``: a tensor is copied iff a prior holds a tensor with an equal key, and the
prior's bytes still hash to the digest it recorded; anything else is encoded, with the reason.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
from numba import njit

from forge import jit
from forge.atomic import same_file
from forge.errors import ForgeError
from forge.fileio import copy_ranges
from forge.gguf_file import KV, GGUFFile, T, TensorWriter, open_gguf

#: ds4's FNV-1a basis: one decimal digit short of the canonical 14695981039346656037, kept so keys match
#: ds4's (antirez/ds4 uses it for its hashmap and --compare-tensor, the andreaborio/ds4 fork for --reuse keys)
FNV_BASIS = 1469598103934665603
FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1
#: bump when the HF -> GGUF tensor transforms change (part of every HF source digest)
CONVERTER_VERSION = 1

KEYS, SOURCES, IMATRIX, ENCODERS, DIGESTS = (
    "forge.reuse.keys",
    "forge.reuse.sources",
    "forge.reuse.imatrix",
    "forge.reuse.encoders",
    "forge.reuse.digests",
)


def fnv1a64(data: bytes | Iterable[bytes], h: int = FNV_BASIS) -> int:
    """ds4's FNV-1a 64 (same prime, ds4's basis); ``data`` may be several byte strings in sequence.
    Compiled: an imatrix of a 256-expert model is ~200 MB, which a Python loop over bytes took seconds on."""
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    for chunk in chunks:
        if jit.enabled():
            h = int(_fnv1a64_bytes(np.frombuffer(chunk, np.uint8), np.uint64(h)))
            continue
        for b in bytes(chunk):
            h = ((h ^ b) * FNV_PRIME) & _MASK
    return h


@njit(**jit.JIT)
def _fnv1a64_bytes(buf: np.ndarray, h: np.uint64) -> np.uint64:
    prime = np.uint64(FNV_PRIME)
    for i in range(buf.size):
        h = (h ^ np.uint64(buf[i])) * prime  # unsigned 64-bit arithmetic wraps, as C's
    return h


def hex16(h: int) -> str:
    return f"{h:016x}"


def content_digest(arrays: Iterable[np.ndarray]) -> str:
    """xxh3-64 over arrays' bytes (zero-copy views of memory-mapped data)."""
    x = xxhash.xxh3_64()
    for a in arrays:
        x.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return x.hexdigest()


def importance_digest(importance: np.ndarray | None) -> str:
    return "" if importance is None else content_digest([np.asarray(importance, dtype=np.float32)])


def tensor_key(
    name: str, source: str, out_type: str, shape: tuple[int, ...], encoder: int, imatrix: str
) -> str:
    fields = [name, source, out_type, "x".join(map(str, shape)), str(encoder), imatrix]
    return hex16(fnv1a64("\0".join(fields).encode()))


@dataclass(frozen=True)
class TensorStamp:
    """What a build records about one output tensor."""

    key: str
    source: str
    imatrix: str
    encoder: int


def stamp_kvs(stamps: list[TensorStamp], digests: list[str]) -> list[KV]:
    return [
        KV(KEYS, [s.key for s in stamps], T.ARRAY, T.STRING),
        KV(SOURCES, [s.source for s in stamps], T.ARRAY, T.STRING),
        KV(IMATRIX, [s.imatrix for s in stamps], T.ARRAY, T.STRING),
        KV(ENCODERS, [s.encoder for s in stamps], T.ARRAY, T.INT32),
        KV(DIGESTS, digests, T.ARRAY, T.STRING),
    ]


# ------------------------------------------------------------------------------ ds4's file keys


def shard_stat_salt(folder: Path) -> int:
    """ds4: XOR over *.safetensors in the folder of fnv1a64(name, size as int64, mtime seconds as int64)."""
    salt = 0
    for p in folder.glob("*.safetensors"):
        try:
            st = p.stat()
        except OSError:
            continue
        salt ^= fnv1a64([p.name.encode(), struct.pack("<qq", st.st_size, int(st.st_mtime))])
    return salt


def ds4_keys(source_path: Path, imatrix_path: Path | None, n_tensors: int, alignment: int) -> tuple[str, str]:
    """(``quantize.reuse_key``, ``quantize.reuse_key_weights``) as ds4 computes them."""
    if source_path.is_dir():
        index = source_path / "model.safetensors.index.json"
        head = [
            index.read_bytes() if index.is_file() else b"",
            struct.pack("<Q", shard_stat_salt(source_path)),
        ]
    else:
        st = source_path.stat()
        head = [source_path.name.encode(), struct.pack("<qq", st.st_size, int(st.st_mtime))]
    salt = struct.pack("<QQ", n_tensors, alignment)
    weights = fnv1a64([*head, salt])
    if imatrix_path is None:
        return hex16(weights), hex16(weights)
    h = fnv1a64(head)
    with open(imatrix_path, "rb") as f:
        while chunk := f.read(1 << 20):
            h = fnv1a64(chunk, h)
    return hex16(fnv1a64(salt, h)), hex16(weights)


# ---------------------------------------------------------------------------------- priors


@dataclass(frozen=True)
class PriorTensor:
    file: GGUFFile
    name: str
    stamp: TensorStamp
    digest: str
    out_type: str
    shape: tuple[int, ...]


@dataclass
class Priors:
    by_key: dict[str, PriorTensor]
    by_name: dict[str, PriorTensor]
    warnings: list[str]


def _prior_files(paths: Iterable[str | Path]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted(p.glob("*.gguf")) if p.is_dir() else [p]
    return out


def load_priors(paths: Iterable[str | Path], out: Path | None) -> Priors:
    """Open every prior; a prior that cannot be used is a warning (and a full build), not an error."""
    priors = Priors({}, {}, [])
    for path in _prior_files(paths):
        if out is not None and same_file(path, out):
            raise ForgeError(f"--reuse {path} is the output file itself; choose another output name")
        try:
            f = open_gguf(path)
        except ForgeError as e:
            priors.warnings.append(f"prior {path} ignored: {e}")
            continue
        keys = f.kv(KEYS)
        names = list(f.tensors)
        arrays = [f.kv(k) for k in (KEYS, SOURCES, IMATRIX, ENCODERS, DIGESTS)]
        if keys is None or any(a is None or len(a) != len(names) for a in arrays):
            priors.warnings.append(
                f"prior {path} ignored: it carries no forge reuse keys (not built by forge?)"
            )
            continue
        for i, name in enumerate(names):
            info = f.tensors[name]
            stamp = TensorStamp(arrays[0][i], arrays[1][i], arrays[2][i], int(arrays[3][i]))
            pt = PriorTensor(f, name, stamp, arrays[4][i], info.ggml_type.name, info.shape)
            priors.by_key.setdefault(stamp.key, pt)
            priors.by_name.setdefault(name, pt)
    return priors


def why_regenerated(stamp: TensorStamp, out_type: str, prior: PriorTensor | None) -> str:
    """The reason a tensor without a matching key is encoded, from the same-named prior tensor."""
    if prior is None:
        return "no prior"
    if prior.out_type != out_type:
        return f"new type ({prior.out_type} -> {out_type})"
    if prior.stamp.source != stamp.source:
        return "source changed"
    if prior.stamp.encoder != stamp.encoder:
        return f"encoder version ({prior.stamp.encoder} -> {stamp.encoder})"
    if prior.stamp.imatrix != stamp.imatrix:
        return "imatrix rows changed"
    return "shape or name changed"


def verified_bytes(prior: PriorTensor) -> np.ndarray | None:
    """The prior tensor's bytes (a zero-copy view) if they still hash to the recorded digest."""
    data = prior.file.raw(prior.name)
    return data if content_digest([data]) == prior.digest else None


def copy_from_prior(prior: PriorTensor) -> TensorWriter:
    """A writer that streams the prior tensor's bytes in the kernel where possible."""
    info = prior.file.tensors[prior.name]
    return lambda f: copy_ranges(f, [(prior.file.path, info.offset, info.nbytes)])
