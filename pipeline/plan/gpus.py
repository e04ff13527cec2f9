"""GPU sizes for the memory planner: the presets `synth-grpo plan --gpu` accepts, a forgiving lookup by
name, and the memory of the GPU this process runs on."""

from __future__ import annotations

import re

from pipeline.plan.shapes import PlanError

GIB = 1024**3

# name: (nominal GB, GiB torch reports as total_memory). Usable capacity is what an allocation is
# checked against, and it is below the nominal size (e.g. "A10 24 GB" -> ~22.0 GiB in OOM messages).
GPU_PRESETS: dict[str, tuple[int, float]] = {
    "A10": (24, 22.0),
    "L4": (24, 22.0),
    "L40S": (48, 44.4),
    "RTX6000-Ada": (48, 47.4),
    "A6000": (48, 47.4),
    "A100-40": (40, 39.4),
    "A100-80": (80, 79.1),
    "H100": (80, 79.1),
    "H200": (141, 139.8),
}
_GPU_ALIASES = {
    "a10g": "A10", "l40": "L40S", "6000ada": "RTX6000-Ada", "rtx6000adageneration": "RTX6000-Ada",
    "rtxa6000": "A6000", "a100": "A100-40", "h10080": "H100", "h10094": "H100", "h200141": "H200",
}
_GPU_NOISE = {"nvidia", "geforce", "tesla", "quadro", "sxm", "sxm4", "sxm5", "pcie", "nvl", "gb", "gib", "hbm3", "hbm3e"}


def gpu_preset(name: str) -> tuple[str, float]:
    """Forgiving preset lookup: "a100-80", "A100 80GB", "NVIDIA H100 SXM", "l40s" -> (name, GiB)."""
    tokens = [t.removesuffix("gb") for t in re.split(r"[^a-z0-9]+", name.lower()) if t and t not in _GPU_NOISE]
    key = "".join(tokens)
    table = {re.sub(r"[^a-z0-9]", "", p.lower()): p for p in GPU_PRESETS}
    found = table.get(key) or _GPU_ALIASES.get(key)
    if found is None:
        listing = ", ".join(f"{p} ({nom} GB)" for p, (nom, _) in GPU_PRESETS.items())
        raise PlanError(f"unknown GPU {name!r}; presets: {listing}; or give --gpu-mem GiB")
    return found, GPU_PRESETS[found][1]


def detect_gpu_gib() -> float | None:
    """Total memory of CUDA device 0 in GiB (in a Ray worker: its own GPU), None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GIB
