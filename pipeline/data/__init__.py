"""The rows a run trains on: SYNTH, local files, SQuAD-style JSON and the bundled German sample
(``sources``), the stable eval split, and the tiny offline policy and judge the project builds
itself (``tiny_models``).

May import: ``pipeline.config``, ``pipeline.rundir`` and below."""
