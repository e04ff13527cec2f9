"""One Ray Train worker: data, policy + LoRA, TRL GRPOTrainer with the pool's reward functions.

Everything a worker needs arrives in ``train_loop_config`` (the resolved config as a dict, the
run directory, the reward pool's actor handles), so the same function runs under ``synth-grpo
train``, Ray Tune trials and ``ray job submit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pipeline.config import TINY_POLICY, ConfigError, RunConfig, config_from_dict
from pipeline.data.sources import DataError
from pipeline.rundir.metric_names import CAP_METRIC
from pipeline.rundir.files import (ADAPTER_DIR, EVAL_SAMPLES, FATAL_FILE, HEALTH, LENGTH_CHANGES, METRICS, SAMPLES,
                                TRAINER_DIR, WORKER_FILES, append_event, read_metrics, write_atomic)

# Errors a retry cannot fix: the same data, model and config fail the same way on every attempt.
# OSError covers transformers' "not a local folder and not a valid model identifier" and missing files.
NOT_RETRYABLE = (ConfigError, DataError, OSError)


def resolve_policy_path(cfg: RunConfig) -> str:
    if cfg.model.name_or_path == TINY_POLICY:
        from pipeline.data.tiny_models import ensure_tiny

        return str(ensure_tiny())
    return cfg.model.name_or_path


def precision_flags(cfg: RunConfig, on_gpu: bool) -> dict[str, bool]:
    import torch

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
                      load_universal: bool = False):
    from trl import GRPOConfig

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
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM",
    )


def _restore_length_state(run_dir: Path, step: int, length_ctl, truncate: bool) -> None:
    """Resume: every rank restores the same cap from metrics.jsonl; rank 0 also drops rows past the checkpoint."""
    from pipeline.training.callbacks import truncate_jsonl

    rows = [r for r in read_metrics(run_dir / METRICS) if r.get("step", 0) <= step]
    if truncate:
        truncate_jsonl(run_dir / METRICS, step)
        truncate_jsonl(run_dir / SAMPLES, step)
    if any(CAP_METRIC in r for r in rows):
        length_ctl.restore(rows)


def load_tokenizer(cfg: RunConfig):
    """The policy's tokenizer, padded on the left (evaluation generates from padded batches)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        resolve_policy_path(cfg), revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_policy(cfg: RunConfig, on_gpu: bool, tokenizer=None):
    """(tokenizer, model, eos_ids) for the configured policy; hub ids and local paths load the same way."""
    import torch
    from transformers import AutoModelForCausalLM

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
                       callbacks, on_gpu: bool = False, is_rank0: bool = True, load_universal: bool = False):
    """TRL's GRPOTrainer for this config: the one construction shared by Ray workers and benchmarks."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from pipeline.data.sources import to_trl_rows

    extra = {}
    if cfg.grpo.dynamic_sampling.enabled:  # DAPO dynamic sampling: a GRPOTrainer subclass
        from pipeline.training.dynamic_sampling import DynamicSamplingGRPOTrainer as GRPOTrainer

        extra["dynamic_sampling"] = cfg.grpo.dynamic_sampling
    return GRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=build_grpo_config(cfg, run_dir, on_gpu, is_rank0, weights, load_universal),
        train_dataset=Dataset.from_list(to_trl_rows(train_recs, cfg.data.system_prompt)),
        processing_class=tokenizer,
        peft_config=lora_config(cfg),
        callbacks=list(callbacks),
        **extra,
    )


def train_loop_per_worker(config: dict) -> None:
    import ray
    import ray.train
    import torch

    from pipeline.training.events import RunEvents, quiet_worker
    from pipeline.data.sources import load_records
    from pipeline.training.elastic import deepspeed_resume, for_world_size, record_world_size, reshard_for_group, resized
    from pipeline.training.health import HealthCallback
    from pipeline.training.length_control import CompletionLengthControl, reference_floor
    from pipeline.scoring.clients import make_pool_reward_funcs
    from pipeline.training.callbacks import Evaluator, MetricsSink, RayTrainReporter, SamplesWriter, training_callbacks
    from pyarrow.fs import LocalFileSystem

    from pipeline.rundir.storage import RunFileSync, remove_unregistered_checkpoints, retry_cannot_fix, sync_callback
    from rewards.judge import SelfJudge

    rank, local_rank = ray.train.get_context().get_world_rank(), ray.train.get_context().get_local_rank()
    is_rank0 = rank == 0
    log = print if is_rank0 else None
    try:
        cfg = for_world_size(config_from_dict(config["cfg"]), ray.train.get_context().get_world_size())
        on_gpu = cfg.distributed.use_gpu and torch.cuda.is_available()
        tokenizer = load_tokenizer(cfg)
        train_recs, eval_recs, _ = load_records(cfg.data, log=log, tokenizer=tokenizer)
        tokenizer, model, eos_ids = load_policy(cfg, on_gpu, tokenizer)
    except NOT_RETRYABLE as e:
        # Ray Train's failure policy retries any raised error; the same data, model and config would
        # fail again, so the worker ends cleanly and leaves the cause for the driver (exit 2).
        if is_rank0:
            write_atomic(Path(config["run_dir"]) / FATAL_FILE, f"{type(e).__name__}: {e}\n")
        return
    run_dir = Path(config["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)  # a node's own disk may not have it yet
    store = config.get("store")  # pipeline.rundir.storage.RunStorage with output.storage, else None
    if store is not None and ray.train.get_checkpoint() is not None:
        if local_rank == 0:  # one copy per node; this node may never have seen the run
            store.pull(run_dir, WORKER_FILES)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    pool = config["pool"]
    torch.set_num_threads(max(1, int(cfg.distributed.cpus_per_worker)))
    say = log if cfg.logging.console == "verbose" else None  # otherwise the driver's console shows events.jsonl
    floor = reference_floor([r["reference"] for r in train_recs], tokenizer,
                            cfg.generation.adaptive.reference_quantile) if cfg.adaptive_length else 0
    length_ctl = CompletionLengthControl(cfg, ceiling=config.get("length_ceiling"), log=say, reference_floor=floor)
    if floor and is_rank0:
        append_event(run_dir, "length_floor", step=0, tokens=length_ctl.floor,
                     quantile=cfg.generation.adaptive.reference_quantile)
    self_judge = SelfJudge(tokenizer, cfg.judge.max_input_tokens, cfg.judge.max_batch_size) if cfg.judge.backend == "self" else None
    funcs, weights = make_pool_reward_funcs(pool, cfg, eos_ids, lambda: length_ctl.current, self_judge)

    metrics = MetricsSink(run_dir, cfg.output.run_name or run_dir.name, cfg.logging.ray_metrics)
    samples = SamplesWriter(run_dir, cfg.logging.samples_every, cfg.logging.num_samples)
    evaluator = Evaluator(cfg, eval_recs, tokenizer, pool, eos_ids, length_ctl.budget, report=ray.train.report)
    health = HealthCallback(config=cfg, print_fn=say or (lambda _msg: None))
    evaluator.samples_path = run_dir / EVAL_SAMPLES if is_rank0 else None
    events = RunEvents(run_dir, length_ctl, health)
    # with storage, the run's files follow it there, uploaded in a thread, and in full before each checkpoint
    sync = RunFileSync(store, run_dir) if is_rank0 and store is not None else None
    reporter = RayTrainReporter(flush=None if sync is None else sync.flush)
    callbacks = training_callbacks(length_control=length_ctl, samples=samples, health=health, events=events,
                                   metrics=metrics, reporter=reporter, evaluator=evaluator,
                                   sync=None if sync is None else sync_callback(sync))
    resume_from, step, saved_world, universal = None, 0, None, None
    checkpoint = ray.train.get_checkpoint()
    # A checkpoint in cloud storage is downloaded once per node and deleted after the run has read it; a
    # local one is read in place (to_directory() copied it to /tmp at every resume, and left it there).
    checkpoint_files = contextlib.ExitStack()
    if checkpoint is not None:
        resume_from = checkpoint_files.enter_context(checkpoint.as_directory())
        step = json.loads((Path(resume_from) / "trainer_state.json").read_text())["global_step"]
        _restore_length_state(run_dir, step, length_ctl, truncate=is_rank0)
        world = ray.train.get_context().get_world_size()
        saved_world = resized(Path(resume_from), world)
        if is_rank0:
            if say:
                say(f"[resume] from checkpoint at step {step}")
            append_event(run_dir, "resume", step=step)
        if saved_world and step < cfg.optimization.max_steps:
            # one per machine: Ray Train numbers local ranks per node IP, and local rank 0 writes it
            ip = ray.util.get_node_ip_address()
            dest = Path(tempfile.gettempdir()) / f"synth-grpo-universal-{ip}-{run_dir.name}-{step}"
            if local_rank == 0:
                checkpoint_files.callback(shutil.rmtree, dest, ignore_errors=True)
            universal = reshard_for_group(Path(resume_from), dest, local_rank, step, saved_world, world,
                                          run_dir=run_dir if is_rank0 else None, log=log)
    elif is_rank0:
        # A fresh start: rows from an attempt that died before its first checkpoint would repeat steps.
        for name in (METRICS, SAMPLES, EVAL_SAMPLES):
            (run_dir / name).unlink(missing_ok=True)
    trainer = build_grpo_trainer(cfg, run_dir, tokenizer, model, train_recs, funcs, weights, callbacks, on_gpu,
                                 is_rank0, load_universal=universal is not None)
    quiet_worker(trainer, cfg.logging.console)
    length_ctl.bind(trainer)
    samples.trainer = evaluator.trainer = reporter.trainer = trainer
    if self_judge is not None:
        self_judge.trainer = trainer
    # Checkpoint folders past the step this group starts from are a dead group's leftovers: removed before
    # this group saves those steps again, in Ray Train's storage and in each node's HF output folder.
    if is_rank0:
        storage = ray.train.get_context().get_storage()
        remove_unregistered_checkpoints(storage.storage_filesystem, storage.experiment_fs_path, step)
    if local_rank == 0:
        remove_unregistered_checkpoints(LocalFileSystem(), str(Path(trainer.args.output_dir).resolve()), step)
    if is_rank0:
        record_world_size(run_dir, trainer.args, ray.train.get_context().get_world_size(), step, log)
    finished = step >= cfg.optimization.max_steps
    if finished:  # finished already: only the adapter is left to write
        if is_rank0:
            export_trained_weights(Path(resume_from), run_dir / ADAPTER_DIR)
    else:
        with deepspeed_resume(universal) if saved_world else contextlib.nullcontext():
            trainer.train(resume_from_checkpoint=resume_from)
        trainer.save_model(str(run_dir / ADAPTER_DIR))
    checkpoint_files.close()
    if is_rank0:
        tokenizer.save_pretrained(str(run_dir / ADAPTER_DIR))
        (run_dir / ADAPTER_DIR / "training_args.bin").unlink(missing_ok=True)  # a pickle nothing needs to load
        if not finished:  # a rerun of a finished run saw no step: keep what the run wrote
            write_atomic(run_dir / LENGTH_CHANGES, json.dumps(length_ctl.changes))
            health.write(run_dir / HEALTH)
    storage_error = 0
    if sync is not None:
        try:
            sync.close()  # everything, the adapter included, is in storage before the run reports done
        except OSError as e:
            if not retry_cannot_fix(e):
                raise  # Ray Train restarts the group from its checkpoint and uploads again
            # Denied, no such bucket or folder, a full disk: a restart would rerun the last steps to fail the
            # same way. The driver stops with this cause (exit 2); every rank still reports, as Ray Train expects.
            write_atomic(run_dir / FATAL_FILE, f"{type(e).__name__}: {e}\n")
            storage_error = 1  # and in the report: the driver may run on another node than rank 0
    final = {k: v for k, v in (metrics.history[-1] if metrics.history else {}).items() if isinstance(v, (int, float))}
    ray.train.report({**final, **evaluator.last, "done": 1, "step": max(trainer.state.global_step, step),
                      **({"storage_error": 1} if storage_error else {})})


def export_trained_weights(checkpoint: Path, dest: Path) -> None:
    """The weights of a finished run, as the trainer's save_model wrote them into its last checkpoint
    (the LoRA adapter, or the full model's shards and config): copied, not loaded into a trainer
    (which needed the private Trainer._load_from_checkpoint)."""
    import shutil

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
