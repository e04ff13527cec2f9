"""Every place the project relies on a library's private name, patched function or
version-specific behaviour (TRL, transformers, DeepSpeed, Ray), one module per library, each seam
with the version it was written against and what breaks if it moves. Nothing else in the project
touches a private name of those libraries (``tests/test_architecture.py``).

May import: nothing of the project (every layer may import it)."""
