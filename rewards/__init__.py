"""Pure reward components (no Ray): ROUGE-L, length similarity, termination shaping, frozen judge."""
