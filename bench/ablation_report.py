"""The ablation's statistics, table and forest plot, from the kept runs' metrics rows.

A gain is the last held-out ``eval/score`` minus the first. Arms share seeds, and every arm's first
evaluation of a seed is the same policy (LoRA starts as the identity) under the same sampler, so an
arm's difference to its reference is paired seed by seed. Its standard error is the larger of two:
the spread of the paired differences over seeds (sd / sqrt(n): training noise included) and the
evaluation's own sampling error (from ``eval/score_stderr``); with three seeds the spread alone can
come out small by chance. A difference is called significant only beyond two standard errors.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path

from bench.common import machine
from bench.pathologies import RUNS, TASK, fmt_value, summarize_run
from pipeline.config import load_config


def first_last_eval(rows: list[dict]) -> tuple[dict, dict] | None:
    evals = [r for r in rows if "eval/score" in r]
    return (evals[0], evals[-1]) if len(evals) > 1 else None


def run_figures(kept: dict) -> dict:
    """One run's figures: its gain and the evaluation's error of its first and last score."""
    cfg = load_config(RUNS[kept["base"]], [*kept["delta"], f"optimization.max_steps={kept['steps']}", *TASK])
    s = summarize_run(kept["rows"], cfg, kept["seconds"])
    ends = first_last_eval(kept["rows"])
    first, last = ends if ends else ({}, {})
    return {"gain": s["eval_score_gain"], "first": first.get("eval/score"), "last": last.get("eval/score"),
            "se_first": first.get("eval/score_stderr"), "se_last": last.get("eval/score_stderr"),
            "eos_rate": last.get("eval/eos_rate"), "mean_length": last.get("eval/mean_length"),
            "entropy_retained": s["entropy_retained"], "entropy_start": s["entropy_start"],
            "entropy_max": max((r["entropy"] for r in kept["rows"] if isinstance(r.get("entropy"), float)), default=None),
            "findings": s["findings"], "sec_per_step": s["sec_per_step"], "kl_to_initial": s["kl_to_initial_last"]}


def _se(values: list[float], eval_se: float) -> float | None:
    if not values:
        return None
    spread = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return max(spread, eval_se)


def gain_over_seeds(per_seed: dict[int, dict]) -> tuple[float | None, float | None]:
    ok = [f for f in per_seed.values() if f["gain"] is not None and None not in (f["se_first"], f["se_last"])]
    gains = [f["gain"] for f in ok]
    eval_se = math.sqrt(sum(f["se_first"] ** 2 + f["se_last"] ** 2 for f in ok)) / len(ok) if ok else 0.0
    return (statistics.fmean(gains) if gains else None), _se(gains, eval_se)


def paired_difference(arm: dict[int, dict], ref: dict[int, dict]) -> tuple[float | None, float | None, int]:
    """Mean over shared seeds of (arm's gain - reference's gain), its standard error, the seeds used."""
    seeds = [s for s in arm if s in ref and None not in (arm[s]["gain"], ref[s]["gain"], arm[s]["se_last"], ref[s]["se_last"])]
    diffs, var = [], 0.0
    for s in seeds:
        a, r = arm[s], ref[s]
        diffs.append(a["gain"] - r["gain"])
        var += a["se_last"] ** 2 + r["se_last"] ** 2
        if a["first"] != r["first"]:  # not the same first evaluation: its sampling error counts too
            var += (a["se_first"] or 0) ** 2 + (r["se_first"] or 0) ** 2
    if not diffs:
        return None, None, 0
    return statistics.fmean(diffs), _se(diffs, math.sqrt(var) / len(diffs)), len(diffs)


def _mean(per_seed: dict[int, dict], key: str) -> float | None:
    xs = [f[key] for f in per_seed.values() if isinstance(f.get(key), (int, float))]
    return statistics.fmean(xs) if xs else None


def report(runs: dict[str, dict[int, dict]], names: list[str], arms: dict, settings, figure: str | None = None) -> dict:
    """{arm: figures over seeds, the difference to its reference}, and the forest plot if asked."""
    figures = {n: {seed: run_figures(k) for seed, k in runs[n].items()} for n in names}
    out: dict = {}
    for n in names:
        arm, per = arms[n], figures[n]
        gain, gain_se = gain_over_seeds(per)
        diff = diff_se = None
        if arm.family != "reference" and arm.base in figures:
            diff, diff_se, _ = paired_difference(per, figures[arm.base])
        found = Counter(rule for f in per.values() for rule in f["findings"])
        out[n] = {"family": arm.family, "reference": arm.base if arm.family != "reference" else None,
                  "delta": list(arm.delta), "seeds": sorted(per), "gain": gain, "gain_se": gain_se,
                  "diff": diff, "diff_se": diff_se,
                  "significant": bool(diff is not None and diff_se and abs(diff) > 2 * diff_se),
                  "eos_rate": _mean(per, "eos_rate"), "mean_length": _mean(per, "mean_length"),
                  "entropy_retained": _mean(per, "entropy_retained"), "entropy_max": _mean(per, "entropy_max"),
                  "kl_to_initial": _mean(per, "kl_to_initial"),
                  "findings": {rule: f"{k}/{len(per)}" for rule, k in sorted(found.items())},
                  "sec_per_step": _mean(per, "sec_per_step"),
                  "per_seed": {s: {k: f[k] for k in ("gain", "eos_rate", "mean_length", "entropy_retained", "findings")}
                               for s, f in sorted(per.items())}}
    if figure:
        out["figure"] = str(forest_plot(out, Path(figure), settings))
    return out


def forest_plot(result: dict, path: Path, settings) -> Path:
    """Each arm's difference to its reference with a +-2 SE bar, one panel per family."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    families = [("leave-one-out", "ours with one fix reverted (or turned on): difference to ours"),
                ("add-one", "the baseline with one fix applied: difference to the baseline")]
    fig = Figure(figsize=(11, 5.5))
    FigureCanvasAgg(fig)
    for i, (family, title) in enumerate(families):
        ax = fig.add_subplot(1, 2, i + 1)
        rows = [(n, r) for n, r in result.items() if isinstance(r, dict) and r.get("family") == family and r["diff"] is not None]
        for y, (name, r) in enumerate(reversed(rows)):
            color = "tab:red" if r["significant"] and r["diff"] < 0 else "tab:green" if r["significant"] else "tab:gray"
            ax.errorbar(r["diff"], y, xerr=2 * r["diff_se"], fmt="o", color=color, capsize=3)
        ax.set_yticks(range(len(rows)), [n for n, _ in reversed(rows)])
        ax.axvline(0, color="black", linewidth=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(6))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("held-out eval/score gain, difference (±2 SE)")
    seeds = sorted({s for r in result.values() if isinstance(r, dict) for s in r.get("seeds", [])})
    fig.suptitle(f"Ablation on the tiny policy: {settings.steps} steps, seeds {seeds}, eval at {settings.eval_budget} tokens x "
                 f"{settings.eval_samples} samples ({machine()}); coloured beyond 2 SE", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def print_table(result: dict, names: list[str]) -> None:
    """One line per arm: what changed, its gain, its difference to its reference and the run's symptoms."""
    m = result["meta"]
    print(f"ablation, tiny policy, {m['steps']} steps, seeds {m['seeds']}, eval at {m['eval_budget']} tokens x "
          f"{m['eval_samples']} samples every {m['eval_every']} steps, {m['machine']}")
    head = f"{'arm':18} {'seeds':>5} {'gain ± se':>16} {'diff ± se':>18} {'EOS':>5} {'len':>5} {'ent.ret':>7} {'s/step':>6}  findings"
    print(head)
    for n in names:
        r = result[n]
        diff = "" if r["diff"] is None else f"{r['diff']:+.3f} ± {r['diff_se']:.3f}{' *' if r['significant'] else '  '}"
        gain = "n/a" if r["gain"] is None else f"{r['gain']:+.3f} ± {r['gain_se']:.3f}"
        found = ", ".join(f"{k} {v}" for k, v in r["findings"].items()) or "none"
        print(f"{n:18} {len(r['seeds']):>5} {gain:>16} {diff:>18} {fmt_value(r['eos_rate']):>5} {fmt_value(r['mean_length']):>5} "
              f"{fmt_value(r['entropy_retained']):>7} {fmt_value(r['sec_per_step']):>6}  {found}")
    print("* beyond 2 SE. Deltas:")
    for n in names:
        if result[n]["delta"]:
            print(f"  {n}: {' '.join(result[n]['delta'])}")


def markdown_table(result: dict, names: list[str]) -> str:
    """The table as docs/ablation.md holds it."""
    def pm(v, se, bold=False):
        if v is None:
            return "n/a"
        text = f"{v:+.3f} ± {se:.3f}"
        return f"**{text}**" if bold else text

    lines = ["| arm | seeds | gain ± se | difference to its reference ± se | held-out EOS rate | answer length | entropy retained | s/step | findings (share of seeds) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        r = result[n]
        diff = "" if r["family"] == "reference" else pm(r["diff"], r["diff_se"], r["significant"])
        found = ", ".join(f"`{k}` {v}" for k, v in r["findings"].items()) or "none"
        lines.append(f"| `{n}` | {len(r['seeds'])} | {pm(r['gain'], r['gain_se'])} | {diff} | {fmt_value(r['eos_rate'])} | "
                     f"{fmt_value(r['mean_length'])} | {fmt_value(r['entropy_retained'])} | {fmt_value(r['sec_per_step'])} | {found} |")
    return "\n".join(lines)
