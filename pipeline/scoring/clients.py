"""TRL reward functions that are thin async clients of the Ray reward pool.

One function per component, named as the component, so TRL logs ``rewards/<name>/mean`` and
``/std``; TRL runs async reward functions concurrently, so the four components are scored in
parallel by the pool's actors. The ``self`` judge (the baseline run's self-judging, kept only to
reproduce it) scores in the worker with the live policy, since its weights change every step.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from pipeline.config import RunConfig
from pipeline.scoring.pool import RewardPool
from rewards.eos import is_terminated
from rewards.trl_rewards import EOS_KWARGS, completion_text, scored_components


def eos_kwargs(cfg: RunConfig) -> dict[str, float]:
    """The ``rewards.*`` fields named like the eos component's keyword arguments (``rewards.eos.eos_component``)."""
    return {k: getattr(cfg.rewards, k) for k in EOS_KWARGS}


def make_pool_reward_funcs(pool: RewardPool, cfg: RunConfig, eos_token_ids: list[int],
                           current_max_len: Callable[[], int],
                           self_judge: Any | None = None) -> tuple[list[Callable], list[float]]:
    """(reward_funcs, reward_weights) for ``rewards.trl_rewards.scored_components``: the cheap components
    are scored and logged at any weight (the baseline run's EOS rate is part of what the comparison
    shows), the judge only at a positive weight.
    """
    ekw = eos_kwargs(cfg)

    async def rouge_l(completions, reference, **kwargs):
        return await pool.rouge_l([completion_text(c) for c in completions], list(reference))

    async def length(completions, reference, **kwargs):
        return await pool.length([completion_text(c) for c in completions], list(reference))

    async def judge(completions, question, reference, log_metric=None, **kwargs):
        texts = [completion_text(c) for c in completions]
        t0 = time.perf_counter()
        if self_judge is not None:
            scores = self_judge.score(list(question), list(reference), texts)
        else:
            scores = await pool.judge(list(question), list(reference), texts)
        if log_metric is not None:
            dt = time.perf_counter() - t0
            log_metric("pool/judge_seconds", dt)
            log_metric("pool/judge_per_second", len(texts) / dt if dt > 0 else 0.0)
        return scores

    async def eos(completions, completion_ids, reference, log_extra=None, **kwargs):
        ids = [list(map(int, x)) for x in completion_ids]
        if log_extra is not None:  # samples.jsonl reads these from TRL's completion log
            log_extra("reference", list(reference))
            log_extra("ended_with_eos", [is_terminated(x, eos_token_ids) for x in ids])
        return await pool.eos(ids, eos_token_ids, current_max_len(), ekw)

    funcs = {"rouge_l": rouge_l, "length": length, "judge": judge, "eos": eos}
    names, weights = scored_components(cfg.rewards.weights), cfg.rewards.weights
    return [funcs[c] for c in names], [float(weights.get(c, 0.0)) for c in names]
