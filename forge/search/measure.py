"""What each candidate costs: the mean KL divergence from the unquantized model when one group alone is
quantized to one type, measured with the runtime on the calibration text.

- The candidates: groups of quantizable tensors (one tensor each, or one family per layer), and per group
  the types it can take, after llama.cpp's fallbacks (``forge.quant.plan.with_fallback``) and without the
  types whose encoder needs importance weights the imatrix lacks for that tensor. Sizes are exact bytes.
- The encodings: one GGUF per requested type holding every tensor that can take it, made by
  ``forge.quant.quantize`` (so the bytes are the ones any build with that type writes, and a final build
  with ``reuse=`` of these files copies them). Kept next to the output and reused across runs.
- The reference: the source model's log-probabilities on the scored tokens, and the hidden state entering
  every layer, computed once. A candidate in layer L reruns layers L.. only (the earlier ones are the
  reference's), on a model whose weights take that group's tensors from the type's file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGMLQuantizationType as Q

from forge.atomic import atomic_output
from forge.errors import ForgeError
from forge.gguf_file import tensor_nbytes
from forge.imatrix.importance import importance_for
from forge.imatrix.model import Imatrix
from forge.quant.plan import NEEDS_IMATRIX, is_quantizable, processing_order, with_fallback
from forge.quant.source import QuantSource, SrcTensor
from forge.quant.types import get_type

#: candidate types when ``--types`` is not given (llama.cpp's K- and i-quants from 2 to 8.5 bits)
DEFAULT_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "Q2_K", "IQ3_XXS", "IQ3_S", "Q3_K", "IQ4_XS", "Q4_K",
                 "Q5_K", "Q6_K", "Q8_0")  # fmt: skip
GRANULARITIES = ("tensor", "family-layer")
MEASUREMENTS_VERSION = 1

_FAMILIES = [
    (re.compile(r"ffn_(gate|up|down|gate_up)_exps"), "ffn_exps"),
    (re.compile(r"ffn_(gate|up|down)_shexp"), "ffn_shexp"),
    (re.compile(r"ffn_(gate|up|down)\.weight"), "ffn"),
    (re.compile(r"attn_|wqkv"), "attn"),
    (re.compile(r"ssm_|time_mix"), "ssm"),
]


@dataclass
class Option:
    """One way to quantize a group: a type per tensor (after fallbacks) and the exact bytes."""

    label: str  # the requested type's name (e.g. "Q4_K")
    types: tuple[Q, ...]  # per tensor of the group, in the group's order
    size: int


@dataclass
class Group:
    name: str
    tensors: list[str]
    layer: int  # the first layer it touches: -1 token embedding, n_layer the output head
    options: list[Option] = field(default_factory=list)


def layer_of(name: str, n_layer: int) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    if m:
        return int(m.group(1))
    return -1 if name.startswith("token_embd") else n_layer


def family_of(name: str) -> str:
    m = re.match(r"blk\.(\d+)\.(.*)", name)
    if not m:
        return name.removesuffix(".weight")
    for rx, fam in _FAMILIES:
        if rx.search(m.group(2)):
            return f"blk.{m.group(1)}.{fam}"
    return name.removesuffix(".weight")


def parse_types(spec: str | None) -> list[str]:
    if not spec:
        return list(DEFAULT_TYPES)
    names = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        qt = get_type(item)  # ForgeError naming the unknown type
        name = qt.ggml_type.name
        if name not in names:
            names.append(name)
    if not names:
        raise ForgeError("--types names no type")
    return names


def option_for(t: SrcTensor, qtype: Q, imatrix: Imatrix | None) -> Q | None:
    """The type ``t`` ends up with when asked for ``qtype`` (llama.cpp's fallbacks), or None when that
    encoding needs importance weights the imatrix does not have for ``t``."""
    eff, _ = with_fallback(qtype, t.shape[-1])
    qt = get_type(eff)
    if not (qt.uses_imatrix or eff in NEEDS_IMATRIX or getattr(qt, "requires_importance", False)):
        return eff
    n_mat = t.shape[0] if len(t.shape) == 3 else 1
    has = imatrix is not None and importance_for(imatrix, t.name, t.shape[-1], n_mat) is not None
    exempt = t.name in ("token_embd.weight", "output.weight")
    if not has and (getattr(qt, "requires_importance", False) or (eff in NEEDS_IMATRIX and not exempt)):
        return None
    return eff


def make_groups(
    source: QuantSource, types: list[str], imatrix: Imatrix | None, granularity: str
) -> tuple[list[Group], int]:
    """The groups with their options (sizes exact), and the bytes of the tensors no option changes."""
    if granularity not in GRANULARITIES:
        raise ForgeError(f"--granularity must be one of {', '.join(GRANULARITIES)}, not {granularity!r}")
    with quiet_importance():
        return _make_groups(source, types, imatrix, granularity)


@contextlib.contextmanager
def quiet_importance() -> Iterator[None]:
    """importance_for logs experts without imatrix data on every call; the builds say it once each."""
    logger = logging.getLogger("forge.imatrix.importance")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _make_groups(
    source: QuantSource, types: list[str], imatrix: Imatrix | None, granularity: str
) -> tuple[list[Group], int]:
    tensors = {t.name: t for t in source.tensors()}
    n_layer = source.hparam("block_count", 1)
    fixed = 0
    groups: dict[str, Group] = {}
    for name in processing_order(list(tensors)):
        t = tensors[name]
        if not is_quantizable(t):
            fixed += tensor_nbytes(t.shape, t.ggml_type)
            continue
        key = name if granularity == "tensor" else family_of(name)
        g = groups.setdefault(key, Group(key.removesuffix(".weight"), [], layer_of(name, n_layer)))
        g.tensors.append(name)
        g.layer = min(g.layer, layer_of(name, n_layer))
    for g in groups.values():
        seen: set[tuple[Q, ...]] = set()
        for label in types:
            effs = [option_for(tensors[n], Q[label], imatrix) for n in g.tensors]
            if any(e is None for e in effs):
                continue
            key_types = tuple(e for e in effs if e is not None)
            if key_types in seen:  # another requested type gives the same bytes (a fallback)
                continue
            seen.add(key_types)
            size = sum(tensor_nbytes(tensors[n].shape, e) for n, e in zip(g.tensors, key_types, strict=True))
            g.options.append(Option(label, key_types, size))
        if not g.options:
            raise ForgeError(
                f"{g.name}: none of the types {', '.join(types)} can be used for it"
                + ("" if imatrix is not None else " without an importance matrix (pass --imatrix FILE)")
            )
    return list(groups.values()), fixed


def type_file_recipe(source: QuantSource, label: str, imatrix: Imatrix | None) -> str:
    """A recipe giving every tensor that can take ``label`` that type, the others their source type."""
    lines = [f'name = "search-{label.lower()}"', f'default = "{label.lower()}"']
    with quiet_importance():
        ineligible = [
            t for t in source.tensors() if is_quantizable(t) and option_for(t, Q[label], imatrix) is None
        ]
    for t in ineligible:
        lines += ["", "[[rules]]", f'name = "{t.name}"', f'type = "{t.ggml_type.name.lower()}"']
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------
# measuring


class Measurements:
    """The costs measured so far, persisted (atomically, after every measurement) as JSON next to the
    output; a file made with other settings is not used."""

    def __init__(self, path: Path, settings: dict) -> None:
        self.path, self.settings = path, settings
        self.costs: dict[str, dict[str, float]] = {}
        self.points: dict[str, float] = {}  # whole models: ",".join(label per group) -> measured KLD
        self.proxy: dict[str, dict[str, float]] = {}  # --proxy: group -> label -> weighted weight error
        self.reference: dict = {}
        self.stale = False
        self.previous: dict = {}
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError, UnicodeDecodeError):
                data = {}
            if data.get("version") == MEASUREMENTS_VERSION and data.get("settings") == settings:
                self.costs = {g: dict(v) for g, v in data.get("costs", {}).items()}
                self.points = dict(data.get("points", {}))
                self.proxy = {g: dict(v) for g, v in data.get("proxy", {}).items()}
                self.reference = data.get("reference", {})
            else:
                self.stale, self.previous = True, data

    def get(self, group: str, label: str) -> float | None:
        return self.costs.get(group, {}).get(label)

    def put(self, group: str, label: str, kld: float) -> None:
        self.costs.setdefault(group, {})[label] = kld
        self.save()

    def put_point(self, key: str, kld: float) -> None:
        self.points[key] = kld
        self.save()

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.costs.values())

    def save(self) -> None:
        data = {"version": MEASUREMENTS_VERSION, "settings": self.settings, "reference": self.reference,
                "costs": self.costs, "points": self.points, "proxy": self.proxy}  # fmt: skip
        with atomic_output(self.path) as f:
            f.write(json.dumps(data, indent=1, sort_keys=True).encode())


def _mixed_weights_class() -> type:
    from runtime.weights import GGUFWeights

    class MixedWeights(GGUFWeights):
        """The base file's weights, with some tensors taken from other files (same names and shapes)."""

        def __init__(self, path: Path, overlay: dict[str, GGUFWeights], shared: dict | None = None) -> None:
            super().__init__(path, "cpu", verify_experts=False)
            self.overlay = overlay
            self.shared = {} if shared is None else shared

        def columns(self, names: list[str], order=None):  # noqa: ANN001, ANN202 - torch.Tensor
            """The base's decoded matrices are decoded once for all variants (``shared``, kept by the meter):
            a variant decodes only the tensors it changes. On a 35B-shaped layer, rebuilding the float32
            copies of every unchanged matrix (the LM head above all) was most of a candidate's cost."""
            if order is not None or any(n in self.overlay for n in names):
                return super().columns(names, order)
            key = tuple(names)
            if key not in self.shared:
                self.shared[key] = super().columns(names)
            return self.shared[key]

        def qtype(self, name: str) -> Q:
            o = self.overlay.get(name)
            return o.qtype(name) if o is not None else super().qtype(name)

        def raw(self, name: str):  # noqa: ANN202 - torch.Tensor
            o = self.overlay.get(name)
            return o.raw(name) if o is not None else super().raw(name)

    return MixedWeights


class KldMeter:
    """Mean KL divergence of a model variant from the base model on fixed chunks of tokens."""

    def __init__(self, base: Path, tokens: list[int], n_ctx: int, n_chunks: int) -> None:
        import torch

        from runtime.models import build_model
        from runtime.weights import load_weights

        self.base = base
        self.shared: dict = {}  # the base's decoded matrices, shared by every variant (MixedWeights.columns)
        self.n_ctx = n_ctx
        self.first = n_ctx // 2
        weights = load_weights(base, "cpu", verify_experts=False)
        model = build_model(weights)
        if n_ctx > model.n_ctx_train:
            raise ForgeError(f"--ctx {n_ctx} is longer than the model's context ({model.n_ctx_train})")
        available = len(tokens) // n_ctx
        if available < 1 or len(tokens) < 2 * n_ctx:
            raise ForgeError(f"the text has {len(tokens)} tokens; at least 2 x ctx = {2 * n_ctx} are needed")
        self.n_chunks = min(n_chunks, available)
        self.ids = torch.tensor(tokens[: self.n_chunks * n_ctx], dtype=torch.long).view(self.n_chunks, n_ctx)
        self.n_layer = model.n_layer
        self.ref_logp: list = []
        self.hidden: list[list] = [[] for _ in range(model.n_layer + 1)]  # input of layer L (n: of the head)
        with torch.inference_mode():
            for c in range(self.n_chunks):
                state = model.new_state(n_ctx)
                h = model.weights.rows("token_embd.weight", self.ids[c])
                for layer in range(model.n_layer):
                    self.hidden[layer].append(h)
                    h = model._block(layer, h, state)
                self.hidden[model.n_layer].append(h)
                self.ref_logp.append(self._head(model, h))
        self.ref_p = [lp.exp() for lp in self.ref_logp]
        targets = [self.ids[c, self.first + 1 :] for c in range(self.n_chunks)]
        nll = torch.cat(
            [-lp.gather(1, t[:, None])[:, 0].double() for lp, t in zip(self.ref_logp, targets, strict=True)]
        )
        self.perplexity = math.exp(nll.mean().item())
        self.scored = int(nll.numel())

    def _head(self, model: object, h: object) -> object:
        import torch

        from runtime.models.qwen3moe import rms_norm

        logits = model.output(rms_norm(h, model.output_norm, model.eps))  # type: ignore[attr-defined]
        logits = logits[self.first : -1].float()
        if not torch.isfinite(logits).all():
            raise ForgeError("non-finite logits while measuring (a candidate encoding overflowed)")
        return torch.log_softmax(logits, dim=-1)

    def kld(self, model: object, start: int) -> float:
        """Mean KLD of ``model`` when the layers before ``start`` are the base model's (-1: from the
        embedding; n_layer: only the head)."""
        import torch

        total, n = 0.0, 0
        with torch.inference_mode():
            for c in range(self.n_chunks):
                state = model.new_state(self.n_ctx)  # type: ignore[attr-defined]
                if start < 0:
                    h = model.weights.rows("token_embd.weight", self.ids[c])  # type: ignore[attr-defined]
                    start_layer = 0
                else:
                    h, start_layer = self.hidden[start][c], start
                for layer in range(start_layer, self.n_layer):
                    h = model._block(layer, h, state)  # type: ignore[attr-defined]
                logp = self._head(model, h)
                k = (self.ref_p[c] * (self.ref_logp[c] - logp)).sum(-1).double()
                total += float(k.sum())
                n += k.numel()
        return total / n

    def kld_of_file(self, path: Path) -> float:
        from runtime.models import load_model

        return self.kld(load_model(path, verify_experts=False), -1)

    def variant(self, overlay: dict[str, object]) -> object:
        from runtime.models import build_model

        return build_model(_mixed_weights_class()(self.base, overlay, self.shared))


def measure(
    groups: list[Group],
    meter: KldMeter,
    type_files: dict[str, Path],
    store: Measurements,
    progress: Callable[[int, int, str], None] | None = None,
    only: set[tuple[str, str]] | None = None,
) -> float:
    """Measure every (group, option) not in ``store`` yet (of ``only``: (group, label) pairs, when given);
    returns the seconds spent."""
    from runtime.weights import GGUFWeights

    todo = [(g, o) for g in groups for o in g.options if store.get(g.name, o.label) is None
            and (only is None or (g.name, o.label) in only)]  # fmt: skip
    total = sum(len(g.options) for g in groups) if only is None else len(only)
    done = total - len(todo)
    t0 = time.perf_counter()
    for label in sorted({o.label for _, o in todo}, key=lambda s: list(type_files).index(s)):
        w = GGUFWeights(type_files[label], "cpu", verify_experts=False)
        for g, o in [(g, o) for g, o in todo if o.label == label]:
            model = meter.variant({n: w for n in g.tensors})
            store.put(g.name, o.label, max(meter.kld(model, g.layer), 0.0))
            done += 1
            if progress:
                progress(done, total, f"{g.name} {o.label}")
    return time.perf_counter() - t0


def choice_key(groups: list[Group], choice: list[int]) -> str:
    return ",".join(g.options[j].label for g, j in zip(groups, choice, strict=True))


def measure_choice(
    groups: list[Group], choice: list[int], meter: KldMeter, type_files: dict[str, Path], store: Measurements
) -> float:
    """The mean KLD of the whole model with every group at its chosen option (persisted as a point)."""
    from runtime.weights import GGUFWeights

    key = choice_key(groups, choice)
    if key not in store.points:
        opened: dict[str, GGUFWeights] = {}
        overlay = {}
        for g, j in zip(groups, choice, strict=True):
            label = g.options[j].label
            if label not in opened:
                opened[label] = GGUFWeights(type_files[label], "cpu", verify_experts=False)
            overlay.update(dict.fromkeys(g.tensors, opened[label]))
        store.put_point(key, max(meter.kld(meter.variant(overlay), -1), 0.0))
    return store.points[key]


def settings_key(
    model: Path, imatrix: Path | None, text: str, n_ctx: int, n_chunks: int, granularity: str
) -> dict:
    def stamp(p: Path) -> dict:
        st = p.stat()
        return {"path": str(p.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}

    def stamp_model(p: Path) -> dict | list:
        if p.is_dir():
            return [stamp(f) for f in sorted(p.iterdir()) if f.is_file()]
        return stamp(p)

    return {
        "model": stamp_model(model),
        "imatrix": stamp(imatrix) if imatrix is not None else None,
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "ctx": n_ctx,
        "chunks": n_chunks,
        "granularity": granularity,
    }


def cost_table(groups: Iterable[Group], store: Measurements) -> list[list[float]]:
    return [[float(store.get(g.name, o.label)) for o in g.options] for g in groups]  # type: ignore[arg-type]
