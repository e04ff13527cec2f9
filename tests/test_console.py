"""The run's console: the renderer and file tail on their own, the tune trial board, and a real
captured `synth-grpo train` whose console shows every event and none of the per-step dicts."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, load_config
from pipeline.training.callbacks import read_metrics
from pipeline.rundir.files import LEASE
from pipeline.console.live import ConsoleRenderer, JsonlTail, poll_run, table_every
from pipeline.console.trials import TrialBoard

REPO = Path(__file__).resolve().parents[1]


def train_row(step: int, **kw) -> dict:
    return {"step": step, "loss": 0.1, "reward": 0.5 + step / 100, "rewards/judge/mean": 0.4, "entropy": 2.0,
            "completions/clipped_ratio": 0.25, "completions/mean_length": 9.5, "generation/max_completion_length": 16, **kw}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 2.0  # two seconds per row
        return self.t


def test_table_every_gives_about_fifteen_rows():
    assert [table_every(n) for n in (5, 30, 300, 2000, 18000)] == [1, 2, 20, 100, 1000]


def test_plain_console_without_terminal_table_and_events_no_frames():
    out = io.StringIO()
    r = ConsoleRenderer("progress", 30, out, tty=False, clock=Clock())
    r.row({"step": 0, "eval/score": 0.41, "eval/rouge_l": 0.3, "eval/eos_rate": 0.5, "eval/mean_length": 12.0})
    for s in range(1, 31):
        r.row(train_row(s))
        if s == 12:
            r.event({"event": "length_cap", "step": 12, "old": 8, "new": 16, "why": "clipped ratio outside [0.05, 0.2]"})
    r.row({"step": 30, "train_runtime": 10.0, "train_loss": 0.2})  # the trainer's summary row: not a step
    r.close()
    text = out.getvalue()
    assert "\r" not in text and "\033" not in text
    lines = text.splitlines()
    assert lines[0] == "[eval] step 0: eval/score 0.410 (rouge_l 0.300, eos_rate 0.500, mean length 12.0)"
    rows = [ln for ln in lines if ln.lstrip()[:1].isdigit()]
    assert [ln.split()[0] for ln in rows] == [f"{s}/30" for s in range(2, 31, 2)]  # every 2 logged steps
    assert rows[-1].split()[1] == "0.800" and rows[-1].split()[-1] == "2.00"  # reward, s/step
    assert "[length] step 12: max_completion_length 8 -> 16 (clipped ratio outside [0.05, 0.2])" in lines
    assert lines.index("[length] step 12: max_completion_length 8 -> 16 (clipped ratio outside [0.05, 0.2])") \
        == lines.index(next(ln for ln in rows if ln.startswith("12/30"))) + 1
    assert len(lines) == 1 + 1 + 15 + 1  # eval, header, 15 rows, event


def test_live_line_on_a_terminal_is_cleared_before_each_plain_line():
    out = io.StringIO()
    r = ConsoleRenderer("progress", 10, out, tty=True, clock=Clock())
    for s in range(1, 5):
        r.row(train_row(s))
    r.event({"event": "checkpoint", "step": 4, "name": "checkpoint-000004"})
    r.close()
    text = out.getvalue()
    frames = text.split("\r\033[K")
    assert "step 4/10 | reward 0.540 | eval/score - | entropy 2.000 | clipped 0.25 | cap 16 | 2.00 s/step | ETA 12s" in frames
    assert "[checkpoint] step 4: checkpoint-000004\n" in frames
    assert text.endswith("\r\033[K")  # closed: no half-drawn frame left behind
    assert ConsoleRenderer("table", 10, io.StringIO(), tty=True).live is False


def test_json_mode_one_line_per_row_and_event():
    out = io.StringIO()
    r = ConsoleRenderer("json", 10, out, tty=True)
    r.row(train_row(1))
    r.event({"event": "resume", "step": 4})
    assert [json.loads(x) for x in out.getvalue().splitlines()] == [train_row(1), {"event": "resume", "step": 4}]


def test_tail_follows_resume_truncation_and_fresh_start(tmp_path):
    metrics, events = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl"
    metrics.write_text(json.dumps({"step": 1, "reward": 0.1}) + "\n")  # an earlier attempt's row
    mt, et = JsonlTail(metrics), JsonlTail(events)
    assert poll_run(mt, et) == []
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 2, "reward": 0.2}) + "\n" + '{"step": 3, "rew')  # a row half written
    events.write_text(json.dumps({"event": "checkpoint", "step": 2}) + "\n")
    assert poll_run(mt, et) == [("row", {"step": 2, "reward": 0.2}), ("event", {"event": "checkpoint", "step": 2})]
    with metrics.open("a") as f:
        f.write('ard": 0.3}\n')
    assert poll_run(mt, et) == [("row", {"step": 3, "reward": 0.3})]
    # resume: rows past the checkpoint dropped (file rewritten shorter), then training goes on
    metrics.write_text(json.dumps({"step": 1, "reward": 0.1}) + "\n" + json.dumps({"step": 2, "reward": 0.2}) + "\n")
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 3, "reward": 0.35}) + "\n")
    assert poll_run(mt, et) == [("row", {"step": 3, "reward": 0.35})]
    metrics.unlink()  # a fresh start deletes the file
    metrics.write_text(json.dumps({"step": 1, "reward": 0.9}) + "\n")
    assert poll_run(mt, et) == [("row", {"step": 1, "reward": 0.9})]


def test_trial_board_lines_and_table():
    out = io.StringIO()
    board = TrialBoard(lambda p: f"lr={p['lr']}", "progress", out, tty=False, every_s=60, clock=Clock())
    board.start("t1", {"lr": 1e-5})
    board.start("t2", {"lr": 3e-5})
    board.result("t1", {"step": 10, "eval/score": 0.45})
    board.complete("t2", failed="ValueError: boom")
    board.complete("t1")
    for _ in range(30):
        board.tick()
    lines = out.getvalue().splitlines()
    assert lines[:5] == ["[trial] t1 started: lr=1e-05", "[trial] t2 started: lr=3e-05",
                         "[trial] t1 step 10: eval/score 0.450", "[trial] t2 failed: ValueError: boom",
                         "[trial] t1 finished at step 10: eval/score 0.450"]
    table = lines[5:]
    assert table[0].split() == ["trial", "params", "step", "eval/score", "state"]
    assert table[1].split() == ["t1", "lr=1e-05", "10", "0.450", "finished"]
    assert table[2].split() == ["t2", "lr=3e-05", "-", "-", "error"]
    assert len(table) == 3  # printed once: nothing changed after


def test_console_field_validated():
    assert load_config(None, ["logging.console=table"]).logging.console == "table"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["logging.console=quiet"])
    assert any(p.startswith("logging.console: 'quiet' is not one of progress, table, json, verbose") for p in e.value.problems)


# ---------------------------------------------------------------- a real captured run


def run_cli(tmp_path: Path, policy: Path, name: str, console: str, report_to: list[str],
            second_writer: dict | None = None) -> subprocess.CompletedProcess:
    """`synth-grpo train` of a 10-step run; with ``second_writer`` (a dict, filled in) the same command is
    started again while the first runs."""
    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    data["model"]["name_or_path"] = str(policy)
    data["generation"].update(max_completion_length=8, length_schedule=[[4, 12]])
    data["optimization"].update(max_steps=10)
    data["eval"].update(num_prompts=4, every_steps=5)
    data["output"].update(save_steps=5, root=str(tmp_path), run_name=name)
    data["logging"].update(console=console, report_to=report_to, samples_every=5)
    data["distributed"]["max_failures"] = 0
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    env = {**os.environ, "RAY_ADDRESS": ""}
    cmd = [sys.executable, "-m", "pipeline", "train", "--config", str(path)]
    if second_writer is None:
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    # A second `train` of the same run while this one writes it: refused within seconds, naming the holder.
    with (tmp_path / f"{name}.out").open("w+") as out, (tmp_path / f"{name}.err").open("w+") as err:
        first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=err, text=True)
        lease, deadline = tmp_path / name / LEASE, time.monotonic() + 300
        while first.poll() is None and not lease.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        t0 = time.monotonic()
        second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        second_writer.update(returncode=second.returncode, seconds=time.monotonic() - t0, stderr=second.stderr,
                             holder=first.pid, first_alive=first.poll() is None)
        first.wait(timeout=900)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(cmd, first.returncode, out.read(), err.read())


@pytest.mark.slow
def test_captured_run_console_shows_events_not_step_dicts(tmp_path, tiny_policy):
    """The tiny policy that never stops (EOS moved away): the cap schedule changes at step 4, the
    health rule never_stops fires at step 10, evaluations at 0, 5, 10, checkpoints at 5, 10."""
    from tests.test_train_ray import never_stopping_policy

    policy = never_stopping_policy(tiny_policy, tmp_path / "never-stops")
    second: dict = {}
    res = run_cli(tmp_path, policy, "watch", "progress", ["tensorboard"], second_writer=second)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    # One writer per run: the second start, while the first was alive, exited 2 in seconds naming it, and
    # the first went on to log every step once.
    assert second["first_alive"] and second["returncode"] == 2 and second["seconds"] < 10, second
    assert f"pid {second['holder']}" in second["stderr"] and "Traceback" not in second["stderr"], second["stderr"]
    train_steps = [r["step"] for r in read_metrics(tmp_path / "watch" / "metrics.jsonl") if "reward" in r]
    assert train_steps == list(range(1, 11)), train_steps
    lines = out.splitlines()
    assert "\r" not in out  # not a terminal: plain lines only
    assert "Reporting training result" not in out  # Ray Train's per-report lines
    assert not any("{'loss'" in ln or "'reward':" in ln or '"reward":' in ln for ln in lines)  # TRL's per-step dicts
    run_dir = tmp_path / "watch"
    # every cap change, finding, evaluation and checkpoint the run recorded is on the console
    changes = json.loads((run_dir / "length_changes.json").read_text())
    assert [c[1:] for c in changes] == [[8, 12]]  # the schedule's one change
    for step, old, new in changes:
        assert f"[length] step {step}: max_completion_length {old} -> {new} (schedule)" in lines
    findings = json.loads((run_dir / "health.json").read_text())
    assert "never_stops" in {f["rule"] for f in findings}
    for f in findings:
        assert f"[health] [{f['rule']}] step {f['first_step']}: {f['summary']}" in lines
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/score" in r]
    assert [r["step"] for r in evals] == [0, 5, 10]
    for r in evals:
        assert any(ln.startswith(f"[eval] step {r['step']}: eval/score {r['eval/score']:.3f} (") for ln in lines)
    for step in (5, 10):
        assert f"[checkpoint] step {step}: checkpoint-{step:06d}" in lines
    assert [ln.split()[0] for ln in lines if ln.split() and ln.split()[0].endswith("/10")] == [f"{s}/10" for s in range(1, 11)]
    # Ray Train's controller actors print warnings with tracebacks when the machine is overloaded or
    # runs several Ray instances (a shared CI box); they are not the pipeline's output.
    ours = [ln for ln in lines if "(TrainController pid=" not in ln and "(PlacementGroupCleaner pid=" not in ln]
    assert len(ours) < 60, out

    # every evaluation's answers with their component scores ...
    answers = [json.loads(x) for x in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    k = yaml.safe_load((run_dir / "config.yaml").read_text())["eval"]["samples_per_prompt"]
    assert sorted({a["step"] for a in answers}) == [0, 5, 10] and len(answers) == 3 * 4 * k  # 4 prompts x k samples
    assert all(set(a["scores"]) == {"rouge_l", "length", "judge", "eos"} and not a["ended_with_eos"] for a in answers)
    # ... the best and worst of the first and last in the doctor's report ...
    from pipeline.report.doctor import doctor

    report = doctor(run_dir, plots=False)[2].read_text()
    section = report.split("## Held-out samples")[1]
    assert f"### Step 0 ({4 * k} answers" in section and f"### Step 10 ({4 * k} answers" in section
    assert "### Step 5" not in section
    best = max((a for a in answers if a["step"] == 10), key=lambda a: a["score"])
    assert f"| best | {best['score']:.3f} | {best['scores']['rouge_l']:.3f} |" in section
    # ... and as TensorBoard text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdirs = {p.parent for p in (run_dir / "trainer").rglob("events.out.tfevents.*")}
    tags = {}
    for d in logdirs:
        acc = EventAccumulator(str(d), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags().get("tensors", []):
            tags.setdefault(tag, []).extend(e.step for e in acc.Tensors(tag))
    assert sorted(tags.get("eval/samples/text_summary", [])) == [0, 5, 10]


def test_report_samples_best_and_worst_of_first_and_last_evaluation(tmp_path):
    from pipeline.report.markdown import report_section
    from pipeline.rundir import eval_samples
    from pipeline.rundir.files import EVAL_SAMPLES

    w = {"rouge_l": 0.4, "length": 0.1, "judge": 0.4, "eos": 0.1}
    recs = [{"id": i, "question": f"Frage {i}?", "reference": f"Antwort {i}."} for i in range(5)]

    def evaluation(step, base):
        scores = {c: [base + i / 10 for i in range(5)] for c in ("rouge_l", "length", "judge", "eos")}
        return eval_samples.eval_rows(step, recs, [f"a{step}-{i} | x" for i in range(5)], [i % 2 == 0 for i in range(5)], scores, w)

    path = tmp_path / EVAL_SAMPLES
    for step, base in ((0, 0.0), (5, 0.2), (10, 0.1), (10, 0.3)):  # step 10 evaluated again after a resume
        eval_samples.write(path, evaluation(step, base))
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows[1]["score"] == pytest.approx(0.4 * 0.1 + 0.1 * 0.1 + 0.4 * 0.1 + 0.1 * 0.0)  # EOS term: did it stop
    md = "\n".join(report_section(tmp_path))
    assert "### Step 0 (5 answers, mean score" in md and "### Step 10 (5 answers" in md and "### Step 5" not in md
    step10 = md.split("### Step 10")[1].splitlines()
    best = [ln for ln in step10 if ln.startswith("| best")]
    worst = [ln for ln in step10 if ln.startswith("| worst")]
    assert len(best) == 2 and len(worst) == 2
    assert best[0].startswith("| best | 0.730 | 0.700 | 0.700 | 0.700 | 0.700 | yes | Frage 4? | a10-4 \\| x | Antwort 4. |")
    assert worst[0].startswith("| worst | 0.360 | 0.400 | ")  # the resumed evaluation's answers, not the first


@pytest.mark.slow
@pytest.mark.parametrize("console", ["verbose", "table"])
def test_console_field_decides_whether_the_trainer_prints_step_dicts(tmp_path, tiny_policy, capfd, console):
    """logging.console reaches the run: a real GRPOTrainer (in process, 2 steps) prints TRL's
    per-step dicts only in verbose mode; otherwise quiet_worker removed the printers."""
    from pipeline.training.events import quiet_worker
    from pipeline.data.sources import load_records
    from pipeline.scoring.clients import eos_kwargs
    from pipeline.training.worker import build_grpo_trainer, load_policy
    from rewards.trl_rewards import make_reward_funcs

    cfg = load_config(None, [f"logging.console={console}", "logging.progress_bar=false", "optimization.max_steps=2",
                             "generation.max_completion_length=8", "output.save_steps=1000",
                             "rewards.weights={rouge_l: 0.5, length: 0.5, judge: 0, eos: 1}"])
    train, _, _ = load_records(cfg.data, log=None)
    tokenizer, model, eos_ids = load_policy(cfg, on_gpu=False)
    funcs, weights = make_reward_funcs(cfg.rewards.weights, None, eos_ids, lambda: 8, eos_kwargs(cfg))
    trainer = build_grpo_trainer(cfg, tmp_path, tokenizer, model, train, funcs, weights, [])
    quiet_worker(trainer, cfg.logging.console)
    capfd.readouterr()
    trainer.train()
    out = capfd.readouterr().out
    dicts = [ln for ln in out.splitlines() if ln.startswith("{") and "'reward'" in ln]
    assert len(dicts) == (2 if console == "verbose" else 0), out[-2000:]


def _trial(config):
    from ray import tune

    for step in (1, 2):
        tune.report({"eval/score": config["x"] * step, "step": step})


@pytest.mark.slow
def test_trial_board_fed_by_a_real_tune_run(ray_local, tmp_path):
    """The Tune callback's hooks, driven by Ray Tune itself: start, each result, finish, a table."""
    from ray import tune

    from pipeline.console.trials import tune_console_callback

    out = io.StringIO()
    board = TrialBoard(lambda p: f"x={p['x']}", "table", out, every_s=0)
    tuner = tune.Tuner(tune.with_resources(_trial, {"CPU": 0.1}), param_space={"x": tune.grid_search([0.1, 0.2])},
                       run_config=tune.RunConfig(storage_path=str(tmp_path), callbacks=[tune_console_callback(board)],
                                                 verbose=0))
    tuner.fit()
    lines = out.getvalue().splitlines()
    events = [ln for ln in lines if ln.startswith("[trial]")]
    assert sum("started: x=0.1" in ln for ln in events) == 1 and sum("started: x=0.2" in ln for ln in events) == 1
    assert sum(ln.endswith("eval/score 0.400") and "finished at step 2" in ln for ln in events) == 1
    assert len([ln for ln in events if " step " in ln and "finished" not in ln]) == 4  # two results per trial
    assert sorted(board.trials[t]["state"] for t in board.trials) == ["finished", "finished"]
    assert any(ln.split()[:5] == ["trial", "params", "step", "eval/score", "state"] for ln in lines)
