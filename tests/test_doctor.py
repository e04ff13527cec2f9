"""Training health rules, live callback, report/plots and the `doctor` CLI, on synthetic metric
streams: one that reproduces the baseline run's run, one healthy, one the size of a tiny run."""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from pipeline.report.doctor import RULES, History, RuleSettings, diagnose, doctor_cli
from pipeline.rundir.files import read_jsonl

REPO = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# The baseline run's settings (see configs/seed-baseline.yaml and the seed notes): self-judge, 4 generations,
# LR 5e-5, no EOS reward, no entropy control, 160 tokens raised to 256 at step 500, 18,000 steps.
SEED_CONFIG = {
    "generation": {"num_generations": 4, "temperature": 1.0, "max_completion_length": 160, "length_schedule": [[500, 256]]},
    "rewards": {"weights": {"rouge_l": 0.3, "length": 0.2, "judge": 0.5, "eos": 0.0}, "eos_bonus": 0.0},
    "judge": {"backend": "self"},
    "grpo": {"adaptive_entropy": False, "entropy_target": 1.0, "epsilon_high": 0.2},
    "optimization": {"learning_rate": 5e-5, "max_steps": 18000},
    "logging": {"logging_steps": 1},
}


def seed_stream(n=2000, raise_at=500, tau=200.0, seed=0, log_cap=False, cap=160):
    """Reward 0.33 -> 0.40 then flat (the judge rising, ROUGE-L falling under it), entropy 1.5 -> 0.2,
    clipped ratio 1.0, clip ratios 0, reward_std < 0.01, max length stuck at the first cap."""
    rnd = random.Random(seed)
    rows = []
    for step in range(1, n + 1):
        g = 1 - math.exp(-step / tau)
        judge = 0.40 + 0.23 * g + rnd.gauss(0, 0.004)
        rouge = 0.30 - 0.15 * g + rnd.gauss(0, 0.004)
        row = {
            "step": step, "reward": 0.3 * rouge + 0.2 * 0.2 + 0.5 * judge, "reward_std": 0.004 + 0.004 * rnd.random(),
            "rewards/rouge_l/mean": rouge, "rewards/judge/mean": judge, "rewards/length/mean": 0.2, "rewards/eos/mean": 0.0,
            "completions/clipped_ratio": 1.0, "completions/mean_length": float(cap), "completions/max_length": float(cap),
            "entropy": 0.2 + 1.3 * math.exp(-step / 150) + rnd.gauss(0, 0.02),
            "clip_ratio/region_mean": 0.0, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0,
            "frac_reward_zero_std": 0.75, "learning_rate": 5e-5, "loss": 0.0,
        }
        if log_cap:
            row["generation/max_completion_length"] = 256 if step >= raise_at else cap
        rows.append(row)
        if step % 100 == 0:
            rows.append({"step": step, "eval/score": 0.4})
    return rows


def healthy_stream(n=200, seed=1, noise=0.02):
    """Every component rising, entropy easing 1.5 -> 1.1, ~20% clipped with an adaptive cap that
    completions follow, clip ratios and reward spread well above zero."""
    rnd = random.Random(seed)
    rows = []
    for step in range(1, n + 1):
        t = step / n
        judge, rouge = 0.40 + 0.25 * t + rnd.gauss(0, noise), 0.20 + 0.20 * t + rnd.gauss(0, noise)
        length, eos = 0.5 + 0.3 * t + rnd.gauss(0, noise), -0.05 + 0.15 * t + rnd.gauss(0, noise)
        cap = 32 + 8 * int(4 * t)
        rows.append({
            "step": step, "reward": 0.3 * rouge + 0.2 * length + 0.5 * judge + eos, "reward_std": 0.15 + rnd.gauss(0, 0.01),
            "rewards/rouge_l/mean": rouge, "rewards/judge/mean": judge, "rewards/length/mean": length, "rewards/eos/mean": eos,
            "completions/clipped_ratio": min(1.0, max(0.0, 0.2 + rnd.gauss(0, 0.05))), "completions/mean_length": 0.6 * cap,
            "completions/max_length": float(cap), "generation/max_completion_length": cap,
            "entropy": 1.5 - 0.4 * t + rnd.gauss(0, 0.03), "clip_ratio/region_mean": 0.03 + abs(rnd.gauss(0, 0.01)),
            "clip_ratio/low_mean": 0.01, "clip_ratio/high_mean": 0.02, "frac_reward_zero_std": 0.1, "loss": 0.01,
        })
        if step % 10 == 0:
            rows.append({"step": step, "eval/score": 0.4 + 0.2 * t})
    return rows


