"""The reward pool: Ray actors around the pure components in ``rewards/`` (``pool``), and the
TRL reward functions that call them from a training worker (``clients``).

May import: ``rewards``, ``pipeline.plan``, ``pipeline.data``, ``pipeline.config`` and below."""
