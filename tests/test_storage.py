"""Runs kept in cloud storage: a real S3 API on 127.0.0.1 (moto's server), real Ray Train workers.

The bucket holds every rank's ZeRO shards of each checkpoint and the run's files; with every local
run directory deleted, the same command resumes from the bucket (and from a plain folder shared by
the nodes of a multi-node cluster); a bad storage URI exits 2 before Ray; no credential is ever
pickled, written to the bucket or to a run folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.rundir.files import LEASE
from tests.conftest import (BUCKET, REPO, bucket_objects, free_port, leaked_credentials, local_files,
                            planted_credentials, secret_forms)


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    return proc, time.monotonic() - t0


# ---------------------------------------------------------------- credentials: never carried, never stored


class _SignedRequests:
    """An HTTP server on 127.0.0.1 that answers 403 to everything and keeps each request's AWS signature:
    the access key named in ``Authorization`` and the ``X-Amz-Security-Token`` (the session token)."""

    def __init__(self):
        import http.server
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                auth = self.headers.get("Authorization", "")
                key = auth.split("Credential=", 1)[1].split("/", 1)[0] if "Credential=" in auth else None
                seen.append((key, self.headers.get("X-Amz-Security-Token")))
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD = do_PUT = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_storage_pickles_without_credentials_and_each_process_signs_with_its_own(tmp_path, monkeypatch):
    """RunStorage and its filesystem, pickled (Ray's cloudpickle and plain pickle, as Ray Train ships
    train_loop_config and Tune saves storage_filesystem into the experiment state), hold none of the
    driver's credentials in any encoding; a process that unpickles them signs with its own environment's."""
    import pickle

    import cloudpickle

    from pipeline.rundir.storage import RunStorage

    server = _SignedRequests()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        store = RunStorage(f"s3://{BUCKET}/pickled", "run")
        blobs = []
        for obj in (store, store.child("trials"), store.fs):
            blobs += [(f"pickle {type(obj).__name__}", pickle.dumps(obj)), (f"cloudpickle {type(obj).__name__}", cloudpickle.dumps(obj))]
        assert not leaked_credentials(blobs)
        assert secret_forms("abcd")[0] in pickle.dumps("xabcdx")  # the scan itself finds a pickled string
        (tmp_path / "store.pkl").write_bytes(cloudpickle.dumps(store))
        # Another process with other credentials (a cluster node with its own) reads the pickled store.
        other = {"AWS_ACCESS_KEY_ID": "OTHERNODEKEY", "AWS_SECRET_ACCESS_KEY": "othernodesecret",
                 "AWS_SESSION_TOKEN": "OTHERNODETOKEN", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
        code = ("import pickle, sys; s = pickle.load(open(sys.argv[1], 'rb'))\n"
                "try: s.exists('x')\nexcept OSError: pass")
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store.pkl")], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env={**os.environ, **other})
        assert proc.returncode == 0, proc.stderr[-2000:]
        # The endpoint came with the pickle (not the process's AWS_ENDPOINT_URL), the credentials did not.
        assert ("OTHERNODEKEY", "OTHERNODETOKEN") in server.seen and len(set(server.seen)) == 1, server.seen
        with pytest.raises(OSError):
            pickle.loads(pickle.dumps(store)).exists("x")  # this process: its own (planted) credentials
        mine = planted_credentials()
        assert (mine["AWS_ACCESS_KEY_ID"], mine["AWS_SESSION_TOKEN"]) in server.seen, server.seen
    finally:
        server.close()


@pytest.mark.parametrize("uri", ["s3://AKIDLEAKq7:wJalr/XUtnLEAKq7+K7MD@ENG@bucket/runs",
                                 "abfs://:c2VjcmV0LEAKq7ACCOUNTKEY==@account.dfs.core.windows.net/runs",
                                 "abfss://container:LEAKq7@account.dfs.core.windows.net/runs",
                                 "s3://bucket/runs?access_key=AKIDLEAKq7&secret_key=LEAKq7",
                                 "gs://bucket/runs?access_token=LEAKq7"])
def test_credentials_in_the_storage_uri_exit_2_before_ray_without_echoing_them(uri, tmp_path, capsys):
    from pipeline.cli.main import main
    from pipeline.rundir.storage import StorageError, check_writable, filesystem

    for call in (lambda: filesystem(uri), lambda: check_writable(uri, "run")):
        with pytest.raises(StorageError) as e:
            call()
        assert "LEAKq7" not in str(e.value) and "ENG@" not in str(e.value) and "output.storage" in str(e.value), e.value
    assert main(["train", "--set", f"output.storage={uri}", "--set", f"output.root={tmp_path}"]) == 2
    captured = capsys.readouterr()
    assert "output.storage" in captured.err and "credentials or a query string" in captured.err, captured.err
    assert "LEAKq7" not in captured.out + captured.err and "[ray]" not in captured.out
    assert not list(tmp_path.iterdir())  # nothing written: stopped before the run directory


def test_a_container_in_an_abfs_uri_is_not_a_credential():
    from pipeline.rundir.storage import check_location, redacted

    check_location("abfs://container@account.dfs.core.windows.net/runs")  # the container's name, no secret
    check_location("/mnt/shared/runs:v1@x")  # a path: nothing to parse
    assert redacted("s3://key:secret@bucket/p?x=1") == "s3://***@bucket/p"


def test_an_endpoint_url_with_credentials_is_refused(monkeypatch):
    from pipeline.rundir.storage import StorageError, filesystem

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:LEAKq7@minio.internal:9000")
    with pytest.raises(StorageError) as e:
        filesystem(f"s3://{BUCKET}/runs")
    assert "AWS_ENDPOINT_URL" in str(e.value) and "LEAKq7" not in str(e.value)


# ---------------------------------------------------------------- names and plain folders


def test_a_plain_folder_takes_a_new_run_and_its_nested_folders(tmp_path):
    """check_writable on a run name the folder has never seen (it was refused: the probe went into a
    folder that did not exist), then the run's files and the adapter's subfolders pushed and pulled back."""
    from pipeline.rundir.storage import RunStorage, check_writable

    shared = tmp_path / "nfs" / "runs"  # not even the storage folder exists yet
    check_writable(str(shared), "newrun")
    assert (shared / "newrun").is_dir() and not list((shared / "newrun").iterdir())  # the probe is gone
    run_dir = tmp_path / "local" / "newrun"
    (run_dir / "adapter" / "nested").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("a: 1\n")
    (run_dir / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    (run_dir / "adapter" / "nested" / "x.json").write_text("{}")
    store = RunStorage(str(shared), "trials").child("t1")  # a trial's folder under a search: two levels new
    assert store.push(run_dir, ["config.yaml"], ["adapter"]) == ["config.yaml", "adapter/"]
    assert store.list() == ["adapter/adapter_model.safetensors", "adapter/nested/x.json", "config.yaml"]
    back = tmp_path / "back"
    store.pull(back, ["config.yaml"], ["adapter"])
    assert (back / "adapter" / "nested" / "x.json").read_text() == "{}"
    assert (back / "config.yaml").read_text() == "a: 1\n"
    # A file:// URI is the same folder; a file pushed again replaces the old one by a rename (a reader that
    # holds the old file, here a hard link to it, keeps all of it) and leaves no temporary file behind.
    check_writable(f"file://{shared}", "other")
    assert (shared / "other").is_dir()
    old = shared / "trials" / "t1" / "adapter" / "adapter_model.safetensors"
    os.link(old, tmp_path / "reader")
    (run_dir / "adapter" / "adapter_model.safetensors").write_bytes(b"new weights")
    RunStorage(f"file://{shared}", "trials").child("t1").push(run_dir, dirs=["adapter"])
    assert old.read_bytes() == b"new weights" and (tmp_path / "reader").read_bytes() == b"weights"
    assert sorted(p.name for p in old.parent.iterdir()) == ["adapter_model.safetensors", "nested"]


def test_run_names_and_storage_keys(tmp_path, capsys):
    """The storage key is the run's name, never the run directory's last component; a name that is not one
    plain folder name (or an explicit --run-dir whose folder name is not) exits 2 before Ray, naming the option."""
    from pipeline.cli.main import main
    from pipeline.config import load_config
    from pipeline.rundir.storage import name_problem, run_store

    for name in ("run", "tiny-tune", "a.b_c-1", "..x"):
        assert name_problem(name, "output.run_name") is None, name
    for name in (".", "..", "../x", "a/b", "", "a b", "/", "x\n"):
        assert "output.run_name" in name_problem(name, "output.run_name"), name
    cfg = load_config(None, [f"output.storage={tmp_path / 'store'}", "output.run_name=alpha"])
    assert run_store(cfg, Path("/a/run")).path == run_store(cfg, Path("/b/other")).path == str(tmp_path / "store" / "alpha")
    cfg.output.run_name = "beta"
    assert run_store(cfg, Path("/a/run")).path != run_store(cfg.__class__(**{**cfg.__dict__}), Path("/a/run"), name="x").path

    for argv, field in ((["train", "--run-dir", str(tmp_path / "a b")], "--run-dir"),
                        (["tune", "--name", ".."], "--name"), (["tune", "--name", "a/b"], "--name")):
        assert main([*argv, "--set", f"output.root={tmp_path / 'root'}"]) == 2, argv
        err = capsys.readouterr().err
        assert field in err and "Traceback" not in err, err
    assert not (tmp_path / "root").exists() and not (tmp_path / "a b").exists()


def test_storage_errors_a_retry_cannot_fix(tmp_path):
    from pipeline.rundir.storage import RunFileSync, RunStorage, retry_cannot_fix

    assert retry_cannot_fix(PermissionError(13, "Permission denied"))
    assert retry_cannot_fix(FileExistsError(17, "Cannot create directory 'x/adapter': non-directory entry exists"))
    assert retry_cannot_fix(OSError("AWS Error ACCESS_DENIED during PutObject operation: Access Denied"))
    assert retry_cannot_fix(OSError("AWS Error NO_SUCH_BUCKET during PutObject operation"))
    assert not retry_cannot_fix(OSError("AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7"))
    assert not retry_cannot_fix(TimeoutError("timed out"))
    # What the worker sees at the end of a run: close() names the storage, with the cause a retry cannot fix.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    sync = RunFileSync(RunStorage(str(blocker), "run"), run_dir, interval_s=3600)
    with pytest.raises(OSError) as e:
        sync.close()
    assert "output.storage" in str(e.value) and retry_cannot_fix(e.value), e.value


# ---------------------------------------------------------------- bad input: before Ray, exit 2


def test_unwritable_storage_exits_2_before_ray(s3_server, tmp_path):
    proc, seconds = run_cli("train", "--set", "output.storage=s3://no-such-bucket/runs", "--set",
                            f"output.root={tmp_path}", "--set", "output.run_name=bad-bucket")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "output.storage" in proc.stderr and "no-such-bucket" in proc.stderr, proc.stderr
    assert "NoSuchBucket" in proc.stderr or "does not exist" in proc.stderr.lower(), proc.stderr
    assert "Traceback" not in proc.stderr and "[ray]" not in proc.stdout, proc.stdout + proc.stderr


def test_unreachable_storage_exits_2_before_ray(tmp_path):
    port = free_port()  # nothing listens there
    env = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    proc, seconds = run_cli("train", "--set", f"output.storage=s3://{BUCKET}/runs", "--set",
                            f"output.root={tmp_path}", "--set", "output.run_name=unreachable", env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "output.storage" in proc.stderr and f"127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "[ray]" not in proc.stdout
    assert seconds < 60, seconds


def test_storage_under_a_file_exits_2_and_a_bad_scheme_is_a_config_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    proc, _ = run_cli("train", "--set", f"output.storage={blocker}/runs", "--set", f"output.root={tmp_path}")
    assert proc.returncode == 2 and "output.storage" in proc.stderr and str(blocker) in proc.stderr, proc.stderr
    proc, _ = run_cli("train", "--set", "output.storage=ftp://host/runs")
    assert proc.returncode == 2 and "output.storage: 'ftp://host/runs'" in proc.stderr, proc.stderr


def test_run_files_flushed_before_a_checkpoint_and_dead_groups_checkpoints_removed(s3_server, tmp_path):
    """flush() uploads the run's files in the caller's thread (the reporter calls it before each checkpoint
    report, so a checkpoint is never registered ahead of its metrics rows in storage); and the folders of
    checkpoints past a group's start step go, in a bucket and on a local disk, the rest stay."""
    import pyarrow.fs as pafs

    from pipeline.rundir.storage import RunFileSync, RunStorage, remove_unregistered_checkpoints

    store = RunStorage(f"s3://{BUCKET}/flush", "run")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sync = RunFileSync(store, run_dir, interval_s=3600)  # the thread uploads once, then not for an hour
    try:
        for step in (1, 2):
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "reward": 0.5}) + "\n")
            sync.request()
        sync.flush()
        assert store.read_text("metrics.jsonl") == (run_dir / "metrics.jsonl").read_text()
    finally:
        sync.close()

    for fs, root in ((store.fs, f"{store.path}/ray_train"), (pafs.LocalFileSystem(), str(tmp_path / "trainer"))):
        for name in ("checkpoint-000002", "checkpoint-000004", "checkpoint-6", "other"):
            fs.create_dir(f"{root}/{name}")
            with fs.open_output_stream(f"{root}/{name}/a.pt") as f:
                f.write(b"x")
        assert sorted(remove_unregistered_checkpoints(fs, root, 2)) == ["checkpoint-000004", "checkpoint-6"]
        left = {i.base_name for i in fs.get_file_info(pafs.FileSelector(root))}
        assert left == {"checkpoint-000002", "other"}
        assert remove_unregistered_checkpoints(fs, f"{root}/missing", 0) == []


