"""Recipes: which quant type each tensor gets. TOML data, an ordered list of rules plus a default.

Precedence (first that applies wins):
1. ``--tensor-type PATTERN=TYPE`` overrides, in command-line order (regex search on the name);
2. rules naming a tensor exactly (``name = "output.weight"``);
3. pattern rules (``pattern = "attn_v"``, a regex search), in file order, whose ``when`` holds;
4. the recipe's ``default``.

A rule's ``when`` is a small arithmetic/boolean expression over: ``i`` and ``n`` (with ``index =
"layer"``, the default: the tensor's layer number and the layer count; with ``index = "counter"``:
the tensor's position among the tensors the rule's pattern matches, in llama-quantize's processing
order, and their number), and model facts ``n_layer``, ``n_expert``, ``n_head``, ``n_head_kv``,
``n_gqa``, ``n_embd``, ``has_imatrix``, ``tied_embeddings`` (no ``output.weight``: llama-quantize gives
``token_embd`` the output's type), and the tensor's ``n_mat`` (ggml's ne[2]: the experts of a merged
expert tensor, else 1). ``/`` and ``//`` are integer divisions (as in llama.cpp's C).
"""

from __future__ import annotations

import ast
import operator
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from forge.errors import ForgeError
from forge.quant.types import get_type

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: the presets: package data (``forge/recipes/*.toml``), read the same from a checkout or an installed wheel
PRESETS = resources.files("forge") / "recipes"

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}  # fmt: skip
_CMPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
         ast.Eq: operator.eq, ast.NotEq: operator.ne}  # fmt: skip


def _eval(node: ast.AST, env: dict[str, int]) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body, env)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, bool)):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ForgeError(f"unknown name {node.id!r} (known: {', '.join(sorted(env))})")
        return env[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.BoolOp):
        values = [_eval(v, env) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        v = _eval(node.operand, env)
        return (not v) if isinstance(node.op, ast.Not) else -v
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = _eval(comp, env)
            if type(op) not in _CMPS or not _CMPS[type(op)](left, right):
                return False
            left = right
        return True
    raise ForgeError(f"unsupported expression element {ast.dump(node)[:40]}")


@dataclass(frozen=True)
class Rule:
    type: str
    name: str | None = None
    pattern: str | None = None
    when: str | None = None
    index: str = "layer"
    line: int = 0
    source: str = "<recipe>"

    def matches(self, tensor: str) -> bool:
        if self.name is not None:
            return tensor == self.name
        return re.search(self.pattern or "", tensor) is not None

    def holds(self, env: dict[str, int]) -> bool:
        if not self.when:
            return True
        try:
            return bool(_eval(ast.parse(self.when, mode="eval"), env))
        except (ForgeError, ArithmeticError, TypeError, ValueError) as e:
            raise ForgeError(f"{self.source}: line {self.line}: when = {self.when!r}: {e}") from None


@dataclass
class Recipe:
    name: str
    default: str
    rules: list[Rule] = field(default_factory=list)
    file_type: str | None = None
    version: int = 1
    text: str = ""

    def type_for(self, tensor: str, env_for: Any, overrides: list[tuple[str, str]] = ()) -> tuple[str, str]:
        """(type name, reason). ``env_for(rule)`` gives the ``when`` variables for that rule."""
        for pattern, qtype in overrides:
            if re.search(pattern, tensor):
                return qtype, f"--tensor-type {pattern}={qtype}"
        for rule in [r for r in self.rules if r.name is not None] + [r for r in self.rules if r.name is None]:
            if rule.matches(tensor) and rule.holds(env_for(rule)):
                return rule.type, f"rule at line {rule.line}"
        return self.default, "default"


def _line_of(text: str, needle: str) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return i
    return 0


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ForgeError(f"{source}: malformed recipe: {e}") from None
    if "default" not in data:
        raise ForgeError(f'{source}: recipe needs a `default = "TYPE"` line')
    _check_type(data["default"], source, _line_of(text, "default"))
    rules = []
    for k, raw in enumerate(data.get("rules", [])):
        line = _line_of(text, str(raw.get("pattern") or raw.get("name") or "")) if raw else 0
        where = f"{source}: line {line} (rule {k + 1})"
        unknown = set(raw) - {"type", "name", "pattern", "when", "index"}
        if unknown:
            raise ForgeError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        if "type" not in raw or ("name" in raw) == ("pattern" in raw):
            raise ForgeError(f"{where}: a rule needs `type` and exactly one of `name` or `pattern`")
        _check_type(raw["type"], source, line)
        if raw.get("index", "layer") not in ("layer", "counter"):
            raise ForgeError(f"{where}: index must be 'layer' or 'counter'")
        if "pattern" in raw:
            try:
                re.compile(raw["pattern"])
            except re.error as e:
                raise ForgeError(f"{where}: bad pattern {raw['pattern']!r}: {e}") from None
        if "when" in raw:
            try:
                ast.parse(raw["when"], mode="eval")
            except SyntaxError:
                raise ForgeError(f"{where}: cannot parse when = {raw['when']!r}") from None
        rules.append(Rule(raw["type"].upper(), raw.get("name"), raw.get("pattern"), raw.get("when"),
                          raw.get("index", "layer"), line, source))  # fmt: skip
    return Recipe(
        name=str(data.get("name", Path(source).stem)),
        default=data["default"].upper(),
        rules=rules,
        file_type=data.get("file_type"),
        version=int(data.get("version", 1)),
        text=text,
    )


def _check_type(name: str, source: str, line: int) -> None:
    try:
        get_type(name)
    except ForgeError as e:
        raise ForgeError(f"{source}: line {line}: {e}") from None


def available_recipes() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in PRESETS.iterdir() if p.name.endswith(".toml"))


def load_recipe(name_or_path: str) -> Recipe:
    """A shipped preset by name (``q4_k_m``) or a TOML file path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        preset = PRESETS / f"{name_or_path.lower()}.toml"
        if not preset.is_file():
            raise ForgeError(f"unknown recipe {name_or_path!r}; presets: {', '.join(available_recipes())}")
        return parse_recipe(preset.read_text(encoding="utf-8"), str(preset))
    if not path.is_file():
        raise ForgeError(f"{path}: no such recipe file")
    return parse_recipe(path.read_text(encoding="utf-8"), str(path))


def parse_overrides(items: list[str]) -> list[tuple[str, str]]:
    """``--tensor-type PATTERN=TYPE`` items (pattern lower-cased, as llama-quantize does)."""
    out = []
    for item in items:
        pattern, sep, qtype = item.rpartition("=")
        if not sep or not pattern:
            raise ForgeError(f"--tensor-type {item!r}: expected PATTERN=TYPE")
        get_type(qtype)
        try:
            re.compile(pattern.lower())
        except re.error as e:
            raise ForgeError(f"--tensor-type {item!r}: bad pattern: {e}") from None
        out.append((pattern.lower(), qtype.upper()))
    return out
