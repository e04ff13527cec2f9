"""One writer per run: the lease (pipeline/rundir/lease.py) on a local folder, a plain-folder storage and
S3 (moto's server), the CLI refusing a held run or search before Ray, and whole-file writes that a
crash cannot leave half done. Two real `synth-grpo train` on one run (refused, then a takeover after
SIGKILL that resumes) are part of tests/test_storage.py's killed ZeRO-2 run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.rundir.files import LEASE, read_metrics
from pipeline.rundir.lease import LeaseHeld, RunLease, dead_because
from tests.conftest import BUCKET, REPO


@pytest.fixture
def quick(monkeypatch):
    """Heartbeats every 0.2 s, dead after 5 s without one, storage leases settle for 0.3 s."""
    monkeypatch.setenv("SYNTH_GRPO_LEASE_HEARTBEAT_S", "0.2")
    monkeypatch.setenv("SYNTH_GRPO_LEASE_STALE_S", "5")
    monkeypatch.setenv("SYNTH_GRPO_LEASE_SETTLE_S", "0.3")


def holder(**kw) -> dict:
    """A lease record as another process would have written it."""
    now = time.time()
    return {"token": "other", "host": "elsewhere", "pid": 4242, "pid_started": None, "job_id": "raysubmit_X",
            "command": "train", "started": now - 100, "heartbeat": now, **kw}


@pytest.fixture
def sleeper():
    """A live process on this host that is not the test (a holder that is alive)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # exited and reaped: the pid names no process
    return proc.pid


def check_slot(read, plant, folder_lease, events_dir: Path, sleeper, store=None) -> None:
    """The lease's rules on one place: acquire, refuse a live holder, take over a stale or dead one, release."""
    a = RunLease(folder_lease[0], store=folder_lease[1], log=None).acquire()
    mine = read()
    assert mine["token"] == a.token and mine["host"] == socket.gethostname() and mine["pid"] == os.getpid()
    with pytest.raises(LeaseHeld) as e:
        RunLease(folder_lease[0], store=folder_lease[1], log=None).acquire()
    text = str(e.value)
    assert f"pid {os.getpid()}" in text and f"host {socket.gethostname()}" in text
    assert re.search(r"last heartbeat [01] s ago", text), text
    assert "output.run_name" in text and "taken over automatically" in text
    assert read()["token"] == a.token  # the refused start left the lease as it was
    a.release()
    assert read() is None

    cases = {
        "fresh, another host": (holder(), False),
        "fresh, this host, alive": (holder(host=socket.gethostname(), pid=sleeper.pid), False),
        "stale, another host": (holder(heartbeat=time.time() - 10), True),
        "fresh, this host, process gone": (holder(host=socket.gethostname(), pid=gone_pid()), True),
        "fresh, this host, pid reused": (holder(host=socket.gethostname(), pid=sleeper.pid, pid_started=1.0), True),
    }
    for name, (rec, taken) in cases.items():
        plant(rec)
        lease = RunLease(folder_lease[0], store=folder_lease[1], log=None)
        if not taken:
            with pytest.raises(LeaseHeld) as e:
                lease.acquire()
            assert f"pid {rec['pid']}" in str(e.value) and read()["token"] == "other", name
            continue
        lease.acquire()
        try:
            assert read()["token"] == lease.token, name
            assert [t["previous"]["pid"] for t in lease.taken_over] == [rec["pid"]], name
            lease.record_takeovers(events_dir)
        finally:
            lease.release()
    events = [e for e in read_metrics(events_dir / "events.jsonl") if e["event"] == "lease_takeover"]
    assert len(events) == 3 and {e["previous"]["host"] for e in events} == {"elsewhere", socket.gethostname()}
    assert re.match(r"no heartbeat for 1\d s", events[0]["why"]) and "is gone from this host" in events[1]["why"]


def test_local_lease_acquire_refuse_takeover_release(tmp_path, quick, sleeper):
    run = tmp_path / "run"
    path = run / LEASE

    def read():
        return json.loads(path.read_text()) if path.exists() else None

    def plant(rec):
        run.mkdir(exist_ok=True)
        path.write_text(json.dumps(rec))

    check_slot(read, plant, (run, None), run, sleeper)
    assert sorted(p.name for p in run.iterdir()) == ["events.jsonl"]  # no temporary or moved lease left behind
    empty = tmp_path / "never-written"
    RunLease(empty, log=None).acquire().release()
    assert not empty.exists()  # a folder the lease alone created goes with it


def test_storage_lease_on_s3_and_two_starts_at_once(s3_server, tmp_path, quick, sleeper):
    from pipeline.rundir.storage import RunStorage

    store = RunStorage(f"s3://{BUCKET}/leases", "run")

    def read():
        return json.loads(store.read_text(LEASE)) if store.exists(LEASE) else None

    def plant(rec):
        store.write_bytes(LEASE, json.dumps(rec).encode())

    check_slot(read, plant, (tmp_path / "local", store), tmp_path, sleeper, store)
    assert not (tmp_path / "local" / LEASE).exists()

    # Two starts at the same moment on two machines (own local folders, one bucket): one holds it.
    won, refused = [], []
    barrier = threading.Barrier(2)

    def start(i):
        lease = RunLease(tmp_path / f"machine{i}", store=RunStorage(f"s3://{BUCKET}/leases", "race"), log=None)
        barrier.wait()
        try:
            won.append(lease.acquire())
        except LeaseHeld as e:
            refused.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(won) == 1 and len(refused) == 1, (won, refused)
    assert json.loads(RunStorage(f"s3://{BUCKET}/leases", "race").read_text(LEASE))["token"] == won[0].token
    assert sum((tmp_path / f"machine{i}" / LEASE).exists() for i in range(2)) == 1  # the refused start let go of its own
    won[0].release()


