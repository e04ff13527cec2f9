"""ROUGE-L F-measure over Unicode word tokens, so German words stay whole.

The `rouge-score` package keeps only ``[a-z0-9]`` (``Größe`` -> ``gr``, ``e``). Here text is
NFC-normalized and casefolded, and a token is a run of Unicode letters/digits (combining accents
included). On ASCII text that is exactly the package's tokenizer, and the LCS and F-measure are
the same definitions, so scores agree with ``rouge_score``'s ``rougeL`` to float precision.

Casefolding maps ``ß`` to ``ss`` (``Straße`` == ``STRASSE`` == ``Strasse``), the Unicode
caseless match; the word itself stays one token. The LCS runs in rapidfuzz's compiled
bit-parallel ``LCSseq`` on token strings where each reference token is one character.
"""
from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from rapidfuzz.distance import LCSseq

# Letters and digits of any script plus combining diacritics left after NFC. ``\w`` also matches
# "_", which rouge-score treats as a separator: tokenize() blanks it first (cheaper than excluding
# it in the class, which makes the regex twice as slow).
_TOKEN_RE = re.compile(r"[\w\u0300-\u036f]+")
_NO_MATCH = "\x00"  # stands for every prediction token absent from the reference


def tokenize(text: str) -> list[str]:
    """Unicode word tokens: NFC, casefold, runs of letters/digits (``Größe`` -> ``['grösse']``)."""
    if not text:
        return []
    if not text.isascii() and not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    if "_" in text:
        text = text.replace("_", " ")
    return _TOKEN_RE.findall(text.casefold())


def _encode_reference(tokens: Sequence[str]) -> tuple[dict[str, str], str]:
    """Map each distinct reference token to one character (codepoints from 1, skipping surrogates)."""
    vocab: dict[str, str] = {}
    for tok in tokens:
        if tok not in vocab:
            n = len(vocab) + 1
            vocab[tok] = chr(n if n < 0xD800 else n + 0x800)
    return vocab, "".join(vocab[t] for t in tokens)


def _fmeasure(lcs: int, n_pred: int, n_ref: int) -> float:
    # Same arithmetic as rouge_score.scoring.fmeasure(precision, recall).
    if lcs == 0:
        return 0.0
    p, r = lcs / n_pred, lcs / n_ref
    return 2 * p * r / (p + r)


def _score_tokens(pred: Sequence[str], vocab: dict[str, str], ref_str: str) -> float:
    if not pred or not ref_str:
        return 0.0
    get = vocab.get
    pred_str = "".join([get(t, _NO_MATCH) for t in pred])
    return _fmeasure(LCSseq.similarity(ref_str, pred_str), len(pred), len(ref_str))


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure of one prediction against one reference, in [0, 1]."""
    vocab, ref_str = _encode_reference(tokenize(reference))
    return _score_tokens(tokenize(prediction), vocab, ref_str)


def rouge_l_batch(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
    """ROUGE-L per pair; each distinct reference is tokenized once (GRPO repeats it per group)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    cache: dict[str, tuple[dict[str, str], str]] = {}
    out = []
    for pred, ref in zip(predictions, references):
        enc = cache.get(ref)
        if enc is None:
            enc = cache[ref] = _encode_reference(tokenize(ref))
        out.append(_score_tokens(tokenize(pred), *enc))
    return out
