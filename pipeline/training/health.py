"""Live training health: the doctor's rules on TRL's log stream, each finding said once, when it
first holds, so a bad run is named within its first few hundred steps instead of after 18,000.
At the end (``write``) each finding is marked active, or resolved when it no longer holds."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from transformers import TrainerCallback

from pipeline.diagnosis.history import History
from pipeline.diagnosis.rules import Finding, RuleSettings, Tracker, config_dict
from pipeline.rundir.files import write_atomic

COUNTER_NAME = "synth_grpo_health_findings"


class HealthCallback(TrainerCallback):
    """Runs the rules on every log of the main process; prints each new finding once, counts it
    in a Ray metric (when Ray is initialized), and keeps it in ``findings`` for the run's end."""

    def __init__(self, rules: RuleSettings | None = None, config: Any = None, print_fn: Callable[[str], Any] = print,
                 export_ray_metrics: bool = True, only: Iterable[str] | None = None):
        self.settings = rules or RuleSettings()
        self.config = config_dict(config)  # RunConfig or its dict: windows scale with max_steps, advice names current values
        self.print_fn = print_fn
        self.export_ray_metrics = export_ray_metrics
        self.tracker = Tracker(self.settings, self.config, only)
        self.history = History()
        self.findings: list[Finding] = []
        self._counter: Any = None

    # the trainer-independent part, also used by tests and by anything that replays a stream
    def observe(self, row: Mapping[str, Any]) -> list[Finding]:
        """Add one logged row; return the findings that fire for the first time on it."""
        if not self.history.append(row) or not self.tracker.pending:
            return []
        new = self.tracker.update(self.history)
        for f in new:
            self.findings.append(f)
            self.print_fn(f"synth-grpo health: {f.format()}")
            self._count(f.rule)
        return new

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not getattr(state, "is_world_process_zero", True):
            return
        row = dict(logs)
        row.setdefault("step", state.global_step)
        self.observe(row)

    def write(self, path: str | Path) -> Path:
        """Findings as JSON (the doctor's --json format), e.g. RUN_DIR/health.json at train end; each is marked
        active, or resolved with the last step it held, on the history seen so far."""
        self.tracker.settle(self.history)
        path = Path(path)
        write_atomic(path, Finding.to_json(self.findings) + "\n")
        return path

    def _count(self, rule: str) -> None:
        # A process that never imported Ray cannot have initialized it; don't import it for nothing.
        ray = sys.modules.get("ray")
        if not self.export_ray_metrics or ray is None:
            return
        try:
            if not ray.is_initialized():
                return
            if self._counter is None:
                from ray.util.metrics import Counter

                self._counter = Counter(COUNTER_NAME, description="training-health findings, by rule and run",
                                        tag_keys=("rule", "run"))
            run = str(((self.config or {}).get("output") or {}).get("run_name") or "")
            self._counter.inc(1, tags={"rule": rule, "run": run})
        except Exception as e:  # a metrics hiccup must never stop training
            self.export_ray_metrics = False
            self.print_fn(f"synth-grpo health: Ray metric export disabled ({type(e).__name__}: {e})")
