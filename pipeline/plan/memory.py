"""GPU memory planner: predict per-GPU memory of a GRPO run before it starts, without a GPU.

Answers the baseline run's question "can num_generations go from 4 to 8 or 16 on this GPU?" from the
run config and the model's config.json alone (no weights are loaded). All formulas live in
`formulas.estimate`, each with a comment naming its source. Results are per GPU, in GiB (2**30 bytes).
The parameter, LoRA, gradient, optimizer and KV-cache terms are checked exactly against counted
tensors in tests/test_memory.py; the activation terms are estimates not yet measured on a GPU
(docs/memory.md says how to validate them).

This module turns a run config into the formulas' inputs and searches them (largest num_generations,
largest completion length); the shapes, GPU sizes, formulas and `synth-grpo plan` live beside it
(shapes.py, gpus.py, formulas.py, plan_cli.py) and their names stay readable here as `memory.<name>`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import RunConfig, divides_into_groups, worker_range
from pipeline.plan.formulas import (COMPONENT_ORDER, CUDA_CONTEXT_GIB, FRAGMENTATION, HEADROOM, JUDGE_CONTEXT_GIB, PHASE,
                                    PlanInputs, estimate, layer_activation_bytes, peak_total)
from pipeline.plan.gpus import GIB, GPU_PRESETS, detect_gpu_gib, gpu_preset
from pipeline.seams.trl_seams import fuses_lm_head
from pipeline.plan.shapes import (BUILTIN_EXAMPLES, MINILM_PARAMS, ModelShape, PlanError, builtin_shape, lora_param_count,
                                  resolve_shape)

# The planner's names other modules and tests read as `memory.<name>`, wherever they are defined.
__all__ = ["BUILTIN_EXAMPLES", "COMPONENT_ORDER", "CUDA_CONTEXT_GIB", "FRAGMENTATION", "GIB", "GPU_PRESETS", "HEADROOM",
           "JUDGE_CONTEXT_GIB", "MemoryPlan", "ModelShape", "PHASE", "PlanError", "PlanInputs", "batch_for_generations",
           "builtin_shape", "completion_length", "detect_gpu_gib", "estimate", "fits_gpu", "gpu_preset",
           "layer_activation_bytes", "lora_param_count", "max_completion_length_ceiling", "max_generations", "peak_total",
           "plan_inputs", "plan_run", "resolve_shape", "scaled_batch", "warn_if_not_fits"]

MAX_SEARCH_GENERATIONS = 512


@dataclass
class MemoryPlan:
    components: dict[str, float]  # GiB per GPU
    total_gib: float
    gpu_gib: float | None
    fits: bool | None  # None when no GPU size is known
    max_num_generations: int | None  # None: no GPU size; 0: not even 2 fit
    peak_phase: str = "training"
    notes: list[str] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)  # component -> how it was computed
    inputs: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"total_gib": round(self.total_gib, 3), "gpu_gib": self.gpu_gib, "fits": self.fits,
                "max_num_generations": self.max_num_generations,
                "components": {k: round(v, 3) for k, v in self.components.items()},
                "peak_phase": self.peak_phase, "notes": self.notes}


def completion_length(cfg: RunConfig) -> int:
    """The length the planner sizes for: a fixed value, or adaptive's ceiling (else its start)."""
    g = cfg.generation
    if cfg.adaptive_length:
        return g.adaptive.ceiling or g.adaptive.start
    return max([int(g.max_completion_length)] + [int(length) for _, length in g.length_schedule])


