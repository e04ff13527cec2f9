"""One writer per run: a lease on the run directory and on its folder in ``output.storage``.

Resuming is "run the same command again", so nothing else stops a second `synth-grpo train` (or a
second Ray job) from resuming a run a live process still writes: it would rewrite ``metrics.jsonl``
under the first and delete the checkpoint folders past its own start step. The CLI therefore takes
a lease before it writes anything and holds it until it returns:

- ``<run dir>/.lease.json`` (``run_files.LEASE``), created with a hard link from a complete
  temporary file (atomic, like O_CREAT|O_EXCL, also on NFS), for runs on one machine or a shared disk;
- with ``output.storage``, ``<storage>/<run_name>/.lease.json`` with the same content: the one place
  Ray jobs on different machines share.

A lease holds the holder's host, pid (and the pid's start time, so a reused pid is not taken for
the holder), the Ray job submission id when run by `ray job submit`, the command, the start time
and a heartbeat that a daemon thread renews every ``SYNTH_GRPO_LEASE_HEARTBEAT_S`` seconds
(default 10). A second writer exits 2 naming the holder. A lease is dead, and is taken over with a
``lease_takeover`` event, when its heartbeat is older than ``SYNTH_GRPO_LEASE_STALE_S`` seconds
(default max(60, 3 heartbeats)), or at once when its holder ran on this host and that process is
gone (a killed job resubmitted on the same head node). Heartbeat ages compare wall clocks of two
machines: keep their clocks in sync (NTP) or the bound absorbs the skew.

S3 (and GCS, Azure through pyarrow) has no atomic create that pyarrow exposes: arrow's S3 client
does not send ``If-None-Match`` (apache/arrow#44281). A storage lease is therefore written, left to
settle for ``SYNTH_GRPO_LEASE_SETTLE_S`` seconds (default 1) and read back: of two writers that
start together, the one whose object is read back holds it. Two starts whose read and write are
further apart than the settle time cannot both win; two that interleave within it can, and then
the next heartbeat of one of them reads the other's token and stops it (``lost``): the honest limit
is a window of about a second between two starts, closed within one heartbeat.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from pipeline.errors import cli_error
from pipeline.rundir.files import EVENTS, LEASE, append_event

HEARTBEAT_ENV, STALE_ENV, SETTLE_ENV = "SYNTH_GRPO_LEASE_HEARTBEAT_S", "SYNTH_GRPO_LEASE_STALE_S", "SYNTH_GRPO_LEASE_SETTLE_S"


def heartbeat_s() -> float:
    return float(os.environ.get(HEARTBEAT_ENV) or 10.0)


def stale_after_s() -> float:
    """Heartbeat age past which a holder counts as dead (no process renews its lease for that long)."""
    return float(os.environ.get(STALE_ENV) or max(60.0, 3 * heartbeat_s()))


def settle_s() -> float:
    return float(os.environ.get(SETTLE_ENV) or 1.0)


class LeaseHeld(RuntimeError):
    """Another live process holds the run's lease."""

    def __init__(self, where: str, holder: dict[str, Any], what: str = "run"):
        self.where, self.holder = where, holder
        stop = (f"stop its Ray job (ray job stop {holder['job_id']})" if holder.get("job_id")
                else f"end that process (pid {holder.get('pid')} on {holder.get('host')})")
        super().__init__(
            f"the {what} is being written by another process ({describe(holder)}; lease {where}); wait for it to "
            f"finish, {stop}, or use another {'--name' if what == 'search' else 'output.run_name'}; a lease whose "
            f"heartbeat is older than {stale_after_s():g} s is taken over automatically")


def ray_job_id() -> str | None:
    """The `ray job submit` submission id of this driver (from the job config Ray hands the entrypoint), else Ray's job id."""
    try:
        meta = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}").get("metadata") or {}
        if meta.get("job_submission_id"):
            return str(meta["job_submission_id"])
    except (ValueError, AttributeError):
        pass
    return os.environ.get("RAY_JOB_ID") or None


