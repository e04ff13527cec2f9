"""Held-out evaluation: a fixed budget, several samples per prompt, its standard error, KL to the
initial policy, and no trace in training's random stream. A real TRL GRPOTrainer with LoRA (in
process) and the real Ray reward pool."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.training.callbacks import Evaluator, score_stderr


def test_score_stderr_is_the_within_prompt_sampling_error():
    # Two prompts, two samples each: var 0.02 and 0 -> sqrt(0.02 / 2 + 0) / 2.
    assert score_stderr([0, 0, 1, 1], [0.5, 0.7, 0.2, 0.2]) == pytest.approx((0.02 / 2) ** 0.5 / 2)
    # One sample per prompt: the spread over all completions.
    assert score_stderr([0, 1, 2], [0.0, 0.5, 1.0]) == pytest.approx((0.25 / 3) ** 0.5)


def test_eval_budget_is_the_field_or_the_runs_largest_length():
    recs = [{"question": "Was?", "reference": "Das."}]
    assert Evaluator(load_config(None), recs, None, None, [0], max_new_tokens=96).max_new_tokens == 96
    cfg = load_config(None, ["eval.max_new_tokens=24"])
    assert Evaluator(cfg, recs, None, None, [0], max_new_tokens=96).max_new_tokens == 24


STEPS = 8


def _setup(tmp_path, pool, lr: float):
    from pipeline.data.sources import load_records
    from pipeline.training.length_control import CompletionLengthControl
    from pipeline.scoring.clients import make_pool_reward_funcs
    from pipeline.training.worker import build_grpo_trainer, load_policy

    cfg = load_config(None, [
        f"optimization.learning_rate={lr}", f"optimization.max_steps={STEPS}", "eval.num_prompts=6",
        "eval.samples_per_prompt=2", f"eval.every_steps={STEPS}", "logging.progress_bar=false",
        "output.save_steps=1000",
    ])
    train, held_out, _ = load_records(cfg.data, log=None)
    tokenizer, model, eos_ids = load_policy(cfg, on_gpu=False)
    ctl = CompletionLengthControl(cfg, log=None)
    funcs, weights = make_pool_reward_funcs(pool, cfg, eos_ids, lambda: ctl.current, None)
    evaluator = Evaluator(cfg, held_out, tokenizer, pool, eos_ids, ctl.budget)
    rows: list[dict] = []
    evaluator.report = rows.append
    trainer = build_grpo_trainer(cfg, tmp_path, tokenizer, model, train, funcs, weights, [ctl, evaluator])
    ctl.bind(trainer)
    evaluator.trainer = trainer
    return ctl, evaluator, trainer, rows


@pytest.fixture(scope="module")
def trained(ray_local, tiny_policy, tmp_path_factory):
    """The default config at two learning rates 10x apart, STEPS steps each, evaluated at 0 and STEPS."""
    from pipeline.scoring.pool import start_pool, stop_pool

    pool = start_pool(load_config(None, ["judge.cpus_per_actor=0.25"]))
    runs = {}
    try:
        for lr in (1e-3, 1e-2):
            ctl, evaluator, trainer, rows = _setup(tmp_path_factory.mktemp(f"lr{lr}"), pool, lr)
            trainer.train()
            runs[lr] = (ctl, evaluator, trainer, rows)
        yield runs
    finally:
        stop_pool(pool)


@pytest.mark.slow
def test_learning_rates_10x_apart_end_with_different_eval_scores(trained):
    (_, _, _, low), (_, _, _, high) = trained[1e-3], trained[1e-2]
    assert [r["step"] for r in low] == [r["step"] for r in high] == [0, STEPS]
    assert low[0] == high[0]  # the same initial policy and evaluation seed: the same evaluation
    assert low[0]["eval/kl_to_initial"] == 0.0  # LoRA starts as the identity
    assert low[-1]["eval/score"] != high[-1]["eval/score"]
    assert high[-1]["eval/kl_to_initial"] > low[-1]["eval/kl_to_initial"] > 0
    for r in low + high:
        assert r["eval/num_completions"] == 6 * 2 and r["eval/max_new_tokens"] == 96  # 6 prompts x 2 samples, the ceiling
        assert r["eval/score_stderr"] > 0


@pytest.mark.slow
def test_evaluation_ignores_the_training_cap_and_training_rng(trained):
    import torch

    from pipeline.seams.trl_seams import set_generation_cap

    ctl, evaluator, trainer, _ = trained[1e-2]
    scores = []
    for cap in (4, 40):
        set_generation_cap(trainer, cap)
        ctl.current = cap
        state = torch.get_rng_state()
        scores.append(evaluator.evaluate(STEPS))
        assert torch.equal(torch.get_rng_state(), state)  # evaluation leaves training's sample stream alone
    assert scores[0] == scores[1]
    assert scores[0]["eval/mean_length"] > 4 and scores[0]["eval/max_new_tokens"] == 96  # past the training cap of 4
