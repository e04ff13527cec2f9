"""PNG plots of a run's metrics for the doctor's report, the curves the baseline run's author had to read.

Uses matplotlib's object API on the Agg canvas (no pyplot, no global backend switch), so it
works headless and inside a process that already imported pyplot with another backend.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Iterable, Mapping

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pipeline.config import scheduled_length
from pipeline.diagnosis.rules import config_caps
from pipeline.rundir.metric_names import CAP_METRIC, number
from pipeline.rundir.files import write_atomic

# which findings are marked on which plot
_MARKS = {
    "reward": ("reward_plateau", "judge_rouge_divergence"),
    "entropy": ("entropy_collapse",),
    "length": ("never_stops", "length_schedule_ignored"),
    "clip_ratio": ("no_effective_update", "zero_variance_groups"),
}


def series(rows: Iterable[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that have a finite number for key; a row without a step
    takes the previous row's step + 1."""
    xs, ys, step = [], [], -1.0
    for r in rows:
        s, v = number(r.get("step")), number(r.get(key))
        step = s if s is not None else step + 1
        if v is not None:
            xs.append(step)
            ys.append(v)
    return xs, ys


PLOT_BOUND = 1e100  # values beyond it are not drawn: matplotlib's axis arithmetic overflows near 1e308


def plot_series(rows: Iterable[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """``series`` without the values no plot can show (beyond ±PLOT_BOUND, a diverged or corrupt log)."""
    pairs = [(x, y) for x, y in zip(*series(rows, key)) if abs(y) <= PLOT_BOUND]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _line(ax, rows, key, label=None, **kw) -> bool:
    xs, ys = plot_series(rows, key)
    if xs:
        ax.plot(xs, ys, label=label or key, linewidth=1, **kw)
    return bool(xs)


def _mark(ax, findings, names) -> None:
    for f in findings:
        if f.rule in names:
            ax.axvline(f.first_step, color="crimson", linestyle=":", linewidth=1)
            if getattr(f, "resolved", False):  # it held from first_step to last_step, then stopped
                ax.axvspan(f.first_step, f.last_step, color="crimson", alpha=0.08)
            ax.annotate(f.rule, (f.first_step, 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                        color="crimson", va="top", ha="right")


def _schedule(ax, rows, config) -> None:
    start, sched = config_caps(config)
    xs = plot_series(rows, "completions/max_length")[0]
    sched = [(s, n) for s, n in sched if abs(n) <= PLOT_BOUND]
    if not sched or start is None or abs(start) > PLOT_BOUND or not xs:
        return
    steps = sorted({xs[0], xs[-1], *(float(s) for s, _ in sched if xs[0] <= s <= xs[-1])})
    ax.step(steps, [scheduled_length(sched, x, start) for x in steps], where="post", color="black", linestyle="--",
            linewidth=1, label="cap (config length_schedule)")


def save_png(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return write_atomic(path, buf.getvalue())  # a symlink planted at path is replaced, not followed


def _finish(ax, title: str, findings, marks: str, xlabel: bool = True, twin=None) -> None:
    """Title, the findings of `_MARKS[marks]` marked, one legend of ax's lines (and twin's), grid, step axis."""
    ax.set_title(title)
    _mark(ax, findings, _MARKS[marks])
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None:
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    if xlabel:
        ax.set_xlabel("step")


def plot_run(rows: list[Mapping[str, Any]], out_dir: str | Path, findings: Iterable[Any] = (),
             config: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Write reward.png, entropy.png, length.png and clip_ratio.png (each only if it has data);
    returns {name: path}. Findings are marked where they first fired; without a logged cap, the
    config's length schedule is drawn, so a cap that never reached generation shows."""
    out, findings = Path(out_dir), list(findings)
    keys = {k for r in rows for k in r}
    plotters = {"reward": _plot_reward, "entropy": _plot_entropy, "length": _plot_length, "clip_ratio": _plot_clip_ratio}
    written: dict[str, Path] = {}
    for name, plot in plotters.items():
        fig = plot(rows, keys, findings, config)
        if fig is not None:
            written[name] = save_png(fig, out / f"{name}.png")
    return written


def _plot_reward(rows, keys: set[str], findings: list, config) -> Figure | None:
    comps = sorted(k for k in keys if k.startswith("rewards/") and k.endswith("/mean") and len(k) <= 100)[:12]
    if "reward" in keys or comps:
        fig = Figure(figsize=(9, 6))
        ax1, ax2 = fig.subplots(2, 1, sharex=True)
        _line(ax1, rows, "reward", color="black")
        xs, ys = plot_series(rows, "reward")
        sx, sd = plot_series(rows, "reward_std")
        std = dict(zip(sx, sd))
        if xs and std:
            pairs = [(x, y, std[x]) for x, y in zip(xs, ys) if x in std]
            ax1.fill_between([p[0] for p in pairs], [p[1] - p[2] for p in pairs], [p[1] + p[2] for p in pairs],
                             color="grey", alpha=0.2, label="± reward_std")
        _line(ax1, rows, "eval/score", marker="o", markersize=3)
        _finish(ax1, "total reward", findings, "reward", xlabel=False)
        for k in comps:
            _line(ax2, rows, k, label=k.split("/")[1])
        _finish(ax2, "reward components (rewards/<name>/mean)", findings, "reward")
        return fig
    return None


def _plot_entropy(rows, keys: set[str], findings: list, config) -> Figure | None:
    if "entropy" in keys:
        fig = Figure(figsize=(9, 3.5))
        ax = fig.subplots()
        _line(ax, rows, "entropy", color="tab:purple")
        if "entropy_coef" in keys:
            _line(ax.twinx(), rows, "entropy_coef", color="tab:grey", linestyle="--")
        _finish(ax, "entropy", findings, "entropy")
        return fig
    return None


def _plot_length(rows, keys: set[str], findings: list, config) -> Figure | None:
    if keys & {"completions/mean_length", "completions/max_length", "completions/clipped_ratio"}:
        fig = Figure(figsize=(9, 4))
        ax = fig.subplots()
        _line(ax, rows, "completions/mean_length", label="mean length")
        _line(ax, rows, "completions/max_length", label="max length")
        if not _line(ax, rows, CAP_METRIC, label="cap (generation)", color="black", linestyle="--"):
            _schedule(ax, rows, config)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("tokens")
        ax2 = ax.twinx()
        _line(ax2, rows, "completions/clipped_ratio", label="clipped ratio", color="crimson", alpha=0.6)
        ax2.set_ylim(-0.05, 1.05)
        ax2.set_ylabel("clipped ratio")
        _finish(ax, "completion length and clipped ratio", findings, "length", twin=ax2)
        return fig
    return None


def _plot_clip_ratio(rows, keys: set[str], findings: list, config) -> Figure | None:
    clip_keys = [k for k in ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean") if k in keys]
    if clip_keys or keys & {"reward_std", "frac_reward_zero_std"}:
        fig = Figure(figsize=(9, 6))
        ax1, ax2 = fig.subplots(2, 1, sharex=True)
        for k in clip_keys:
            _line(ax1, rows, k, label=k.split("/")[1])
        _finish(ax1, "GRPO clip ratios", findings, "clip_ratio", xlabel=False)
        _line(ax2, rows, "reward_std")
        _line(ax2, rows, "frac_reward_zero_std")
        _finish(ax2, "group signal", findings, "clip_ratio")
        return fig
    return None
