"""`synth-grpo tune`: Ray Tune over the same training as `synth-grpo train`, one run directory per trial.

Each trial is a Tune function that builds the project's Ray Train TorchTrainer for its own config
and run directory and calls ``fit()`` (the Ray Train V2 + Tune pattern); a Ray Train callback
forwards the held-out ``eval/score`` reports to Tune. The objective is that fixed-weight score,
never the training reward, whose scale moves with the searched reward weights. One reward pool
(one frozen judge in memory) is started by the driver and shared by every trial.

Layout under ``<output.root>/<name>/``: ``trials/<trial_id>/`` (run directories), ``tune/`` (Tune's
experiment state, for ``--resume``), ``base_config.yaml`` and ``space.yaml`` (what the search
resumes with), ``results.csv`` and ``best.yaml``. With ``output.storage`` the same layout is also
kept in ``<output.storage>/<name>/``: Tune's experiment state and every trial's checkpoints and
files go there, so a search runs on nodes without a shared disk and ``--resume`` works from a
machine that has none of it locally.
"""

from __future__ import annotations

import csv
import io
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import ray
import yaml

from pipeline.config import (ConfigError, RunConfig, config_from_dict, engine_problem, get_path, read_yaml,
                             worker_range)
from pipeline.console.live import quiet_environment
from pipeline.console.trials import TrialBoard, tune_console_callback
from pipeline.data.sources import DataError, check_source
from pipeline.errors import cli_error
from pipeline.rundir.files import ADAPTER_DIR, CONFIG, METRICS, WORKER_DIRS, read_metrics, write_atomic
from pipeline.rundir.lease import LeaseHeld, run_holding_leases
from pipeline.rundir.storage import StorageError, check_writable, name_problem, run_store
from pipeline.scoring.pool import RewardPoolError, judge_actor_options, start_pool, stop_pool, training_worker_gpus
from pipeline.training.driver import (FATAL_FILE, RayUnreachable, build_trainer, gpu_length_ceiling, init_ray,
                                      prepare_run_dir, raise_if_fatal)
from pipeline.tune.search_space import SearchSpace, SpaceError, load_space, parse_space

OBJECTIVE = "eval/score"
TIME_ATTR = "step"  # the training step each eval reports: ASHA's clock
TRIAL_DRIVER_CPUS = 0.1  # the Tune trial only waits on its Train controller; workers bring their own CPUs
TUNE_DIR, TRIALS_DIR = "tune", "trials"
BASE_CONFIG, SPACE_COPY, RESULTS_CSV, BEST_CONFIG = "base_config.yaml", "space.yaml", "results.csv", "best.yaml"
EXIT_INTERRUPTED = 130


@dataclass
class SearchOutcome:
    exp_dir: Path
    rows: list[dict[str, Any]]
    results_csv: Path
    best_config: Path | None
    interrupted: bool
    search_alg: str
    columns: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- inside a trial


def _report_callback(max_steps: int, save_steps: int):
    """Ray Train callback (runs in the Train controller): forward eval reports to the Tune trial.

    Checkpoint-only reports carry no ``eval/score`` (Tune's strict metric check would fail the
    trial), so only eval reports and the final one go on. An evaluation at a step that also saves
    a checkpoint is held until that checkpoint's report (the worker evaluates before TRL saves):
    ASHA may stop the trial on it, at a rung or at ``max_t``, and stopping it on the evaluation
    killed the run before Ray Train had registered the step's checkpoint (seen on S3). Ray Train
    runs its checkpoint manager before user callbacks, so the checkpoint is registered first.
    """
    from ray.tune.integration.ray_train import TuneReportCallback

    class EvalReportCallback(TuneReportCallback):
        held: dict | None = None

        def after_report(self, run_context, metrics, checkpoint):
            row = dict(metrics[0]) if metrics else {}
            final = bool(row.pop("done", None))  # Tune reads "done" as "stop this trial now", before the function returns
            step = row.get(TIME_ATTR, 0)
            held, self.held = self.held, None
            if held is not None and not (final and OBJECTIVE in row and step == held.get(TIME_ATTR)):
                if checkpoint is not None or final or step > held.get(TIME_ATTR, 0):
                    super().after_report(run_context, [held], None)
                else:
                    self.held = held
            if OBJECTIVE not in row:
                return
            if not final and (step >= max_steps or (save_steps and step % save_steps == 0)):
                self.held = row
                return
            super().after_report(run_context, [row], None)

    return EvalReportCallback()


