"""`synth-grpo compare RUN_DIR [RUN_DIR ...]`: runs side by side, one PNG per metric family plus
a Markdown table of start/best/final values and the config differences between the runs.

Reads local run directories through the doctor's reader (same errors for bad input, exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from pipeline.errors import cli_error
from pipeline.config import REWARD_COMPONENTS
from pipeline.report.run_reader import RunDirError, load_run
from pipeline.rundir.metric_names import CAP_METRIC, is_train_row
from pipeline.report.plots import plot_series, save_png, series
from pipeline.rundir.files import write_atomic

# metric -> "max" (higher is better), "min" (lower is better) or None (no better direction)
TABLE_METRICS: dict[str, str | None] = {
    "reward": "max",
    **{f"rewards/{c}/mean": "max" for c in REWARD_COMPONENTS},
    "eval/score": "max",
    **{f"eval/{c}": "max" for c in REWARD_COMPONENTS},
    "eval/eos_rate": "max",
    "entropy": None,
    "completions/clipped_ratio": "min",
    "completions/mean_length": None,
    CAP_METRIC: None,
}
# config keys that differ by construction between any two runs
IGNORED_CONFIG_KEYS = ("output.root", "output.run_name")
MAX_DIFF_ROWS = 200  # config differences listed in compare.md


@dataclass
class RunData:
    name: str
    path: Path
    rows: list[dict[str, Any]]  # training-step rows and eval rows, in file order
    config: dict[str, Any] | None


def load_runs(run_dirs: list[str | Path]) -> list[RunData]:
    """Each run directory's metrics and config; raises RunDirError naming the first bad one."""
    runs, names = [], set()
    for d in run_dirs:
        run = load_run(d)
        name = run.path.name if run.path.name not in names else str(run.path)
        names.add(name)
        rows = [r for r in run.rows if is_train_row(r) or "eval/score" in r]
        runs.append(RunData(name, run.path, rows, run.config))
    return runs


def stats(rows: list[Mapping[str, Any]], key: str, direction: str | None) -> dict[str, Any] | None:
    """start, best (with its step) and final of one metric over a run's rows; None when never logged."""
    xs, ys = series(rows, key)
    if not xs:
        return None
    pick = {"max": max, "min": min}.get(direction)
    best_i = pick(range(len(ys)), key=lambda i: ys[i]) if pick else None
    return {
        "start": ys[0], "start_step": int(xs[0]), "final": ys[-1], "final_step": int(xs[-1]),
        "best": ys[best_i] if best_i is not None else None, "best_step": int(xs[best_i]) if best_i is not None else None,
    }


