"""Memory planner: hand-computed numbers, exact counts against real (tiny) tensors, and the CLI contract."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.plan import memory as M
from pipeline.cli.main import main as cli_main
from pipeline.config import load_config

REPO = Path(__file__).resolve().parents[1]
SAUERKRAUT = REPO / "configs" / "sauerkraut-8b.yaml"


def cfg8b(*overrides: str):
    return load_config(SAUERKRAUT, list(overrides))


def gib_bytes(plan: M.MemoryPlan, name: str) -> int:
    return round(plan.components[name] * M.GIB)


# ---------------------------------------------------------------- hand-computed shapes


def test_llama31_8b_parameter_count_and_bf16_size():
    shape = M.resolve_shape("VAGOsolutions/Llama-3.1-SauerkrautLM-8b-Instruct")
    # per layer: q 4096^2 + k,v 2*4096*1024 + o 4096^2 + gate,up,down 3*4096*14336 + 2 norms = 218,112,000
    # 32 layers + embed and untied lm_head 2*128256*4096 + final norm 4096
    assert shape.param_count() == 32 * 218_112_000 + 2 * 128_256 * 4096 + 4096 == 8_030_261_248
    plan = M.plan_run(cfg8b(), gpu_gib=80)
    assert plan.components["base_weights"] == pytest.approx(14.96, abs=0.005)


def test_lora_r32_all_linear_llama31_8b():
    shape = M.resolve_shape("meta-llama/Llama-3.1-8B-Instruct")
    # r*(in+out): q 32*8192, k 32*5120, v 32*5120, o 32*8192, gate/up/down 3 * 32*(4096+14336)
    per_layer = 32 * 8192 * 2 + 32 * 5120 * 2 + 3 * 32 * 18432
    assert per_layer == 2_621_440
    assert M.lora_param_count(shape, 32, "all-linear") == 32 * per_layer == 83_886_080
    assert M.lora_param_count(shape, 32, ["q_proj", "v_proj"]) == 32 * (32 * 8192 + 32 * 5120)


def test_other_builtin_shapes_match_published_counts():
    assert M.resolve_shape("Qwen/Qwen2.5-7B-Instruct").param_count() == 7_615_616_512  # qkv bias included
    assert M.resolve_shape("mistralai/Mistral-7B-v0.1").param_count() == 7_241_732_096
    assert M.builtin_shape("someone/unrelated-model") is None


# ---------------------------------------------------------------- exact against real tensors


def _tiny_config(kind: str, **kw):
    from transformers import LlamaConfig, Qwen2Config

    base = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    return (LlamaConfig if kind == "llama" else Qwen2Config)(**{**base, **kw})


def _write_config(tmp_path: Path, config) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    return tmp_path


@pytest.mark.parametrize("kind,kw,targets", [
    ("llama", {}, "all-linear"),
    ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}, ["q_proj", "v_proj", "down_proj"]),
    ("qwen2", {"tie_word_embeddings": False}, "all-linear"),
])
def test_param_and_lora_counts_equal_numel_of_real_models(tmp_path, kind, kw, targets):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _tiny_config(kind, **kw)
    model = AutoModelForCausalLM.from_config(config)
    shape = M.resolve_shape(str(_write_config(tmp_path, config)))
    assert shape.param_count() == sum(p.numel() for p in model.parameters())  # counted on the empty model
    # the formula the built-in shapes use is exact too
    assert M.ModelShape.from_hf_config(config.to_dict(), "test").param_count() == shape.param_count()
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert M.lora_param_count(shape, 4, targets) == trainable


def _tiny_cfg(tmp_path: Path, *overrides: str, **config_kw):
    path = _write_config(tmp_path, _tiny_config("llama", **config_kw))
    return load_config(REPO / "configs" / "tiny.yaml", [f"model.name_or_path={path}", "lora.r=4", "lora.dropout=0.0",
                                                        "optimization.precision=fp32", *overrides])


def test_gradient_and_adamw_bytes_equal_real_tensors(tmp_path):
    """Stage 0 LoRA in fp32: 4 B weights, 4 B grads, 8 B AdamW (exp_avg + exp_avg_sq) per trainable param."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    cfg = _tiny_cfg(tmp_path)
    plan = M.plan_run(cfg, gpu_gib=24, fused_logits=True)
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(_tiny_config("llama")), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    model(input_ids=torch.randint(0, 300, (2, 16)), labels=torch.randint(0, 300, (2, 16))).loss.backward()
    opt.step()
    assert gib_bytes(plan, "lora_weights") == sum(p.numel() * p.element_size() for p in params)
    assert gib_bytes(plan, "gradients") == sum(p.grad.numel() * p.grad.element_size() for p in params)
    moments = sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items() if k != "step")
    assert gib_bytes(plan, "optimizer_states") == moments


