"""Reading a run directory for the doctor and `synth-grpo compare`: its metric rows and config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.run_files import CONFIG, METRICS, read_jsonl


class RunDirError(ValueError):
    """Bad input: the CLI prints it and exits 2."""


@dataclass
class Run:
    path: Path
    rows: list[dict[str, Any]]
    broken_lines: list[int]
    config: dict[str, Any] | None
    config_problem: str | None = None


def load_run(run_dir: str | Path) -> Run:
    """The rows of RUN_DIR/metrics.jsonl (broken lines counted) and its config.yaml; RunDirError on bad input."""
    d = Path(run_dir)
    if not d.exists():
        raise RunDirError(f"run directory {str(d)!r} does not exist")
    if not d.is_dir():
        raise RunDirError(f"{str(d)!r} is not a directory (give the run directory that holds {METRICS})")
    mpath = d / METRICS
    if not mpath.is_file():
        has = sorted(p.name for p in d.iterdir())[:10]
        raise RunDirError(f"no {METRICS} in {str(d)!r}" + (f" (it holds: {', '.join(has)})" if has else " (the directory is empty)"))
    rows, broken = read_jsonl(mpath)
    if not rows:
        why = f"all {len(broken)} lines are broken (lines {line_list(broken)})" if broken else "it is empty"
        raise RunDirError(f"{mpath}: no metric rows, {why}")
    cfg, problem = None, None
    cpath = d / CONFIG
    if cpath.is_file():
        import yaml

        try:
            cfg = yaml.safe_load(cpath.read_text(encoding="utf-8"))
            if not isinstance(cfg, dict):
                cfg, problem = None, f"{cpath}: not a mapping of config groups; advice will not name current values"
        except yaml.YAMLError as e:
            problem = f"{cpath}: not valid YAML ({str(e).splitlines()[0]}); advice will not name current values"
    return Run(d, rows, broken, cfg, problem)


def line_list(nums: list[int], most: int = 20) -> str:
    """Line numbers for a message: the first ``most`` and how many more."""
    s = ", ".join(map(str, nums[:most]))
    return s + (f", ... ({len(nums) - most} more)" if len(nums) > most else "")