# The rules the baseline run's pathologies fire; the two others are symptoms it did not have (its entropy fell,
# its completions were all cut from the start).
SEED_RULES = set(RULES) - {"entropy_blowup", "length_overshoot"}

EXPECTED_ADVICE = {
    "never_stops": ["rewards.eos_bonus", "generation.max_completion_length: adaptive"],
    "entropy_collapse": ["grpo.adaptive_entropy: true", "grpo.entropy_target", "grpo.epsilon_high", "optimization.learning_rate"],
    "no_effective_update": ["generation.num_generations: 8", "judge.backend"],
    "zero_variance_groups": ["grpo.dynamic_sampling.enabled: true", "generation.num_generations: 8", "judge.backend"],
    "length_schedule_ignored": ["generation.length_schedule", "generation.max_completion_length"],
    "reward_plateau": ["optimization.learning_rate", "generation.num_generations"],
    "judge_rouge_divergence": ["judge.backend", "rewards.weights.judge"],
}


def by_rule(findings):
    return {f.rule: f for f in findings}


# ---------------------------------------------------------------- rules


def test_seed_stream_fires_every_rule_with_advice():
    found = by_rule(diagnose(seed_stream(), config=SEED_CONFIG))
    assert set(found) == SEED_RULES
    for rule, keys in EXPECTED_ADVICE.items():
        text = "\n".join(found[rule].advice)
        for key in keys:
            assert key in text, (rule, key, text)
    # early where the signal is immediate; the length rule right after the schedule's step
    assert found["never_stops"].first_step <= 20
    assert found["no_effective_update"].first_step <= 20
    assert found["zero_variance_groups"].first_step <= 20
    assert found["entropy_collapse"].first_step <= 400
    assert 500 <= found["length_schedule_ignored"].first_step <= 520
    assert 1000 <= found["reward_plateau"].first_step <= 2000  # the baseline run's reward rose for ~1,000 steps
    # the numbers it saw and the current values in the advice
    ev = found["length_schedule_ignored"].evidence
    assert (ev["previous_limit"], ev["new_limit"], ev["completions_max_length"], ev["raise_step"]) == (160, 256, 160.0, 500)
    assert found["never_stops"].evidence["clipped_ratio_mean"] == 1.0
    assert found["entropy_collapse"].evidence["early_entropy"] > 1.3
    assert "(now 4)" in found["no_effective_update"].advice[0]
    assert "(now self)" in "\n".join(found["judge_rouge_divergence"].advice)
    assert "(now 5e-05)" in "\n".join(found["entropy_collapse"].advice)


def test_a_run_config_object_is_accepted():
    from pipeline.config import load_config

    cfg = load_config(REPO / "configs" / "seed-baseline.yaml")
    found = by_rule(diagnose(seed_stream(30, tau=1e9, cap=8), config=cfg))
    assert "(now 4)" in found["no_effective_update"].advice[0]
    assert found["length_schedule_ignored"].evidence["new_limit"] == 12  # seed-baseline: 8 -> 12 at step 20


def test_logged_cap_that_generation_ignores_is_found_without_config():
    found = by_rule(diagnose(seed_stream(700, log_cap=True)))
    f = found["length_schedule_ignored"]
    assert f.evidence["source"].startswith("logged") and f.first_step == 509
    assert "bug" in f.advice[0]


def test_working_schedule_is_not_flagged():
    rows = seed_stream(700, log_cap=True)
    for r in rows:
        if r.get("generation/max_completion_length") == 256:
            r["completions/max_length"] = 256.0
    assert "length_schedule_ignored" not in by_rule(diagnose(rows))


