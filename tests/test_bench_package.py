"""bench/ is one package: every script takes its prologue from bench.common instead of repeating it."""

from __future__ import annotations

import ast
import importlib
import os
import sys
from pathlib import Path

import pytest

import bench.common
import bench.generation as gen

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name not in ("__init__.py", "common.py"))


def test_every_script_imports_the_shared_prologue_and_runs_as_a_file_or_a_module():
    """`python -m bench.x` and `python bench/x.py` (the issues' form) alike: a script run as a file puts the
    repo root where Python put bench/ (sys.path[0]), as `-m` does, and nothing else edits sys.path."""
    assert len(SCRIPTS) >= 5
    for path in SCRIPTS:
        tree = ast.parse(path.read_text())
        top = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
        assert "bench.common" in top, f"{path.name}: no `from bench.common import ...` at the top"
        edits = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "insert"
                 and isinstance(n.value, ast.Attribute) and n.value.attr == "path"]
        assert not edits, f"{path.name}: sys.path edited"
        if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body):  # a script
            first = next(i for i, n in enumerate(tree.body) if isinstance(n, ast.ImportFrom) and n.module.startswith("bench"))
            guard = tree.body[first - 1]
            assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "not __package__", f"{path.name}: no file-run guard"
            assert ast.unparse(guard.body[0]) == "sys.path[0] = str(Path(__file__).resolve().parents[1])", path.name


def test_a_script_run_as_a_file_from_elsewhere_works(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, str(BENCH / "ablation.py"), "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--seeds" in proc.stdout, proc.stderr[-2000:]


def test_common_sets_the_offline_environment(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM"):
        monkeypatch.delenv(name, raising=False)
    importlib.reload(bench.common)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TOKENIZERS_PARALLELISM"] == "false"
    assert bench.common.REPO == BENCH.parent


def test_generation_bench_help_needs_no_engine_and_its_ratios_are_vllm_over_hf(monkeypatch, capsys):
    """bench.generation loads vLLM and Ray only to measure: ``--help`` works without them (CI starts no vLLM)."""
    monkeypatch.setattr(sys, "argv", ["bench.generation", "--help"])
    with pytest.raises(SystemExit) as exit_:
        gen.main()
    assert exit_.value.code == 0
    assert "--max-new-tokens" in capsys.readouterr().out
    assert gen.generated_length([5, 7, 2, 9], {2}) == 3 and gen.generated_length([5, 7], {2}) == 2
    timed = {"hf": {"tokens_per_s": 100.0, "startup_s": 1.0}, "vllm": {"tokens_per_s": 250.0, "startup_s": 40.0}}
    steps = {"hf": {"sec_per_step": 2.0, "startup_s": 3.0}, "vllm": {"sec_per_step": 1.0, "startup_s": 48.0}}
    ratios = gen.summarize(timed, steps)["vllm_over_hf"]
    assert ratios["tokens_per_s"] == 2.5 and ratios["sec_per_step"] == 0.5 and ratios["startup_s"] == 16.0
    assert gen.summarize(timed, None)["vllm_over_hf"]["sec_per_step"] is None
