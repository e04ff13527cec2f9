"""`synth-grpo compare`: plots per metric family, the start/best/final table checked against the
metrics files, config differences, and bad input (exit 2 naming the folder)."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path


from pipeline.cli.main import main
from pipeline.config import REWARD_COMPONENTS, load_config


def write_run(root: Path, name: str, seed: int, steps: int, overrides: list[str]) -> Path:
    """A run directory in the trainer's format: TRL metric rows, eval rows, the final summary row."""
    rng = random.Random(seed)
    d = root / name
    d.mkdir(parents=True)
    cfg = load_config(None, [f"output.run_name={name}", f"output.root={root}", *overrides])
    (d / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    lines = [json.dumps({"step": 0, "eval/score": 0.3 + rng.random() / 10, **{f"eval/{c}": rng.random() for c in REWARD_COMPONENTS},
                         "eval/eos_rate": rng.random(), "eval/mean_length": 12.0})]
    cap = 8
    for s in range(1, steps + 1):
        cap += 8 if s % 4 == 0 else 0
        lines.append(json.dumps({
            "step": s, "loss": rng.random(), "reward": rng.random(), "reward_std": rng.random() / 5,
            **{f"rewards/{c}/mean": rng.random() for c in REWARD_COMPONENTS},
            "entropy": 2.5 - s / steps + rng.random() / 10, "completions/clipped_ratio": rng.random(),
            "completions/mean_length": 5 + rng.random() * 10, "generation/max_completion_length": cap,
        }))
        if s % 5 == 0:
            lines.append(json.dumps({"step": s, "eval/score": rng.random(), "eval/eos_rate": rng.random()}))
    lines.append("{broken")  # a run killed mid-write
    lines.append(json.dumps({"step": steps, "train_runtime": 12.0, "train_loss": 0.1}))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d


def file_values(run_dir: Path, key: str) -> list[tuple[int, float]]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row.get(key), (int, float)):
            out.append((row["step"], float(row[key])))
    return out


def parse_table(md: str) -> dict[tuple[str, str], tuple[str, str, str]]:
    cells = {}
    for line in md.splitlines():
        m = re.match(r"\| `([^`]+)` \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", line)
        if m and not m.group(2).startswith("`"):
            cells[(m.group(1), m.group(2).strip())] = (m.group(3).strip(), m.group(4).strip(), m.group(5).strip())
    return cells


def test_compare_two_runs_table_matches_metrics_files(tmp_path, capsys):
    a = write_run(tmp_path / "runs", "seedlike", 1, 20, ["optimization.learning_rate=5e-5", "generation.num_generations=4"])
    b = write_run(tmp_path / "runs", "ours", 2, 24, [])
    out = tmp_path / "cmp"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0

    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["clipped.png", "entropy.png", "eval.png", "reward.png"]
    assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / p).stat().st_size > 5000 for p in pngs)

    md = (out / "compare.md").read_text()
    table = parse_table(md)
    directions = {"reward": max, "rewards/judge/mean": max, "eval/score": max, "completions/clipped_ratio": min,
                  "entropy": None, "generation/max_completion_length": None}
    for run in (a, b):
        for key, pick in directions.items():
            vals = file_values(run, key)
            start, best, final = table[(key, run.name)]
            assert math.isclose(float(start), vals[0][1], rel_tol=1e-3), (key, run.name, start, vals[0])
            assert final == f"{vals[-1][1]:.4g} ({vals[-1][0]})"
            if pick is None:
                assert best == "-"
            else:
                step, value = pick(vals, key=lambda sv: sv[1])
                assert best == f"{value:.4g} ({step})", (key, run.name)
    # The final summary row (train_runtime) is not a training step: the last reward is the last step's.
    assert table[("reward", "ours")][2].endswith("(24)")

    diffs = md.split("## Config differences")[1]
    ours_lr = load_config(None).optimization.learning_rate  # the tiny default's
    assert f"`optimization.learning_rate` | `5e-05` | `{ours_lr}`" in diffs.replace("5.0e-05", "5e-05")
    assert "`generation.num_generations` | `4` | `8`" in diffs
    assert "output.run_name" not in diffs and "output.root" not in diffs
    assert "(2)" in diffs.splitlines()[0]


def test_compare_folder_without_metrics_exits_2_naming_it(tmp_path, capsys):
    good = write_run(tmp_path, "good", 3, 5, [])
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    assert main(["compare", str(good), str(empty), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "synth-grpo compare:" in err and "no metrics.jsonl" in err and str(empty) in err
    assert not (tmp_path / "o" / "compare.md").exists()
    assert main(["compare", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
