"""Reading a config without running it: the GPU memory planner and the settings that cannot act.

The planner, one job per module: ``shapes`` (a model's decoder shape from its config.json or a
built-in), ``gpus`` (GPU presets and the local GPU's size), ``formulas`` (per-GPU bytes of every
component), ``memory`` (a run config into the formulas' inputs, the plan and its searches; its names
stay readable as ``memory.<name>``) and ``plan_cli`` (``synth-grpo plan``). ``inert``: settings
that have no effect on a run.

May import: ``pipeline.data``, ``pipeline.config``, ``pipeline.rundir`` and below."""