# ---------------------------------------------------------------- end to end on S3


def _registered(store) -> list[int]:
    """Steps of the checkpoints Ray Train registered, as the bucket holds them."""
    from tests.test_tune import registered_checkpoints

    return [int(name.rsplit("-", 1)[1]) for name in registered_checkpoints(store)]


@pytest.mark.slow
def test_killed_zero2_run_resumes_from_s3_with_empty_local_dirs(s3_server, tmp_path, capsys):
    """synth-grpo train (2 ranks, ZeRO-2, output.storage on S3) killed with its whole local Ray once Ray
    Train registered a checkpoint in the bucket; every local run directory deleted; the same command
    again resumes from the bucket: steps once each, both ranks' shards, the run's files, the doctor.
    A second `train` while the first runs exits 2 naming it; the rerun takes the dead one's lease over."""
    from pipeline.report.doctor import doctor_cli
    from pipeline.training.callbacks import read_metrics
    from pipeline.rundir.storage import RunStorage
    from tests.test_train_ray import resume_events, small, train_rows
    from tests.test_tune import signal_session

    storage, steps = f"s3://{BUCKET}/runs", 6
    data = small(tmp_path, distributed={"num_workers": 2, "zero_stage": 2, "cpus_per_worker": 0.5},
                 judge={"cpus_per_actor": 0.25}, optimization={"per_device_train_batch_size": 4, "max_steps": steps},
                 eval={"num_prompts": 2, "every_steps": steps}, output={"storage": storage, "save_steps": 2})
    data["output"]["run_name"] = "s3run"
    cfg_path, run_dir, store = tmp_path / "s3run.yaml", tmp_path / "s3run", RunStorage(storage, "s3run")
    cfg_path.write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "pipeline", "train", "--config", str(cfg_path), "--address", "local"]
    env = {**os.environ, "RAY_ADDRESS": ""}  # the AWS SDK's variables from the s3_server fixture reach moto
    with (tmp_path / "first.log").open("w") as out:  # a file: Ray's logs would fill a pipe no one reads
        first = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        deadline = time.time() + 600
        while time.time() < deadline and first.poll() is None and not store.exists(LEASE):
            time.sleep(0.2)
        # A second writer while the first holds the run (still starting): refused in seconds, naming the holder.
        t0 = time.monotonic()
        second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and time.monotonic() - t0 < 10, (second.stdout[-2000:], second.stderr[-2000:])
        assert f"pid {first.pid}" in second.stderr and "output.run_name" in second.stderr, second.stderr
        assert "[ray]" not in second.stdout and "Traceback" not in second.stderr, second.stdout + second.stderr
        while time.time() < deadline and first.poll() is None and not _registered(store):
            time.sleep(0.3)
        signal_session(first.pid, signal.SIGKILL)  # driver, local Ray and both workers at once, as a crash
        first.wait(timeout=60)
    at = _registered(store)
    assert at and at[-1] < steps, (at, (tmp_path / "first.log").read_text()[-3000:])
    step = at[-1]
    ckpt = f"ray_train/checkpoint-{step:06d}"
    files = store.list(ckpt)
    # One checkpoint holding both ranks' optimizer shards, the adapter and the trainer state.
    shards = [f for f in files if f.startswith(f"{ckpt}/global_step{step}/") and f.endswith("optim_states.pt")]
    assert sorted(Path(f).name.split("_mp_")[0] for f in shards) == ["zero_pp_rank_0", "zero_pp_rank_1"], files
    for name in ("trainer_state.json", "adapter_model.safetensors", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        assert f"{ckpt}/{name}" in files, (name, files)
    before = [r for r in map(json.loads, store.read_text("metrics.jsonl").splitlines()) if "reward" in r]
    assert [r["step"] for r in before][:step] == list(range(1, step + 1))  # the rows reached the bucket first

    shutil.rmtree(run_dir)  # a fresh cluster: no local run directory anywhere
    # What a bigger group that died before Ray Train registered its next checkpoint leaves behind: a part in
    # the bucket and one on this node's disk. This run saves that step again: it must not merge with them.
    nxt = step + 2
    stale = f"checkpoint-{nxt:06d}/global_step{nxt}/zero_pp_rank_5_mp_rank_00_optim_states.pt"
    with store.fs.open_output_stream(f"{store.path}/ray_train/{stale}") as f:
        f.write(b"a dead group's partition")
    local_stale = run_dir / "trainer" / f"checkpoint-{nxt}" / f"global_step{nxt}" / "zero_pp_rank_5_mp_rank_00_optim_states.pt"
    local_stale.parent.mkdir(parents=True)
    local_stale.write_bytes(b"a dead group's partition")

    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming" in again.stdout
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # up to the checkpoint from the bucket, then trained
    assert rows[:step] == before[:step] and resume_events(run_dir) == [step]
    # The killed holder's lease in the bucket (the local one went with the folder) was taken over, and said so.
    taken = [e for e in read_metrics(run_dir / "events.jsonl") if e["event"] == "lease_takeover"]
    assert [(e["previous"]["pid"], e["where"]) for e in taken] == [(first.pid, f"{store.uri}/{LEASE}")], taken
    assert "[lease] took over" in again.stdout and not store.exists(LEASE)  # released at the end
    remote = [r for r in store.read_text("metrics.jsonl").splitlines() if '"reward"' in r]
    assert len(remote) == steps
    saved_again = store.list(f"ray_train/checkpoint-{nxt:06d}")
    assert f"ray_train/checkpoint-{nxt:06d}/trainer_state.json" in saved_again and f"ray_train/{stale}" not in saved_again
    assert (run_dir / "trainer" / f"checkpoint-{nxt}" / "trainer_state.json").exists() and not local_stale.exists()
    last = store.list(f"ray_train/checkpoint-{steps:06d}")
    assert sum(f.endswith("optim_states.pt") for f in last) == 2, last
    # The run's files, readable with no node alive.
    files = store.list()
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "eval_samples.jsonl", "health.json", "length_changes.json",
                 "adapter/adapter_config.json", "adapter/adapter_model.safetensors"):
        assert name in files, (name, files)
    ckpt_rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "checkpoint/seconds" in r]
    assert steps in [r["step"] for r in ckpt_rows] and all(r["checkpoint/seconds"] > 0 for r in ckpt_rows)
    # The doctor reads the run straight from the bucket.
    capsys.readouterr()
    assert doctor_cli(type("A", (), {"run_dir": store.uri, "json": False})()) == 0
    out = capsys.readouterr()
    assert "metric lines, steps" in out.out and store.uri in out.err
    # The session's planted credentials signed every request and are nowhere at rest: not in any object in
    # the bucket, not in the run directory or the CLI's output (raw, hex or base64).
    assert not leaked_credentials([*bucket_objects(), *local_files(tmp_path)])