@pytest.mark.parametrize("n,config", [(30, None), (200, None), (2000, {"optimization": {"max_steps": 2000}})])
def test_healthy_stream_has_no_finding(n, config):
    assert diagnose(healthy_stream(n), config=config) == []



def overshoot_stream(n=300, seed=44, at=(40, 65), entropy_peak=2.6, length_peak=29.0, clipped_peak=0.28):
    """The shape measured in docs/ablation.md (ours, 300 steps, seed 44): one prompt per step, so entropy and length
    are noisy step to step; between ``at`` the answers double (14 -> 29 tokens) and run into the cap (28% cut)
    while per-token entropy rises with them (1.8 -> 2.6), then all of it comes back."""
    rnd = random.Random(seed)
    rows = []
    for step in range(1, n + 1):
        bump = math.sin(math.pi * (step - at[0]) / (at[1] - at[0])) if at[0] <= step <= at[1] else 0.0
        length, cap = 14.0 + (length_peak - 14.0) * bump, 41 + int(34 * bump)
        clipped = max(0.0, min(1.0, clipped_peak * bump + rnd.gauss(0, 0.03)))
        rows.append({
            "step": step, "reward": 0.7 + rnd.gauss(0, 0.1), "reward_std": 0.1, "loss": 0.0, "frac_reward_zero_std": 0.0,
            "entropy": max(0.3, 1.8 + (entropy_peak - 1.8) * bump + rnd.gauss(0, 0.6)),
            "completions/mean_length": max(2.0, length + rnd.gauss(0, 3)), "completions/clipped_ratio": clipped,
            "completions/max_length": float(cap if clipped > 0 else min(cap, 2 * length)),  # a cut one has the cap's length
            "clip_ratio/region_mean": 0.0, "generation/max_completion_length": cap,
        })
    return rows


def test_an_answer_length_overshoot_is_found_and_resolved_and_is_no_entropy_blowup():
    cfg = {"optimization": {"max_steps": 300, "learning_rate": 3e-3}, "generation": {"num_generations": 8}}
    found = by_rule(diagnose(overshoot_stream(), config=cfg))
    assert set(found) == {"length_overshoot"}  # entropy rose 1.4x with the length: below a blow-up
    f = found["length_overshoot"]
    assert 40 < f.first_step <= 60 and f.resolved and f.last_step < 70
    assert f.evidence["mean_length"] >= 2 * f.evidence["early_mean_length"] and f.evidence["clipped_ratio_mean"] >= 0.2
    assert "optimization.learning_rate: 0.0015 (now 0.003)" in "\n".join(f.advice)
    # half the growth, or all of it without running into the cap, is no overshoot
    assert diagnose(overshoot_stream(length_peak=21.0), config=cfg) == []
    assert diagnose(overshoot_stream(clipped_peak=0.05), config=cfg) == []


def blowup_stream(peak: float, seed=44):
    """Answers of a steady length; from step 40 to 80 entropy climbs from 1.8 to ``peak`` and stays there."""
    rnd = random.Random(seed)
    rows = overshoot_stream(seed=seed, length_peak=14.0, clipped_peak=0.0)
    for r in rows:
        rise = min(1.0, max(0.0, (r["step"] - 40) / 40))
        r["entropy"] = max(0.3, 1.8 + (peak - 1.8) * rise + rnd.gauss(0, 0.6))
        r["entropy_coef"] = 0.01 if r["step"] > 40 else 0.0
    return rows


def test_an_entropy_blowup_is_found_with_the_bonus_it_ran_under():
    cfg = {"grpo": {"adaptive_entropy": False, "entropy_coef": 0.01}, "optimization": {"max_steps": 300}}
    f = by_rule(diagnose(blowup_stream(4.5), config=cfg))["entropy_blowup"]
    assert 60 < f.first_step < 100 and not f.resolved and f.evidence["ratio"] >= 2 and f.evidence["entropy_coef"] == 0.01
    assert "entropy bonus of 0.01" in f.summary and "grpo.entropy_coef: 0.0 (now 0.01)" in "\n".join(f.advice)
    # a rise to 3.1 (1.7x: what the healthy tiny runs reached, docs/ablation.md) is none
    assert diagnose(blowup_stream(3.1), config=cfg) == []

