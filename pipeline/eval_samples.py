"""Held-out answers a person can read: every evaluation's answers with their component scores in
``eval_samples.jsonl``, the best and worst of the first and last evaluation in the doctor's
report, and as TensorBoard text when the run reports to TensorBoard."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

from pipeline.run_files import EVAL_SAMPLES, read_metrics

SHOWN = 2  # best and worst answers shown per evaluation


def answer_score(scores: Mapping[str, float], ended_with_eos: bool, weights: Mapping[str, float]) -> float:
    """One answer's eval/score: the run's fixed weights, the EOS term 1 when it stopped (as eval/eos_rate)."""
    terms = {**scores, "eos": 1.0 if ended_with_eos else 0.0}
    total = sum(weights.values()) or 1.0
    return sum(w * float(terms.get(k, 0.0)) for k, w in weights.items()) / total


def eval_rows(step: int, records: Sequence[Mapping[str, Any]], answers: Sequence[str], ended: Sequence[bool],
              scores: Mapping[str, Sequence[float]], weights: Mapping[str, float]) -> list[dict[str, Any]]:
    rows, seen = [], Counter()
    for i, (rec, text) in enumerate(zip(records, answers)):
        comp = {k: float(v[i]) for k, v in scores.items()}
        sample = seen[rec["question"]]  # eval.samples_per_prompt: the k-th answer to this prompt
        seen[rec["question"]] += 1
        rows.append({"step": step, "id": rec.get("id"), "prompt": rec["question"], "sample": sample, "completion": text,
                     "reference": rec["reference"], "ended_with_eos": bool(ended[i]), "scores": comp,
                     "score": answer_score(comp, bool(ended[i]), weights)})
    return rows


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    with Path(path).open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def by_evaluation(rows: Sequence[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    """step -> that evaluation's answers; a step evaluated again after a resume keeps its last answers."""
    out: dict[int, list[Mapping[str, Any]]] = {}
    last, ids = None, set()
    for r in rows:
        step = r.get("step")
        if not isinstance(step, int) or "score" not in r:
            continue
        key = (r.get("prompt"), r.get("sample", 0))
        if step != last or key in ids:  # a new evaluation (an answer again: the step evaluated anew)
            out[step], last, ids = [], step, set()
        ids.add(key)
        out[step].append(r)
    return out


def best_and_worst(answers: Sequence[Mapping[str, Any]], n: int = SHOWN) -> tuple[list, list]:
    ranked = sorted(answers, key=lambda r: -r["score"])
    return ranked[:n], ranked[max(n, len(ranked) - n):][::-1]


def _cell(text: Any, limit: int = 300) -> str:
    s = " ".join(str(text or "").split())
    s = s if len(s) <= limit else s[: limit - 1] + "…"
    return s.replace("|", "\\|")


def markdown(step: int, answers: Sequence[Mapping[str, Any]], n: int = SHOWN) -> list[str]:
    best, worst = best_and_worst(answers, n)
    comps = list(answers[0]["scores"]) if answers else []
    out = [f"| | score | {' | '.join(comps)} | EOS | question | answer | reference |",
           "|---" * (len(comps) + 6) + "|"]
    for label, group in (("best", best), ("worst", worst)):
        for r in group:
            out.append(f"| {label} | {r['score']:.3f} | " + " | ".join(f"{r['scores'][c]:.3f}" for c in comps)
                       + f" | {'yes' if r.get('ended_with_eos') else 'no'} | {_cell(r['prompt'])} | "
                       f"{_cell(r['completion'])} | {_cell(r['reference'])} |")
    return out


def report_section(run_dir: Path) -> list[str]:
    """Markdown for the doctor's report.md: the best and worst answers of the first and last evaluation."""
    evals = by_evaluation(read_metrics(Path(run_dir) / EVAL_SAMPLES))
    if not evals:
        return []
    steps = sorted(evals)
    picked = [steps[0]] + ([steps[-1]] if steps[-1] != steps[0] else [])
    out = ["", "## Held-out samples", "",
           f"The best and worst {SHOWN} held-out answers of the first and last evaluation ({len(steps)} in all), "
           f"each with its component scores and its `eval/score` (`{EVAL_SAMPLES}` holds every answer of every evaluation)."]
    for step in picked:
        answers = evals[step]
        mean = sum(r["score"] for r in answers) / len(answers)
        out += ["", f"### Step {step} ({len(answers)} answers, mean score {mean:.3f})", ""] + markdown(step, answers)
    return out


def to_tensorboard(trainer, step: int, rows: Sequence[Mapping[str, Any]]) -> bool:
    """The evaluation's best and worst answers as TensorBoard text (tag ``eval/samples``), through
    the run's own TensorBoardCallback writer; False when the run does not report to TensorBoard."""
    from transformers.integrations import TensorBoardCallback

    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, TensorBoardCallback):
            if cb.tb_writer is None:
                cb._init_summary_writer(trainer.args)
            if cb.tb_writer is None or not rows:
                return False
            cb.tb_writer.add_text("eval/samples", "\n".join(markdown(step, rows)), global_step=step)
            cb.tb_writer.flush()
            return True
    return False
