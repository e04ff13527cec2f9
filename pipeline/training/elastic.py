"""Elastic training: ``distributed.num_workers: [min, max]`` with constant samples per optimizer step.

Ray Train V2 runs the worker group at any size in [min, max] (``ScalingConfig(num_workers=(min,
max))``): a lost node restarts the group smaller from the latest checkpoint, returning capacity
grows it again. So that the training dynamics do not depend on how many nodes are alive, the
samples per optimizer step (per-device batch x workers x gradient accumulation) stay those of the
full size: gradient accumulation (and TRL's steps_per_generation) grow as workers go. That
arithmetic, and the refusal of a range where it does not divide, is pipeline.config.batch's.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from pipeline.config import (  # noqa: F401 (re-exported: the worker, driver and tuner import them from here)
    accumulation_for, for_world_size, samples_per_step, scaling_num_workers, worker_range)
from pipeline.rundir.files import EVENTS, append_event, read_metrics


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


def checkpoint_world_size(checkpoint_dir: Path) -> int | None:
    """How many data-parallel ranks wrote the ZeRO partitions of an HF checkpoint (None: no ZeRO), as
    DeepSpeed recorded it in the step's model states: counting partition files would also count any a
    dead group left in the folder. Memory-mapped, so a full model's weights in that file are not read.
    ``weights_only``: the file may come from storage others can write, and this read needs no pickled code
    (DeepSpeed's own load of the same checkpoint unpickles in full: docs/cluster.md, "Trust")."""
    import torch

    latest = Path(checkpoint_dir) / "latest"
    if not latest.is_file():
        return None
    step_dir = Path(checkpoint_dir) / latest.read_text().strip()
    # ZeRO-1/2 write one model-states file; ZeRO-3 one per rank
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (step_dir / name).is_file():
            try:
                states = torch.load(step_dir / name, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError:  # written by torch's legacy serialization, which cannot be memory-mapped
                states = torch.load(step_dir / name, map_location="cpu", weights_only=True)
            return int(states["dp_world_size"])
    return None


def resized(checkpoint_dir: Path, world_size: int) -> int | None:
    """The checkpoint's ZeRO rank count when it differs from ``world_size`` (None: same, or no ZeRO)."""
    saved = checkpoint_world_size(checkpoint_dir)
    return saved if saved is not None and saved != world_size else None


def to_universal(checkpoint_dir: Path, dest: Path) -> None:
    """DeepSpeed's universal checkpoint of an HF checkpoint's ZeRO-1/2 partitions, written to ``dest``.

    It holds each parameter's fp32 weights and Adam moments whole (``zero/<name>/exp_avg.pt``), so a
    group of any size can load its own partitions from it; ``dest/latest_universal`` names the step.
    HF's checkpoints lack the version record DeepSpeed's converter asks for, hence inject_missing_state.
    """
    import argparse
    import io

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    from pipeline.rundir.storage import file_rank

    tag = (Path(checkpoint_dir) / "latest").read_text().strip()
    # The converter takes every partition file in the folder: links to this checkpoint's group's only
    source, ranks = Path(dest) / "source" / tag, checkpoint_world_size(checkpoint_dir)
    source.mkdir(parents=True)
    for f in (Path(checkpoint_dir) / tag).iterdir():
        if f.is_file() and (file_rank(f.name) or 0) < ranks:
            (source / f.name).symlink_to(f.resolve())
    args = argparse.Namespace(input_folder=str(source), output_folder=str(Path(dest) / f"{tag}_universal"),
                              num_extract_workers=1, num_merge_workers=1,  # no process pool inside a Ray worker
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        ds_to_universal(args)
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
    import time

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


@contextlib.contextmanager
def deepspeed_resume(universal: Path | None):
    """HF's DeepSpeed resume for a group of another size than the checkpoint's.

    DeepSpeed refuses ZeRO partitions written by another number of ranks ("Automatic adjustment of
    ZeRO's optimizer state partitioning ... not currently supported"). With ``universal`` (see
    reshard; the engine's config must have ``checkpoint.load_universal``) the engine loads weights
    and optimizer state from it, partitioned for this group. Without, it loads the weights only
    (``load_optimizer_states=False``): the fp32 copy is rebuilt from them, the Adam moments start
    again. Either way HF restores the LR schedule, the step and the RNG from the checkpoint itself.
    """
    import transformers.trainer as hf_trainer

    original = hf_trainer.deepspeed_load_checkpoint

    def load(engine, checkpoint_path, load_module_strict=True):
        load_path, _ = engine.load_checkpoint(str(universal or checkpoint_path), load_module_strict=load_module_strict,
                                              load_optimizer_states=universal is not None,
                                              load_lr_scheduler_states=True)
        if load_path is None:
            raise ValueError(f"[deepspeed] failed to resume from checkpoint {universal or checkpoint_path}")

    hf_trainer.deepspeed_load_checkpoint = load
    try:
        yield
    finally:
        hf_trainer.deepspeed_load_checkpoint = original
