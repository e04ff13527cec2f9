"""`synth-grpo train`: Ray (embedded or a cluster), the reward pool, a Ray Train TorchTrainer.

The run directory is the contract with everything downstream (doctor, tune, benchmarks): the
resolved ``config.yaml``, ``metrics.jsonl``, ``samples.jsonl``, ``adapter/``, and Ray Train's
checkpoints under ``ray_train/`` (kept K; a rerun with the same run name resumes from them).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig

RAY_TRAIN_DIR = "ray_train"


@dataclass
class TrainOutcome:
    run_dir: Path
    metrics: dict[str, Any]
    summary: str


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output.root) / (cfg.output.run_name or "run")


def prepare_run_dir(cfg: RunConfig, run_dir: Path, log=print) -> bool:
    """Create the run directory and write the resolved config; True when it resumes an earlier run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    resumed = (run_dir / RAY_TRAIN_DIR).exists()
    path = run_dir / "config.yaml"
    text = cfg.to_yaml()
    if path.exists() and path.read_text(encoding="utf-8") != text:
        kept = run_dir / f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml"
        path.rename(kept)
        if log:
            log(f"[run] {path} differs from this run's config; the earlier one is kept as {kept.name}")
    path.write_text(text, encoding="utf-8")
    return resumed


def init_ray(address: str | None = None, log=print) -> None:
    """Join RAY_ADDRESS / --address (and `ray job submit`'s cluster), else start an embedded local Ray."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    ray.init(address=address or None, log_to_driver=True, logging_level="WARNING")
    if log:
        where = address or "embedded local Ray"
        log(f"[ray] {where}: {ray.cluster_resources().get('CPU', 0):g} CPUs, {ray.cluster_resources().get('GPU', 0):g} GPUs")


def build_trainer(cfg: RunConfig, run_dir: Path, pool, length_ceiling: int | None = None, extra_callbacks=()):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from pipeline.console import ray_logging_config
    from pipeline.worker import train_loop_per_worker

    d = cfg.distributed
    resources = {"CPU": d.cpus_per_worker}
    if d.use_gpu:
        resources["GPU"] = d.gpus_per_worker
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg.to_dict(), "run_dir": str(run_dir.resolve()), "pool": pool, "length_ceiling": length_ceiling},
        scaling_config=ScalingConfig(num_workers=d.num_workers, use_gpu=d.use_gpu, resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if d.use_gpu else "gloo"),
        run_config=RayRunConfig(
            name=RAY_TRAIN_DIR,
            storage_path=str(run_dir.resolve()),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.output.checkpoints_kept),
            failure_config=FailureConfig(max_failures=d.max_failures),
            callbacks=list(extra_callbacks),
            logging_config=ray_logging_config(cfg.logging.console),
        ),
    )


def gpu_length_ceiling(cfg: RunConfig) -> int | None:
    """Adaptive cap without a ceiling on a GPU: ask the memory planner for the longest that fits."""
    if not (cfg.adaptive_length and cfg.generation.adaptive.ceiling is None and cfg.distributed.use_gpu):
        return None
    try:
        from pipeline.memory import detect_gpu_gib, max_completion_length_ceiling

        gib = detect_gpu_gib()
        return max_completion_length_ceiling(cfg, gib) if gib else None
    except Exception:
        return None


def registered_checkpoints(run_dir: Path) -> list[str]:
    """Checkpoints Ray Train's controller has registered for this run: what a restart or rerun resumes from."""
    try:
        snap = json.loads((run_dir / RAY_TRAIN_DIR / "checkpoint_manager_snapshot.json").read_text(encoding="utf-8"))
        return [c["checkpoint_dir_name"] for c in snap["checkpoint_results"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def summarize(run_dir: Path) -> str:
    from pipeline.run_callbacks import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "eval/score" in r]

    def span(key: str, fmt: str = ".3f") -> str:
        vals = [r[key] for r in train if isinstance(r.get(key), (int, float))]
        return f"{vals[0]:{fmt}} -> {vals[-1]:{fmt}}" if vals else "n/a"

    lines = [
        f"run directory: {run_dir}",
        f"steps: {max((r['step'] for r in rows if 'loss' in r or 'reward' in r), default=0)}",
        f"reward: {span('reward')}",
        f"clipped ratio: {span('completions/clipped_ratio', '.2f')}",
        f"entropy: {span('entropy')}",
        f"max completion length: {span('generation/max_completion_length', '.0f')}",
    ]
    if evals:
        lines.append(f"eval/score: {evals[0]['eval/score']:.3f} -> {evals[-1]['eval/score']:.3f}")
    adapter = run_dir / "adapter"
    lines.append(f"adapter: {adapter if adapter.exists() else 'not written'}")
    return "\n".join(lines)


def run_training(cfg: RunConfig, run_dir: Path, pool=None, log=print) -> TrainOutcome:
    """Train one run end to end on the current Ray (starts a pool when none is given)."""
    from pipeline.reward_pool import start_pool, stop_pool

    own_pool = pool is None
    if own_pool:
        pool = start_pool(cfg)
    try:
        trainer = build_trainer(cfg, run_dir, pool, gpu_length_ceiling(cfg))
        result = trainer.fit()
    finally:
        if own_pool:
            stop_pool(pool)
    summary = summarize(run_dir)
    return TrainOutcome(run_dir, dict(result.metrics or {}), summary)


def train_cli(cfg: RunConfig, args) -> int:
    from pipeline.reward_pool import RewardPoolError

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    if not run_dir.is_absolute() and os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        print(f"[run] WARNING: output.root {cfg.output.root!r} is relative inside a Ray job: the run directory "
              "would be in Ray's temporary copy of the working dir; use --set output.root=/absolute/path",
              file=sys.stderr)
    run_dir = run_dir.resolve()
    if cfg.distributed.use_gpu:
        try:
            from pipeline.memory import warn_if_not_fits

            warning = warn_if_not_fits(cfg)
            if warning:
                print(f"[plan] WARNING: {warning}", file=sys.stderr)
        except ImportError:
            pass
    resumed = prepare_run_dir(cfg, run_dir)
    print(f"[run] {'resuming' if resumed else 'starting'} {run_dir}")
    from pipeline.console import quiet_environment, watch

    quiet_environment(cfg.logging.console)
    init_ray(args.address)

    try:
        with watch(run_dir, cfg.logging.console, cfg.optimization.max_steps, live=cfg.logging.progress_bar):
            outcome = run_training(cfg, run_dir)
    except RewardPoolError as e:
        print(f"synth-grpo train: {e}\ncheckpoints so far are kept in {run_dir / RAY_TRAIN_DIR}", file=sys.stderr)
        return 1
    except Exception as e:  # Ray wraps worker errors; show the cause, keep the run directory
        cause = e
        while getattr(cause, "__cause__", None) is not None:
            cause = cause.__cause__
        print(f"synth-grpo train: training failed: {type(cause).__name__}: {cause}\n"
              f"the run directory {run_dir} and its checkpoints are kept; rerun the same command to resume",
              file=sys.stderr)
        return 1
    print("\n=== synth-grpo summary ===\n" + outcome.summary)
    (run_dir / "summary.txt").write_text(outcome.summary + "\n", encoding="utf-8")
    return 0