def test_kv_cache_equals_dynamic_cache_bytes(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    cfg = _tiny_cfg(tmp_path, "optimization.per_device_train_batch_size=4", "optimization.gradient_accumulation_steps=1",
                    "generation.num_generations=2", "data.max_prompt_length=20", "generation.max_completion_length=12")
    plan = M.plan_run(cfg, gpu_gib=24)
    model = LlamaForCausalLM(_tiny_config("llama")).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 300, (4, 32)), use_cache=True).past_key_values
    measured = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert gib_bytes(plan, "generation_kv_cache") == measured == 2 * 2 * 32 * 4 * 32 * 4  # 2*L*kv_dim*bytes*tokens


@pytest.mark.parametrize("attn,lora,dropout,dtype", [
    ("sdpa", "all-linear", 0.1, "bfloat16"),
    ("sdpa", ["q_proj", "v_proj"], 0.1, "float32"),
    ("eager", "all-linear", 0.0, "float32"),
    ("eager", "all-linear", 0.1, "bfloat16"),
    ("sdpa", None, 0.0, "float32"),
])
def test_layer_activations_equal_saved_tensors_on_cpu(attn, lora, dropout, dtype):
    """Bytes autograd saves per token per decoder layer (difference of a 3- and a 2-layer model), counted
    with saved_tensors_hooks, equal the planner's per-layer formula. CPU dropout keeps a float mask
    (mask_bytes = element size) where CUDA keeps a bool one; GPU kernels remain to be measured."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    tdtype = getattr(torch, dtype)
    b, seq = 2, 24

    def saved_bytes(layers: int) -> int:
        torch.manual_seed(0)
        model = LlamaForCausalLM(_tiny_config("llama", num_hidden_layers=layers, attn_implementation=attn)).to(tdtype)
        if lora is not None:
            model = get_peft_model(model, LoraConfig(r=4, lora_dropout=dropout, target_modules=lora), autocast_adapter_dtype=False)
            model.enable_input_require_grads()  # as TRL/PEFT do with gradient checkpointing: every layer alike
        model.train()
        mask = torch.ones(b, seq, dtype=torch.long)
        mask[0, :5] = 0  # left padding, as in GRPO batches
        params = {p.data_ptr() for p in model.parameters()}
        kept: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                kept[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.get_decoder()(input_ids=torch.randint(0, 300, (b, seq)), attention_mask=mask)
        return sum(kept.values())

    measured = (saved_bytes(3) - saved_bytes(2)) / (b * seq)
    shape = M.ModelShape.from_hf_config(_tiny_config("llama").to_dict(), "test")
    a = torch.tensor([], dtype=tdtype).element_size()
    x = M.PlanInputs(shape=shape, judge=(0, None), judge_batch=(1, 1), num_gpus=1, zero_stage=0, offload_optimizer=False,
                  offload_params=False, wbytes=a, lora=lora is not None, lora_r=4, lora_targets=lora or "all-linear",
                  lora_dropout=dropout, grad_ckpt=False, batch=b, steps_per_generation=1, num_generations=2,
                  prompt_len=seq, completion_len=0, beta=0.0, vllm_util=None, attn=attn, fused_logits=True, gpu_gib=None)
    assert M.layer_activation_bytes(x, seq, mask_bytes=a) == measured


# ---------------------------------------------------------------- behaviour


def test_memory_grows_with_num_generations_when_prompts_per_round_are_kept():
    # HF generate: its KV cache grows with the batch (vLLM's share is a fixed fraction of the GPU)
    totals = [M.plan_run(cfg8b("generation.backend=hf", f"generation.num_generations={g}",
                               f"optimization.per_device_train_batch_size={g}"), 80).total_gib
              for g in (4, 8, 16, 32)]
    assert totals == sorted(totals) and len(set(totals)) == 4
    # at a fixed per-device batch only the number of distinct prompts changes: same memory
    fixed = {round(M.plan_run(cfg8b(f"generation.num_generations={g}"), 80).total_gib, 6) for g in (2, 4, 8, 16)}
    assert len(fixed) == 1


def test_zero3_divides_per_gpu_weights_by_k_and_zero2_does_not():
    one = M.plan_run(cfg8b("distributed.zero_stage=3"), 80, num_gpus=1)
    four = M.plan_run(cfg8b("distributed.zero_stage=3"), 80, num_gpus=4)
    for name in ("base_weights", "lora_weights", "gradients", "optimizer_states"):
        assert four.components[name] == pytest.approx(one.components[name] / 4, rel=1e-6), name
    z2 = M.plan_run(cfg8b("distributed.zero_stage=2"), 80, num_gpus=4)
    assert z2.components["base_weights"] == one.components["base_weights"]
    assert z2.components["gradients"] == pytest.approx(one.components["gradients"] / 4, rel=1e-6)
    # ZeRO-3 gathers the full weights for generate(): the generation phase pays them back
    assert four.components["generation_transient"] > z2.components["generation_transient"]


def test_gradient_checkpointing_and_fused_logits_shrink_the_training_phase():
    on = M.plan_run(cfg8b(), 80)
    off = M.plan_run(cfg8b("model.gradient_checkpointing=false"), 80)
    assert off.components["activations"] > 5 * on.components["activations"]
    full = M.plan_run(cfg8b("generation.max_completion_length=256", "optimization.per_device_train_batch_size=8"), 80,
                      fused_logits=False)
    # older TRL: 8 seqs x 256 completion tokens x 128256 vocab x 4 B x 2 (logits + log_softmax) = 1.957 GiB
    assert gib_bytes(full, "logits") == 8 * 256 * 128_256 * 4 * 2
    fused = M.plan_run(cfg8b("generation.max_completion_length=256"), 80, fused_logits=True)
    assert fused.components["logits"] < full.components["logits"] / 4


def test_reference_model_is_a_copy_only_without_lora():
    assert M.plan_run(cfg8b("grpo.beta=0.04"), 80).components["reference_model"] == 0
    full = M.plan_run(cfg8b("grpo.beta=0.04", "lora.enabled=false"), 80)
    assert gib_bytes(full, "reference_model") == 8_030_261_248 * 2


def test_fits_flips_at_the_gpu_size():
    hf = cfg8b("generation.backend=hf")  # vLLM's share scales with the GPU: no single edge
    total = M.plan_run(hf, 80).total_gib
    edge = total / (1 - M.HEADROOM)
    assert M.plan_run(hf, edge + 0.01).fits is True
    assert M.plan_run(hf, edge - 0.01).fits is False
    assert M.plan_run(cfg8b(), 8.0).max_num_generations == 0  # weights alone exceed 8 GiB


def test_max_num_generations_is_the_largest_that_fits():
    plan = M.plan_run(cfg8b(), 48)
    g = plan.max_num_generations
    assert g and g >= 2
    x = M.plan_inputs(cfg8b(), 48, None)
    scaled = lambda n: dataclasses.replace(x, num_generations=n, batch=M.batch_for_generations(x, n, x.num_generations, x.batch))
    assert M.fits_gpu(scaled(g))
    assert not any(M.fits_gpu(scaled(n)) for n in range(g + 1, g + 40))
    assert (M.batch_for_generations(x, g, 8, 8) * x.num_gpus * x.steps_per_generation) % g == 0  # TRL's rule


def test_same_gpu_judge_and_vllm_are_counted():
    own = M.plan_run(cfg8b(), 80)
    same = M.plan_run(cfg8b("judge.placement=same_gpu", "judge.gpus_per_actor=0.5"), 80)  # Qwen2.5-7B judge beside the policy
    assert same.components["judge"] > 14 and same.total_gib > own.total_gib + 14
    vllm = M.plan_run(cfg8b("generation.vllm_gpu_memory_utilization=0.3", "generation.vllm_sleep_mode=false"), 80)
    assert vllm.components["vllm_reservation"] == pytest.approx(24.0) and vllm.components["generation_kv_cache"] == 0


def test_vllm_share_is_weights_then_kv_cache_and_sleep_mode_frees_it_for_training():
    """vLLM's gpu_memory_utilization covers its own (unsharded) weights, its KV cache gets the rest; with
    sleep mode the share is held only in the generation phase, so the peak is the larger phase, not both."""
    awake = M.plan_run(cfg8b("generation.vllm_sleep_mode=false"), 80)
    asleep = M.plan_run(cfg8b(), 80)  # the shipped 8B config: vLLM with sleep mode
    share = 0.3 * 80
    assert awake.components["vllm_reservation"] == pytest.approx(share) and awake.components["vllm_awake"] == 0
    assert asleep.components["vllm_awake"] == pytest.approx(share) and asleep.components["vllm_reservation"] == 0
    # awake: share + training phase on top of the rest; asleep: the larger of the two (here the share)
    assert asleep.peak_phase == "generation" and awake.peak_phase == "training"
    training = awake.components["activations"] + awake.components["logits"]
    overheads = awake.components["framework_overhead"] - asleep.components["framework_overhead"]
    assert asleep.total_gib == pytest.approx(awake.total_gib - training - overheads, abs=1e-6)
    x = M.plan_inputs(cfg8b(), 80, None)
    seq_bytes = (x.prompt_len + x.completion_len) * 2 * x.shape.num_layers * x.shape.kv_dim * x.wbytes
    kv_seqs = int((share - awake.components["base_weights"]) * M.GIB) // seq_bytes
    assert f"{kv_seqs} of the rollout's" in awake.details["vllm_reservation"], awake.details


def test_vllm_share_that_cannot_work_is_named():
    too_small = M.plan_run(cfg8b("generation.vllm_gpu_memory_utilization=0.15"), 80)  # 12 GiB < 15 GiB of weights
    assert any("vLLM cannot start" in n and "vllm_gpu_memory_utilization 0.15" in n for n in too_small.notes), too_small.notes
    tight = M.plan_run(cfg8b("generation.vllm_gpu_memory_utilization=0.2"), 80)  # room for fewer seqs than a rollout
    assert any("sequences at once" in n for n in tight.notes), tight.notes
    both = M.plan_run(cfg8b("generation.vllm_gpu_memory_utilization=0.7", "generation.vllm_sleep_mode=false"), 80)
    assert not both.fits and any("do not both fit" in n and "vllm_sleep_mode: true" in n for n in both.notes), both.notes
    assert not any("do not both fit" in n for n in M.plan_run(cfg8b("generation.vllm_gpu_memory_utilization=0.5"), 80).notes)


def test_completion_length_ceiling_is_the_largest_that_fits():
    cfg = cfg8b()
    c = M.max_completion_length_ceiling(cfg, 48)
    assert c > 0
    x = M.plan_inputs(cfg, 48, None)
    assert M.fits_gpu(dataclasses.replace(x, completion_len=c)) and not M.fits_gpu(dataclasses.replace(x, completion_len=c + 1))
    assert M.max_completion_length_ceiling(cfg, 10) == 0


def test_warn_if_not_fits(monkeypatch):
    monkeypatch.setattr(M, "detect_gpu_gib", lambda: None)
    assert M.warn_if_not_fits(cfg8b()) is None  # CPU: nothing to say
    monkeypatch.setattr(M, "detect_gpu_gib", lambda: 20.0)
    assert "20.0 GiB" in M.warn_if_not_fits(cfg8b())
    monkeypatch.setattr(M, "detect_gpu_gib", lambda: 140.0)
    assert M.warn_if_not_fits(cfg8b()) is None


@pytest.mark.parametrize("name,preset", [("a100-80", "A100-80"), ("A100 80GB", "A100-80"), ("h100", "H100"),
                                         ("NVIDIA H100 80GB HBM3", "H100"), ("l40s", "L40S"), ("RTX 6000 Ada", "RTX6000-Ada"),
                                         ("A10G", "A10"), ("a100-40gb", "A100-40"), ("H200", "H200")])
def test_gpu_names_are_forgiving(name, preset):
    assert M.gpu_preset(name)[0] == preset


def test_tiny_policy_shape_comes_from_pipeline_tiny():
    plan = M.plan_run(load_config(REPO / "configs" / "tiny.yaml"), 24)
    assert plan.fits and plan.inputs["shape_source"].startswith(("pipeline.data.tiny_models", "/"))


def test_tiny_policy_count_is_exact(tiny_policy):
    """A local folder (and 'tiny', built) is counted on the empty model: the loaded model's numel, no formula."""
    from transformers import AutoModelForCausalLM

    loaded = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_policy).parameters())
    assert M.resolve_shape(str(tiny_policy)).param_count() == loaded
    assert M.resolve_shape("tiny").param_count() == loaded


