"""The run directory and its storage: what a run writes and where (``files``: one constant per
file, the JSONL readers, ``write_atomic``, the run-name rule), the metric names the files share
(``metric_names``), the held-out answers' rows (``eval_samples``), the cloud or shared-disk copy
(``storage``) and the one-writer lease (``lease``).

May import: ``pipeline.errors``, ``pipeline.seams``. Nothing here knows the config or training."""
