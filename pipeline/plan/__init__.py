"""Reading a config without running it: the GPU memory planner (``memory``, ``synth-grpo plan``)
and the settings that cannot act (``inert``).

May import: ``pipeline.data``, ``pipeline.config``, ``pipeline.rundir`` and below."""
