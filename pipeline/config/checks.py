"""The config's rules across fields (one check per section, as TRL's config classes check theirs in
``__post_init__``), the probes of the filesystem for model folders and data paths, and the resume
policy: which fields a rerun may change and still resume."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from pipeline.config.batch import generation_batch_problems, worker_count_problems
from pipeline.config.build import build
from pipeline.config.messages import choice_problem, did_you_mean, shown
from pipeline.config.schema import (ATTN_IMPLEMENTATIONS, HUB_KERNEL, LORA_ALL_LINEAR, MODULE_NAME, REPORT_TO,
                                    REWARD_COMPONENTS, TINY_POLICY, RunConfig, field_values)
from pipeline.rundir.files import run_name_problem
from pipeline.rundir.storage import StorageError, check_location, redacted

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


def resume_changes(saved: dict[str, Any], cfg: RunConfig) -> list[tuple[str, Any, Any]]:
    """(field, saved value, new value) for every field outside RESUME_SAFE_FIELDS that differs.

    The saved config is rebuilt on today's defaults, so a field added since it was written counts
    as unchanged when the new config keeps its default.
    """
    old = field_values(build(saved, []))
    new = field_values(cfg)
    return [
        (k, old.get(k), new.get(k))
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and not any(k == s or (s.endswith(".") and k.startswith(s)) for s in RESUME_SAFE_FIELDS)
    ]


# One check per section, as TRL's config classes check theirs in ``__post_init__``; each returns
# "field: value, what is allowed" lines, and ``validate`` runs them all so every problem shows at once.


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
    p: list[str] = []
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
    g, p = cfg.generation, generation_batch_problems(cfg)
    mcl = g.max_completion_length
    if isinstance(mcl, str) and mcl != "adaptive":
        p.append(f"generation.max_completion_length: {shown(mcl)} must be a positive integer or 'adaptive'"
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
    return p


def _installed(module: str) -> bool:
    """Importable, without importing it (vLLM takes seconds to import); None in sys.modules blocks it."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def engine_problem(cfg: RunConfig) -> str | None:
    """Why the configured generation engine cannot start here, or None. Asked by the commands that
    generate (train, tune), not by those that only read the config (plan, doctor): a laptop without
    vLLM may plan a vLLM run."""
    if cfg.generation.backend == "vllm" and not _installed("vllm"):
        return ("generation.backend: 'vllm' needs vLLM, which is not installed in this environment; install it "
                "with ./scripts/setup.sh vllm (without a GPU that is vLLM's CPU build), or set generation.backend: hf")
    return None


def _check_grpo(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    gr = cfg.grpo
    if gr.epsilon_high is not None and gr.epsilon_high < gr.epsilon:
        return [f"grpo.epsilon_high: {gr.epsilon_high} must be >= epsilon {gr.epsilon}"]
    return []


def _check_distributed(cfg: RunConfig, base_dir: Path | None) -> list[str]:
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
        return [f"lora.target_modules: {shown(m)} is not a module name (letters, digits, '_', '.', '-')" for m in bad]
    if tm == LORA_ALL_LINEAR:
        return []
    try:
        with warnings.catch_warnings():  # "possible nested set" and the like: PEFT compiles it the same way
            warnings.simplefilter("ignore")
            re.compile(tm)
    except re.error as e:
        return [f"lora.target_modules: {shown(tm)} is neither 'all-linear' nor a regular expression ({e})"]
    return [] if tm.strip() else ["lora.target_modules: empty; give module names or 'all-linear'"]


def _check_model_names(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    """model.attn_implementation and logging.report_to, against the names transformers accepts."""
    attn = cfg.model.attn_implementation
    p = [] if attn is None or HUB_KERNEL.fullmatch(attn) else choice_problem("model.attn_implementation", attn, ATTN_IMPLEMENTATIONS)
    return p + [q for i, name in enumerate(cfg.logging.report_to)
                for q in choice_problem(f"logging.report_to[{i}]", name, REPORT_TO)]


def _check_data(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    dd, p = cfg.data, []
    if dd.source in ("local", "squad") and not dd.path:
        p.append(f"data.path: required for data.source {dd.source!r}")
    elif dd.source in ("local", "squad") and not on_disk(resolve_path(dd.path, base_dir)):
        p.append(f"data.path: {dd.path!r} does not exist")
    return p


def _check_outputs(cfg: RunConfig, base_dir: Path | None) -> list[str]:
    """logging and output: how the run is watched and kept."""
    st, name = cfg.output.storage, cfg.output.run_name
    p = []
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


_CHECKS = (_check_rewards, _check_judge, _check_generation, _check_grpo, _check_distributed,
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
