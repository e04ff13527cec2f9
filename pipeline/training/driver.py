"""`synth-grpo train`: Ray (embedded or a cluster), the reward pool, a Ray Train TorchTrainer.

The run directory (its layout: ``pipeline/rundir/files.py``) is the contract with everything
downstream (doctor, tune, benchmarks): the resolved ``config.yaml``, ``metrics.jsonl``,
``samples.jsonl``, ``adapter/``, and Ray Train's checkpoints under ``ray_train/`` (kept K; a rerun
with the same run name resumes from them).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, RunConfig, engine_problem, read_yaml, resume_changes, scaling_num_workers
from pipeline.console.live import quiet_environment, ray_logging_config, watch
from pipeline.data.sources import DataError, check_source
from pipeline.errors import cli_error
from pipeline.plan.memory import detect_gpu_gib, max_completion_length_ceiling, warn_if_not_fits
from pipeline.rundir.files import (ADAPTER_DIR, CONFIG, DRIVER_FILES, FATAL_FILE, FATAL_METRIC, METRICS, RAY_TRAIN_DIR,
                                   SUMMARY, WORKER_FILES, append_event, read_metrics, write_atomic)
from pipeline.rundir.lease import LeaseHeld, run_holding_leases
from pipeline.rundir.metric_names import CAP_METRIC, is_train_row
from pipeline.rundir.storage import StorageError, check_writable, name_problem, run_store
from pipeline.training.worker_args import WorkerArgs


class FatalRunError(RuntimeError):
    """A worker stopped on bad data, a bad model or a bad config: retrying would fail the same way."""


def raise_if_fatal(run_dir: Path, metrics: dict | None = None) -> None:
    """FatalRunError with the cause a worker left, if it left one: in ``FATAL_FILE`` (on this node), or in
    its final report's ``metrics`` (after training; rank 0 may have run on another node)."""
    fatal = run_dir / FATAL_FILE
    if fatal.is_file():
        raise FatalRunError(fatal.read_text(encoding="utf-8").strip())
    if (metrics or {}).get(FATAL_METRIC):
        raise FatalRunError(str(metrics[FATAL_METRIC]))


@dataclass
class TrainOutcome:
    run_dir: Path
    metrics: dict[str, Any]
    summary: str


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output.root) / (cfg.output.run_name or "run")


class ResumeConflict(ValueError):
    """A rerun under an existing run name whose training-relevant config differs from the run's."""

    def __init__(self, run_dir: Path, changes: list[tuple[str, Any, Any]]):
        self.lines = [f"{name}: {old!r} in the run being resumed, {new!r} now" for name, old, new in changes]
        super().__init__(
            f"{run_dir} was trained with another config; resuming it would ignore or mix these settings:\n"
            + "\n".join(f"  - {line}" for line in self.lines)
            + "\neither start a new run (--set output.run_name=NEW_NAME) or resume with the new settings "
            "(--allow-config-change; the earlier config is kept beside the new one)"
        )


