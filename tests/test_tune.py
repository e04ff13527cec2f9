"""Ray Tune search: the space parser (fast, no Ray) and real searches on the tiny models on CPU."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, RunConfig, config_from_dict, load_config
from pipeline.tune.search_space import SpaceError, fit_batch_to_groups, load_space, parse_space
from pipeline.rundir.files import ADAPTER_DIR, EVENTS, METRICS, RAY_TRAIN_DIR
from pipeline.rundir.storage import RunStorage
from pipeline.tune.tuner import BEST_CONFIG, OBJECTIVE, RESULTS_CSV, TRIALS_DIR, TUNE_DIR, max_concurrent_trials
from tests.conftest import bucket_objects, leaked_credentials, local_files

REPO = Path(__file__).resolve().parents[1]
LR = "optimization.learning_rate"
NG = "generation.num_generations"
BATCH = "optimization.per_device_train_batch_size"


def space(**entries) -> dict:
    return {"num_samples": 2, "space": {k.replace("__", "."): v for k, v in entries.items()}}


def problems_of(data) -> list[str]:
    with pytest.raises(SpaceError) as e:
        parse_space(data, "s.yaml")
    return e.value.problems


# ---------------------------------------------------------------- parser: distributions


def test_each_distribution_parses_and_maps_to_tune():
    s = parse_space({"num_samples": 5, "space": {
        LR: {"loguniform": ["1e-6", 5.0e-5]},  # PyYAML reads 1e-6 (no dot) as a string
        "optimization.warmup_ratio": {"uniform": [0.0, 0.2]},
        NG: {"choice": [4, 8, 16]},
        "optimization.max_steps": {"randint": [10, 20]},
        "grpo.beta": 0.01,  # a plain value: held fixed for every trial
    }})
    kinds = {d.key: (d.kind, d.args) for d in s.params}
    assert kinds == {
        LR: ("loguniform", (1e-6, 5e-5)), "optimization.warmup_ratio": ("uniform", (0.0, 0.2)),
        NG: ("choice", (4, 8, 16)), "optimization.max_steps": ("randint", (10, 20)), "grpo.beta": ("fixed", (0.01,)),
    }
    assert s.num_samples == 5
    from ray.tune.search.sample import Categorical, Float, Integer

    t = s.to_tune()
    assert isinstance(t[LR], Float) and isinstance(t[NG], Categorical) and t[NG].categories == [4, 8, 16]
    assert isinstance(t["optimization.max_steps"], Integer) and (t["optimization.max_steps"].lower, t["optimization.max_steps"].upper) == (10, 20)
    assert t["grpo.beta"] == 0.01


def test_trial_config_applies_values_and_validates():
    s = parse_space(space(**{LR: {"loguniform": [1e-6, 1e-4]}, "generation.adaptive.start": {"randint": [16, 64]}}))
    import numpy as np

    cfg = s.trial_config(RunConfig().to_dict(), {LR: 3e-5, "generation.adaptive.start": np.int64(40)})  # Tune hands numpy ints
    assert cfg.optimization.learning_rate == 3e-5 and cfg.generation.adaptive.start == 40
    assert type(cfg.generation.adaptive.start) is int


# ---------------------------------------------------------------- parser: the reward-weight simplex


def simplex_space(**spec) -> dict:
    return space(rewards__weights={"simplex": ["rouge_l", "length", "judge"], **spec})


def test_simplex_draws_normalise_to_one_and_fixed_components_keep_their_weight():
    s = parse_space(simplex_space(fixed=["eos"]))
    base = RunConfig().to_dict()  # eos weight 1.0
    draws = {"rewards.weights[rouge_l]": 0.9, "rewards.weights[length]": 0.05, "rewards.weights[judge]": 0.4}
    w = s.trial_config(base, draws).rewards.weights
    assert math.isclose(w["rouge_l"] + w["length"] + w["judge"], 1.0)
    assert w["eos"] == 1.0
    # -log(u): a small draw is a large weight (a flat Dirichlet from uniforms)
    assert w["length"] > w["judge"] > w["rouge_l"] > 0
    even = s.trial_config(base, {k: 0.3 for k in draws}).rewards.weights
    assert all(math.isclose(even[c], 1 / 3) for c in ("rouge_l", "length", "judge"))
    assert set(s.searched_keys) == {f"rewards.weights.{c}" for c in ("rouge_l", "length", "judge", "eos")}


def test_simplex_fixed_values_and_total():
    s = parse_space(simplex_space(fixed={"eos": 0.5}, total=2.0))
    draws = {"rewards.weights[rouge_l]": 0.5, "rewards.weights[length]": 0.5, "rewards.weights[judge]": 0.5}
    w = s.trial_config(RunConfig().to_dict(), draws).rewards.weights
    assert w["eos"] == 0.5 and math.isclose(w["rouge_l"] + w["length"] + w["judge"], 2.0)
    assert set(s.to_tune()) == set(draws)


def test_simplex_draws_cover_the_simplex():
    """Uniform draws through -log give a flat Dirichlet: each weight's mean is 1/3."""
    import random

    s = parse_space(simplex_space())
    rng = random.Random(0)
    means = {"rouge_l": 0.0, "length": 0.0, "judge": 0.0}
    n = 3000
    for _ in range(n):
        w = s.simplexes[0].weights({s.simplexes[0].param(c): rng.random() for c in means}, {})
        for c in means:
            means[c] += w[c] / n
    assert all(abs(m - 1 / 3) < 0.02 for m in means.values()), means


