"""The worker loop's shape without running it: its typed arguments travel as Ray Train pickles them,
and its phases are the ones metrics.jsonl names (timing_s/<phase>). The run itself: test_train_ray."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import cloudpickle

from pipeline.config import load_config
from pipeline.rundir.metric_names import TIMING_KEYS, TIMING_PREFIX, WORKER_PHASES, is_train_row
from pipeline.rundir.storage import RunStorage
from pipeline.training.worker_args import WorkerArgs

WORKER = Path(__file__).resolve().parents[1] / "pipeline" / "training" / "worker.py"


def test_worker_args_pickle_as_ray_train_ships_them(tmp_path):
    cfg = load_config()
    cfg.output.run_name = "run"
    args = WorkerArgs(cfg, tmp_path / "run", pool=None, length_ceiling=64, store=RunStorage(str(tmp_path / "s"), "run"))
    loop_config = args.loop_config()
    assert isinstance(loop_config, dict)  # Ray Train's train_loop_config must be a dict
    for dumps in (pickle.dumps, cloudpickle.dumps):
        back = WorkerArgs.of(pickle.loads(dumps(loop_config)))
        assert back.cfg == cfg and back.run_dir == args.run_dir and back.length_ceiling == 64
        assert back.store.uri == args.store.uri and back.pool is None


def _phases_timed_by_the_loop() -> list[str]:
    """The phase names train_loop_per_worker passes to timed(timings, "<phase>", ...), in order."""
    tree = ast.parse(WORKER.read_text(encoding="utf-8"))
    loop = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train_loop_per_worker")
    return [call.args[1].value for call in ast.walk(loop) if isinstance(call, ast.Call)
            and getattr(call.func, "id", None) == "timed" and isinstance(call.args[1], ast.Constant)]


def test_the_loop_times_each_documented_phase_once_in_order():
    assert _phases_timed_by_the_loop() == list(WORKER_PHASES)
    assert TIMING_KEYS == tuple(TIMING_PREFIX + p for p in WORKER_PHASES)


def test_the_timing_row_is_no_training_step():
    """Every reader counts steps with is_train_row: the timing row must not add one."""
    row = {"step": 4, **{k: 1.5 for k in TIMING_KEYS}}
    assert not is_train_row(row)
