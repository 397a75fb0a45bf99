"""Lossless Hugging Face -> GGUF conversion (bf16 / f16 / f32), streamed tensor by tensor."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from forge.arch import Architecture, OutTensor, architecture_for
from forge.arch.base import SourceArray
from forge.arch.tokenizer import tokenizer_kvs
from forge.bulk import f32_to_bf16
from forge.checkpoint import Checkpoint
from forge.errors import ForgeError
from forge.fileio import copy_ranges
from forge.gguf_file import KV, T, TensorSpec, TensorWriter, write_gguf, write_gguf_split
from forge.progress import byte_progress

OUTTYPES = {
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
}


@dataclass
class ModelSource:
    """A checkpoint seen through its architecture table: GGUF KVs and planned tensors."""

    ckpt: Checkpoint
    arch: Architecture
    tensors: list[OutTensor]

    @classmethod
    def open(cls, hf_dir: str | Path, mtp: bool = True, mtp_only: bool = False) -> ModelSource:
        ckpt = Checkpoint(hf_dir)
        arch = architecture_for(ckpt, mtp=mtp, mtp_only=mtp_only)
        return cls(ckpt, arch, arch.plan())

    def kvs(self, file_type: int) -> list[KV]:
        """Every KV llama.cpp's converter writes, in its order."""
        vocab_size = int(self.arch.hp("vocab_size"))
        tokenizer = tokenizer_kvs(
            self.ckpt, vocab_size, self.arch.pre_tokenizer_names, self.arch.special_tokens
        )
        first = []
        bundled = self.arch.bundled_chat_template()
        if bundled is not None:  # written first; the model's own template overwrites it in place
            own = [kv for kv in tokenizer if kv.key == "tokenizer.chat_template"]
            first = own or [KV("tokenizer.chat_template", bundled, T.STRING)]
            tokenizer = [kv for kv in tokenizer if kv.key != "tokenizer.chat_template"]
        return [
            KV("general.architecture", self.arch.gguf_arch, T.STRING),
            *first,
            *self.general_kvs(),
            *self.arch.model_kvs(file_type),
            KV("general.quantization_version", gguf.GGML_QUANT_VERSION, T.UINT32),
            *tokenizer,
        ]

    def general_kvs(self) -> list[KV]:
        """``general.type``, the sampling defaults of generation_config.json, ``general.name`` and what the model
        card (README.md) and the folder name say (basename, version, license, tags...), and the size label:
        gguf's own ``Metadata``, the code llama.cpp's converter runs."""
        total = sum(int(np.prod(t.shape)) for t in self.tensors)
        meta = gguf.Metadata.load(None, self.ckpt.path, None, total)
        if meta.name is None:
            meta.name = self.ckpt.path.name
        if meta.size_label is None and total > 0:
            meta.size_label = self.size_label()
        writer = gguf.GGUFWriter(path=None, arch=self.arch.gguf_arch)
        writer.add_type(gguf.GGUFType.MODEL)
        meta.set_gguf_meta_model(writer)
        return [KV(key, v.value, v.type, _item_type(v)) for key, v in writer.kv_data[0].items()
                if key != "general.architecture"]  # fmt: skip

    def size_label(self) -> str:
        sizes = [int(np.prod(t.shape)) for t in self.tensors]
        expert = sum(s for s, t in zip(sizes, self.tensors, strict=True) if "_exps." in t.name)
        total = sum(sizes)
        n_exp = self.arch.n_experts if expert else 0
        # gguf's size_label takes the parameters of one expert, as the GGUF writer counts them
        return gguf.utility.size_label(total, total - expert, expert // max(n_exp, 1), n_exp)


def _item_type(v: gguf.gguf_writer.GGUFValue) -> T | None:
    """An array's item type (the writer infers it from the first item when it was not given)."""
    if v.type != T.ARRAY:
        return None
    return v.sub_type or (T.get_type(v.value[0]) if v.value else T.STRING)


def float_type_for(t: OutTensor, outtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """llama.cpp's converter rule: a type the architecture fixes, else 1-D tensors and the listed F32 tensors
    stay F32."""
    if t.gguf_type is not None:
        return t.gguf_type
    if t.force_f32 or len(t.shape) <= 1:
        return GGMLQuantizationType.F32
    return outtype


def encode_float(t: OutTensor, gtype: GGMLQuantizationType, src: SourceArray | None = None) -> np.ndarray:
    """Produce a tensor's values in F32, F16 or BF16 (a BF16 source to BF16 is a bit copy; BF16 as uint16
    bits), or its encoded bytes when the architecture gives them (MXFP4, Q8_0, I32). ``src``: the values
    already produced."""
    if t.encoded is not None:
        return t.encoded()
    src = t.produce() if src is None else src
    if src.shape != t.shape:
        raise ForgeError(f"tensor {t.name}: produced shape {src.shape}, planned {t.shape}")
    if gtype == GGMLQuantizationType.BF16 and src.dtype == "BF16":
        return src.data
    f32 = src.float32()
    if gtype == GGMLQuantizationType.F32:
        return f32
    if gtype == GGMLQuantizationType.F16:
        return f32.astype(np.float16)
    return f32_to_bf16(f32)


_STORED = {
    "BF16": GGMLQuantizationType.BF16,
    "F16": GGMLQuantizationType.F16,
    "F32": GGMLQuantizationType.F32,
}


def byte_copy(t: OutTensor, gtype: GGMLQuantizationType) -> TensorWriter | None:
    """When the output bytes are the stored source bytes, a writer that copies them file to file."""
    if not t.verbatim or any(_STORED.get(s.dtype) != gtype for s in t.sources):
        return None
    ranges = [(s.shard, s.offset, s.nbytes) for s in t.sources]
    return lambda f: copy_ranges(f, ranges)


@dataclass
class ConvertReport:
    paths: list[Path]
    n_tensors: int
    bytes_written: int
    source_bytes: int
    seconds: float


def convert_checkpoint(
    hf_dir: str | Path,
    out: str | Path,
    outtype: str = "bf16",
    split_max_size: int | None = None,
    mtp: bool = True,
    mtp_only: bool = False,
    progress: bool = False,
) -> ConvertReport:
    """Convert a checkpoint folder to GGUF; memory stays bounded by the largest tensor. ``mtp_only``: the
    multi-token-prediction block alone, a draft model for speculative decoding (llama.cpp's ``--mtp``)."""
    if outtype not in OUTTYPES:
        raise ForgeError(f"unsupported --outtype {outtype!r}; choose from {', '.join(OUTTYPES)}")
    gtype, ftype = OUTTYPES[outtype]
    start = time.perf_counter()
    src = ModelSource.open(hf_dir, mtp=mtp, mtp_only=mtp_only)
    kvs = src.kvs(int(ftype))
    specs = [TensorSpec(t.name, t.shape, float_type_for(t, gtype)) for t in src.tensors]

    def data() -> Iterator[object]:
        for t, spec in zip(src.tensors, specs, strict=True):
            yield byte_copy(t, spec.ggml_type) or encode_float(t, spec.ggml_type)

    with byte_progress(sum(s.nbytes for s in specs), "convert", progress) as advance:

        def on_tensor(spec: TensorSpec) -> None:
            advance(spec.nbytes, spec.name)

        if split_max_size:
            paths = write_gguf_split(out, kvs, specs, data(), split_max_size, on_tensor=on_tensor)
        else:
            write_gguf(out, kvs, specs, data(), on_tensor=on_tensor)
            paths = [Path(out)]
    return ConvertReport(
        paths=paths,
        n_tensors=len(specs),
        bytes_written=sum(p.stat().st_size for p in paths),
        source_bytes=src.ckpt.total_bytes,
        seconds=time.perf_counter() - start,
    )
