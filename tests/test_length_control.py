"""Completion-length control: the schedule and the adaptive cap, unit-level and on a real GRPOTrainer."""

from __future__ import annotations

import math
import random

import pytest
from transformers import TrainerCallback

from pipeline.config import load_config
from pipeline.training.length_control import (
    CAP_METRIC,
    CompletionLengthControl,
    adaptive_next,
    band_side,
    reference_floor,
    scheduled_length,
    smoothed_ratio,
    target_cap,
)


def test_scheduled_length_follows_the_last_step_reached():
    sched = [[5, 32], [10, 64]]
    assert [scheduled_length(sched, s, 16) for s in (0, 4, 5, 9, 10, 99)] == [16, 16, 32, 32, 64, 64]
    assert scheduled_length([], 7, 16) == 16


@pytest.mark.parametrize("ratio,n,side", [
    (0.5, 8, 1), (0.375, 8, 0), (0.25, 64, 0), (0.3, 64, 1),  # one step far above decides; near the edge, a window
    (0.0, 8, 0), (0.0, 32, 0), (0.0, 40, -1), (1 / 64, 64, 0), (0.0, 64, -1), (0.125, 64, 0),
])
def test_band_side_needs_the_miss_to_be_beyond_chance(ratio, n, side):
    assert band_side(ratio, n, (0.05, 0.2), 1.0) == side


def test_more_hysteresis_needs_more_evidence():
    assert band_side(0.3, 64, (0.05, 0.2), 1.0) == 1 and band_side(0.3, 64, (0.05, 0.2), 2.0) == 0
    assert band_side(0.0, 40, (0.05, 0.2), 1.0) == -1 and band_side(0.0, 40, (0.05, 0.2), 2.0) == 0


def test_adaptive_moves_toward_the_estimate_by_at_least_a_step_within_floor_and_ceiling():
    assert adaptive_next(32, 0, 80.0, 8, 8, 128) == 32  # inside the band: hold
    assert adaptive_next(32, 1, 50.4, 8, 8, 128) == 50 and adaptive_next(32, 1, 33.0, 8, 8, 128) == 40
    assert adaptive_next(32, -1, 20.0, 4, 8, 128) == 20 and adaptive_next(32, -1, 31.0, 4, 8, 128) == 28
    assert adaptive_next(120, 1, 240.0, 16, 8, 128) == 128 and adaptive_next(12, -1, 2.0, 16, 8, 128) == 8


def test_geometric_estimate_from_the_completions_that_ended():
    # Lengths geometric with EOS hazard 0.1: at cap 10, P(cut) = 0.9**10, mean length (1 - 0.9**10) / 0.1,
    # and the cap where 12.5% are cut is log(0.125) / log(0.9) = 19.7.
    cut, mean = 0.9 ** 10, (1 - 0.9 ** 10) / 0.1
    assert target_cap(10, cut, 100000, mean, 0.125) == pytest.approx(math.log(0.125) / math.log(0.9), abs=0.05)
    assert target_cap(10, 1.0, 64, 10.0, 0.125) == 20  # nothing ended: double
    assert target_cap(64, 0.0, 64, 8.0, 0.125) == pytest.approx(43.1, abs=0.1)  # short answers: fall, at most halving


def test_estimate_interpolates_between_the_two_sides_of_the_target():
    # 16 tokens cut 40%, 32 cut 1%: log-linear between them, never outside the bracket.
    est = target_cap(32, 0.0, 64, 13.0, 0.125, bracket=((16, 0.4), None))
    c32 = smoothed_ratio(0.0, 64)
    frac = (math.log(0.125) - math.log(0.4)) / (math.log(c32) - math.log(0.4))
    assert est == pytest.approx(16 + 16 * frac) and 16 < est < 32
    # Only a window on the same side known: no bracket, the model's estimate.
    assert target_cap(32, 0.0, 64, 13.0, 0.125, bracket=(None, (40, 0.01))) == target_cap(32, 0.0, 64, 13.0, 0.125)


class _State:
    def __init__(self, step):
        self.global_step = step


def _feed(ctl, ratios, mean_length=12.0, first_step=1):
    caps = []
    for i, r in enumerate(ratios):
        logs = {"completions/clipped_ratio": r, "completions/mean_length": mean_length}
        ctl.on_log(None, _State(first_step + i), None, logs=logs)
        caps.append(logs[CAP_METRIC])
    return caps


