"""GPU memory planner: predict per-GPU memory of a GRPO run before it starts, without a GPU.

Answers the seed's question "can num_generations go from 4 to 8 or 16 on this GPU?" from the
run config and the model's config.json alone (no weights are loaded). All formulas live in
`_estimate`, each with a comment naming its source. Results are per GPU, in GiB (2**30 bytes).
The parameter, LoRA, gradient, optimizer and KV-cache terms are checked exactly against counted
tensors in tests/test_memory.py; the activation terms are estimates not yet measured on a GPU
(docs/memory.md says how to validate them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import cli_error
from pipeline.config import TINY_POLICY, RunConfig, divides_into_groups, worker_range
from pipeline.seams.trl_seams import fuses_lm_head

GIB = 1024**3
HEADROOM = 0.05  # "fits" leaves 5% of the GPU free for estimation error
CUDA_CONTEXT_GIB = 1.0  # CUDA context + cuBLAS workspaces + NCCL buffers (not seen by torch's allocator)
FRAGMENTATION = 0.10  # caching-allocator slack on the transient peak (reserved vs allocated, typically 5-15%)
JUDGE_CONTEXT_GIB = 0.5  # a same-GPU judge is another Ray process: its own CUDA context
MAX_SEARCH_GENERATIONS = 512

# name: (nominal GB, GiB torch reports as total_memory). Usable capacity is what an allocation is
# checked against, and it is below the nominal size (e.g. "A10 24 GB" -> ~22.0 GiB in OOM messages).
GPU_PRESETS: dict[str, tuple[int, float]] = {
    "A10": (24, 22.0),
    "L4": (24, 22.0),
    "L40S": (48, 44.4),
    "RTX6000-Ada": (48, 47.4),
    "A6000": (48, 47.4),
    "A100-40": (40, 39.4),
    "A100-80": (80, 79.1),
    "H100": (80, 79.1),
    "H200": (141, 139.8),
}
_GPU_ALIASES = {
    "a10g": "A10", "l40": "L40S", "6000ada": "RTX6000-Ada", "rtx6000adageneration": "RTX6000-Ada",
    "rtxa6000": "A6000", "a100": "A100-40", "h10080": "H100", "h10094": "H100", "h200141": "H200",
}
_GPU_NOISE = {"nvidia", "geforce", "tesla", "quadro", "sxm", "sxm4", "sxm5", "pcie", "nvl", "gb", "gib", "hbm3", "hbm3e"}


class PlanError(ValueError):
    """Bad planner input (unknown GPU, model shape not found); the CLI prints it and exits 2."""


# ---------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class ModelShape:
    """What the formulas need of a Llama-style decoder (llama, mistral, qwen2 families)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q, k, v
    o_bias: bool = False  # Llama attention_bias: bias on q, k, v and o
    mlp_bias: bool = False
    max_positions: int = 131072
    source: str = ""
    params: int | None = None  # exact count of the model a config.json describes; else the formula below

    @property
    def q_dim(self) -> int:
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * (self.head_dim or self.hidden_size // self.num_heads)

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer in one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def param_count(self) -> int:
        """Exact: counted on the empty model where a config.json was read, else the formula, exact for
        LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM (tests compare numel)."""
        if self.params is not None:
            return self.params
        lin = self.linears()
        per_layer = sum(a * b for a, b in lin.values()) + 2 * self.hidden_size  # + two RMSNorm weights
        if self.qkv_bias or self.o_bias:
            per_layer += self.q_dim + 2 * self.kv_dim
        if self.o_bias:
            per_layer += self.hidden_size
        if self.mlp_bias:
            per_layer += 2 * self.intermediate_size + self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size  # + final norm

    def layer_param_count(self) -> int:
        return sum(a * b for a, b in self.linears().values())

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], source: str) -> "ModelShape":
        if not isinstance(d, dict):
            raise PlanError(f"{source}: not a JSON object but {type(d).__name__}")
        d = d.get("text_config") or d
        if not isinstance(d, dict):
            raise PlanError(f"{source}: text_config is not a JSON object")
        try:
            heads = _shape_int(d, "num_attention_heads", 1 << 12)
            hidden = _shape_int(d, "hidden_size", 1 << 17)
            head_dim = _shape_int(d, "head_dim", 1 << 14, None)
            if head_dim is None and heads > hidden:
                raise ValueError(f"num_attention_heads {heads} > hidden_size {hidden} and no head_dim")
            mt = str(d.get("model_type", ""))
            return cls(
                hidden_size=hidden,
                intermediate_size=_shape_int(d, "intermediate_size", 1 << 20),
                num_layers=_shape_int(d, "num_hidden_layers", 1 << 12),
                num_heads=heads,
                num_kv_heads=_shape_int(d, "num_key_value_heads", heads, heads),
                vocab_size=_shape_int(d, "vocab_size", 1 << 24),
                head_dim=head_dim,
                tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=mt.startswith("qwen2") or bool(d.get("attention_bias", False)),
                o_bias=bool(d.get("attention_bias", False)) and not mt.startswith("qwen2"),
                mlp_bias=bool(d.get("mlp_bias", False)),
                max_positions=_shape_int(d, "max_position_embeddings", 1 << 31, 131072),
                source=source,
            )
        except KeyError as e:
            raise PlanError(f"{source}: config.json lacks a decoder shape field ({e})") from None
        except ValueError as e:
            raise PlanError(f"{source}: {e}") from None


