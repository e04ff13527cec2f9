"""Termination shaping: reward stopping with EOS, penalize running into the length cap.

The baseline run's policy never emitted EOS (clipped ratio 1.0), and when every completion is cut every
length-based reward is equal within a group, so GRPO gets no signal. These terms make stopping
worth something. All take the completion token ids as TRL passes them to reward functions
(the EOS id is the last id when the completion terminated) and the *current* maximum completion
length, which a length schedule changes during training. Lengths count every id given, EOS
included, as TRL's ``completions/mean_length`` does.

"Terminated" means the last id is one of ``eos_token_ids``. TRL's own truncation test is
``ids[-1] not in {eos..., pad}``; pass the pad id among ``eos_token_ids`` to match it exactly.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def is_terminated(completion_ids: Sequence[int], eos_token_ids: Iterable[int]) -> bool:
    """True when the completion ends with an EOS id."""
    return len(completion_ids) > 0 and completion_ids[-1] in set(eos_token_ids)


def eos_reward(completion_ids: Sequence[int], eos_token_ids: Iterable[int], max_len: int, *, eos_bonus: float = 0.1,
               truncation_penalty: float = 0.1) -> float:
    """+eos_bonus if terminated, -truncation_penalty if cut at ``max_len`` (len >= max_len), else 0."""
    if is_terminated(completion_ids, eos_token_ids):
        return eos_bonus
    if len(completion_ids) >= max_len:
        return -truncation_penalty
    return 0.0


def _length(completion: Sequence[int] | int) -> int:
    return completion if isinstance(completion, int) else len(completion)


def overlong_penalty(completion: Sequence[int] | int, max_len: int, buffer: int) -> float:
    """DAPO soft overlong penalty: 0 up to ``max_len - buffer``, linear to -1 at ``max_len``.

    ``completion`` is the ids or their count. Beyond ``max_len`` it stays -1. ``buffer <= 0``
    disables the ramp (0 within ``max_len``); a buffer larger than ``max_len`` ramps from length 0.
    """
    length = _length(completion)
    if length > max_len:
        return -1.0
    if buffer <= 0:
        return 0.0
    start = max_len - min(buffer, max_len)
    if length <= start:
        return 0.0
    return -(length - start) / (max_len - start)


def brevity_penalty(completion: Sequence[int] | int, max_len: int) -> float:
    """``-len / max_len`` (ids or their count): a steady push toward shorter answers, weighted outside."""
    return -_length(completion) / max_len if max_len > 0 else 0.0


def eos_component(completion_ids: Sequence[int], eos_token_ids: Iterable[int], max_len: int, *, eos_bonus: float = 0.1,
                  truncation_penalty: float = 0.1, overlong_buffer: int = 16, overlong_weight: float = 0.1,
                  brevity_weight: float = 0.0) -> float:
    """The ``eos`` reward: termination bonus/penalty + weighted overlong + weighted brevity."""
    if max_len <= 0:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    n = len(completion_ids)
    value = eos_reward(completion_ids, eos_token_ids, max_len, eos_bonus=eos_bonus,
                       truncation_penalty=truncation_penalty)
    if overlong_weight:
        value += overlong_weight * overlong_penalty(n, max_len, overlong_buffer)
    if brevity_weight:
        value += brevity_weight * brevity_penalty(n, max_len)
    return value


def eos_component_batch(completion_ids: Sequence[Sequence[int]], eos_token_ids: Iterable[int], max_len: int,
                        **kwargs: float) -> list[float]:
    """``eos_component`` for each completion (same keyword arguments)."""
    eos = frozenset(eos_token_ids)
    return [eos_component(ids, eos, max_len, **kwargs) for ids in completion_ids]
