"""One TRL reward function per component, so TRL logs ``rewards/<name>/mean`` and ``/std`` for each.

The baseline run logged only its blended reward. Here TRL combines the components itself with
``GRPOConfig.reward_weights``; each function's ``__name__`` (``rouge_l``, ``length``, ``judge``,
``eos``) becomes its metric name. These are the in-process forms; the Ray reward pool offers the
same components as async clients elsewhere.

TRL calls ``func(prompts=..., completions=..., completion_ids=..., **dataset_columns)`` plus its
own extras (``trainer_state``, ``log_extra``, ``log_metric``); the dataset must carry
``reference`` (and ``question`` for the judge, else the last user turn of the prompt is used).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rewards.eos import eos_component, eos_component_batch
from rewards.judge import Judge
from rewards.length import length_similarity_batch
from rewards.rouge import rouge_l_batch

COMPONENTS = ("rouge_l", "length", "judge", "eos")
EOS_KWARGS = tuple(p for p in inspect.signature(eos_component).parameters if p not in {"completion_ids", "eos_token_ids", "max_len"})


def _message_text(message: Any) -> str:
    content = message.get("content", "") if isinstance(message, Mapping) else message
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # multimodal parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def completion_text(completion: Any) -> str:
    """The text of a TRL completion: a plain string, or conversational ``[{"role": "assistant", ...}]``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _message_text(completion)
    messages = list(completion or [])
    assistant = [m for m in messages if isinstance(m, Mapping) and m.get("role") == "assistant"]
    return "".join(_message_text(m) for m in (assistant or messages))


def prompt_question(prompt: Any) -> str:
    """The question inside a prompt: the last user turn of a conversation, or the plain prompt."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt or [] if isinstance(m, Mapping) and m.get("role") == "user"]
    return _message_text(users[-1]) if users else completion_text(prompt)


def _column(kwargs: dict[str, Any], name: str, n: int) -> list[str]:
    if name not in kwargs or kwargs[name] is None:
        raise KeyError(f"reward function needs dataset column '{name}' (have: {sorted(kwargs)})")
    values = list(kwargs[name])
    if len(values) != n:
        raise ValueError(f"column '{name}' has {len(values)} rows for {n} completions")
    return [str(v) for v in values]


class RewardFunc:
    """A named TRL reward function (``name``, its ``__name__`` as TRL reads it); a class instance so that it
    pickles when its judge does."""

    name = ""

    def __init__(self) -> None:
        self.__name__ = self.name

    def __call__(self, prompts: list | None = None, completions: list | None = None, completion_ids: list | None = None, **kwargs: Any) -> list[float]:
        texts = [completion_text(c) for c in completions or []]
        return self.compute(prompts or [], texts, completion_ids or [], kwargs)

    def compute(self, prompts: list, texts: list[str], completion_ids: list, kwargs: dict[str, Any]) -> list[float]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<reward {self.__name__}>"


class RougeReward(RewardFunc):
    name = "rouge_l"

    def compute(self, prompts, texts, completion_ids, kwargs):
        return rouge_l_batch(texts, _column(kwargs, "reference", len(texts)))


class LengthReward(RewardFunc):
    name = "length"

    def compute(self, prompts, texts, completion_ids, kwargs):
        return length_similarity_batch(texts, _column(kwargs, "reference", len(texts)))


class JudgeReward(RewardFunc):
    name = "judge"

    def __init__(self, judge: Judge) -> None:
        super().__init__()
        self.judge = judge

    def compute(self, prompts, texts, completion_ids, kwargs):
        refs = _column(kwargs, "reference", len(texts))
        if kwargs.get("question") is not None:
            questions = _column(kwargs, "question", len(texts))
        else:
            questions = [prompt_question(p) for p in prompts]
        return [float(s) for s in self.judge.score(questions, refs, texts)]


class EosReward(RewardFunc):
    name = "eos"

    def __init__(self, eos_token_ids: Sequence[int], max_len_fn: Callable[[], int], eos_kwargs: Mapping[str, Any]) -> None:
        super().__init__()
        unknown = set(eos_kwargs) - set(EOS_KWARGS)
        if unknown:
            raise ValueError(f"unknown eos_kwargs {sorted(unknown)} (allowed: {', '.join(EOS_KWARGS)})")
        self.eos_token_ids, self.max_len_fn, self.eos_kwargs = frozenset(eos_token_ids), max_len_fn, dict(eos_kwargs)

    def compute(self, prompts, texts, completion_ids, kwargs):
        if len(completion_ids) != len(texts):
            raise ValueError("the eos reward needs completion_ids (TRL passes them) for every completion")
        # read the cap now: a length schedule changes it during training
        return eos_component_batch(completion_ids, self.eos_token_ids, int(self.max_len_fn()), **self.eos_kwargs)


def scored_components(weights: Mapping[str, float]) -> list[str]:
    """The components a run scores, in the fixed order rouge_l, length, judge, eos: the one rule for both
    factories (these in-process functions and the reward pool's clients in ``pipeline.scoring.clients``).

    TRL computes every reward function it is given and logs ``rewards/<name>/mean`` for each, whatever
    its weight. A cheap component (rouge_l, length, eos) is kept even at weight 0 (or absent from
    ``weights``), so runs and Tune trials with different weights stay comparable and e.g. the EOS rate
    stays visible. The judge, the one costly component, is scored only at a positive weight; evaluation
    scores it apart (``eval.score_weights``).
    """
    unknown = set(weights) - set(COMPONENTS)
    if unknown:
        raise ValueError(f"unknown reward components {sorted(unknown)} (allowed: {', '.join(COMPONENTS)})")
    return [c for c in COMPONENTS if c != "judge" or float(weights.get(c, 0.0)) > 0]


def make_reward_funcs(weights: Mapping[str, float], judge: Judge | None, eos_token_ids: Sequence[int],
                      max_len_fn: Callable[[], int],
                      eos_kwargs: Mapping[str, Any]) -> tuple[list[Callable], list[float]]:
    """Reward functions and their TRL ``reward_weights`` for ``scored_components(weights)``; a positive
    judge weight without a judge is an error."""
    names = scored_components(weights)
    if "judge" in names and judge is None:
        raise ValueError(f"reward weight judge={float(weights['judge'])} needs a judge (got None)")
    make = {"rouge_l": RougeReward, "length": LengthReward, "judge": lambda: JudgeReward(judge),
            "eos": lambda: EosReward(eos_token_ids, max_len_fn, eos_kwargs)}
    return [make[n]() for n in names], [float(weights.get(n, 0.0)) for n in names]