def prepare_run_dir(cfg: RunConfig, run_dir: Path, log=print, allow_config_change: bool = False, store=None) -> bool:
    """Create the run directory and write the resolved config; True when it resumes an earlier run.

    A run with checkpoints resumes only under the same training-relevant config (``resume_changes``),
    unless ``allow_config_change``: a changed setting must not be silently ignored by a resume.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    store = store or run_store(cfg, run_dir)  # given: a trial's folder in its search's storage (a Tune trial)
    if store is not None:  # the run may live only in storage (a fresh cluster): its config and files first
        store.pull(run_dir, sorted({*DRIVER_FILES, *WORKER_FILES}))
    resumed = store.has_checkpoints() if store is not None else (run_dir / RAY_TRAIN_DIR).exists()
    path = run_dir / CONFIG
    text = cfg.to_yaml()
    if path.exists() and path.read_bytes() != text.encode("utf-8"):
        if resumed:  # the saved config as the loader reads one: a damaged file is one line, not a traceback
            changes = resume_changes(read_yaml(path) or {}, cfg)
            if changes and not allow_config_change:
                raise ResumeConflict(run_dir, changes)
            if changes:
                append_event(run_dir, "config_change", fields=[c[0] for c in changes])
        kept = run_dir / f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml"
        path.rename(kept)
        if log:
            log(f"[run] {path} differs from this run's config; the earlier one is kept as {kept.name}")
    write_atomic(path, text)
    if store is not None:
        store.push(run_dir, DRIVER_FILES + tuple(p.name for p in run_dir.glob("config.*.yaml")))
    return resumed


def ray_address(address: str | None, connect_timeout_s: float = 20.0) -> tuple[str | None, str]:
    """(address, where it came from); None: start an embedded Ray, whatever Ray's temp folder holds.
    Raises RayUnreachable when a given cluster does not answer within ``connect_timeout_s``."""
    source = "embedded"
    if address:
        source = "--address"
    elif os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        source = "the Ray job" if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") else "RAY_ADDRESS"
    if address and not _wait_for_gcs(address, connect_timeout_s):
        raise RayUnreachable(f"Ray cluster at {address} (from {source}) does not answer after {connect_timeout_s:g} s; "
                             "start it (ray start --head / ray up) or fix the address")
    return address, source


def _wait_for_gcs(address: str, timeout_s: float) -> bool:
    """Whether host:port of a GCS address accepts a TCP connection within ``timeout_s``."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return True  # "auto" and other forms: leave them to Ray
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


class RayUnreachable(RuntimeError):
    """The cluster to join does not answer."""


def init_ray(address: str | None = None, log=print, connect_timeout_s: float = 20.0) -> None:
    """Join --address / RAY_ADDRESS (set by `ray job submit`), else start a fresh embedded Ray.

    ``ray.init()`` with no address would join the cluster named in Ray's temp folder, even a dead
    one left by a crashed ``ray start``; "local" always starts a new one.
    """
    import ray  # ray: imported once the run directory is ready (bind_embedded_ray_to_loopback runs before)

    if ray.is_initialized():
        return
    address, source = ray_address(address, connect_timeout_s)
    ray.init(address=address or "local", log_to_driver=True, logging_level="WARNING")
    if log:
        where = f"{address} (from {source})" if address else "embedded local Ray"
        log(f"[ray] {where}: {ray.cluster_resources().get('CPU', 0):g} CPUs, {ray.cluster_resources().get('GPU', 0):g} GPUs")


def build_trainer(cfg: RunConfig, run_dir: Path, pool, length_ceiling: int | None = None, extra_callbacks=(), store=None):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig as RayRunConfig, ScalingConfig  # ray
    from ray.train.torch import TorchConfig, TorchTrainer

    from pipeline.scoring.pool import training_worker_gpus  # imports ray

    d = cfg.distributed
    store = store or run_store(cfg, run_dir)
    resources = {"CPU": d.cpus_per_worker}
    if d.use_gpu:
        resources["GPU"] = training_worker_gpus(cfg)
    return TorchTrainer(
        ray_train_loop,
        train_loop_config=WorkerArgs(cfg, run_dir.resolve(), pool, length_ceiling, store).loop_config(),
        scaling_config=ScalingConfig(num_workers=scaling_num_workers(cfg), use_gpu=d.use_gpu, resources_per_worker=resources,
                                     placement_strategy=d.placement.upper(), elastic_resize_monitor_interval_s=d.resize_check_s),
        torch_config=TorchConfig(backend="nccl" if d.use_gpu else "gloo"),
        run_config=RayRunConfig(
            name=RAY_TRAIN_DIR,
            storage_path=store.path if store else str(run_dir.resolve()),
            storage_filesystem=store.fs if store else None,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.output.checkpoints_kept),
            failure_config=FailureConfig(max_failures=d.max_failures),
            callbacks=list(extra_callbacks),
            logging_config=ray_logging_config(cfg.logging.console),
        ),
    )