# ---------------------------------------------------------------- batch size fitted to the group


@pytest.mark.parametrize("batch, workers, spg, groups, expected", [
    (8, 1, 1, 16, 16),   # a group bigger than the batch: the batch grows to one whole group
    (8, 1, 1, 4, None),  # already divisible: unchanged
    (6, 1, 1, 4, 8),     # next multiple of the group
    (4, 2, 1, 16, 8),    # 8 x 2 workers = 16
    (3, 1, 2, 8, 4),     # 4 x 2 steps per generation = 8
])
def test_batch_size_is_raised_to_what_trl_accepts(batch, workers, spg, groups, expected):
    data = {"optimization": {"per_device_train_batch_size": batch}, "distributed": {"num_workers": workers},
            "generation": {"num_generations": groups, "steps_per_generation": spg}}
    assert fit_batch_to_groups(data) == expected
    final = data["optimization"]["per_device_train_batch_size"]
    assert (final * workers * spg) % groups == 0 and final >= batch


def test_every_group_size_of_the_default_space_gives_a_valid_trial():
    s = load_space(REPO / "tune_spaces" / "default.yaml")
    base = load_config(None).to_dict()
    assert s.check_against(base) == []
    for g in (4, 8, 16):
        cfg = s.trial_config(base, {LR: 1e-5, NG: g, **{f"rewards.weights[{c}]": 0.5 for c in ("rouge_l", "length", "judge")}})
        assert cfg.generation.num_generations == g and cfg.generation_batch_size % g == 0


def test_default_space_fits_the_real_config():
    s = load_space(REPO / "tune_spaces" / "default.yaml")
    assert s.check_against(load_config(REPO / "configs" / "sauerkraut-8b.yaml").to_dict()) == []


# ---------------------------------------------------------------- bad spaces name the key and what was expected


