"""The memory formulas: per-GPU bytes of every component of a GRPO step from the planner's inputs
(model shape, parallelism, batch, lengths), each term with a comment naming its source."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.plan.gpus import GIB
from pipeline.plan.shapes import ModelShape, lora_param_count, targeted_linears

HEADROOM = 0.05  # "fits" leaves 5% of the GPU free for estimation error
CUDA_CONTEXT_GIB = 1.0  # CUDA context + cuBLAS workspaces + NCCL buffers (not seen by torch's allocator)
FRAGMENTATION = 0.10  # caching-allocator slack on the transient peak (reserved vs allocated, typically 5-15%)
JUDGE_CONTEXT_GIB = 0.5  # a same-GPU judge is another Ray process: its own CUDA context


@dataclass(frozen=True)
class PlanInputs:
    shape: ModelShape
    judge: tuple[int, ModelShape | None]  # (judge parameter bytes on this GPU, judge shape for its forward)
    judge_batch: tuple[int, int]  # (max_batch_size, max_input_tokens)
    num_gpus: int
    zero_stage: int
    offload_optimizer: bool
    offload_params: bool
    wbytes: int  # bytes per weight / activation element (bf16/fp16: 2, fp32: 4)
    lora: bool
    lora_r: int
    lora_targets: str | list[str]
    lora_dropout: float
    grad_ckpt: bool
    batch: int  # per_device_train_batch_size (completions per micro-batch)
    steps_per_generation: int
    num_generations: int
    prompt_len: int
    completion_len: int
    beta: float
    vllm_util: float | None  # colocated vLLM's share of the GPU, None for the hf backend
    attn: str  # "sdpa", "eager" or "flash"
    fused_logits: bool
    gpu_gib: float | None
    refill_oversample: float | None = None  # grpo.dynamic_sampling.oversample when enabled, else None
    vllm_sleep: bool = False  # sleep mode: vLLM holds its share only while generating


def human_count(count: float) -> str:
    """8030261248 -> '8.03B', 83886080 -> '83.9M', 5120 -> '5.1K'."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= div:
            return f"{count / div:.{2 if unit == 'B' else 1}f}{unit}"
    return str(int(count))


def layer_activation_bytes(x: PlanInputs, seq: int, mask_bytes: int = 1) -> int:
    """Bytes autograd keeps per token in one decoder layer. Method of Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models" (sec. 4: count every tensor saved for backward),
    applied to Llama's RMSNorm + GQA attention + SwiGLU + LoRA instead of GPT's block. Exact against
    saved-tensor hooks on CPU (tests); `mask_bytes`: dropout mask per element, bool on CUDA, float on CPU."""
    s, a = x.shape, x.wbytes
    h, q, kv, i = s.hidden_size, s.q_dim, s.kv_dim, s.intermediate_size
    targets = targeted_linears(x.lora_targets, s) if x.lora else []
    full = not x.lora
    # RMSNorm upcasts to fp32 and keeps that copy (4h) and rsqrt (4) for backward; two norms per layer.
    # A trainable norm weight also keeps the normalized input.
    total = 2 * (4 * h + 4) + (2 * a * h if full else 0)

    def kept(names: tuple[str, ...], width: int) -> tuple[int, bool]:
        """(bytes kept for these linears' input, whether the undropped input itself is kept). Only a
        trainable weight (full fine-tuning) or LoRA's A matrix needs the input; dropout > 0 gives each
        adapter its own dropped copy plus mask."""
        hit = [n for n in names if n in targets]
        if full or (hit and x.lora_dropout == 0):
            return a * width, True
        if hit:
            return len(hit) * (a + mask_bytes) * width, False
        return 0, False

    total += kept(("q_proj", "k_proj", "v_proj"), h)[0] + kept(("gate_proj", "up_proj"), h)[0] + kept(("down_proj",), i)[0]
    o_bytes, o_keeps_out = kept(("o_proj",), q)
    total += len(targets) * a * x.lora_r  # LoRA A outputs, kept by B
    # Attention keeps q, k, v. transformers repeats K/V to all heads when a padding mask is passed
    # (integrations/sdpa_attention.use_gqa_in_sdpa), which GRPO batches always have; flash-attn keeps native K/V.
    total += a * (q + 2 * (kv if x.attn == "flash" else q))
    if x.attn == "eager":
        # eager keeps the fp32 softmax and its cast to the compute dtype (Korthikanti's 5as/h term); its output
        # is kept only by o_proj's consumer (o_bytes)
        total += (4 + (a if a != 4 else 0)) * s.num_heads * seq + o_bytes
    else:
        # sdpa/flash kernels keep their output and a logsumexp; o_proj shares that output unless dropout copies it.
        total += a * q + 4 * s.num_heads + (0 if o_keeps_out else o_bytes)
        if x.attn == "sdpa":
            total += a * seq  # the boolean padding mask becomes an additive bias per call, kept for backward
    # SwiGLU: SiLU keeps its input (gate out), the product keeps both factors (silu out, up out).
    total += 3 * a * i
    return total