def tune_trial(params: dict[str, Any], *, base: dict[str, Any], space: SearchSpace, pool, trials_dir: str,
               trials_store=None) -> None:
    """One Tune trial: its config (validated), its run directory, the project's TorchTrainer.fit().

    ``trials_store``: the search's ``trials/`` folder in storage; its filesystem holds no credentials,
    so the trial's process authenticates from its own environment (pipeline.rundir.storage.filesystem).
    """
    from ray import tune  # lazy: Ray Tune loads only where a search runs

    trial_id = tune.get_context().get_trial_id()
    cfg = space.trial_config(base, params)
    cfg.output.root, cfg.output.run_name = trials_dir, trial_id
    store = trials_store.child(trial_id) if trials_store is not None else None
    cfg.output.storage = trials_store.uri if trials_store is not None else None
    run_dir = Path(trials_dir) / trial_id  # stable across --resume: Ray Train resumes from its checkpoints
    prepare_run_dir(cfg, run_dir, log=None, store=store)  # with storage: the trial's files come from there first
    if store is not None and not trained(run_dir) and store.exists(f"{ADAPTER_DIR}/adapter_config.json"):
        store.pull(run_dir, dirs=WORKER_DIRS)
    if trained(run_dir):  # finished before a crash Tune's saved state had not caught up with
        last = last_eval(run_dir)
        if last:
            tune.report(last)
        return
    (run_dir / FATAL_FILE).unlink(missing_ok=True)
    build_trainer(cfg, run_dir, pool, gpu_length_ceiling(cfg), extra_callbacks=[_report_callback(cfg.optimization.max_steps, cfg.output.save_steps)], store=store).fit()
    raise_if_fatal(run_dir)  # a worker stopped on an error a retry cannot fix: the trial errors with it


def trained(run_dir: Path) -> bool:
    """The worker saves the adapter only after the last step."""
    return (run_dir / ADAPTER_DIR / "adapter_config.json").exists()


def last_eval(run_dir: Path) -> dict[str, Any]:
    rows = [r for r in read_metrics(run_dir / METRICS) if OBJECTIVE in r]
    return {k: v for k, v in rows[-1].items() if isinstance(v, (int, float))} if rows else {}


def _trial_dirname(trial) -> str:
    return trial.trial_id


# ---------------------------------------------------------------- driver


def max_concurrent_trials(cfg: RunConfig, resources: dict[str, float]) -> int:
    """Trials that fit beside the shared pool: (cluster - pool) / (trial driver + workers), at least 1."""
    d, j = cfg.distributed, cfg.judge
    judge = judge_actor_options(cfg)
    workers = worker_range(cfg)[1]
    per_trial_cpu = TRIAL_DRIVER_CPUS + workers * d.cpus_per_worker
    fits = [(resources.get("CPU", 0.0) - j.num_actors * judge["num_cpus"]) / per_trial_cpu]
    if d.use_gpu:
        fits.append((resources.get("GPU", 0.0) - j.num_actors * judge["num_gpus"]) / (workers * training_worker_gpus(cfg)))
    return max(1, math.floor(min(fits) + 1e-9))


def search_algorithm(seed: int):
    """Optuna (TPE) where it imports, else Tune's random search; both seeded."""
    try:
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        return OptunaSearch(seed=seed), "optuna"
    except ImportError:
        from ray.tune.search import BasicVariantGenerator

        return BasicVariantGenerator(random_state=seed), "random"


def resolve_base(cfg: RunConfig) -> RunConfig:
    """Absolute paths: Tune runs trials in their own working directories."""
    cfg = config_from_dict(cfg.to_dict())
    cfg.output.root = str(Path(cfg.output.root).expanduser().resolve())
    model = Path(cfg.model.name_or_path).expanduser()
    if model.exists():
        cfg.model.name_or_path = str(model.resolve())
    return cfg


def experiment_dir(cfg: RunConfig, name: str | None) -> tuple[str, Path]:
    name = name or f"{cfg.output.run_name or 'run'}-tune"
    return name, Path(cfg.output.root).expanduser().resolve() / name


