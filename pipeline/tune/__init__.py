"""Ray Tune over training: the search-space YAML as Tune distributions (``search_space``) and the
search itself, one training run per trial (``tuner``).

May import: ``pipeline.training`` and below."""
