"""Guards so that the house does not grow back (issue 50): a module of the service, actor or orchestrator
packages or of the benchmarks stays within MODULE_LINES, a function anywhere in the product within
FUNCTION_LINES, no test module imports another test module (shared helpers live in tests/helpers/), every write
of state goes through the durable helpers (actors/storage/durable.py), and the README stays within README_LINES."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
MODULE_LINES = 450
FUNCTION_LINES = 120
README_LINES = 300
SIZED_ROOMS = [REPO / "orchestrator", REPO / "actors", REPO / "bench"]
NOT_SIZED = REPO / "actors" / "engine"   # the compute core: its modules are split by what they compute
PRODUCT = [REPO / "orchestrator", REPO / "actors", REPO / "policies"]
# renames of folders that hold derived data, which a crash may leave behind and the next run builds again:
# a converted GGUF model, a tokenizer, a checkpoint downloaded from storage (each checked when read)
CACHE_RENAMES = {"actors/storage/gguf_cache.py", "actors/storage/sources.py", "actors/storage/checkpoint_mirror.py"}


def python_files(roots: list[Path]) -> list[Path]:
    return sorted(path for root in roots for path in root.rglob("*.py"))


def test_modules_of_the_service_actor_orchestrator_and_bench_packages_stay_their_size():
    large = {str(p.relative_to(REPO)): n for p in python_files(SIZED_ROOMS)
             if NOT_SIZED not in p.parents and (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert not large, f"split these by what they hold (at most {MODULE_LINES} lines each): {large}"


def test_functions_stay_their_size():
    long = []
    for path in python_files(PRODUCT):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"split these functions by job (at most {FUNCTION_LINES} lines): {long}"


def imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_test_module_imports_another():
    tests = REPO / "tests"
    test_modules = {".".join(p.relative_to(REPO).with_suffix("").parts) for p in tests.rglob("test_*.py")}
    found = []
    for path in tests.rglob("*.py"):
        for name in imported_modules(ast.parse(path.read_text())) & test_modules:
            found.append(f"{path.relative_to(REPO)} imports {name}")
    assert not found, f"move what they share to tests/helpers/: {found}"


def bypasses(tree: ast.AST) -> list[int]:
    """Lines that rename or fsync by hand: os.replace / os.rename / os.fsync, and a path's .replace(target) or
    .rename(target) (one argument: not str.replace, which takes two)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Name) and owner.id == "os" and node.func.attr in ("replace", "rename", "fsync"):
            lines.append(node.lineno)
        elif node.func.attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords:
            lines.append(node.lineno)
    return lines


def test_state_is_written_through_the_durable_helpers():
    found = []
    for path in python_files(PRODUCT):
        relative = str(path.relative_to(REPO))
        if relative in CACHE_RENAMES or relative == "actors/storage/durable.py":
            continue
        found += [f"{relative}:{line}" for line in bypasses(ast.parse(path.read_text()))]
    assert not found, ("write these with actors/storage/durable.py (write_durably, replace_durably, append_record): "
                       f"{found}")


def test_the_readme_stays_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_LINES})"
