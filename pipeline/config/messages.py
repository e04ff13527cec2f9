"""How a config problem is written: one printable line, naming the field, with a did-you-mean."""

from __future__ import annotations

import difflib
from typing import Any


def one_line(problem: str, limit: int = 1000) -> str:
    """A problem as one printable line: a newline or control character from the input is escaped, a long one cut."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(problem))
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ConfigError(ValueError):
    """Raised with every problem found; the CLI prints one line per problem and exits 2."""

    def __init__(self, problems: list[str]):
        self.problems = [one_line(p) for p in problems]
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a value in a message, not a copy of the file)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * limit:
        return "an integer of over 4000 digits" if value.bit_length() > 13000 else f"a {len(str(abs(value)))}-digit integer"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def did_you_mean(word: Any, options: Any, prefix: str = "") -> str:
    """`` (did you mean 'PREFIX + the closest option'?)`` for a misspelt name, else ""."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def choice_problem(name: str, value: Any, allowed: tuple) -> list[str]:
    """``name: 'x' is not one of a, b (did you mean 'b'?)``, or nothing when ``value`` is allowed."""
    if value in allowed:
        return []
    return [f"{name}: {shown(value)} is not one of {', '.join(map(str, allowed))}{did_you_mean(value, allowed)}"]
