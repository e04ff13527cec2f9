"""Model shapes for the memory planner: what the formulas need of a decoder, read from a config.json
(local, Hugging Face cache or hub), a built-in shape matched by id, or the project's tiny policy; and
LoRA's parameter count on such a shape."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pipeline.data.tiny_models as tiny
from pipeline.config import TINY_POLICY


class PlanError(ValueError):
    """Bad planner input (unknown GPU, model shape not found); the CLI prints it and exits 2."""


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
MINILM_PARAMS = 22_713_216


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
    total = shape.num_layers * sum(r * (lin[n][0] + lin[n][1]) for n in targeted_linears(targets, shape))
    if isinstance(targets, list) and any(t in ("lm_head", "embed_tokens") for t in targets):
        total += r * (shape.hidden_size + shape.vocab_size) * sum(t in ("lm_head", "embed_tokens") for t in targets)
    return total


def targeted_linears(targets: str | list[str], shape: ModelShape) -> list[str]:
    """The linears of one decoder layer that LoRA targets (PEFT's "all-linear": every one)."""
    return list(shape.linears()) if targets == "all-linear" else [t for t in targets if t in shape.linears()]
