"""The import structure (docs/architecture.md): no cycle between the project's modules, the training
path free of the offline doctor's report, plots, CLI and compare, and no private name imported
from another module. Read from the source with ``ast``: every import counts, also one inside a
function, except those under ``if TYPE_CHECKING:``."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "rewards")
TRAINING_PATH = ("worker", "run_callbacks", "health", "length_control", "reward_clients", "dynamic_sampling",
                 "eval_samples", "elastic", "storage")
OFFLINE_ONLY = ("pipeline.doctor", "pipeline.diagnosis.report", "pipeline.diagnosis.run_reader", "pipeline.plots",
                "pipeline.cli", "pipeline.compare")


def _runtime_nodes(tree: ast.AST):
    """Every node, skipping the bodies of ``if TYPE_CHECKING:`` (annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """({module: project modules it imports}, ["module: name"] of private names imported from another module)."""
    files = {}
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = p.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph, private = {}, []
    for name, path in files.items():
        deps = set()
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}  # `from pipeline import eval_samples`
                if node.module in files:
                    private += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        graph[name] = {d for d in deps if d in files and d != name}
    return graph, private


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [node, dep] if dep in path else [node, dep]
            if dep not in state and (found := visit(dep, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_import_cycle_between_project_modules():
    graph, _ = import_graph(REPO)
    assert "pipeline.diagnosis.rules" in graph and len(graph) > 30
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_training_path_does_not_import_the_report_plots_cli_or_compare():
    graph, _ = import_graph(REPO)
    for module in TRAINING_PATH:
        bad = reachable(graph, f"pipeline.{module}") & set(OFFLINE_ONLY)
        assert not bad, f"pipeline.{module} imports {sorted(bad)}"
    assert "pipeline.diagnosis.rules" in reachable(graph, "pipeline.health")  # the live callback runs the rules


def test_no_private_name_imported_from_another_module():
    _, private = import_graph(REPO)
    assert not private, private


def test_the_checks_fail_on_a_cycle_a_private_import_and_a_report_import(tmp_path):
    """The same checks on a small tree that breaks each rule: they must say so."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "a.py").write_text("def f():\n    from pipeline.b import _helper\n")
    (tmp_path / "pipeline" / "b.py").write_text("from pipeline import a\n_helper = 1\n")
    (tmp_path / "pipeline" / "health.py").write_text("from pipeline.plots import plot_run\n")
    (tmp_path / "pipeline" / "plots.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline.health import x\n")
    graph, private = import_graph(tmp_path)
    assert find_cycle(graph) == ["pipeline.a", "pipeline.b", "pipeline.a"]
    assert private == ["pipeline.a: pipeline.b._helper"]
    assert reachable(graph, "pipeline.health") == {"pipeline.plots"}  # and no cycle back: TYPE_CHECKING is skipped
    del graph["pipeline.a"]
    assert find_cycle(graph) is None


def test_every_subpackage_is_installed():
    """pyproject.toml lists its packages by name: a subpackage missing there works in this checkout
    but not where the project is installed (a cluster node)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for pkg in PACKAGES for p in (REPO / pkg).rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