ADAPTIVE = ["generation.adaptive.start=32", "generation.adaptive.band_low=0.05", "generation.adaptive.band_high=0.2",
            "generation.adaptive.step=2", "generation.adaptive.floor=8", "generation.adaptive.ceiling=96"]


def test_callback_logs_the_cap_it_used_and_counts_the_window_in_completions():
    cfg = load_config(None, ADAPTIVE + ["generation.adaptive.window_completions=16", "generation.adaptive.hysteresis=1"])
    ctl = CompletionLengthControl(cfg, log=None)
    assert ctl.per_step == 8  # per_device_train_batch_size 8 x 1 worker x 1 accumulation step
    logs = {"completions/clipped_ratio": 0.25, "completions/mean_length": 20.0}
    ctl.on_log(None, _State(1), None, logs=logs)
    assert logs[CAP_METRIC] == 32 and ctl.current == 32  # 2 of 8 cut: not beyond one standard error
    logs = {"completions/clipped_ratio": 0.75, "completions/mean_length": 20.0}
    ctl.on_log(None, _State(2), None, logs=logs)
    assert logs[CAP_METRIC] == 32 and ctl.current > 32  # 8 of 16 cut: beyond chance; logged: the cap step 2 ran under
    eval_row = {"eval/score": 0.5}
    ctl.on_log(None, _State(2), None, logs=eval_row)
    assert CAP_METRIC not in eval_row and ctl.changes == [(2, 32, ctl.current)]


def test_window_and_hysteresis_change_the_decisions():
    """Ratios that wander around the band's upper edge: a short window or no hysteresis chases the noise."""
    ratios = [0.25, 0.125, 0.5, 0.125, 0.25, 0.0, 0.375, 0.125] * 3

    def changes(*extra):
        ctl = CompletionLengthControl(load_config(None, ADAPTIVE + list(extra)), log=None)
        _feed(ctl, ratios, mean_length=20.0)
        return len(ctl.changes)

    steady = changes("generation.adaptive.window_completions=64", "generation.adaptive.hysteresis=1")
    assert steady <= 1
    assert changes("generation.adaptive.window_completions=8", "generation.adaptive.hysteresis=1") > steady
    assert changes("generation.adaptive.window_completions=64", "generation.adaptive.hysteresis=0") > steady


def _simulate(seed: int, median: float, steps: int = 30) -> tuple[CompletionLengthControl, list[int], list[float]]:
    """The default run's situation: 8 completions per step, answers log-normal around ``median`` tokens."""
    cfg = load_config(None)  # configs/tiny.yaml
    ctl = CompletionLengthControl(cfg, log=None)
    rng = random.Random(seed)
    caps, clipped = [], []
    for step in range(1, steps + 1):
        lengths = [max(1, round(rng.lognormvariate(math.log(median), 0.4))) for _ in range(8)]
        cap = ctl.current
        logs = {"completions/clipped_ratio": sum(x > cap for x in lengths) / 8,
                "completions/mean_length": sum(min(x, cap) for x in lengths) / 8}
        ctl.on_log(None, _State(step), None, logs=logs)
        caps.append(cap)
        clipped.append(logs["completions/clipped_ratio"])
    return ctl, caps, clipped


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("median", [10, 14])
def test_cap_settles_on_noisy_small_steps(seed, median):
    ctl, caps, clipped = _simulate(seed, median)
    assert caps[0] == 8 and max(caps) > 8
    assert len(ctl.changes) <= 5  # the rule it replaces: nine changes in 30 steps
    assert len([c for c in ctl.changes if c[0] >= 15]) <= 2  # the second half holds (nearly) still
    tail = clipped[15:]
    assert 0.02 <= sum(tail) / len(tail) <= 0.25  # around the band [0.05, 0.2], 8 completions per step