def estimate(x: PlanInputs) -> tuple[dict[str, int], dict[str, str], str]:
    """Per-GPU bytes of every component, a note on each, and which phase peaks."""
    c: dict[str, int] = {}
    why: dict[str, str] = {}
    _weight_terms(x, c, why)
    _judge_term(x, c, why)
    _generation_terms(x, c, why)
    _training_terms(x, c, why)
    gen_phase = c["generation_kv_cache"] + c["generation_transient"] + c["vllm_awake"]
    train_phase = c["activations"] + c["logits"]
    phase = "training" if train_phase >= gen_phase else "generation"
    c["framework_overhead"] = int(CUDA_CONTEXT_GIB * GIB + FRAGMENTATION * max(gen_phase, train_phase))
    why["framework_overhead"] = f"CUDA context/cuBLAS/NCCL {CUDA_CONTEXT_GIB} GiB + {FRAGMENTATION:.0%} fragmentation of the peak phase"
    return c, why, phase


def _weight_terms(x: PlanInputs, c: dict[str, int], why: dict[str, str]) -> None:
    """Weights, gradients, optimizer states and the reference model, each sharded as the ZeRO stage says."""
    s, a, k = x.shape, x.wbytes, x.num_gpus
    n_params = s.param_count()
    n_train = lora_param_count(s, x.lora_r, x.lora_targets) if x.lora else n_params
    mixed = a == 2

    # Weights. ZeRO-3 partitions every parameter over the K data-parallel GPUs (Rajbhandari et al. 2020,
    # "ZeRO", sec. 5: stage 3 = P_os+g+p); with parameter offload only the gathered working set stays:
    # DeepSpeed gathers the current module and prefetches the next, taken here as two of the largest.
    live = 2 * max(s.layer_param_count(), s.vocab_size * s.hidden_size) * a
    shard = k if x.zero_stage == 3 else 1
    offloaded = x.zero_stage == 3 and x.offload_params
    # Trainable weights, gradients, optimizer: ZeRO paper's mixed-precision Adam is 2 + 2 + 12 bytes per
    # trainable parameter (half weights, half grads, fp32 master + momentum + variance); stage 1 shards the
    # 12, stage 2 also the grads, stage 3 also the weights. Without DeepSpeed, PEFT keeps LoRA adapters in
    # fp32 (autocast_adapter_dtype) and AdamW keeps m, v in the param dtype: 4 + 4 + 8. fp32 runs: 4 + 4 + 8.
    wb, gb, ob = (2, 2, 12) if mixed and (x.zero_stage >= 1 or not x.lora) else (4, 4, 8)
    sharded = f" / {k} GPUs (ZeRO-3)" if shard > 1 else ""
    base_b = a if x.lora else wb  # the frozen base in the compute dtype; full fine-tuning's weights as trained
    c["base_weights"] = live if offloaded else n_params * base_b // shard
    why["base_weights"] = ("ZeRO-3 offloaded to CPU; two gathered modules stay" if offloaded
                           else f"{human_count(n_params)} {'frozen' if x.lora else 'trainable'} params x {base_b} B{sharded}")
    c["lora_weights"] = 0 if offloaded or not x.lora else n_train * wb // shard
    why["lora_weights"] = f"{human_count(n_train)} params (r={x.lora_r}) x {wb} B{sharded}" if x.lora else "lora.enabled false"
    grad_shard = k if x.zero_stage >= 2 else 1
    c["gradients"] = n_train * gb // grad_shard
    if x.zero_stage == 0 and k > 1:
        c["gradients"] *= 2  # DDP's reducer keeps its own bucket copy of the gradients
    why["gradients"] = f"{human_count(n_train)} x {gb} B" + (f" / {k} (ZeRO-{x.zero_stage})" if grad_shard > 1 else "") + (
        " x 2 (DDP buckets)" if x.zero_stage == 0 and k > 1 else "")
    opt_shard = k if x.zero_stage >= 1 else 1
    c["optimizer_states"] = 0 if x.offload_optimizer else n_train * ob // opt_shard
    why["optimizer_states"] = "offloaded to CPU" if x.offload_optimizer else (
        f"{human_count(n_train)} x {ob} B (Adam" + (" + fp32 master)" if ob == 12 else ")") + (f" / {k} (ZeRO-{x.zero_stage})" if opt_shard > 1 else ""))

    # Reference model for the KL term: with LoRA TRL disables the adapters on the same weights (no copy);
    # without LoRA it holds a second full model, partitioned like the policy under ZeRO-3.
    c["reference_model"] = n_params * a // shard if x.beta > 0 and not x.lora else 0
    why["reference_model"] = ("beta = 0: none" if x.beta <= 0 else "LoRA: base with adapters disabled, no copy"
                              if x.lora else f"full copy, {human_count(n_params)} x {a} B")


