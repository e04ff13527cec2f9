"""What the driver hands each Ray Train worker: one typed, picklable record instead of a dict read by key.

Its own small module so the driver (imported by the CLI before Ray starts) can build it without
importing the worker, which loads transformers and torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import RunConfig
from pipeline.rundir.storage import RunStorage

if TYPE_CHECKING:
    from pipeline.scoring.pool import RewardPool

# Ray Train hands ``train_loop_config`` to the loop as its one argument and requires a dict (Tune
# merges a trial's parameters into it), so the typed record travels under this one key.
LOOP_CONFIG_KEY = "args"


@dataclass
class WorkerArgs:
    """Everything a worker needs; Ray Train pickles it to every worker (cloudpickle: the config's
    dataclasses, a path, the reward pool's actor handles and the storage's filesystem all pickle)."""

    cfg: RunConfig  # the resolved config; each worker adapts it to the group's size (config.for_world_size)
    run_dir: Path  # absolute: a node's own disk may not have it yet
    pool: RewardPool | Any  # the reward pool's actor handles (pipeline.scoring.pool); None in tests that stop early
    length_ceiling: int | None = None  # the adaptive cap's ceiling from the memory planner (driver.gpu_length_ceiling)
    store: RunStorage | None = None  # output.storage (or a Tune trial's folder in it), else None

    def loop_config(self) -> dict[str, WorkerArgs]:
        """As Ray Train's ``train_loop_config``."""
        return {LOOP_CONFIG_KEY: self}

    @staticmethod
    def of(loop_config: dict[str, Any]) -> WorkerArgs:
        """The record back out of ``train_loop_config``, at the top of the worker loop."""
        return loop_config[LOOP_CONFIG_KEY]
