"""The worker's side of the console: rank 0 records the run's events in ``events.jsonl`` as they
happen, and outside ``verbose`` the worker prints nothing per step (the driver draws the console
from the run directory, ``pipeline.console.live``)."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from transformers import TrainerCallback

from pipeline.rundir.files import append_event
from pipeline.seams.ray_seams import quiet_train_report_logger

class RunEvents(TrainerCallback):
    """Rank 0: the run's events into events.jsonl as they happen: cap changes (from the length
    control), health findings (from the health callback), checkpoints. Placed after both."""

    def __init__(self, run_dir: Path, length_ctl=None, health=None):
        self.run_dir = Path(run_dir)
        self.length_ctl, self.health = length_ctl, health
        self._changes = len(length_ctl.changes) if length_ctl is not None else 0
        self._findings = len(health.findings) if health is not None else 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.length_ctl is not None:
            band = getattr(self.length_ctl, "band", None)
            for step, old, new in self.length_ctl.changes[self._changes:]:
                why = "schedule" if self.length_ctl.schedule else f"clipped ratio outside [{band[0]}, {band[1]}]"
                append_event(self.run_dir, "length_cap", step=step, old=old, new=new, why=why)
            self._changes = len(self.length_ctl.changes)
        if self.health is not None:
            for f in self.health.findings[self._findings:]:
                append_event(self.run_dir, "finding", step=f.first_step, rule=f.rule, text=f.format())
            self._findings = len(self.health.findings)

    def on_step_begin(self, args, state, control, **kwargs):
        self.on_log(args, state, control)  # a scheduled cap is set at the step's start

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            append_event(self.run_dir, "checkpoint", step=state.global_step, name=f"checkpoint-{state.global_step:06d}")


def quiet_worker(trainer, mode: str) -> None:
    """Outside ``verbose``: no per-step dicts from TRL (transformers' ProgressCallback prints them
    through tqdm, PrinterCallback with print), no tqdm bars, and no "Reporting training result"
    line from Ray Train for every ray.train.report (its logger is named after its file, so the
    run's LoggingConfig level does not reach it)."""
    if mode == "verbose":
        return
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for cb in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(cb)
    # transformers' own deprecated alias, read by the save path at every checkpoint: nothing here to change
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    with contextlib.suppress(Exception):
        import datasets

        datasets.disable_progress_bars()
    quiet_train_report_logger()
