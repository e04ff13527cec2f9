"""Completion-length control: a fixed schedule or an adaptive cap, applied where generation reads it.

The baseline run's callback set ``args.max_completion_length``, which TRL copies at start-up, so its
completions stayed at 160 tokens. The cap is set on every trainer attribute TRL's generation reads
(``set_generation_cap``, the TRL seam in ``pipeline.seams.trl_seams``).
The adaptive mode follows the clipped ratio: when every completion in a group is cut, every
length-based reward is equal within the group and GRPO gets no signal from it. A rule that
stepped the cap on 3 steps of 8 completions cycled 8 -> 24 -> 8 on the default run: the ratio of 8
completions is too noisy, so the estimate pools completions and only a significant miss moves it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable, Sequence

from transformers import TrainerCallback

from pipeline.config import RunConfig, scheduled_length
from pipeline.rundir.metric_names import CAP_METRIC
from pipeline.seams.trl_seams import set_generation_cap

# Every attribute TRL's generation reads, set mid-run (the seam: pipeline.seams.trl_seams)


def smoothed_ratio(clipped: float, n: int) -> float:
    """The clipped ratio of ``n`` completions, pulled off 0 and 1 (k + 0.5) / (n + 1) so its log is finite."""
    return (clipped * n + 0.5) / (n + 1)


def binomial_tail(k: int, n: int, p: float, upper: bool) -> float:
    """P(K >= k) (upper) or P(K <= k) for K ~ Binomial(n, p)."""
    ks = range(k, n + 1) if upper else range(0, k + 1)
    return sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                        + (i * math.log(p) if i else 0.0) + ((n - i) * math.log1p(-p) if n - i else 0.0)) for i in ks)


def band_side(clipped: float, n: int, band: tuple[float, float], z: float) -> int:
    """+1 when the ratio of ``n`` completions is above the band beyond chance, -1 below, 0 otherwise.

    Beyond chance: a count of cut completions at least this far from the band's edge has probability
    under the one-sided normal tail of ``z`` standard errors (exact binomial, since near 0 the
    normal approximation lets 0 of 24 pass for "below 5%"). Far outside, one step decides; near the
    edge, it takes a window.
    """
    low, high = band
    alpha = 0.5 * math.erfc(z / math.sqrt(2))
    k = round(clipped * n)
    if clipped > high and (high == 0 or binomial_tail(k, n, high, upper=True) < alpha):
        return 1
    if clipped < low and binomial_tail(k, n, low, upper=False) < alpha:
        return -1
    return 0


def target_cap(cap: int, clipped: float, n: int, mean_length: float, target: float,
               bracket: tuple[tuple[int, float] | None, tuple[int, float] | None] = (None, None)) -> float:
    """Where the clipped ratio would be ``target``, estimated from ``n`` completions at ``cap``.

    Bracketed (``bracket``: the latest earlier windows, (cap, smoothed ratio), above and below the
    target; the one on the other side of the target from this window is used): ``log`` of the ratio
    interpolated linearly in the cap between the two (regula falsi), so the cap never leaves the
    bracket. Otherwise a geometric stopping model, fitted to completions that ended and
    were cut (censored maximum likelihood: per-token EOS hazard = ended / tokens generated, so
    P(length > L) = (1 - hazard) ** L), stepped from the cap in log space, at most doubling or halving.
    """
    c = smoothed_ratio(clipped, n)
    other = bracket[1] if c > target else bracket[0]
    if other is not None:
        lo, hi = sorted([(cap, c), other])
        if lo[0] != hi[0] and (lo[1] - target) > 0 > (hi[1] - target):
            frac = (math.log(target) - math.log(lo[1])) / (math.log(hi[1]) - math.log(lo[1]))
            return lo[0] + frac * (hi[0] - lo[0])
    hazard = (1 - clipped) / max(mean_length, 1.0)
    if hazard <= 0:
        return 2.0 * cap
    est = cap + (math.log(target) - math.log(c)) / math.log1p(-min(hazard, 0.999))
    return min(2.0 * cap, max(cap / 2.0, est))


def adaptive_next(cap: int, side: int, estimate: float, step: int, floor: int, ceiling: int) -> int:
    """One move on the side ``band_side`` found: toward the estimate, by at least ``step`` tokens."""
    if side == 0:
        return cap
    move = max(step, abs(round(estimate) - cap))
    return min(ceiling, cap + move) if side > 0 else max(floor, cap - move)


def reference_floor(references: Sequence[str], tokenizer, quantile: float) -> int:
    """Tokens (+1 for EOS) within which ``quantile`` of the reference answers end; 0 when off or no references."""
    if quantile <= 0 or not references:
        return 0
    ids = tokenizer(list(references), add_special_tokens=False)["input_ids"]
    lengths = sorted(len(x) + 1 for x in ids)
    return lengths[max(0, math.ceil(quantile * len(lengths)) - 1)]


class CompletionLengthControl(TrainerCallback):
    """Owns the current cap; other parts (the EOS reward) read ``current``, evaluation reads ``budget``.

    Adaptive: each logged step adds its completions (their clipped ratio and mean length) to a window
    of at most ``window_completions``, counted since the last change. When the pooled ratio lies
    outside the band by ``hysteresis`` standard errors, the cap moves toward where the ratio would
    be the band's middle (``target_cap``), by at least ``step`` tokens, and the window starts again.
    """

    def __init__(self, cfg: RunConfig, ceiling: int | None = None, log: Callable[[str], None] = print,
                 reference_floor: int = 0):
        g = cfg.generation
        self.adaptive = cfg.adaptive_length
        self.schedule = [list(x) for x in g.length_schedule]
        self.initial = cfg.initial_max_completion_length
        self.current = self.initial
        a = g.adaptive
        self.band = (a.band_low, a.band_high)
        self.cfg, self.planner_ceiling = cfg, ceiling
        self.ceiling = a.ceiling or ceiling or 4 * a.start
        self.step_size = a.step
        # ``reference_floor`` (see ``reference_floor()``) raises the floor, and the start with it, up to the ceiling.
        self.floor = max(a.floor, min(reference_floor, self.ceiling)) if self.adaptive else a.floor
        if self.adaptive:
            self.current = max(self.current, self.floor)
        self.window_completions, self.z = a.window_completions, a.hysteresis
        o = cfg.optimization  # completions behind one logged step (TRL logs their means)
        self.per_step = (o.per_device_train_batch_size * cfg.distributed.num_workers
                         * o.gradient_accumulation_steps * cfg.logging.logging_steps)
        self.recent: list[tuple[int, float, float]] = []  # (completions, clipped ratio, mean length) per step
        # (cap, smoothed ratio) of the latest windows that moved the cap up (ratio above the target) and down
        self.above: tuple[int, float] | None = None
        self.below: tuple[int, float] | None = None
        self.trainer = None
        self.log = log
        self.changes: list[tuple[int, int, int]] = []  # (step, old, new)

    @property
    def budget(self) -> int:
        """The most tokens this run ever generates: the adaptive ceiling, or the largest fixed/scheduled length."""
        return self.cfg.completion_budget(self.planner_ceiling)

    def bind(self, trainer) -> None:
        self.trainer = trainer
        set_generation_cap(trainer, self.current)

    def restore(self, rows: list[dict]) -> None:
        """Resume: replay the logged steps up to the checkpoint, so the cap, the window and the
        bracket are those the uninterrupted run had."""
        saved, self.log = self.log, None
        for row in rows:
            if "completions/clipped_ratio" in row and CAP_METRIC in row:
                self.current = int(row[CAP_METRIC])
                self.on_log(None, SimpleNamespace(global_step=int(row.get("step", 0))), None, logs=dict(row))
        self.log = saved
        if self.trainer is not None:
            set_generation_cap(self.trainer, self.current)

    def _set(self, step: int, length: int, why: str) -> None:
        if length == self.current:
            return
        self.changes.append((step, self.current, length))
        if self.log:
            self.log(f"[length] step {step}: max_completion_length {self.current} -> {length} ({why})")
        self.current = length
        if self.trainer is not None:
            set_generation_cap(self.trainer, length)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.schedule:
            self._set(state.global_step, scheduled_length(self.schedule, state.global_step, self.initial), "schedule")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "completions/clipped_ratio" not in logs:
            return
        logs[CAP_METRIC] = self.current  # the cap this step's completions were generated under
        if not self.adaptive:
            return
        mean_len = float(logs.get("completions/mean_length", self.current))
        self.recent.append((self.per_step, float(logs["completions/clipped_ratio"]), mean_len))
        while sum(n for n, _, _ in self.recent[1:]) >= self.window_completions:
            self.recent.pop(0)
        n = sum(x[0] for x in self.recent)
        clipped = sum(k * c for k, c, _ in self.recent) / n
        mean_len = sum(k * m for k, _, m in self.recent) / n
        side = band_side(clipped, n, self.band, self.z)
        if side == 0:
            return
        target = sum(self.band) / 2
        here = (self.current, smoothed_ratio(clipped, n))
        # A point on the other side that contradicts this window (the policy's lengths moved) is stale.
        if side > 0 and self.below is not None and self.below[0] <= self.current:
            self.below = None
        if side < 0 and self.above is not None and self.above[0] >= self.current:
            self.above = None
        est = target_cap(self.current, clipped, n, mean_len, target, (self.above, self.below))
        new = adaptive_next(self.current, side, est, self.step_size, self.floor, self.ceiling)
        if new != self.current:
            if side > 0:
                self.above = here
            else:
                self.below = here
            self._set(state.global_step, new, f"clipped ratio {clipped:.2f} of {n} completions outside "
                      f"[{self.band[0]}, {self.band[1]}]; estimate {est:.0f}")
            self.recent.clear()
