"""A config from a YAML file and ``--set`` overrides: read, overridden, built and checked, every
problem reported at once (ConfigError), before Ray starts."""

from __future__ import annotations

import contextlib
import typing
from pathlib import Path
from typing import Any

import yaml

from pipeline.config.build import build
from pipeline.config.checks import on_disk, resolve_path, validate
from pipeline.config.messages import ConfigError
from pipeline.config.schema import DEFAULT_CONFIG, RunConfig, mapping_default
from pipeline.config.yaml_io import NoAliasLoader, read_yaml


def yaml_number(value: Any) -> float | None:
    """A YAML number, else None (bools too). PyYAML follows YAML 1.1, which reads ``1e-5`` (no dot)
    as a string, so a string Python reads as a float counts."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return float(value)
    return None


def get_path(data: Any, dotted: str, default: Any = None) -> Any:
    """``data["a"]["b"]`` for ``"a.b"``; ``default`` where a part is missing or not a mapping."""
    node = data
    for part in dotted.split("."):
        if not isinstance(node, typing.Mapping) or part not in node:
            return default
        node = node[part]
    return node


def set_path(data: dict, dotted: str, value: Any) -> str | None:
    """``data["a"]["b"] = value`` for ``"a.b"``, creating missing groups; the part that is not a group, else None."""
    *groups, last = dotted.split(".")
    node = data
    for part in groups:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return part
    node[last] = value
    return None


def _parse_scalar(text: str) -> Any:
    """--set values are parsed as YAML scalars/lists: 8 -> int, 1e-5 -> float, [a, b] -> list."""
    try:
        value = yaml.load(text, Loader=NoAliasLoader)  # noqa: S506 (safe: a SafeLoader)
    except (yaml.YAMLError, ValueError, RecursionError):
        return text
    if isinstance(value, str) and any(c.isdigit() for c in value):  # not "nan", "inf"
        number = yaml_number(value)
        return value if number is None else number
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str], problems: list[str]) -> None:
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {item!r}: expected group.key=value")
            continue
        path, _, raw = item.partition("=")
        keys = path.strip().split(".")
        if len(keys) < 2 or not all(keys):
            problems.append(f"--set {item!r}: expected group.key=value (for example optimization.learning_rate=1e-5)")
            continue
        for i in range(2, len(keys)):  # one key of a mapping field the file does not set: into its default
            prefix = ".".join(keys[:i])
            if get_path(data, prefix) is None and (default := mapping_default(prefix)) is not None:
                set_path(data, prefix, default)
        not_group = set_path(data, path.strip(), _parse_scalar(raw))
        if not_group:
            problems.append(f"--set {path}: '{not_group}' is not a group")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (default: configs/tiny.yaml), apply --set overrides, validate. Raises ConfigError."""
    path = Path(path) if path else DEFAULT_CONFIG
    problems: list[str] = []
    if not path.is_file():
        raise ConfigError([f"--config: file {str(path)!r} does not exist"])
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping of groups at top level, got {type(data).__name__}"])
    apply_overrides(data, list(overrides or []), problems)
    if isinstance(data.get("output", {}), dict) and get_path(data, "output.run_name") is None:
        set_path(data, "output.run_name", path.stem)  # checked like a given name: it names the run's folder
    cfg = config_from_dict(data, problems, base_dir=path.parent)
    if cfg.data.path and on_disk(resolve_path(cfg.data.path, path.parent)):
        cfg.data.path = str(resolve_path(cfg.data.path, path.parent).resolve())
    for section in (cfg.model, cfg.judge):  # local model folders, absolute for Ray workers and jobs
        attr = "name_or_path" if section is cfg.model else "model"
        local = resolve_path(getattr(section, attr), path.parent)
        if on_disk(local, "is_dir"):
            setattr(section, attr, str(local.resolve()))
    return cfg


MAX_PROBLEMS = 100  # lines a config error shows; a file of a thousand unknown keys needs no more


def config_from_dict(data: dict[str, Any], problems: list[str] | None = None, base_dir: Path | None = None) -> RunConfig:
    """The config in ``data``, checked; raises ConfigError with every problem.

    A field of the wrong type or range keeps its default for the checks across fields, whose lines about
    a field already named are left out (they would be about the default, not the value given).
    """
    problems = [] if problems is None else problems
    cfg = build(data, problems)
    named = {p.split(":", 1)[0] for p in problems}
    problems.extend(p for p in validate(cfg, base_dir=base_dir) if p.split(":", 1)[0] not in named)
    if len(problems) > MAX_PROBLEMS:
        problems[MAX_PROBLEMS:] = [f"... and {len(problems) - MAX_PROBLEMS} more problems"]
    if problems:
        raise ConfigError(problems)
    return cfg
