"""Search spaces for `synth-grpo tune`: YAML in, Ray Tune distributions and valid trial configs out.

Parsing collects every problem (key, value, what was expected) before Ray starts, so a bad space
exits 2 with one line per problem. A trial's config is a pure function of the base config and the
sampled values, so the driver, the trial and the results table all rebuild the same config.
Ray is imported only in ``to_tune``: the parser and its tests need none.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from pipeline.config import (REWARD_COMPONENTS, ConfigError, RunConfig, config_from_dict, did_you_mean, divides_into_groups,
                             get_path, mapping_default, read_yaml, set_path, yaml_number)

DISTRIBUTIONS = ("loguniform", "uniform", "choice", "randint")
SIMPLEX = "simplex"
SPACE_KEYS = ("num_samples", "space", "asha")
ASHA_KEYS = ("grace_period", "reduction_factor")
# eval.* defines the objective and output.* is set per trial: searching them makes trials incomparable.
FORBIDDEN_GROUPS = ("eval", "output")
SIMPLEX_FLOOR = 1e-6  # lower bound of the uniform draws behind a simplex (-log(0) is infinite)


class SpaceError(ConfigError):
    """A bad search space: every problem, one line each (the CLI exits 2)."""

    def __init__(self, problems: list[str]):
        super().__init__(problems)
        self.args = ("invalid search space:\n" + "\n".join(f"  - {p}" for p in problems),)


@dataclass(frozen=True)
class Dist:
    """One searched config field: ``kind`` is a distribution name or ``fixed``."""

    key: str
    kind: str
    args: tuple

    def to_tune(self):
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.args))
        # loguniform, uniform and randint by name
        return self.args[0] if self.kind == "fixed" else getattr(tune, self.kind)(*self.args)

    def corners(self) -> list[Any]:
        """The values most likely to break a config: both ends, every option."""
        return [self.args[0], self.args[1] - 1] if self.kind == "randint" else list(self.args)


@dataclass(frozen=True)
class Simplex:
    """Reward weights drawn uniformly on a simplex: ``drawn`` sum to ``total``, ``fixed`` are set apart.

    Each drawn component is a uniform draw u; the weights are -log(u) normalised (a flat Dirichlet),
    so Optuna sees ordinary uniform parameters. A fixed value of None keeps the base config's weight.
    """

    key: str
    drawn: tuple[str, ...]
    fixed: dict[str, float | None] = field(default_factory=dict)
    total: float = 1.0

    def param(self, component: str) -> str:
        return f"{self.key}[{component}]"

    def to_tune(self) -> dict[str, Any]:
        from ray import tune

        return {self.param(c): tune.uniform(SIMPLEX_FLOOR, 1.0) for c in self.drawn}

    def weights(self, params: dict[str, Any], current: dict[str, float]) -> dict[str, float]:
        mass = [-math.log(min(1.0, max(SIMPLEX_FLOOR, float(params[self.param(c)])))) for c in self.drawn]
        norm = sum(mass)
        share = [m / norm if norm > 0 else 1.0 / len(mass) for m in mass]
        return {**current, **{c: self.total * s for c, s in zip(self.drawn, share)},
                **{c: (current.get(c, 0.0) if v is None else v) for c, v in self.fixed.items()}}

    def corners(self) -> list[dict[str, Any]]:
        """Equal weights, and all mass on each drawn component in turn."""
        even = {self.param(c): 0.5 for c in self.drawn}
        peaks = [{self.param(c): (SIMPLEX_FLOOR if c == d else 1.0) for c in self.drawn} for d in self.drawn]
        return [even, *peaks]


@dataclass
class SearchSpace:
    path: str
    params: list[Dist]
    simplexes: list[Simplex]
    num_samples: int = 8
    grace_period: int | None = None  # ASHA: None = eval.every_steps
    reduction_factor: int = 2
    raw: dict[str, Any] = field(default_factory=dict)  # the YAML as read, saved with a search for --resume

    def to_tune(self) -> dict[str, Any]:
        """Ray Tune's param_space: flat, keyed by config path (and ``key[component]`` for simplex draws)."""
        space: dict[str, Any] = {d.key: d.to_tune() for d in self.params}
        for s in self.simplexes:
            space.update(s.to_tune())
        return space

    @property
    def searched_keys(self) -> list[str]:
        """Config paths a trial's values differ in (for the results table)."""
        keys = [d.key for d in self.params if d.kind != "fixed"]
        for s in self.simplexes:
            keys += [f"{s.key}.{c}" for c in (*s.drawn, *s.fixed)]
        return keys

    def trial_config(self, base: dict[str, Any], params: dict[str, Any]) -> RunConfig:
        """Base config + sampled values, batch size fitted to the group, validated (raises ConfigError)."""
        data = copy.deepcopy(base)
        for d in self.params:
            set_path(data, d.key, _plain(params[d.key]) if d.key in params else d.args[0])
        for s in self.simplexes:
            current = get_path(data, s.key)  # a mapping the base config does not set: its default, not {}
            set_path(data, s.key, s.weights(params, dict(current if isinstance(current, dict) else mapping_default(s.key) or {})))
        fit_batch_to_groups(data)
        return config_from_dict(data)

    def check_against(self, base: dict[str, Any]) -> list[str]:
        """Validate trial configs at every corner of the space (one field at a time), before Ray starts."""
        mid = {s.param(c): 0.5 for s in self.simplexes for c in s.drawn}
        first = {d.key: d.corners()[0] for d in self.params}
        problems: list[str] = []
        probes = [(d.key, v, {**first, **mid, d.key: v}) for d in self.params for v in d.corners()]
        probes += [(s.key, "simplex corner", {**first, **mid, **c}) for s in self.simplexes for c in s.corners()]
        for key, value, params in probes or [("(base)", None, {})]:
            try:
                self.trial_config(base, params)
            except ConfigError as e:
                for p in e.problems:
                    line = f"{self.path}: {key}={value!r} gives an invalid trial config: {p}"
                    if line not in problems:
                        problems.append(line)
        return problems


