"""Elastic training: ``distributed.num_workers: [min, max]`` with constant samples per optimizer step.

Ray Train V2 runs the worker group at any size in [min, max] (``ScalingConfig(num_workers=(min,
max))``): a lost node restarts the group smaller from the latest checkpoint, returning capacity
grows it again. So that the training dynamics do not depend on how many nodes are alive, the
samples per optimizer step (per-device batch x workers x gradient accumulation) stay those of the
full size: gradient accumulation (and TRL's steps_per_generation) grow as workers go. That
arithmetic, and the refusal of a range where it does not divide, is pipeline.config.batch's.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from pipeline.rundir.files import EVENTS, append_event, read_metrics
from pipeline.rundir.storage import file_rank
from pipeline.seams.deepspeed_seams import zero_to_universal, zero_world_size


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


def resized(checkpoint_dir: Path, world_size: int) -> int | None:
    """The checkpoint's ZeRO rank count when it differs from ``world_size`` (None: same, or no ZeRO)."""
    saved = zero_world_size(checkpoint_dir)
    return saved if saved is not None and saved != world_size else None


def to_universal(checkpoint_dir: Path, dest: Path) -> None:
    """DeepSpeed's universal checkpoint of an HF checkpoint's ZeRO-1/2 partitions, written to ``dest``.

    It holds each parameter's fp32 weights and Adam moments whole (``zero/<name>/exp_avg.pt``), so a
    group of any size can load its own partitions from it; ``dest/latest_universal`` names the step.
    The converter itself is a DeepSpeed seam (``pipeline.seams.deepspeed_seams.zero_to_universal``).
    """
    tag = (Path(checkpoint_dir) / "latest").read_text().strip()
    # The converter takes every partition file in the folder: links to this checkpoint's group's only
    source, ranks = Path(dest) / "source" / tag, zero_world_size(checkpoint_dir)
    source.mkdir(parents=True)
    for f in (Path(checkpoint_dir) / tag).iterdir():
        if f.is_file() and (file_rank(f.name) or 0) < ranks:
            (source / f.name).symlink_to(f.resolve())
    zero_to_universal(source, Path(dest) / f"{tag}_universal")
    shutil.rmtree(Path(dest) / "source")


def reshard(checkpoint_dir: Path, dest: Path, local_rank: int) -> str | None:
    """Every rank: the universal checkpoint of ``checkpoint_dir`` in ``dest``, written once per node
    (by local rank 0; the ranks of a machine share ``dest``). Returns None when every rank can load
    it, else why not: all ranks must agree, since the answer sets the DeepSpeed config of each."""
    import torch.distributed as dist

    error = None
    if local_rank == 0:
        shutil.rmtree(dest, ignore_errors=True)  # a converted copy from an attempt that died mid-way
        try:
            to_universal(checkpoint_dir, dest)
        except Exception as e:  # an unconvertible checkpoint falls back to a reset, it does not end the run
            error = f"{type(e).__name__}: {e}"
            shutil.rmtree(dest, ignore_errors=True)
    if not dist.is_initialized():
        return error
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def reshard_for_group(checkpoint_dir: Path, dest: Path, local_rank: int, step: int, previous: int, world: int,
                      run_dir: Path | None = None, log=print) -> Path | None:
    """Every rank of a group resuming on another count than its checkpoint's: the universal checkpoint
    to load (see reshard), or None where it could not be made, and the optimizer state starts again.
    Rank 0 (the one given ``run_dir``) records which in events.jsonl and says so on the console."""
    t0 = time.monotonic()
    failed = reshard(checkpoint_dir, dest, local_rank)
    if run_dir is not None and not failed:
        if log:
            log(f"[elastic] optimizer state resharded at step {step}: the checkpoint's ZeRO partitions of "
                f"{previous} workers, loaded by {world} through a DeepSpeed universal checkpoint")
        append_event(run_dir, "optimizer_resharded", step=step, previous=previous, num_workers=world,
                     seconds=round(time.monotonic() - t0, 3))
    elif run_dir is not None:
        if log:
            log(f"[elastic] optimizer state reset at step {step}: the checkpoint's ZeRO partitions are from "
                f"{previous} workers, this group has {world}, and they could not be resharded ({failed}); "
                "weights, schedule and step are kept")
        append_event(run_dir, "optimizer_reset", step=step, previous=previous, num_workers=world, reason=failed)
    return None if failed else dest
