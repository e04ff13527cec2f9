"""Completion-length control: a fixed schedule or an adaptive cap, applied where generation reads it.

The seed's callback set ``args.max_completion_length``, which TRL copies at start-up, so its
completions stayed at 160 tokens. TRL's generation reads ``trainer.max_completion_length`` (and
the loss normalisation of dr_grpo), ``trainer.generation_config.max_new_tokens`` and
``trainer.generation_kwargs`` (HF generate), and the vLLM generator's sampling parameters; all are
set here. The adaptive mode follows the clipped ratio: when every completion in a group is cut,
every length-based reward is equal within the group and GRPO gets no signal from it.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from transformers import TrainerCallback

from pipeline.config import RunConfig

CAP_METRIC = "generation/max_completion_length"


def scheduled_length(schedule: list[list[int]], step: int, initial: int) -> int:
    """The schedule's length in force at ``step``: the last entry whose step is <= step."""
    length = initial
    for at, value in schedule:
        if step >= at:
            length = value
    return length


def adaptive_next(cap: int, clipped_ratio: float, band: tuple[float, float], step: int, floor: int, ceiling: int) -> int:
    """One adaptive move: raise above the band, lower below it, hold inside."""
    low, high = band
    if clipped_ratio > high:
        return min(ceiling, cap + step)
    if clipped_ratio < low:
        return max(floor, cap - step)
    return cap


def _seam_gone(what: str) -> RuntimeError:
    """These are TRL's private attributes (tests/test_seams.py pins them): fail loudly, never cap nothing."""
    try:
        from importlib.metadata import version

        trl = f"trl {version('trl')}"
    except Exception:  # pragma: no cover
        trl = "this trl"
    return RuntimeError(f"length control: {what} is gone in {trl}, so the completion-length cap would not reach "
                        "generation; use the TRL version pinned in pyproject.toml (tests/test_seams.py checks it)")


def apply_max_completion_length(trainer, length: int) -> None:
    """Set every attribute TRL's generation reads (see module docstring); raises if one is gone."""
    if not hasattr(trainer, "max_completion_length"):
        raise _seam_gone("GRPOTrainer.max_completion_length")
    trainer.max_completion_length = length
    trainer.args.max_completion_length = length  # for anything that reads args later (and for the record)
    if getattr(trainer, "use_vllm", False):
        vllm = getattr(trainer, "vllm_generation", None)
        if vllm is None or not hasattr(vllm, "max_completion_length"):
            raise _seam_gone("GRPOTrainer.vllm_generation.max_completion_length")
    else:
        gen_cfg, kwargs = getattr(trainer, "generation_config", None), getattr(trainer, "generation_kwargs", None)
        if gen_cfg is None or not hasattr(gen_cfg, "max_new_tokens"):
            raise _seam_gone("GRPOTrainer.generation_config (its max_new_tokens)")
        if not isinstance(kwargs, dict):
            raise _seam_gone("GRPOTrainer.generation_kwargs")
        gen_cfg.max_new_tokens = length
        kwargs["max_new_tokens"] = length
    vllm = getattr(trainer, "vllm_generation", None)
    if vllm is not None:
        if hasattr(vllm, "max_completion_length"):
            vllm.max_completion_length = length
        sampling = getattr(vllm, "sampling_params", None)
        if sampling is not None and hasattr(sampling, "max_tokens"):
            sampling.max_tokens = length


class CompletionLengthControl(TrainerCallback):
    """Owns the current cap; other parts (the EOS reward, evaluation) read ``current``."""

    def __init__(self, cfg: RunConfig, ceiling: int | None = None, log: Callable[[str], None] = print):
        g = cfg.generation
        self.adaptive = cfg.adaptive_length
        self.schedule = [list(x) for x in g.length_schedule]
        self.initial = cfg.initial_max_completion_length
        self.current = self.initial
        a = g.adaptive
        self.band = (a.band_low, a.band_high)
        self.step_size, self.floor = a.step, a.floor
        self.ceiling = a.ceiling or ceiling or 4 * a.start
        self.recent: deque[float] = deque(maxlen=a.window)
        self.trainer = None
        self.log = log
        self.changes: list[tuple[int, int, int]] = []  # (step, old, new)

    def bind(self, trainer) -> None:
        self.trainer = trainer
        apply_max_completion_length(trainer, self.current)

    def restore(self, cap: int, recent: list[float]) -> None:
        """Resume: continue from the cap and clipped ratios logged before the checkpoint."""
        self.current = cap
        self.recent.extend(recent)
        if self.trainer is not None:
            apply_max_completion_length(self.trainer, cap)

    def _set(self, step: int, length: int, why: str) -> None:
        if length == self.current:
            return
        self.changes.append((step, self.current, length))
        if self.log:
            self.log(f"[length] step {step}: max_completion_length {self.current} -> {length} ({why})")
        self.current = length
        if self.trainer is not None:
            apply_max_completion_length(self.trainer, length)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.schedule:
            self._set(state.global_step, scheduled_length(self.schedule, state.global_step, self.initial), "schedule")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "completions/clipped_ratio" not in logs:
            return
        logs[CAP_METRIC] = self.current  # the cap this step's completions were generated under
        if not self.adaptive:
            return
        self.recent.append(float(logs["completions/clipped_ratio"]))
        if len(self.recent) < self.recent.maxlen:
            return
        mean = sum(self.recent) / len(self.recent)
        new = adaptive_next(self.current, mean, self.band, self.step_size, self.floor, self.ceiling)
        if new != self.current:
            self._set(state.global_step, new, f"clipped ratio {mean:.2f} outside [{self.band[0]}, {self.band[1]}]")
            self.recent.clear()