# ---------------------------------------------------------------- batch size


def fit_batch_to_groups(data: dict[str, Any]) -> int | None:
    """Raise per_device_train_batch_size to the next size TRL accepts for this num_generations.

    TRL needs per_device_train_batch_size * num_workers * steps_per_generation divisible by
    num_generations; the batch only grows, so every prompt still gets its whole group.
    Returns the new batch size, or None when it was already valid.
    """
    o, g = data.get("optimization", {}), data.get("generation", {})
    defaults = RunConfig()
    num_gen = g.get("num_generations", defaults.generation.num_generations)
    batch = o.get("per_device_train_batch_size", defaults.optimization.per_device_train_batch_size)
    workers = data.get("distributed", {}).get("num_workers", defaults.distributed.num_workers)
    spg = g.get("steps_per_generation") or o.get("gradient_accumulation_steps", 1)
    ints = (num_gen, batch, workers, spg)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in ints):
        return None  # config validation names the bad field
    if divides_into_groups(batch * workers * spg, num_gen):
        return None
    step = num_gen // math.gcd(num_gen, workers * spg)
    new = -(-batch // step) * step
    data.setdefault("optimization", {})["per_device_train_batch_size"] = new
    return new


# ---------------------------------------------------------------- config paths


def _plain(value: Any) -> Any:
    """numpy scalars from Tune's samplers -> Python numbers (config validation checks types)."""
    return value.item() if hasattr(value, "item") and not isinstance(value, (list, dict, str)) else value


def _weights_dict(tp: Any) -> bool:
    return typing.get_origin(tp) is dict


def config_fields() -> dict[str, Any]:
    """Every searchable config path -> its type (``group.field``, nested sections, weight components)."""
    out: dict[str, Any] = {}

    def walk(cls: type, prefix: str) -> None:
        for name, tp in typing.get_type_hints(cls).items():
            path = f"{prefix}{name}"
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{path}.")
                continue
            out[path] = tp
            if _weights_dict(tp) and name in ("weights", "score_weights"):
                for c in REWARD_COMPONENTS:
                    out[f"{path}.{c}"] = float

    walk(RunConfig, "")
    return out


def _accepts(tp: Any, kind: type) -> bool:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return any(_accepts(a, kind) for a in typing.get_args(tp))
    return tp is kind


# ---------------------------------------------------------------- parsing


def _parse_bounds(key: str, kind: str, value: Any, problems: list[str]) -> tuple | None:
    if not (isinstance(value, list) and len(value) == 2):
        problems.append(f"{key}: {kind} expects [low, high], got {value!r}")
        return None
    low, high = (yaml_number(v) for v in value)
    if low is None or high is None:
        problems.append(f"{key}: {kind} bounds must be numbers, got {value!r}")
        return None
    if kind == "randint":
        if not (float(low).is_integer() and float(high).is_integer()):
            problems.append(f"{key}: randint bounds must be integers, got {value!r}")
            return None
        low, high = int(low), int(high)
    if low >= high:
        what = "high is exclusive, so high must be > low" if kind == "randint" else "need low < high"
        problems.append(f"{key}: {kind} low {low} >= high {high} ({what})")
        return None
    if kind == "loguniform" and low <= 0:
        problems.append(f"{key}: loguniform low {low} must be > 0 (log scale)")
        return None
    return (float(low), float(high)) if kind != "randint" else (low, high)


def _parse_dist(key: str, tp: Any, spec: Any, problems: list[str]) -> Dist | None:
    if not isinstance(spec, dict):  # a plain value holds the field fixed for every trial
        return Dist(key, "fixed", (spec,))
    if len(spec) != 1:
        problems.append(f"{key}: expected one distribution ({', '.join(DISTRIBUTIONS)}), got keys {sorted(spec)}")
        return None
    kind, value = next(iter(spec.items()))
    if kind == SIMPLEX:
        problems.append(f"{key}: simplex applies to a whole weights mapping (e.g. rewards.weights), not one field")
        return None
    if kind not in DISTRIBUTIONS:
        problems.append(f"{key}: unknown distribution {kind!r}{did_you_mean(kind, DISTRIBUTIONS)} (allowed: {', '.join(DISTRIBUTIONS)})")
        return None
    if kind == "choice":
        if not isinstance(value, list) or not value:
            problems.append(f"{key}: choice expects a non-empty list of options, got {value!r}")
            return None
        bad = [v for v in value if not (v is None or isinstance(v, (str, int, float, bool)))]
        if bad:
            problems.append(f"{key}: choice options must be single values (number, string, bool, null), got {bad[0]!r}")
            return None
        return Dist(key, kind, tuple(value))
    bounds = _parse_bounds(key, kind, value, problems)
    if bounds is None:
        return None
    if kind in ("loguniform", "uniform") and not _accepts(tp, float):
        problems.append(f"{key}: {kind} draws floats but the field takes integers; use randint or choice")
        return None
    if kind == "randint" and not (_accepts(tp, int) or _accepts(tp, float)):
        problems.append(f"{key}: randint draws integers but the field is not a number")
        return None
    return Dist(key, kind, bounds)


def _parse_simplex(key: str, tp: Any, spec: dict, problems: list[str]) -> Simplex | None:
    if not _weights_dict(tp) or key != "rewards.weights":
        problems.append(f"{key}: simplex only applies to rewards.weights")
        return None
    known = len(problems)  # the simplex is built only when none is added below
    problems += [f"{key}: unknown simplex key {k!r}{did_you_mean(k, (SIMPLEX, 'fixed', 'total'))} (allowed: simplex, fixed, total)"
                 for k in spec if k not in (SIMPLEX, "fixed", "total")]
    drawn, fixed_raw, total = spec.get(SIMPLEX), spec.get("fixed", {}), yaml_number(spec.get("total", 1.0))
    if not isinstance(drawn, list) or len(drawn) < 2:
        problems.append(f"{key}: simplex expects a list of at least 2 reward components to draw, got {drawn!r}")
        return None
    for c in drawn:
        if c not in REWARD_COMPONENTS:
            problems.append(f"{key}: simplex component {c!r} is not a reward component{did_you_mean(c, REWARD_COMPONENTS)} (allowed: {', '.join(REWARD_COMPONENTS)})")
    if len(set(drawn)) != len(drawn):
        problems.append(f"{key}: simplex lists a component twice: {drawn!r}")
    if isinstance(fixed_raw, list):
        fixed_raw = {c: None for c in fixed_raw}
    if not isinstance(fixed_raw, dict):
        problems.append(f"{key}: fixed expects a list of components (keep the config's weight) or a mapping component: weight, got {fixed_raw!r}")
        return None
    fixed: dict[str, float | None] = {}
    for c, w in fixed_raw.items():
        if c not in REWARD_COMPONENTS:
            problems.append(f"{key}: fixed component {c!r} is not a reward component{did_you_mean(c, REWARD_COMPONENTS)}")
        elif c in drawn:
            problems.append(f"{key}: {c!r} is both drawn and fixed; list it in one of them")
        elif w is not None and (yaml_number(w) is None or yaml_number(w) < 0):
            problems.append(f"{key}: fixed weight for {c!r} must be a number >= 0, got {w!r}")
        else:
            fixed[c] = None if w is None else float(yaml_number(w))
    if total is None or total <= 0:
        problems.append(f"{key}: total must be a number > 0, got {spec.get('total')!r}")
    return Simplex(key, tuple(drawn), fixed, float(total)) if len(problems) == known else None


def parse_space(data: Any, path: str = "<space>") -> SearchSpace:
    """Parse a loaded YAML mapping; raises SpaceError listing every problem."""
    problems: list[str] = []
    if not isinstance(data, dict):
        raise SpaceError([f"{path}: expected a mapping with 'space:' at top level, got {type(data).__name__}"])
    problems += [f"{path}: unknown top-level key {k!r}{did_you_mean(k, SPACE_KEYS)} (allowed: {', '.join(SPACE_KEYS)})"
                 for k in data if k not in SPACE_KEYS]
    num_samples = data.get("num_samples", 8)
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        problems.append(f"num_samples: {num_samples!r} must be an integer >= 1")
    asha = data.get("asha") or {}
    if not isinstance(asha, dict):
        problems.append(f"asha: expected a mapping ({', '.join(ASHA_KEYS)}), got {asha!r}")
        asha = {}
    for k, v in asha.items():
        if k not in ASHA_KEYS:
            problems.append(f"asha.{k}: unknown key{did_you_mean(k, ASHA_KEYS)} (allowed: {', '.join(ASHA_KEYS)})")
        elif not isinstance(v, int) or isinstance(v, bool) or v < (2 if k == "reduction_factor" else 1):
            problems.append(f"asha.{k}: {v!r} must be an integer >= {2 if k == 'reduction_factor' else 1}")
    space = data.get("space")
    if not isinstance(space, dict) or not space:
        problems.append(f"space: expected a non-empty mapping of config field paths to distributions, got {space!r}")
        raise SpaceError(problems)

    fields = config_fields()
    params: list[Dist] = []
    simplexes: list[Simplex] = []
    for key, spec in space.items():
        key = str(key)
        if key not in fields:
            problems.append(f"{key}: unknown config field{did_you_mean(key, fields)}")
            continue
        if key.split(".")[0] in FORBIDDEN_GROUPS:
            problems.append(f"{key}: {key.split('.')[0]}.* cannot be searched (eval.* defines the objective, output.* is set per trial)")
            continue
        tp = fields[key]
        if isinstance(spec, dict) and SIMPLEX in spec:
            s = _parse_simplex(key, tp, spec, problems)
            if s:
                simplexes.append(s)
        elif _weights_dict(tp) and isinstance(spec, dict):
            problems.append(f"{key}: a weights mapping is searched with 'simplex: [components]' (or search one component, e.g. {key}.judge)")
        else:
            d = _parse_dist(key, tp, spec, problems)
            if d:
                params.append(d)
    problems += [f"{d.key}: also set by the simplex on {s.key}; search it in one place"
                 for s in simplexes for d in params if d.key.startswith(s.key + ".")]
    if problems:
        raise SpaceError(problems)
    return SearchSpace(path, params, simplexes, num_samples, asha.get("grace_period"), asha.get("reduction_factor", 2), data)


def load_space(path: str | Path) -> SearchSpace:
    """Read and parse a space YAML file; raises SpaceError."""
    path = Path(path)
    if not path.is_file():
        raise SpaceError([f"--space: file {str(path)!r} does not exist"])
    try:
        data = read_yaml(path)
    except ConfigError as e:
        raise SpaceError(e.problems) from None
    return parse_space(data, str(path))
