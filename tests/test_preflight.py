"""Bad input stops before Ray or any model starts (exit 2, the field or file named); reruns never
silently resume under another config; the embedded Ray ignores a stale cluster file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config
from pipeline.training.driver import RAY_TRAIN_DIR, RayUnreachable, ResumeConflict, prepare_run_dir, ray_address
from tests.conftest import REPO


def run_cli(*args: str, timeout: float = 60, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    return proc, time.monotonic() - t0


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    broken_squad = tmp_path / "squad.json"
    broken_squad.write_text('{"data": [{"paragraphs": [', encoding="utf-8")
    broken_parquet = tmp_path / "rows.parquet"
    broken_parquet.write_bytes(b"PAR1 this is not parquet")
    invalid_rows = tmp_path / "invalid.jsonl"
    invalid_rows.write_text('{"query": "", "synthetic_answer": "x"}\n{not json}\n', encoding="utf-8")
    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    return {
        "empty data file": (["--set", "data.source=local", "--set", f"data.path={empty}"], str(empty)),
        "all-invalid rows": (["--set", "data.source=local", "--set", f"data.path={invalid_rows}"], str(invalid_rows)),
        "malformed SQuAD JSON": (["--set", "data.source=squad", "--set", f"data.path={broken_squad}"], str(broken_squad)),
        "malformed Parquet": (["--set", "data.source=local", "--set", f"data.path={broken_parquet}"], str(broken_parquet)),
        "missing model path": (["--set", "model.name_or_path=/nonexistent/model"], "model.name_or_path"),
        "unwritable output.root": (["--set", f"output.root={blocker}/runs"], "output.root"),
    }


@pytest.mark.parametrize("case", ["empty data file", "all-invalid rows", "malformed SQuAD JSON", "malformed Parquet",
                                  "missing model path", "unwritable output.root"])
def test_bad_input_exits_2_fast_naming_the_field_or_file(tmp_path, case):
    args, named = _bad_inputs(tmp_path)[case]
    proc, seconds = run_cli("train", *args, "--set", f"output.run_name=bad-{case.replace(' ', '-')}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert seconds < 10, seconds
    assert named in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "[ray]" not in proc.stdout  # Ray never started


def _finished_run(tmp_path: Path, *overrides: str):
    cfg = load_config(None, [f"output.root={tmp_path}", *overrides])
    run_dir = tmp_path / cfg.output.run_name
    prepare_run_dir(cfg, run_dir, log=None)
    (run_dir / RAY_TRAIN_DIR).mkdir()  # a run with checkpoints: a rerun resumes it
    return run_dir


def test_rerun_with_a_changed_learning_rate_exits_2_naming_it(tmp_path):
    run_dir = _finished_run(tmp_path)
    before = (run_dir / "config.yaml").read_text()
    proc, seconds = run_cli("train", "--set", f"output.root={tmp_path}", "--set", "optimization.learning_rate=3e-4")
    assert proc.returncode == 2 and seconds < 10, proc.stderr[-2000:]
    assert "optimization.learning_rate" in proc.stderr and "--allow-config-change" in proc.stderr
    assert "output.run_name" in proc.stderr  # the other way forward
    assert (run_dir / "config.yaml").read_text() == before  # nothing of the run was touched


def test_resume_accepts_safe_changes_and_an_explicit_change(tmp_path):
    run_dir = _finished_run(tmp_path)
    more = load_config(None, [f"output.root={tmp_path}", "optimization.max_steps=60", "logging.samples_every=5"])
    assert prepare_run_dir(more, run_dir, log=None) is True  # more steps and logging: resumes
    changed = load_config(None, [f"output.root={tmp_path}", "data.min_reference_words=3", "lora.r=4"])
    with pytest.raises(ResumeConflict) as e:
        prepare_run_dir(changed, run_dir, log=None)
    assert [line.split(":")[0] for line in e.value.lines] == ["data.min_reference_words", "lora.r"]
    assert prepare_run_dir(changed, run_dir, log=None, allow_config_change=True) is True
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["lora"]["r"] == 4
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "config_change" and events[-1]["fields"] == ["data.min_reference_words", "lora.r"]
    assert len(list(run_dir.glob("config.*.yaml"))) >= 1  # the earlier config is kept


def test_unreachable_cluster_fails_fast_naming_address_and_source(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    t0 = time.monotonic()
    with pytest.raises(RayUnreachable) as e:
        ray_address(None, connect_timeout_s=2)
    assert time.monotonic() - t0 < 10
    assert "127.0.0.1:9" in str(e.value) and "RAY_ADDRESS" in str(e.value)
    with pytest.raises(RayUnreachable, match="--address"):
        ray_address("127.0.0.1:9", connect_timeout_s=1)
    monkeypatch.delenv("RAY_ADDRESS")
    assert ray_address(None) == (None, "embedded")


@pytest.mark.slow
def test_stale_cluster_file_does_not_stop_the_embedded_ray():
    """A crashed `ray start` leaves ray_current_cluster behind; with no address we start our own Ray."""
    tmp = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))  # short: Ray's socket paths live under it
    (tmp / "ray").mkdir()
    (tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")  # nothing listens on port 9
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    script = ("import ray; from pipeline.training.driver import init_ray; init_ray(); "
              "print('CPUS', ray.cluster_resources().get('CPU')); ray.shutdown()")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**env, "RAY_TMPDIR": str(tmp)})
    assert proc.returncode == 0 and "CPUS" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_error_found_in_the_worker_is_not_retried(tmp_path):
    """A model folder that passes the pre-check (it has config.json) but does not load: the worker
    reports the cause once and the run stops with exit 2, instead of Ray Train retrying it."""
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text("{not json", encoding="utf-8")
    proc, seconds = run_cli("train", "--set", f"model.name_or_path={model}", "--set", f"output.root={tmp_path}",
                            "--set", "distributed.max_failures=3", "--set", "output.run_name=broken", timeout=300)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert "config.json" in last and "OSError" in last, proc.stderr[-2000:]
    assert proc.stdout.count("data[bundled]") <= 1  # one attempt, no retries
    assert (tmp_path / "broken" / "config.yaml").is_file()  # the run directory is kept



@pytest.mark.slow
def test_storage_error_after_training_stops_without_rerunning_steps(ray_local, tmp_path, capsys):
    """output.storage a plain folder whose ``<run>/adapter`` is a file: the final upload cannot make the
    folder, an error no retry fixes, met only after training. The run stops (exit 2, the cause named once)
    where Ray Train used to restart the group max_failures times; the run and its checkpoints are kept."""
    from pipeline.cli.main import main
    from pipeline.rundir.files import EVENTS, METRICS, read_metrics
    from pipeline.rundir.metric_names import is_train_row

    shared = tmp_path / "shared"
    (shared / "up").mkdir(parents=True)
    (shared / "up" / "adapter").write_text("in the way", encoding="utf-8")
    sets = [f"output.root={tmp_path / 'runs'}", "output.run_name=up", f"output.storage={shared}",
            "distributed.max_failures=2", "optimization.max_steps=2", "eval.num_prompts=2", "logging.console=table",
            "logging.progress_bar=false", "generation.max_completion_length=8", "judge.cpus_per_actor=0.25"]
    code = main(["train", *(a for s in sets for a in ("--set", s))])
    err = capsys.readouterr().err
    assert code == 2, err[-4000:]
    last = err.strip().splitlines()[-1]
    assert "output.storage" in last and f"'{shared / 'up' / 'adapter'}'" in last and "File exists" in last, last
    assert "stopped without retrying" in err and err.count("non-directory entry exists") == 1, err[-4000:]
    run_dir = tmp_path / "runs" / "up"
    rows = read_metrics(run_dir / METRICS)
    assert [r["step"] for r in rows if is_train_row(r)] == [1, 2]
    assert sum("timing_s/setup" in r for r in rows) == 1  # one attempt: the group was not restarted ...
    assert not [e for e in read_metrics(run_dir / EVENTS) if e["event"] == "resume"]  # ... nor resumed
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()  # the run's files are kept here ...
    assert (shared / "up" / RAY_TRAIN_DIR / "checkpoint_manager_snapshot.json").is_file()  # ... its checkpoints there
