"""The metric names this pipeline reads and adds to TRL's log, and which logged rows are training steps.

TRL's GRPOTrainer logs one dict per logged step (``reward``, ``rewards/<name>/mean``, ``entropy``,
``completions/clipped_ratio``, ...); the length control adds the cap each step was generated under,
the evaluator ``eval/*``. Everything that reads ``metrics.jsonl`` counts training steps the same way.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

CAP_METRIC = "generation/max_completion_length"  # the cap this step's completions were generated under
# A logged row counts as a training step if it has one of these (eval lines and the trainer's
# final summary line do not).
TRAIN_KEYS = (
    "reward", "reward_std", "entropy", "loss", "frac_reward_zero_std", "completions/clipped_ratio",
    "completions/mean_length", "completions/max_length", "clip_ratio/region_mean",
)


# The worker loop's phases (pipeline/training/worker.py), each timed in seconds as veRL times
# ``timing_s/gen``: rank 0 writes them as one row of their own at the run's last step (no TRAIN_KEYS,
# so no reader counts it as a step), and every rank adds them to Ray Train's final report.
WORKER_PHASES = ("setup", "callbacks", "restore", "build_trainer", "judges", "train", "finish")
TIMING_PREFIX = "timing_s/"
TIMING_KEYS = tuple(TIMING_PREFIX + phase for phase in WORKER_PHASES)

MAX_STEP = 2**53  # a logged step counts optimizer steps: a larger one (or one past float precision) is no step


def number(v: Any) -> float | None:
    """A finite logged number as a float, else None (bools, strings, NaN, inf, ints beyond a float)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        v = float(v)
    except OverflowError:  # an int beyond float's range (JSON allows 400 digits)
        return None
    return v if math.isfinite(v) else None


def is_train_row(row: Mapping[str, Any]) -> bool:
    """A training step's row: a finite value of a TRAIN_KEYS or ``rewards/...`` key, and not the
    trainer's final summary (``train_runtime``)."""
    if "train_runtime" in row:
        return False
    return any(number(row.get(k)) is not None for k in TRAIN_KEYS) or any(
        k.startswith("rewards/") and number(v) is not None for k, v in row.items()
    )