_NO_DEFAULT = object()


def _shape_int(d: dict[str, Any], key: str, most: int, default: Any = _NO_DEFAULT) -> Any:
    """A shape field of a config.json: a whole number from 1 to ``most`` (null or absent: the default,
    KeyError without one); ValueError naming the field otherwise."""
    v = d.get(key)
    if v is None:
        if default is _NO_DEFAULT:
            raise KeyError(key)
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (1 <= v <= most) or v != int(v):
        shown = json.dumps(v)[:40] if isinstance(v, (int, float, str, bool)) else type(v).__name__
        raise ValueError(f"{key} is {shown}, expected a whole number from 1 to {most}")
    return int(v)


_LLAMA3_8B = ModelShape(4096, 14336, 32, 32, 8, 128256, max_positions=131072, source="built-in Llama-3.1-8B shape")
_MISTRAL_7B = ModelShape(4096, 14336, 32, 32, 8, 32000, max_positions=32768, source="built-in Mistral-7B-v0.1 shape")
_MISTRAL_7B_V03 = dataclasses.replace(_MISTRAL_7B, vocab_size=32768, source="built-in Mistral-7B-v0.3 shape")
_QWEN25_7B = ModelShape(3584, 18944, 28, 28, 4, 152064, qkv_bias=True, max_positions=32768, source="built-in Qwen2.5-7B shape")
# Matched against the lower-cased id before any network access; fine-tunes keep their base's shape.
_BUILTIN_PATTERNS: list[tuple[str, ModelShape]] = [
    (r"llama-?3(\.[01])?-.*8b|sauerkrautlm.*llama-?3|llama-?3.*sauerkrautlm", _LLAMA3_8B),
    (r"mistral-7b.*v0\.3", _MISTRAL_7B_V03),
    (r"mistral-7b", _MISTRAL_7B),
    (r"qwen2\.5-7b", _QWEN25_7B),
]
BUILTIN_EXAMPLES = ("meta-llama/Llama-3.1-8B-Instruct", "VAGOsolutions/Llama-3.1-SauerkrautLM-8b-Instruct",
                    "mistralai/Mistral-7B-Instruct-v0.3", "Qwen/Qwen2.5-7B-Instruct")
# all-MiniLM-L6-v2 (the packaged embedding judge): 22.7M parameters, fp32
_MINILM_PARAMS = 22_713_216


def builtin_shape(model_id: str) -> ModelShape | None:
    name = model_id.lower()
    for pattern, shape in _BUILTIN_PATTERNS:
        if re.search(pattern, name):
            return dataclasses.replace(shape, source=f"{shape.source} (matched by id)")
    return None