# ---------------------------------------------------------------- elastic worker counts


def test_elastic_range_keeps_samples_per_optimizer_step(tmp_path):
    from pipeline.config import ConfigError, load_config
    from pipeline.config import for_world_size, samples_per_step
    from pipeline.training.driver import build_trainer
    from pipeline.training.worker import build_grpo_config

    cfg = load_config(None, ["distributed.num_workers=[1, 2]", "optimization.per_device_train_batch_size=4",
                             "optimization.gradient_accumulation_steps=1", "generation.num_generations=4",
                             f"output.root={tmp_path}"])
    assert build_trainer(cfg, tmp_path / "run", pool=None).scaling_config.num_workers == (1, 2)
    per_step = {}
    for world in (1, 2):  # this process is one rank: TRL's generation batch counts one process's share
        args = build_grpo_config(for_world_size(cfg, world), tmp_path, False, True, [1.0] * 4)
        per_step[world] = (args.per_device_train_batch_size * world * args.gradient_accumulation_steps,
                           args.generation_batch_size * world)
    assert per_step[1] == per_step[2] == (8, 8) and samples_per_step(cfg) == 8
    fixed = load_config(None, ["distributed.num_workers=2"])
    assert build_trainer(fixed, tmp_path / "run2", pool=None).scaling_config.num_workers == 2

    with pytest.raises(ConfigError) as e:  # 3 x 1 samples cannot be split over 2 workers: refused, not rounded
        load_config(None, ["distributed.num_workers=[1, 3]", "optimization.per_device_train_batch_size=4",
                           "generation.num_generations=4"])
    assert "distributed.num_workers: [1, 3]" in str(e.value) and "2 worker(s)" in str(e.value)
    ok = load_config(None, ["distributed.num_workers=[1, 3]", "optimization.gradient_accumulation_steps=2",
                            "optimization.per_device_train_batch_size=4", "generation.num_generations=4"])
    assert [for_world_size(ok, n).optimization.gradient_accumulation_steps for n in (1, 2, 3)] == [6, 3, 2]
    for bad, words in (("[2, 1]", "min <= max"), ("[1, 2, 3]", "[min, max]")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"distributed.num_workers={bad}"])
        assert words in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["distributed.num_workers=[1, 2]", "distributed.zero_stage=3"])
    assert "zero_stage 3" in str(e.value)


