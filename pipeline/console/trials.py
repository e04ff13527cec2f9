"""The tune console: Ray Tune's trials as one line per event and a table, fed by a Tune callback
in the driver's tune loop."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any, Callable, Mapping, TextIO

from pipeline.console.live import fmt_number

class TrialBoard:
    """The tune console: one line per trial event (started, evaluated, finished, failed) and a
    table of trials (id, params, step, eval/score, state), redrawn in place on a terminal,
    printed again every ``every_s`` seconds when it changed otherwise."""

    def __init__(self, describe: Callable[[Mapping[str, Any]], str], mode: str = "progress",
                 stream: TextIO | None = None, tty: bool | None = None, every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.describe, self.mode = describe, mode
        self.stream = stream or sys.stdout
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.live = mode == "progress" and (isatty() if tty is None else tty)
        self.every_s, self.clock = every_s, clock
        self.trials: dict[str, dict[str, Any]] = {}
        self._drawn_lines = 0
        self._changed = False
        self._last_print = clock()

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles its callbacks with the experiment state; a terminal stream does not pickle.
        state = dict(self.__dict__)
        state["stream"] = None if state["stream"] in (sys.stdout, sys.stderr) or not hasattr(state["stream"], "getvalue") \
            else state["stream"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.stream is None:
            self.stream = sys.stdout

    def _write(self, line: str, data: Mapping[str, Any]) -> None:
        self._erase()
        self.stream.write((json.dumps(dict(data), ensure_ascii=False) if self.mode == "json" else line) + "\n")
        self.stream.flush()
        self._changed = True
        self._redraw()

    def _erase(self) -> None:
        if self._drawn_lines:
            self.stream.write(f"\033[{self._drawn_lines}F\033[J")
            self._drawn_lines = 0

    def _redraw(self) -> None:
        if self.live and self.trials:
            text = self.table()
            self.stream.write(text + "\n")
            self.stream.flush()
            self._drawn_lines = text.count("\n") + 1

    def start(self, trial_id: str, config: Mapping[str, Any]) -> None:
        params = self.describe(config)
        self.trials.setdefault(trial_id, {"params": params, "step": None, "score": None})["state"] = "running"
        self._write(f"[trial] {trial_id} started: {params}", {"trial": trial_id, "event": "start", "params": params})

    def result(self, trial_id: str, result: Mapping[str, Any]) -> None:
        t = self.trials.setdefault(trial_id, {"params": "", "state": "running"})
        t["step"], t["score"] = result.get("step"), result.get("eval/score", t.get("score"))
        self._write(f"[trial] {trial_id} step {t['step']}: eval/score {fmt_number(t['score'])}",
                    {"trial": trial_id, "event": "result", "step": t["step"], "eval/score": t["score"]})

    def complete(self, trial_id: str, failed: str | None = None) -> None:
        t = self.trials.setdefault(trial_id, {"params": "", "step": None, "score": None})
        t["state"] = "error" if failed else "finished"
        line = (f"[trial] {trial_id} failed: {failed}" if failed
                else f"[trial] {trial_id} finished at step {t.get('step')}: eval/score {fmt_number(t.get('score'))}")
        self._write(line, {"trial": trial_id, "event": t["state"], "step": t.get("step"), "eval/score": t.get("score"),
                           **({"error": failed} if failed else {})})

    def tick(self) -> None:
        """Called on every Tune loop iteration: without a terminal, the table again once a minute if it changed."""
        if self.mode == "json" or self.live or not self._changed or self.clock() - self._last_print < self.every_s:
            return
        self.stream.write(self.table() + "\n")
        self.stream.flush()
        self._changed, self._last_print = False, self.clock()

    def close(self) -> None:
        self._erase()
        self.stream.flush()

    def table(self) -> str:
        head = ["trial", "params", "step", "eval/score", "state"]
        body = [[tid, t.get("params", ""), "-" if t.get("step") is None else str(t["step"]), fmt_number(t.get("score")),
                 t.get("state", "")] for tid, t in self.trials.items()]
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
        fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        return "\n".join([fmt(head), *(fmt(b) for b in body)])


def tune_console_callback(board: TrialBoard):
    """A Ray Tune callback (it runs in the driver's tune loop) feeding ``board``."""
    from ray.tune import Callback

    class TuneConsole(Callback):  # a console problem must never fail the search: each hook swallows its errors
        def on_trial_start(self, iteration, trials, trial, **info):
            with contextlib.suppress(Exception):
                board.start(trial.trial_id, trial.config)

        def on_trial_result(self, iteration, trials, trial, result, **info):
            with contextlib.suppress(Exception):
                if "eval/score" in result:
                    board.result(trial.trial_id, result)

        def on_trial_complete(self, iteration, trials, trial, **info):
            with contextlib.suppress(Exception):
                board.complete(trial.trial_id)

        def on_trial_error(self, iteration, trials, trial, **info):
            with contextlib.suppress(Exception):
                board.complete(trial.trial_id, failed=str(getattr(trial, "error_file", None) or "see the trial's error.txt"))

        def on_step_end(self, iteration, trials, **info):
            with contextlib.suppress(Exception):
                board.tick()

        def on_experiment_end(self, trials, **info):
            with contextlib.suppress(Exception):
                board.close()

    return TuneConsole()