def test_resume_replays_the_logged_steps_to_the_same_state():
    cfg = load_config(None, ADAPTIVE)
    ratios = [1.0, 0.875, 0.5, 0.25, 0.0, 0.0, 0.125, 0.0, 0.0, 0.0, 0.0, 0.125, 0.0, 0.0, 0.0, 0.0]
    whole = CompletionLengthControl(cfg, log=None)
    rows = []
    for i, r in enumerate(ratios, start=1):
        logs = {"completions/clipped_ratio": r, "completions/mean_length": 12.0}
        whole.on_log(None, _State(i), None, logs=logs)
        rows.append({"step": i, **logs})
    assert len(whole.changes) >= 2
    resumed = CompletionLengthControl(cfg, log=None)
    resumed.restore(rows[:6])
    for row in rows[6:]:
        logs = {k: v for k, v in row.items() if k != CAP_METRIC and k != "step"}
        resumed.on_log(None, _State(row["step"]), None, logs=logs)
        assert logs[CAP_METRIC] == row[CAP_METRIC]
    assert resumed.current == whole.current and resumed.changes == whole.changes


def test_budget_is_the_most_the_run_generates():
    assert CompletionLengthControl(load_config(None, ADAPTIVE), log=None).budget == 96
    fixed = load_config(None, ["generation.max_completion_length=8", "generation.length_schedule=[[20, 12]]"])
    assert CompletionLengthControl(fixed, log=None).budget == 12


class _Recorder(TrainerCallback):
    def __init__(self):
        self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/clipped_ratio" in logs:
            self.rows.append(dict(logs, step=state.global_step))


def test_reference_quantile_raises_the_floor_and_the_start(tiny_policy):
    """The cap starts at, and never falls below, the length that 90% of the training references fit in."""
    from transformers import AutoTokenizer

    from pipeline.data.sources import load_records

    tokenizer = AutoTokenizer.from_pretrained(tiny_policy)
    cfg = load_config(None, ADAPTIVE + ["generation.adaptive.start=8", "generation.adaptive.reference_quantile=0.9"])
    train, _, _ = load_records(cfg.data, log=None)
    refs = [r["reference"] for r in train]
    floor = reference_floor(refs, tokenizer, 0.9)
    lengths = [len(tokenizer(r, add_special_tokens=False)["input_ids"]) + 1 for r in refs]
    assert sum(n <= floor for n in lengths) >= 0.9 * len(lengths) > sum(n < floor for n in lengths)
    assert reference_floor(refs, tokenizer, 0.0) == 0 and reference_floor(refs, tokenizer, 1.0) == max(lengths)

    ctl = CompletionLengthControl(cfg, log=None, reference_floor=floor)
    assert ctl.current == ctl.floor == floor > 8
    _feed(ctl, [0.0] * 40, mean_length=4.0)  # answers far below the cap: it would fall, and stops at the floor
    assert ctl.current == floor
    without = CompletionLengthControl(load_config(None, ADAPTIVE + [f"generation.adaptive.start={floor + 16}"]), log=None)
    _feed(without, [0.0] * 40, mean_length=4.0)
    assert without.current < floor
    assert CompletionLengthControl(cfg, log=None, reference_floor=500).current == 96  # never above the ceiling


def _train_adaptive(tmp_path, start: int, steps: int) -> list[dict]:
    """A real TRL GRPOTrainer (in process, no Ray) with the tiny policy and the project's callback."""
    from pipeline.data.sources import load_records
    from pipeline.scoring.clients import eos_kwargs
    from pipeline.training.worker import build_grpo_trainer, load_policy
    from rewards.trl_rewards import make_reward_funcs

    cfg = load_config(None, [
        "generation.max_completion_length=adaptive", f"generation.adaptive.start={start}",
        "generation.adaptive.floor=8", "generation.adaptive.ceiling=96", "generation.adaptive.step=8",
        "generation.adaptive.window_completions=48", f"optimization.max_steps={steps}", "optimization.learning_rate=1e-5",
        "optimization.per_device_train_batch_size=16",
        "logging.progress_bar=false", "output.save_steps=1000", "rewards.weights={rouge_l: 0.5, length: 0.5, judge: 0, eos: 1}",
    ])
    train, _, _ = load_records(cfg.data, log=None)
    tokenizer, model, eos_ids = load_policy(cfg, on_gpu=False)
    ctl = CompletionLengthControl(cfg, log=None)
    funcs, weights = make_reward_funcs(cfg.rewards.weights, None, eos_ids, lambda: ctl.current, eos_kwargs(cfg))
    rec = _Recorder()
    trainer = build_grpo_trainer(cfg, tmp_path, tokenizer, model, train, funcs, weights, [ctl, rec])
    ctl.bind(trainer)
    trainer.train()
    return rec.rows