@pytest.mark.parametrize("data, expected", [
    (space(optimization__learning_rat={"uniform": [0, 1]}),
     "optimization.learning_rat: unknown config field (did you mean 'optimization.learning_rate'?)"),
    (space(**{LR: {"logunifrom": [1e-6, 1e-5]}}),
     "optimization.learning_rate: unknown distribution 'logunifrom' (did you mean 'loguniform'?)"),
    (space(**{LR: {"uniform": [1e-4, 1e-5]}}), "optimization.learning_rate: uniform low 0.0001 >= high 1e-05"),
    (space(**{LR: {"loguniform": [0, 1e-5]}}), "optimization.learning_rate: loguniform low 0 must be > 0"),
    (space(**{LR: {"loguniform": [1e-6]}}), "optimization.learning_rate: loguniform expects [low, high]"),
    (space(**{LR: {"uniform": ["a", 1]}}), "uniform bounds must be numbers"),
    (space(**{NG: {"choice": []}}), "generation.num_generations: choice expects a non-empty list"),
    (space(**{NG: {"choice": [[4, 8]]}}), "choice options must be single values"),
    (space(**{NG: {"randint": [8, 8]}}), "generation.num_generations: randint low 8 >= high 8 (high is exclusive"),
    (space(**{NG: {"randint": [2.5, 8]}}), "randint bounds must be integers"),
    (space(**{NG: {"uniform": [2, 16]}}), "uniform draws floats but the field takes integers; use randint or choice"),
    (space(**{LR: {"uniform": [0, 1], "choice": [1]}}), "expected one distribution"),
    (space(eval__num_prompts={"choice": [4, 8]}), "eval.num_prompts: eval.* cannot be searched"),
    (space(rewards__weights={"uniform": [0, 1]}), "rewards.weights: a weights mapping is searched with 'simplex"),
    (space(rewards__weights={"simplex": ["rouge_l", "judg"]}), "simplex component 'judg' is not a reward component (did you mean 'judge'?)"),
    (space(rewards__weights={"simplex": ["rouge_l"]}), "simplex expects a list of at least 2"),
    (space(rewards__weights={"simplex": ["rouge_l", "judge"], "fixed": {"judge": 0.2}}), "'judge' is both drawn and fixed"),
    (space(rewards__weights={"simplex": ["rouge_l", "judge"], "fixed": {"eos": -1}}), "fixed weight for 'eos' must be a number >= 0"),
    (space(rewards__weights={"simplex": ["rouge_l", "judge"], "total": 0}), "total must be a number > 0"),
    (space(rewards__weights={"simplex": ["rouge_l", "judge"], "fixd": ["eos"]}), "unknown simplex key 'fixd' (did you mean 'fixed'?)"),
    (space(eval__score_weights={"simplex": ["rouge_l", "judge"]}), "eval.score_weights: eval.* cannot be searched"),
    (space(rewards__weights={"simplex": ["rouge_l", "judge"]}, rewards__weights__judge={"uniform": [0, 1]}),
     "rewards.weights.judge: also set by the simplex on rewards.weights"),
    ({"num_samples": 0, "space": {LR: 1e-5}}, "num_samples: 0 must be an integer >= 1"),
    ({"samples": 3, "space": {LR: 1e-5}}, "unknown top-level key 'samples' (did you mean 'num_samples'?)"),
    ({"space": {}}, "space: expected a non-empty mapping"),
    ({"asha": {"grace_perid": 2}, "space": {LR: 1e-5}}, "asha.grace_perid: unknown key (did you mean 'grace_period'?)"),
    ([1, 2], "expected a mapping with 'space:' at top level"),
])
def test_bad_space_names_the_key_and_what_was_expected(data, expected):
    found = problems_of(data)
    assert any(expected in p for p in found), found


def test_every_problem_is_reported_at_once():
    found = problems_of(space(**{LR: {"loguniform": [0, 1]}, NG: {"choice": []}, "grpo.betta": 0.1}))
    assert len(found) == 3


def test_corner_values_are_checked_with_the_config_validation():
    s = parse_space(space(**{NG: {"choice": [1, 4]}, "grpo.epsilon_high": {"uniform": [0.1, 0.3]}}))
    found = s.check_against(RunConfig().to_dict())
    assert any("generation.num_generations=1" in p and "must be >= 2" in p for p in found), found
    assert any("grpo.epsilon_high=0.1" in p and "must be >= epsilon" in p for p in found), found
    with pytest.raises(ConfigError, match="num_generations"):
        s.trial_config(RunConfig().to_dict(), {NG: 1, "grpo.epsilon_high": 0.3})


