"""The house's import graph, read from the source: no circles (imports under
``TYPE_CHECKING`` and inside functions count too: a circle is a circle to the reader),
and read-ahead reaches the cache only through its port."""

from __future__ import annotations

import ast
from pathlib import Path

import asynccache

ROOT = Path(asynccache.__file__).parent

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that ``name`` imports, wherever the import stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the module; ``from mod import name`` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_reader_finds_a_circle_it_is_shown() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [frozenset({"a", "b", "c"})]


def test_the_graph_sees_imports_under_type_checking() -> None:
    edges = graph()
    # readers.py imports the store's loop thread at the top; parts.py the write queue
    assert "asynccache.store.loop" in edges["asynccache.readahead.readers"]
    assert "asynccache.cache.write_queue" in edges["asynccache.cache.parts"]
    # reads.py names CacheParts only under TYPE_CHECKING
    assert "asynccache.cache.parts" in edges["asynccache.cache.reads"]


def test_no_import_circles() -> None:
    assert circles(graph()) == []


def test_the_cache_mechanisms_do_not_import_the_cache() -> None:
    edges = graph()
    for name in ("reads", "writes", "write_queue", "leases", "chunks", "decorator", "loops",
                 "parts", "coalesce"):
        assert "asynccache.cache.core" not in edges[f"asynccache.cache.{name}"], name


def test_read_ahead_reaches_the_cache_only_through_its_port() -> None:
    edges = graph()
    reached = {target for name, targets in edges.items()
               if name.startswith("asynccache.readahead.")
               for target in targets if target.startswith("asynccache.cache")}
    assert reached == {"asynccache.cache.port"}
