"""Shared fixtures: offline environment, one tiny-model cache per session, one local Ray per session."""

from __future__ import annotations

import base64
import os
import secrets
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Never reach a hub from a test; build the tiny models once into the repo's ignored cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("SYNTH_GRPO_CACHE", str(REPO / ".cache" / "synth-grpo"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray Train's controller polls its workers every 2 s (and registers their reports then): a run's end, a
# dead worker and each checkpoint were noticed up to 2 s late, in every run of the suite. Every Ray Train
# run a test starts, in this process or a subprocess, inherits the shorter interval; production keeps Ray's.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# vLLM's CPU build compiles each engine's model with inductor (C++), cached under ~/.cache/vllm: on a fresh
# machine such as CI's, the vLLM tests' fixture took 249 s instead of 186 s. VLLM_CPU_CI_ENV (vLLM's own
# CPU CI switch) traces the model once and runs it eagerly: 187 s from a fresh cache. Tests only; a
# user's run keeps vLLM's compiled path.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")

# This process builds HF-backend trainers only (vLLM runs in subprocesses and Ray workers): TRL would import
# vLLM with GRPOTrainer (seconds), and vLLM's logger keeps the stream it found, pytest's capture of one test,
# which is closed after it ("lost sys.stderr": the whole session died).
from pipeline.seams.trl_seams import keep_vllm_unloaded  # noqa: E402

keep_vllm_unloaded()

# Throwaway AWS credentials, unique to this session, planted before any Ray starts (every Ray worker and
# CLI subprocess inherits them): moto accepts any, the AWS SDK signs every request with them, and the
# storage tests assert that none of them reaches a bucket or a run folder. A real key in the developer's
# environment is replaced, never used. Planted once: a test's subprocess that imports this file keeps them.
CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
if os.environ.get("SYNTH_GRPO_TEST_CREDENTIALS") != "planted":
    _alphabet = string.ascii_letters + string.digits
    os.environ.update({var: "".join(secrets.choice(_alphabet) for _ in range(n))
                       for var, n in zip(CREDENTIAL_VARS, (20, 40, 64))}, SYNTH_GRPO_TEST_CREDENTIALS="planted")
    os.environ.pop("AWS_PROFILE", None)


def planted_credentials() -> dict[str, str]:
    return {var: os.environ[var] for var in CREDENTIAL_VARS}


def secret_forms(secret: str) -> list[bytes]:
    """The byte strings that contain ``secret`` wherever it is stored raw, hex-encoded (both cases; Tune's
    experiment state is hex of cloudpickle) or base64-encoded at any of the 3 byte alignments (plain and URL-safe)."""
    raw = secret.encode()
    forms = [raw, raw.hex().encode(), raw.hex().upper().encode()]
    for skip in range(3):  # the whole 3-byte groups of the secret, starting at each alignment
        part = raw[skip:][: (len(raw) - skip) // 3 * 3]
        forms += [base64.b64encode(part), base64.urlsafe_b64encode(part)]
    return forms


def leaked_credentials(blobs) -> list[str]:
    """``where: VAR (form)`` for each planted credential found in ``blobs`` ((where, bytes) pairs)."""
    forms = [(var, i, form) for var, value in planted_credentials().items() for i, form in enumerate(secret_forms(value))]
    kinds = ["raw", "hex", "HEX"] + [f"base64@{k}{u}" for k in range(3) for u in ("", "-urlsafe")]
    return [f"{where}: {var} ({kinds[i]})" for where, data in blobs for var, i, form in forms if form in data]


def local_files(*roots: Path):
    """(path, bytes) of every file below ``roots``."""
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if path.is_file() and not path.is_symlink():
                yield str(path), path.read_bytes()


def bucket_objects(prefix: str = ""):
    """(s3 URI, bytes) of every object in the test bucket (under ``prefix``), read through the AWS SDK's environment."""
    import pyarrow.fs as pafs

    from pipeline.rundir.storage import filesystem

    fs, root = filesystem(f"s3://{BUCKET}/{prefix}".rstrip("/"))
    for info in fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True)):
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as f:
                yield f"s3://{info.path}", f.read()


def shared_data_dir() -> Path | None:
    """../shared/data beside the repo (a session's checkout or CI's clone); None when absent."""
    for base in (REPO.parent / "shared", REPO.parent.parent / "shared"):
        if (base / "data").is_dir():
            return base / "data"
    return None


@pytest.fixture(scope="session")
def xquad_path() -> Path:
    data = shared_data_dir()
    path = data / "xquad-de" / "xquad.de.json" if data else None
    if path is None or not path.is_file():
        pytest.skip("../shared/data/xquad-de/xquad.de.json is absent: XQuAD tests need the shared folder beside the repo")
    return path


@pytest.fixture(scope="session")
def tiny_policy() -> Path:
    from pipeline.data.tiny_models import ensure_tiny

    return ensure_tiny()


@pytest.fixture(scope="session")
def ray_local():
    """One embedded local Ray for the whole session (starting Ray costs seconds on 2 cores)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    yield ray
    ray.shutdown()


BUCKET = "synth-runs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server in its own process; the AWS SDK's environment points this process at it.

    Yields the endpoint URL; the bucket ``synth-runs`` exists. Requests are signed with the session's planted
    credentials (above), which no filesystem carries: each process that touches the bucket (a Ray worker, a
    Tune trial, a CLI subprocess) finds them in its own environment, as a cluster node would. The endpoint
    and region travel with the pickled filesystem; a process that builds its own reads AWS_ENDPOINT_URL.
    """
    pytest.importorskip("moto.server", reason="moto[server] is in the test extra")
    import pyarrow.fs as pafs

    port = free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"moto-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"moto server did not start (see {log.name})")
                time.sleep(0.3)
        fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                               allow_bucket_creation=True)
        fs.create_dir(BUCKET)
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
