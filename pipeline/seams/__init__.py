"""Every place the project relies on a library's private name, patched function or
version-specific behaviour (TRL, transformers, DeepSpeed, Ray), one module per library
(``trl_seams``, ``transformers_seams``, ``deepspeed_seams``, ``ray_seams``), each seam with the
version it was written against and what breaks if it moves. Nothing else in ``pipeline/`` or
``rewards/`` touches a private name of those libraries (``tests/test_seams.py`` checks it, and each
seam's effect); ``pyproject.toml`` pins each library to the minor version the seams were written against.

May import: nothing of the project (every layer may import it). Libraries only lazily, inside the
seam that needs them (``ray_seams.bind_embedded_ray_to_loopback`` runs before Ray is imported)."""
