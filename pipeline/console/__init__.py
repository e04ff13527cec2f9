"""What a person watches while a run or a search goes: the driver's console drawn from the run
directory's files (``live``) and Ray Tune's trial board (``trials``). The worker's side (the events
it writes) lives in ``pipeline.training.events``.

May import: ``pipeline.config``, ``pipeline.rundir`` and below; never training."""
