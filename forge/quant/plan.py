"""The tensor plan: for every tensor, its output type, why, and whether it is encoded or copied.

Follows llama-quantize: which tensors are quantized at all, the processing order (which the mixture
rules' running counters follow), and the fallbacks for rows a type's block size does not divide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q

from forge.errors import ForgeError
from forge.gguf_file import TensorSpec
from forge.imatrix.importance import importance_for
from forge.imatrix.model import Imatrix
from forge.quant.recipe import Recipe, Rule
from forge.quant.source import FLOAT_TYPES, QuantSource, SrcTensor
from forge.quant.types import get_type

#: llama.cpp's fallback when a row length is not a multiple of the type's block size
FALLBACK = {
    **dict.fromkeys((Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.IQ4_XS), Q.IQ4_NL),
    Q.Q2_K: Q.Q4_0,
    Q.Q3_K: Q.Q4_0,
    Q.Q4_K: Q.Q5_0,
    Q.Q5_K: Q.Q5_1,
    Q.Q6_K: Q.Q8_0,
}
#: 2-D tensors llama-quantize never quantizes (besides norms): router, conv, ssm parameters...
NOT_QUANTIZED = re.compile(
    r"ffn_gate_inp\.weight|ffn_gate_tid2eid\.weight|ssm_conv1d|_norm\.weight|pos_embd|token_types|time_mix_|conv1d"
)
#: types llama-quantize refuses to make without importance weights (except token_embd / output)
NEEDS_IMATRIX = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S, Q.IQ1_M)


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    src_type: Q
    out_type: Q
    action: str  # "encode", "copy" (from the source, unchanged) or "reuse" (from a prior build)
    reason: str
    importance: object = None  # float32 (n_mat, n_per_row) or None
    prior: object = None  # reuse.PriorTensor when action == "reuse"

    @property
    def spec(self) -> TensorSpec:
        # llama-quantize writes ggml_n_dims dimensions: trailing ne of 1 (leading numpy dims) dropped
        shape = self.shape
        while len(shape) > 1 and shape[0] == 1:
            shape = shape[1:]
        return TensorSpec(self.name, shape, self.out_type)


def processing_order(names: list[str]) -> list[str]:
    """llama-quantize's order: non-block tensors by name, then blocks by layer number, names inside."""

    def key(name: str) -> tuple[int, int, str]:
        m = re.match(r"blk\.(\d+)\.", name)
        return (1, int(m.group(1)), name) if m else (0, 0, name)

    return sorted(names, key=key)


def is_quantizable(t: SrcTensor) -> bool:
    ne = list(reversed(t.shape))
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return t.name.endswith("weight") and len(ne) >= 2 and not NOT_QUANTIZED.search(t.name)


def _layer(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else 0


def with_fallback(qtype: Q, n_per_row: int) -> tuple[Q, str]:
    if n_per_row % get_type(qtype).block_size == 0:
        return qtype, ""
    fb = FALLBACK.get(qtype, Q.F16)
    if n_per_row % get_type(fb).block_size:
        fb = Q.F16
    return fb, f"; row length {n_per_row} is not a multiple of {qtype.name}'s block: {fb.name} instead"


def make_plan(
    source: QuantSource,
    recipe: Recipe,
    overrides: list[tuple[str, str]] = (),
    imatrix: Imatrix | None = None,
    allow_requantize: bool = False,
) -> list[PlannedTensor]:
    tensors = {t.name: t for t in source.tensors()}
    order = processing_order(list(tensors))
    quantizable = [n for n in order if is_quantizable(tensors[n])]
    for pattern, qtype in overrides:
        if not any(re.search(pattern, n) for n in quantizable):
            raise ForgeError(
                f"--tensor-type {pattern}={qtype.lower()}: the pattern matches no quantizable tensor"
            )
    n_head = source.hparam("attention.head_count", 1)
    facts = {
        "n_layer": source.hparam("block_count", 1),
        "n_expert": source.hparam("expert_count", 0),
        "n_head": n_head,
        "n_head_kv": source.hparam("attention.head_count_kv", n_head),
        "n_embd": source.hparam("embedding_length", 0),
        "has_imatrix": int(imatrix is not None),
        # llama-quantize treats token_embd as the output (output's rules) when there is no output.weight
        "tied_embeddings": int("output.weight" not in tensors),
    }
    facts["n_gqa"] = facts["n_head"] // max(facts["n_head_kv"], 1)
    counters: dict[Rule, dict[str, int]] = {}
    for rule in recipe.rules:
        if rule.index == "counter":
            matched = [n for n in quantizable if rule.matches(n)]
            counters[rule] = {n: i for i, n in enumerate(matched)}

    plan = []
    for name in order:
        t = tensors[name]
        if not is_quantizable(t):
            plan.append(PlannedTensor(name, t.shape, t.ggml_type, t.ggml_type, "copy", "not quantized"))
            continue
        if t.ggml_type not in FLOAT_TYPES and not allow_requantize:
            raise ForgeError(
                f"tensor {name} is already quantized ({t.ggml_type.name}); pass --allow-requantize"
            )

        # matrices in the tensor (ggml's ne[2]): the experts of a merged expert tensor, else 1
        n_mat = t.shape[-3] if len(t.shape) >= 3 else 1

        def env_for(rule: Rule, name: str = name, n_mat: int = n_mat) -> dict[str, int]:
            if rule.index == "counter":
                idx = counters[rule]
                return {**facts, "n_mat": n_mat, "i": idx.get(name, 0), "n": len(idx)}
            return {**facts, "n_mat": n_mat, "i": _layer(name), "n": facts["n_layer"]}

        type_name, reason = recipe.type_for(name, env_for, overrides)
        qtype, note = with_fallback(get_type(type_name).ggml_type, t.shape[-1])
        importance = _importance(imatrix, t, qtype)
        exempt = name in ("token_embd.weight", "output.weight")  # llama-quantize's exemption
        must = getattr(get_type(qtype), "requires_importance", False)  # the encoder cannot run without
        if importance is None and (must or (qtype in NEEDS_IMATRIX and not exempt)):
            raise ForgeError(
                f"tensor {name} needs an importance matrix for {qtype.name}"
                + (" (the imatrix has no entry for it)" if imatrix is not None else " (pass --imatrix FILE)")
            )
        same = qtype == t.ggml_type
        plan.append(
            PlannedTensor(
                name, t.shape, t.ggml_type, qtype, "copy" if same else "encode", reason + note, importance
            )
        )
    return plan


def _importance(imatrix: Imatrix | None, t: SrcTensor, qtype: Q) -> object:
    if imatrix is None or not get_type(qtype).uses_imatrix:
        return None
    n_mat = t.shape[0] if len(t.shape) == 3 else 1
    return importance_for(imatrix, t.name, t.shape[-1], n_mat)
