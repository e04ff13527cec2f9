"""bench.ablation: its arms are the config deltas they say, its statistics are paired, and its quick mode
(two arms, one seed, 4 steps) trains once and is continued from the kept runs without training again."""

from __future__ import annotations

import gzip
import json

import pytest

import bench.ablation as ablation
from bench.ablation_report import paired_difference
from pipeline.config import load_config


def test_each_arm_changes_only_its_fix_from_its_reference():
    arms = ablation.ARMS
    assert len([a for a in arms.values() if a.family == "leave-one-out"]) == len(ablation.FIXES) == 8
    assert len([a for a in arms.values() if a.family == "add-one"]) == 8
    # ours as shipped lacks two fixes: their leave-one-out arm turns them on
    assert {"ours+clip", "ours+dynamic", "ours-eos", "ours-judge", "baseline+cap"} <= set(arms)
    for arm in arms.values():
        if arm.family == "reference":
            continue
        ref = load_config(ablation.RUNS[arm.base], [])
        cfg = load_config(ablation.RUNS[arm.base], list(arm.delta))
        changed = {k for k, v in _fields(cfg).items() if _fields(ref).get(k) != v}
        assert changed, f"{arm.name}: its delta changes nothing"
        assert all(k.split(".")[0] in ("rewards", "judge", "grpo", "generation", "optimization") for k in changed), (arm.name, changed)
    loo = load_config(ablation.RUNS["ours"], list(arms["ours-cap"].delta))
    assert loo.generation.max_completion_length == 8 and loo.generation.length_schedule == [[20, 12]]
    add = load_config(ablation.RUNS["baseline"], list(arms["baseline+cap"].delta))
    ours = load_config(ablation.RUNS["ours"], [])
    assert add.generation.max_completion_length == "adaptive" and add.generation.adaptive == ours.generation.adaptive
    assert load_config(ablation.RUNS["baseline"], list(arms["baseline+judge"].delta)).judge.model == ours.judge.model


def _fields(cfg) -> dict:
    from pipeline.config.schema import field_values

    return field_values(cfg)


def test_paired_difference_takes_the_larger_of_seed_spread_and_evaluation_error():
    def run(gain, se_last, first=0.5):
        return {"gain": gain, "first": first, "se_first": 0.01, "se_last": se_last}

    ref = {1: run(0.01, 0.01), 2: run(0.02, 0.01), 3: run(0.03, 0.01)}
    same_shift = {s: run(r["gain"] + 0.05, 0.01) for s, r in ref.items()}  # no spread: the evaluation's error
    diff, se, n = paired_difference(same_shift, ref)
    assert n == 3 and diff == pytest.approx(0.05) and se == pytest.approx((3 * 2 * 0.01 ** 2) ** 0.5 / 3)
    noisy = {1: run(0.31, 0.001), 2: run(-0.18, 0.001), 3: run(0.03, 0.001)}  # spread dominates
    diff, se, _ = paired_difference(noisy, ref)
    assert diff == pytest.approx(0.1 / 3) and se > 0.1
    assert paired_difference({4: run(0.1, 0.01)}, ref) == (None, None, 0)  # no shared seed, no difference


def test_bad_arguments_exit_2_naming_the_option(capsys, tmp_path):
    for argv, named in ((["--arms", "ours", "nonsense"], "--arms: unknown nonsense"), (["--steps", "0"], "--steps"),
                        (["--seeds", "3", "3"], "--seeds")):
        with pytest.raises(SystemExit) as exit_:
            ablation.main(argv)
        assert exit_.value.code == 2 and named in capsys.readouterr().err
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert ablation.main(["--report-only", "--results", str(tmp_path), "--figure", str(a_file / "forest.png")]) == 2
    assert "a-file" in capsys.readouterr().err  # the figure's folder is a file: named, no traceback
    with pytest.raises(SystemExit) as exit_:
        ablation.main(["--results", str(a_file)])
    assert exit_.value.code == 2 and "--results: " in capsys.readouterr().err  # before any run is trained


@pytest.mark.slow
def test_quick_mode_trains_two_arms_once_and_continues_from_the_kept_runs(ray_local, tiny_policy, tmp_path, capsys):
    argv = ["--arms", "ours", "ours-eos", "--seeds", "1", "--steps", "4", "--eval-every", "4", "--eval-samples", "2",
            "--eval-budget", "24", "--results", str(tmp_path), "--json"]
    assert ablation.main(argv) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert out.err.count("] ours") == 2  # both trained: one progress line each
    for arm in ("ours", "ours-eos"):
        r = result[arm]
        assert set(r) >= {"gain", "gain_se", "diff", "diff_se", "eos_rate", "mean_length", "entropy_retained",
                          "findings", "sec_per_step", "delta"}
        assert r["gain"] is not None and r["gain_se"] > 0 and r["sec_per_step"] > 0 and 0 <= r["eos_rate"] <= 1
    assert result["ours-eos"]["diff"] is not None and result["ours-eos"]["delta"] == list(ablation.ARMS["ours-eos"].delta)
    # the delta reached the run: TRL's reward is the weighted sum of the components, the EOS one weighted 1 or 0
    for arm, eos_weight in (("ours", 1.0), ("ours-eos", 0.0)):
        kept = json.loads(gzip.decompress((tmp_path / "steps-4" / arm / "seed-1.json.gz").read_bytes()))
        rows = [r for r in kept["rows"] if "reward" in r and "rewards/eos/mean" in r]
        assert len(rows) == 4
        for r in rows:
            weighted = (0.3 * r["rewards/rouge_l/mean"] + 0.2 * r["rewards/length/mean"] + 0.5 * r["rewards/judge/mean"]
                        + eos_weight * r["rewards/eos/mean"])
            assert r["reward"] == pytest.approx(weighted, abs=1e-4), (arm, r["step"])
    # continued: nothing trains again and the figures are the same
    assert ablation.main(argv) == 0
    again = capsys.readouterr()
    assert "] ours" not in again.err and json.loads(again.out)["ours-eos"]["diff"] == result["ours-eos"]["diff"]
    # a kept run is never mixed with other settings
    assert ablation.main([*argv[:-3], "--eval-samples", "3", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "seed-1.json.gz was measured with other settings" in err and "another --results folder" in err