def _judge_term(x: PlanInputs, c: dict[str, int], why: dict[str, str]) -> None:
    # Judge sharing this GPU: its weights, its own CUDA context, and one no-grad forward over a scoring batch
    # (one layer's intermediates at a time, then last-position logits in fp32).
    judge_bytes, jshape = x.judge
    c["judge"] = judge_bytes
    if judge_bytes and jshape is not None:
        jt = x.judge_batch[0] * x.judge_batch[1]
        c["judge"] += jt * (4 * jshape.hidden_size + 2 * (jshape.hidden_size + 4 * jshape.q_dim + 2 * jshape.kv_dim
                                                          + 3 * jshape.intermediate_size)) + x.judge_batch[0] * jshape.vocab_size * 4
    if judge_bytes:
        c["judge"] += int(JUDGE_CONTEXT_GIB * GIB)
    why["judge"] = (f"placement same_gpu, {x.judge_batch[0]} x {x.judge_batch[1]} tokens per scoring forward + own CUDA context"
                    if judge_bytes else "not on this GPU (judge.placement own_gpu/none, or judge 'self')")


def _generation_terms(x: PlanInputs, c: dict[str, int], why: dict[str, str]) -> None:
    """The KV cache and transients of generate(), or colocated vLLM's reservation; after `_weight_terms`
    (ZeRO-3 gathers the weights it sharded)."""
    s, a = x.shape, x.wbytes
    n_params = s.param_count()
    # Generation. HF generate runs the whole local generation batch (per-device batch x steps_per_generation)
    # at once; its KV cache holds K and V per layer: 2 * layers * kv_heads * head_dim * bytes per token.
    seqs = x.batch * x.steps_per_generation
    if x.refill_oversample is not None:
        # Dynamic sampling's refill round: every group dropped asks for ceil(oversample x groups) new groups
        # per device, generated at once; the kept rows it holds meanwhile are token ids (negligible).
        seqs = max(seqs, math.ceil(x.refill_oversample * seqs / x.num_generations) * x.num_generations)
    seq = x.prompt_len + x.completion_len
    kv_per_token = 2 * s.num_layers * s.kv_dim * a
    gen_extra = 0
    if x.zero_stage == 3:  # TRL's ds3_gather_for_generation gathers the full weights for generate()
        gen_extra += n_params * a - c["base_weights"] - c["lora_weights"]
    if x.vllm_util is not None:
        _vllm_terms(x, c, why, seqs, seq, kv_per_token)
    else:
        c["vllm_reservation"] = c["vllm_awake"] = 0
        why["vllm_reservation"] = why["vllm_awake"] = "generation.backend hf"
        c["generation_kv_cache"] = seqs * seq * kv_per_token
        why["generation_kv_cache"] = f"{seqs} seqs x {seq} tokens x {kv_per_token // 1024} KiB"
        # prefill of one layer at a time under no_grad (norm in fp32, q/k/v/out with K/V repeated, SwiGLU),
        # then the sampling logits in fp32 (logits, processors, softmax: ~3 copies).
        gen_extra += seqs * x.prompt_len * (4 * s.hidden_size + a * (s.hidden_size + 4 * s.q_dim + 2 * s.kv_dim + 3 * s.intermediate_size))
        gen_extra += 3 * seqs * s.vocab_size * 4
    c["generation_transient"] = gen_extra
    why["generation_transient"] = "prefill of one layer + sampling logits" + (" + ZeRO-3 gathered weights" if x.zero_stage == 3 else "")


