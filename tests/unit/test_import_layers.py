"""Imports go one way: the layers of ``../shared/DESIGN.md``, checked on the source with ``ast`` (issue 10).

Every import counts, also those under ``TYPE_CHECKING`` or inside functions: a layer that needs a type from above
it gets a ``Protocol`` of its own instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("privacy", "swarm", "peers")

# peers' rooms, lowest first: a room may import rooms of a lower rank (and itself), never a higher or an equal one
RANKS = {"core": 0, "model": 1, "training": 2, "wire": 3, "server": 4, "client": 4, "trainer": 5, "api": 5, "cli": 6}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = source_modules(root)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "peers" and len(parts) > 1 and parts[1] in RANKS else None


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Every import that breaks a rule, as a readable line."""
    found = []
    for source, targets in sorted(edges.items()):
        top = source.split(".")[0]
        for target in sorted(targets):
            target_top = target.split(".")[0]
            if top == "privacy" and target_top != "privacy":
                found.append(f"{source} imports {target}: privacy/ depends on nothing of ours")
            if top == "swarm" and target_top == "peers":
                found.append(f"{source} imports {target}: swarm/ must not import peers/")
            private = [p for p in target.split(".")[1:] if p.startswith("_") and not p.startswith("__")]
            if private and target.rsplit(".", 1)[0] != source.rsplit(".", 1)[0] and target_top != top:
                found.append(f"{source} imports {target}: a private module of another package")
            if top == "peers" and target_top == "peers" and room(source) != room(target):
                a, b = room(source), room(target)
                if a is None or b is None:
                    continue
                if RANKS[b] >= RANKS[a]:
                    found.append(f"{source} imports {target}: peers/{a} may not import peers/{b} (same or higher "
                                 f"layer)")
    return found + [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(edges)]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_imports_follow_the_layers():
    problems = violations(graph())
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_every_room_of_peers_is_a_package():
    for name in RANKS:
        assert (ROOT / "peers" / name / "__init__.py").exists(), f"peers/{name}/ is missing"


@pytest.mark.parametrize("source, target, rule", [
    ("privacy.admission", "swarm.records", "privacy/ depends on nothing"),
    ("swarm.routing", "peers.core.config", "swarm/ must not import peers/"),
    ("peers.server.handler", "peers.client.session", "may not import peers/client"),
    ("peers.client.session", "peers.server.handler", "may not import peers/server"),
    ("peers.wire.stream", "peers.trainer.trainer", "may not import peers/trainer"),
    ("swarm.discovery", "privacy._files", "a private module of another package"),
])
def test_a_forbidden_import_is_caught(source, target, rule):
    """The checker itself: each rule fires on an edge that breaks it."""
    assert any(rule in line for line in violations({source: {target}, target: set()}))


def test_a_cycle_is_caught():
    assert cycles({"peers.a": {"peers.b"}, "peers.b": {"peers.c"}, "peers.c": {"peers.a"}})