def test_cli_bad_space_exits_2_naming_the_key(tmp_path, capsys):
    from pipeline.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("space:\n  optimization.learning_rate: {loguniform: [0, 1.0e-5]}\n  generation.num_generation: {choice: [4]}\n")
    assert main(["tune", "--space", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "loguniform low 0 must be > 0" in err
    assert "generation.num_generation: unknown config field (did you mean 'generation.num_generations'?)" in err
    assert main(["tune", "--space", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_resume_without_a_search_exits_2(tmp_path, capsys):
    from pipeline.cli.main import main

    assert main(["tune", "--resume", "--name", "nothing-here", "--set", f"output.root={tmp_path}"]) == 2
    assert f"--resume: no search at {tmp_path.resolve() / 'nothing-here'}" in capsys.readouterr().err


def test_cli_needs_eval_prompts_for_the_objective(capsys):
    from pipeline.cli.main import main

    args = ["tune", "--space", str(REPO / "tune_spaces" / "default.yaml"), "--set", "eval.num_prompts=0"]
    assert main(args) == 2
    assert "eval.num_prompts: 0: the search's objective is eval/score" in capsys.readouterr().err


# ---------------------------------------------------------------- concurrency from the cluster's resources


def test_concurrency_follows_resources():
    cfg = config_from_dict({"judge": {"cpus_per_actor": 0.5}, "distributed": {"cpus_per_worker": 1}})
    assert max_concurrent_trials(cfg, {"CPU": 2}) == 1  # 0.5 pool + (0.1 driver + 1 worker)
    cfg.distributed.cpus_per_worker = 0.5
    assert max_concurrent_trials(cfg, {"CPU": 2}) == 2
    assert max_concurrent_trials(cfg, {"CPU": 16}) == 25
    gpu = config_from_dict({"judge": {"gpus_per_actor": 1, "placement": "own_gpu"}, "distributed": {"use_gpu": True, "num_workers": 2}})
    assert max_concurrent_trials(gpu, {"CPU": 64, "GPU": 8}) == 3  # (8 - 1 judge GPU) // 2 GPUs per trial
    assert max_concurrent_trials(gpu, {"CPU": 1, "GPU": 0}) == 1  # never below one


# ---------------------------------------------------------------- results table (no Ray)


def test_results_rows_status_sorting_csv_and_best_config(tmp_path):
    """Statuses come from Tune's saved state (what --resume reads, see saved_trials) and the run directories."""
    from types import SimpleNamespace

    from pipeline.tune.tuner import collect_rows, format_table, write_best_config, write_results_csv

    s = parse_space({"space": {LR: {"loguniform": [1e-6, 1e-4]},
                               "rewards.weights": {"simplex": ["rouge_l", "judge"], "fixed": ["eos"]}}})
    base = RunConfig()
    base.output.root, base.optimization.max_steps = str(tmp_path), 4
    draws = lambda lr: {LR: lr, "rewards.weights[rouge_l]": 0.5, "rewards.weights[judge]": 0.5}  # noqa: E731
    # raced6: ASHA stopped it at step 2, and it reached its last step (adapter saved) before the stop landed
    trials = {"done1": (0.41, 4, None), "best2": (0.52, 4, None), "asha3": (0.30, 2, None),
              "err4": (None, None, RuntimeError("Traceback ...\nOSError: no such model 'x'\n")), "run5": (0.35, 2, None),
              "raced6": (0.33, 2, None)}
    exp = tmp_path / "s-tune"
    states = {t: ("ERROR" if t == "err4" else "RUNNING" if t == "run5" else "TERMINATED") for t in trials}
    grid = []
    for i, (t, (score, step, err)) in enumerate(trials.items()):
        run_dir = exp / "trials" / t
        (run_dir / "adapter").mkdir(parents=True)
        cfg = parse_space(space(**{LR: 1e-5})).trial_config(base.to_dict(), {LR: 1e-5 * (i + 1)})
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        if step == 4 or t == "raced6":
            (run_dir / "adapter" / "adapter_config.json").write_text("{}")
        metrics = {} if score is None else {OBJECTIVE: score, "step": step}
        grid.append((t, states[t], draws(1e-5 * (i + 1)), SimpleNamespace(metrics=metrics, error=err)))

    rows, columns, interrupted = collect_rows(grid, s, base.to_dict(), exp)
    assert interrupted  # run5 was RUNNING in the saved state
    assert [(r["trial_id"], r["status"]) for r in rows] == [
        ("best2", "done"), ("done1", "done"), ("run5", "unfinished"), ("raced6", "stopped@2"), ("asha3", "stopped@2"),
        ("err4", "error")]
    assert rows[-1]["error"] == "OSError: no such model 'x'"
    assert math.isclose(rows[0][LR], 2e-5) and rows[0]["rewards.weights.eos"] == 1.0
    assert rows[0]["rewards.weights.judge"] == rows[0]["rewards.weights.rouge_l"] == 0.5
    csv_rows = read_csv(write_results_csv(rows, columns, exp / "results.csv"))
    assert [r["rank"] for r in csv_rows] == ["1", "2", "3", "4", "5", "6"] and csv_rows[0][OBJECTIVE] == "0.52"
    table = format_table(rows, columns)
    assert table.splitlines()[0].split()[:5] == ["rank", "trial_id", "status", "eval/score", "step"]
    best = write_best_config(rows, s, base, "s-tune", exp / "best.yaml")
    cfg = load_config(best)
    assert cfg.output.run_name == "s-tune-best" and cfg.output.root == str(tmp_path)
    assert math.isclose(cfg.optimization.learning_rate, 2e-5)
    assert "best trial best2" in best.read_text().splitlines()[0]


def _report_score(config):
    from ray import tune

    if config["fail"]:
        raise ValueError("bad trial")
    for step in (1, 2):
        tune.report({OBJECTIVE: config["x"] * step, "step": step})


@pytest.mark.slow
def test_saved_trials_reads_tunes_saved_state_through_its_public_api(ray_local, tmp_path):
    """saved_trials (ExperimentAnalysis + ResultGrid on the folder) against a real, if trivial, Tune run."""
    from ray import tune

    from pipeline.tune.tuner import saved_trials

    tuner = tune.Tuner(
        tune.with_resources(_report_score, {"CPU": 0.1}),
        param_space={"x": tune.grid_search([0.25, 0.5]), "fail": tune.grid_search([False, True])},
        tune_config=tune.TuneConfig(metric=OBJECTIVE, mode="max"),
        run_config=tune.RunConfig(name="tune", storage_path=str(tmp_path), verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )
    tuner.fit()
    got = saved_trials(tmp_path / "tune")
    assert len(got) == 4 and len({t for t, _, _, _ in got}) == 4
    for trial_id, status, config, result in got:
        assert isinstance(trial_id, str) and trial_id
        if config["fail"]:  # failed before reporting: the config comes from the trial, not its (empty) result
            assert status == "ERROR" and "bad trial" in str(result.error) and OBJECTIVE not in (result.metrics or {})
        else:
            assert status == "TERMINATED" and result.error is None
            assert result.metrics[OBJECTIVE] == 2 * config["x"] and result.metrics["step"] == 2


# ---------------------------------------------------------------- real searches (tiny models, CPU)


def small_tune(tmp_path: Path, **sections) -> dict:
    """Trials of seconds: 4 steps, eval of 4 prompts every 2 steps, two trials at a time on 2 CPUs."""
    from tests.test_train_ray import small

    return small(tmp_path, generation={"num_generations": 4}, optimization={"per_device_train_batch_size": 4},
                 distributed={"cpus_per_worker": 0.5}, judge={"cpus_per_actor": 0.25}, **sections)


def tiny_space(extra: dict | None = None) -> dict:
    return {"num_samples": 3, "space": {
        LR: {"loguniform": [1.0e-3, 3.0e-2]},  # large enough that 4 steps move eval/score apart
        NG: {"choice": [2, 4]},
        "rewards.weights": {"simplex": ["rouge_l", "length", "judge"], "fixed": ["eos"]},
        **(extra or {}),
    }}


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def first_draws(space, seed: int, key: str, n: int) -> list:
    """The first ``n`` values of ``key`` the search's seeded searcher suggests (search_algorithm, Tune's public
    Searcher API): trials are asked for in this order, the space's keys in the order of its YAML file."""
    from pipeline.tune.tuner import search_algorithm

    alg, _ = search_algorithm(seed)
    alg.set_search_properties(OBJECTIVE, "max", space.to_tune())
    return [alg.suggest(f"draw-{i}")[key] for i in range(n)]


# The search test reads the search as the bucket holds it: what a resume from storage can use.


def trial_states(exp: RunStorage) -> dict[str, str]:
    """Trial id -> status from Tune's latest saved experiment state in the search's folder ``exp``."""
    try:
        names = sorted(f for f in exp.list(TUNE_DIR) if f.startswith(f"{TUNE_DIR}/experiment_state-") and f.endswith(".json"))
        data = json.loads(exp.read_text(names[-1]))
    except (IndexError, OSError, ValueError):
        return {}
    states = {}
    for trial_json, _ in data["trial_data"]:
        t = json.loads(trial_json)
        states[t["trial_id"]] = t["status"]
    return states


def registered_checkpoints(store: RunStorage) -> list[str]:
    """The checkpoints Ray Train registered for a run or trial in storage (pipeline.training.driver.registered_checkpoints,
    read from ``store``; the node-loss and S3 resume tests use it too)."""
    try:
        snap = json.loads(store.read_text(f"{RAY_TRAIN_DIR}/checkpoint_manager_snapshot.json"))
        return [c["checkpoint_dir_name"] for c in snap["checkpoint_results"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def trained(trial: RunStorage) -> bool:
    """The adapter is saved (and uploaded) only after the last step."""
    return trial.exists(f"{ADAPTER_DIR}/adapter_config.json")


def resume_events(trial: RunStorage) -> list[int]:
    text = trial.read_text(EVENTS) if trial.exists(EVENTS) else ""
    return [e["step"] for e in map(json.loads, text.splitlines()) if e.get("event") == "resume"]


def trained_steps(trial: RunStorage) -> list[int]:
    """The training steps in a trial's metrics.jsonl, in order."""
    text = trial.read_text(METRICS) if trial.exists(METRICS) else ""
    return [m["step"] for m in map(json.loads, text.splitlines()) if "loss" in m]


def fingerprint(trial: RunStorage) -> dict:
    """A trial's files in storage (no mtime to trust there): every name, and the text of its logs."""
    return {"files": trial.list(), METRICS: trial.read_text(METRICS), EVENTS: trial.read_text(EVENTS),
            "snapshot": trial.read_text(f"{RAY_TRAIN_DIR}/checkpoint_manager_snapshot.json")}


def signal_session(sid: int, sig: int) -> None:
    """Signal every process of a session (the CLI started with start_new_session=True)."""
    import psutil

    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            continue


CRASH_STEPS = 8


@pytest.mark.slow
def test_crashed_search_resumes_then_results_best_config_and_training_from_it(s3_server, tmp_path, request):
    """One search of three trials through the CLI, kept in S3 (moto's server), one trial's model broken:
    killed (with its whole local Ray) once a trial has finished, its local folder deleted, --resume
    completes the rest from the bucket. Then what the search leaves: the table, the best config, a
    training from it, and in the bucket Tune's state, the trials' checkpoints and files, the results.
    One search serves all of it: each costs minutes of the suite."""
    import shutil
    import uuid

    from pipeline.rundir.storage import run_store
    from pipeline.training.driver import run_training
    from tests.conftest import BUCKET

    cfg_path, space_path = tmp_path / "tiny.yaml", tmp_path / "space.yaml"
    # 8 steps, a checkpoint every 2: Ray Train registers a checkpoint a step or two after the worker saved it
    # (the upload runs beside training), so with 4 steps the window between a registered checkpoint and the
    # trial's end was under a second and CI twice saw a whole search pass without one trial caught in it.
    data = small_tune(tmp_path, output={"storage": f"s3://{BUCKET}/crash-{uuid.uuid4().hex[:8]}"})
    data["optimization"]["max_steps"], data["eval"]["every_steps"] = CRASH_STEPS, 4
    # One model folder fails to load (it passes the config's check, its config.json is broken): that trial
    # errors, the others go on. Seed 6's draws put it second: the third trial starts once it has failed,
    # behind the first, so it is mid-run when the first finishes (two trials started together could end together).
    data["optimization"]["seed"] = 6
    missing = tmp_path / "no-such-model"
    missing.mkdir()
    (missing / "config.json").write_text("{not json", encoding="utf-8")
    cfg_path.write_text(yaml.safe_dump(data))
    space_path.write_text(yaml.safe_dump({**tiny_space({"model.name_or_path": {"choice": ["tiny", str(missing)]}}),
                                          "asha": {"grace_period": CRASH_STEPS}}))  # no early stops
    draws = first_draws(load_space(space_path), data["optimization"]["seed"], "model.name_or_path", 3)
    assert draws == ["tiny", str(missing), "tiny"], f"Optuna's draws changed ({draws}): choose another optimization.seed"
    exp_dir = tmp_path / "crash"
    exp = run_store(config_from_dict(data), name="crash")  # <storage>/crash/: Tune's state in tune/, the trials in trials/
    trial = exp.child(TRIALS_DIR).child
    cmd = [sys.executable, "-m", "pipeline", "tune", "--config", str(cfg_path), "--space", str(space_path),
           "--address", "local", "--name", "crash"]
    env = {**os.environ, "RAY_ADDRESS": "", "TUNE_GLOBAL_CHECKPOINT_S": "1"}  # Tune's saved state: at most 1 s old
    assert env.get("AWS_ENDPOINT_URL") == s3_server  # the CLI reaches moto through the AWS SDK's environment
    out = (tmp_path / "first.log").open("w")  # a file, not a pipe: Ray's logs would fill a pipe no one reads
    t0 = time.time()
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)

    ended: dict[str, tuple] = {}  # trials TERMINATED in the bucket: their files no longer change, read once

    def look() -> tuple[dict, dict]:  # from the bucket: Tune's trial states; per trial, registered checkpoints and adapter
        states = trial_states(exp)
        trials = {t: ended.get(t) or (registered_checkpoints(trial(t)), trained(trial(t))) for t in states}
        ended.update({t: trials[t] for t, s in states.items() if s == "TERMINATED"})
        return states, trials

    def mid_run(states, trials) -> set[str]:  # unfinished, a checkpoint to resume from, the last step still ahead
        return {t for t, s in states.items() if s != "TERMINATED" and trials[t][0] and not trials[t][1]}

    # Wait for one finished trial and one between checkpoints, then crash the whole session at once:
    # driver, local Ray and every worker (Ray's workers run in their own process groups). The session
    # is frozen (SIGSTOP) and the bucket read again before the kill: a trial seen between checkpoints
    # could otherwise finish in the moment between the look and the kill (CI saw one do so).
    deadline, caught, states, trials = time.time() + 600, set(), {}, {}
    seen: list[tuple] = []  # (time, states, per trial: registered checkpoints, trained), each change: the failure message
    while time.time() < deadline and first.poll() is None:
        states, trials = look()
        caught = mid_run(states, trials)
        if not seen or seen[-1][1:] != (states, trials):
            seen.append((round(time.time(), 1), states, trials))
        if caught and "TERMINATED" in states.values():
            signal_session(first.pid, signal.SIGSTOP)
            time.sleep(0.5)  # let requests moto has already received land
            states, trials = look()
            caught = mid_run(states, trials)
            if caught and "TERMINATED" in states.values():
                signal_session(first.pid, signal.SIGKILL)
                break
            signal_session(first.pid, signal.SIGCONT)
        time.sleep(0.5)  # each look is a dozen requests to moto, which shares the CPUs with the search
    finished = {t for t, s in states.items() if s == "TERMINATED"}
    caught_at = {t: int(trials[t][0][-1].rsplit("-", 1)[1]) for t in caught}
    first.wait(timeout=60)
    log = (tmp_path / "first.log").read_text()
    timeline = "\n".join(map(str, seen))
    assert finished and len(finished) < 3, timeline + "\n" + log[-2000:]
    print(f"at the crash ({time.time() - t0:.0f} s): states {states}, caught between checkpoints {caught_at}")
    assert caught, "no trial was caught between checkpoints; the resume-from-checkpoint path went untested\n" + timeline
    kept = {t: fingerprint(trial(t)) for t in finished}
    logged = {t: trained_steps(trial(t))[-1:] for t in caught}  # what the resume finds beside the checkpoint

    shutil.rmtree(exp_dir)  # a machine that never saw the search: --resume finds it in the bucket only
    t1 = time.time()
    again = subprocess.run([*cmd[:-2], "--name", "crash", "--resume"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=900)
    print(again.stdout[-4000:])
    print(f"resumed in {time.time() - t1:.0f} s")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming" in again.stdout and "sorted by eval/score" in again.stdout and "interrupted" not in again.stderr
    assert ": search optuna," in log  # the first run's [tune] line: Optuna's seeded draws, not a fallback
    # The table, from the folder the resume rebuilt here (its results.csv and best.yaml also in the bucket).
    rows = read_csv(exp_dir / RESULTS_CSV)
    assert len(rows) == 3 and [r["rank"] for r in rows] == ["1", "2", "3"] and {r["trial_id"] for r in rows} >= finished
    assert (exp_dir / BEST_CONFIG).exists() and exp.exists(BEST_CONFIG) and exp.exists(RESULTS_CSV)
    failed = [r for r in rows if r["model.name_or_path"] == str(missing)]
    ok = [r for r in rows if r["model.name_or_path"] == "tiny"]
    assert len(failed) == 1 and len(ok) == 2, "the seeded draws should pick both models; choose another optimization.seed"
    assert all(r["status"] == "error" and "no-such-model" in r["error"] and r[OBJECTIVE] == "" for r in failed)
    scores = [float(r[OBJECTIVE]) for r in rows if r[OBJECTIVE]]
    assert len(scores) == len(ok) and scores == sorted(scores, reverse=True)
    assert rows[-1]["status"] == "error"  # trials without a score sort last
    # The trials, from the bucket: what the resume wrote there.
    for t, before in kept.items():  # finished trials were not run again
        assert f"[trial] {t} started" not in again.stdout, t
        assert fingerprint(trial(t)) == before, t
    for t, ckpt in caught_at.items():  # trials caught mid-run went on from their checkpoint, not from step 0
        assert resume_events(trial(t))[:1] == [ckpt], t
    for r in ok:  # no step twice, none missing, none past max_steps
        t, steps = r["trial_id"], trained_steps(trial(r["trial_id"]))
        assert steps == list(range(1, CRASH_STEPS + 1)), (
            t, steps, f"at the crash the bucket held checkpoint {caught_at.get(t)} and metrics to step {logged.get(t)}")
        assert r["status"] == "done" and float(r["step"]) == CRASH_STEPS
        w = [float(r[f"rewards.weights.{c}"]) for c in ("rouge_l", "length", "judge")]
        assert math.isclose(sum(w), 1.0, rel_tol=1e-6) and float(r["rewards.weights.eos"]) == 1.0
        run_dir = Path(r["run_dir"])  # here: the trial's files the table needs (the rest is in the bucket)
        assert run_dir.parent == exp_dir.resolve() / TRIALS_DIR
        trial_cfg = load_config(run_dir / "config.yaml")
        assert math.isclose(trial_cfg.optimization.learning_rate, float(r[LR]))
        assert trial_cfg.optimization.per_device_train_batch_size == int(r[BATCH])
        assert trial_cfg.generation_batch_size % int(r[NG]) == 0
        assert (run_dir / "metrics.jsonl").exists() and (run_dir / "adapter" / "adapter_config.json").exists()
        assert not (run_dir / RAY_TRAIN_DIR).exists()  # checkpoints only in the bucket (checked below)

    # The best trial as a ready-to-run config, in its own run directory, and a training from it.
    best, cfg = rows[0], config_from_dict(data)
    best_cfg = load_config(exp_dir / BEST_CONFIG)
    assert best_cfg.output.run_name == "crash-best" and best_cfg.output.root == str(tmp_path.resolve())
    assert math.isclose(best_cfg.optimization.learning_rate, float(best[LR]))
    assert best_cfg.generation.num_generations == int(best[NG])
    assert math.isclose(best_cfg.rewards.weights["judge"], float(best["rewards.weights.judge"]))
    assert best_cfg.eval.score_weights == cfg.eval.score_weights
    trained_cfg = load_config(exp_dir / BEST_CONFIG, ["optimization.max_steps=2", "eval.num_prompts=2", "output.storage=null"])
    run_dir = tmp_path / trained_cfg.output.run_name
    request.getfixturevalue("ray_local")  # the session's Ray, here only now: the search ran its own
    run_training(trained_cfg, run_dir, log=None)
    assert (run_dir / "adapter" / "adapter_config.json").exists()
    assert [m["step"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m] == [1, 2]

    # The search in the bucket: Tune's state, every trial's checkpoints and files, the results.
    files = exp.list()
    for name in ("base_config.yaml", "space.yaml", "results.csv", "best.yaml"):
        assert name in files, (name, files)
    assert any(f.startswith("tune/experiment_state") for f in files), files
    for r in ok:
        t = f"{TRIALS_DIR}/{r['trial_id']}"
        for name in ("ray_train/checkpoint_manager_snapshot.json", "metrics.jsonl", "samples.jsonl", "config.yaml"):
            assert f"{t}/{name}" in files, (t, name, [f for f in files if f.startswith(t)])
        assert f"{t}/{RAY_TRAIN_DIR}/checkpoint-{CRASH_STEPS:06d}/trainer_state.json" in files  # the last one too
        assert f"{t}/adapter/adapter_config.json" in files
        assert exp.read_text(f"{t}/metrics.jsonl") == (Path(r["run_dir"]) / "metrics.jsonl").read_text()
    # The CLI's search, crashed and resumed (Tune's saved state, tuner.pkl, experiment_state-*.json,
    # search_gen_state-*.json, holds the storage filesystem): no credential of the session's in the
    # bucket or in the local folders and logs.
    assert not leaked_credentials([*bucket_objects(), *local_files(tmp_path)])
