"""A run you can watch: the driver's console, drawn from the run directory's files.

Workers print nothing per step (TRL's per-step dicts and Ray Train's per-report lines are turned
off, see ``quiet_worker``); rank 0 records the events that matter in ``events.jsonl``
(``RunEvents``), and the driver tails ``metrics.jsonl`` and ``events.jsonl`` (``watch``):

- ``progress`` (default): on a terminal one live line (step/total, reward, eval/score, entropy,
  clipped ratio, cap, s/step, ETA), a compact table row every N logged steps, and the events
  (cap changes, health findings, evaluations, checkpoints, resumes) on their own lines. Without a
  terminal (``ray job logs``, CI) the same without the live line: plain lines only.
- ``table``: the table and the events, never a live line (nor with ``logging.progress_bar: false``).
- ``json``: each metrics row and event as one JSON line.
- ``verbose``: today's output (TRL's dicts, Ray's report lines, tqdm); the driver draws nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TextIO

from pipeline.rundir.metric_names import CAP_METRIC, is_train_row, number
from pipeline.rundir.files import EVENTS, METRICS
from pipeline.seams.ray_seams import NO_TRAIN_PRINT_PATCH

HEADER_EVERY = 20  # table rows between repeated headers
# (column title, metrics key, width, decimals)
TABLE = [
    ("reward", "reward", 7, 3), ("rouge_l", "rewards/rouge_l/mean", 7, 3), ("judge", "rewards/judge/mean", 6, 3),
    ("eos", "rewards/eos/mean", 6, 3), ("entropy", "entropy", 7, 3), ("clipped", "completions/clipped_ratio", 7, 2),
    ("len", "completions/mean_length", 5, 1), ("cap", CAP_METRIC, 4, 0),
]


def table_every(max_steps: int) -> int:
    """Logged steps between table rows: a round number giving about 15 rows a run."""
    target = max(1, max_steps // 15)
    nice = [m * 10 ** e for e in range(7) for m in (1, 2, 5)]
    return max(n for n in nice if n <= target)


def fmt_number(v: Any, nd: int = 3) -> str:
    n = number(v)
    return "-" if n is None else f"{n:.{nd}f}"


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def format_eval(row: Mapping[str, Any]) -> str:
    comps = ", ".join(f"{k.split('/', 1)[1]} {fmt_number(v)}" for k, v in row.items()
                      if k.startswith("eval/") and k not in ("eval/score", "eval/mean_length") and k != "step")
    length = row.get("eval/mean_length")
    tail = f", mean length {fmt_number(length, 1)}" if length is not None else ""
    return f"[eval] step {row.get('step')}: eval/score {fmt_number(row.get('eval/score'))} ({comps}{tail})"


def format_event(ev: Mapping[str, Any]) -> str:
    kind, step = ev.get("event"), ev.get("step")
    if kind == "length_cap":
        return f"[length] step {step}: max_completion_length {ev.get('old')} -> {ev.get('new')} ({ev.get('why', '')})"
    if kind == "finding":
        return f"[health] {ev.get('text') or ev.get('rule')}"
    if kind == "checkpoint":
        return f"[checkpoint] step {step}: {ev.get('name', '')}".rstrip()
    if kind == "resume":
        return f"[resume] from checkpoint at step {step}"
    rest = ", ".join(f"{k} {v}" for k, v in ev.items() if k not in ("event", "step", "time"))
    return f"[{kind}] step {step}" + (f": {rest}" if rest else "")


class ConsoleRenderer:
    """Turns metrics rows and events into console text; pure apart from writing to ``stream``."""

    def __init__(self, mode: str, total_steps: int, stream: TextIO | None = None, tty: bool | None = None,
                 every: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.mode = mode
        self.total = total_steps
        self.stream = stream or sys.stdout
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.live = mode == "progress" and (isatty() if tty is None else tty)
        self.every = every or table_every(total_steps)
        self.clock = clock
        self.logged = 0
        self.table_rows = 0
        self.last: dict[str, Any] = {}
        self.last_eval: float | None = None
        self._times: list[tuple[float, int]] = []  # (time, step) of recent rows, for s/step
        self._frame = False

    # -- output
    def _write(self, text: str) -> None:
        self.close()  # the live line is cleared before the text (it is drawn again after it)
        self.stream.write(text + "\n")
        self.stream.flush()

    def _draw(self) -> None:
        if self.live:
            self.stream.write("\r\033[K" + self.progress_line())
            self.stream.flush()
            self._frame = True

    # -- what the driver feeds in
    def row(self, row: Mapping[str, Any]) -> None:
        if self.mode == "json":
            self._write(json.dumps(dict(row), ensure_ascii=False))
            return
        if "eval/score" in row:
            self.last_eval = row.get("eval/score")
            self._write(format_eval(row))
        elif is_train_row(row):
            self.logged += 1
            self.last = dict(row)
            step = int(row.get("step", self.logged))
            self._times = (self._times + [(self.clock(), step)])[-20:]
            if self.logged % self.every == 0 or step >= self.total:
                if self.table_rows % HEADER_EVERY == 0:
                    self._write(self.table_header())
                self.table_rows += 1
                self._write(self.table_row(row))
        self._draw()

    def event(self, ev: Mapping[str, Any]) -> None:
        self._write(json.dumps(dict(ev), ensure_ascii=False) if self.mode == "json" else format_event(ev))
        self._draw()

    def close(self) -> None:
        if self._frame:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._frame = False

    # -- text
    def sec_per_step(self) -> float | None:
        if len(self._times) < 2:
            return None
        (t0, s0), (t1, s1) = self._times[0], self._times[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None

    def table_header(self) -> str:
        cells = [f"{'step':>{len(str(self.total))*2+1}}"] + [f"{t:>{w}}" for t, _, w, _ in TABLE] + [f"{'s/step':>6}"]
        return "  ".join(cells)

    def table_row(self, row: Mapping[str, Any]) -> str:
        width = len(str(self.total)) * 2 + 1
        cells = [f"{str(row.get('step')) + '/' + str(self.total):>{width}}"]
        cells += [f"{fmt_number(row.get(k), nd):>{w}}" for _, k, w, nd in TABLE] + [f"{fmt_number(self.sec_per_step(), 2):>6}"]
        return "  ".join(cells)

    def progress_line(self) -> str:
        r = self.last
        step = r.get("step", 0)
        parts = [f"step {step}/{self.total}", f"reward {fmt_number(r.get('reward'))}", f"eval/score {fmt_number(self.last_eval)}",
                 f"entropy {fmt_number(r.get('entropy'))}", f"clipped {fmt_number(r.get('completions/clipped_ratio'), 2)}",
                 f"cap {fmt_number(r.get(CAP_METRIC), 0)}"]
        sps = self.sec_per_step()
        if sps:
            parts += [f"{sps:.2f} s/step", f"ETA {_duration(sps * max(0, self.total - int(step)))}"]
        return " | ".join(parts)


class JsonlTail:
    """New complete rows of a JSONL file since the last call; follows a file rewritten (a resume
    drops the rows past its checkpoint) or replaced (a fresh start deletes it) without repeating rows."""

    MARK = 64  # bytes before the offset that must be unchanged for the file to be the one read so far

    def __init__(self, path: Path, from_end: bool = True):
        self.path = path
        self.offset, self.inode, self.mark, self.seen = 0, None, b"", set()
        if from_end and path.exists():  # rows of an earlier attempt are not news
            data = path.read_bytes()
            self.offset, self.inode, self.mark = len(data), path.stat().st_ino, data[-self.MARK:]
            self.seen = {self._key(r) for r in self._parse(data)[0]}

    @staticmethod
    def _key(row: Mapping[str, Any]) -> str:
        return json.dumps({k: v for k, v in row.items() if k != "time"}, sort_keys=True)

    @staticmethod
    def _parse(data: bytes) -> tuple[list[dict], int]:
        rows, used = [], 0
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # a row still being written
            used += len(line)
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                rows.append(obj)
        return rows, used

    def poll(self) -> list[dict]:
        try:
            st = self.path.stat()
        except OSError:
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset - len(self.mark))
            if st.st_ino != self.inode or f.read(len(self.mark)) != self.mark:
                self.offset, self.inode, self.mark = 0, st.st_ino, b""  # rewritten: read it again, skip rows seen
                f.seek(0)
            data = f.read()
        rows, used = self._parse(data)
        if used:
            self.mark = (self.mark + data[:used])[-self.MARK:]
            self.offset += used
        fresh = []
        for r in rows:
            k = self._key(r)
            if k not in self.seen:
                self.seen.add(k)
                fresh.append(r)
        return fresh


def poll_run(metrics: JsonlTail, events: JsonlTail) -> list[tuple[str, dict]]:
    """New rows and events in step order (a step's row before the events it caused)."""
    items = [("row", r) for r in metrics.poll()] + [("event", e) for e in events.poll()]
    return sorted(items, key=lambda it: (it[1].get("step", 0) if isinstance(it[1].get("step"), (int, float)) else 0,
                                         it[0] == "event"))


@contextlib.contextmanager
def watch(run_dir: Path, mode: str, total_steps: int, stream: TextIO | None = None, live: bool = True,
          interval: float = 0.5) -> Iterator[ConsoleRenderer | None]:
    """Draw the run's console from its files while the body runs (nothing in ``verbose`` mode)."""
    if mode == "verbose":
        yield None
        return
    run_dir = Path(run_dir)
    renderer = ConsoleRenderer(mode, total_steps, stream, tty=None if live else False)
    metrics, events = JsonlTail(run_dir / METRICS), JsonlTail(run_dir / EVENTS)
    stop = threading.Event()

    def pump() -> None:
        for kind, item in poll_run(metrics, events):
            renderer.row(item) if kind == "row" else renderer.event(item)

    def loop() -> None:
        while not stop.wait(interval):
            with contextlib.suppress(Exception):  # the console must never stop a run
                pump()

    thread = threading.Thread(target=loop, name="synth-grpo-console", daemon=True)
    thread.start()
    try:
        yield renderer
    finally:
        stop.set()
        thread.join(timeout=5)
        with contextlib.suppress(Exception):
            pump()
        renderer.close()


QUIET_ENV = {
    **NO_TRAIN_PRINT_PATCH,  # a Ray worker would print every line twice (pipeline.seams.ray_seams)
    # transformers' "Loading weights" and datasets' bars in every actor (inherited by a local Ray's workers)
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}


def quiet_environment(mode: str) -> None:
    """Outside verbose, before Ray starts: the environment that keeps workers from printing twice
    and from drawing progress bars. An explicit setting in the environment wins."""
    if mode != "verbose":
        for k, v in QUIET_ENV.items():
            os.environ.setdefault(k, v)


def ray_logging_config(mode: str):
    """Ray Train's supported log level for its own ``ray.train`` loggers: WARNING outside verbose."""
    from ray.train import LoggingConfig

    quiet_environment(mode)
    return LoggingConfig(log_level="INFO" if mode == "verbose" else "WARNING")
