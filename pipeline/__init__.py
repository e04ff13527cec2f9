"""synth-grpo: Ray-orchestrated GRPO fine-tuning of a German QA model."""

__version__ = "0.1.0"
