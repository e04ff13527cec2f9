"""The doctor's report: report.md (findings, metric summary, held-out samples, plots) and the text
`synth-grpo doctor` prints (its ``--json`` is ``Finding.to_json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from pipeline.diagnosis.history import History
from pipeline.diagnosis.rules import Finding, RuleSettings, diagnose
from pipeline.report.run_reader import Run, RunDirError, load_run
from pipeline.rundir.metric_names import CAP_METRIC, TRAIN_KEYS, number
from pipeline.rundir.eval_samples import SHOWN, by_evaluation, markdown, read_answers
from pipeline.rundir.files import EVAL_SAMPLES, METRICS, REPORT, line_list, write_atomic


def write_report(run: Run, h: History, findings: list[Finding], plots: Mapping[str, Path]) -> Path:
    """report.md beside the metrics: findings with why/advice, a metric summary, the plots."""
    out = [f"# Training health report: {run.path.name}", ""]
    steps = f"steps {h.steps[0]}-{h.steps[-1]}" if len(h) else "no training steps"
    out.append(f"{len(h)} logged training steps ({steps}), {len(run.rows) - len(h)} other lines (eval, summary).")
    if run.broken_lines:
        out.append(f"Skipped {len(run.broken_lines)} broken lines of {METRICS}: {line_list(run.broken_lines)}.")
    if run.bad_steps:
        out.append(f"Skipped {len(run.bad_steps)} rows of {METRICS} whose step is no step number: {line_list(run.bad_steps)}.")
    if run.config_problem:
        out.append(run.config_problem + ".")
    resolved = sum(f.resolved for f in findings)
    out += ["", f"## Findings ({len(findings)}" + (f", {resolved} resolved" if resolved else "") + ")", ""]
    if not findings:
        out.append("No rule fired: no sign of the baseline run's pathologies in this run.")
    else:
        out += ["A finding is *resolved* when it held for a while but no longer holds at the end of the run.", "",
                "| rule | status | held | what it saw first |", "|---|---|---|---|"]
        out += [f"| `{f.rule}` | {f.status} | {f.span()}{'' if f.resolved else ' on'} | {f.summary} |" for f in findings]
        for f in findings:
            when = f"resolved: held at {f.span()}" if f.resolved else f"from step {f.first_step}"
            out += ["", f"### `{f.rule}` ({when})", "", f.summary + ".", "", f"**Why it matters:** {f.why}.", "",
                    "**What to change:**", ""]
            out += [f"- `{a.split(' — ')[0]}`" + (f" — {a.split(' — ', 1)[1]}" if " — " in a else "") for a in f.advice]
            out += ["", "<details><summary>evidence</summary>", "", "```json", json.dumps(f.evidence), "```", "</details>"]
    out += ["", "## Metrics", "", "| metric | first | last | min | max |", "|---|---|---|---|---|"]
    for key in ("reward", "reward_std", "entropy", "completions/clipped_ratio", "completions/mean_length",
                "completions/max_length", CAP_METRIC, "clip_ratio/region_mean", "frac_reward_zero_std",
                *sorted(k for k in h.keys() if k.startswith("rewards/") and k.endswith("/mean"))):
        vals = h.values(key)
        if vals:
            out.append(f"| `{key}` | {vals[0]:.4g} | {vals[-1]:.4g} | {min(vals):.4g} | {max(vals):.4g} |")

    out += report_section(run.path, run.warnings)
    if plots:
        out += ["", "## Plots", ""]
        out += [f"![{name}]({p.name})" for name, p in plots.items()]
    return write_atomic(run.path / REPORT, "\n".join(out) + "\n")


def doctor(run_dir: str | Path, settings: RuleSettings | None = None,
           plots: bool = True) -> tuple[Run, list[Finding], Path, dict[str, Path]]:
    """Read a run directory, diagnose it, write report.md and PNGs: (run, findings, report, plots).
    Raises RunDirError on bad input."""
    run = load_run(run_dir)
    h = History(run.rows)
    if not len(h):
        raise RunDirError(f"{run.path / METRICS}: {len(run.rows)} rows but none is a training step "
                          f"(none has {', '.join(TRAIN_KEYS[:3])}, ...)")
    findings = diagnose(h, settings, run.config)
    written: dict[str, Path] = {}
    if plots:
        from pipeline.report.plots import plot_run  # lazy: imports matplotlib

        written = plot_run(run.rows, run.path, findings, run.config)
    report = write_report(run, h, findings, written)
    return run, findings, report, written


def input_warnings(run: Run) -> list[str]:
    """What the command says on stderr about its input, one line each naming the file: skipped broken
    lines and rows, an unreadable config, skipped held-out answers."""
    return list(run.warnings)


def findings_text(run: Run, findings: list[Finding], report: Path, plots: Mapping[str, Path]) -> str:
    """What `synth-grpo doctor` prints: the run in one line, each finding with why and what to change, the files."""
    steps = [int(r["step"]) for r in run.rows if number(r.get("step")) is not None]
    span = f", steps {min(steps)}-{max(steps)}" if steps else ""
    resolved = sum(f.resolved for f in findings)
    out = [f"{run.path}: {len(run.rows)} metric lines{span}; {len(findings)} finding(s)"
           + (f", {resolved} of them resolved before the end" if resolved else "")]
    for f in findings:
        out += ["", f.format()]
    if not findings:
        out.append("no rule fired")
    out += ["", f"report: {report}", "plots:  " + ", ".join(str(p) for p in plots.values())]
    return "\n".join(out)


def report_section(run_dir: Path, warnings: list[str] | None = None) -> list[str]:
    """Markdown for the doctor's report.md: the best and worst answers of the first and last evaluation.
    A line about skipped rows goes to ``warnings`` (and into the section)."""
    rows, skipped = read_answers(run_dir)
    if skipped and warnings is not None:
        warnings.append(skipped)
    evals = by_evaluation(rows)
    if not evals:
        return ["", "## Held-out samples", "", skipped + "."] if skipped else []
    steps = sorted(evals)
    picked = [steps[0]] + ([steps[-1]] if steps[-1] != steps[0] else [])
    out = ["", "## Held-out samples", "",
           f"The best and worst {SHOWN} held-out answers of the first and last evaluation ({len(steps)} in all), "
           f"each with its component scores and its `eval/score` (`{EVAL_SAMPLES}` holds every answer of every evaluation)."]
    if skipped:
        out += ["", skipped + "."]
    for step in picked:
        answers = evals[step]
        mean = sum(float(r["score"]) for r in answers) / len(answers)
        out += ["", f"### Step {step} ({len(answers)} answers, mean score {mean:.3f})", ""] + markdown(step, answers)
    return out
