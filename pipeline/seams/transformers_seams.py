"""transformers seams: a private method of its TensorBoard callback and the module function its
Trainer resumes DeepSpeed through. Written against transformers 5.24.0 (pinned to 5.24.x in
pyproject.toml); tests/test_seams.py calls each and checks its effect."""

from __future__ import annotations

import contextlib
from pathlib import Path


def tensorboard_writer(callback, args):
    """The ``SummaryWriter`` of a ``TensorBoardCallback``, created now if training has not logged yet.

    transformers 5.24.0 creates it lazily in ``on_train_begin`` through the private
    ``_init_summary_writer(args)``; the evaluation may write before that. If the method moves this
    raises AttributeError at the first evaluation of a run that reports to TensorBoard; None when
    TensorBoard is not installed."""
    if callback.tb_writer is None:
        callback._init_summary_writer(args)
    return callback.tb_writer


@contextlib.contextmanager
def deepspeed_resume_from(universal: Path | None):
    """HF's DeepSpeed resume for a group of another size than the checkpoint's.

    DeepSpeed refuses ZeRO partitions written by another number of ranks ("Automatic adjustment of
    ZeRO's optimizer state partitioning ... not currently supported"). With ``universal`` (see
    pipeline.training.elastic.reshard; the engine's config must have ``checkpoint.load_universal``)
    the engine loads weights and optimizer state from it, partitioned for this group. Without, it
    loads the weights only (``load_optimizer_states=False``): the fp32 copy is rebuilt from them, the
    Adam moments start again. Either way HF restores the LR schedule, the step and the RNG from the
    checkpoint itself.

    transformers 5.24.0: the resume (``Trainer._prepare_for_training``) calls the module-level
    ``transformers.trainer.deepspeed_load_checkpoint(engine, path, load_module_strict=...)``, replaced
    here for the duration of the block. If transformers imports it under another name or moves the
    call, the patch does nothing and DeepSpeed's own refusal ends the resume of a resized group
    (tests/test_storage.py, the node-lost elastic run, fails).
    """
    import transformers.trainer as hf_trainer  # heavy: only the resuming worker needs it

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
