"""The house's layers, read from the imports (every import counts, also those inside functions):
no arrow runs back up, the import graph has no cycle, the modules every service shares import no
service, and none imports the tests' own helpers (tests.helpers). The rule is docs/architecture.md's:

    0  polar.v1                 the generated contracts
    1  polar (the base)         everything in polar/ but polar.app and polar.testing
    2  gateway, trainer         built on the base, and on neither of each other
    3  polar.app                the commands, the stack, the runs and the gateway node (and
                                polar.__main__, which runs the command)
    4  polar.testing            fakes for tests; no production module imports it
"""

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
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
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


# (module prefix, rank, the layer's name), the first match counting.
LAYERS = (
    ("polar.testing", 4, "polar.testing"),
    ("polar.app", 3, "polar.app"),
    ("polar.__main__", 3, "polar.app"),
    ("gateway", 2, "gateway"),
    ("trainer", 2, "trainer"),
    ("polar.v1", 0, "polar.v1"),
    ("polar", 1, "polar"),
)


def layer(module: str) -> tuple[int, str]:
    """(the layer's rank, the layer's name) of one of our modules."""
    for prefix, rank, name in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return rank, name
    raise ValueError(f"{module} is in no layer")


def arrows_back_up(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes to a higher layer, or sideways between gateway and trainer."""
    found = []
    for name, targets in sorted(graph.items()):
        rank, home = layer(name)
        for target in sorted(targets):
            target_rank, target_home = layer(target)
            if target_rank > rank or (target_rank == rank and target_home != home):
                found.append(f"{name} ({home}) imports {target} ({target_home})")
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items() if not name.startswith(GENERATED)}


def test_no_arrow_runs_back_up():
    assert not arrows_back_up(_graph()), "imports against the layers:\n" + "\n".join(arrows_back_up(_graph()))


def test_an_arrow_back_up_is_found():
    """The check itself: each kind of wrong arrow is reported, the right ones are not."""
    graph = {
        "polar.config": {"polar.v1.common_pb2"},
        "gateway.core": {"polar.config"},
        "polar.app.cli": {"gateway.core", "trainer.loop", "polar.config"},
        "polar.rollout.tasks": {"gateway.sampling"},
        "trainer.loop": {"gateway.core", "polar.app.stack"},
        "polar.inference.server": {"polar.testing.gateway"},
    }
    assert arrows_back_up(graph) == [
        "polar.inference.server (polar) imports polar.testing.gateway (polar.testing)",
        "polar.rollout.tasks (polar) imports gateway.sampling (gateway)",
        "trainer.loop (trainer) imports gateway.core (gateway)",
        "trainer.loop (trainer) imports polar.app.stack (polar.app)",
    ]


def test_no_import_cycle():
    graph = _graph()
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
    leaves = {"polar.service_base", "polar.grpc_server", "polar.config", "polar.credentials"}
    for leaf in leaves:
        imported = _imports(leaf, modules[leaf], modules)
        assert imported <= leaves | {"polar"}, f"{leaf} imports {sorted(imported - leaves)}"


def imports_of_the_tests(source: str) -> list[str]:
    """The modules of the tests (`tests`, `tests.…`) that `source` imports, anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [name for name in names if name == "tests" or name.startswith("tests.")]
    return found


def test_no_module_imports_the_tests():
    """The tests' own helpers (tests.helpers) are not part of what is installed: no module of
    polar, gateway or trainer (polar.testing included) imports them."""
    found = []
    for name, path in _modules().items():
        found += [f"{name} imports {target}" for target in imports_of_the_tests(path.read_text())]
    assert not found, "\n".join(found)


def test_an_import_of_the_tests_is_found():
    source = "import json\nfrom tests.helpers import swe_mini\n\ndef f():\n    import tests.helpers.stack_config\n"
    assert imports_of_the_tests(source) == ["tests.helpers", "tests.helpers.stack_config"]
    assert imports_of_the_tests("from polar import testing\nimport testsuite\n") == []