def test_tiny_run_of_the_seed_is_diagnosed_in_30_steps():
    cfg = {"generation": {"num_generations": 4, "max_completion_length": 32, "length_schedule": [[20, 48]]},
           "optimization": {"max_steps": 30}}
    found = by_rule(diagnose(seed_stream(30, tau=1e9, cap=8), config=cfg))
    assert {"never_stops", "no_effective_update", "zero_variance_groups", "length_schedule_ignored", "reward_plateau"} <= set(found)
    assert found["length_schedule_ignored"].evidence["new_limit"] == 48


def test_missing_keys_and_eval_lines_are_tolerated():
    rnd = random.Random(3)
    rows = [{k: v for k, v in r.items() if rnd.random() > 0.3} for r in seed_stream(300)]
    rows += [{}, {"step": 5}, {"eval/score": 1.0}, {"train_runtime": 3.0}, {"reward": "n/a", "entropy": float("nan")}]
    diagnose(rows, config=SEED_CONFIG)  # no exception
    assert diagnose([]) == []
    h = History([{"eval/score": 1.0}, {"reward": 0.5}, {"reward": 0.7, "step": 9}])
    assert len(h) == 2 and h.steps == [0, 9] and h.mean("reward", 0, 2) == pytest.approx(0.6)


def rising_stream(n=1200, seed=0, noise=0.01):
    """A steadily rising reward (0.3 -> 0.6 over n steps) and nothing else: the issue-13 false plateau."""
    rnd = random.Random(seed)
    return [{"step": i + 1, "reward": 0.3 + 0.3 * i / (n - 1) + rnd.gauss(0, noise)} for i in range(n)]


def test_steadily_rising_reward_is_no_plateau():
    # Before: reward_plateau fired at step 30 over 10-step windows. A plateau needs evidence proportionate
    # to the run: a trend over the whole tail, and, with no earlier rise, a bound over as many steps again.
    for seed in (0, 1, 2):
        assert diagnose(rising_stream(seed=seed)) == [], seed
    assert diagnose(rising_stream(), config={"optimization": {"max_steps": 1200}}) == []
    # the same climb, then flat for as long again: a plateau, found after the climb and still there at the end
    rows = rising_stream()
    rows += [{"step": 1201 + i, "reward": 0.6 + random.Random(i).gauss(0, 0.01)} for i in range(1200)]
    f = by_rule(diagnose(rows))["reward_plateau"]
    assert 1200 < f.first_step <= 2400 and f.status == "active" and f.last_step == 2400
    assert f.evidence["rose_before"] is True


def _stops_after(n_bad=60, n=200):
    """Completions never stop for n_bad steps, then the adaptive cap fixes it (clipped ratio ~0.2)."""
    rnd = random.Random(4)
    return [{"step": s, "completions/clipped_ratio": 1.0 if s <= n_bad else 0.2 + rnd.gauss(0, 0.02),
             "completions/max_length": 32.0, "reward": 0.5 + rnd.gauss(0, 0.05)} for s in range(1, n + 1)]


def test_finding_that_stopped_holding_is_resolved_with_its_span(tmp_path, capsys):
    f = by_rule(diagnose(_stops_after()))["never_stops"]
    assert (f.status, f.first_step) == ("resolved", 10)
    assert 60 <= f.last_step < 70  # held while the 10-step window was mostly clipped, not after
    still = by_rule(diagnose(_stops_after(n_bad=200)))["never_stops"]
    assert (still.status, still.last_step) == ("active", 200)
    # doctor text and report.md say so; --json prints the findings' to_dict()
    run = write_run(tmp_path / "fixed", _stops_after(), config=None)
    assert doctor_cli(argparse.Namespace(run_dir=str(run), json=False)) == 0
    out = capsys.readouterr().out
    assert "1 finding(s), 1 of them resolved" in out and f"[never_stops] resolved, held at steps 10-{f.last_step}" in out
    assert f"| `never_stops` | resolved | steps 10-{f.last_step} |" in (run / "report.md").read_text()
    js = json.loads(json.dumps(f.to_dict()))
    assert (js["status"], js["first_step"], js["last_step"]) == ("resolved", 10, f.last_step)
    # and health.json from the live callback agrees
    from pipeline.training.health import HealthCallback

    printed = []
    cb = HealthCallback(print_fn=printed.append)
    _replay(cb, _stops_after())
    (live,) = json.loads(cb.write(tmp_path / "health.json").read_text())
    assert len(printed) == 1 and (live["rule"], live["status"], live["first_step"], live["last_step"]) == (
        "never_stops", "resolved", 10, f.last_step)


