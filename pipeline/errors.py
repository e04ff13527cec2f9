"""How every `synth-grpo` command reports bad input and failures: one form, one place."""

from __future__ import annotations

import sys


def cli_error(command: str, message: object, problems: list[str] | tuple = (), code: int = 2) -> int:
    """`synth-grpo COMMAND: MESSAGE` and one `  - problem` line each on stderr; returns the exit code."""
    print("\n  - ".join([f"synth-grpo {command}: {message}", *problems]), file=sys.stderr)
    return code
