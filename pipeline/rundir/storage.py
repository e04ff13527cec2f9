"""Run storage beyond one machine: ``output.storage`` (s3://, gs://, abfs:// or a path).

Ray Train persists checkpoints there (``RunConfig(storage_path, storage_filesystem)``); this module
adds what Ray does not: a pyarrow filesystem that carries no credentials (each process that uses it,
the driver, a Tune trial, a Ray Train worker, finds its own through the provider's default chain:
environment, ``~/.aws/credentials``, an instance role), a write check before any model loads, each
rank's own part of a checkpoint, and the run's files (metrics, samples, adapter, ...) copied up in a
background thread so a run can be read, resumed and diagnosed with no node alive.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import threading
import uuid
from pathlib import Path

from pipeline.rundir.files import (CONFIG, DRIVER_FILES, METRICS, RAY_TRAIN_DIR, SUMMARY, WORKER_DIRS, WORKER_FILES,
                                   replaced_atomically, run_name_problem, write_atomic)


class StorageError(ValueError):
    """output.storage cannot be reached or written."""


# A run's name is its folder in storage and under output.root: one path component, nothing that walks.
def name_problem(name: str, field: str) -> str | None:
    """Why ``name`` cannot name a run (or a search) folder, as one line naming ``field``; None when it can
    (``run_files.run_name_problem``, the config's rule for ``output.run_name``)."""
    why = run_name_problem(name)
    return f"{field}: {why}: it names the run's folder under output.root and in output.storage" if why else None


def is_uri(location: str | None) -> bool:
    return bool(location) and "://" in str(location) and not str(location).startswith("file://")


def redacted(location: str) -> str:
    """``location`` with what could be a secret cut out (credentials before ``@``, a ``?query``), for messages."""
    location = str(location)
    if not is_uri(location):
        return location
    scheme, rest = location.split("://", 1)
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    if "@" in rest:  # the last one: a secret may hold '/' or '@' itself
        rest = "***@" + rest.rpartition("@")[2]
    return f"{scheme}://{rest}"


def check_location(location: str, field: str = "output.storage") -> None:
    """StorageError when a storage URI carries credentials (``user:secret@``) or a query string (where
    pyarrow also takes keys and SAS tokens): they would be pickled with the filesystem, logged and
    written with the run. The message shows the URI without them."""
    location = str(location)
    if not is_uri(location):
        return
    rest = location.split("://", 1)[1]
    userinfo = rest.rpartition("@")[0] if "@" in rest else ""
    if ":" in userinfo or "?" in rest:
        raise StorageError(
            f"{field}: {redacted(location)!r} has credentials or a query string in the URI; give the URI "
            "without them and the credentials through the environment or the provider's credential chain "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, an instance role; see docs/cluster.md \"Credentials\")")


def filesystem(location: str):
    """(pyarrow filesystem, path inside it) for a URI or a local path.

    No credentials are passed to pyarrow: pyarrow pickles explicit keys with the filesystem, and Ray
    Train and Tune pickle ``storage_filesystem`` into the experiment state they write to storage. Built
    without them, S3 takes the AWS SDK's default credential chain in whichever process unpickles it
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``~/.aws``, an instance or pod
    role); the endpoint and region travel with it. An ``AWS_ENDPOINT_URL`` (MinIO, Ceph, moto) may be http://.
    """
    import pyarrow.fs as pafs

    location = str(location).removeprefix("file://")
    if not is_uri(location):
        return pafs.LocalFileSystem(), str(Path(location).expanduser().resolve())
    check_location(location)
    scheme, rest = location.split("://", 1)
    if scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        kwargs = dict(
            region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            connect_timeout=5, request_timeout=30,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=3),
        )
        if endpoint:
            scheme_, _, host = endpoint.partition("://")
            if "@" in host.partition("/")[0]:
                raise StorageError("AWS_ENDPOINT_URL: credentials in the endpoint URL would travel with the run's "
                                   "filesystem; give the endpoint as scheme://host:port and the keys as AWS_ACCESS_KEY_ID / "
                                   "AWS_SECRET_ACCESS_KEY")
            kwargs.update(endpoint_override=host or scheme_, scheme=scheme_ if host else "https")
        return pafs.S3FileSystem(**kwargs), rest.strip("/")
    fs, path = pafs.FileSystem.from_uri(location)
    return fs, path.rstrip("/")


