"""Reading a finished (or running) run after the fact: ``synth-grpo doctor`` (``doctor``: the
findings, ``markdown``: report.md, ``plots``: its PNGs), ``synth-grpo compare`` (``compare``)
and the run reader they share (``run_reader``).

May import: ``pipeline.diagnosis``, ``pipeline.plan``, ``pipeline.config``, ``pipeline.rundir``
and below; never training or tune (a report must open on a laptop without Ray or torch)."""
