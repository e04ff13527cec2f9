"""Reading a run directory for the doctor and `synth-grpo compare`: its metric rows and config.

A run directory can hold anything (a live run's half-written last line, a file edited by hand, a
folder someone else wrote), so the reader decides what each problem costs: a broken line or a row
whose ``step`` is no step number is skipped and counted; a config.yaml that cannot be read only costs
the advice's current values. Every such problem is one warning line that names the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, read_yaml
from pipeline.rundir.metric_names import MAX_STEP, number
from pipeline.rundir.files import CONFIG, METRICS, iter_jsonl, line_list

class RunDirError(ValueError):
    """Bad input: the CLI prints it and exits 2."""


@dataclass
class Run:
    path: Path
    rows: list[dict[str, Any]]
    broken_lines: list[int]
    config: dict[str, Any] | None
    config_problem: str | None = None
    bad_steps: list[int] = field(default_factory=list)  # line numbers of rows skipped for their step
    warnings: list[str] = field(default_factory=list)  # one line each, naming the file: what the CLI prints


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
    try:
        numbered = list(iter_jsonl(mpath))
    except OSError as e:
        raise RunDirError(f"{mpath}: cannot be read ({e.strerror or e})") from None
    broken = [no for no, row in numbered if row is None]
    rows, bad_steps = _valid_steps([(no, row) for no, row in numbered if row is not None])
    if not rows:
        why = f"all {len(broken)} lines are broken (lines {line_list(broken)})" if broken else "it is empty"
        if bad_steps:
            why = f"{len(bad_steps)} rows have a step that is no step number (lines {line_list(bad_steps)})" + (
                f" and {len(broken)} lines are broken" if broken else "")
        raise RunDirError(f"{mpath}: no metric rows, {why}")
    cfg, problem = read_config(d / CONFIG)
    if problem:
        problem += "; advice will not name current values"
    run = Run(d, rows, broken, cfg, problem, bad_steps)
    if broken:
        run.warnings.append(f"{mpath}: skipped {len(broken)} broken lines (lines {line_list(broken)})")
    if bad_steps:
        run.warnings.append(f"{mpath}: skipped {len(bad_steps)} rows whose step is not a whole number from 0 to 2**53 "
                            f"(lines {line_list(bad_steps)})")
    if problem:
        run.warnings.append(problem)
    return run


def _valid_steps(numbered: list[tuple[int, dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[int]]:
    """The rows whose ``step`` is absent, null, or a step number; and the line numbers of the others."""
    good, bad = [], []
    for no, row in numbered:
        step = row.get("step")
        s = number(step)
        if step is None or (s is not None and 0 <= s <= MAX_STEP and s == int(s)):
            good.append(row)
        else:
            bad.append(no)
    return good, bad


def read_config(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A run folder's config.yaml as a dict, or None and why not (None, None when there is none).
    Read as the config loader reads configs (``read_yaml``: bounded size and nesting, UTF-8, no aliases,
    which the run's own writer never uses), so what is made of it (tables, advice) stays small."""
    if not path.is_file():
        return None, None
    try:
        cfg = read_yaml(path)
    except ConfigError as e:
        return None, e.problems[0]
    if not isinstance(cfg, dict):
        return None, f"{path}: not a mapping of config groups"
    return cfg, None
