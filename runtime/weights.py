"""Model weights for the runtime: GGUF tensors (or a Hugging Face folder) -> torch tensors.

Routed expert tensors stay as their file bytes (zero-copy over the mmap on CPU; on the GPU where the CUDA
kernels compute their type): the backends compute on those bytes, or decode the selected experts (the torch
path), or keep them decoded within ``--expert-cache-mib``. The token embedding is decoded per looked-up row;
other tensors are decoded once, on first use, to float32 — except quantized products the CUDA kernels take.
"""

from __future__ import annotations

import math
import warnings
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from forge.errors import ForgeError
from forge.gguf_file import open_gguf
from runtime.dequant import dequantize as torch_dequantize

if TYPE_CHECKING:
    from runtime.experts import ExpertCache, LayerExperts

_MISSING = object()
# A token embedding up to this size (as float32) is decoded whole on first lookup, not per looked-up row.
SMALL_TABLE_BYTES = 64 << 20
# Bytes of decoded (float32) routed experts a model may keep resident; the rest are decoded on every use.
DEFAULT_EXPERT_BUDGET = 1 << 30
_FLOAT_VIEWS = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def dequantize(
    raw: torch.Tensor, qtype: GGMLQuantizationType, n_per_row: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 (..., row_bytes) in GGUF encoding -> (..., n_per_row) of ``dtype`` on raw's device."""
    if qtype in _FLOAT_VIEWS:
        return raw.contiguous().view(_FLOAT_VIEWS[qtype]).to(dtype)
    return torch_dequantize(raw, qtype, n_per_row, dtype=dtype)


@cache
def check_decodable(qtype: GGMLQuantizationType) -> None:
    """Raise ForgeError unless the runtime can dequantize this GGML type (or read it as integers: I32)."""
    if qtype == GGMLQuantizationType.I32:
        return
    if qtype not in GGML_QUANT_SIZES:
        raise ForgeError(f"quant type {qtype!r} is unknown to the runtime")
    block, size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(torch.zeros(1, size, dtype=torch.uint8), qtype, block)
    except Exception as exc:  # any failure of a decoder means: cannot run this file
        raise ForgeError(f"the runtime cannot decode quant type {qtype.name}") from exc


class ExpertTensor:
    """A stacked routed-expert weight (n_expert, rows, cols), kept encoded.

    ``resident`` tensors are decoded whole on first use and kept (when the model's expert budget allows);
    the others decode the experts a batch selects, on every use.
    """

    def __init__(
        self, raw: torch.Tensor, qtype: GGMLQuantizationType, cols: int, resident: bool = False
    ) -> None:
        self.raw, self.qtype, self.cols, self.resident = raw, qtype, cols, resident
        self.n_expert, self.rows = raw.shape[0], raw.shape[1]
        self._decoded: torch.Tensor | None = None

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (n,) int64 -> float32 (n, rows, cols)."""
        if self.resident:
            return self.decoded()[ids]
        return dequantize(self.raw[ids], self.qtype, self.cols)

    def decoded(self) -> torch.Tensor:
        """All experts as float32 (n_expert, rows, cols), decoded once."""
        if self._decoded is None:
            self._decoded = dequantize(self.raw, self.qtype, self.cols)
        return self._decoded

    def release(self) -> None:
        """Drop the decoded copy (its owner keeps it in another form) and decode per use from now on."""
        self._decoded, self.resident = None, False

    def per_expert(self, ids: list[int]) -> list[torch.Tensor]:
        """Float32 (rows, cols) matrices of experts ``ids``: views of the decoded tensor when resident."""
        if self.resident:
            full = self.decoded()
            return [full[i] for i in ids]
        return list(self.take(torch.tensor(ids, device=self.raw.device)).unbind(0))

    @property
    def decoded_nbytes(self) -> int:
        return self.n_expert * self.rows * self.cols * 4


class Weights:
    """What a model reads: metadata (GGUF keys) and tensors by GGUF name."""

    arch: str
    source: str
    device: torch.device

    def __init__(self, meta: dict[str, Any], device: torch.device, source: str) -> None:
        self.meta, self.device, self.source = meta, device, source
        self.expert_budget = DEFAULT_EXPERT_BUDGET
        # round matmul inputs as ggml's CPU backend does (to compare with llama.cpp's own figures)
        self.ggml_numerics = False
        from runtime.cpu_kernels import available, start_threads  # numba: imported when a model is loaded

        # one-token steps run compiled kernels over row-major weights
        self.cpu_kernels = available(torch.device(device))
        if self.cpu_kernels:
            start_threads()
        self.expert_cache: ExpertCache | None = None
        # routed experts stay the file's bytes in host memory whatever the device (runtime.hybrid computes them)
        self.host_experts = False
        self._experts_fit: bool | None = None  # all routed experts fit decoded in the budget (decided once)
        self._dense: dict[str, torch.Tensor] = {}
        arch = self.get("general.architecture", None)
        if not isinstance(arch, str):
            raise ForgeError(f"{source}: no general.architecture in the metadata")
        self.arch = arch

    # metadata -----------------------------------------------------------------------------------------
    def _lookup(self, key: str) -> Any:
        return self.meta.get(key, _MISSING)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        value = self._lookup(key)
        if value is _MISSING:
            if default is _MISSING:
                raise ForgeError(f"{self.source}: missing metadata key {key}")
            return default
        return value

    def hparam(self, key: str, default: Any = _MISSING) -> Any:
        """An architecture key, e.g. hparam('block_count') reads '<arch>.block_count'."""
        return self.get(f"{self.arch}.{key}", default)

    # tensors --------------------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        raise NotImplementedError

    def dense(self, name: str) -> torch.Tensor:
        """A whole tensor as float32 on the device (decoded once, then kept)."""
        if name not in self._dense:
            self._require(name)
            self._dense[name] = self._load_dense(name)
        return self._dense[name]

    def columns(self, names: list[str], order: torch.Tensor | None = None) -> torch.Tensor:
        """Matrices (a 1-D tensor counts as one row) stacked by rows, their rows permuted by ``order``,
        then transposed: a (n_in, total rows) float32 tensor, so ``x @ it`` is ``x @ W.T``. It is contiguous
        (faster for torch's one-token matmul) unless ``cpu_kernels``, whose kernels read ``it.T``'s rows.

        The decoded parts are not kept (each weight is held once, in this form); ``dense`` decodes again.
        """
        parts = [self.dense(n) for n in names]
        w = torch.cat([p[None, :] if p.dim() == 1 else p for p in parts])
        if order is not None:
            w = w[order]
        out = w.contiguous().T if self.cpu_kernels else w.T.contiguous()
        for n in names:
            self._dense.pop(n, None)
        return out

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a 2-D tensor (the token embedding), float32."""
        raise NotImplementedError

    def table(self, name: str) -> torch.Tensor:
        """An integer tensor (e.g. DeepSeek V4's token -> expert table ``ffn_gate_tid2eid``) as int64."""
        self._require(name)
        return self._table(name).to(self.device, torch.int64)

    def _table(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def qtype(self, name: str) -> GGMLQuantizationType:
        """The tensor's encoding in the source (float tensors: F32)."""
        return GGMLQuantizationType.F32

    def experts(self, name: str) -> ExpertTensor:
        """A routed-expert tensor, kept encoded; decoded to float32 at load (resident) only when all of the
        model's routed experts fit in the expert budget decoded (a small model: its fastest path), never
        some of them (a layer with some parts decoded could use neither the encoded-row kernels nor a fused
        resident matrix).

        With an expert cache (SSD streaming), routed experts are served by the cache instead.
        """
        self._require(name)
        cache = self.expert_cache
        if cache is not None:
            layer, role = _routed_parts(name)
            if layer in cache.layers:
                return cache.tensor(layer, role)
        if self.host_experts:
            return self._host_experts(name)
        t = self._experts(name)
        if self.cuda_computes(t.qtype):  # the cuda kernels read the file bytes: no float32 copy
            return t
        if self._experts_fit is None:
            self._experts_fit = self._routed_decoded_nbytes() <= self.expert_budget
        if self._experts_fit:
            t.resident = True
        if t.resident:
            t.decoded()  # at load, so that the first forward pass is not the one paying for it
        return t

    def _experts(self, name: str) -> ExpertTensor:
        raise NotImplementedError

    def _host_experts(self, name: str) -> ExpertTensor:
        raise ForgeError(f"{self.source}: routed experts held in host memory need a GGUF file")

    def _routed_decoded_nbytes(self) -> int:
        """Bytes of every routed-expert tensor decoded to float32."""
        return 0

    def cuda_computes(self, qtype: GGMLQuantizationType) -> bool:
        """The cuda kernels compute products of this type straight from its file bytes (device cuda, no ggml
        numerics, a quantized type they decode)."""
        if self.device.type != "cuda" or self.ggml_numerics or qtype == GGMLQuantizationType.F32:
            return False
        from runtime.backends import cuda_kernels

        return cuda_kernels.computes(self.device, qtype)

    def _require(self, name: str) -> None:
        if not self.has(name):
            raise ForgeError(f"{self.source}: missing tensor {name}")

    def _load_dense(self, name: str) -> torch.Tensor:
        raise NotImplementedError


class GGUFWeights(Weights):
    """Weights read from a GGUF file (forge's header parser; tensor data stays memory-mapped)."""

    def __init__(
        self, path: str | Path, device: str | torch.device = "cpu", verify_experts: bool = True
    ) -> None:
        path = Path(path)
        if not path.is_file():
            raise ForgeError(f"{path}: no such file")
        self.file = open_gguf(path)
        self._tensors = dict(self.file.tensors)
        self._raw: dict[str, torch.Tensor] = {}
        super().__init__({}, torch.device(device), str(path))
        self.path = path
        self.store = self._open_store(verify_experts)
        for t in self._tensors.values():
            check_decodable(t.ggml_type)
        self._routed: dict[str, tuple[int, int]] = {}  # expert-major: canonical name -> (layer, role index)
        if self.store is not None:
            for layer, lr in self.store.layers.items():
                for c in lr.components:
                    self._routed[lr.canonical_name(c.role)] = (layer, c.role)

    def _open_store(self, verify: bool) -> Any:
        """The expert-major store (forge.layout.ExpertStore) of a v1/v2 file, validated; None if canonical.

        ``verify``: also check the payload digest (with file reads, so that it leaves no pages mapped).
        """
        from forge.layout.source import STORE_TENSOR_NAMES

        names = [n for n in STORE_TENSOR_NAMES if n in self._tensors]
        if not names:
            return None
        from forge.layout import open_expert_store
        from runtime.experts import verify_store_payload

        store = open_expert_store(self.path, verify_payload=False)
        if verify:
            verify_store_payload(store)
        for n in names:
            del self._tensors[n]
        return store

    def expert_layers(self) -> dict[int, LayerExperts]:
        """Per layer, where the routed experts live in the file (one read each on expert-major files)."""
        from runtime.experts import canonical_layers, expert_major_layers

        if self.store is not None:
            return expert_major_layers(self.store)
        return canonical_layers(self._tensors, int(self.hparam("block_count")))

    def _lookup(self, key: str) -> Any:
        kv = self.file.kvs.get(key)
        return _MISSING if kv is None else kv.value

    def keys(self) -> list[str]:
        return list(self.file.kvs)

    def has(self, name: str) -> bool:
        return name in self._tensors or name in self._routed

    def _routed_decoded_nbytes(self) -> int:
        names = [n for n in (*self._tensors, *self._routed) if n.endswith("_exps.weight")]
        return sum(4 * math.prod(self.shape(n)) for n in names)

    def _component(self, name: str) -> Any:
        assert self.store is not None
        layer, role = self._routed[name]
        return self.store.layers[layer].components[role]

    def qtype(self, name: str) -> GGMLQuantizationType:
        self._require(name)
        if name in self._routed:
            return GGMLQuantizationType(self._component(name).ggml_type)
        return self._tensors[name].ggml_type

    def shape(self, name: str) -> tuple[int, ...]:
        """Torch order (reversed ggml ne)."""
        self._require(name)
        if name in self._routed:
            return tuple(int(n) for n in reversed(self._component(name).dims))
        return self._tensors[name].shape

    def _routed_array(self, name: str) -> np.ndarray:
        """An expert-major component as a strided (experts, rows, row_bytes) view of the records."""
        assert self.store is not None
        layer, _ = self._routed[name]
        c = self._component(name)
        records = self.store.layer_records(layer)[:, c.record_offset : c.record_offset + c.expert_bytes]
        rows = c.dims[1]
        row_bytes = c.expert_bytes // rows
        return np.lib.stride_tricks.as_strided(
            records, (c.dims[2], rows, row_bytes), (records.strides[0], row_bytes, 1), writeable=False
        )

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as uint8 (*shape[:-1], row_bytes), zero-copy on CPU.

        On expert-major files a routed tensor is a strided view: each expert's slice is one record.
        """
        if name not in self._raw:
            raw = self.host_raw(name)
            self._raw[name] = raw.to(self.device) if self.device.type != "cpu" else raw
        return self._raw[name]

    def host_raw(self, name: str) -> torch.Tensor:
        """``raw`` in host memory: the zero-copy view of the mapped file, whatever the device."""
        self._require(name)
        shape = self.shape(name)
        arr = (
            self._routed_array(name) if name in self._routed else self.file.raw(name).reshape(*shape[:-1], -1)
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mmap is read-only; we never write through it
            return torch.from_numpy(arr)

    def _load_dense(self, name: str) -> torch.Tensor:
        raw = self.raw(name)
        self._raw.pop(name, None)  # held decoded from now on, not twice
        return dequantize(raw, self.qtype(name), self.shape(name)[-1])

    def cuda_stack(
        self, names: list[str], order: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, GGMLQuantizationType] | None:
        """Matrices of one quantized type the cuda kernels compute, their file rows stacked (rows are
        encoded independently, so stacking and ``order`` permute whole encoded rows): (uint8 (rows,
        row_bytes) on the GPU, type); None when they are not all such (the caller takes ``columns``)."""
        qtypes = {self.qtype(n) for n in names}
        if len(qtypes) != 1 or any(len(self.shape(n)) != 2 for n in names):
            return None
        (qtype,) = qtypes
        if not self.cuda_computes(qtype):
            return None
        stacked = torch.cat([self.raw(n) for n in names]) if len(names) > 1 else self.raw(names[0])
        if order is not None:
            stacked = stacked[order]
        if len(names) > 1 or order is not None:
            for n in names:
                self._raw.pop(n, None)
        return stacked.contiguous(), qtype

    def cuda_expert_stack(self, names: list[str]) -> ExpertTensor | None:
        """Routed-expert tensors of one type the cuda kernels compute, each expert's rows stacked: (n_expert,
        sum of rows, row_bytes) on the GPU, so that one launch computes them all (gate and up); None when
        they are not all such, or when the experts are streamed or held in host memory."""
        if self.host_experts or any(n in self._raw for n in names):
            return None
        cache = self.expert_cache
        if cache is not None and any(_routed_parts(n)[0] in cache.layers for n in names):
            return None
        qtypes, shapes = {self.qtype(n) for n in names}, {tuple(self.shape(n)[::2]) for n in names}
        if len(qtypes) != 1 or len(shapes) != 1 or len(next(iter(shapes))) != 2:
            return None
        (qtype,) = qtypes
        if not self.cuda_computes(qtype):
            return None
        stacked = torch.cat([self.raw(n) for n in names], dim=1)
        for n in names:
            self._raw.pop(n, None)
        return ExpertTensor(stacked, qtype, self.shape(names[0])[-1])

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        self._require(name)
        if name not in self._dense and self.shape(name)[0] * self.shape(name)[-1] * 4 <= SMALL_TABLE_BYTES:
            self.dense(name)  # decoded once: decoding rows costs a dequantizer call per lookup
        if name in self._dense:
            return self._dense[name].index_select(0, ids)
        raw = self.raw(name).index_select(0, ids.to(self.device))
        return dequantize(raw, self.qtype(name), self.shape(name)[-1])

    def _experts(self, name: str) -> ExpertTensor:
        return ExpertTensor(self.raw(name), self.qtype(name), self.shape(name)[-1])

    def _host_experts(self, name: str) -> ExpertTensor:
        return ExpertTensor(self.host_raw(name), self.qtype(name), self.shape(name)[-1])

    def _table(self, name: str) -> torch.Tensor:
        if self.qtype(name) != GGMLQuantizationType.I32:
            raise ForgeError(f"{self.source}: {name} is {self.qtype(name).name}, not an I32 table")
        return torch.from_numpy(self.file.raw(name).view(np.int32).reshape(self.shape(name)).copy())


class TensorWeights(Weights):
    """Weights held as float tensors in GGUF layout (a Hugging Face folder mapped by ``load_hf_folder``).

    ``qtypes``: the encoding each tensor would have in the GGUF (F32 where not given), for ggml numerics.
    """

    def __init__(
        self,
        meta: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        device: str | torch.device,
        source: str,
        qtypes: dict[str, GGMLQuantizationType] | None = None,
    ) -> None:
        super().__init__(meta, torch.device(device), source)
        self.tensors = tensors
        self.qtypes = qtypes or {}

    def qtype(self, name: str) -> GGMLQuantizationType:
        return self.qtypes.get(name, GGMLQuantizationType.F32)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _load_dense(self, name: str) -> torch.Tensor:
        return self.tensors[name].to(self.device, torch.float32)

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(name)[ids.to(self.device)]

    def _experts(self, name: str) -> ExpertTensor:
        t = self.dense(name)  # already float32: resident at no cost
        return ExpertTensor(t.view(torch.uint8), GGMLQuantizationType.F32, t.shape[-1], resident=True)

    def _table(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def load_weights(
    path: str | Path,
    device: str | torch.device = "cpu",
    expert_budget: int = DEFAULT_EXPERT_BUDGET,
    ggml_numerics: bool = False,
    stream_experts: int | None = None,
    expert_policy: str = "lru",
    verify_experts: bool = True,
) -> Weights:
    """A GGUF file, or a Hugging Face folder (config.json + safetensors) of a supported architecture.

    ``expert_budget``: bytes of decoded routed experts to keep resident (0: decode on every use).
    ``stream_experts``: stream routed experts from the file through a cache of that many experts
    (eviction ``expert_policy``: lru or lfu) instead of keeping them mapped.
    ``verify_experts``: check an expert-major file's payload digest at load.
    """
    path = Path(path)
    if path.is_dir():
        weights: Weights = load_hf_folder(path, device)
        if stream_experts is not None:
            raise ForgeError(f"{path}: expert streaming needs a GGUF file, not a Hugging Face folder")
    else:
        weights = GGUFWeights(path, device, verify_experts)
    weights.expert_budget = expert_budget
    weights.ggml_numerics = ggml_numerics
    if stream_experts is not None:
        assert isinstance(weights, GGUFWeights)
        weights.expert_cache = open_expert_cache(weights, stream_experts, expert_policy)
    return weights


def open_expert_cache(weights: GGUFWeights, capacity: int, policy: str = "lru") -> ExpertCache:
    """An expert cache of ``capacity`` whole experts over the file's routed experts."""
    from runtime.experts import ExpertCache

    return ExpertCache(
        weights.path,
        weights.expert_layers(),
        capacity,
        int(weights.hparam("expert_used_count")),
        policy,
        weights.device,
    )


def _routed_parts(name: str) -> tuple[int, str]:
    """'blk.3.ffn_up_exps.weight' -> (3, 'up'); (-1, '') for any other name."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        role = parts[2].removeprefix("ffn_").removesuffix("_exps")
        if parts[2] == f"ffn_{role}_exps" and role in ("gate", "up", "down"):
            return int(parts[1]), role
    return -1, ""


# Hugging Face folders -------------------------------------------------------------------------------------


def load_hf_folder(folder: str | Path, device: str | torch.device = "cpu") -> TensorWeights:
    """A Hugging Face checkpoint folder as float32 tensors with the GGUF names, layout and metadata
    ``forge convert`` would write (the same architecture tables), so a folder and its GGUF run the same code.
    Tensors stored as BF16 that ``forge convert`` keeps BF16 report that type (for ggml numerics)."""
    from forge.convert import ModelSource, float_type_for

    bf16 = GGMLQuantizationType.BF16
    src = ModelSource.open(folder, mtp=False)
    meta = {kv.key: kv.value for kv in src.kvs(file_type=0)}
    tensors = {t.name: torch.from_numpy(np.ascontiguousarray(t.produce().float32())) for t in src.tensors}
    qtypes = {
        t.name: bf16
        for t in src.tensors
        if float_type_for(t, bf16) == bf16 and all(s.dtype == "BF16" for s in t.sources)
    }
    return TensorWeights(meta, tensors, device, str(folder), qtypes)