def plan_inputs(cfg: RunConfig, gpu_gib: float | None, num_gpus: int | None) -> PlanInputs:
    prec = cfg.optimization.precision
    judge_bytes, jshape = 0, None
    j = cfg.judge
    if j.placement == "same_gpu" and j.backend == "llm":
        jshape = resolve_shape(j.model)
        judge_bytes = jshape.param_count() * 2
    elif j.placement == "same_gpu" and j.backend == "embedding":
        judge_bytes = MINILM_PARAMS * 4
    attn = cfg.model.attn_implementation or "sdpa"
    o = cfg.optimization
    return PlanInputs(
        shape=resolve_shape(cfg.model.name_or_path, cfg.model.revision),
        judge=(judge_bytes, jshape), judge_batch=(j.max_batch_size, j.max_input_tokens),
        num_gpus=num_gpus or worker_range(cfg)[0],  # an elastic run plans for its fewest workers (largest ZeRO shards)
        zero_stage=cfg.distributed.zero_stage,
        offload_optimizer=cfg.distributed.offload_optimizer, offload_params=cfg.distributed.offload_params,
        wbytes=4 if prec == "fp32" else 2,  # auto = bf16 on a GPU
        lora=cfg.lora.enabled, lora_r=cfg.lora.r, lora_targets=cfg.lora.target_modules, lora_dropout=cfg.lora.dropout,
        grad_ckpt=cfg.model.gradient_checkpointing, batch=o.per_device_train_batch_size,
        steps_per_generation=cfg.generation.steps_per_generation or o.gradient_accumulation_steps,
        num_generations=cfg.generation.num_generations, prompt_len=cfg.data.max_prompt_length,
        completion_len=completion_length(cfg), beta=cfg.grpo.beta,
        vllm_util=cfg.generation.vllm_gpu_memory_utilization if cfg.generation.backend == "vllm" else None,
        attn="flash" if "flash" in attn else ("eager" if attn == "eager" else "sdpa"),
        fused_logits=fuses_lm_head(), gpu_gib=gpu_gib,
        refill_oversample=cfg.grpo.dynamic_sampling.oversample if cfg.grpo.dynamic_sampling.enabled else None,
        vllm_sleep=cfg.generation.backend == "vllm" and cfg.generation.vllm_sleep_mode,
    )


def _vllm_notes(x: PlanInputs, c: dict[str, int], total: int) -> list[str]:
    """Where colocated vLLM's share cannot work: too small for its weights or one sequence, too small for a
    whole rollout at once, or too large to leave training its memory."""
    if x.vllm_util is None or not x.gpu_gib:
        return []
    weights, seq = x.shape.param_count() * x.wbytes, x.prompt_len + x.completion_len
    kv_seqs = (int(x.vllm_util * x.gpu_gib * GIB) - weights) // (seq * 2 * x.shape.num_layers * x.shape.kv_dim * x.wbytes)
    rollout = x.batch * x.steps_per_generation
    share = f"generation.vllm_gpu_memory_utilization {x.vllm_util} ({x.vllm_util * x.gpu_gib:.1f} of {x.gpu_gib} GiB)"
    if kv_seqs < 1:
        return [f"{share} leaves no KV cache for one {seq}-token sequence after vLLM's {weights / GIB:.1f} GiB of "
                "weights: vLLM cannot start; raise it"]
    notes = []
    if kv_seqs < rollout:
        notes.append(f"{share}: vLLM's KV cache holds {kv_seqs} of a rollout's {rollout} sequences at once; the rest "
                     "wait for room (slower rollouts); raise it for one pass")
    if total > x.gpu_gib * GIB * (1 - HEADROOM):
        held = c["vllm_reservation"] + c["vllm_awake"]
        notes.append(f"vLLM's share ({held / GIB:.1f} GiB) and training ({(total - held) / GIB:.1f} GiB) do not both fit "
                     f"in {x.gpu_gib} GiB: lower {share.split(' ')[0]}"
                     + ("" if x.vllm_sleep else ", or set generation.vllm_sleep_mode: true (it frees the share while training)"))
    return notes


def fits_gpu(x: PlanInputs) -> bool:
    c, _, phase = estimate(x)
    return x.gpu_gib is not None and peak_total(c, phase) <= x.gpu_gib * GIB * (1 - HEADROOM)


def batch_for_generations(x: PlanInputs, g: int, g0: int, b0: int) -> int:
    """Per-device batch for g generations keeping the config's prompts per round (b0/g0 per device),
    raised until TRL's rule holds: batch * num_gpus * steps_per_generation divisible by g."""
    b = max(1, math.ceil(b0 * g / g0))
    while not divides_into_groups(b * x.num_gpus * x.steps_per_generation, g):
        b += 1
    return b


def scaled_batch(cfg: RunConfig, num_generations: int, num_gpus: int | None = None) -> int:
    """The per-device batch `synth-grpo plan`'s sweep uses for `num_generations`: the config's prompts per
    round kept, rounded up to TRL's divisibility rule (bench/gpu_check.py runs exactly these batches)."""
    x = plan_inputs(cfg, None, num_gpus)
    return batch_for_generations(x, num_generations, x.num_generations, x.batch)