def _flat_zero_clip(n=60):
    return [{"step": s, "reward_std": 0.005, "clip_ratio/region_mean": 0.0, "reward": 0.4} for s in range(1, n + 1)]


def test_clip_ratios_zero_by_construction_are_no_symptom():
    one = {"optimization": {"gradient_accumulation_steps": 1}, "generation": {"steps_per_generation": None},
           "grpo": {"num_iterations": 1}}
    f = by_rule(diagnose(_flat_zero_clip(), config=one))["no_effective_update"]
    assert f.evidence["clip_ratio_zero_by_construction"] is True
    assert "0 by construction" in f.summary and "one optimizer step per rollout" in f.summary
    assert "clip region" not in f.why
    # only the reward spread counts then: a healthy spread with zero clip ratios is no finding
    healthy_spread = [{**r, "reward_std": 0.2} for r in _flat_zero_clip()]
    assert "no_effective_update" not in by_rule(diagnose(healthy_spread, config=one))
    # two optimizer steps per rollout: zero clip ratios are evidence again
    two = {**one, "generation": {"steps_per_generation": 2}}
    f2 = by_rule(diagnose(_flat_zero_clip(), config=two))["no_effective_update"]
    assert f2.evidence["clip_ratio_zero_by_construction"] is False and "clip_ratio/region_mean 0" in f2.summary
    assert "no_effective_update" not in by_rule(diagnose([{**r, "clip_ratio/region_mean": 0.05} for r in _flat_zero_clip()], config=two))


def test_windows_scale_with_the_run():
    s = RuleSettings()
    assert s.window(30) == 10 and s.window(1000) == 50 and s.window(100000) == 200
    assert s.plateau_window(40) == 10 and s.plateau_window(100, planned=18000) == 360


# ---------------------------------------------------------------- live callback


def _replay(cb, rows, main=True):
    state = types.SimpleNamespace(is_world_process_zero=main, global_step=0)
    for r in rows:
        state.global_step = int(r.get("step", state.global_step))
        cb.on_log(None, state, None, logs={k: v for k, v in r.items() if k != "step"})


def test_callback_prints_each_finding_once_and_agrees_with_doctor():
    from pipeline.training.health import HealthCallback

    printed = []
    cb = HealthCallback(config=SEED_CONFIG, print_fn=printed.append)
    rows = seed_stream()
    _replay(cb, rows)
    _replay(cb, seed_stream(300, seed=5))  # more pathological steps: nothing new is said
    assert len(printed) == len(SEED_RULES)
    for rule in SEED_RULES:
        assert sum(f"[{rule}]" in p for p in printed) == 1
    live = [(f.rule, f.first_step) for f in cb.findings]
    assert sorted(live) == sorted((f.rule, f.first_step) for f in diagnose(rows, config=SEED_CONFIG))


def test_callback_quiet_on_healthy_run_and_off_main_process(tmp_path):
    from pipeline.training.health import HealthCallback

    printed = []
    cb = HealthCallback(print_fn=printed.append)
    _replay(cb, healthy_stream())
    assert printed == [] and cb.findings == []
    worker = HealthCallback(print_fn=printed.append)
    _replay(worker, seed_stream(100), main=False)
    assert printed == [] and len(worker.history) == 0
    assert json.loads(cb.write(tmp_path / "health.json").read_text()) == []


