"""The import structure (docs/architecture.md): packages in layers, each importing only the layers
below it; no cycle between the project's modules; no private name imported from another module.
Read from the source with ``ast``: every import counts, one inside a function and one under
``if TYPE_CHECKING:`` included (an annotation-only import still ties the two modules together)."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "rewards")
# Low to high: a module may import its own package and any package listed before it, never one after.
LAYERS = ("rewards", "pipeline", "pipeline.errors", "pipeline.seams", "pipeline.rundir", "pipeline.config",
          "pipeline.data", "pipeline.plan", "pipeline.scoring", "pipeline.diagnosis", "pipeline.console",
          "pipeline.training", "pipeline.tune", "pipeline.report", "pipeline.cli", "pipeline.__main__")


def project_files(root: Path) -> dict[str, Path]:
    files = {}
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = p.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return files


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """({module: project modules it imports}, ["module: name"] of private names imported from another module)."""
    files = project_files(root)
    graph, private = {}, []
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}  # `from pipeline.rundir import eval_samples`
                if node.module in files:
                    private += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        graph[name] = {d for d in deps if d in files and d != name}
    return graph, private


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest entry that is ``module`` or a package above it."""
    hits = [i for i, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + ".")]
    return max(hits, key=lambda i: len(LAYERS[i]))


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({LAYERS[layer_of(m)]}) imports {d} ({LAYERS[layer_of(d)]})"
                  for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))


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


def test_every_package_sits_in_a_layer_and_imports_only_those_below():
    graph, _ = import_graph(REPO)
    assert "pipeline.diagnosis.rules" in graph and len(graph) > 40
    packages = {m for m, p in project_files(REPO).items() if p.name == "__init__.py" and m.count(".") == 1}
    assert packages <= set(LAYERS), f"a package without a layer: {sorted(packages - set(LAYERS))}"
    assert not upward_imports(graph), "\n".join(upward_imports(graph))


def test_no_import_cycle_between_project_modules():
    graph, _ = import_graph(REPO)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_private_name_imported_from_another_module():
    _, private = import_graph(REPO)
    assert not private, private


def test_the_checks_fail_on_a_cycle_a_private_import_and_an_upward_import(tmp_path):
    """The same checks on a small tree that breaks each rule: they must say so."""
    for pkg in ("pipeline", "rewards", "pipeline/training", "pipeline/report"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "training" / "a.py").write_text("def f():\n    from pipeline.training.b import _helper\n")
    (tmp_path / "pipeline" / "training" / "b.py").write_text("from pipeline.training import a\n_helper = 1\n")
    (tmp_path / "pipeline" / "training" / "health.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline.report.plots import plot_run\n")
    (tmp_path / "pipeline" / "report" / "plots.py").write_text("import pipeline.training.health\n")
    graph, private = import_graph(tmp_path)
    assert find_cycle(graph) == ["pipeline.report.plots", "pipeline.training.health", "pipeline.report.plots"]
    assert private == ["pipeline.training.a: pipeline.training.b._helper"]
    assert upward_imports(graph) == [
        "pipeline.training.health (pipeline.training) imports pipeline.report.plots (pipeline.report)"]
    del graph["pipeline.report.plots"]
    assert find_cycle(graph) == ["pipeline.training.a", "pipeline.training.b", "pipeline.training.a"]


def test_every_subpackage_is_installed():
    """pyproject.toml finds its packages by pattern: a subpackage the patterns miss works in this
    checkout but not where the project is installed (a cluster node)."""
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    found = {".".join(p.parent.relative_to(REPO).parts) for pkg in PACKAGES for p in (REPO / pkg).rglob("__init__.py")}
    missed = {p for p in found if not any(fnmatch.fnmatchcase(p, pat) for pat in include)}
    assert len(found) > 10 and not missed, sorted(missed)


MAX_FUNCTION_LINES = 60
LONG_MARKER = "# long:"  # on the def line: a formula table that reads top to bottom, said why


def long_functions(root: Path) -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines (decorators excluded) without the marker on their def line."""
    out = []
    for name, path in project_files(root).items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                header = "\n".join(lines[node.lineno - 1:node.body[0].lineno - 1])
                if length > MAX_FUNCTION_LINES and LONG_MARKER not in header:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return out


def lazy_imports_without_reason(root: Path) -> list[str]:
    """Imports of the project's own modules inside a function with no comment on the line saying why."""
    out = []
    for name, path in project_files(root).items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                        else [])
                own = [m for m in mods if m.split(".")[0] in PACKAGES]
                if own and "#" not in lines[node.end_lineno - 1]:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {', '.join(own)}")
    return sorted(set(out))


def test_no_function_over_60_lines_outside_the_marked_formula_tables():
    assert not long_functions(REPO), "\n".join(long_functions(REPO))


def test_own_modules_are_imported_at_the_top_or_say_why_not():
    assert not lazy_imports_without_reason(REPO), "\n".join(lazy_imports_without_reason(REPO))


def test_the_length_and_lazy_import_checks_can_fail(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "rewards").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "pipeline" / "m.py").write_text(
        f"def long():\n{body}\n\n\ndef table():  # long: formula table\n{body}\n\n\n"
        "def lazy():\n    from pipeline import m\n    from pipeline import n  # lazy: imports torch\n")
    assert long_functions(tmp_path) == ["pipeline/m.py:1 long (61 lines)"]
    assert lazy_imports_without_reason(tmp_path) == ["pipeline/m.py:128 pipeline"]