def max_generations(x: PlanInputs) -> int:
    """Largest g whose scaled batch fits; stops once even the unrounded batch b0*g/g0 does not fit."""
    best = 0
    for g in range(2, MAX_SEARCH_GENERATIONS + 1):
        if not fits_gpu(dataclasses.replace(x, num_generations=g, batch=max(1, math.ceil(x.batch * g / x.num_generations)))):
            break
        if fits_gpu(dataclasses.replace(x, num_generations=g, batch=batch_for_generations(x, g, x.num_generations, x.batch))):
            best = g
    return best


def plan_run(cfg: RunConfig, gpu_gib: float | None = None, num_gpus: int | None = None, *,
             fused_logits: bool | None = None) -> MemoryPlan:
    """Predict per-GPU memory of `cfg` on a GPU of `gpu_gib` GiB (default: the detected one) with the
    ZeRO stage sharding over `num_gpus` (default: distributed.num_workers). Raises PlanError."""
    gpu_gib = gpu_gib if gpu_gib is not None else detect_gpu_gib()
    x = plan_inputs(cfg, gpu_gib, num_gpus)
    if fused_logits is not None:
        x = dataclasses.replace(x, fused_logits=fused_logits)
    c, why, phase = estimate(x)
    total = peak_total(c, phase)
    notes = []
    notes += _vllm_notes(x, c, total)
    if cfg.judge.placement == "same_gpu" and cfg.judge.backend == "self":
        notes.append("judge 'self' shares the policy's weights; its scoring forward is not counted")
    if x.steps_per_generation > 1 and x.vllm_util is None:
        notes.append(f"generate() runs {x.batch * x.steps_per_generation} sequences at once (steps_per_generation "
                     f"{x.steps_per_generation}); set generation.steps_per_generation lower to shrink the KV cache")
    fits = None if gpu_gib is None else total <= gpu_gib * GIB * (1 - HEADROOM)
    return MemoryPlan(
        components={n: c.get(n, 0) / GIB for n in COMPONENT_ORDER}, total_gib=total / GIB, gpu_gib=gpu_gib, fits=fits,
        max_num_generations=None if gpu_gib is None else max_generations(x), peak_phase=phase, notes=notes,
        details=why,
        inputs={"model": cfg.model.name_or_path, "shape_source": x.shape.source, "params": x.shape.param_count(),
                "trainable": lora_param_count(x.shape, x.lora_r, x.lora_targets) if x.lora else x.shape.param_count(),
                "num_gpus": x.num_gpus, "zero_stage": x.zero_stage, "batch": x.batch, "num_generations": x.num_generations,
                "steps_per_generation": x.steps_per_generation, "prompt_len": x.prompt_len,
                "completion_len": x.completion_len, "wbytes": x.wbytes, "grad_ckpt": x.grad_ckpt,
                "fused_logits": x.fused_logits},
    )


def max_completion_length_ceiling(cfg: RunConfig, gpu_gib: float, num_gpus: int | None = None) -> int:
    """Largest completion length that fits at the config's batch (0 if none): the adaptive cap's ceiling
    when the config sets none. Binary search; memory is monotone in the length."""
    x = plan_inputs(cfg, gpu_gib, num_gpus)
    lo, hi = 0, max(0, x.shape.max_positions - x.prompt_len)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits_gpu(dataclasses.replace(x, completion_len=mid)):
            lo = mid
        else:
            hi = mid - 1
    return lo


def warn_if_not_fits(cfg: RunConfig) -> str | None:
    """Warning text when on this GPU the plan predicts the run will not fit; None on CPU or when the
    shape cannot be found (training should not fail because the planner cannot answer)."""
    gpu = detect_gpu_gib()
    if gpu is None:
        return None
    try:
        plan = plan_run(cfg, gpu)
    except PlanError:
        return None
    if plan.fits:
        return None
    return (f"memory planner: this run needs about {plan.total_gib:.1f} GiB per GPU, the GPU has {gpu:.1f} GiB; "
            f"largest num_generations that fits: {plan.max_num_generations} "
            f"(largest completion length: {max_completion_length_ceiling(cfg, gpu)}). "
            f"See `synth-grpo plan --config ...`.")