@pytest.mark.slow
def test_zero2_optimizer_state_resharded_for_fewer_and_more_workers(tmp_path):
    """Adam moments and fp32 weights of a 2-rank ZeRO-2 checkpoint, loaded by 1 and by 3 ranks through
    pipeline.training.elastic.reshard, equal what the 2 ranks held (a reset would load zero moments)."""
    import torch

    from tests.zero_reshard import STATES

    def phase(name: str, world: int) -> None:
        proc = subprocess.run([sys.executable, "-m", "tests.zero_reshard", name, str(world), str(tmp_path),
                               str(free_port())], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    phase("save", 2)
    saved = torch.load(tmp_path / "saved.pt")
    assert len(saved) == 4 and all(saved[n]["exp_avg"].abs().sum() > 0 for n in saved)  # trained: moments exist
    for world in (1, 3):
        phase("load", world)
        loaded = torch.load(tmp_path / f"loaded-{world}.pt")
        assert loaded.keys() == saved.keys()
        for name, state in saved.items():
            for key in ("fp32", *STATES):
                assert torch.equal(loaded[name][key], state[key]), (world, name, key)


def test_a_checkpoint_that_cannot_be_resharded_falls_back_to_a_reset(tmp_path):
    """reshard names why it failed and leaves no half-written universal folder behind; the group then
    loads no optimizer state, with an optimizer_reset record naming the reason and a console line."""
    import torch

    from pipeline.seams.deepspeed_seams import zero_world_size as checkpoint_world_size
    from pipeline.training.elastic import reshard, reshard_for_group
    from pipeline.training.callbacks import read_metrics

    broken = tmp_path / "checkpoint-4"  # DeepSpeed's model states of 2 ranks, their partitions missing
    (broken / "global_step4").mkdir(parents=True)
    (broken / "latest").write_text("global_step4")
    torch.save({"dp_world_size": 2, "mp_world_size": 1}, broken / "global_step4" / "mp_rank_00_model_states.pt")
    assert checkpoint_world_size(broken) == 2
    dest = tmp_path / "universal"
    error = reshard(broken, dest, local_rank=0)
    assert isinstance(error, str) and error.split(":")[0].endswith(("Error", "Exception")), error
    assert not dest.exists()
    lines: list[str] = []
    assert reshard_for_group(broken, dest, 0, 4, 2, 1, run_dir=tmp_path, log=lines.append) is None
    reset = [e for e in read_metrics(tmp_path / "events.jsonl") if e["event"] == "optimizer_reset"]
    assert [(e["step"], e["previous"], e["num_workers"], e["reason"]) for e in reset] == [(4, 2, 1, error)]
    assert len(lines) == 1 and "optimizer state reset at step 4" in lines[0] and error in lines[0]
    assert checkpoint_world_size(tmp_path) is None  # no ZeRO checkpoint: nothing to reshard
    assert reshard(broken, dest, local_rank=1) is None  # not the converting rank (and no process group here)


# ---------------------------------------------------------------- a node lost mid-run


NODE_TESTS = {  # scenario of tests/multinode.py -> the test that asserts on it
    "elastic": "test_node_lost_elastic_run_goes_on_with_one_worker_and_grows_back",
    "fixed": "test_node_lost_fixed_count_resumes_from_s3_on_a_replacement_node",
    "shared": "test_plain_folder_storage_on_two_nodes_trains_and_resumes_without_the_local_run_dir",
}


@pytest.fixture(scope="module")
def node_scenarios(request, s3_server, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The scenarios of the selected tests among NODE_TESTS, run in turn on one multi-node cluster in one
    process (starting a cluster and that process cost half a minute each on 2 cores)."""
    import tempfile

    from tests.multinode import SCENARIOS

    selected = {item.originalname for item in request.session.items}
    scenarios = [s for s in SCENARIOS if NODE_TESTS[s] in selected]
    workdir = tmp_path_factory.mktemp("nodes")
    # Its own Ray temp root: the cluster's address file must not send another process's ray.init() to it.
    ray_tmp = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.multinode", str(workdir), f"s3://{BUCKET}/nodes",
                               str(workdir / "nfs" / "runs"), *scenarios],
                              cwd=REPO, capture_output=True, text=True, timeout=600 + 600 * len(scenarios),
                              env={**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    (workdir / "scenario.log").write_text(proc.stdout + proc.stderr)  # Ray Train's restarts and their causes
    return workdir, proc


def _scenario(node_scenarios, scenario: str) -> dict:
    workdir, proc = node_scenarios
    result_path = workdir / f"result-{scenario}.json"
    assert result_path.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(result_path.read_text())
    assert result["ok"], (result, proc.stderr[-5000:])
    return result


def _check_steps_once_and_samples_constant(run_dir: Path, steps: int) -> list[dict]:
    from pipeline.training.callbacks import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(isinstance(r.get("rewards/judge/mean"), float) for r in rows)  # every step had its judge scores
    events = read_metrics(run_dir / "events.jsonl")
    starts = [e for e in events if e["event"] in ("workers", "resize")]
    assert len(starts) >= 2 and len({e["samples_per_step"] for e in starts}) == 1, starts
    assert len({e["generation_batch_size"] for e in starts}) == 1, starts  # TRL's, across all workers
    return events


@pytest.mark.slow
def test_node_lost_elastic_run_goes_on_with_one_worker_and_grows_back(node_scenarios):
    from tests.multinode import ELASTIC_STEPS

    result = _scenario(node_scenarios, "elastic")
    assert result["removed"] in result["training_nodes"]
    # a judge on each worker node (SPREAD): the lost node's judge was restarted by Ray on the node left
    # before the group trained on, and every step was scored (_check_steps_once_and_samples_constant)
    assert sorted(j["node"] for j in result["judge_nodes"]) == sorted(result["training_nodes"]), result
    lost = [i for i, j in enumerate(result["judge_nodes"]) if j["node"] == result["removed"]]
    for at in (result["judges_at_shrink"][lost[0]], result["judges_at_end"][lost[0]]):
        assert at["restarts"] >= 1 and at["state"] == "ALIVE" and at["node"] != result["removed"], result
    assert result["step_at_removal"] < ELASTIC_STEPS and result["step_at_replacement"] < ELASTIC_STEPS, result
    assert result["grow_decided"], result  # the group of one was held until Ray Train decided to grow (no race)
    events = _check_steps_once_and_samples_constant(node_scenarios[0] / "node-loss-elastic", ELASTIC_STEPS)
    resize = [(e["previous"], e["num_workers"], e["gradient_accumulation_steps"]) for e in events if e["event"] == "resize"]
    assert resize == [(2, 1, 2), (1, 2, 1)], events  # down to one worker when the node went, back up when it came
    at = [e["step"] for e in events if e["event"] == "resize"]
    assert at[0] < at[1], events  # it trained on one worker in between
    # ZeRO-2 partitions of 2 ranks resharded for 1, then those of 1 for 2 (DeepSpeed universal checkpoints);
    # a start that failed and was retried before the next checkpoint reshards that checkpoint again
    resharded = [(e["previous"], e["num_workers"]) for e in events if e["event"] == "optimizer_resharded"]
    assert [t for i, t in enumerate(resharded) if resharded[i - 1: i] != [t]] == [(2, 1), (1, 2)], events
    assert not [e for e in events if e["event"] == "optimizer_reset"], events


@pytest.mark.slow
def test_node_lost_fixed_count_resumes_from_s3_on_a_replacement_node(node_scenarios):
    from pipeline.rundir.storage import RunStorage

    from tests.multinode import STEPS

    result = _scenario(node_scenarios, "fixed")
    assert result["step_at_removal"] < STEPS and result["steps_while_waiting"] < STEPS  # it waited for a node
    events = _check_steps_once_and_samples_constant(node_scenarios[0] / "node-loss-fixed", STEPS)
    assert not [e for e in events if e["event"] in ("resize", "optimizer_reset", "optimizer_resharded")], events
    resumed = [e for e in events if e["event"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["time"] > result["added_at"], (events, result)  # not before the node came
    files = RunStorage(f"s3://{BUCKET}/nodes", "node-loss-fixed").list(f"ray_train/checkpoint-{STEPS:06d}")
    assert sum(f.endswith("optim_states.pt") for f in files) == 2, files


@pytest.mark.slow
def test_plain_folder_storage_on_two_nodes_trains_and_resumes_without_the_local_run_dir(node_scenarios):
    """output.storage a plain folder (standing in for NFS) shared by a two-node cluster: the CLI takes a run
    name the folder has never seen (the write probe creates its folder), uploads the adapter's folder at
    the end, and the same command with the local run directory deleted resumes from the folder."""
    from pipeline.training.callbacks import read_metrics
    from pipeline.rundir.storage import RunStorage

    workdir = node_scenarios[0]
    shared = workdir / "nfs" / "runs"
    result = _scenario(node_scenarios, "shared")
    print(f"two runs: {result['seconds']:.0f} s (first run {result['first_seconds']:.0f} s; "
          f"the cluster started in {result['cluster_seconds']:.0f} s)")
    run_dir, kept = workdir / "shared-run", shared / "shared-run"
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # steps 1-2 from the folder, 3-4 trained after the resume
    assert [e["step"] for e in read_metrics(run_dir / "events.jsonl") if e["event"] == "resume"] == [2]
    files = RunStorage(str(shared), "shared-run").list()
    for name in ("config.yaml", "metrics.jsonl", "summary.txt", "adapter/adapter_model.safetensors",
                 "ray_train/checkpoint_manager_snapshot.json", "ray_train/checkpoint-000004/trainer_state.json"):
        assert name in files, (name, files)
    assert (kept / "metrics.jsonl").read_text() == (run_dir / "metrics.jsonl").read_text()