def flatten(d: Mapping[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(runs: list[RunData]) -> dict[str, list[Any]]:
    """dotted key -> each run's value, for the keys whose values are not all equal."""
    flat = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*flat)) if flat else []
    missing = object()
    diffs = {}
    for k in keys:
        if k in IGNORED_CONFIG_KEYS:
            continue
        vals = [f.get(k, missing) for f in flat]
        if any(v != vals[0] for v in vals[1:]):
            diffs[k] = ["(absent)" if v is missing else v for v in vals]
    return diffs


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _cell(v: Any, limit: int = 80) -> str:
    """A config key or value for a table cell: one line, at most ``limit`` characters."""
    s = " ".join(str(v)[: 4 * limit].split()).replace("|", "\\|").replace("`", "'")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def markdown_table(runs: list[RunData], images: Mapping[str, Path] | None = None) -> str:
    out = ["# Run comparison", ""]
    out += [f"- **{r.name}**: `{r.path}` ({sum(1 for x in r.rows if is_train_row(x))} logged steps, "
            f"{sum(1 for x in r.rows if 'eval/score' in x)} evaluations)" for r in runs]
    out += ["", "## Start, best and final values", "",
            "Best is the highest value (the lowest for the clipped ratio; none where neither direction is better), "
            "with its step.", "", "| metric | run | start | best (step) | final (step) |", "|---|---|---|---|---|"]
    for key, direction in TABLE_METRICS.items():
        for r in runs:
            s = stats(r.rows, key, direction)
            if s is None:
                continue
            best = "-" if s["best"] is None else f"{_num(s['best'])} ({s['best_step']})"
            out.append(f"| `{key}` | {r.name} | {_num(s['start'])} | {best} | {_num(s['final'])} ({s['final_step']}) |")
    diffs = config_differences(runs)
    out += ["", f"## Config differences ({len(diffs)})", ""]
    if not diffs:
        out.append("The runs' configs are the same" + (" (or missing)" if any(r.config is None for r in runs) else "") + ".")
    else:
        out += ["| field | " + " | ".join(r.name for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]
        out += [f"| `{_cell(k)}` | " + " | ".join(f"`{_cell(v)}`" for v in vals) + " |"
                for k, vals in list(diffs.items())[:MAX_DIFF_ROWS]]
        if len(diffs) > MAX_DIFF_ROWS:
            out += ["", f"... and {len(diffs) - MAX_DIFF_ROWS} more fields."]
    if images:
        out += ["", "## Plots", ""] + [f"![{name}]({p.name})" for name, p in images.items()]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- plots


def plot_families(runs: list[RunData], out_dir: Path) -> dict[str, Path]:
    """reward.png (total and each component), entropy.png, clipped.png (clipped ratio and the cap),
    eval.png (eval/score); one line per run, each only when some run logged it."""
    from matplotlib.figure import Figure

    colors = [f"C{i}" for i in range(10)]
    keys = {k for r in runs for row in r.rows for k in row}
    written: dict[str, Path] = {}

    def save(fig, name: str) -> None:
        written[name] = save_png(fig, out_dir / f"{name}.png")

    def lines(ax, key: str, title: str | None = None, **kw) -> None:
        for i, r in enumerate(runs):
            xs, ys = plot_series(r.rows, key)
            if xs:
                ax.plot(xs, ys, color=colors[i % 10], label=r.name, linewidth=1, **kw)
        if title:
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)

    def panel(key: str, title: str, height: float = 3.5, **kw):
        """One metric, a line per run, with its legend: (figure, axes)."""
        fig = Figure(figsize=(9, height))
        ax = fig.subplots()
        lines(ax, key, title, **kw)
        ax.legend(fontsize=7)
        return fig, ax

    comps = [f"rewards/{c}/mean" for c in REWARD_COMPONENTS if f"rewards/{c}/mean" in keys]
    if "reward" in keys or comps:
        panels = (["reward"] if "reward" in keys else []) + comps
        fig = Figure(figsize=(10, 2.6 * ((len(panels) + 1) // 2)))
        axes = fig.subplots((len(panels) + 1) // 2, 2, squeeze=False).ravel()
        for ax, key in zip(axes, panels):
            lines(ax, key, key)
        for ax in axes[len(panels):]:
            ax.set_visible(False)
        axes[0].legend(fontsize=7)
        save(fig, "reward")
    if "entropy" in keys:
        save(panel("entropy", "entropy")[0], "entropy")
    if "completions/clipped_ratio" in keys:
        fig, ax = panel("completions/clipped_ratio", "clipped ratio (solid) and max completion length (dashed)", 4)
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel("clipped ratio")
        if CAP_METRIC in keys:
            ax2 = ax.twinx()
            lines(ax2, CAP_METRIC, linestyle="--")
            ax2.set_ylabel("cap (tokens)")
        ax.set_xlabel("step")
        save(fig, "clipped")
    if "eval/score" in keys:
        fig, ax = panel("eval/score", "held-out eval/score", marker="o", markersize=3)
        ax.set_xlabel("step")
        save(fig, "eval")
    return written


def compare(run_dirs: list[str | Path], out_dir: str | Path) -> tuple[Path, dict[str, Path]]:
    """Write the plots and compare.md into out_dir; (table path, {family: png})."""
    runs = load_runs(run_dirs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = plot_families(runs, out)
    return write_atomic(out / "compare.md", markdown_table(runs, images)), images


def compare_cli(args) -> int:
    """0 written, 2 bad input (a missing or empty run directory, named)."""
    out = Path(args.out) if args.out else Path("compare-" + "-vs-".join(Path(d).name or "run" for d in args.run_dirs))
    try:
        table, images = compare(args.run_dirs, out)
    except RunDirError as e:
        return cli_error("compare", e)
    except OSError as e:  # could not write the table or plots
        return cli_error("compare", f"could not write into {str(out)!r}: {e}", code=1)
    print(f"table: {table}")
    print("plots: " + ", ".join(str(p) for p in images.values()))
    return 0