def _check_max_length_follows_cap(rows):
    for r in rows:
        assert r["completions/max_length"] <= r[CAP_METRIC], r["step"]
        if r["completions/clipped_ratio"] > 0:
            assert r["completions/max_length"] == r[CAP_METRIC], r["step"]  # clipped ones end exactly at the cap


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.slow
def test_adaptive_cap_rises_until_the_clipped_ratio_enters_the_band(tmp_path, tiny_policy):
    rows = _train_adaptive(tmp_path, start=8, steps=18)
    caps = [r[CAP_METRIC] for r in rows]
    clipped = [r["completions/clipped_ratio"] for r in rows]
    assert caps[0] == 8 and _mean(clipped[:3]) > 0.3  # answers longer than the start cap
    first_change = next(c for c in caps if c != 8)
    assert first_change > 8 and _mean(caps[-6:]) > 8  # it rose and stayed up
    # Small groups are noisy, so the cap may step back down; what matters is where it settles.
    assert _mean(clipped[-6:]) < _mean(clipped[:3]) and _mean(clipped[-6:]) <= 0.3 + 0.15
    _check_max_length_follows_cap(rows)


@pytest.mark.slow
def test_adaptive_cap_falls_when_answers_are_short(tmp_path, tiny_policy):
    rows = _train_adaptive(tmp_path, start=96, steps=12)
    caps = [r[CAP_METRIC] for r in rows]
    clipped = [r["completions/clipped_ratio"] for r in rows]
    assert caps[0] == 96 and _mean(clipped[:3]) < 0.1  # answers far below the cap
    assert next(c for c in caps if c != 96) < 96 and caps[-1] <= 96 - 2 * 8  # it fell, step by step
    _check_max_length_follows_cap(rows)


def test_callback_order_every_log_reader_sees_the_cap_and_events_record_at_once(tmp_path):
    """The worker's callback list (run_callbacks.training_callbacks), run by HF's CallbackHandler as the
    trainer does: the cap the length control writes into ``logs`` reaches every later callback, and
    events.jsonl records a cap change and a finding at the call where they happen."""
    import json

    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, TrainerControl, TrainerState

    from pipeline.training.events import RunEvents
    from pipeline.training.health import HealthCallback
    from pipeline.training.callbacks import MetricsSink, training_callbacks

    cfg = load_config(None, ["generation.max_completion_length=16", "generation.length_schedule=[[5, 32]]"])
    ctl = CompletionLengthControl(cfg, log=None)
    health = HealthCallback(config=cfg, print_fn=lambda _m: None, export_ray_metrics=False, only=["never_stops"])
    metrics = MetricsSink(tmp_path, "order", ray_metrics=False)
    seen: dict[str, list[bool]] = {}

    def reader(name):
        class Reader(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                seen.setdefault(name, []).append(CAP_METRIC in logs)
        Reader.__name__ = f"Reader_{name}"  # HF warns about two callbacks of one class
        return Reader()

    callbacks = training_callbacks(length_control=ctl, samples=reader("samples"), health=health,
                                   events=RunEvents(tmp_path, ctl, health), metrics=metrics,
                                   reporter=reader("reporter"), evaluator=reader("evaluator"), sync=reader("sync"))
    handler = CallbackHandler([DefaultFlowCallback(), *callbacks], None, None, None, None)
    state, control = TrainerState(), TrainerControl()

    def events(kind):
        path = tmp_path / "events.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return [e for e in rows if e["event"] == kind]

    for step in range(1, 13):
        state.global_step = step
        handler.on_step_begin(None, state, control)
        if step == 5:  # the schedule's raise, in events.jsonl at the step's start
            assert [(e["step"], e["old"], e["new"]) for e in events("length_cap")] == [(5, 16, 32)]
        handler.on_log(None, state, control, logs={"completions/clipped_ratio": 1.0, "reward": 0.1})
        assert len(events("finding")) == len(health.findings)  # a finding is recorded at the log it fired on
    assert health.findings and health.findings[0].rule == "never_stops"
    assert all(all(v) for v in seen.values()) and set(seen) == {"samples", "reporter", "evaluator", "sync"}
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r[CAP_METRIC] for r in rows] == [16] * 4 + [32] * 8
    assert health.history.values(CAP_METRIC) == [16.0] * 4 + [32.0] * 8