def _process_started(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def pid_alive(pid: int, started: float | None = None) -> bool:
    """Whether process ``pid`` runs on this host (and, when ``started`` is known, is the same process)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError, TypeError):
        return True  # exists (another user's), or not a pid we can judge: assume alive
    try:
        import psutil

        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped by its parent
            return False
        return started is None or abs(proc.create_time() - float(started)) < 1.0
    except ImportError:
        return True
    except Exception:  # psutil.NoSuchProcess: gone since os.kill looked
        return False


def record(command: str, token: str, started: float) -> dict[str, Any]:
    return {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "pid_started": _process_started(os.getpid()),
            "job_id": ray_job_id(), "command": command, "started": started, "heartbeat": time.time()}


def dead_because(holder: dict[str, Any], now: float | None = None) -> str | None:
    """Why ``holder`` no longer holds its lease, or None while it is alive."""
    now = time.time() if now is None else now
    if holder.get("host") == socket.gethostname() and not pid_alive(holder.get("pid"), holder.get("pid_started")):
        return f"its process (pid {holder.get('pid')}) is gone from this host"
    try:
        age = now - float(holder.get("heartbeat"))
    except (TypeError, ValueError):
        return "its lease is unreadable"
    if age > stale_after_s():
        return f"no heartbeat for {age:.0f} s (more than {stale_after_s():g} s)"
    return None


def describe(holder: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    parts = [f"host {holder.get('host')}", f"pid {holder.get('pid')}"]
    if holder.get("job_id"):
        parts.append(f"Ray job {holder['job_id']}")
    if holder.get("command"):
        parts.append(f"synth-grpo {holder['command']}")
    try:
        parts.append(f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(holder['started'])))}")
        parts.append(f"last heartbeat {max(0.0, now - float(holder['heartbeat'])):.0f} s ago")
    except (KeyError, TypeError, ValueError):
        pass
    return ", ".join(parts)


def _parse(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    return obj if isinstance(obj, dict) else {"host": "?", "pid": "?", "heartbeat": None}  # torn or foreign: stale


# ---------------------------------------------------------------- where a lease lives


class LocalSlot:
    """The lease file in a local (or shared-disk) folder: created by hard link (atomic), taken over by rename."""

    def __init__(self, folder: Path):
        self.folder, self.path = Path(folder), Path(folder) / LEASE
        self.where = str(self.path)
        self.made_folder = False  # removed again on release when nothing else was written there

    def read(self) -> dict[str, Any] | None:
        try:
            text = self.path.read_text(encoding="utf-8")
            if not text:  # being written (created without a hard link): as old as the file
                return {"host": "?", "pid": "?", "heartbeat": self.path.stat().st_mtime}
        except FileNotFoundError:
            return None
        return _parse(text)

    def _tmp(self, rec: dict) -> Path:
        tmp = self.folder / f".lease.{uuid.uuid4().hex[:8]}.tmp"
        tmp.write_text(json.dumps(rec), encoding="utf-8")
        return tmp

    def create(self, rec: dict) -> bool:
        """Our lease where there is none; False when another was there first."""
        if not self.folder.is_dir():
            try:
                self.folder.mkdir(parents=True)
                self.made_folder = True
            except FileExistsError:  # another start made it a moment ago
                pass
        tmp = self._tmp(rec)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: exclusive create, then the content
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(rec))
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def take_over(self, dead: dict, rec: dict) -> bool:
        """Replace the lease ``dead`` (as read) with ours; False when it changed since (someone else got there)."""
        moved = self.folder / f".lease.{rec['token']}.old"
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return self.create(rec)
        try:
            if _parse(moved.read_text(encoding="utf-8")) != dead:  # a fresh lease moved by mistake: put it back
                try:
                    os.link(moved, self.path)
                except FileExistsError:
                    pass
                return False
        finally:
            moved.unlink(missing_ok=True)
        return self.create(rec)

    def renew(self, rec: dict) -> bool:
        """Write our renewed lease; False (nothing written) when the lease is no longer ours."""
        current = self.read()
        if current is None:  # removed by hand: ours again, unless another start got there first
            return self.create(rec)
        if current.get("token") != rec["token"]:
            return False
        os.replace(self._tmp(rec), self.path)
        return True

    def release(self, token: str) -> None:
        current = self.read()
        if current is not None and current.get("token") == token:
            self.path.unlink(missing_ok=True)
        if self.made_folder:
            try:
                self.folder.rmdir()
            except OSError:  # the run wrote there: kept
                pass


class StorageSlot:
    """The lease object in a run's storage folder (``RunStorage``): write, settle, read back (see the module's docstring)."""

    def __init__(self, store):
        self.store = store
        self.where = f"{store.uri}/{LEASE}"

    def read(self) -> dict[str, Any] | None:
        try:
            return _parse(self.store.read_text(LEASE))
        except FileNotFoundError:  # pyarrow's "Path does not exist", on S3 as on a disk
            return None

    def _write(self, rec: dict) -> None:
        self.store.write_bytes(LEASE, json.dumps(rec).encode("utf-8"))

    def create(self, rec: dict) -> bool:
        self._write(rec)
        time.sleep(settle_s())
        back = self.read()
        return back is not None and back.get("token") == rec["token"]

    def take_over(self, dead: dict, rec: dict) -> bool:
        if self.read() != dead:
            return False
        return self.create(rec)

    def renew(self, rec: dict) -> bool:
        current = self.read()
        if current is not None and current.get("token") != rec["token"]:
            return False
        self._write(rec)  # ours, or removed by hand: ours again
        return True

    def release(self, token: str) -> None:
        current = self.read()
        if current is not None and current.get("token") == token:
            self.store.fs.delete_file(f"{self.store.path}/{LEASE}")


def slot_for_store(store):
    """A storage folder's lease: a plain folder (a shared disk) gets the atomic local file."""
    return LocalSlot(Path(store.path)) if store.local else StorageSlot(store)


# ---------------------------------------------------------------- the lease