def copy_atomic(src: Path, dest: Path) -> None:
    """``src`` copied to ``dest`` through a temporary file beside it and a rename (``files.write_atomic``
    for a file too large to hold in memory, such as a full model's shard): a reader of a shared disk,
    or a crash mid-copy, never finds half of it."""
    with open(src, "rb") as f, replaced_atomically(dest) as out:
        shutil.copyfileobj(f, out, 1 << 20)


def _is_local(fs) -> bool:
    import pyarrow.fs as pafs

    return isinstance(fs, pafs.LocalFileSystem)


class RunStorage:
    """One run's folder in storage: ``<output.storage>/<run_name>/`` (Ray Train's checkpoints under ``ray_train/``).

    Pickled to Tune trials and Ray Train workers with its filesystem, which holds no credentials (see
    ``filesystem``): each process that reads or writes storage authenticates from its own environment.
    A local or shared-disk location gets its folders created as files go in (an object store has none).
    """

    def __init__(self, location: str, run_name: str):
        self.location = str(location).rstrip("/")
        self.fs, base = filesystem(self.location)
        self.local = _is_local(self.fs)
        self.path = f"{base}/{run_name}"
        self.uri = f"{self.location}/{run_name}"

    def child(self, name: str) -> "RunStorage":
        """The folder ``name`` inside this one, on the same filesystem object (no credentials read again)."""
        import copy

        sub = copy.copy(self)
        sub.location, sub.path, sub.uri = self.uri, f"{self.path}/{name}", f"{self.uri}/{name}"
        return sub

    # -------------------------------------------------------------- queries
    def _info(self, rel: str):
        import pyarrow.fs as pafs

        return self.fs.get_file_info(f"{self.path}/{rel}" if rel else self.path), pafs.FileType

    def exists(self, rel: str) -> bool:
        info, ft = self._info(rel)
        return info.type != ft.NotFound

    def size(self, rel: str) -> int:
        info, ft = self._info(rel)
        return info.size if info.type == ft.File else -1

    def has_checkpoints(self) -> bool:
        """Whether Ray Train registered a checkpoint of this run (what a rerun resumes from)."""
        return self.exists(f"{RAY_TRAIN_DIR}/checkpoint_manager_snapshot.json")

    def read_text(self, rel: str) -> str:
        with self.fs.open_input_stream(f"{self.path}/{rel}") as f:
            return f.read().decode("utf-8")

    def list(self, rel: str = "") -> list[str]:
        """Every file below ``rel``, relative to the run's folder."""
        import pyarrow.fs as pafs

        if not self.exists(rel):
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(f"{self.path}/{rel}".rstrip("/"), recursive=True))
        return sorted(i.path[len(self.path) + 1:] for i in infos if i.type == pafs.FileType.File)

    # -------------------------------------------------------------- copies
    def _make_dir(self, path: str) -> None:
        """A folder (and its parents) on a local or shared disk; object stores need none."""
        if self.local:
            self.fs.create_dir(path, recursive=True)

    def push(self, run_dir: Path, names=(), dirs=()) -> list[str]:
        """Upload the named files and folders of ``run_dir`` that exist; what was uploaded."""
        import pyarrow.fs as pafs

        done = []
        for name in names:
            src = Path(run_dir) / name
            if src.is_file():
                self.write_bytes(name, src.read_bytes())
                done.append(name)
        for name in dirs:
            src = Path(run_dir) / name
            if not src.is_dir():
                continue
            if self.local:  # file by file, each whole or not at all, into folders made as needed
                for file in sorted(p for p in src.rglob("*") if p.is_file()):
                    dest = Path(self.path, name, file.relative_to(src))
                    self._make_dir(str(dest.parent))
                    copy_atomic(file, dest)
            else:  # an object put is whole or absent already
                pafs.copy_files(str(src), f"{self.path}/{name}", source_filesystem=pafs.LocalFileSystem(),
                                destination_filesystem=self.fs)
            done.append(name + "/")
        return done

    def write_bytes(self, rel: str, data: bytes) -> None:
        """One file, whole: an object put (atomic on S3, GCS, Azure); on a local or shared disk a temporary
        file renamed over the target, so a crash mid-write leaves the previous file."""
        dest = f"{self.path}/{rel}"
        if not self.local:
            with self.fs.open_output_stream(dest) as f:
                f.write(data)
            return
        self._make_dir(dest.rpartition("/")[0])
        write_atomic(Path(dest), data)

    def pull(self, run_dir: Path, names=(), dirs=(), only_larger: bool = True) -> list[str]:
        """Download the named files (and the files of the named folders) that storage holds; with ``only_larger`` a file
        is taken only when the local copy is missing or smaller (the run's files only grow, except
        for the truncation on resume, which happens after this)."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        done = []
        for name in names:
            size = self.size(name)
            dst = run_dir / name
            if size < 0 or (only_larger and dst.is_file() and dst.stat().st_size >= size):
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            with self.fs.open_input_stream(f"{self.path}/{name}") as f:
                tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:6]}")
                tmp.write_bytes(f.read())
            os.replace(tmp, dst)  # readers on this node never see half a file
            done.append(name)
        for name in dirs:
            if not (only_larger and (run_dir / name).exists()):
                done += self.pull(run_dir, self.list(name), only_larger=False)
        return done

    def download_run(self, dest: Path) -> Path:
        """Every run file (not the checkpoints) into ``dest``: the run as a local folder, e.g. for the doctor."""
        names = sorted({*DRIVER_FILES, *WORKER_FILES, SUMMARY}
                       | {n for n in self.list() if "/" not in n and n.startswith("config.")})
        self.pull(dest, names, WORKER_DIRS, only_larger=False)
        return dest


def check_writable(location: str, run_name: str) -> None:
    """Write, read back and delete a probe file in the run's storage folder (created on a local or shared
    disk, as the run will be); StorageError names why, never with credentials from the URI (``filesystem``
    refuses a URI that holds any)."""
    try:
        store = RunStorage(location, run_name)
        store._make_dir(store.path)
        probe = f".synth-grpo-probe-{uuid.uuid4().hex[:8]}"
        with store.fs.open_output_stream(f"{store.path}/{probe}") as f:
            f.write(b"ok")
        if store.read_text(probe) != "ok":
            raise OSError("a file written there reads back different")
        store.fs.delete_file(f"{store.path}/{probe}")
    except StorageError:
        raise
    except Exception as e:  # pyarrow raises OSError subclasses, ValueError for bad URIs, ArrowException...
        msg = " ".join(str(e).split())
        raise StorageError(f"output.storage: {redacted(location)!r} cannot be written ({type(e).__name__}: {msg[:400]}); "
                           "check the bucket or path, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL") from e


# ------------------------------------------------------------------ checkpoints: each rank its own part

# Files DeepSpeed and the HF Trainer write per rank: ZeRO partitions and the RNG state of each process.
_RANK_FILE = re.compile(r"(?:zero_pp_rank_|rng_state_)(\d+)[_.]")


def file_rank(name: str) -> int | None:
    """The rank that wrote a per-rank checkpoint file (a ZeRO partition or RNG state), None for a shared one."""
    m = _RANK_FILE.search(name)
    return int(m.group(1)) if m else None


def rank_part(checkpoint_dir: Path, rank: int, dest: Path) -> Path:
    """Hard links (copies across filesystems) of the files ``rank`` owns in an HF checkpoint folder.

    Rank 0 owns the shared files (trainer state, adapter, scheduler) and its own shards; rank k only
    its ZeRO partitions and RNG state. Reported by every rank to ``ray.train.report``, Ray Train merges
    the parts into one checkpoint, so a node's local disk need not be shared with any other.
    """
    checkpoint_dir = Path(checkpoint_dir)
    shutil.rmtree(dest, ignore_errors=True)  # a part left by an attempt that died at this step
    for src in sorted(p for p in checkpoint_dir.rglob("*") if p.is_file()):
        if (file_rank(src.name) or 0) != rank:
            continue
        dst = dest / src.relative_to(checkpoint_dir)
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    dest.mkdir(parents=True, exist_ok=True)
    return dest


_CHECKPOINT_DIR = re.compile(r"checkpoint-(\d+)")


def remove_unregistered_checkpoints(fs, root: str, after_step: int) -> list[str]:
    """Delete the checkpoint folders under ``root`` (a pyarrow filesystem path) past ``after_step``.

    A group starts from Ray Train's latest registered checkpoint; folders of later steps are parts a
    group that died before their registration left behind. The new group saves those steps again into
    the same folders, and where it is smaller the dead group's higher ranks' ZeRO partitions would stay
    beside its own: a checkpoint of mixed groups, which DeepSpeed and the universal conversion misread.
    Called by rank 0 (for Ray Train's storage) and each node's local rank 0 (for HF's local folder)
    before the trainer starts; no rank saves before every rank has started.
    """
    import pyarrow.fs as pafs

    removed = []
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        m = _CHECKPOINT_DIR.fullmatch(info.base_name)
        if m and info.type == pafs.FileType.Directory and int(m.group(1)) > after_step:
            fs.delete_dir(info.path)
            removed.append(info.base_name)
    return removed


# ------------------------------------------------------------------ the run's files, synced in the background

# What an object store answers when waiting cannot help (pyarrow's "AWS Error <CODE> ..." and the XML codes).
_PERMANENT_CODES = ("ACCESS_DENIED", "NO_SUCH_BUCKET", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH",
                    "AccessDenied", "NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled")
_PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EROFS,
                     errno.ENOSPC, errno.EDQUOT, errno.EEXIST, errno.ENAMETOOLONG}  # EEXIST: a file where a folder must be


def retry_cannot_fix(error: BaseException) -> bool:
    """Whether a storage error would come back on a retry (denied, no such bucket or folder, read-only, full,
    a file where a folder must be):
    such an error stops a run at once, where Ray Train would otherwise rerun the group from its checkpoint."""
    cause = error.__cause__ if isinstance(error.__cause__, BaseException) else None
    if cause is not None and retry_cannot_fix(cause):
        return True
    if isinstance(error, OSError) and error.errno in _PERMANENT_ERRNOS:
        return True
    return any(code in str(error) for code in _PERMANENT_CODES)



class RunFileSync:
    """Rank 0 copies the run's files to storage in a thread: ``request()`` after a write, ``close()`` at the end.

    Uploads never block a training step (but ``flush``, before a checkpoint is reported); a failed
    upload is retried at the next request and the last error is kept (``close`` raises it, so a run
    never ends with storage silently behind).
    """

    def __init__(self, store: RunStorage, run_dir: Path, interval_s: float = 2.0):
        self.store, self.run_dir, self.interval_s = store, Path(run_dir), interval_s
        self._wake, self._stop = threading.Event(), threading.Event()
        self._lock = threading.Lock()  # one upload at a time: the thread's, or flush's
        self._dirs_due = False
        self.error: Exception | None = None
        self.uploads = 0
        self._thread = threading.Thread(target=self._loop, name="synth-grpo-storage-sync", daemon=True)
        self._thread.start()

    def request(self, dirs: bool = False) -> None:
        self._dirs_due |= dirs
        self._wake.set()

    def flush(self) -> None:
        """Upload the files now, in the caller's thread: storage then has every row written so far."""
        with self._lock:
            dirs, self._dirs_due = self._dirs_due, False
            try:
                self.store.push(self.run_dir, WORKER_FILES, WORKER_DIRS if dirs else ())
                self.uploads += 1
                self.error = None
            except Exception as e:  # keep training; try again at the next request
                self.error = e
                self._dirs_due |= dirs

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._wake.wait(timeout=60):
                self._wake.clear()
                self.flush()
                self._stop.wait(self.interval_s)  # at most one upload per interval

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=120)
        self._dirs_due = True
        self.flush()
        if self.error is not None:
            raise OSError(f"output.storage: could not copy the run's files to {self.store.uri}: {self.error}") from self.error


def run_store(cfg, run_dir: Path | None = None, name: str | None = None) -> RunStorage | None:
    """The run's storage folder ``<output.storage>/<name>``, or None without ``output.storage``.

    Keyed on the run's name (``name``, else ``output.run_name``; the run directory's own name only where
    neither is set), never on a path: two run directories of one name in different places would share it.
    """
    if not cfg.output.storage:
        return None
    return RunStorage(cfg.output.storage, name or cfg.output.run_name or Path(run_dir).name)


def sync_callback(sync: RunFileSync):
    """A TrainerCallback that asks ``sync`` for an upload after each log and each checkpoint."""
    from transformers import TrainerCallback

    class StorageSync(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            sync.request()

        def on_save(self, args, state, control, **kwargs):
            sync.request()

    return StorageSync()


def local_copy(uri: str, cache: Path | None = None) -> Path:
    """A run in storage (``<output.storage>/<run_name>``) downloaded to a local folder, for reading."""
    location, _, name = str(uri).rstrip("/").rpartition("/")
    base = cache or Path(os.environ.get("SYNTH_GRPO_CACHE", Path.home() / ".cache" / "synth-grpo")) / "storage-runs"
    shown = redacted(uri)
    try:
        check_location(uri, field="STORAGE_URI")
        store = RunStorage(location, name)
        if not store.exists(CONFIG) and not store.exists(METRICS):
            raise StorageError(f"{shown}: no run there (neither {CONFIG} nor {METRICS})")
        return store.download_run(base / re.sub(r"[^\w.-]+", "_", shown.split("://", 1)[-1]))
    except StorageError:
        raise
    except Exception as e:
        raise StorageError(f"{shown}: cannot read the run ({type(e).__name__}: {' '.join(str(e).split())[:400]})") from e