def ray_train_loop(config: dict) -> None:
    """What build_trainer hands Ray Train: the worker's loop, imported where it runs, so the driver itself
    never loads transformers and TRL (bench/gpu_check.py puts its probed loop in this name's place)."""
    from pipeline.training.worker import train_loop_per_worker  # imports torch, transformers, TRL: the worker's

    train_loop_per_worker(config)


def gpu_length_ceiling(cfg: RunConfig) -> int | None:
    """Adaptive cap without a ceiling on a GPU: ask the memory planner for the longest that fits."""
    if not (cfg.adaptive_length and cfg.generation.adaptive.ceiling is None and cfg.distributed.use_gpu):
        return None
    try:
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
    rows = read_metrics(run_dir / METRICS)
    train = [r for r in rows if is_train_row(r)]
    evals = [r for r in rows if "eval/score" in r]

    def span(key: str, fmt: str = ".3f") -> str:
        vals = [r[key] for r in train if isinstance(r.get(key), (int, float))]
        return f"{vals[0]:{fmt}} -> {vals[-1]:{fmt}}" if vals else "n/a"

    lines = [
        f"run directory: {run_dir}",
        f"steps: {max((r['step'] for r in train), default=0)}",
        f"reward: {span('reward')}",
        f"clipped ratio: {span('completions/clipped_ratio', '.2f')}",
        f"entropy: {span('entropy')}",
        f"max completion length: {span(CAP_METRIC, '.0f')}",
    ]
    if evals:
        lines.append(f"eval/score: {evals[0]['eval/score']:.3f} -> {evals[-1]['eval/score']:.3f}")
    adapter = run_dir / ADAPTER_DIR
    lines.append(f"adapter: {adapter if adapter.exists() else 'not written'}")
    return "\n".join(lines)


def run_training(cfg: RunConfig, run_dir: Path, pool=None, log=print) -> TrainOutcome:
    """Train one run end to end on the current Ray (starts a pool when none is given)."""
    from pipeline.scoring.pool import start_pool, stop_pool  # imports ray

    own_pool = pool is None
    if own_pool:  # the judges load while Ray Train starts the workers: a worker's first score waits for them
        pool = start_pool(cfg, wait=False)
    (run_dir / FATAL_FILE).unlink(missing_ok=True)
    try:
        trainer = build_trainer(cfg, run_dir, pool, gpu_length_ceiling(cfg))
        try:
            result = trainer.fit()
        finally:  # a judge that could not load is the cause to name, whatever fit did (before the pool stops)
            if own_pool:
                pool.wait_started()
    finally:
        if own_pool:
            stop_pool(pool)
    raise_if_fatal(run_dir, result.metrics)
    store = run_store(cfg, run_dir)
    if store is not None:  # rank 0 may have run on another node: read the run as storage holds it
        store.download_run(run_dir)
    summary = summarize(run_dir)
    return TrainOutcome(run_dir, dict(result.metrics or {}), summary)


def train_cli(cfg: RunConfig, args) -> int:
    """`synth-grpo train`: the run's lease (run_lease.py) is held from before the run directory is
    written until the command returns, whatever way it returns."""
    return run_holding_leases("train", lambda leases: _train_cli(cfg, args, leases))


