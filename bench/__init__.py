"""Benchmarks: measured comparisons the docs quote (docs/benchmarks.md, docs/memory.md).

Run each from the repository root as a module, e.g. ``python -m bench.gpu_check --help``; every
script starts with ``bench.common`` (repository root, offline Hugging Face settings, a local Ray,
the machine line and the ``--json`` output)."""