class RunLease:
    """The lease on one run (or one search): ``acquire`` before writing, ``release`` on every way out.

    ``folder`` is the run directory (or the search's folder); ``store`` its storage folder, if any.
    """

    def __init__(self, folder: Path, store=None, command: str = "train", what: str = "run", log=print,
                 on_lost: Callable[[str], None] | None = None):
        self.folder, self.command, self.what, self.log = Path(folder), command, what, log
        self.slots = [LocalSlot(self.folder)] + ([slot_for_store(store)] if store is not None else [])
        self.token, self.started = uuid.uuid4().hex, time.time()
        self.rec = record(command, self.token, self.started)
        self.held: list = []
        self.taken_over: list[dict[str, Any]] = []  # (previous holder, why dead, where) of each lease taken over
        self.lost: str | None = None
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "RunLease":
        """Take every slot's lease, or release what was taken and raise LeaseHeld naming the holder."""
        try:
            for slot in self.slots:
                self._acquire(slot)
                self.held.append(slot)
        except BaseException:
            self.release()
            raise
        self._thread = threading.Thread(target=self._beat, name="synth-grpo-lease", daemon=True)
        self._thread.start()
        return self

    def _acquire(self, slot) -> None:
        for _ in range(3):  # a lease that changes under us while it is taken over: look again
            current = slot.read()
            if current is None:
                if slot.create(self.rec):
                    return
                continue
            why = dead_because(current)
            if why is None:
                raise LeaseHeld(slot.where, current, self.what)
            if slot.take_over(current, self.rec):
                self.taken_over.append({"previous": current, "why": why, "where": slot.where})
                if self.log:
                    self.log(f"[lease] took over the {self.what}'s lease from {describe(current)}: {why}")
                return
        raise LeaseHeld(slot.where, slot.read() or {}, self.what)

    def record_takeovers(self, run_dir: Path, store=None) -> None:
        """A ``lease_takeover`` event per lease taken over (after the run directory is prepared: a pull
        from storage would replace a shorter local events file)."""
        for t in self.taken_over:
            prev = t["previous"]
            append_event(run_dir, "lease_takeover", where=t["where"], why=t["why"],
                         previous={k: prev.get(k) for k in ("host", "pid", "job_id", "command", "started", "heartbeat")})
        if self.taken_over and store is not None:
            store.push(run_dir, [EVENTS])

    def renew(self) -> None:
        """One heartbeat on every slot; on finding the lease taken by another, ``lost`` and ``on_lost``."""
        self.rec = {**self.rec, "heartbeat": time.time()}
        for slot in list(self.held):
            try:
                ours = slot.renew(self.rec)
            except Exception as e:  # storage unreachable for a moment: try again at the next beat
                if self.log:
                    self.log(f"[lease] WARNING: could not renew {slot.where}: {type(e).__name__}: {e}")
                continue
            if not ours:
                self.held.remove(slot)
                now = slot.read() or {}
                self.lost = f"the lease {slot.where} was taken over by {describe(now)}"
                if self.log:
                    print(f"[lease] ERROR: {self.lost}; this process stops writing the {self.what}", file=sys.stderr)
                if self.on_lost is not None:
                    self.on_lost(self.lost)
                self._stop.set()
                return

    def _beat(self) -> None:
        while not self._stop.wait(heartbeat_s()):
            self.renew()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        for slot in reversed(self.held):
            try:
                slot.release(self.token)
            except Exception as e:  # a storage lease left behind is taken over once its heartbeat is stale
                if self.log:
                    self.log(f"[lease] WARNING: could not remove {slot.where}: {type(e).__name__}: {e}")
        self.held = []

    def __enter__(self) -> "RunLease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class Leases:
    """The CLI's leases, released on every way out of a command (``with Leases() as leases: ...``).

    A lease found taken over by another writer interrupts the main thread (``lost``): the command
    then stops with exit 1 instead of writing beside the new holder. SIGTERM (``ray job stop``, a
    scheduler's stop) ends the command as an exit does, so the leases are released at once and the
    next submission needs no takeover.
    """

    def __init__(self):
        self.leases: list[RunLease] = []
        self._sigterm = None

    def take(self, folder: Path, store=None, command: str = "train", what: str = "run") -> RunLease:
        import _thread

        lease = RunLease(folder, store, command, what, on_lost=lambda why: _thread.interrupt_main()).acquire()
        self.leases.append(lease)
        return lease

    @property
    def lost(self) -> str | None:
        return next((lease.lost for lease in self.leases if lease.lost), None)

    def __enter__(self) -> "Leases":
        if threading.current_thread() is threading.main_thread():
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        for lease in reversed(self.leases):
            lease.release()
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_holding_leases(command: str, body: Callable[[Leases], int]) -> int:
    """A CLI command's ``body(leases)``, its leases released on every way out; exit 1 when another writer
    took one over (the heartbeat interrupted the main thread): stop, never write beside it."""
    with Leases() as leases:
        try:
            return body(leases)
        except KeyboardInterrupt:
            if leases.lost:
                return cli_error(command, f"stopped: {leases.lost}", code=1)
            raise
