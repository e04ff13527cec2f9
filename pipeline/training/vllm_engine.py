"""vLLM as this run's generation engine (``generation.backend: vllm``): TRL's colocated engine in each
Ray Train worker. What TRL leaves to the caller lives here: the CPU build's KV-cache reservation, the
engine's context length, and sampling from it outside TRL's rollout (the held-out evaluation)."""

from __future__ import annotations

import math
import os

from pipeline.config import RunConfig
from pipeline.seams.trl_seams import colocated_engine

# vLLM's CPU build reads gpu_memory_utilization as a share of the machine's RAM *minus this process's
# RSS*, which a training process mostly fills (the engine then refuses to start); an explicit size in
# GiB (an integer) is what it takes instead. A value the user set is kept.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
GIB = 1024**3


def engine_context_length(cfg: RunConfig, length_ceiling: int | None = None) -> int:
    """The engine's max_model_len: the longest prompt plus the most tokens the run ever generates (training
    cap or evaluation budget), not the model's whole context, whose KV cache would not fit beside training."""
    return cfg.data.max_prompt_length + max(cfg.completion_budget(length_ceiling), cfg.eval.max_new_tokens or 0)


def cpu_kv_cache_gib(model_config, cfg: RunConfig, dtype_bytes: int, length_ceiling: int | None = None) -> int:
    """GiB of KV cache for the engine's largest batch at full length: TRL's max_num_seqs (per-device batch x
    steps_per_generation) sequences of ``engine_context_length`` tokens; at least 1 (vLLM's unit)."""
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    per_token = 2 * model_config.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    o = cfg.optimization
    seqs = o.per_device_train_batch_size * (cfg.generation.steps_per_generation or o.gradient_accumulation_steps)
    return max(1, math.ceil(per_token * seqs * engine_context_length(cfg, length_ceiling) / GIB))


def reserve_cpu_kv_cache(cfg: RunConfig, model, on_gpu: bool, length_ceiling: int | None = None) -> None:
    """Before the trainer (and so the engine) is built: the CPU build's KV cache, sized for this run."""
    if cfg.generation.backend != "vllm" or on_gpu or os.environ.get(CPU_KV_CACHE_ENV):
        return
    dtype_bytes = next(model.parameters()).element_size()
    os.environ[CPU_KV_CACHE_ENV] = str(cpu_kv_cache_gib(model.config, cfg, dtype_bytes, length_ceiling))


def engine_sample(trainer, prompts: list[list[int]], *, max_tokens: int, temperature: float, top_p: float,
                  stop_token_ids: list[int], seed: int) -> list[tuple[list[int], float]]:
    """One completion per prompt from the engine holding the policy's current weights: (token ids, the
    engine's log-probability of them). Prompt i samples from seed + i, so a later call with the same
    prompts and seed differs only where the weights do."""
    from vllm import SamplingParams  # vllm: installed for generation.backend vllm only

    params = [SamplingParams(n=1, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             stop_token_ids=list(stop_token_ids), seed=seed + i, logprobs=0)
              for i in range(len(prompts))]
    with colocated_engine(trainer) as llm:  # every rank, with prompts or not: the weight sync is collective
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params,
                            use_tqdm=False) if prompts else []
    return [(list(o.outputs[0].token_ids), float(o.outputs[0].cumulative_logprob or 0.0)) for o in outs]