def test_plain_folder_storage_uses_the_atomic_file(tmp_path, quick):
    from pipeline.rundir.lease import LocalSlot, slot_for_store
    from pipeline.rundir.storage import RunStorage

    store = RunStorage(str(tmp_path / "shared"), "run")
    assert isinstance(slot_for_store(store), LocalSlot)
    a = RunLease(tmp_path / "a", store=store, log=None).acquire()
    with pytest.raises(LeaseHeld, match="shared/run/.lease.json"):
        RunLease(tmp_path / "b", store=store, log=None).acquire()  # another machine: its own run dir, the same share
    assert not (tmp_path / "b").exists()
    a.release()
    assert not (tmp_path / "shared" / "run" / LEASE).exists()


def test_heartbeat_renews_and_a_lease_taken_over_stops_its_old_holder(tmp_path, quick):
    lost = threading.Event()
    lease = RunLease(tmp_path, log=None, on_lost=lambda why: lost.set()).acquire()
    first = json.loads((tmp_path / LEASE).read_text())["heartbeat"]
    time.sleep(0.7)
    assert json.loads((tmp_path / LEASE).read_text())["heartbeat"] > first
    assert dead_because(json.loads((tmp_path / LEASE).read_text())) is None
    (tmp_path / LEASE).unlink()  # removed by hand: the next heartbeat writes it again
    time.sleep(0.7)
    assert json.loads((tmp_path / LEASE).read_text())["token"] == lease.token and not lost.is_set()
    (tmp_path / LEASE).write_text(json.dumps(holder()))  # what a process that judged it stale left there
    assert lost.wait(5) and "taken over by host elsewhere" in lease.lost
    lease.release()
    assert json.loads((tmp_path / LEASE).read_text())["token"] == "other"  # the new holder's lease stays


def test_held_run_exits_2_before_ray_naming_the_holder(tmp_path, sleeper, capsys):
    """The CLI end to end, with a second `train` on a live run, its SIGKILL and the takeover by a rerun
    that resumes: tests/test_storage.py's killed ZeRO-2 run (its two starts are paid once there)."""
    from pipeline.cli.main import main

    run = tmp_path / "held"
    run.mkdir()
    (run / LEASE).write_text(json.dumps(holder(host=socket.gethostname(), pid=sleeper.pid, job_id=None)))
    t0 = time.monotonic()
    code = main(["train", "--set", f"output.root={tmp_path}", "--set", "output.run_name=held"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - t0 < 10, err
    assert f"pid {sleeper.pid} on {socket.gethostname()}" in err and "output.run_name" in err, err
    assert sorted(p.name for p in run.iterdir()) == [LEASE]  # no config written, no Ray started


def test_held_search_exits_2_before_ray_naming_the_holder(tmp_path, sleeper, capsys):
    from pipeline.cli.main import main

    exp = tmp_path / "search"
    exp.mkdir()
    (exp / LEASE).write_text(json.dumps(holder(host=socket.gethostname(), pid=sleeper.pid, command="tune")))
    code = main(["tune", "--space", str(REPO / "tune_spaces" / "default.yaml"), "--name", "search",
                 "--set", f"output.root={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and f"pid {sleeper.pid}" in err and "--name" in err and "raysubmit_X" in err, err
    assert sorted(p.name for p in exp.iterdir()) == [LEASE]  # nothing of a search written


CRASH = """
import os, signal, sys
from pathlib import Path
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # the crash: after the bytes, before the rename
kind, path = sys.argv[1], Path(sys.argv[2])
if kind == "file":
    from pipeline.rundir.files import write_atomic
    write_atomic(path, "new " * 100000)
else:
    from pipeline.rundir.storage import RunStorage
    src = path.parent / "src"
    src.mkdir()
    (src / path.name).write_text("new " * 100000)
    RunStorage(str(path.parent.parent), path.parent.name).push(src, [path.name])
"""


@pytest.mark.parametrize("kind", ["file", "local storage"])
def test_a_whole_file_write_killed_midway_leaves_the_old_file(tmp_path, kind):
    path = tmp_path / "store" / "run" / "config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("old: 1\n")
    proc = subprocess.run([sys.executable, "-c", CRASH, kind, str(path)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert path.read_text() == "old: 1\n"


def test_sigterm_releases_the_lease(tmp_path):
    """`ray job stop` sends the driver SIGTERM: the command ends as on an exit, its lease removed, so
    the next submission needs no takeover (and none from another host waits out the stale bound)."""
    code = f"""
import time
from pathlib import Path
from pipeline.rundir.lease import Leases
with Leases() as leases:
    leases.take(Path({str(tmp_path)!r}), None, "train")
    print("held", flush=True)
    time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held" and (tmp_path / LEASE).exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not (tmp_path / LEASE).exists()
