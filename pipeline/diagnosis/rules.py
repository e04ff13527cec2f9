"""Training health rules: they name the baseline run's pathologies early, live and after the fact.

The baseline run's author found each problem by reading curves after 18,000 steps. These rules read the
same metric stream (TRL's names, one dict per logged step) and say within the first few hundred
steps what is wrong, with the numbers they saw and the config key to change.

Rules are pure functions ``rule(history, end, settings, config) -> Finding | None`` that judge
the first ``end`` logged steps. ``diagnose`` replays a whole run and reports the step at which
each rule would first have fired live, so the doctor and the live callback
(``pipeline.training.health.HealthCallback``) agree (``Tracker``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

from pipeline.config import get_path, scheduled_length, yaml_number
from pipeline.diagnosis.history import History
from pipeline.plan.inert import one_step_per_rollout, rollout_text
from pipeline.rundir.metric_names import CAP_METRIC, MAX_STEP, number

# ---------------------------------------------------------------- settings and findings


@dataclass(frozen=True)
class RuleSettings:
    """Thresholds and windows. Windows count logged steps and grow with the run, so the same
    defaults judge a 30-step tiny run and an 18,000-step real one."""

    min_window: int = 10  # smallest window (logged steps)
    window_fraction: float = 0.05  # ... growing to this share of the steps seen
    max_window: int = 200  # ... but never longer, so a late problem is seen late by at most this
    clipped_ratio: float = 0.95  # never_stops: mean completions/clipped_ratio at or above
    entropy_fraction: float = 0.3  # entropy_collapse: below this share of the early entropy
    early_steps: int = 10  # entropy values averaged for "early"
    entropy_rise: float = 2.0  # entropy_blowup: at or above this multiple of the early entropy ...
    entropy_rise_nats: float = 1.0  # ... and at least this much above it
    length_growth: float = 2.0  # length_overshoot: mean completion length at or above this multiple of the early one ...
    overshoot_clipped: float = 0.2  # ... while at least this share is cut (below never_stops' share)
    clip_zero: float = 1e-6  # no_effective_update: clip_ratio/region_mean at or below ...
    reward_std_min: float = 0.01  # ... while reward_std is below this
    zero_std_fraction: float = 0.5  # zero_variance_groups: mean frac_reward_zero_std above
    still_clipped: float = 0.1  # length_schedule_ignored: clipped ratio that proves the real cap
    plateau_min_window: int = 10  # reward_plateau window (logged steps) ...
    plateau_fraction: float = 0.25  # ... growing to this share of the steps seen
    plateau_planned_fraction: float = 0.02  # ... and at least this share of the planned run (config max_steps)
    plateau_max_window: int = 1000
    plateau_min_gain: float = 0.01  # reward_plateau: the tail's trend bounds the gain per window below this ...
    plateau_rel_gain: float = 0.1  # ... and, if it rose before, its rate must be below this share of the earlier rate
    divergence_min_change: float = 0.01  # judge up and ROUGE-L down by at least this ...
    confidence_z: float = 3.0  # ... and by this many standard errors (plateau: the gain's upper bound)
    # Logged steps of the whole run when no config says (optimization.max_steps): `diagnose` sets it to the
    # stream's length, so after the fact long windows are scaled to the run that was actually logged.
    planned_rows: int | None = None

    def window(self, seen: int) -> int:
        return min(self.max_window, max(self.min_window, int(self.window_fraction * seen)))

    def plateau_window(self, seen: int, planned: int | None = None) -> int:
        """Windows for slow trends are long: a share of the steps seen and of the planned run."""
        floor = int(self.plateau_planned_fraction * planned) if planned else 0
        return min(self.plateau_max_window, max(self.plateau_min_window, int(self.plateau_fraction * seen), floor))


@dataclass
class Finding:
    rule: str
    first_step: int  # the logged step at which the rule first held
    summary: str  # one line with the numbers
    evidence: dict[str, Any]  # the steps and numbers the rule saw
    why: str  # why it matters
    advice: list[str] = field(default_factory=list)  # "config.key: value — reason"
    status: str = "active"  # "active": it still holds at the last logged step; "resolved": it stopped holding
    last_step: int | None = None  # the last logged step at which it held (its span is first_step..last_step)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def to_json(findings: Iterable[Finding]) -> str:
        """The findings as `synth-grpo doctor --json` prints them and health.json holds them."""
        return json.dumps([f.to_dict() for f in findings], indent=1)

    @property
    def resolved(self) -> bool:
        return self.status == "resolved"

    def span(self) -> str:
        last = self.first_step if self.last_step is None else self.last_step
        return f"step {self.first_step}" if last == self.first_step else f"steps {self.first_step}-{last}"

    def format(self) -> str:
        head = (f"[{self.rule}] resolved, held at {self.span()} and no longer at the end: {self.summary}" if self.resolved
                else f"[{self.rule}] step {self.first_step}: {self.summary}")
        lines = [head, f"  why: {self.why}", "  change:"]
        lines += [f"    - {a}" for a in self.advice]
        return "\n".join(lines)


# ---------------------------------------------------------------- config helpers

_MISSING = object()


def _advice(cfg: Mapping[str, Any] | None, key: str, value: Any, reason: str) -> str:
    """'key: value (now X) — reason'; the current value is named only when the config is known."""
    cur = get_path(cfg, key, _MISSING)
    now = "" if cfg is None or cur is _MISSING else (" (already set)" if cur == value else f" (now {_fmt(cur)})")
    return f"{key}: {_fmt(value)}{now} — {reason}"


def _fmt(v: Any, limit: int = 120) -> str:
    """A config value as the YAML and --set spell it: a string bare, anything else as JSON (true, null, [..]);
    at most ``limit`` characters (a run folder's config can hold anything)."""
    try:
        s = v if isinstance(v, str) else json.dumps(v, default=str)
    except (ValueError, RecursionError):  # a circular or too deep value
        s = f"<{type(v).__name__}>"
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _span(h: History, a: int, b: int) -> list[int]:
    return [h.steps[max(a, 0)], h.steps[b - 1]]


def _lower_lr(cfg: Mapping[str, Any] | None) -> float:
    lr = yaml_number(get_path(cfg, "optimization.learning_rate"))
    return 5e-6 if lr is None or lr > 5e-6 else float(f"{lr / 2:.1g}")


def _halved_lr(cfg: Mapping[str, Any] | None) -> float:
    """Half the run's learning rate: an overshoot at the peak is the policy's step size, not the 8B's 5e-6 default."""
    lr = yaml_number(get_path(cfg, "optimization.learning_rate"))
    return float(f"{lr / 2:.2g}") if lr and lr > 0 else _lower_lr(cfg)


def _planned_rows(cfg: Mapping[str, Any] | None, s: RuleSettings | None = None) -> int | None:
    """Logged steps the run will have: optimization.max_steps / logging.logging_steps, else the settings' planned_rows."""
    steps, every = get_path(cfg, "optimization.max_steps"), get_path(cfg, "logging.logging_steps", 1)
    ok = isinstance(steps, int) and isinstance(every, int) and 0 < every and 0 <= steps <= MAX_STEP
    return steps // every if ok else (s.planned_rows if s is not None else None)


def _more_generations(cfg: Mapping[str, Any] | None) -> int:
    g = get_path(cfg, "generation.num_generations")
    return 8 if not isinstance(g, int) or g < 8 else 2 * g


# ---------------------------------------------------------------- rules

Rule = Callable[[History, int, RuleSettings, "Mapping[str, Any] | None"], "Finding | None"]


def never_stops(h: History, end: int, s: RuleSettings, cfg: Mapping[str, Any] | None = None) -> Finding | None:
    w = s.window(end)
    a = end - w
    m = h.mean("completions/clipped_ratio", a, end, min_count=max(2, w // 2)) if a >= 0 else None
    if m is None or m < s.clipped_ratio:
        return None
    mx = h.mean("completions/max_length", a, end)
    ev = {"steps": _span(h, a, end), "logged_steps": w, "clipped_ratio_mean": _r(m),
          "mean_length": _r(h.mean("completions/mean_length", a, end), 1), "max_length": _r(mx, 1),
          "threshold": s.clipped_ratio}
    adv = []
    if cfg is None or not number(get_path(cfg, "rewards.weights.eos")):
        adv.append(_advice(cfg, "rewards.weights.eos", 1.0, "count the eos component at all"))
    adv += [
        _advice(cfg, "rewards.eos_bonus", 0.1, "a bonus when the completion ends with EOS, so stopping is rewarded"),
        _advice(cfg, "rewards.truncation_penalty", 0.1, "a penalty when it is cut at the cap"),
        _advice(cfg, "generation.max_completion_length", "adaptive",
                "keeps the clipped ratio in generation.adaptive.band_low..band_high (0.1..0.3) by moving the cap"),
        _advice(cfg, "rewards.overlong_weight", 0.1, "DAPO soft overlong penalty over the last rewards.overlong_buffer tokens"),
        _advice(cfg, "grpo.mask_truncated_completions", True, "optional: truncated completions leave the loss"),
    ]
    return Finding(
        "never_stops", h.steps[end - 1],
        f"completions/clipped_ratio averaged {m:.2f} over steps {ev['steps'][0]}-{ev['steps'][1]} ({w} logged steps)"
        + (f"; completions run to the cap ({mx:.0f} tokens) without EOS" if mx is not None else ""),
        ev,
        "the policy never ends with EOS: every completion is cut, so every length-based reward is equal within a "
        "group and gives no signal, and the model never learns to stop",
        adv,
    )


def entropy_collapse(h: History, end: int, s: RuleSettings, cfg: Mapping[str, Any] | None = None) -> Finding | None:
    r = _early_and_now(h, "entropy", end, s)
    if r is None or r[1] >= s.entropy_fraction * r[0]:
        return None
    early, cur, k, a = r
    target = round(0.5 * early, 2)
    ev = {"early_entropy": _r(early), "early_steps": _span(h, 0, k), "entropy": _r(cur), "steps": _span(h, a, end),
          "ratio": _r(cur / early, 3), "threshold_fraction": s.entropy_fraction}
    return Finding(
        "entropy_collapse", h.steps[end - 1],
        f"entropy fell from {early:.2f} (steps {ev['early_steps'][0]}-{ev['early_steps'][1]}) to {cur:.2f} "
        f"(steps {ev['steps'][0]}-{ev['steps'][1]}), {100 * cur / early:.0f}% of its early value",
        ev,
        "the policy has become nearly deterministic: the completions of a group look alike, their rewards tie, and "
        "GRPO stops exploring answers better than the current one",
        [
            _advice(cfg, "grpo.adaptive_entropy", True, "TRL's controller raises the entropy bonus while entropy is below the target"),
            _advice(cfg, "grpo.entropy_target", target, f"about half the early entropy ({early:.2f})"),
            _advice(cfg, "grpo.epsilon_high", 0.28, "clip-higher (DAPO) lets unlikely tokens gain probability" + (
                "; it acts only with grpo.num_iterations >= 2 or a larger generation.steps_per_generation: here "
                f"{_rollout_ratio_one(cfg)}" if _rollout_ratio_one(cfg) else "")),
            _advice(cfg, "optimization.learning_rate", _lower_lr(cfg), "a lower peak LR slows the collapse"),
        ],
    )


def _early_and_now(h: History, key: str, end: int, s: RuleSettings) -> tuple[float, float, int, int] | None:
    """(early mean, mean over the last window, early rows, window start) of ``key``; None until both exist."""
    k = h.first_index_with(key, s.early_steps)
    if k is None or k >= end:
        return None
    w = s.window(end)
    a = max(k, end - w)
    early, cur = h.mean(key, 0, k), h.mean(key, a, end, min_count=max(2, min(w, end - a) // 2))
    return None if cur is None or not early or early <= 0 else (early, cur, k, a)


def entropy_blowup(h: History, end: int, s: RuleSettings, cfg: Mapping[str, Any] | None = None) -> Finding | None:
    r = _early_and_now(h, "entropy", end, s)
    if r is None or r[1] < s.entropy_rise * r[0] or r[1] - r[0] < s.entropy_rise_nats:
        return None
    early, cur, k, a = r
    ev = {"early_entropy": _r(early), "early_steps": _span(h, 0, k), "entropy": _r(cur), "steps": _span(h, a, end),
          "ratio": _r(cur / early, 3), "entropy_coef": _r(h.mean("entropy_coef", a, end), 5), "threshold_ratio": s.entropy_rise}
    coef = ev["entropy_coef"]
    return Finding(
        "entropy_blowup", h.steps[end - 1],
        f"entropy rose from {early:.2f} (steps {ev['early_steps'][0]}-{ev['early_steps'][1]}) to {cur:.2f} "
        f"(steps {ev['steps'][0]}-{ev['steps'][1]}), {cur / early:.1f}x its early value"
        + (f", with an entropy bonus of {coef:g}" if coef else ""),
        ev,
        "the policy drifts toward random tokens: answers lose coherence, every reward component falls, and long "
        "rambling completions run into the cap; an entropy bonus or clip-higher that pushes entropy up, or a step size "
        "too large for the policy, drives it",
        [
            _advice(cfg, "optimization.learning_rate", _halved_lr(cfg), "a smaller step size"),
            _advice(cfg, "grpo.entropy_coef", 0.0, "no fixed entropy bonus; the adaptive controller adds one only "
                    "below grpo.entropy_target"),
            _advice(cfg, "grpo.entropy_target", round(0.5 * early, 2), f"below the early entropy ({early:.2f}), so the "
                    "controller's bonus stays off while entropy is high"),
            _advice(cfg, "grpo.epsilon_high", 0.2, "symmetric clipping: clip-higher lets unlikely tokens gain probability"),
        ],
    )


def length_overshoot(h: History, end: int, s: RuleSettings, cfg: Mapping[str, Any] | None = None) -> Finding | None:
    r = _early_and_now(h, "completions/mean_length", end, s)
    if r is None or r[1] < s.length_growth * r[0]:
        return None
    early, cur, k, a = r
    clip = h.mean("completions/clipped_ratio", a, end)
    if clip is None or not s.overshoot_clipped <= clip < s.clipped_ratio:  # all cut: never_stops says it
        return None
    ev = {"early_mean_length": _r(early, 1), "early_steps": _span(h, 0, k), "mean_length": _r(cur, 1),
          "steps": _span(h, a, end), "clipped_ratio_mean": _r(clip), "entropy": [_r(h.mean("entropy", 0, k)),
          _r(h.mean("entropy", a, end))], "cap": _r(h.mean(CAP_METRIC, a, end), 1), "threshold_growth": s.length_growth}
    return Finding(
        "length_overshoot", h.steps[end - 1],
        f"completions grew from {early:.1f} tokens (steps {ev['early_steps'][0]}-{ev['early_steps'][1]}) to {cur:.1f} "
        f"(steps {ev['steps'][0]}-{ev['steps'][1]}) and {100 * clip:.0f}% are cut",
        ev,
        "the answers run on past what they need: the length and judge rewards still pay for more words, the cap (if "
        "adaptive) follows them up, per-token entropy rises with the length, and the held-out score falls while it lasts "
        "(the tiny policy at its peak learning rate: docs/ablation.md)",
        [
            _advice(cfg, "optimization.learning_rate", _halved_lr(cfg), "the overshoot comes at the peak learning rate"),
            _advice(cfg, "optimization.warmup_ratio", 0.2, "a longer warmup reaches the peak more slowly"),
            _advice(cfg, "rewards.weights.eos", 1.0, "reward ending with EOS, so stopping competes with more words"),
            _advice(cfg, "rewards.overlong_weight", 0.1, "DAPO's soft penalty over the last rewards.overlong_buffer tokens "
                    "before the cap"),
        ],
    )


def _region_clip(h: History, a: int, b: int, min_count: int) -> float | None:
    m = h.mean("clip_ratio/region_mean", a, b, min_count)
    if m is None:  # older TRL: low and high only
        lo, hi = h.mean("clip_ratio/low_mean", a, b, min_count), h.mean("clip_ratio/high_mean", a, b, min_count)
        m = None if lo is None or hi is None else lo + hi
    return m


def _rollout_ratio_one(cfg: Mapping[str, Any] | None) -> str | None:
    """When the config says each rollout is used up inside one optimizer step, the PPO ratio is exactly 1 and
    the clip ratios are 0 by construction: the reason as text, else None (also None without a config)."""
    if cfg is None:
        return None
    ga, spg, it = (get_path(cfg, "optimization.gradient_accumulation_steps", 1), get_path(cfg, "generation.steps_per_generation"),
                   get_path(cfg, "grpo.num_iterations", 1))
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in (ga, it)) or not (
            spg is None or isinstance(spg, int) and spg >= 1):
        return None
    return rollout_text(ga, spg, it) if one_step_per_rollout(ga, spg, it) else None


def no_effective_update(h: History, end: int, s: RuleSettings, cfg: Mapping[str, Any] | None = None) -> Finding | None:
    w = s.window(end)
    a = end - w
    if a < 0:
        return None
    need = max(2, w // 2)
    clip = _region_clip(h, a, end, need)
    rstd = h.mean("reward_std", a, end, need)
    # With the ratio exactly 1 by construction, zero clip ratios are expected and prove nothing: only the
    # reward spread counts then.
    by_construction = _rollout_ratio_one(cfg)
    if rstd is None or rstd >= s.reward_std_min or (not by_construction and (clip is None or clip > s.clip_zero)):
        return None
    ev = {"steps": _span(h, a, end), "logged_steps": w, "clip_ratio_region_mean": _r(clip, 6), "reward_std_mean": _r(rstd, 5),
          "frac_reward_zero_std_mean": _r(h.mean("frac_reward_zero_std", a, end)), "reward_std_threshold": s.reward_std_min,
          "clip_ratio_zero_by_construction": bool(by_construction)}
    if by_construction:
        summary = (f"reward_std {rstd:.4f} (< {s.reward_std_min}) over steps {ev['steps'][0]}-{ev['steps'][1]}; the clip "
                   f"ratios are 0 by construction here ({by_construction}), so they are no symptom")
        why = ("advantages are rewards minus the group mean: with almost no reward spread they are ~0 and the optimizer "
               "steps change almost nothing")
    else:
        summary = (f"clip_ratio/region_mean {clip:.2g} and reward_std {rstd:.4f} (< {s.reward_std_min}) over steps "
                   f"{ev['steps'][0]}-{ev['steps'][1]}")
        why = ("advantages are rewards minus the group mean: with almost no reward spread they are ~0, the policy ratio "
               "never leaves the clip region, and the optimizer steps change almost nothing")
    return Finding(
        "no_effective_update", h.steps[end - 1], summary, ev, why,
        [
            _advice(cfg, "generation.num_generations", _more_generations(cfg),
                    "more completions per prompt, more spread within each group (`synth-grpo plan` says what fits)"),
            _advice(cfg, "judge.backend", "embedding",
                    "a frozen judge with continuous scores (or `llm` with a separate frozen model), not parsed integers or the policy itself"),
            _advice(cfg, "generation.max_completion_length", "adaptive", "if completions are all clipped, length rewards tie"),
        ],
    )


def zero_variance_groups(h: History, end: int, s: RuleSettings, cfg: Mapping[str, Any] | None = None) -> Finding | None:
    w = s.window(end)
    a = end - w
    m = h.mean("frac_reward_zero_std", a, end, min_count=max(2, w // 2)) if a >= 0 else None
    if m is None or m <= s.zero_std_fraction:
        return None
    ev = {"steps": _span(h, a, end), "logged_steps": w, "frac_reward_zero_std_mean": _r(m), "threshold": s.zero_std_fraction}
    return Finding(
        "zero_variance_groups", h.steps[end - 1],
        f"{100 * m:.0f}% of groups had identical rewards (frac_reward_zero_std) over steps {ev['steps'][0]}-{ev['steps'][1]}",
        ev,
        "a group whose completions all get the same reward has zero advantage and contributes no gradient; most of each "
        "batch is wasted",
        [
            _advice(cfg, "grpo.dynamic_sampling.enabled", True, "drop groups whose reward std is below "
                    "grpo.dynamic_sampling.min_std and refill the batch from fresh prompts (DAPO dynamic sampling)"),
            _advice(cfg, "generation.num_generations", _more_generations(cfg), "larger groups are less often all equal"),
            _advice(cfg, "judge.backend", "embedding", "continuous judge scores break ties that integer grades leave"),
            _advice(cfg, "generation.max_completion_length", "adaptive", "clipped completions tie on length and EOS"),
            _advice(cfg, "generation.temperature", 1.0, "more diverse samples per group"),
        ],
    )


def config_caps(cfg: Mapping[str, Any] | None) -> tuple[int | None, list[tuple[int, int]]]:
    """(first cap, sorted [(step, length)]) of a config dict's generation.length_schedule (also drawn by plots)."""
    sched = get_path(cfg, "generation.length_schedule")
    sched = sched if isinstance(sched, list) else []
    mcl = get_path(cfg, "generation.max_completion_length", 160)
    start = get_path(cfg, "generation.adaptive.start", 64) if mcl == "adaptive" else mcl
    pairs = sorted((int(p[0]), int(p[1])) for p in sched if isinstance(p, (list, tuple)) and len(p) == 2
                   and all(number(x) is not None for x in p))
    return (int(start) if number(start) is not None else None), pairs


def _expected_cap(h: History, i: int, caps: tuple[int | None, list[tuple[int, int]]]) -> float | None:
    """The cap generation should have used at row i: the logged one, else the config's schedule."""
    v = h.value(CAP_METRIC, i)
    if v is not None:
        return v
    start, sched = caps
    return scheduled_length(sched, h.steps[i], start) if sched else None


def length_schedule_ignored(h: History, end: int, s: RuleSettings, cfg: Mapping[str, Any] | None = None) -> Finding | None:
    w = s.min_window
    if end < w + 1:
        return None
    # A completion cut without EOS has exactly the cap's length, so clipped completions that stay shorter than
    # the expected cap prove generation still uses an older, lower one.
    conf = config_caps(cfg)
    base_i = h.first_index_with(CAP_METRIC, 1)
    base = conf[0] if conf[1] else (h.value(CAP_METRIC, base_i - 1) if base_i else None)
    if base is None:
        return None
    caps, lens = [], []
    for i in range(end - 1, end - w - 1, -1):
        cap, mx, clip = _expected_cap(h, i, conf), h.value("completions/max_length", i), h.value("completions/clipped_ratio", i)
        if cap is None or mx is None or clip is None or cap <= base or mx >= cap - 0.5 or clip < s.still_clipped:
            return None
        caps.append(cap)
        lens.append(mx)
    raise_i = next(i for i in range(end) if (_expected_cap(h, i, conf) or 0) > base)
    new_cap, stuck = min(caps), max(lens)
    clip = h.mean("completions/clipped_ratio", end - w, end)
    source = f"logged {CAP_METRIC}" if h.value(CAP_METRIC, raise_i) is not None else "config generation.length_schedule"
    ev = {"raise_step": h.steps[raise_i], "previous_limit": base, "new_limit": new_cap, "source": source,
          "steps": _span(h, end - w, end), "completions_max_length": stuck, "clipped_ratio_mean": _r(clip)}
    logged = source.startswith("logged")
    why = ("the pipeline logged a higher cap than generation used: its schedule did not reach generation" if logged else
           "generation still uses the old cap: a schedule that changes args.max_completion_length after TRL copied it "
           "at init changes nothing") + "; answers that need more room stay cut and the schedule never reaches training"
    if logged:
        adv = ["a bug in this pipeline's length control: report it with this run directory; meanwhile:",
               _advice(cfg, "generation.max_completion_length", int(new_cap), "a fixed cap from the start")]
    else:
        adv = [_advice(cfg, "generation.length_schedule", get_path(cfg, "generation.length_schedule") or [[ev["raise_step"], int(new_cap)]],
                       "keep the schedule but run it with this pipeline, which sets what generation reads (trainer attribute, "
                       "generation config, vLLM sampling params) and logs generation/max_completion_length; drop callbacks "
                       "that mutate args"),
               _advice(cfg, "generation.max_completion_length", "adaptive", "or let the cap follow the clipped ratio")]
    return Finding(
        "length_schedule_ignored", h.steps[end - 1],
        f"the cap rose from {base:g} to {new_cap:g} at step {ev['raise_step']} ({source}), but completions/max_length "
        f"stayed at {stuck:g} over steps {ev['steps'][0]}-{ev['steps'][1]} while {100 * clip:.0f}% were still clipped",
        ev, why, adv,
    )


def reward_plateau(h: History, end: int, s: RuleSettings, cfg: Mapping[str, Any] | None = None) -> Finding | None:
    # Evidence proportionate to the run. The tail is the last 2w logged steps (w grows with the steps seen and
    # with the planned run); a least-squares trend over the whole tail, at its upper confidence bound (z SE),
    # must gain less than plateau_min_gain per window. Then either the reward rose before the tail (a
    # significant trend over the head worth at least plateau_min_gain) and the tail's rate is below
    # plateau_rel_gain of that earlier rate; or it never rose, and the trend over the whole run bounds the gain
    # of as many steps again below plateau_min_gain. A slow but steady climb is neither.
    w = s.plateau_window(end, _planned_rows(cfg, s))
    t = end - 2 * w
    if t < w:
        return None
    R, z = "reward", s.confidence_z
    tail, head, whole = h.trend(R, t, end, w), h.trend(R, 0, t, max(3, t // 2)), h.trend(R, 0, end, end // 2)
    first, last = h.mean(R, 0, w), h.mean(R, end - w, end)
    if None in (tail, head, whole, first, last):
        return None
    tail_ucb = tail[0] + z * tail[1]
    if tail_ucb * w >= s.plateau_min_gain:
        return None
    rose = head[0] - z * head[1] > 0 and head[0] * t >= s.plateau_min_gain
    whole_ucb = whole[0] + z * whole[1]
    if (tail_ucb >= s.plateau_rel_gain * head[0]) if rose else (whole_ucb * end >= s.plateau_min_gain):
        return None
    ev = {"first_window": [_r(first)] + _span(h, 0, w), "last_window": [_r(last)] + _span(h, end - w, end),
          "tail_steps": _span(h, t, end), "tail_gain_per_window": _r(tail[0] * w), "tail_gain_upper_bound": _r(tail_ucb * w),
          "rose_before": rose, "earlier_gain_per_window": _r(head[0] * w) if rose else None,
          "run_gain_upper_bound": None if rose else _r(whole_ucb * end), "window": w,
          "min_gain": s.plateau_min_gain, "rel_gain": s.plateau_rel_gain}
    tail_text = (f"the trend over steps {ev['tail_steps'][0]}-{ev['tail_steps'][1]} gains {tail[0] * w:+.4f} "
                 f"(at most {tail_ucb * w:+.4f}) per {w} logged steps")
    if rose:
        tail_text += f", under {100 * s.plateau_rel_gain:.0f}% of the earlier {head[0] * w:+.4f}"
    else:
        tail_text += f"; it never rose: at most {whole_ucb * end:+.4f} over as many steps again"
    return Finding(
        "reward_plateau", h.steps[end - 1],
        f"mean reward {first:.3f} over steps {ev['first_window'][1]}-{ev['first_window'][2]}, {last:.3f} over steps "
        f"{ev['last_window'][1]}-{ev['last_window'][2]}; {tail_text}",
        ev,
        "more steps at these settings buy nothing; a plateau with never_stops, no_effective_update or "
        "zero_variance_groups is their symptom, so fix those first",
        [
            _advice(cfg, "optimization.learning_rate", _lower_lr(cfg), "or search it: `synth-grpo tune` (LR, group size, reward weights)"),
            _advice(cfg, "generation.num_generations", _more_generations(cfg), "more spread within groups, stronger advantages"),
            "rewards.weights: rebalance toward the component that still moves (see reward.png: rewards/<component>/mean)",
        ],
    )


def judge_rouge_divergence(h: History, end: int, s: RuleSettings, cfg: Mapping[str, Any] | None = None) -> Finding | None:
    w = s.plateau_window(end, _planned_rows(cfg, s))
    a, m = end - 2 * w, end - w
    if a < 0:
        return None
    J, R = "rewards/judge/mean", "rewards/rouge_l/mean"
    need = max(2, w // 2)
    j0, j1, r0, r1 = h.mean(J, a, m, need), h.mean(J, m, end, need), h.mean(R, a, m, need), h.mean(R, m, end, need)
    if None in (j0, j1, r0, r1):
        return None
    dj, dr = j1 - j0, r1 - r0
    sj = s.confidence_z * math.hypot(h.sem(J, a, m), h.sem(J, m, end))
    sr = s.confidence_z * math.hypot(h.sem(R, a, m), h.sem(R, m, end))
    if dj < max(s.divergence_min_change, sj) or dr > -max(s.divergence_min_change, sr):
        return None
    ev = {"judge": [_r(j0), _r(j1)], "rouge_l": [_r(r0), _r(r1)], "before_steps": _span(h, a, m), "steps": _span(h, m, end),
          "min_change": s.divergence_min_change}
    self_judge = get_path(cfg, "judge.backend") == "self"
    return Finding(
        "judge_rouge_divergence", h.steps[end - 1],
        f"rewards/judge/mean rose {j0:.3f} -> {j1:.3f} while rewards/rouge_l/mean fell {r0:.3f} -> {r1:.3f} "
        f"(steps {ev['before_steps'][0]}-{ev['before_steps'][1]} vs {ev['steps'][0]}-{ev['steps'][1]})",
        ev,
        "the judge likes the answers more while they match the references less: the policy is likely learning what "
        "pleases the judge" + (" (here it judges itself)" if self_judge else "") + " rather than answering better",
        [
            _advice(cfg, "judge.backend", "embedding", "a frozen judge that never receives gradients (or `llm` with a separate frozen model)"),
            _advice(cfg, "rewards.weights.judge", 0.3, "less weight on the judge ..."),
            _advice(cfg, "rewards.weights.rouge_l", 0.5, "... more on the reference overlap"),
            "read samples.jsonl around these steps to see what the judge rewards",
        ],
    )


# Each rule by its function's name, the name its findings carry.
RULES: dict[str, Rule] = {rule.__name__: rule for rule in (
    never_stops, entropy_collapse, no_effective_update, zero_variance_groups, length_schedule_ignored, reward_plateau,
    judge_rouge_divergence, entropy_blowup, length_overshoot)}


def config_dict(config: Any) -> Mapping[str, Any] | None:
    """A RunConfig as its dict; a dict (or None) as it is."""
    return config.to_dict() if hasattr(config, "to_dict") else config


def check(h: History, end: int | None = None, settings: RuleSettings | None = None, config: Any = None,
          rules: Iterable[str] | None = None) -> list[Finding]:
    """The findings that hold at the end of the first `end` rows (default: all); the live path."""
    end = len(h) if end is None else end
    if end < 1:
        return []
    s, cfg = settings or RuleSettings(), config_dict(config)
    out = [RULES[r](h, end, s, cfg) for r in (rules or RULES)]
    return [f for f in out if f is not None]


class Tracker:
    """Each rule over a growing history: the finding from the step it first held; `settle` then marks it
    active or resolved (with the last step it held) at the end of the history. The one bookkeeping shared
    by the doctor's replay and the live callback."""

    def __init__(self, settings: RuleSettings | None = None, config: Any = None, rules: Iterable[str] | None = None):
        self.settings, self.config = settings or RuleSettings(), config_dict(config)
        self.pending = [r for r in (rules or RULES) if r in RULES]
        self.found: dict[str, tuple[Finding, int]] = {}  # rule -> (finding, rows seen when it first held)

    def update(self, h: History, end: int | None = None) -> list[Finding]:
        """Judge the first `end` rows (default: all) by the rules that have not held yet; returns those that now do."""
        end = len(h) if end is None else end
        new = [f for f in (RULES[r](h, end, self.settings, self.config) for r in self.pending) if f is not None] if end else []
        for f in new:
            self.pending.remove(f.rule)
            f.last_step = f.first_step
            self.found[f.rule] = (f, end)
        return new

    def settle(self, h: History) -> list[Finding]:
        """Mark each finding active if it still holds on the whole history, else resolved, with the last step
        it held (found backwards from the end: one check for an active finding)."""
        for name, (f, first) in self.found.items():
            last = next((e for e in range(len(h), first, -1) if RULES[name](h, e, self.settings, self.config)), first)
            f.last_step, f.status = h.steps[last - 1], "active" if last == len(h) else "resolved"
        return self.findings()

    def findings(self) -> list[Finding]:
        return sorted((f for f, _ in self.found.values()), key=lambda f: f.first_step)


def diagnose(rows: Iterable[Mapping[str, Any]] | History, settings: RuleSettings | None = None, config: Any = None,
             rules: Iterable[str] | None = None) -> list[Finding]:
    """Replay a run: for each rule, the finding at the first step where it held (sorted by step), marked
    resolved, with the last step it held, when it no longer holds at the end. Without a config that says how
    long the run was planned, long windows are scaled to the length of the stream."""
    h = rows if isinstance(rows, History) else History(rows)
    s, cfg = settings or RuleSettings(), config_dict(config)
    if _planned_rows(cfg, s) is None:
        s = replace(s, planned_rows=len(h))
    tracker = Tracker(s, cfg, rules)
    for end in range(1, len(h) + 1):
        if not tracker.pending:
            break
        tracker.update(h, end)
    return tracker.settle(h)
