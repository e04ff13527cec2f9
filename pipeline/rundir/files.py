"""The run directory's layout: one name for each file, who writes it, and the JSONL readers.

The run directory is the contract with everything downstream (the console, the doctor, tune,
storage, benchmarks). Import-light (no torch, no Ray), so workers and the CLI can import it.
"""

from __future__ import annotations

import json
import contextlib
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

RUN_NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]+")  # a run's or a search's name: one folder name


def run_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a run (or a search) folder, else None; the caller prefixes the field.
    The name is the run's folder under ``output.root`` and its key in ``output.storage``."""
    if isinstance(name, str) and RUN_NAME_PATTERN.fullmatch(name) and name not in (".", ".."):
        return None
    shown = repr(name)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"{shown} must be one folder name of letters, digits, '.', '_' and '-' (not '.' or '..')"


CONFIG = "config.yaml"  # the resolved config (the driver); an earlier one is kept as config.<time>.yaml
EVENTS = "events.jsonl"  # resumes, config changes, resizes, cap changes, findings, checkpoints (append_event)
METRICS = "metrics.jsonl"  # one object per logged step (rank 0, run_callbacks.MetricsSink)
SAMPLES = "samples.jsonl"  # completions with their rewards every logging.samples_every steps
EVAL_SAMPLES = "eval_samples.jsonl"  # every held-out answer of every evaluation (eval_samples.py)
HEALTH = "health.json"  # the live health findings at the end (health.HealthCallback)
LENGTH_CHANGES = "length_changes.json"  # [step, old, new] of each cap change (length_control)
ADAPTER_DIR = "adapter"  # the trained LoRA adapter (or full weights) and the tokenizer
SUMMARY = "summary.txt"  # the driver's summary at the end
FATAL_FILE = "fatal_error.txt"  # written by rank 0 when an error a retry cannot fix stops it (worker.NOT_RETRYABLE)
FATAL_METRIC = "fatal_error"  # the cause in a worker's final Ray Train report (worker.unless_retry_cannot_fix)
RAY_TRAIN_DIR = "ray_train"  # Ray Train's storage: its checkpoints (kept K) and checkpoint_manager_snapshot.json
TRAINER_DIR = "trainer"  # the HF Trainer's output_dir (its checkpoints pass through to Ray Train)
REPORT = "report.md"  # `synth-grpo doctor`'s report, beside its PNG plots
LEASE = ".lease.json"  # who writes the run now, and their heartbeat (run_lease.py); never copied between folders

# The run's own files, by who writes them. The driver writes the config and its events before
# the workers start and the summary after; rank 0 writes the rest while training.
DRIVER_FILES = (CONFIG, EVENTS)
WORKER_FILES = (METRICS, SAMPLES, EVAL_SAMPLES, HEALTH, EVENTS, LENGTH_CHANGES)
WORKER_DIRS = (ADAPTER_DIR,)


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write a whole file through a temporary file in the same folder and a rename: a crash mid-write
    leaves the previous file (or none), never half of one, and a symlink at ``path`` is replaced, not
    followed. For files written whole; the JSONL logs are appended to instead."""
    path = Path(path)
    with replaced_atomically(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return path


@contextlib.contextmanager
def replaced_atomically(path: Path):
    """A binary file to write ``path``'s new content into: a temporary file beside it, synced and renamed
    over ``path`` when the block ends, removed if it raises (``write_atomic``, ``storage.copy_atomic``)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Rows of a JSONL file and the 1-based numbers of lines that are not JSON objects."""
    rows, broken = [], []
    for no, obj in iter_jsonl(path):
        if obj is None:
            broken.append(no)
        else:
            rows.append(obj)
    return rows, broken


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(1-based line number, the JSON object on it, or None where the line is no JSON object) of each
    non-blank line. Bytes that are not UTF-8 read as U+FFFD; a line nested too deep is no object."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, an int of over 4300 digits, or nested too deep
                obj = None
            yield no, obj if isinstance(obj, dict) else None


def line_list(nums: list[int], most: int = 20) -> str:
    """Line numbers for a message: the first ``most`` and how many more."""
    s = ", ".join(map(str, nums[:most]))
    return s + (f", ... ({len(nums) - most} more)" if len(nums) > most else "")


def read_metrics(path: Path) -> list[dict]:
    """Rows of a JSONL file (none if it is missing); broken lines (a run killed mid-write) are skipped."""
    return read_jsonl(path)[0] if Path(path).exists() else []


def append_event(run_dir: Path, event: str, **fields: Any) -> None:
    """One line of ``events.jsonl``: what happened to the run (resumes, config changes, resizes, and
    the console's cap changes, findings and checkpoints). The one writer of that file."""
    with (Path(run_dir) / EVENTS).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"event": event, **fields, "time": time.time()}, ensure_ascii=False) + "\n")