@functools.lru_cache(maxsize=32)
def _count_params(config_json: str) -> int | None:
    """The parameters of the model a config.json describes, counted on an empty model (accelerate's
    ``init_empty_weights``: meta tensors, no weights loaded or allocated); exact for any architecture
    transformers builds, None where it builds none (the formula counts then)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(**json.loads(config_json))
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()  # init_empty_weights re-creates each parameter, which unties tied embeddings
        return sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 - any config transformers cannot build (the formula counts then)
        return None


CONFIG_JSON_MAX_BYTES = 4 << 20  # a model's config.json is a few KB (a VLM's with its processor a few 100 KB)


def _read_config(path: Path, source: str) -> ModelShape:
    """The shape a config.json describes; PlanError naming the file when it cannot be read as one."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(CONFIG_JSON_MAX_BYTES + 1)
    except OSError as e:
        raise PlanError(f"{source}: cannot be read ({e.strerror or e})") from None
    if len(data) > CONFIG_JSON_MAX_BYTES:
        raise PlanError(f"{source}: larger than {CONFIG_JSON_MAX_BYTES >> 20} MiB, not a model's config.json")
    try:
        text = data.decode("utf-8")
        d = json.loads(text)
    except UnicodeDecodeError as e:
        raise PlanError(f"{source}: not UTF-8 (byte {e.start})") from None
    except ValueError as e:
        raise PlanError(f"{source}: not valid JSON ({str(e)[:200]})") from None
    except RecursionError:
        raise PlanError(f"{source}: JSON nested too deep") from None
    return dataclasses.replace(ModelShape.from_hf_config(d, source), params=_count_params(text))


def _tiny_shape() -> ModelShape:
    """The project's own tiny policy (pipeline.data.tiny_models): the built policy's config.json, else the recipe it
    would be built from (vocab_size is then the BPE target)."""
    import pipeline.data.tiny_models as tiny

    config = tiny.policy_dir() / "config.json"
    if config.is_file():
        return _read_config(config, str(config))
    recipe = dataclasses.asdict(tiny.TinyRecipe())
    return ModelShape.from_hf_config({**recipe, "tie_word_embeddings": True}, "pipeline.data.tiny_models.TinyRecipe (not built yet)")


