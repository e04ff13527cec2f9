"""Completion-length control: the schedule and the adaptive cap, unit-level and on a real GRPOTrainer."""

from __future__ import annotations

import pytest
from transformers import TrainerCallback

from pipeline.config import load_config
from pipeline.length_control import CAP_METRIC, CompletionLengthControl, adaptive_next, scheduled_length


def test_scheduled_length_follows_the_last_step_reached():
    sched = [[5, 32], [10, 64]]
    assert [scheduled_length(sched, s, 16) for s in (0, 4, 5, 9, 10, 99)] == [16, 16, 32, 32, 64, 64]
    assert scheduled_length([], 7, 16) == 16


@pytest.mark.parametrize("ratio,expected", [(0.9, 40), (0.31, 40), (0.3, 32), (0.2, 32), (0.1, 32), (0.05, 24)])
def test_adaptive_moves_out_of_the_band_only(ratio, expected):
    assert adaptive_next(32, ratio, (0.1, 0.3), 8, 8, 128) == expected


def test_adaptive_respects_floor_and_ceiling():
    assert adaptive_next(120, 1.0, (0.1, 0.3), 16, 8, 128) == 128
    assert adaptive_next(12, 0.0, (0.1, 0.3), 16, 8, 128) == 8


class _State:
    def __init__(self, step):
        self.global_step = step


def test_adaptive_callback_waits_for_a_full_window_and_logs_the_cap_it_used():
    cfg = load_config(None, ["generation.adaptive.start=32", "generation.adaptive.window=2",
                             "generation.adaptive.step=8", "generation.adaptive.ceiling=64"])
    ctl = CompletionLengthControl(cfg, log=None)
    logs = {"completions/clipped_ratio": 1.0}
    ctl.on_log(None, _State(1), None, logs=logs)
    assert logs[CAP_METRIC] == 32 and ctl.current == 32  # one step is not a window
    logs = {"completions/clipped_ratio": 0.8}
    ctl.on_log(None, _State(2), None, logs=logs)
    assert logs[CAP_METRIC] == 32 and ctl.current == 40  # logged: the cap step 2 ran under
    eval_row = {"eval/score": 0.5}
    ctl.on_log(None, _State(2), None, logs=eval_row)
    assert CAP_METRIC not in eval_row and ctl.current == 40
    assert ctl.changes == [(2, 32, 40)]


class _Recorder(TrainerCallback):
    def __init__(self):
        self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/clipped_ratio" in logs:
            self.rows.append(dict(logs, step=state.global_step))


def _train_adaptive(tmp_path, start: int, steps: int) -> list[dict]:
    """A real TRL GRPOTrainer (in process, no Ray) with the tiny policy and the project's callback."""
    from pipeline.data import load_records
    from pipeline.reward_clients import eos_kwargs
    from pipeline.worker import build_grpo_trainer, load_policy
    from rewards.trl_rewards import make_reward_funcs

    cfg = load_config(None, [
        "generation.max_completion_length=adaptive", f"generation.adaptive.start={start}",
        "generation.adaptive.floor=8", "generation.adaptive.ceiling=96", "generation.adaptive.step=8",
        "generation.adaptive.window=3", f"optimization.max_steps={steps}", "optimization.learning_rate=1e-5",
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
