"""The import graph of polar/, gateway/ (and trainer/ when present) has no cycle, counting every
import, also those inside functions; the modules every service shares import no service."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("polar", "gateway", "trainer")
# Generated stubs import each other as protoc writes them; they are not ours to arrange.
GENERATED = "polar.v1."


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its source (a `from package import module`
    counts as the module)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            # The module itself or the nearest package of ours that holds it.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items() if not name.startswith(GENERATED)}
    cycles = []
    state: dict[str, str] = {}  # "open" while on the stack, "done" after

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph.get(name, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(trail[trail.index(target) :] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_shared_modules_are_leaves():
    """What every service shares imports no service, nor the supervisor or Envoy."""
    modules = _modules()
    leaves = {"polar.service", "polar.grpc_server", "polar.config", "polar.credentials"}
    for leaf in leaves:
        imported = _imports(leaf, modules[leaf], modules)
        assert imported <= leaves | {"polar"}, f"{leaf} imports {sorted(imported - leaves)}"