def run_search(cfg: RunConfig, space: SearchSpace | None, name: str | None = None, samples: int | None = None,
               resume: bool = False, log=print, tune_callbacks: Sequence = ()) -> SearchOutcome:
    """Run (or, with ``resume``, continue) a search on the current Ray; raises ConfigError for bad input.

    On resume the base config and space saved with the experiment are used, so the finished
    trials and the rest are one search.
    """
    name, exp_dir = experiment_dir(cfg, name)
    store = run_store(cfg, exp_dir, name=name)  # <output.storage>/<name>/
    # Where Tune keeps its experiment state: the storage folder when there is one, else the local folder.
    tune_path, tune_fs = (f"{store.path}/{TUNE_DIR}", store.fs) if store else (str(exp_dir / TUNE_DIR), None)
    if resume:
        base, space = _resumed_search(exp_dir, store, tune_path, tune_fs, log)
    else:
        base = _new_search(cfg, space, exp_dir, store)
    base_dict = base.to_dict()
    callbacks = list(tune_callbacks)
    if log and base.logging.console != "verbose":  # the CLI's console: trial events and a live table instead of Tune's reporter
        callbacks.append(tune_console_callback(TrialBoard(lambda p: describe_trial(space, base_dict, p), base.logging.console)))

    init_ray(None, log=log)
    concurrency = max_concurrent_trials(base, ray.cluster_resources())
    alg, alg_name = search_algorithm(base.optimization.seed)
    pool = start_pool(base, name=f"{name}-pool")
    trainable = _trainable(base_dict, space, pool, exp_dir, store)
    if log:
        log(f"[tune] {exp_dir}: search {alg_name}, ASHA on {OBJECTIVE} by {TIME_ATTR} (rungs below step {_last_rung(base) + 1}), "
            f"{concurrency} trial(s) at a time on {ray.cluster_resources().get('CPU', 0):g} CPUs")
    try:
        if resume:
            tuner = _restored_tuner(tune_path, tune_fs, trainable)
        else:
            tuner = _new_tuner(trainable, base, space, alg, samples, concurrency, callbacks, tune_fs,
                               store.path if store else str(exp_dir))
        tuner.fit()
    finally:
        stop_pool(pool)
    return _collect_outcome(tune_path, tune_fs, store, exp_dir, space, base, name, alg_name)


def _resumed_search(exp_dir: Path, store, tune_path: str, tune_fs, log) -> tuple[RunConfig, SearchSpace]:
    """The base config and space a search was started with, read back from its folder (or its storage)."""
    from ray import tune  # lazy: Ray Tune loads only where a search runs

    if store is not None:  # a machine that never saw the search: its saved base config and space first
        store.pull(exp_dir, [BASE_CONFIG, SPACE_COPY], only_larger=False)
    if not tune.Tuner.can_restore(tune_path, storage_filesystem=tune_fs):
        where = store.uri + "/" + TUNE_DIR if store else exp_dir / TUNE_DIR
        raise ConfigError([f"--resume: no search to resume at {where} (check --config's output.root, output.storage and --name)"])
    base = config_from_dict(read_yaml(exp_dir / BASE_CONFIG))
    space = parse_space(read_yaml(exp_dir / SPACE_COPY), str(exp_dir / SPACE_COPY))
    if log:
        log(f"[tune] resuming {exp_dir} with its saved {BASE_CONFIG} and {SPACE_COPY}")
    return base, space


def _new_search(cfg: RunConfig, space: SearchSpace | None, exp_dir: Path, store) -> RunConfig:
    """A new search's base config, checked against the space and saved with it for ``--resume``."""
    if space is None:
        raise ConfigError(["--space: a search space is required"])
    if (exp_dir / TUNE_DIR).exists():
        raise ConfigError([f"--name: a search already exists at {exp_dir}; pass --resume to continue it, or another --name"])
    base = resolve_base(cfg)
    _check_base(base, space)
    exp_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(exp_dir / BASE_CONFIG, base.to_yaml())
    write_atomic(exp_dir / SPACE_COPY, yaml.safe_dump(space.raw, sort_keys=False))
    if store is not None:
        store.push(exp_dir, [BASE_CONFIG, SPACE_COPY])
    return base