# ---------------------------------------------------------------- CLI


def test_cli_json_schema():
    out = subprocess.run([sys.executable, "-m", "pipeline", "plan", "--config", str(SAUERKRAUT), "--gpu", "A10", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"total_gib", "gpu_gib", "fits", "max_num_generations", "components"} <= set(data)
    assert data["gpu_gib"] == M.GPU_PRESETS["A10"][1] and isinstance(data["fits"], bool)
    assert isinstance(data["max_num_generations"], int)
    assert set(data["components"]) == set(M.COMPONENT_ORDER) and all(isinstance(v, float) for v in data["components"].values())
    off_peak = {"generation": ("activations", "logits"),
                "training": ("generation_kv_cache", "generation_transient", "vllm_awake")}[data["peak_phase"]]
    counted = sum(v for k, v in data["components"].items() if k not in off_peak)
    assert counted == pytest.approx(data["total_gib"], abs=0.01)


def test_cli_unknown_gpu_exits_2(capsys):
    assert cli_main(["plan", "--config", str(SAUERKRAUT), "--gpu", "V100-ish"]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU" in err and "A100-80" in err and "H200" in err


def test_cli_unknown_model_exits_2_without_network(monkeypatch, capsys):
    import huggingface_hub

    def offline(*a, **k):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    rc = cli_main(["plan", "--config", str(SAUERKRAUT), "--set", "model.name_or_path=nobody/no-such-model", "--gpu", "h100"])
    assert rc == 2 and "shape not found" in capsys.readouterr().err


def test_cli_table_mentions_every_component(capsys):
    assert cli_main(["plan", "--config", str(SAUERKRAUT), "--gpu", "A100-80"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in M.COMPONENT_ORDER) and "largest num_generations that fits" in out
