"""DeepSpeed seams: its ZeRO checkpoint layout and its universal-checkpoint converter, which has no
Python API but its command line's ``main(args)``. Written against deepspeed 0.19.8 (pinned to 0.19.x
in pyproject.toml); tests/test_storage.py reshards a real ZeRO-2 checkpoint through both."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

# ZeRO-1/2 write one model-states file per step; ZeRO-3 one per rank (rank 0's first here)
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def zero_world_size(checkpoint_dir: Path) -> int | None:
    """How many data-parallel ranks wrote the ZeRO partitions of an HF checkpoint (None: no ZeRO).

    deepspeed 0.19.8: ``latest`` names the step folder, whose model-states file (``MODEL_STATES``)
    records ``dp_world_size``; counting partition files would also count any a dead group left in
    the folder. If DeepSpeed renames the file or the key this returns None (a resized group then
    tries a plain resume, which DeepSpeed refuses) or raises KeyError. Memory-mapped, so a full
    model's weights in that file are not read. ``weights_only``: the file may come from storage
    others can write, and this read needs no pickled code (DeepSpeed's own load of the same
    checkpoint unpickles in full: docs/cluster.md, "Trust")."""
    import torch  # heavy: only a resuming worker reads a checkpoint

    latest = Path(checkpoint_dir) / "latest"
    if not latest.is_file():
        return None
    step_dir = Path(checkpoint_dir) / latest.read_text().strip()
    for name in MODEL_STATES:
        if (step_dir / name).is_file():
            try:
                states = torch.load(step_dir / name, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError:  # written by torch's legacy serialization, which cannot be memory-mapped
                states = torch.load(step_dir / name, map_location="cpu", weights_only=True)
            return int(states["dp_world_size"])
    return None


def universal_converter_args(input_folder: Path, output_folder: Path):
    """The ``Namespace`` DeepSpeed's universal-checkpoint converter takes: it has no Python API but its
    command line's ``main(args)`` (deepspeed 0.19.8: ``deepspeed.checkpoint.ds_to_universal``), so
    these are its options' destinations; one it adds and reads raises AttributeError in ``main``.
    One extract and one merge worker: no process pool inside a Ray worker. HF's checkpoints lack the
    version record the converter asks for, hence ``inject_missing_state``."""
    import argparse

    return argparse.Namespace(input_folder=str(input_folder), output_folder=str(output_folder),
                              num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)


def zero_to_universal(input_folder: Path, output_folder: Path) -> None:
    """DeepSpeed's universal checkpoint (each parameter's fp32 weights and Adam moments whole, so a
    group of any size can load its own partitions) of the ZeRO-1/2 step folder ``input_folder``,
    written to ``output_folder``; the converter's progress bars are swallowed."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal  # heavy: only a resharding worker

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal(universal_converter_args(input_folder, output_folder))


def skip_shm_allreduce_build() -> None:
    """deepspeed 0.19.8 compiles its shared-memory all-reduce (``deepspeed_shm_comm``, C++ built on the
    spot: 45-150 s on 2 cores, and a compiler the machine may lack) whenever its torch backend starts on
    CPU (``deepspeed.comm.torch.build_shm_op``). Only ``inference_all_reduce`` (tensor-parallel
    inference) uses it; ZeRO training's collectives go through torch.distributed (gloo), and
    ``inference_all_reduce`` falls back to it too. If DeepSpeed renames the function, the op is built
    again: slower, not wrong (tests/test_seams.py starts the backend in a fresh extensions folder)."""
    import importlib

    # not `import deepspeed.comm.torch as m`: `deepspeed.comm` re-exports torch itself under that name
    backend = importlib.import_module("deepspeed.comm.torch")  # heavy: only a DeepSpeed worker
    backend.build_shm_op = lambda: None
