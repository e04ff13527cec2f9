"""bench/ is one package: every script takes its prologue from bench.common instead of repeating it."""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import bench.common

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name not in ("__init__.py", "common.py"))


def test_every_script_imports_the_shared_prologue_and_none_edits_sys_path():
    assert len(SCRIPTS) >= 5
    for path in SCRIPTS:
        tree = ast.parse(path.read_text())
        top = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
        assert "bench.common" in top, f"{path.name}: no `from bench.common import ...` at the top"
        edits = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "insert"
                 and isinstance(n.value, ast.Attribute) and n.value.attr == "path"]
        assert not edits, f"{path.name}: sys.path edited (run it as `python -m bench.{path.stem}`)"


def test_common_sets_the_offline_environment(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM"):
        monkeypatch.delenv(name, raising=False)
    importlib.reload(bench.common)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TOKENIZERS_PARALLELISM"] == "false"
    assert bench.common.REPO == BENCH.parent
