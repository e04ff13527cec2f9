"""One training run: the driver (``driver``: Ray, the reward pool, the Ray Train ``TorchTrainer``)
and everything that runs in a Ray Train worker: the worker loop (``worker``), TRL's
``GRPOTrainer`` with dynamic sampling (``dynamic_sampling``), the length cap
(``length_control``), the callbacks (``callbacks``, ``health``, ``events``) and elastic resume
(``elastic``).

May import: ``pipeline.console``, ``pipeline.diagnosis``, ``pipeline.scoring``, ``pipeline.plan``,
``pipeline.data``, ``pipeline.config``, ``pipeline.rundir``, ``rewards`` and below; never the
report, tune or the CLI."""