def _last_rung(base: RunConfig) -> int:
    """ASHA's max_t: rungs strictly before the last step, so a trial that ran every step (and saved its
    adapter) is never cut off there."""
    return max(1, base.optimization.max_steps - 1)


def _trainable(base_dict: dict[str, Any], space: SearchSpace, pool, exp_dir: Path, store):
    """`tune_trial` bound to the search's base, space and shared pool, on a small CPU bundle of its own."""
    from ray import tune  # lazy: Ray Tune loads only where a search runs

    return tune.with_resources(
        tune.with_parameters(tune_trial, base=base_dict, space=space, pool=pool, trials_dir=str(exp_dir / TRIALS_DIR),
                             trials_store=store.child(TRIALS_DIR) if store else None),
        tune.PlacementGroupFactory([{"CPU": TRIAL_DRIVER_CPUS}]),
    )


def _restored_tuner(tune_path: str, tune_fs, trainable):
    from ray import tune  # lazy: Ray Tune loads only where a search runs

    return tune.Tuner.restore(tune_path, trainable=trainable, resume_unfinished=True, resume_errored=False,
                              storage_filesystem=tune_fs)


def _new_tuner(trainable, base: RunConfig, space: SearchSpace, alg, samples: int | None, concurrency: int,
               callbacks: list, tune_fs, storage_path: str):
    """A Tuner maximizing the objective with ASHA over the steps; Tune's own reporter only in verbose mode."""
    from ray import tune  # lazy: Ray Tune loads only where a search runs
    from ray.tune.schedulers import ASHAScheduler  # lazy: Ray Tune loads only where a search runs

    max_t = _last_rung(base)
    scheduler = ASHAScheduler(
        time_attr=TIME_ATTR, max_t=max_t, grace_period=min(space.grace_period or base.eval.every_steps, max_t),
        reduction_factor=space.reduction_factor, stop_last_trials=False,
    )
    return tune.Tuner(
        trainable,
        param_space=space.to_tune(),
        tune_config=tune.TuneConfig(
            metric=OBJECTIVE, mode="max", search_alg=alg, scheduler=scheduler,
            num_samples=samples or space.num_samples, max_concurrent_trials=concurrency,
            trial_dirname_creator=_trial_dirname,
        ),
        run_config=tune.RunConfig(
            name=TUNE_DIR, storage_path=storage_path, storage_filesystem=tune_fs,
            callbacks=callbacks,
            verbose=None if base.logging.console == "verbose" else 0,
            failure_config=tune.FailureConfig(max_failures=0),  # Ray Train retries inside a trial
        ),
    )


def _collect_outcome(tune_path: str, tune_fs, store, exp_dir: Path, space: SearchSpace, base: RunConfig, name: str,
                     alg_name: str) -> SearchOutcome:
    """The finished search's table, results.csv and best.yaml (also pushed to storage)."""
    trials = saved_trials(tune_path, tune_fs)
    if store is not None:  # trials ran on other nodes: their files, as far as this table needs them
        pull_trials(store.child(TRIALS_DIR), [t[0] for t in trials], exp_dir / TRIALS_DIR)
    rows, columns, interrupted = collect_rows(trials, space, base.to_dict(), exp_dir)
    results_csv = write_results_csv(rows, columns, exp_dir / RESULTS_CSV)
    best = write_best_config(rows, space, base, name, exp_dir / BEST_CONFIG)
    if store is not None:
        store.push(exp_dir, [RESULTS_CSV, BEST_CONFIG])
    return SearchOutcome(exp_dir, rows, results_csv, best, interrupted, alg_name, columns)


def pull_trials(trials_store, trial_ids: Sequence[str], trials_dir: Path) -> None:
    """Each trial's config, metrics and adapter config from storage into ``trials_dir``, where missing here."""
    for trial_id in trial_ids:
        trials_store.child(trial_id).pull(trials_dir / trial_id, [CONFIG, METRICS, f"{ADAPTER_DIR}/adapter_config.json"])


def _check_base(base: RunConfig, space: SearchSpace) -> None:
    problems = []
    if base.eval.num_prompts < 1:
        problems.append(f"eval.num_prompts: {base.eval.num_prompts}: the search's objective is {OBJECTIVE}; it needs held-out prompts (>= 1)")
    problems += space.check_against(base.to_dict())
    if problems:
        raise SpaceError(problems)


