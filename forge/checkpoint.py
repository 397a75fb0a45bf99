"""Hugging Face checkpoints: config, tokenizer files and lazily memory-mapped safetensors tensors.

Nothing is loaded into RAM up front: shard headers are parsed (a few KB each) and each tensor is a
``numpy.memmap`` view created on demand.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from forge.bulk import bf16_to_f32
from forge.errors import ForgeError
from forge.fileio import drop_pages

#: safetensors dtype -> (numpy storage dtype, itemsize). BF16 is kept as its uint16 bit pattern.
_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype("u1"),  # FP8 codes, decoded by float32()
    "F8_E8M0": np.dtype("u1"),  # power-of-two scale exponents (bias 127)
}


def _e4m3_table() -> np.ndarray:
    """float32 value of each F8_E4M3 (fn) code: 4 exponent bits (bias 7), 3 mantissa bits; 0x7F/0xFF NaN."""
    c = np.arange(256)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, m * 2.0**-9, (8 + m) * np.exp2(e - 10.0))
    v = np.where(c & 0x80, -mag, mag).astype(np.float32)
    v[(c & 0x7F) == 0x7F] = np.nan
    return v


_E4M3 = _e4m3_table()
#: float32 value of each E8M0 code: 2^(code - 127); 0xFF is NaN
_E8M0 = np.append(np.exp2(np.arange(255) - 127.0), np.nan).astype(np.float32)


@dataclass(frozen=True)
class HFTensor:
    """One tensor inside a safetensors shard, not yet read."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: Path
    offset: int  # absolute byte offset in the shard file
    nbytes: int

    def raw(self) -> np.ndarray:
        """The stored values (BF16 as uint16 bits), memory-mapped, in the stored shape."""
        if self.nbytes == 0:
            return np.zeros(self.shape, _DTYPES[self.dtype])
        dtype = _DTYPES[self.dtype]
        return _shard_map(self.shard)[self.offset : self.offset + self.nbytes].view(dtype).reshape(self.shape)

    def release(self) -> None:
        """Drop this tensor's pages from the process's resident set (``fileio.drop_pages``)."""
        if self.nbytes:
            drop_pages(_shard_map(self.shard), self.offset, self.nbytes)

    def float32(self) -> np.ndarray:
        data = self.raw()
        if self.dtype == "BF16":
            return bf16_to_f32(data)
        if self.dtype == "F8_E4M3":
            return _E4M3[data]
        if self.dtype == "F8_E8M0":
            return _E8M0[data]
        return np.asarray(data, dtype=np.float32)


@lru_cache(maxsize=256)
def _shard_map(path: Path) -> np.ndarray:
    """One read-only mapping per shard, shared by all its tensors."""
    return np.memmap(path, dtype=np.uint8, mode="r")


def read_safetensors_header(path: Path) -> list[HFTensor]:
    """Parse a shard's header, checking that every tensor lies inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ForgeError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise ForgeError(f"{path}: truncated or corrupt safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ForgeError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise ForgeError(f"{path}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if dtype not in _DTYPES:
            raise ForgeError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        try:
            start, end = (int(v) for v in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ForgeError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
        if not 0 <= start <= end or any(d < 0 for d in shape):
            raise ForgeError(f"{path}: corrupt safetensors header entry for tensor {name}")
        if end - start != int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype].itemsize:
            raise ForgeError(f"{path}: tensor {name} byte size does not match its shape")
        if base + end > size:
            raise ForgeError(
                f"{path}: truncated safetensors file (tensor {name} ends past the end of the file)"
            )
        out.append(HFTensor(name, dtype, shape, path, base + start, end - start))
    return out


def json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold one object (config.json, tokenizer.json, an index): else one clear error."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ForgeError(f"{path}: not UTF-8 text (a binary file?)") from None
    except json.JSONDecodeError as e:
        raise ForgeError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ForgeError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


class Checkpoint:
    """A Hugging Face model folder."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise ForgeError(f"{self.path}: no such folder")
        if not self.path.is_dir():
            raise ForgeError(f"{self.path}: not a folder (expected a Hugging Face checkpoint folder)")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise ForgeError(f"{self.path}: missing config.json (not a Hugging Face checkpoint folder?)")
        self.raw_config: dict[str, Any] = json_object(config_path)

    @cached_property
    def config(self) -> dict[str, Any]:
        """The text model's config: ``text_config`` (multimodal wrappers) merged over the top level."""
        cfg = dict(self.raw_config)
        text = cfg.get("text_config")
        if isinstance(text, dict):
            cfg.update(text)
        return cfg

    @cached_property
    def shard_names(self) -> list[str]:
        """Shard file names in the order llama.cpp's converter visits them (sorted, from the index)."""
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(self._weight_map(index).values()))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise ForgeError(f"{self.path}: shard {missing[0]} is listed in the index but absent")
            return names
        if (self.path / "model.safetensors").is_file():
            return ["model.safetensors"]
        found = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not found:
            raise ForgeError(f"{self.path}: no safetensors weights (model.safetensors or an index)")
        return found

    @cached_property
    def tensors(self) -> dict[str, HFTensor]:
        """Every tensor, keyed by name, in the converter's visiting order (shard by shard)."""
        out: dict[str, HFTensor] = {}
        for name in self.shard_names:
            # llama.cpp's converter visits a shard's tensors in name order, not the header's (data) order
            for t in sorted(read_safetensors_header(self.path / name), key=lambda t: t.name):
                out[t.name] = t
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            listed = set(self._weight_map(index))
            missing = sorted(listed - set(out))
            if missing:
                raise ForgeError(f"{self.path}: tensor {missing[0]} is listed in the index but in no shard")
        return out

    @staticmethod
    def _weight_map(index: Path) -> dict[str, str]:
        weight_map = json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ForgeError(f"{index}: invalid index (no weight_map of tensor -> shard names)")
        return weight_map

    def __iter__(self) -> Iterator[HFTensor]:
        return iter(self.tensors.values())

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self)

    def read_json(self, name: str) -> dict[str, Any] | None:
        p = self.path / name
        return json_object(p) if p.is_file() else None

    def chat_template(self) -> str | None:
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        cfg = self.read_json("tokenizer_config.json") or {}
        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):  # named templates: llama.cpp takes "default"
            tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
        return tmpl
