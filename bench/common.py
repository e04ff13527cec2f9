"""The prologue every benchmark shares: the repository root, an offline Hugging Face environment
(set on import, before transformers reads it: the benchmarks read only local files), a local Ray,
the machine line of a result and its ``--json`` printing."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def init_local_ray() -> None:
    """A Ray of this machine's CPUs, quiet: the benchmark prints its own table."""
    import ray  # lazy: only the benchmarks that train start Ray

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False)


def machine(with_platform: bool = False) -> str:
    """The machine a result was measured on, as the results' "machine" field reads."""
    return f"{os.cpu_count()} CPUs" + (f", {sys.platform}" if with_platform else "")


def print_json(result: Any, indent: int | None = 1, **kwargs: Any) -> None:
    """A result as the one JSON object ``--json`` prints."""
    print(json.dumps(result, indent=indent, **kwargs), flush=True)