# ---------------------------------------------------------------- results


def _error_line(err: BaseException | None) -> str:
    """The root cause of a trial's error in one line (Ray wraps it in several layers of tracebacks)."""
    if err is None:
        return ""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    causes = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b:?", ln)]
    line = causes[-1] if causes else (lines[-1] if lines else type(err).__name__)
    return line[:300]


def saved_trials(tune_dir: Path | str, filesystem=None) -> list[tuple[str, str, dict, Any]]:
    """(trial id, status, searched config, Result) per trial, as Tune saved them: what ``--resume`` will see.

    Tune's public readers of a saved experiment (``ExperimentAnalysis`` on the folder, ``ResultGrid``
    over it). The grid ``Tuner.fit()`` returns is not used: on Ctrl-C Tune marks the trials it stopped
    TERMINATED in memory, after saving them as still running.
    """
    from ray.tune import ExperimentAnalysis, ResultGrid

    analysis = ExperimentAnalysis(str(tune_dir), storage_filesystem=filesystem, default_metric=OBJECTIVE, default_mode="max")
    # The trial's own config: a trial that failed before reporting has none in its Result.
    return [(t.trial_id, t.status, dict(t.config or {}), r) for t, r in zip(analysis.trials, ResultGrid(analysis))]


def collect_rows(trials: Sequence[tuple[str, str, dict, Any]], space: SearchSpace, base: dict[str, Any],
                 exp_dir: Path) -> tuple[list[dict], list[str], bool]:
    """One row per trial (from ``saved_trials``), sorted by the objective (best first), trials without a score last."""
    keys = list(space.searched_keys)
    if "generation.num_generations" in keys and "optimization.per_device_train_batch_size" not in keys:
        keys.append("optimization.per_device_train_batch_size")
    rows, interrupted = [], False
    for trial_id, status, params, result in trials:
        metrics = result.metrics or {}
        row: dict[str, Any] = {"trial_id": trial_id, OBJECTIVE: metrics.get(OBJECTIVE), TIME_ATTR: metrics.get(TIME_ATTR)}
        error, values = _error_line(result.error), {}
        try:
            values = space.trial_config(base, params).to_dict()
            row.update({k: get_path(values, k) for k in keys})
        except ConfigError as e:
            error = error or "; ".join(e.problems)
        if result.error or status == "ERROR":
            row["status"] = "error"
        elif status != "TERMINATED":
            row["status"], interrupted = "unfinished", True
        # Done: trained, and its last step's evaluation is the one Tune saw. A trial ASHA stopped can
        # still reach its last step before the stop lands; its score and storage are the stop's.
        elif trained(exp_dir / TRIALS_DIR / trial_id) and row[TIME_ATTR] == get_path(values, "optimization.max_steps"):
            row["status"] = "done"
        else:
            row["status"] = f"stopped@{row[TIME_ATTR]}"  # ASHA stopped it early
        row["run_dir"] = str(exp_dir / TRIALS_DIR / trial_id)
        row["error"] = error
        rows.append(row)
    rows.sort(key=lambda r: (r[OBJECTIVE] is None, -(r[OBJECTIVE] or 0.0)))
    for rank, row in enumerate(rows, 1):
        row["rank"] = rank
    columns = ["rank", "trial_id", "status", OBJECTIVE, TIME_ATTR, *keys, "run_dir", "error"]
    return rows, columns, interrupted


def write_results_csv(rows: list[dict], columns: list[str], path: Path) -> Path:
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return write_atomic(path, out.getvalue())


def _short(key: str) -> str:
    return ("w." if key.startswith("rewards.weights.") else "") + key.rsplit(".", 1)[-1]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def describe_trial(space: SearchSpace, base: dict[str, Any], params: dict[str, Any]) -> str:
    """A trial's searched values in one line (as the results table shows them)."""
    try:
        values: Any = space.trial_config(base, dict(params)).to_dict()
    except ConfigError as e:
        return "invalid: " + "; ".join(e.problems)
    return " ".join(f"{_short(key)}={_cell(get_path(values, key))}" for key in space.searched_keys)


