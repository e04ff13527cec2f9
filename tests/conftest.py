"""Shared fixtures: offline environment, one tiny-model cache per session, one local Ray per session."""

from __future__ import annotations

import os
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
