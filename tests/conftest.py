"""Shared fixtures: offline environment, one tiny-model cache per session, one local Ray per session."""

from __future__ import annotations

import os
import socket
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
    from pipeline.tiny import ensure_tiny

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

    Yields the endpoint URL; the bucket ``synth-runs`` exists. Workers get the filesystem pickled
    from the driver (as Ray Train ships storage_filesystem), so they need no environment of their own.
    """
    pytest.importorskip("moto.server", reason="moto[server] is in the test extra")
    import pyarrow.fs as pafs

    port = free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"moto-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ENDPOINT_URL": endpoint,
           "AWS_REGION": "us-east-1"}
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
        fs = pafs.S3FileSystem(access_key="testing", secret_key="testing", endpoint_override=f"127.0.0.1:{port}",
                               scheme="http", region="us-east-1", allow_bucket_creation=True)
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