def _vllm_terms(x: PlanInputs, c: dict[str, int], why: dict[str, str], seqs: int, seq: int, kv_per_token: int) -> None:
    """Colocated vLLM's share as vLLM allots it: gpu_memory_utilization x the GPU for its own weights (unsharded)
    and, in what is left, its KV cache. Held for the whole run, or with sleep mode (level 2) only while
    generating: weights and KV cache are let go for the training phase and the weights pushed back after."""
    weights = x.shape.param_count() * x.wbytes
    reserved = int(x.vllm_util * x.gpu_gib * GIB) if x.gpu_gib else weights + seqs * seq * kv_per_token
    kv_seqs = max(0, reserved - weights) // (seq * kv_per_token)
    share = f"{x.vllm_util:.0%} of the GPU" if x.gpu_gib else "weights + KV cache (no GPU size given)"
    note = (f"colocated vLLM, {share}: {weights / GIB:.1f} GiB weights + {max(0, reserved - weights) / GIB:.1f} GiB "
            f"KV cache ({kv_seqs} of the rollout's {seqs} seqs x {seq} tokens at once)")
    key, idle = ("vllm_awake", "vllm_reservation") if x.vllm_sleep else ("vllm_reservation", "vllm_awake")
    c[key], why[key] = reserved, note + (", released while training (sleep mode)" if x.vllm_sleep else "")
    c[idle], why[idle] = 0, "vllm_awake: sleep mode, held only while generating" if x.vllm_sleep else "sleep mode off"
    c["generation_kv_cache"] = 0
    why["generation_kv_cache"] = "inside the vLLM reservation"


def _training_terms(x: PlanInputs, c: dict[str, int], why: dict[str, str]) -> None:
    """Activations and logits of one training micro-batch."""
    s, a = x.shape, x.wbytes
    seq = x.prompt_len + x.completion_len
    # Training activations of one micro-batch (batch x (prompt + completion) tokens). Without checkpointing
    # every layer keeps its tensors; with it only each layer's input (a*h) plus one recomputed layer. One
    # more layer's worth is the backward working set (activation gradients); + the final norm.
    tokens = x.batch * seq
    per_layer = layer_activation_bytes(x, seq)
    extra = 4 * s.hidden_size + 4  # final RMSNorm
    if x.grad_ckpt:
        c["activations"] = tokens * (s.num_layers * a * s.hidden_size + 2 * per_layer + extra)
        why["activations"] = f"{tokens} tokens x (layer inputs + 2 layers x {per_layer / 1024:.0f} KiB), checkpointing"
    else:
        c["activations"] = tokens * ((s.num_layers + 1) * per_layer + extra)
        why["activations"] = f"{tokens} tokens x {s.num_layers + 1} layers x {per_layer / 1024:.0f} KiB"
    # Logits. Older TRL: full logits of the completion positions in fp32 plus the log_softmax copy kept for
    # backward: batch * completion * vocab * 4 * 2. TRL with the fused LM head: one [<=4096 x <=32768] tile in
    # compute dtype, the masked hidden states, the fp32 hidden-state gradient and per-token statistics.
    n_c = x.batch * x.completion_len
    if x.fused_logits:
        c["logits"] = min(n_c, 4096) * min(s.vocab_size, 32768) * a + n_c * (s.hidden_size * (a + 4) + 40)
        why["logits"] = f"TRL fused LM head: one {min(n_c, 4096)} x {min(s.vocab_size, 32768)} tile + hidden grads"
    else:
        c["logits"] = n_c * s.vocab_size * 4 * 2
        why["logits"] = f"{n_c} completion tokens x {s.vocab_size} vocab x fp32 x 2 (logits + log_softmax)"


PHASE = {"generation_kv_cache": "generation", "generation_transient": "generation", "vllm_awake": "generation",
         "activations": "training", "logits": "training"}
COMPONENT_ORDER = ("base_weights", "lora_weights", "gradients", "optimizer_states", "reference_model", "judge", "vllm_reservation", "vllm_awake",
          "generation_kv_cache", "generation_transient", "activations", "logits", "framework_overhead")


def peak_total(c: dict[str, int], phase: str) -> int:
    """Persistent terms + the larger phase: the KV cache is freed before the training forward starts."""
    return sum(v for n, v in c.items() if PHASE.get(n, phase) == phase)
