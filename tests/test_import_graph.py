"""The import graph among the toolkit's parts has no cycle (issue 19): data flows checkpoint -> plan -> GGUF ->
runtime, and only collection (imatrix, prune profiles) drives the runtime. Every import counts, including
those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("forge.quant", "forge.distributed", "forge.prune", "runtime")


def _part(module: str) -> str | None:
    return next((p for p in PARTS if module == p or module.startswith(p + ".")), None)


def _edges() -> dict[tuple[str, str], str]:
    """(importing part, imported part) -> one file:line where it happens."""
    edges: dict[tuple[str, str], str] = {}
    for path in sorted([*ROOT.glob("forge/**/*.py"), *ROOT.glob("runtime/**/*.py")]):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        src = _part(module)
        if src is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                dst = _part(name)
                if dst is not None and dst != src:
                    edges.setdefault((src, dst), f"{path.relative_to(ROOT)}:{node.lineno}")
    return edges


def _cycle(edges: dict[tuple[str, str], str]) -> list[str] | None:
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [*path, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in graph:
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_cycle_among_quant_distributed_prune_runtime() -> None:
    edges = _edges()
    cycle = _cycle(edges)
    where = [f"{a} -> {b} ({edges[(a, b)]})" for a, b in zip(cycle, cycle[1:], strict=False)] if cycle else []
    assert cycle is None, "import cycle: " + "; ".join(where)


def test_the_checker_finds_a_cycle() -> None:
    assert _cycle({("a", "b"): "x", ("b", "c"): "y", ("c", "a"): "z"}) is not None
    assert _cycle({("a", "b"): "x", ("b", "c"): "y"}) is None
