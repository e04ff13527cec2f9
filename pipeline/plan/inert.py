"""Settings that cannot change the run as configured, named before it starts: one warning line each.

The baseline run's worst bug was a knob that did nothing. Some knobs do nothing by construction rather than
by a bug: clip-higher when every rollout is used up inside one optimizer step (TRL's policy ratio is
then exactly 1), the entropy controller's knobs with the controller off, LoRA's with LoRA off. The
rules below read only the config (no Ray, no torch), so `synth-grpo train` and `tune` say it at once.

Settings that matter only in some modes warn when they differ from their default (the config chose
them); the clip settings warn whatever their value, because clip-higher is on by default.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

from pipeline.config import RunConfig

PREFIX = "[config] WARNING:"
CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")  # TRL clips the ratio to [1 - epsilon, 1 + epsilon_high]


def one_step_per_rollout(gradient_accumulation_steps: int, steps_per_generation: int | None, num_iterations: int) -> bool:
    """True when each rollout is used up within the optimizer step that generated it, so the policy has
    not moved and the PPO ratio new/old is exactly 1. TRL's GRPOTrainer then computes no old log-probs
    and uses the current ones detached (its test: gradient_accumulation_steps % (steps_per_generation x
    num_iterations) == 0; steps_per_generation defaults to gradient_accumulation_steps)."""
    spg = steps_per_generation or gradient_accumulation_steps
    return gradient_accumulation_steps % (spg * max(num_iterations, 1)) == 0


def rollout_text(ga: int, spg: int | None, iters: int) -> str:
    spg = spg or ga
    if spg == ga and iters == 1:
        return "one optimizer step per rollout (steps_per_generation == gradient_accumulation_steps, num_iterations 1)"
    return (f"each rollout is used up within one optimizer step (gradient_accumulation_steps {ga} is a multiple of "
            f"steps_per_generation {spg} x num_iterations {iters})")


def _default(section: Any, name: str) -> Any:
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _changed(section: Any, names: tuple[str, ...]) -> list[str]:
    """The fields of a config section whose values differ from their defaults."""
    return [n for n in names if getattr(section, n) != _default(section, n)]


def inert_settings(cfg: RunConfig) -> list[str]:
    """One line per setting that cannot change this run: 'field has no effect: why; what would make it act'."""
    return _clipping_inert(cfg) + _entropy_inert(cfg) + _schedule_inert(cfg) + _modes_off_inert(cfg)


def _clipping_inert(cfg: RunConfig) -> list[str]:
    out: list[str] = []
    o, g, gr = cfg.optimization, cfg.generation, cfg.grpo
    # PPO clipping: with the ratio exactly 1 nothing is ever clipped.
    ga, spg, iters = o.gradient_accumulation_steps, g.steps_per_generation, gr.num_iterations
    if gr.loss_type in CLIP_LOSSES and one_step_per_rollout(ga, spg, iters):
        why = (f"{rollout_text(ga, spg, iters)}, so the policy ratio is exactly 1 and never clipped; clipping acts when "
               "gradient_accumulation_steps is not a multiple of steps_per_generation x num_iterations "
               f"(e.g. grpo.num_iterations: 2, or generation.steps_per_generation: {2 * ga})")
        out.append(f"grpo.epsilon has no effect: {why}")
        if gr.epsilon_high is not None and gr.epsilon_high != gr.epsilon:
            out.append(f"grpo.epsilon_high has no effect: {why}")
    elif gr.loss_type == "sapo":
        names = ["epsilon"] + (["epsilon_high"] if gr.epsilon_high is not None else [])
        out += [f"grpo.{n} has no effect: grpo.loss_type sapo replaces clipping with a soft gate" for n in names]
    elif gr.loss_type == "cispo" and gr.epsilon_high is not None:
        out.append("grpo.epsilon has no effect: grpo.loss_type cispo caps the ratio at grpo.epsilon_high only")
    return out


def _entropy_inert(cfg: RunConfig) -> list[str]:
    out: list[str] = []
    gr = cfg.grpo
    # entropy controller (TRL reads these only with use_adaptive_entropy)
    if not gr.adaptive_entropy:
        out += [f"grpo.{n} has no effect: grpo.adaptive_entropy is false (the entropy bonus is the fixed grpo.entropy_coef)"
                for n in _changed(gr, ("entropy_target", "entropy_coef_max", "entropy_coef_delta"))]
    elif gr.entropy_coef == 0 and (gr.entropy_coef_max == 0 or gr.entropy_coef_delta == 0):
        knob = "entropy_coef_max" if gr.entropy_coef_max == 0 else "entropy_coef_delta"
        out.append(f"grpo.adaptive_entropy has no effect: the bonus starts at grpo.entropy_coef 0 and grpo.{knob} 0 "
                   "keeps it there")
    return out


def _schedule_inert(cfg: RunConfig) -> list[str]:
    out: list[str] = []
    o = cfg.optimization
    # learning-rate schedule: transformers' "constant" schedule takes no warmup
    if o.lr_scheduler_type == "constant" and o.warmup_ratio > 0:
        out.append("optimization.warmup_ratio has no effect: lr_scheduler_type 'constant' has no warmup "
                   "(use 'constant_with_warmup')")
    return out


def _modes_off_inert(cfg: RunConfig) -> list[str]:
    out: list[str] = []
    g = cfg.generation
    # modes that are off
    if not cfg.adaptive_length:
        a = g.adaptive
        out += [f"generation.adaptive.{n} has no effect: generation.max_completion_length is {g.max_completion_length}, not 'adaptive'"
                for n in _changed(a, tuple(f.name for f in dataclasses.fields(a)))]
    if g.backend != "vllm":
        out += [f"generation.{n} has no effect: generation.backend is {g.backend!r}, not 'vllm'"
                for n in _changed(g, ("vllm_gpu_memory_utilization", "vllm_sleep_mode"))]
    elif not cfg.distributed.use_gpu:  # the CPU build: its KV cache is sized for the run (training/vllm_engine.py)
        out += [f"generation.{n} has no effect: distributed.use_gpu is false (vLLM's CPU build sizes its KV cache "
                "for the run and has no sleep mode)" for n in _changed(g, ("vllm_gpu_memory_utilization", "vllm_sleep_mode"))]
    if not cfg.lora.enabled:
        out += [f"lora.{n} has no effect: lora.enabled is false (full fine-tuning)"
                for n in _changed(cfg.lora, ("r", "alpha", "dropout", "target_modules"))]
    if not cfg.distributed.use_gpu:
        out += [f"distributed.{n} has no effect: distributed.use_gpu is false"
                for n in _changed(cfg.distributed, ("gpus_per_worker",))]
    if isinstance(cfg.distributed.num_workers, int):
        out += [f"distributed.{n} has no effect: distributed.num_workers is a fixed count (an elastic group is [min, max])"
                for n in _changed(cfg.distributed, ("resize_check_s",))]
    workers = cfg.distributed.num_workers
    if (workers if isinstance(workers, int) else max(workers)) == 1:
        out += [f"distributed.{n} has no effect: distributed.num_workers is 1 (one worker has nothing to spread or pack)"
                for n in _changed(cfg.distributed, ("placement",))]
    r = cfg.rewards
    if not r.weights.get("eos"):
        out += [f"rewards.{n} has no effect on the reward: rewards.weights.eos is 0 (the eos component is only logged)"
                for n in _changed(r, ("eos_bonus", "truncation_penalty", "overlong_weight", "brevity_weight")) if getattr(r, n)]
    elif not r.overlong_weight and r.overlong_buffer != _default(r, "overlong_buffer"):
        out.append("rewards.overlong_buffer has no effect: rewards.overlong_weight is 0")
    if cfg.eval.num_prompts == 0:
        out += [f"eval.{n} has no effect: eval.num_prompts is 0 (no evaluation)"
                for n in _changed(cfg.eval, ("every_steps", "max_new_tokens", "score_weights"))]
    return out


def warn_inert(cfg: RunConfig, print_fn: Callable[[str], Any] | None = None) -> list[str]:
    """Print each inert setting as one `[config] WARNING:` line (stderr by default); returns the lines."""
    lines = inert_settings(cfg)
    for line in lines:
        (print_fn or (lambda s: print(s, file=sys.stderr)))(f"{PREFIX} {line}")
    return lines
