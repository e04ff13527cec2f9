"""The batch arithmetic TRL and an elastic group impose, in one place.

TRL's rule: the generation batch (per-device batch x workers x steps_per_generation) divides by
``num_generations``, so every prompt gets its whole group. An elastic group (``distributed.num_workers:
[min, max]``) keeps the samples per optimizer step of its full size: gradient accumulation (and
steps_per_generation) grow as workers go, and a range where that does not divide for some count is
refused here (exit 2), never rounded. The config checks, the memory planner, the search space and the
training worker all ask this module.
"""

from __future__ import annotations

import copy

from pipeline.config.schema import RunConfig


def divides_into_groups(generation_batch: int, num_generations: int) -> bool:
    """TRL's rule: a generation round's completions (per-device batch x workers x steps_per_generation)
    split into whole groups of ``num_generations``."""
    return generation_batch % num_generations == 0


def worker_range(cfg: RunConfig) -> tuple[int, int]:
    n = cfg.distributed.num_workers
    return (int(n[0]), int(n[1])) if isinstance(n, (list, tuple)) else (int(n), int(n))


def scaling_num_workers(cfg: RunConfig) -> int | tuple[int, int]:
    """What Ray Train's ScalingConfig takes: an int, or (min, max) for an elastic group."""
    lo, hi = worker_range(cfg)
    return lo if lo == hi else (lo, hi)


def samples_per_step(cfg: RunConfig) -> int:
    """Completions per optimizer step at the full size: the invariant of an elastic run."""
    _, hi = worker_range(cfg)
    return cfg.optimization.per_device_train_batch_size * hi * cfg.optimization.gradient_accumulation_steps


def accumulation_for(cfg: RunConfig, world_size: int) -> tuple[int, int | None]:
    """(gradient_accumulation_steps, steps_per_generation) on ``world_size`` workers.

    The configured values are those of the full size (max workers); ValueError if they do not scale.
    """
    _, hi = worker_range(cfg)
    ga, spg = cfg.optimization.gradient_accumulation_steps, cfg.generation.steps_per_generation
    if (ga * hi) % world_size or (spg and (spg * hi) % world_size):
        raise ValueError(f"{world_size} workers cannot keep {samples_per_step(cfg)} samples per optimizer step")
    return ga * hi // world_size, (spg * hi // world_size if spg else None)


def for_world_size(cfg: RunConfig, world_size: int) -> RunConfig:
    """The worker's view of ``cfg`` on a group of ``world_size``: that count of workers, and gradient
    accumulation adapted to it (so everything that counts completions per step sees the real group)."""
    lo, hi = worker_range(cfg)
    if lo == hi:
        return cfg
    out = copy.deepcopy(cfg)
    out.optimization.gradient_accumulation_steps, out.generation.steps_per_generation = accumulation_for(cfg, world_size)
    out.distributed.num_workers = world_size
    return out


def generation_batch_problems(cfg: RunConfig) -> list[str]:
    """TRL's rule on the config, as a problem naming generation.num_generations."""
    g, o = cfg.generation, cfg.optimization
    spg = g.steps_per_generation or o.gradient_accumulation_steps
    if divides_into_groups(cfg.generation_batch_size, g.num_generations):
        return []
    return [f"generation.num_generations: generation batch {cfg.generation_batch_size} (per_device_train_batch_size "
            f"{o.per_device_train_batch_size} x num_workers {cfg.distributed.num_workers} x steps_per_generation "
            f"{spg}) is not divisible by num_generations {g.num_generations} (TRL's rule)"]


def worker_count_problems(cfg: RunConfig) -> list[str]:
    """Config problems of ``distributed.num_workers``: its form, ZeRO-3, and counts that cannot keep the step."""
    n = cfg.distributed.num_workers
    if isinstance(n, list):
        if len(n) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in n):
            return [f"distributed.num_workers: {n!r} must be a count or [min, max]"]
        if not 1 <= n[0] <= n[1]:
            return [f"distributed.num_workers: {n!r} needs 1 <= min <= max"]
    elif n < 1:
        return [f"distributed.num_workers: {n} must be >= 1"]
    if isinstance(n, list) and n[0] != n[1] and cfg.distributed.zero_stage == 3:
        return [f"distributed.num_workers: {n!r} with distributed.zero_stage 3: ZeRO-3 partitions the weights "
                "themselves, which a group of another size cannot load; use zero_stage 0-2 for an elastic run"]
    lo, hi = worker_range(cfg)
    if cfg.optimization.gradient_accumulation_steps < 1 or (cfg.generation.steps_per_generation or 1) < 1:
        return []
    bad = [k for k in range(lo, hi + 1) if _does_not_divide(cfg, k)]
    if bad:
        o = cfg.optimization
        return [f"distributed.num_workers: {n!r} keeps {samples_per_step(cfg)} samples per optimizer step "
                f"(per_device_train_batch_size {o.per_device_train_batch_size} x {hi} workers x "
                f"gradient_accumulation_steps {o.gradient_accumulation_steps}), which {', '.join(map(str, bad))} "
                f"worker(s) cannot split into whole accumulation steps; raise optimization.gradient_accumulation_steps "
                f"(or steps_per_generation) to a multiple of the worker counts, or narrow the range"]
    return []


def _does_not_divide(cfg: RunConfig, k: int) -> bool:
    try:
        accumulation_for(cfg, k)
        return False
    except ValueError:
        return True
