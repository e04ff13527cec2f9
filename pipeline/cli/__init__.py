"""``synth-grpo`` and its sub-commands (``main``): parse, check, then hand over to the package that
does the work.

May import: every package."""
