"""What every architecture table provides, and the machinery they share.

An architecture maps a checkpoint's config.json to GGUF KVs and its tensors to GGUF tensors. The
mapping is planned from names and shapes alone; data is produced lazily, tensor by tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from forge.bulk import bf16_to_f32
from forge.checkpoint import Checkpoint, HFTensor
from forge.errors import ForgeError
from forge.gguf_file import KV, T

#: HF name -> (GGUF name, kept in F32 whatever the output type): the tables of ``Architecture.tabled``
Table = dict[str, tuple[str, bool]]
#: the tensors outside the layers of the llama-style checkpoints (Qwen MoEs, GLM)
GLOBAL_TENSORS: Table = {
    "lm_head.weight": ("output.weight", False),
    "embed_tokens.weight": ("token_embd.weight", False),
    "norm.weight": ("output_norm.weight", True),
}


class SourceArray:
    """Tensor values as stored: BF16 kept as uint16 bits (so bf16 -> bf16 is a bit copy). Given as ``parts``
    (per-expert tensors of one stored type), the values are those stacked, and the stack is made only if
    ``data`` is asked for: ``float32`` converts each part straight into its slot."""

    def __init__(self, data: np.ndarray | None, dtype: str, parts: tuple[np.ndarray, ...] = ()) -> None:
        self._data, self.dtype, self.parts = data, dtype, parts  # dtype: "BF16", "F16" or "F32"

    @property
    def data(self) -> np.ndarray:
        if self._data is None:
            self._data = np.stack(self.parts)
        return self._data

    @property
    def shape(self) -> tuple[int, ...]:
        if self._data is None:
            return (len(self.parts), *self.parts[0].shape)
        return self._data.shape

    def float32(self) -> np.ndarray:
        if self._data is not None:
            return (
                bf16_to_f32(self._data) if self.dtype == "BF16" else self._data.astype(np.float32, copy=False)
            )
        out = np.empty(self.shape, np.float32)  # parts straight into their slots: no stack of them is kept
        for part, slot in zip(self.parts, out, strict=True):
            if self.dtype == "BF16":
                bf16_to_f32(part, slot)
            else:
                slot[...] = part
        return out


@dataclass(frozen=True)
class OutTensor:
    """A planned GGUF tensor: name, numpy-order shape, and how to produce its values."""

    name: str
    shape: tuple[int, ...]
    produce: Callable[[], SourceArray]
    sources: tuple[HFTensor, ...]
    #: llama.cpp's converter keeps these in F32 whatever the output type (norms, router, ssm...)
    force_f32: bool = False
    #: the values are the sources' stored bytes in order (no transform): a plain byte copy
    verbatim: bool = False
    #: the GGUF type llama.cpp's converter writes whatever the output type (None: the float rule)
    gguf_type: GGMLQuantizationType | None = None
    #: the tensor's bytes in ``gguf_type`` when that is not a float type (MXFP4, Q8_0, I32)
    encoded: Callable[[], np.ndarray] | None = None


def raw(t: HFTensor) -> SourceArray:
    if t.dtype not in ("BF16", "F16", "F32"):
        return SourceArray(t.float32(), "F32")
    return SourceArray(t.raw(), t.dtype)


def stacked(parts: list[HFTensor]) -> SourceArray:
    dtypes = {p.dtype for p in parts}
    if len(dtypes) == 1 and parts[0].dtype in ("BF16", "F16", "F32"):
        return SourceArray(None, parts[0].dtype, tuple(p.raw() for p in parts))
    return SourceArray(np.stack([p.float32() for p in parts]), "F32")


def transformed(
    t: HFTensor | tuple[HFTensor, ...], fn: Callable[..., np.ndarray], exact: bool = True
) -> Callable[[], SourceArray]:
    """``fn`` applied to the stored values; ``exact`` means it only moves values (keeps dtype)."""
    ts = t if isinstance(t, tuple) else (t,)

    def produce() -> SourceArray:
        if exact:
            srcs = [raw(x) for x in ts]
            return SourceArray(np.ascontiguousarray(fn(*[s.data for s in srcs])), srcs[0].dtype)
        return SourceArray(np.ascontiguousarray(fn(*[x.float32() for x in ts]), dtype=np.float32), "F32")

    return produce


class Architecture:
    """Base of the per-architecture tables (one subclass per HF ``model_type``)."""

    hf_model_types: ClassVar[tuple[str, ...]]
    gguf_arch: ClassVar[str]
    #: HF name prefixes stripped before mapping (multimodal wrappers nest the text model).
    prefixes: ClassVar[tuple[str, ...]] = ("model.language_model.", "model.", "language_model.model.")
    #: the detected pre-tokenizer's name as llama.cpp records it for this family (e.g. llama-bpe -> glm4)
    pre_tokenizer_names: ClassVar[dict[str, str]] = {}
    #: llama.cpp's converter can write this family's MTP block alone, as a draft model (its --mtp)
    exports_mtp_alone: ClassVar[bool] = False
    #: write only the MTP block (set by architecture_for)
    mtp_only: bool = False
    #: (kind, token) special ids llama.cpp's converter sets for this family when the tokenizer files did not
    special_tokens: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, ckpt: Checkpoint, mtp: bool = True):
        self.ckpt = ckpt
        self.cfg = ckpt.config
        self.mtp = mtp

    # -- config helpers
    def hp(self, *keys: str, default: Any = ...) -> Any:
        for k in keys:
            if k in self.cfg and self.cfg[k] is not None:
                return self.cfg[k]
            rope = self.cfg.get("rope_parameters") or self.cfg.get("rope_scaling") or {}
            if k in rope and rope[k] is not None:
                return rope[k]
        if default is ...:
            raise ForgeError(f"{self.ckpt.path}/config.json: missing {keys[0]}")
        return default

    @property
    def n_layers(self) -> int:
        return int(self.hp("num_hidden_layers"))

    @property
    def n_experts(self) -> int:
        return int(self.hp("num_experts", "num_local_experts"))

    def kv(self, key: str, value: Any, vtype: GGUFValueType = T.UINT32) -> KV:
        return KV(f"{self.gguf_arch}.{key}", value, vtype)

    @property
    def head_dim(self) -> int:
        n_head = int(self.hp("num_attention_heads"))
        return int(self.hp("head_dim", default=int(self.hp("hidden_size")) // n_head))

    def moe_kvs(self, file_type: int, block_count: int, dense_ffn: bool) -> list[KV]:
        """The KVs the Qwen MoE converters share, in llama.cpp's order (``file_type`` included)."""
        n_head = int(self.hp("num_attention_heads"))
        ffn = [self.kv("feed_forward_length", int(self.hp("intermediate_size")))] if dense_ffn else []
        return [
            self.kv("block_count", block_count),
            self.kv("context_length", int(self.hp("max_position_embeddings"))),
            self.kv("embedding_length", int(self.hp("hidden_size"))),
            *ffn,
            self.kv("attention.head_count", n_head),
            self.kv("attention.head_count_kv", int(self.hp("num_key_value_heads", default=n_head))),
            self.kv("rope.freq_base", float(self.hp("rope_theta", default=10000.0)), T.FLOAT32),
            self.kv("attention.layer_norm_rms_epsilon", float(self.hp("rms_norm_eps")), T.FLOAT32),
            self.kv("expert_count", self.n_experts),
            self.kv("expert_used_count", int(self.hp("num_experts_per_tok"))),
            self.kv("attention.key_length", self.head_dim),
            self.kv("attention.value_length", self.head_dim),
            KV("general.file_type", file_type, T.UINT32),  # llama.cpp writes it here
            self.kv("expert_feed_forward_length", int(self.hp("moe_intermediate_size"))),
        ]

    def bundled_chat_template(self) -> str | None:
        """The chat template llama.cpp's converter writes for this family before anything else (right after
        ``general.architecture``; the model's own template, if any, then takes its place). None: no such."""
        return None

    # -- what subclasses provide
    def model_kvs(self, file_type: int) -> list[KV]:
        """Architecture KVs in llama.cpp's order, ``general.file_type`` where llama.cpp puts it."""
        raise NotImplementedError

    def map_tensor(self, name: str, t: HFTensor) -> list[OutTensor] | None:
        """Map one (prefix-stripped) HF tensor; None = part of a group (experts) handled later."""
        raise NotImplementedError

    # -- shared planning
    def strip(self, name: str) -> str | None:
        if name.startswith(("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")):
            return None  # vision tower: not part of the text model
        if name.startswith("mtp."):
            if not self.mtp:
                return None
            # the multi-token-prediction block is exported as one extra decoder layer
            return re.sub(r"^mtp\.layers\.0\.", f"layers.{self.n_layers}.", name)
        if name == "lm_head.weight":
            return name
        for p in self.prefixes:
            if name.startswith(p):
                return name[len(p) :]
        return name

    def plan(self) -> list[OutTensor]:
        """All GGUF tensors in llama.cpp's converter order."""
        experts: dict[tuple[int, str], dict[int, HFTensor]] = {}
        out: list[OutTensor] = []
        tied = True
        for t in self.ckpt:
            name = self.strip(t.name)
            if name is None:
                continue
            if name == "lm_head.weight":
                tied = False
            m = _EXPERT_RE.match(name)
            if m:
                layer, e, proj = int(m["layer"]), int(m["expert"]), m["proj"]
                experts.setdefault((layer, proj), {})[e] = t
                done = self._expert_group_done(experts, layer)
                if done:
                    out += done
                continue
            mapped = self.map_tensor(name, t)
            if mapped is None:
                raise ForgeError(f"{self.ckpt.path}: cannot map tensor {t.name} to GGUF ({self.gguf_arch})")
            out += mapped
        left = [k for k, v in experts.items() if v]
        if left:
            layer, proj = left[0]
            raise ForgeError(f"{self.ckpt.path}: layer {layer} has an incomplete set of {proj} experts")
        if tied and not self.cfg.get("tie_word_embeddings", False):
            raise ForgeError(f"{self.ckpt.path}: lm_head.weight is missing and tie_word_embeddings is false")
        return out

    def _expert_group_done(
        self, experts: dict[tuple[int, str], dict[int, HFTensor]], layer: int
    ) -> list[OutTensor]:
        n = self.n_experts
        groups = [experts.get((layer, p), {}) for p in ("down_proj", "gate_proj", "up_proj")]
        if any(len(g) < n for g in groups):
            return []
        out = []
        for proj, g in zip(("down", "gate", "up"), groups, strict=True):
            parts = [g[e] for e in range(n)]
            shape = (n, *parts[0].shape)
            out.append(
                OutTensor(
                    f"blk.{layer}.ffn_{proj}_exps.weight",
                    shape,
                    lambda p=parts: stacked(p),
                    tuple(parts),
                    verbatim=True,
                )
            )
            g.clear()
        return out

    @staticmethod
    def tabled(name: str, t: HFTensor, layer_tensors: Table, global_tensors: Table) -> list[OutTensor] | None:
        """``t`` written as it is under the name a table gives it: ``global_tensors`` by its whole name,
        ``layer_tensors`` by its name within ``layers.N.`` (as ``blk.N.``); None where neither has it."""
        if name in global_tensors:
            gname, f32 = global_tensors[name]
            return [OutTensor(gname, t.shape, lambda: raw(t), (t,), f32, verbatim=True)]
        m = LAYER_RE.match(name)
        if not m or m["rest"] not in layer_tensors:
            return None
        gname, f32 = layer_tensors[m["rest"]]
        return [OutTensor(f"blk.{m['layer']}.{gname}", t.shape, lambda: raw(t), (t,), f32, verbatim=True)]

    def fused_experts(self, layer: int, name: str, t: HFTensor) -> list[OutTensor]:
        """Fused expert tensors (``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj`` (E, H, I))."""
        if name.endswith("gate_up_proj"):
            half = t.shape[1] // 2
            return [
                OutTensor(f"blk.{layer}.ffn_gate_exps.weight", (t.shape[0], half, t.shape[2]),
                          transformed(t, lambda a: a[:, :half]), (t,)),
                OutTensor(f"blk.{layer}.ffn_up_exps.weight", (t.shape[0], half, t.shape[2]),
                          transformed(t, lambda a: a[:, half:]), (t,)),
            ]  # fmt: skip
        return [OutTensor(f"blk.{layer}.ffn_down_exps.weight", t.shape, lambda: raw(t), (t,), verbatim=True)]


_EXPERT_RE = re.compile(
    r"^layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
LAYER_RE = re.compile(r"^layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
