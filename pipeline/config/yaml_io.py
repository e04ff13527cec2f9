"""Config files read and written as YAML: safe types, no aliases, bounded in size and nesting, and
every failure one line naming the file (a run's saved config.yaml and a search space are read so too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeline.config.messages import ConfigError

CONFIG_MAX_BYTES = 1 << 20  # a run config or a search space is a few KB; a larger file is not one
CONFIG_MAX_DEPTH = 100  # [ and { nesting: PyYAML's scanner is quadratic in it (3,000 "[" take seconds)


class NoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases: ``*name`` repeats an anchored node, and a few nested ones turn
    600 bytes into gigabytes. No shipped config or space uses them; write the values out instead."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not supported; write the value out",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)


class NoAliasDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, writing a value met twice out again instead of as an alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(data: Any) -> str:
    """``data`` as YAML that ``read_yaml`` reads back (values written out, never as aliases)."""
    return yaml.dump(data, Dumper=NoAliasDumper, sort_keys=False, allow_unicode=True)


def _yaml_problem(e: Exception) -> str:
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or " ".join(str(e).split())
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else what


def _flow_depth(text: str) -> int:
    """The deepest nesting of [ and { in text (brackets inside strings count too: an upper bound)."""
    if text.count("[") + text.count("{") <= CONFIG_MAX_DEPTH:
        return 0
    depth = deepest = 0
    for c in text:
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(depth - 1, 0)
    return deepest


def read_yaml(path: str | Path, max_bytes: int = CONFIG_MAX_BYTES) -> Any:
    """The YAML document in ``path`` (safe types, no aliases, at most ``max_bytes``); anything else is a
    ConfigError with one line naming the file and what is wrong (never a traceback)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError([f"{path}: cannot be read ({e.strerror or type(e).__name__})"]) from None
    if len(raw) > max_bytes:
        raise ConfigError([f"{path}: larger than {max_bytes} bytes; not a config file"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})"]) from None
    depth = _flow_depth(text)
    if depth > CONFIG_MAX_DEPTH:
        raise ConfigError([f"{path}: not valid YAML: brackets nested {depth} deep (at most {CONFIG_MAX_DEPTH})"])
    try:
        return yaml.load(text, Loader=NoAliasLoader)  # noqa: S506 (safe: a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {_yaml_problem(e)}"]) from None
    except RecursionError:
        raise ConfigError([f"{path}: not valid YAML: nested too deeply"]) from None
    except ValueError as e:  # PyYAML's int() of a number over Python's 4300 digits
        raise ConfigError([f"{path}: not valid YAML: {' '.join(str(e).split())[:200]}"]) from None