def test_callback_counts_findings_in_ray_only_when_initialized(monkeypatch):
    from pipeline.training.health import COUNTER_NAME, HealthCallback

    incs = []

    class Counter:
        def __init__(self, name, description="", tag_keys=None):
            assert name == COUNTER_NAME and tag_keys == ("rule", "run")

        def inc(self, value=1.0, tags=None):
            assert set(tags) == {"rule", "run"}
            incs.append(tags["rule"])

    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: False
    metrics = types.ModuleType("ray.util.metrics")
    metrics.Counter = Counter
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.util", types.ModuleType("ray.util"))
    monkeypatch.setitem(sys.modules, "ray.util.metrics", metrics)

    cb = HealthCallback(print_fn=lambda s: None)
    _replay(cb, seed_stream(100))
    assert cb.findings and incs == []  # Ray not initialized: no export, no failure
    ray.is_initialized = lambda: True
    cb = HealthCallback(print_fn=lambda s: None)
    _replay(cb, seed_stream(100))
    assert sorted(incs) == sorted(f.rule for f in cb.findings)


# ---------------------------------------------------------------- report, plots, CLI


def write_run(path: Path, rows, config=SEED_CONFIG, broken_after=()):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as fh:
        for i, r in enumerate(rows):
            fh.write(json.dumps(r) + "\n")
            if i in broken_after:
                fh.write('{"step": 3, "reward": \n')
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def test_cli_json_on_a_seed_run_dir(tmp_path):
    run = write_run(tmp_path / "seed-run", seed_stream(), broken_after=(4, 40))
    p = subprocess.run([sys.executable, "-m", "pipeline", "doctor", str(run), "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {f["rule"] for f in out} == SEED_RULES
    for f in out:
        assert {"rule", "first_step", "evidence", "advice"} <= set(f) and f["advice"]
    assert "skipped 2 broken lines (lines 6, 43)" in p.stderr
    report = (run / "report.md").read_text()
    assert "never_stops" in report and "![length](length.png)" in report and "Skipped 2 broken lines" in report
    for name in ("reward", "entropy", "length", "clip_ratio"):
        png = run / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_SIGNATURE
        import matplotlib.image

        img = matplotlib.image.imread(png)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_cli_text_on_healthy_run(tmp_path, capsys):
    run = write_run(tmp_path / "ok", healthy_stream(), config=None)
    assert doctor_cli(argparse.Namespace(run_dir=str(run), json=False)) == 0
    out = capsys.readouterr().out
    assert "0 finding(s)" in out and "no rule fired" in out
    assert (run / "report.md").is_file() and (run / "reward.png").is_file()


def _file(d: Path, name: str, text: str, ret: Path | None = None) -> Path:
    (d / name).write_text(text)
    return ret or d


@pytest.mark.parametrize("setup,expect", [
    (lambda d: d / "nope", "does not exist"),
    (lambda d: d, "no metrics.jsonl in"),
    (lambda d: _file(d, "metrics.jsonl", ""), "it is empty"),
    (lambda d: _file(d, "metrics.jsonl", "oops\n[1, 2]\n\n{\n"), "all 3 lines are broken (lines 1, 2, 4)"),
    (lambda d: _file(d, "metrics.jsonl", '{"eval/score": 1}\n'), "none is a training step"),
    (lambda d: _file(d, "f.txt", "x", d / "f.txt"), "is not a directory"),
])
def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys, setup, expect):
    target = setup(tmp_path)
    assert doctor_cli(argparse.Namespace(run_dir=str(target), json=True)) == 2
    err = capsys.readouterr().err
    assert expect in err and str(target.name) in err


def test_bad_input_via_subprocess_and_broken_config(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pipeline", "doctor", str(tmp_path / "missing")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "missing" in p.stderr and "does not exist" in p.stderr
    run = write_run(tmp_path / "r", seed_stream(60), config=None)
    (run / "config.yaml").write_text("generation: [unclosed\n")
    rows, broken = read_jsonl(run / "metrics.jsonl")
    assert broken == [] and len(rows) == 60
    assert doctor_cli(argparse.Namespace(run_dir=str(run), json=True)) == 0