def _train_cli(cfg: RunConfig, args, leases) -> int:
    run_dir = Path(args.run_dir).expanduser() if args.run_dir else default_run_dir(cfg)
    problem = _name_run(cfg, args, run_dir) or engine_problem(cfg)
    if problem:
        return cli_error("train", problem)
    run_dir = run_dir.resolve()
    if cfg.distributed.use_gpu:
        warning = warn_if_not_fits(cfg)
        if warning:
            print(f"[plan] WARNING: {warning}", file=sys.stderr)
    prepared = _check_and_prepare(cfg, args, leases, run_dir)
    if isinstance(prepared, int):
        return prepared
    store, resumed = prepared
    print(f"[run] {'resuming' if resumed else 'starting'} {run_dir}")
    quiet_environment(cfg.logging.console)
    try:
        init_ray(args.address)
    except RayUnreachable as e:
        return cli_error("train", e)
    outcome = _train_watched(cfg, run_dir)
    if isinstance(outcome, int):
        return outcome
    print("\n=== synth-grpo summary ===\n" + outcome.summary)
    write_atomic(run_dir / SUMMARY, outcome.summary + "\n")
    if store is not None:
        store.push(run_dir, [SUMMARY])
        print(f"[storage] the run is in {store.uri}")
    return 0


def _name_run(cfg: RunConfig, args, run_dir: Path) -> str | None:
    """Set ``output.run_name`` from the run directory; the problem with its name, if any."""
    # The run's name keys its folder in output.storage: one plain folder name, so the run directory is
    # output.root/<name> (or the explicit --run-dir) and two runs in different places never share a folder.
    name = Path(os.path.abspath(run_dir)).name if args.run_dir else (cfg.output.run_name or "run")
    problem = name_problem(name, "--run-dir (its folder name)" if args.run_dir else "output.run_name")
    if problem:
        return problem
    cfg.output.run_name = name
    if not run_dir.is_absolute() and os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        print(f"[run] WARNING: output.root {cfg.output.root!r} is relative inside a Ray job: the run directory "
              "would be in Ray's temporary copy of the working dir; use --set output.root=/absolute/path",
              file=sys.stderr)
    return None


def _check_and_prepare(cfg: RunConfig, args, leases, run_dir: Path):
    """(store, resumed), or the exit code: everything a retry cannot fix is found here, before Ray or any
    model starts (exit 2), and the run's lease is taken before anything is written."""
    try:
        check_source(cfg.data)
        if cfg.output.storage:
            check_writable(cfg.output.storage, cfg.output.run_name)
        store = run_store(cfg, run_dir)
        lease = leases.take(run_dir, store, "train")  # one writer per run, before anything is written
        resumed = prepare_run_dir(cfg, run_dir, allow_config_change=getattr(args, "allow_config_change", False),
                                  store=store)
        lease.record_takeovers(run_dir, store)
    except (DataError, ResumeConflict, StorageError, LeaseHeld) as e:
        return cli_error("train", e)
    except ConfigError as e:  # the run's saved config.yaml cannot be read
        return cli_error("train", "invalid config", e.problems)
    except OSError as e:
        field = "--run-dir" if args.run_dir else "output.root"
        return cli_error("train", f"{field}: cannot write the run directory {run_dir}: "
                                  f"{e.strerror or e} ({e.filename or run_dir})")
    return store, resumed


def _train_watched(cfg: RunConfig, run_dir: Path) -> TrainOutcome | int:
    """The run under the driver's console; the exit code when it fails (the run directory is kept)."""
    from pipeline.scoring.pool import RewardPoolError  # imports ray

    try:
        with watch(run_dir, cfg.logging.console, cfg.optimization.max_steps, live=cfg.logging.progress_bar):
            return run_training(cfg, run_dir)
    except FatalRunError as e:
        return cli_error("train", "stopped without retrying (a retry would fail the same way); the run directory "
                                  f"{run_dir} is kept\n{e}")
    except RewardPoolError as e:
        return cli_error("train", f"{e}\ncheckpoints so far are kept in {run_dir / RAY_TRAIN_DIR}", code=1)
    except Exception as e:  # Ray wraps worker errors; show the cause, keep the run directory
        cause = e
        while getattr(cause, "__cause__", None) is not None:
            cause = cause.__cause__
        return cli_error("train", f"training failed: {type(cause).__name__}: {cause}\nthe run directory "
                                  f"{run_dir} and its checkpoints are kept; rerun the same command to resume", code=1)