def format_table(rows: list[dict], columns: list[str]) -> str:
    """The results as a fixed-width table (run directories omitted; errors last and shortened)."""
    cols = [c for c in columns if c != "run_dir"]
    head = [_short(c) if "." in c else c for c in cols]
    body = [[_cell(r.get(c)) if c != "error" else (r.get("error") or "")[:80] for c in cols] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *(fmt(b) for b in body)])


def write_best_config(rows: list[dict], space: SearchSpace, base: RunConfig, name: str, path: Path) -> Path | None:
    """The best scored trial as a config `synth-grpo train --config` runs unchanged, in its own run directory."""
    best = next((r for r in rows if r[OBJECTIVE] is not None and r["status"] != "error"), None)
    if best is None:
        return None
    params = read_yaml(Path(best["run_dir"]) / CONFIG)
    cfg = config_from_dict(params)
    cfg.output.root, cfg.output.run_name = base.output.root, f"{name}-best"
    header = (f"# best trial {best['trial_id']} of search {name}: {OBJECTIVE} {best[OBJECTIVE]:.4f} at step "
              f"{best[TIME_ATTR]} (trial run directory {best['run_dir']})\n")
    write_atomic(path, header + cfg.to_yaml())
    return path


# ---------------------------------------------------------------- CLI


def tune_cli(cfg: RunConfig, args) -> int:
    """`synth-grpo tune`: the search's lease (run_lease.py, on ``<output.root>/<name>/`` and its storage
    folder) is held from before anything of the search is written until the command returns."""
    return run_holding_leases("tune", lambda leases: _tune_cli(cfg, args, leases))


def _tune_cli(cfg: RunConfig, args, leases) -> int:
    if args.samples is not None and args.samples < 1:
        return cli_error("tune", f"--samples {args.samples}: must be >= 1")
    try:
        space = None if args.resume else load_space(args.space)
        if space is not None:
            _check_base(resolve_base(cfg), space)  # before Ray starts
    except SpaceError as e:
        return cli_error("tune", f"invalid search space {args.space}", e.problems)
    name, exp_dir = experiment_dir(cfg, getattr(args, "name", None))
    problem = name_problem(name, "--name" if getattr(args, "name", None) else "--name (by default <output.run_name>-tune)") \
        or engine_problem(cfg)
    if problem:
        return cli_error("tune", problem)
    try:  # storage that cannot be written ends here, before Ray or any model starts
        if cfg.output.storage:
            check_writable(cfg.output.storage, name)
        store = run_store(cfg, exp_dir, name=name)
        # one search per name: held before the check that no search exists, so two starts cannot both pass it
        leases.take(exp_dir, store, "tune", what="search").record_takeovers(exp_dir, store)
        where = f"{exp_dir}" + (f" or {store.uri}" if store else "")
        if not args.resume and ((exp_dir / TUNE_DIR).exists() or (store is not None and store.exists(TUNE_DIR))):
            return cli_error("tune", f"a search already exists at {where}; pass --resume to continue it, "
                                     "or another --name")
        if args.resume and not ((exp_dir / BASE_CONFIG).is_file() or (store is not None and store.exists(BASE_CONFIG))):
            return cli_error("tune", f"--resume: no search at {where} (it is found through --config's output.root, "
                                     "output.storage and --name)")
    except (StorageError, LeaseHeld) as e:
        return cli_error("tune", e)
    quiet_environment(cfg.logging.console)
    try:
        check_source(cfg.data)
        init_ray(args.address)
    except (DataError, RayUnreachable) as e:
        return cli_error("tune", e)
    try:
        outcome = run_search(cfg, space, name=name, samples=args.samples, resume=args.resume)
    except RewardPoolError as e:
        return cli_error("tune", e, code=1)
    print(f"\n=== synth-grpo tune: {len(outcome.rows)} trials, sorted by {OBJECTIVE} ===")
    print(format_table(outcome.rows, outcome.columns))
    print(f"\nresults: {outcome.results_csv}")
    if outcome.best_config:
        print(f"best config: {outcome.best_config}\n  train it: synth-grpo train --config {outcome.best_config}")
    if outcome.interrupted:
        again = f"--config {args.config} " if args.config else ""
        print(f"search interrupted; continue it with: synth-grpo tune {again}--name {name} --resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0 if outcome.best_config else 1
