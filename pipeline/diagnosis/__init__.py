"""Training health: the rules (live and after the fact), the metric history they read, reading a
run directory, and the doctor's report. Each submodule is imported on its own: the training path
(``pipeline.health``) needs only ``rules`` and ``history``."""
