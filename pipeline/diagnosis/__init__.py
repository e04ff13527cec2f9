"""Training health: the rules (``rules``), shared by the live health callback and the doctor, and
the metric history they read (``history``).

May import: ``pipeline.plan``, ``pipeline.config``, ``pipeline.rundir`` and below."""
