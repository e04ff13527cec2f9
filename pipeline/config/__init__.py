"""The one typed run config: the schema (one pydantic dataclass per section, every field with its default
and declared range or choices), YAML and ``--set`` loading, the checks that list every problem at once,
and the batch arithmetic TRL and an elastic group impose. ``from pipeline.config import RunConfig,
load_config, ...``.

- ``schema``: the sections and RunConfig; pydantic enforces types, ranges, finiteness and choices.
- ``build``: a mapping to a RunConfig, pydantic's errors as one line per problem with the dotted path.
- ``checks``: rules across fields, filesystem probes (model folders, data paths), the resume policy.
- ``batch``: TRL's divisibility rule (once) and the worker-count arithmetic of elastic groups.
- ``load``: ``load_config`` (YAML file + ``--set``) and ``config_from_dict``; ``yaml_io``: reading YAML safely.
- ``messages``: ConfigError and how a problem is worded (did-you-mean, values cut to one line).

May import: ``pipeline.rundir``, ``pipeline.errors``, ``pipeline.seams``.
"""

from pipeline.config.batch import (accumulation_for, divides_into_groups, for_world_size, samples_per_step,
                                   scaling_num_workers, worker_count_problems, worker_range)
from pipeline.config.build import build
from pipeline.config.checks import (RESUME_SAFE_FIELDS, STORAGE_SCHEMES, engine_problem, model_reference_problem, on_disk,
                                    resolve_path, resume_changes, validate)
from pipeline.config.load import (MAX_PROBLEMS, apply_overrides, config_from_dict, get_path, load_config, set_path,
                                  yaml_number)
from pipeline.config.messages import ConfigError, did_you_mean
from pipeline.config.schema import (ATTN_IMPLEMENTATIONS, CONSOLE_MODES, DATA_SOURCES, DEFAULT_CONFIG, HUB_KERNEL,
                                    JUDGE_BACKENDS, LORA_ALL_LINEAR, LOSS_TYPES, LR_SCHEDULERS, MODULE_NAME, PRECISIONS,
                                    REPO_ROOT, REPORT_TO, REWARD_COMPONENTS, SIGNED, TINY_POLICY, AdaptiveLengthSection,
                                    DataSection, DistributedSection, DynamicSamplingSection, EvalSection,
                                    GenerationSection, GRPOSection, JudgeSection, LoggingSection, LoraSection,
                                    ModelSection, OptimizationSection, OutputSection, RewardsSection, RunConfig,
                                    field_values, mapping_default, scheduled_length)
from pipeline.config.yaml_io import CONFIG_MAX_BYTES, CONFIG_MAX_DEPTH, read_yaml

__all__ = [
    "ATTN_IMPLEMENTATIONS", "CONFIG_MAX_BYTES", "CONFIG_MAX_DEPTH", "CONSOLE_MODES", "DATA_SOURCES", "DEFAULT_CONFIG",
    "HUB_KERNEL", "JUDGE_BACKENDS", "LORA_ALL_LINEAR", "LOSS_TYPES", "LR_SCHEDULERS", "MAX_PROBLEMS", "MODULE_NAME",
    "PRECISIONS", "REPO_ROOT", "REPORT_TO", "RESUME_SAFE_FIELDS", "REWARD_COMPONENTS", "SIGNED", "STORAGE_SCHEMES",
    "TINY_POLICY", "AdaptiveLengthSection", "ConfigError", "DataSection", "DistributedSection", "DynamicSamplingSection",
    "EvalSection", "GenerationSection", "GRPOSection", "JudgeSection", "LoggingSection", "LoraSection", "ModelSection",
    "OptimizationSection", "OutputSection", "RewardsSection", "RunConfig", "accumulation_for", "apply_overrides", "build",
    "config_from_dict", "did_you_mean", "divides_into_groups", "engine_problem", "field_values", "for_world_size", "get_path",
    "load_config", "mapping_default", "model_reference_problem", "on_disk", "read_yaml", "resolve_path", "resume_changes",
    "samples_per_step", "scaling_num_workers", "scheduled_length", "set_path", "validate", "worker_count_problems",
    "worker_range", "yaml_number",
]
