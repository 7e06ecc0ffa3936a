"""The floor plan's rule, checked on the code: imports point down the layers only. Every import of a
project module (at the top of a module or inside a function) is read from the source, so a wrong-way
import fails here, named with its file and line, before anyone builds on it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Top first. A module may import from its own layer and the layers below it, never above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("user-facing: client, CLI, observability", ("orchestrator",)),
    ("Ray actors", ("actors.scheduler_actor", "actors.job_dispatch", "actors.trainer_actor", "actors.job_actor",
                    "actors.ray_links", "actors.ray_trainers", "actors.stage_actors", "actors.niceness")),
    ("Ray-free service cores", ("actors.service",)),
    ("job files: checkpoints, PEFT adapters, exports", ("actors.checkpoint",)),
    ("compute engine", ("actors.engine",)),
    ("what a job is and where its files live: specs, data, storage", ("actors.spec", "actors.data", "actors.storage")),
    ("policies: decisions over a snapshot", ("policies",)),
]
PACKAGES = ("orchestrator", "actors", "policies")


def layer_of(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def project_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES and layer_of(name) is not None:
                found.append((node.lineno, name))
                break
    return found


def modules() -> list[tuple[str, Path]]:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            found.append((name, path))
    return found


def test_every_module_has_a_layer():
    unplaced = [name for name, _ in modules() if layer_of(name) is None and name not in PACKAGES]
    assert not unplaced, f"modules in no layer of tests/unit/test_layers.py: {unplaced}"


def test_imports_point_down_only():
    wrong = []
    for name, path in modules():
        own = layer_of(name)
        if own is None:
            continue
        for line, imported in project_imports(path):
            target = layer_of(imported)
            if target is not None and target < own:
                wrong.append(f"{path.relative_to(REPO)}:{line}: {name} ({LAYERS[own][0]}) imports {imported} "
                             f"({LAYERS[target][0]}), a layer above it")
    assert not wrong, "imports pointing up the layers:\n" + "\n".join(wrong)


def test_the_check_catches_a_wrong_way_import(tmp_path):
    """The checker itself: a policy importing the client is found."""
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from orchestrator.client import Client\n    return Client\n")
    assert project_imports(module) == [(2, "orchestrator.client")]
    assert layer_of("orchestrator.client") < layer_of("policies.bad")


def test_no_two_modules_share_a_name():
    """A name says what a module holds: two modules of one name in different rooms would hold different
    things under the same word."""
    names: dict[str, list[str]] = {}
    for name, path in modules():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(name)
    assert not {n: m for n, m in names.items() if len(m) > 1}


def import_graph() -> dict[str, set[str]]:
    """Each project module and the project modules it imports (a package's name stands for its __init__)."""
    known = {name for name, _ in modules()}
    graph: dict[str, set[str]] = {}
    for name, path in modules():
        targets = set()
        for _, imported in project_imports_all(path):
            while imported and imported not in known:   # `from a.b import name`: the module is a.b
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def project_imports_all(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    """No two modules import each other, directly or round a loop (imports for type checking included: a
    circle there is a class split over two files)."""
    assert not circles(import_graph())


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
