"""Quantizer inputs: a Hugging Face folder (converted on the fly) or an F32/F16/BF16 GGUF.

Both present the same face: KVs, tensors with their stored type, and float32 values on demand.
Sources are re-openable from a small picklable descriptor, so worker processes open their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from forge.arch.base import OutTensor, SourceArray
from forge.bulk import bf16_to_f32, float32_values
from forge.convert import ModelSource, encode_float, float_type_for
from forge.errors import ForgeError
from forge.fileio import drop_pages
from forge.gguf_file import KV, GGUFFile, open_gguf
from forge.quant.reuse import CONVERTER_VERSION, content_digest

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
#: KVs a quantized output writes afresh
REWRITTEN_KVS = ("general.file_type", "general.quantization_version")


@dataclass(frozen=True)
class SrcTensor:
    name: str
    shape: tuple[int, ...]  # numpy order
    ggml_type: GGMLQuantizationType


@dataclass(frozen=True)
class SourceRef:
    """Picklable description of a source: ``kind`` is 'hf' or 'gguf'."""

    kind: str
    path: str
    mtp: bool = True

    def open(self) -> QuantSource:
        return HFQuantSource(self) if self.kind == "hf" else GGUFQuantSource(self)


class QuantSource:
    ref: SourceRef
    arch: str

    def tensors(self) -> list[SrcTensor]:
        raise NotImplementedError

    def kvs(self) -> list[KV]:
        """The source's metadata without the keys a quantized file rewrites (file type, quant version)."""
        raise NotImplementedError

    def float32(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def values_or_bits(self, name: str) -> np.ndarray:
        """``float32(name)``, or the same values as their bf16 bits (uint16, same shape) where the source
        stores them in bf16: the encoder widens them itself, a chunk at a time (half the bytes to read, hold
        and copy to a device)."""
        return self.float32(name)

    def stored(self, name: str) -> np.ndarray:
        """The tensor in its stored type (for tensors copied unchanged)."""
        raise NotImplementedError

    def hparam(self, key: str, default: int = 0) -> int:
        raise NotImplementedError

    def digest(self, name: str, trust_mtime: bool = False) -> str:
        """A digest of everything the tensor's values are made from (content, or file stats)."""
        raise NotImplementedError


class HFQuantSource(QuantSource):
    def __init__(self, ref: SourceRef):
        self.ref = ref
        self.model = ModelSource.open(ref.path, mtp=ref.mtp)
        self.arch = self.model.arch.gguf_arch
        self._by_name = {t.name: t for t in self.model.tensors}

    @cached_property
    def _kvs(self) -> list[KV]:
        return [kv for kv in self.model.kvs(0) if kv.key not in REWRITTEN_KVS]

    def kvs(self) -> list[KV]:
        return self._kvs

    def tensors(self) -> list[SrcTensor]:
        return [
            SrcTensor(t.name, t.shape, float_type_for(t, GGMLQuantizationType.BF16))
            for t in self.model.tensors
        ]

    def float32(self, name: str) -> np.ndarray:
        t = self._by_name[name]
        return self._float32(t, t.produce())

    def values_or_bits(self, name: str) -> np.ndarray:
        t = self._by_name[name]
        src = t.produce()
        if src.dtype == "BF16":  # float32 would be these bits widened
            return self._released(t, np.asarray(src.data).view(np.uint16))
        return self._float32(t, src)

    def _float32(self, t: OutTensor, src: SourceArray) -> np.ndarray:
        if float_type_for(t, GGMLQuantizationType.BF16) == GGMLQuantizationType.BF16 and src.dtype != "BF16":
            # what llama-quantize would see after a bf16 conversion
            values = bf16_to_f32(encode_float(t, GGMLQuantizationType.BF16, src))
        else:
            values = src.float32()
        return self._released(t, values)

    def stored(self, name: str) -> np.ndarray:
        t = self._by_name[name]
        return self._released(t, encode_float(t, float_type_for(t, GGMLQuantizationType.BF16)))

    @staticmethod
    def _released(t: OutTensor, values: np.ndarray) -> np.ndarray:
        """``values`` as an array of its own, the source pages they were read from dropped from the resident
        set (a float32 source's values may be a view of the mapping: copied first)."""
        if any(np.may_share_memory(values, p.raw()) for p in t.sources if p.nbytes):
            values = values.copy()
        for p in t.sources:
            p.release()
        return values

    def hparam(self, key: str, default: int = 0) -> int:
        kv = next((k for k in self._kvs if k.key == f"{self.arch}.{key}"), None)
        return int(kv.value) if kv is not None else default

    def digest(self, name: str, trust_mtime: bool = False) -> str:
        parts = self._by_name[name].sources
        head = f"hf-v{CONVERTER_VERSION}:{name}"
        if trust_mtime:
            stats = [
                (p.shard.name, p.shard.stat().st_size, int(p.shard.stat().st_mtime), p.offset, p.nbytes)
                for p in parts
            ]
            return content_digest([np.frombuffer(f"{head}:{stats}".encode(), np.uint8)])
        digest = content_digest([np.frombuffer(head.encode(), np.uint8), *(p.raw() for p in parts)])
        for p in parts:
            p.release()
        return digest


class GGUFQuantSource(QuantSource):
    def __init__(self, ref: SourceRef):
        self.ref = ref
        self.file: GGUFFile = open_gguf(ref.path)
        self.arch = self.file.architecture
        if self.file.kv("split.count", 1) > 1:
            raise ForgeError(f"{ref.path}: split GGUF sources are not supported yet; merge the shards first")

    def kvs(self) -> list[KV]:
        return [
            kv for k, kv in self.file.kvs.items() if k not in REWRITTEN_KVS and not k.startswith("split.")
        ]

    def tensors(self) -> list[SrcTensor]:
        return [SrcTensor(t.name, t.shape, t.ggml_type) for t in self.file.tensors.values()]

    def float32(self, name: str) -> np.ndarray:
        t = self.file.tensors[name]
        raw = self.file.raw(name)
        try:
            values = float32_values(raw, t.ggml_type).reshape(t.shape)
        except NotImplementedError:
            raise ForgeError(
                f"{self.ref.path}: cannot decode tensor {name} of type {t.ggml_type.name}"
            ) from None
        if np.may_share_memory(values, raw):  # an F32 source: a view of the mapping
            values = values.copy()
        self._release(name)
        return values

    def values_or_bits(self, name: str) -> np.ndarray:
        if self.file.tensors[name].ggml_type != GGMLQuantizationType.BF16:
            return self.float32(name)
        bits = np.array(self.file.array(name))  # a copy: the mapped pages are dropped
        self._release(name)
        return bits

    def _release(self, name: str) -> None:
        info = self.file.tensors[name]
        drop_pages(self.file.mapped(), info.offset, info.nbytes)

    def stored(self, name: str) -> np.ndarray:
        return np.asarray(self.file.raw(name))

    def hparam(self, key: str, default: int = 0) -> int:
        return int(self.file.kv(f"{self.arch}.{key}", default))

    def digest(self, name: str, trust_mtime: bool = False) -> str:
        info = self.file.tensors[name]
        if trust_mtime:
            st = self.file.path.stat()
            stats = (self.file.path.name, st.st_size, int(st.st_mtime), info.offset, info.nbytes)
            return content_digest([np.frombuffer(f"gguf:{name}:{stats}".encode(), np.uint8)])
        digest = content_digest([np.frombuffer(f"gguf:{name}".encode(), np.uint8), self.file.raw(name)])
        self._release(name)
        return digest


def source_ref(path: str | Path, mtp: bool = True) -> SourceRef:
    p = Path(path)
    if p.is_dir():
        return SourceRef("hf", str(p), mtp)
    if p.is_file():
        return SourceRef("gguf", str(p), mtp)
    raise ForgeError(f"{p}: no such file or folder (expected a Hugging Face folder or a GGUF file)")
