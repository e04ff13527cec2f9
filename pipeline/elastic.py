"""Elastic training: ``distributed.num_workers: [min, max]`` with constant samples per optimizer step.

Ray Train V2 runs the worker group at any size in [min, max] (``ScalingConfig(num_workers=(min,
max))``): a lost node restarts the group smaller from the latest checkpoint, returning capacity
grows it again. So that the training dynamics do not depend on how many nodes are alive, the
samples per optimizer step (per-device batch x workers x gradient accumulation) stay those of the
full size: gradient accumulation (and TRL's steps_per_generation) grow as workers go. A range
where that does not divide for some count is refused in the config (exit 2), never rounded.
"""

from __future__ import annotations

import contextlib
import copy
import re
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.run_files import EVENTS, append_event, read_metrics

if TYPE_CHECKING:  # annotations only: config.validate imports this module
    from pipeline.config import RunConfig


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


def problems(cfg: RunConfig) -> list[str]:
    """Config problems of ``distributed.num_workers`` (for config.validate)."""
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


def record_world_size(run_dir: Path, args, world_size: int, step: int, log=print) -> dict:
    """Rank 0 at each start of the worker group: an events.jsonl ``workers`` record, ``resize`` when
    the count differs from the one the run last trained on. ``args`` is the trainer's GRPOConfig, so
    the samples per optimizer step recorded are those TRL really uses."""
    last = next((e.get("num_workers") for e in reversed(read_metrics(Path(run_dir) / EVENTS))
                 if e.get("event") in ("workers", "resize")), None)
    fields = dict(num_workers=world_size, step=step, gradient_accumulation_steps=args.gradient_accumulation_steps,
                  samples_per_step=args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps,
                  generation_batch_size=args.generation_batch_size)
    event = "workers" if last in (None, world_size) else "resize"
    if event == "resize":
        fields["previous"] = last
        if log:
            log(f"[elastic] {last} -> {world_size} workers at step {step}: gradient accumulation "
                f"{args.gradient_accumulation_steps}, {fields['samples_per_step']} samples per optimizer step")
    append_event(run_dir, event, **fields)
    return {"event": event, **fields}


_OPTIM_SHARD = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def checkpoint_world_size(checkpoint_dir: Path) -> int | None:
    """How many data-parallel ranks wrote the ZeRO optimizer partitions of an HF checkpoint (None: no ZeRO)."""
    ranks = {int(m.group(1)) for p in Path(checkpoint_dir).glob("global_step*/*") if (m := _OPTIM_SHARD.search(p.name))}
    return len(ranks) or None


def resized(checkpoint_dir: Path, world_size: int) -> int | None:
    """The checkpoint's ZeRO rank count when it differs from ``world_size`` (None: same, or no ZeRO)."""
    saved = checkpoint_world_size(checkpoint_dir)
    return saved if saved is not None and saved != world_size else None


@contextlib.contextmanager
def without_optimizer_state():
    """HF's DeepSpeed resume, loading the weights but not the ZeRO optimizer partitions.

    DeepSpeed refuses partitions written by another number of ranks ("Automatic adjustment of
    ZeRO's optimizer state partitioning ... not currently supported"). Loaded with
    ``load_optimizer_states=False`` it restores the module weights and rebuilds its fp32 copy from
    them (``_restore_from_bit16_weights``): the weights are exact, the Adam moments start again.
    HF still restores the LR schedule, the step and the RNG.
    """
    import transformers.trainer as hf_trainer

    original = hf_trainer.deepspeed_load_checkpoint

    def load(engine, checkpoint_path, load_module_strict=True):
        load_path, _ = engine.load_checkpoint(checkpoint_path, load_module_strict=load_module_strict,
                                              load_optimizer_states=False, load_lr_scheduler_states=True)
        if load_path is None:
            raise ValueError(f"[deepspeed] failed to resume from checkpoint {checkpoint_path}")

    hf_trainer.deepspeed_load_checkpoint = load
    try:
        yield
    finally:
        hf_trainer.deepspeed_load_checkpoint = original
