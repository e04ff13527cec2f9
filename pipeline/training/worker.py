"""One Ray Train worker: data, policy + LoRA, TRL GRPOTrainer with the pool's reward functions.

Everything a worker needs arrives as a ``WorkerArgs`` (the resolved config, the run directory, the
reward pool's actor handles, the run's storage), so the same loop runs under ``synth-grpo train``,
Ray Tune trials and ``ray job submit``. The loop reads as its phases (metric_names.WORKER_PHASES): set up,
callbacks, restore, build the trainer, train, finish; each is timed into the run's metrics
(``timing_s/<phase>``, pipeline/rundir/metric_names.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch

from pipeline.config import TINY_POLICY, ConfigError, RunConfig, for_world_size
from pipeline.data.sources import DataError, load_records, to_trl_rows
from pipeline.data.tiny_models import ensure_tiny
from pipeline.rundir.files import (ADAPTER_DIR, EVAL_SAMPLES, FATAL_FILE, FATAL_METRIC, HEALTH, LENGTH_CHANGES, METRICS,
                                   SAMPLES, TRAINER_DIR, WORKER_FILES, append_event, read_metrics, write_atomic)
from pipeline.rundir.metric_names import CAP_METRIC, TIMING_PREFIX
from pipeline.rundir.storage import RunFileSync, remove_unregistered_checkpoints, retry_cannot_fix, sync_callback
from pipeline.scoring.clients import make_pool_reward_funcs
from pipeline.training.callbacks import (Evaluator, MetricsSink, RayTrainReporter, SamplesWriter, training_callbacks,
                                         truncate_jsonl)
from pipeline.seams.deepspeed_seams import skip_shm_allreduce_build
from pipeline.seams.transformers_seams import deepspeed_resume_from
from pipeline.seams.trl_seams import keep_vllm_unloaded
from pipeline.training.elastic import record_world_size, reshard_for_group, resized
from pipeline.training.events import RunEvents, quiet_worker
from pipeline.training.health import HealthCallback
from pipeline.training.length_control import CompletionLengthControl, reference_floor
from pipeline.training.vllm_engine import engine_context_length, reserve_cpu_kv_cache
from pipeline.training.worker_args import WorkerArgs
from rewards.judge import SelfJudge

# Errors a retry cannot fix: the same data, model and config fail the same way on every attempt.
# OSError covers transformers' "not a local folder and not a valid model identifier" and missing files.
NOT_RETRYABLE = (ConfigError, DataError, OSError)


def resolve_policy_path(cfg: RunConfig) -> str:
    if cfg.model.name_or_path == TINY_POLICY:
        return str(ensure_tiny())
    return cfg.model.name_or_path


def precision_flags(cfg: RunConfig, on_gpu: bool) -> dict[str, bool]:
    p = cfg.optimization.precision
    if p == "auto":
        p = "bf16" if on_gpu and torch.cuda.is_bf16_supported() else ("fp16" if on_gpu else "fp32")
    return {"bf16": p == "bf16", "fp16": p == "fp16"}


def deepspeed_config(cfg: RunConfig, load_universal: bool = False) -> dict[str, Any] | None:
    """ZeRO stage 1-3 (and CPU offload); "auto" values are filled in from the TrainingArguments.
    ``load_universal``: the resume reads a universal checkpoint (pipeline.training.elastic.reshard)."""
    d = cfg.distributed
    if d.zero_stage == 0:
        return None
    zero: dict[str, Any] = {"stage": d.zero_stage, "overlap_comm": False, "contiguous_gradients": True}
    if d.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": d.use_gpu}
    if d.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": d.use_gpu}
    if d.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        **({"checkpoint": {"load_universal": True}} if load_universal else {}),
    }


def build_grpo_config(cfg: RunConfig, run_dir: Path, on_gpu: bool, is_rank0: bool, reward_weights: list[float],
                      load_universal: bool = False, length_ceiling: int | None = None):
    from trl import GRPOConfig  # trl (and datasets, pyarrow): loaded when a trainer is built

    o, g, gr, lg = cfg.optimization, cfg.generation, cfg.grpo, cfg.logging
    return GRPOConfig(
        output_dir=str(run_dir / TRAINER_DIR),
        max_steps=o.max_steps,
        per_device_train_batch_size=o.per_device_train_batch_size,
        gradient_accumulation_steps=o.gradient_accumulation_steps,
        steps_per_generation=g.steps_per_generation,
        learning_rate=o.learning_rate,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        weight_decay=o.weight_decay,
        lr_scheduler_type=o.lr_scheduler_type,
        warmup_steps=o.warmup_ratio,  # transformers 5: a float < 1 is a ratio of max_steps
        max_grad_norm=o.max_grad_norm,
        optim="adamw_torch_fused" if o.fused_adamw and cfg.distributed.zero_stage == 0 else "adamw_torch",
        seed=o.seed,
        data_seed=o.seed,
        use_cpu=not on_gpu,
        activation_checkpointing=cfg.model.gradient_checkpointing,  # transformers 5's name (the old one warns)
        logging_steps=lg.logging_steps,
        save_strategy="steps",
        save_steps=cfg.output.save_steps,
        save_total_limit=cfg.output.checkpoints_kept,
        report_to=list(lg.report_to) or "none",
        disable_tqdm=not (lg.progress_bar and is_rank0),
        deepspeed=deepspeed_config(cfg, load_universal),
        ddp_find_unused_parameters=False,
        # GRPO
        num_generations=g.num_generations,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k or 0,
        max_completion_length=cfg.initial_max_completion_length,
        use_vllm=g.backend == "vllm",
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=g.vllm_gpu_memory_utilization,
        vllm_enable_sleep_mode=g.vllm_sleep_mode and on_gpu,
        vllm_max_model_length=engine_context_length(cfg, length_ceiling),
        beta=gr.beta,
        epsilon=gr.epsilon,
        epsilon_high=gr.epsilon_high,
        entropy_coef=gr.entropy_coef,
        use_adaptive_entropy=gr.adaptive_entropy,
        entropy_target=gr.entropy_target,
        entropy_coef_max=gr.entropy_coef_max,
        entropy_coef_delta=gr.entropy_coef_delta,
        loss_type=gr.loss_type,
        mask_truncated_completions=gr.mask_truncated_completions,
        scale_rewards=gr.scale_rewards,
        num_iterations=gr.num_iterations,
        reward_weights=reward_weights,
        log_completions=False,
        **precision_flags(cfg, on_gpu),
    )


def lora_config(cfg: RunConfig):
    if not cfg.lora.enabled:
        return None
    from peft import LoraConfig  # peft: loaded when a trainer is built

    return LoraConfig(
        r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM",
    )


def _restore_length_state(run_dir: Path, step: int, length_ctl, truncate: bool) -> None:
    """Resume: every rank restores the same cap from metrics.jsonl; rank 0 also drops rows past the checkpoint."""
    rows = [r for r in read_metrics(run_dir / METRICS) if r.get("step", 0) <= step]
    if truncate:
        truncate_jsonl(run_dir / METRICS, step)
        truncate_jsonl(run_dir / SAMPLES, step)
    if any(CAP_METRIC in r for r in rows):
        length_ctl.restore(rows)


def load_tokenizer(cfg: RunConfig):
    """The policy's tokenizer, padded on the left (evaluation generates from padded batches)."""
    from transformers import AutoTokenizer  # transformers' auto classes: loaded on first use

    tokenizer = AutoTokenizer.from_pretrained(
        resolve_policy_path(cfg), revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_policy(cfg: RunConfig, on_gpu: bool, tokenizer=None):
    """(tokenizer, model, eos_ids) for the configured policy; hub ids and local paths load the same way."""
    from transformers import AutoModelForCausalLM  # transformers' auto classes: loaded on first use

    tokenizer = tokenizer or load_tokenizer(cfg)
    flags = precision_flags(cfg, on_gpu)
    dtype = torch.bfloat16 if flags["bf16"] else torch.float16 if flags["fp16"] else torch.float32
    model = AutoModelForCausalLM.from_pretrained(resolve_policy_path(cfg), dtype=dtype, revision=cfg.model.revision,
                                                 attn_implementation=cfg.model.attn_implementation,
                                                 trust_remote_code=cfg.model.trust_remote_code)
    eos_ids = model.generation_config.eos_token_id or tokenizer.eos_token_id
    eos_ids = [int(x) for x in (eos_ids if isinstance(eos_ids, list) else [eos_ids])]
    return tokenizer, model, eos_ids


def build_grpo_trainer(cfg: RunConfig, run_dir: Path, tokenizer, model, train_recs: list[dict], funcs, weights,
                       callbacks, on_gpu: bool = False, is_rank0: bool = True, load_universal: bool = False,
                       length_ceiling: int | None = None):
    """TRL's GRPOTrainer for this config: the one construction shared by Ray workers and benchmarks."""
    from datasets import Dataset  # datasets, trl: loaded when a trainer is built
    from trl import GRPOTrainer

    reserve_cpu_kv_cache(cfg, model, on_gpu, length_ceiling)  # before TRL starts the colocated vLLM engine
    trainer_class, extra = GRPOTrainer, {}
    if cfg.grpo.dynamic_sampling.enabled:  # DAPO dynamic sampling: a GRPOTrainer subclass
        from pipeline.training.dynamic_sampling import DynamicSamplingGRPOTrainer  # subclasses trl's trainer

        trainer_class, extra["dynamic_sampling"] = DynamicSamplingGRPOTrainer, cfg.grpo.dynamic_sampling
    return trainer_class(
        model=model,
        reward_funcs=funcs,
        args=build_grpo_config(cfg, run_dir, on_gpu, is_rank0, weights, load_universal, length_ceiling),
        train_dataset=Dataset.from_list(to_trl_rows(train_recs, cfg.data.system_prompt)),
        processing_class=tokenizer,
        peft_config=lora_config(cfg),
        callbacks=list(callbacks),
        **extra,
    )


@dataclass
class Resume:
    """Where this group starts: Ray Train's checkpoint (read in place or downloaded once per node, and
    let go of by ``files``), its step, and for a group of another size the resharded universal checkpoint."""

    checkpoint_dir: str | None = None
    step: int = 0
    saved_world: int | None = None  # the size of the group that saved it, when that differs from this one
    universal: Path | None = None
    files: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


@dataclass
class TrainingParts:
    """The trainer's collaborators, built before the resume (which replays the length cap into them)."""

    length_ctl: CompletionLengthControl
    self_judge: SelfJudge | None
    funcs: list
    weights: list[float]
    metrics: MetricsSink
    samples: SamplesWriter
    evaluator: Evaluator
    health: HealthCallback
    reporter: RayTrainReporter
    sync: RunFileSync | None  # rank 0 with output.storage
    callbacks: list


@dataclass
class WorkerRun:
    """One worker's run, handed from phase to phase: set up fills the first fields, each later phase its own."""

    args: WorkerArgs
    cfg: RunConfig  # args.cfg for this group's size
    rank: int
    local_rank: int
    world: int
    on_gpu: bool
    tokenizer: Any
    model: Any
    eos_ids: list[int]
    train_recs: list[dict]
    eval_recs: list[dict]
    parts: TrainingParts | None = None  # build_callbacks
    resume: Resume = field(default_factory=Resume)  # restore
    trainer: Any = None  # build_trainer
    timings: dict[str, float] = field(default_factory=dict)  # timing_s/<phase>, rank 0's into metrics.jsonl
    fatal: str | None = None  # an error a retry cannot fix, met after training (unless_retry_cannot_fix)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def run_dir(self) -> Path:
        return self.args.run_dir

    @property
    def log(self):
        return print if self.is_rank0 else None

    @property
    def say(self):
        """Per-step lines only in verbose; otherwise the driver's console shows events.jsonl."""
        return self.log if self.cfg.logging.console == "verbose" else None

    @property
    def finished(self) -> bool:
        """Resumed from the last step: only the weights are left to write."""
        return self.resume.step >= self.cfg.optimization.max_steps


def timed(timings: dict[str, float], phase: str, fn, *args):
    """``fn(*args)``, its wall time kept as ``timing_s/<phase>`` (veRL's ``timing_s/gen`` convention)."""
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        timings[f"{TIMING_PREFIX}{phase}"] = round(time.perf_counter() - start, 6)


def train_loop_per_worker(config: dict) -> None:
    """The Ray Train loop, in timed phases (metric_names.WORKER_PHASES), each handing ``WorkerRun`` to the next.
    ``train_loop_config`` is Ray Train's dict around the ``WorkerArgs`` (worker_args.py says why)."""
    args = WorkerArgs.of(config)
    if args.cfg.generation.backend != "vllm":
        keep_vllm_unloaded()  # before TRL is imported: it would import vLLM, unused here
    if args.cfg.distributed.zero_stage:
        skip_shm_allreduce_build()  # before DeepSpeed's torch backend starts: an op ZeRO training never calls
    timings: dict[str, float] = {}
    run = timed(timings, "setup", set_up, args)
    if run is None:  # a cause no retry fixes is in the fatal-error file
        return
    run.timings = timings
    timed(timings, "callbacks", build_callbacks, run)
    timed(timings, "restore", restore, run)
    timed(timings, "build_trainer", build_trainer, run)
    loaded = timed(timings, "judges", judges_loaded, run)
    if not loaded:  # a cause no retry fixes is in the fatal-error file
        return
    timed(timings, "train", train, run)
    finished = timed(timings, "finish", unless_retry_cannot_fix, run, finish)
    if finished and run.is_rank0 and not run.finished:  # a rerun of a finished run saw no step: keep what the run wrote
        run.parts.metrics.write({"step": run.trainer.state.global_step, **timings})
    hand_over(run, finished)


def set_up(args: WorkerArgs) -> WorkerRun | None:
    """Rank, config, data and policy, then this node's copy of the run directory. None: the data, the
    model or the config cannot work, and the cause is in the fatal-error file."""
    context = ray.train.get_context()
    rank, local_rank = context.get_world_rank(), context.get_local_rank()
    log = print if rank == 0 else None
    try:
        world = context.get_world_size()
        cfg = for_world_size(args.cfg, world)
        on_gpu = cfg.distributed.use_gpu and torch.cuda.is_available()
        tokenizer = load_tokenizer(cfg)
        train_recs, eval_recs, _ = load_records(cfg.data, log=log, tokenizer=tokenizer)
        tokenizer, model, eos_ids = load_policy(cfg, on_gpu, tokenizer)
    except NOT_RETRYABLE as e:
        # Ray Train's failure policy retries any raised error; the same data, model and config would
        # fail again, so the worker ends cleanly and leaves the cause for the driver (exit 2).
        if rank == 0:
            write_atomic(args.run_dir / FATAL_FILE, f"{type(e).__name__}: {e}\n")
        return None
    run = WorkerRun(args, cfg, rank, local_rank, world, on_gpu, tokenizer, model, eos_ids, train_recs, eval_recs)
    run.run_dir.mkdir(parents=True, exist_ok=True)  # a node's own disk may not have it yet
    if args.store is not None and ray.train.get_checkpoint() is not None:
        if local_rank == 0:  # one copy per node; this node may never have seen the run
            args.store.pull(run.run_dir, WORKER_FILES)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    torch.set_num_threads(max(1, int(cfg.distributed.cpus_per_worker)))
    return run


def build_callbacks(run: WorkerRun) -> None:
    """The length control, the judge, the pool's reward functions and the trainer's callbacks."""
    cfg, run_dir = run.cfg, run.run_dir
    floor = reference_floor([r["reference"] for r in run.train_recs], run.tokenizer,
                            cfg.generation.adaptive.reference_quantile) if cfg.adaptive_length else 0
    length_ctl = CompletionLengthControl(cfg, ceiling=run.args.length_ceiling, log=run.say, reference_floor=floor)
    if floor and run.is_rank0:
        append_event(run_dir, "length_floor", step=0, tokens=length_ctl.floor,
                     quantile=cfg.generation.adaptive.reference_quantile)
    self_judge = SelfJudge(run.tokenizer, cfg.judge.max_input_tokens, cfg.judge.max_batch_size) \
        if cfg.judge.backend == "self" else None
    funcs, weights = make_pool_reward_funcs(run.args.pool, cfg, run.eos_ids, lambda: length_ctl.current, self_judge)

    metrics = MetricsSink(run_dir, cfg.output.run_name or run_dir.name, cfg.logging.ray_metrics)
    samples = SamplesWriter(run_dir, cfg.logging.samples_every, cfg.logging.num_samples)
    evaluator = Evaluator(cfg, run.eval_recs, run.tokenizer, run.args.pool, run.eos_ids, length_ctl.budget,
                          report=ray.train.report)
    health = HealthCallback(config=cfg, print_fn=run.say or (lambda _msg: None))
    evaluator.samples_path = run_dir / EVAL_SAMPLES if run.is_rank0 else None
    events = RunEvents(run_dir, length_ctl, health)
    # with storage, the run's files follow it there, uploaded in a thread, and in full before each checkpoint
    store = run.args.store
    sync = RunFileSync(store, run_dir) if run.is_rank0 and store is not None else None
    reporter = RayTrainReporter(flush=None if sync is None else sync.flush)
    callbacks = training_callbacks(length_control=length_ctl, samples=samples, health=health, events=events,
                                   metrics=metrics, reporter=reporter, evaluator=evaluator,
                                   sync=None if sync is None else sync_callback(sync))
    run.parts = TrainingParts(length_ctl, self_judge, funcs, weights, metrics, samples, evaluator, health, reporter,
                              sync, callbacks)


def restore(run: WorkerRun) -> None:
    """Resume from Ray Train's checkpoint: the length cap replayed from metrics.jsonl, the ZeRO state
    resharded for a group of another size. A fresh start drops the rows of an attempt that died before
    its first checkpoint (they would repeat steps)."""
    checkpoint, r = ray.train.get_checkpoint(), run.resume
    if checkpoint is None:
        if run.is_rank0:
            for name in (METRICS, SAMPLES, EVAL_SAMPLES):
                (run.run_dir / name).unlink(missing_ok=True)
        return
    # A checkpoint in cloud storage is downloaded once per node and deleted after the run has read it; a
    # local one is read in place (to_directory() copied it to /tmp at every resume, and left it there).
    r.checkpoint_dir = r.files.enter_context(checkpoint.as_directory())
    r.step = json.loads((Path(r.checkpoint_dir) / "trainer_state.json").read_text())["global_step"]
    _restore_length_state(run.run_dir, r.step, run.parts.length_ctl, truncate=run.is_rank0)
    r.saved_world = resized(Path(r.checkpoint_dir), run.world)
    if run.is_rank0:
        if run.say:
            run.say(f"[resume] from checkpoint at step {r.step}")
        append_event(run.run_dir, "resume", step=r.step)
    if r.saved_world and not run.finished:
        r.universal = _universal_checkpoint(run)


def _universal_checkpoint(run: WorkerRun) -> Path:
    """The checkpoint of a group of another size, resharded for this one: one per machine (Ray Train
    numbers local ranks per node IP, and local rank 0 writes it), removed once the run has read it."""
    r = run.resume
    ip = ray.util.get_node_ip_address()
    dest = Path(tempfile.gettempdir()) / f"synth-grpo-universal-{ip}-{run.run_dir.name}-{r.step}"
    if run.local_rank == 0:
        r.files.callback(shutil.rmtree, dest, ignore_errors=True)
    return reshard_for_group(Path(r.checkpoint_dir), dest, run.local_rank, r.step, r.saved_world, run.world,
                             run_dir=run.run_dir if run.is_rank0 else None, log=run.log)


def build_trainer(run: WorkerRun) -> None:
    """TRL's GRPOTrainer, bound to its callbacks; checkpoints past the start step removed."""
    parts, r = run.parts, run.resume
    trainer = build_grpo_trainer(run.cfg, run.run_dir, run.tokenizer, run.model, run.train_recs, parts.funcs,
                                 parts.weights, parts.callbacks, run.on_gpu, run.is_rank0,
                                 load_universal=r.universal is not None, length_ceiling=run.args.length_ceiling)
    quiet_worker(trainer, run.cfg.logging.console)
    parts.length_ctl.bind(trainer)
    parts.samples.trainer = parts.evaluator.trainer = parts.reporter.trainer = trainer
    if parts.self_judge is not None:
        parts.self_judge.trainer = trainer
    # Checkpoint folders past the step this group starts from are a dead group's leftovers: removed before
    # this group saves those steps again, in Ray Train's storage and in each node's HF output folder.
    if run.is_rank0:
        storage = ray.train.get_context().get_storage()
        remove_unregistered_checkpoints(storage.storage_filesystem, storage.experiment_fs_path, r.step)
    if run.local_rank == 0:
        from pyarrow.fs import LocalFileSystem  # pyarrow: loaded with datasets when the trainer is built

        remove_unregistered_checkpoints(LocalFileSystem(), str(Path(trainer.args.output_dir).resolve()), r.step)
    if run.is_rank0:
        record_world_size(run.run_dir, trainer.args, run.world, r.step, run.log)
    run.trainer = trainer


def train(run: WorkerRun) -> None:
    """The training steps left (none for a run resumed at its last step)."""
    if run.finished:
        return
    r = run.resume
    with deepspeed_resume_from(r.universal) if r.saved_world else contextlib.nullcontext():
        run.trainer.train(resume_from_checkpoint=r.checkpoint_dir)


def finish(run: WorkerRun) -> None:
    """The weights into adapter/ (saved, or copied from the last checkpoint of a finished run), with the
    tokenizer; the length changes and the health findings beside them."""
    adapter = run.run_dir / ADAPTER_DIR
    if not run.finished:
        run.trainer.save_model(str(adapter))
    elif run.is_rank0:
        export_trained_weights(Path(run.resume.checkpoint_dir), adapter)
    run.resume.files.close()
    if run.is_rank0:
        run.tokenizer.save_pretrained(str(adapter))
        (adapter / "training_args.bin").unlink(missing_ok=True)  # a pickle nothing needs to load
        if not run.finished:  # a rerun of a finished run saw no step: keep what the run wrote
            write_atomic(run.run_dir / LENGTH_CHANGES, json.dumps(run.parts.length_ctl.changes))
            run.parts.health.write(run.run_dir / HEALTH)


def judges_loaded(run: WorkerRun) -> bool:
    """Wait for the reward pool's actors, which load while this worker loads its policy (driver.run_training).
    False: one could not be created (a judge model that cannot load), its cause in the fatal-error file: Ray
    Train would retry a raised error and every retry would fail the same way."""
    cause = run.args.pool.creation_error()
    if cause and run.is_rank0:
        write_atomic(run.run_dir / FATAL_FILE, cause + "\n")
    return cause is None


def unless_retry_cannot_fix(run: WorkerRun, phase) -> bool:
    """``phase(run)`` after training; False when it raised an OSError a retry cannot fix (denied, no space,
    not a directory, a file where a folder must be), its cause kept in ``run.fatal`` and the fatal-error
    file for the driver (exit 2). Raised, such an error would make Ray Train restart the group, load the
    model again and fail the same way, up to distributed.max_failures times; any other error is raised:
    the restart resumes from the last step's checkpoint and retrains nothing."""
    try:
        phase(run)
        return True
    except OSError as e:
        if not retry_cannot_fix(e):
            raise
        run.fatal = f"{type(e).__name__}: {e}"
        write_atomic(run.run_dir / FATAL_FILE, run.fatal + "\n")
        return False


def hand_over(run: WorkerRun, finished: bool = True) -> None:
    """The run's files into storage (all of them, before the run reports done), then Ray Train's final report:
    every rank reports, as Ray Train expects, a cause that stopped the run included (the driver may run on
    another node than the rank that met it)."""
    if finished and run.parts.sync is not None:  # everything, the adapter included, before the run reports done
        unless_retry_cannot_fix(run, lambda r: r.parts.sync.close())
    history = run.parts.metrics.history
    final = {k: v for k, v in (history[-1] if history else {}).items() if isinstance(v, (int, float))}
    ray.train.report({**final, **run.parts.evaluator.last, **run.timings, "done": 1,
                      "step": max(run.trainer.state.global_step, run.resume.step),
                      **({FATAL_METRIC: run.fatal} if run.fatal else {})})


def export_trained_weights(checkpoint: Path, dest: Path) -> None:
    """The weights of a finished run, as the trainer's save_model wrote them into its last checkpoint
    (the LoRA adapter, or the full model's shards and config): copied, not loaded into a trainer
    (which needed the private Trainer._load_from_checkpoint)."""
    def weights(p: Path) -> bool:
        return p.name.startswith(("adapter_model", "model")) and p.suffix in (".safetensors", ".bin", ".json")

    files = [p for p in checkpoint.iterdir() if p.is_file() and (
        weights(p) or p.name in ("adapter_config.json", "config.json", "generation_config.json"))]
    if not any(weights(p) and not p.name.endswith(".json") for p in files):
        raise FileNotFoundError(f"{checkpoint}: no adapter or model weights to export (holds {sorted(p.name for p in checkpoint.iterdir())})")
    dest.mkdir(parents=True, exist_ok=True)
    for p in files:
        shutil.copy2(p, dest / p.name)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