def resolve_shape(name_or_path: str, revision: str | None = None) -> ModelShape:
    """Local path, then built-in shapes by id, then the Hugging Face cache, then a download."""
    if name_or_path == TINY_POLICY:
        return _tiny_shape()
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return _read_config(path, str(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PlanError(f"model {name_or_path!r}: folder has no config.json")
        return _read_config(path / "config.json", str(path / "config.json"))
    builtin = builtin_shape(name_or_path)
    if builtin is not None:
        return builtin
    try:
        import huggingface_hub as hub

        cached = hub.try_to_load_from_cache(name_or_path, "config.json", revision=revision)
        found = cached if isinstance(cached, str) else hub.hf_hub_download(name_or_path, "config.json", revision=revision)
        return _read_config(Path(found), f"hub {name_or_path}")
    except PlanError:
        raise
    except Exception as e:  # offline, unknown repo, gated repo: all end the same way for the user
        raise PlanError(
            f"model {name_or_path!r}: shape not found (no local folder, no built-in shape, and config.json "
            f"could not be fetched from the hub: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"Give a local folder with config.json, or a built-in id such as {', '.join(BUILTIN_EXAMPLES)}"
        ) from None


def lora_param_count(shape: ModelShape, r: int, targets: str | list[str]) -> int:
    """LoRA adds A (r x in) and B (out x r) per targeted linear: r * (in + out) parameters (Hu et al. 2021).
    PEFT's "all-linear" targets every linear layer except the output head."""
    lin = shape.linears()
    total = shape.num_layers * sum(r * (lin[n][0] + lin[n][1]) for n in _lora_targets(targets, shape))
    if isinstance(targets, list) and any(t in ("lm_head", "embed_tokens") for t in targets):
        total += r * (shape.hidden_size + shape.vocab_size) * sum(t in ("lm_head", "embed_tokens") for t in targets)
    return total


def _lora_targets(targets: str | list[str], shape: ModelShape) -> list[str]:
    """The linears of one decoder layer that LoRA targets (PEFT's "all-linear": every one)."""
    return list(shape.linears()) if targets == "all-linear" else [t for t in targets if t in shape.linears()]


# ---------------------------------------------------------------- the plan


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


@dataclass(frozen=True)
class _Inputs:
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


def _n(count: float) -> str:
    """8030261248 -> '8.03B', 83886080 -> '83.9M', 5120 -> '5.1K'."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= div:
            return f"{count / div:.{2 if unit == 'B' else 1}f}{unit}"
    return str(int(count))


def _layer_activation_bytes(x: _Inputs, seq: int, mask_bytes: int = 1) -> int:
    """Bytes autograd keeps per token in one decoder layer. Method of Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models" (sec. 4: count every tensor saved for backward),
    applied to Llama's RMSNorm + GQA attention + SwiGLU + LoRA instead of GPT's block. Exact against
    saved-tensor hooks on CPU (tests); `mask_bytes`: dropout mask per element, bool on CUDA, float on CPU."""
    s, a = x.shape, x.wbytes
    h, q, kv, i = s.hidden_size, s.q_dim, s.kv_dim, s.intermediate_size
    targets = _lora_targets(x.lora_targets, s) if x.lora else []
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


def _estimate(x: _Inputs) -> tuple[dict[str, int], dict[str, str], str]:
    """Per-GPU bytes of every component, a note on each, and which phase peaks."""
    s, a, k = x.shape, x.wbytes, x.num_gpus
    n_params = s.param_count()
    n_train = lora_param_count(s, x.lora_r, x.lora_targets) if x.lora else n_params
    c: dict[str, int] = {}
    why: dict[str, str] = {}
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
                           else f"{_n(n_params)} {'frozen' if x.lora else 'trainable'} params x {base_b} B{sharded}")
    c["lora_weights"] = 0 if offloaded or not x.lora else n_train * wb // shard
    why["lora_weights"] = f"{_n(n_train)} params (r={x.lora_r}) x {wb} B{sharded}" if x.lora else "lora.enabled false"
    grad_shard = k if x.zero_stage >= 2 else 1
    c["gradients"] = n_train * gb // grad_shard
    if x.zero_stage == 0 and k > 1:
        c["gradients"] *= 2  # DDP's reducer keeps its own bucket copy of the gradients
    why["gradients"] = f"{_n(n_train)} x {gb} B" + (f" / {k} (ZeRO-{x.zero_stage})" if grad_shard > 1 else "") + (
        " x 2 (DDP buckets)" if x.zero_stage == 0 and k > 1 else "")
    opt_shard = k if x.zero_stage >= 1 else 1
    c["optimizer_states"] = 0 if x.offload_optimizer else n_train * ob // opt_shard
    why["optimizer_states"] = "offloaded to CPU" if x.offload_optimizer else (
        f"{_n(n_train)} x {ob} B (Adam" + (" + fp32 master)" if ob == 12 else ")") + (f" / {k} (ZeRO-{x.zero_stage})" if opt_shard > 1 else ""))

    # Reference model for the KL term: with LoRA TRL disables the adapters on the same weights (no copy);
    # without LoRA it holds a second full model, partitioned like the policy under ZeRO-3.
    c["reference_model"] = n_params * a // shard if x.beta > 0 and not x.lora else 0
    why["reference_model"] = ("beta = 0: none" if x.beta <= 0 else "LoRA: base with adapters disabled, no copy"
                              if x.lora else f"full copy, {_n(n_params)} x {a} B")

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
        c["vllm_reservation"] = int(x.vllm_util * x.gpu_gib * GIB) if x.gpu_gib else n_params * a + seqs * seq * kv_per_token
        why["vllm_reservation"] = (f"colocated vLLM takes {x.vllm_util:.0%} of the GPU for its weights + KV cache"
                                   if x.gpu_gib else "colocated vLLM: weights + KV cache (no GPU size given)")
        c["generation_kv_cache"] = 0
        why["generation_kv_cache"] = "inside the vLLM reservation"
    else:
        c["vllm_reservation"] = 0
        why["vllm_reservation"] = "generation.backend hf"
        c["generation_kv_cache"] = seqs * seq * kv_per_token
        why["generation_kv_cache"] = f"{seqs} seqs x {seq} tokens x {kv_per_token // 1024} KiB"
        # prefill of one layer at a time under no_grad (norm in fp32, q/k/v/out with K/V repeated, SwiGLU),
        # then the sampling logits in fp32 (logits, processors, softmax: ~3 copies).
        gen_extra += seqs * x.prompt_len * (4 * s.hidden_size + a * (s.hidden_size + 4 * s.q_dim + 2 * s.kv_dim + 3 * s.intermediate_size))
        gen_extra += 3 * seqs * s.vocab_size * 4
    c["generation_transient"] = gen_extra
    why["generation_transient"] = "prefill of one layer + sampling logits" + (" + ZeRO-3 gathered weights" if x.zero_stage == 3 else "")

    # Training activations of one micro-batch (batch x (prompt + completion) tokens). Without checkpointing
    # every layer keeps its tensors; with it only each layer's input (a*h) plus one recomputed layer. One
    # more layer's worth is the backward working set (activation gradients); + the final norm.
    tokens = x.batch * seq
    per_layer = _layer_activation_bytes(x, seq)
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

    gen_phase = c["generation_kv_cache"] + c["generation_transient"]
    train_phase = c["activations"] + c["logits"]
    phase = "training" if train_phase >= gen_phase else "generation"
    c["framework_overhead"] = int(CUDA_CONTEXT_GIB * GIB + FRAGMENTATION * max(gen_phase, train_phase))
    why["framework_overhead"] = f"CUDA context/cuBLAS/NCCL {CUDA_CONTEXT_GIB} GiB + {FRAGMENTATION:.0%} fragmentation of the peak phase"
    return c, why, phase


_PHASE = {"generation_kv_cache": "generation", "generation_transient": "generation", "activations": "training", "logits": "training"}
_ORDER = ("base_weights", "lora_weights", "gradients", "optimizer_states", "reference_model", "judge", "vllm_reservation",
          "generation_kv_cache", "generation_transient", "activations", "logits", "framework_overhead")


def _total(c: dict[str, int], phase: str) -> int:
    """Persistent terms + the larger phase: the KV cache is freed before the training forward starts."""
    return sum(v for n, v in c.items() if _PHASE.get(n, phase) == phase)


def completion_length(cfg: RunConfig) -> int:
    """The length the planner sizes for: a fixed value, or adaptive's ceiling (else its start)."""
    g = cfg.generation
    if cfg.adaptive_length:
        return g.adaptive.ceiling or g.adaptive.start
    return max([int(g.max_completion_length)] + [int(length) for _, length in g.length_schedule])


def _inputs(cfg: RunConfig, gpu_gib: float | None, num_gpus: int | None) -> _Inputs:
    prec = cfg.optimization.precision
    judge_bytes, jshape = 0, None
    j = cfg.judge
    if j.placement == "same_gpu" and j.backend == "llm":
        jshape = resolve_shape(j.model)
        judge_bytes = jshape.param_count() * 2
    elif j.placement == "same_gpu" and j.backend == "embedding":
        judge_bytes = _MINILM_PARAMS * 4
    attn = cfg.model.attn_implementation or "sdpa"
    o = cfg.optimization
    return _Inputs(
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
    )


def _fits(x: _Inputs) -> bool:
    c, _, phase = _estimate(x)
    return x.gpu_gib is not None and _total(c, phase) <= x.gpu_gib * GIB * (1 - HEADROOM)


def batch_for_generations(x: _Inputs, g: int, g0: int, b0: int) -> int:
    """Per-device batch for g generations keeping the config's prompts per round (b0/g0 per device),
    raised until TRL's rule holds: batch * num_gpus * steps_per_generation divisible by g."""
    b = max(1, math.ceil(b0 * g / g0))
    while not divides_into_groups(b * x.num_gpus * x.steps_per_generation, g):
        b += 1
    return b


def scaled_batch(cfg: RunConfig, num_generations: int, num_gpus: int | None = None) -> int:
    """The per-device batch `synth-grpo plan`'s sweep uses for `num_generations`: the config's prompts per
    round kept, rounded up to TRL's divisibility rule (bench/gpu_check.py runs exactly these batches)."""
    x = _inputs(cfg, None, num_gpus)
    return batch_for_generations(x, num_generations, x.num_generations, x.batch)


def _max_generations(x: _Inputs) -> int:
    """Largest g whose scaled batch fits; stops once even the unrounded batch b0*g/g0 does not fit."""
    best = 0
    for g in range(2, MAX_SEARCH_GENERATIONS + 1):
        if not _fits(dataclasses.replace(x, num_generations=g, batch=max(1, math.ceil(x.batch * g / x.num_generations)))):
            break
        if _fits(dataclasses.replace(x, num_generations=g, batch=batch_for_generations(x, g, x.num_generations, x.batch))):
            best = g
    return best


def plan_run(cfg: RunConfig, gpu_gib: float | None = None, num_gpus: int | None = None, *,
             fused_logits: bool | None = None) -> MemoryPlan:
    """Predict per-GPU memory of `cfg` on a GPU of `gpu_gib` GiB (default: the detected one) with the
    ZeRO stage sharding over `num_gpus` (default: distributed.num_workers). Raises PlanError."""
    gpu_gib = gpu_gib if gpu_gib is not None else detect_gpu_gib()
    x = _inputs(cfg, gpu_gib, num_gpus)
    if fused_logits is not None:
        x = dataclasses.replace(x, fused_logits=fused_logits)
    c, why, phase = _estimate(x)
    total = _total(c, phase)
    notes = []
    if x.vllm_util is not None and x.gpu_gib and x.vllm_util * x.gpu_gib < x.shape.param_count() * x.wbytes / GIB:
        notes.append(f"vLLM's share ({x.vllm_util:.0%} of {x.gpu_gib} GiB) is smaller than the weights: vLLM cannot start")
    if cfg.judge.placement == "same_gpu" and cfg.judge.backend == "self":
        notes.append("judge 'self' shares the policy's weights; its scoring forward is not counted")
    if x.steps_per_generation > 1 and x.vllm_util is None:
        notes.append(f"generate() runs {x.batch * x.steps_per_generation} sequences at once (steps_per_generation "
                     f"{x.steps_per_generation}); set generation.steps_per_generation lower to shrink the KV cache")
    fits = None if gpu_gib is None else total <= gpu_gib * GIB * (1 - HEADROOM)
    return MemoryPlan(
        components={n: c.get(n, 0) / GIB for n in _ORDER}, total_gib=total / GIB, gpu_gib=gpu_gib, fits=fits,
        max_num_generations=None if gpu_gib is None else _max_generations(x), peak_phase=phase, notes=notes,
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
    x = _inputs(cfg, gpu_gib, num_gpus)
    lo, hi = 0, max(0, x.shape.max_positions - x.prompt_len)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(dataclasses.replace(x, completion_len=mid)):
            lo = mid
        else:
            hi = mid - 1
    return lo


def detect_gpu_gib() -> float | None:
    """Total memory of CUDA device 0 in GiB (in a Ray worker: its own GPU), None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GIB


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


# ---------------------------------------------------------------- CLI


def gpu_preset(name: str) -> tuple[str, float]:
    """Forgiving preset lookup: "a100-80", "A100 80GB", "NVIDIA H100 SXM", "l40s" -> (name, GiB)."""
    tokens = [t.removesuffix("gb") for t in re.split(r"[^a-z0-9]+", name.lower()) if t and t not in _GPU_NOISE]
    key = "".join(tokens)
    table = {re.sub(r"[^a-z0-9]", "", p.lower()): p for p in GPU_PRESETS}
    found = table.get(key) or _GPU_ALIASES.get(key)
    if found is None:
        listing = ", ".join(f"{p} ({nom} GB)" for p, (nom, _) in GPU_PRESETS.items())
        raise PlanError(f"unknown GPU {name!r}; presets: {listing}; or give --gpu-mem GiB")
    return found, GPU_PRESETS[found][1]


def format_plan(plan: MemoryPlan, gpu_name: str | None = None) -> str:
    i = plan.inputs
    lines = [
        f"model: {i['model']} ({i['shape_source']}): {_n(i['params'])} params, {_n(i['trainable'])} trainable",
        f"per GPU: {i['batch']} completions/micro-batch, num_generations {i['num_generations']}, prompt {i['prompt_len']} + "
        f"completion {i['completion_len']} tokens, {'bf16' if i['wbytes'] == 2 else 'fp32'}, ZeRO-{i['zero_stage']} over "
        f"{i['num_gpus']} GPU(s), gradient checkpointing {'on' if i['grad_ckpt'] else 'off'}",
        "",
        f"{'component':<22}{'GiB':>8}  {'phase':<11}basis",
    ]
    for name, gib in plan.components.items():
        phase = _PHASE.get(name, "always")
        mark = "" if phase in ("always", plan.peak_phase) else " (not at peak)"
        lines.append(f"{name:<22}{gib:8.2f}  {phase:<11}{plan.details.get(name, '')}{mark}")
    lines.append("-" * 72)
    where = f"{gpu_name} " if gpu_name else ""
    if plan.gpu_gib is None:
        lines.append(f"{'total':<22}{plan.total_gib:8.2f}  peak in the {plan.peak_phase} phase; no GPU given (--gpu or --gpu-mem)")
    else:
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        lines.append(f"{'total':<22}{plan.total_gib:8.2f}  of {where}{plan.gpu_gib:.1f} GiB: {verdict} "
                     f"({HEADROOM:.0%} headroom); peak in the {plan.peak_phase} phase")
    return "\n".join(lines + [f"note: {n}" for n in plan.notes])


def _sweep(cfg: RunConfig, gpu_gib: float | None, num_gpus: int | None, fused: bool) -> str:
    x = dataclasses.replace(_inputs(cfg, gpu_gib, num_gpus), fused_logits=fused)
    prompts = x.batch * x.num_gpus * x.steps_per_generation // x.num_generations
    rows = [f"num_generations sweep ({prompts} prompts per generation round kept; per-device batch scales with it):",
            f"{'G':>5}{'batch':>7}{'total GiB':>11}  fits"]
    for g in sorted({2, 4, 8, 16, 32, 64, x.num_generations}):
        b = batch_for_generations(x, g, x.num_generations, x.batch)
        y = dataclasses.replace(x, num_generations=g, batch=b)
        c, _, phase = _estimate(y)
        fit = "-" if gpu_gib is None else ("yes" if _fits(y) else "no")
        rows.append(f"{g:>5}{b:>7}{_total(c, phase) / GIB:>11.2f}  {fit}" + ("  <- config" if g == x.num_generations else ""))
    rows.append("(at a fixed per-device batch, num_generations only changes how many prompts share a round: memory is unchanged)")
    return "\n".join(rows)


def plan_cli(cfg: RunConfig, args: Any) -> int:
    """`synth-grpo plan`: print the table (or JSON); exit 2 on an unknown GPU or model shape."""
    try:
        if args.num_gpus is not None and args.num_gpus < 1:
            raise PlanError(f"--num-gpus {args.num_gpus}: must be >= 1")
        gpu_name = None
        if args.gpu:
            gpu_name, gpu_gib = gpu_preset(args.gpu)
        elif args.gpu_mem is not None:
            if args.gpu_mem <= 0:
                raise PlanError(f"--gpu-mem {args.gpu_mem}: must be > 0 GiB")
            gpu_gib = float(args.gpu_mem)
        else:
            gpu_gib = detect_gpu_gib()
            gpu_name = "this GPU" if gpu_gib else None
        plan = plan_run(cfg, gpu_gib, args.num_gpus)
    except PlanError as e:
        return cli_error("plan", e)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return 0
    print(format_plan(plan, gpu_name))
    print()
    print(_sweep(cfg, gpu_gib, args.num_gpus, plan.inputs["fused_logits"]))
    if plan.gpu_gib is not None:
        x = _inputs(cfg, plan.gpu_gib, args.num_gpus)
        g = plan.max_num_generations
        at = f" (per-device batch {batch_for_generations(x, g, x.num_generations, x.batch)})" if g else ""
        print(f"largest num_generations that fits: {g}{at}; largest completion length at the config's batch: "
              f"{max_completion_length_ceiling(cfg, plan.gpu_gib, args.num_gpus)}")
    else:
        fitting = [f"{p}: {_max_generations(dataclasses.replace(_inputs(cfg, gib, args.num_gpus), gpu_gib=gib))}"
                   for p, (_, gib) in GPU_PRESETS.items()]
        print("largest num_generations per preset: " + ", ".join(fitting))
    return 0
