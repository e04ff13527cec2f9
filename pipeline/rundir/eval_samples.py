"""Held-out answers a person can read: the rows of ``eval_samples.jsonl`` (every evaluation's
answers with their component scores), their reader, and the best-and-worst table that the
doctor's report (``pipeline.report.markdown``) and TensorBoard (``pipeline.training.callbacks``)
both show."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

from pipeline.rundir.metric_names import MAX_STEP, number
from pipeline.rundir.files import EVAL_SAMPLES, iter_jsonl, line_list

SHOWN = 2  # best and worst answers shown per evaluation
MAX_COMPONENTS = 12  # score columns shown in a table


def answer_score(scores: Mapping[str, float], ended_with_eos: bool, weights: Mapping[str, float]) -> float:
    """One answer's eval/score: the run's fixed weights, the EOS term 1 when it stopped (as eval/eos_rate)."""
    terms = {**scores, "eos": 1.0 if ended_with_eos else 0.0}
    total = sum(weights.values()) or 1.0
    return sum(w * float(terms.get(k, 0.0)) for k, w in weights.items()) / total


def eval_rows(step: int, records: Sequence[Mapping[str, Any]], answers: Sequence[str], ended: Sequence[bool],
              scores: Mapping[str, Sequence[float]], weights: Mapping[str, float],
              engine_logprobs: Sequence[float | None] | None = None,
              policy_logprobs: Sequence[float | None] | None = None) -> list[dict[str, Any]]:
    """One row per answer. With generation.backend vllm also ``engine_logprob``, the engine's log-probability
    of the answer it sampled, and ``policy_logprob``, the trained policy's of the same tokens: equal (up to
    numerics) when the engine holds the policy's current weights, apart when its weights are stale."""
    rows, seen = [], Counter()
    for i, (rec, text) in enumerate(zip(records, answers)):
        comp = {k: float(v[i]) for k, v in scores.items()}
        sample = seen[rec["question"]]  # eval.samples_per_prompt: the k-th answer to this prompt
        seen[rec["question"]] += 1
        rows.append({"step": step, "id": rec.get("id"), "prompt": rec["question"], "sample": sample, "completion": text,
                     "reference": rec["reference"], "ended_with_eos": bool(ended[i]), "scores": comp,
                     "score": answer_score(comp, bool(ended[i]), weights)})
        if engine_logprobs is not None and engine_logprobs[i] is not None:
            rows[-1]["engine_logprob"] = round(float(engine_logprobs[i]), 6)
            rows[-1]["policy_logprob"] = round(float(policy_logprobs[i]), 6)
    return rows


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    with Path(path).open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def by_evaluation(rows: Sequence[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    """step -> that evaluation's answers; a step evaluated again after a resume keeps its last answers.
    Rows that are no answer (see ``answer_problem``) are left out."""
    out: dict[int, list[Mapping[str, Any]]] = {}
    last, ids = None, set()
    for r in rows:
        if answer_problem(r):
            continue
        step = r["step"]
        key = (str(r.get("prompt")), str(r.get("sample", 0)))
        if step != last or key in ids:  # a new evaluation (an answer again: the step evaluated anew)
            out[step], last, ids = [], step, set()
        ids.add(key)
        out[step].append(r)
    return out


def answer_problem(row: Mapping[str, Any]) -> str | None:
    """Why a row of eval_samples.jsonl is no answer the report can show, else None: it needs a whole
    ``step`` of at least 0, a finite ``score`` and, if any, ``scores`` as a mapping."""
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        return "step"
    if number(row.get("score")) is None:
        return "score"
    if not isinstance(row.get("scores", {}), Mapping):
        return "scores"
    return None


def read_answers(run_dir: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The answers of RUN_DIR/eval_samples.jsonl (none if it is missing) and one line naming the file
    and the lines skipped (broken, or no answer by ``answer_problem``), else None."""
    path = Path(run_dir) / EVAL_SAMPLES
    if not path.is_file():
        return [], None
    rows, skipped = [], {}
    try:
        for no, row in iter_jsonl(path):
            why = "not a JSON object" if row is None else answer_problem(row)
            if why:
                skipped.setdefault(why, []).append(no)
            else:
                rows.append(row)
    except OSError as e:
        return [], f"{path}: cannot be read ({e.strerror or e})"
    if not skipped:
        return rows, None
    parts = [f"{len(nums)} with {'no valid ' + why if why in ('step', 'score', 'scores') else why} (lines {line_list(nums)})"
             for why, nums in skipped.items()]
    return rows, f"{path}: skipped {sum(map(len, skipped.values()))} rows that are no answer: " + "; ".join(parts)


def best_and_worst(answers: Sequence[Mapping[str, Any]], n: int = SHOWN) -> tuple[list, list]:
    ranked = sorted(answers, key=lambda r: -float(r["score"]))
    return ranked[:n], ranked[max(n, len(ranked) - n):][::-1]


def _cell(text: Any, limit: int = 300) -> str:
    s = " ".join(str(text or "")[: 4 * limit].split())
    s = s if len(s) <= limit else s[: limit - 1] + "…"
    return s.replace("|", "\\|")


def _score(v: Any) -> str:
    v = number(v)
    return "-" if v is None else f"{v:.3f}"


def markdown(step: int, answers: Sequence[Mapping[str, Any]], n: int = SHOWN) -> list[str]:
    best, worst = best_and_worst(answers, n)
    comps = list((answers[0].get("scores") or {}) if answers else [])[:MAX_COMPONENTS]
    out = [f"| | score | {' | '.join(_cell(c, 40) for c in comps)} | EOS | question | answer | reference |",
           "|---" * (len(comps) + 6) + "|"]
    for label, group in (("best", best), ("worst", worst)):
        for r in group:
            scores = r.get("scores") or {}
            out.append(f"| {label} | {_score(r['score'])} | " + " | ".join(_score(scores.get(c)) for c in comps)
                       + f" | {'yes' if r.get('ended_with_eos') is True else 'no'} | {_cell(r.get('prompt'))} | "
                       f"{_cell(r.get('completion'))} | {_cell(r.get('reference'))} |")
    return out
