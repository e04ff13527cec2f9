"""Length similarity: how close the completion's length is to the reference's, in [0, 1].

Definition: ``min(n_pred, n_ref) / max(n_pred, n_ref)`` where ``n`` counts the same Unicode word
tokens as ROUGE-L (``rewards.rouge.tokenize``). Symmetric: half as long and twice as long both
score 0.5. An empty completion scores 0 (also against an empty reference, so saying nothing never
pays); a non-empty completion against an empty reference scores 0 too.
"""
from __future__ import annotations

from collections.abc import Sequence

from rewards.rouge import tokenize


def length_ratio(n_pred: int, n_ref: int) -> float:
    """``min/max`` of two token counts; 0 when either is 0."""
    if n_pred <= 0 or n_ref <= 0:
        return 0.0
    return min(n_pred, n_ref) / max(n_pred, n_ref)


def length_similarity(prediction: str, reference: str) -> float:
    """Symmetric token-count ratio of prediction and reference, in [0, 1]."""
    return length_ratio(len(tokenize(prediction)), len(tokenize(reference)))


def length_similarity_batch(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
    """Per-pair length similarity; each distinct reference is counted once."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    counts: dict[str, int] = {}
    out = []
    for pred, ref in zip(predictions, references):
        n_ref = counts.get(ref)
        if n_ref is None:
            n_ref = counts[ref] = len(tokenize(ref))
        out.append(length_ratio(len(tokenize(pred)), n_ref))
    return out
