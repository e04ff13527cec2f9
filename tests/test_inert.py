"""Settings inert by construction are named before the run starts (pipeline.plan.inert), one line each."""

from __future__ import annotations

import pytest

from pipeline.cli import main as cli
from pipeline.training import driver
from pipeline.tune import tuner
from pipeline.config import REPO_ROOT, load_config
from pipeline.plan.inert import PREFIX, inert_settings, one_step_per_rollout

CLIP_HIGH = "grpo.epsilon_high has no effect: one optimizer step per rollout"


def _run_cli(monkeypatch, capsys, command: str, argv: list[str]) -> str:
    """`synth-grpo <command> argv` up to the point where it would start Ray: returns what stderr held then."""
    seen = {}

    def stop_before_ray(cfg, args):
        seen["stderr"] = capsys.readouterr().err
        return 0

    module = {"train": driver, "tune": tuner}[command]
    monkeypatch.setattr(module, f"{command}_cli", stop_before_ray)
    assert cli.main([command, *argv]) == 0
    return seen["stderr"]


def test_train_with_the_tiny_default_warns_that_clip_higher_cannot_act(monkeypatch, capsys):
    err = _run_cli(monkeypatch, capsys, "train", [])
    assert f"{PREFIX} {CLIP_HIGH} (steps_per_generation == gradient_accumulation_steps, num_iterations 1)" in err
    assert f"{PREFIX} grpo.epsilon has no effect" in err
    assert len([ln for ln in err.splitlines() if ln.startswith(PREFIX)]) == 2  # one line each, nothing else


@pytest.mark.parametrize("fix", ["generation.steps_per_generation=2", "grpo.num_iterations=2"])
def test_two_optimizer_steps_per_rollout_silence_it(monkeypatch, capsys, fix):
    err = _run_cli(monkeypatch, capsys, "train", ["--set", fix])
    assert "grpo.epsilon" not in err and PREFIX not in err


def test_tune_warns_before_ray_too(monkeypatch, capsys):
    assert CLIP_HIGH in _run_cli(monkeypatch, capsys, "tune", [])


def test_one_step_per_rollout_follows_trls_rule():
    # TRL computes no old log-probs (ratio exactly 1) when grad_accum % (steps_per_generation * num_iterations) == 0
    assert one_step_per_rollout(1, None, 1) and one_step_per_rollout(4, 4, 1) and one_step_per_rollout(4, 2, 1)
    assert one_step_per_rollout(2, 1, 2)  # reused twice, but both passes inside one optimizer step
    assert not one_step_per_rollout(1, 2, 1) and not one_step_per_rollout(1, None, 2) and not one_step_per_rollout(4, 8, 1)


@pytest.mark.parametrize("overrides,expected", [
    (["grpo.loss_type=sapo", "grpo.num_iterations=2"], ["grpo.epsilon has no effect: grpo.loss_type sapo",
                                                       "grpo.epsilon_high has no effect: grpo.loss_type sapo"]),
    (["grpo.loss_type=cispo", "grpo.num_iterations=2"], ["grpo.epsilon has no effect: grpo.loss_type cispo"]),
    (["grpo.adaptive_entropy=false", "grpo.entropy_target=0.5", "grpo.entropy_coef_max=0.05"],
     ["grpo.entropy_target has no effect: grpo.adaptive_entropy is false",
      "grpo.entropy_coef_max has no effect: grpo.adaptive_entropy is false"]),
    (["grpo.adaptive_entropy=true", "grpo.entropy_coef=0", "grpo.entropy_coef_max=0"],
     ["grpo.adaptive_entropy has no effect: the bonus starts at grpo.entropy_coef 0 and grpo.entropy_coef_max 0"]),
    (["optimization.lr_scheduler_type=constant"], ["optimization.warmup_ratio has no effect: lr_scheduler_type 'constant'"]),
    (["generation.max_completion_length=64", "generation.adaptive.band_high=0.5"],  # tiny.yaml sets the others
     ["generation.adaptive.band_high has no effect: generation.max_completion_length is 64", "generation.adaptive.start",
      "generation.adaptive.band_low", "generation.adaptive.floor", "generation.adaptive.ceiling", "generation.adaptive.step",
      "generation.adaptive.reference_quantile"]),
    (["generation.vllm_gpu_memory_utilization=0.5"], ["generation.vllm_gpu_memory_utilization has no effect: generation.backend is 'hf'"]),
    (["generation.vllm_sleep_mode=true"], ["generation.vllm_sleep_mode has no effect: generation.backend is 'hf'"]),
    (["generation.backend=vllm", "generation.vllm_sleep_mode=true", "generation.vllm_gpu_memory_utilization=0.5"],
     ["generation.vllm_sleep_mode has no effect: distributed.use_gpu is false (vLLM's CPU build",
      "generation.vllm_gpu_memory_utilization has no effect: distributed.use_gpu is false"]),
    (["lora.enabled=false"], ["lora.r has no effect: lora.enabled is false", "lora.alpha has no effect", "lora.dropout has no effect"]),
    (["distributed.gpus_per_worker=2"], ["distributed.gpus_per_worker has no effect: distributed.use_gpu is false"]),
    (["distributed.resize_check_s=5"], ["distributed.resize_check_s has no effect: distributed.num_workers is a fixed count"]),
    (["distributed.placement=spread"], ["distributed.placement has no effect: distributed.num_workers is 1"]),
    (["rewards.weights={rouge_l: 1, eos: 0}", "rewards.eos_bonus=0.3"],
     ["rewards.eos_bonus has no effect on the reward: rewards.weights.eos is 0"]),
    (["rewards.overlong_weight=0", "rewards.overlong_buffer=32"], ["rewards.overlong_buffer has no effect: rewards.overlong_weight is 0"]),
    (["eval.num_prompts=0", "eval.every_steps=5"], ["eval.every_steps has no effect: eval.num_prompts is 0"]),
])
def test_each_rule_names_the_field_and_why(overrides, expected):
    lines = [ln for ln in inert_settings(load_config(None, ["grpo.num_iterations=2", *overrides]))]
    assert sorted(lines) == sorted(ln for ln in lines if any(ln.startswith(e) for e in expected)), lines
    for e in expected:
        assert sum(ln.startswith(e) for ln in lines) == 1, (e, lines)


def test_real_configs_and_their_fixes():
    # the 8B config already uses two optimizer steps per rollout (steps_per_generation 8, grad accumulation 4)
    assert inert_settings(load_config(REPO_ROOT / "configs" / "sauerkraut-8b.yaml")) == []
    # the baseline run's settings: clipping is inert there too (its clip ratios were 0 by construction)
    assert [ln.split(":")[0] for ln in inert_settings(load_config(REPO_ROOT / "configs" / "seed-baseline.yaml"))] == [
        "grpo.epsilon has no effect"]
