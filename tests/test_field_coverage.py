"""No silent knobs: every run-config field is shown to change the run, or says why it cannot.

``FIELD_TESTS`` maps each field (dotted, as ``--set`` spells it) to a test that changes the field
and sees the run change, or to ``"planner-only: ..."`` / ``"hub-only: ..."`` with the reason.
Adding a field to ``pipeline/config/schema.py`` without an entry fails ``test_every_field_is_covered``.
The seam tests below cover the fields that reach TRL, PEFT, DeepSpeed and Ray Train's objects.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.config import RunConfig, field_values, load_config

TESTS = Path(__file__).resolve().parent
SEAM = "tests/test_field_coverage.py::"

FIELD_TESTS: dict[str, str] = {
    "model.name_or_path": "tests/test_preflight.py::test_bad_input_exits_2_fast_naming_the_field_or_file",
    "model.revision": "hub-only: passed to from_pretrained (worker.load_tokenizer/load_policy); a local folder has "
                      "no revisions and no test reaches a hub",
    "model.trust_remote_code": "tests/test_secure_defaults.py::test_worker_refuses_remote_code_unless_the_config_allows_it",
    "model.gradient_checkpointing": SEAM + "test_field_reaches_grpo_config",
    "model.attn_implementation": SEAM + "test_attn_implementation_reaches_the_loaded_policy",
    "generation.vllm_sleep_mode": SEAM + "test_vllm_engine_settings_reach_grpo_config",
    **{f"lora.{k}": SEAM + "test_field_reaches_lora_config" for k in ("enabled", "r", "alpha", "dropout", "target_modules")},
    "data.source": "tests/test_data.py::test_local_parquet_folder",
    "data.path": "tests/test_data.py::test_local_jsonl_skips_and_counts_by_reason",
    "data.hub_id": "tests/test_data.py::test_synth_streaming_path_on_a_local_dataset",
    "data.split": SEAM + "test_split_reaches_the_streamed_dataset",
    **{f"data.{k}": SEAM + "test_field_changes_the_loaded_records"
       for k in ("max_samples", "eval_fraction", "min_reference_words", "system_prompt")},
    "data.language": SEAM + "test_language_filters_synth_rows",
    "data.max_prompt_length": "tests/test_knobs.py::test_prompt_ids_that_reach_generation_respect_max_prompt_length",
    "data.max_context_chars": "tests/test_data.py::test_squad_format_xquad",
    "rewards.weights": "tests/test_trl_rewards.py::test_names_order_and_weights",
    **{f"rewards.{k}": SEAM + "test_field_changes_the_eos_reward"
       for k in ("eos_bonus", "truncation_penalty", "overlong_buffer", "overlong_weight", "brevity_weight")},
    "judge.backend": "tests/test_judge.py::test_load_judge_llm_and_chat_template",
    "judge.model": "tests/test_judge.py::test_load_judge_llm_and_chat_template",
    "judge.num_actors": SEAM + "test_pool_fields_reach_the_actors",
    "judge.num_scorer_actors": SEAM + "test_pool_fields_reach_the_actors",
    "judge.max_retries": SEAM + "test_pool_fields_reach_the_actors",
    "judge.max_input_tokens": SEAM + "test_pool_fields_reach_the_actors",
    "judge.cpus_per_actor": "tests/test_knobs.py::test_placement_decides_the_judge_actors_ray_resources",
    "judge.gpus_per_actor": "tests/test_knobs.py::test_placement_decides_the_judge_actors_ray_resources",
    "judge.placement": "tests/test_knobs.py::test_placement_decides_the_judge_actors_ray_resources",
    "judge.max_batch_size": "tests/test_knobs.py::test_judge_max_batch_size_bounds_every_forward_pass",
    "judge.max_restarts": "tests/test_train_ray.py::test_judge_and_workers_killed_mid_run_every_step_scored_once",
    "grpo.dynamic_sampling.enabled": "tests/test_dynamic_sampling.py::test_constant_groups_never_reach_the_loss",
    "grpo.dynamic_sampling.min_std": "tests/test_dynamic_sampling.py::test_keep_mask_follows_min_std",
    "grpo.dynamic_sampling.max_rounds": "tests/test_dynamic_sampling.py::test_all_constant_runs_short_and_continues",
    "grpo.dynamic_sampling.oversample": "tests/test_dynamic_sampling.py::test_constant_groups_never_reach_the_loss",
    "generation.length_schedule": "tests/test_train_ray.py::test_judge_and_workers_killed_mid_run_every_step_scored_once",
    **{f"generation.adaptive.{k}": "tests/test_length_control.py::test_adaptive_cap_rises_until_the_clipped_ratio_enters_the_band"
       for k in ("band_low", "band_high", "floor", "ceiling", "start")},
    "generation.adaptive.step":
        "tests/test_length_control.py::test_adaptive_moves_toward_the_estimate_by_at_least_a_step_within_floor_and_ceiling",
    "generation.adaptive.window_completions": "tests/test_length_control.py::test_window_and_hysteresis_change_the_decisions",
    "generation.adaptive.hysteresis": "tests/test_length_control.py::test_more_hysteresis_needs_more_evidence",
    "generation.adaptive.reference_quantile": "tests/test_length_control.py::test_reference_quantile_raises_the_floor_and_the_start",
    "distributed.num_workers": SEAM + "test_field_reaches_the_ray_train_trainer",
    "distributed.use_gpu": SEAM + "test_field_reaches_the_ray_train_trainer",
    "distributed.gpus_per_worker": SEAM + "test_field_reaches_the_ray_train_trainer",
    "distributed.cpus_per_worker": SEAM + "test_field_reaches_the_ray_train_trainer",
    "distributed.max_failures": SEAM + "test_field_reaches_the_ray_train_trainer",
    "distributed.resize_check_s": SEAM + "test_field_reaches_the_ray_train_trainer",
    "distributed.placement": SEAM + "test_field_reaches_the_ray_train_trainer",
    "distributed.zero_stage": "tests/test_train_ray.py::test_two_workers_zero2_end_to_end",
    "distributed.offload_optimizer": SEAM + "test_field_reaches_the_deepspeed_config",
    "distributed.offload_params": SEAM + "test_field_reaches_the_deepspeed_config",
    "logging.samples_every": SEAM + "test_logging_fields_reach_the_callbacks",
    "logging.num_samples": SEAM + "test_logging_fields_reach_the_callbacks",
    "logging.ray_metrics": SEAM + "test_logging_fields_reach_the_callbacks",
    "logging.console": "tests/test_console.py::test_console_field_decides_whether_the_trainer_prints_step_dicts",
    "output.root": SEAM + "test_field_reaches_the_ray_train_trainer",
    "output.run_name": SEAM + "test_field_reaches_the_ray_train_trainer",
    "output.checkpoints_kept": SEAM + "test_field_reaches_the_ray_train_trainer",
    "output.storage": "tests/test_storage.py::test_killed_zero2_run_resumes_from_s3_with_empty_local_dirs",
    "eval.num_prompts": "tests/test_train_ray.py::test_two_workers_zero2_end_to_end",
    "eval.every_steps": "tests/test_train_ray.py::test_two_workers_zero2_end_to_end",
    "eval.max_new_tokens": "tests/test_eval.py::test_eval_budget_is_the_field_or_the_runs_largest_length",
    "eval.samples_per_prompt": "tests/test_eval.py::test_learning_rates_10x_apart_end_with_different_eval_scores",
    "eval.score_weights": "tests/test_tune.py::test_crashed_search_resumes_then_results_best_config_and_training_from_it",
}

# Fields that reach TRL's GRPOConfig: (--set override, GRPOConfig attribute, expected value).
GRPO_ARGS = [
    ("model.gradient_checkpointing=true", "gradient_checkpointing", True),
    ("optimization.learning_rate=3e-4", "learning_rate", 3e-4),
    ("optimization.adam_beta1=0.8", "adam_beta1", 0.8),
    ("optimization.adam_beta2=0.95", "adam_beta2", 0.95),
    ("optimization.weight_decay=0.0", "weight_decay", 0.0),
    ("optimization.lr_scheduler_type=linear", "lr_scheduler_type", "linear"),
    ("optimization.warmup_ratio=0.25", "warmup_steps", 0.25),
    ("optimization.precision=bf16", "bf16", True),
    ("optimization.max_steps=7", "max_steps", 7),
    ("optimization.per_device_train_batch_size=16", "per_device_train_batch_size", 16),
    ("optimization.gradient_accumulation_steps=2", "gradient_accumulation_steps", 2),
    ("optimization.max_grad_norm=0.5", "max_grad_norm", 0.5),
    ("optimization.fused_adamw=false", "optim", "adamw_torch"),
    ("optimization.seed=7", "seed", 7),
    ("generation.num_generations=4", "num_generations", 4),
    ("generation.temperature=0.7", "temperature", 0.7),
    ("generation.top_p=0.9", "top_p", 0.9),
    ("generation.top_k=20", "top_k", 20),
    ("generation.max_completion_length=48", "max_completion_length", 48),
    ("generation.backend=vllm", "use_vllm", True),
    ("generation.vllm_gpu_memory_utilization=0.5", "vllm_gpu_memory_utilization", 0.5),
    ("generation.steps_per_generation=2", "steps_per_generation", 2),
    ("grpo.beta=0.04", "beta", 0.04),
    ("grpo.epsilon=0.1", "epsilon", 0.1),
    ("grpo.epsilon_high=0.3", "epsilon_high", 0.3),
    ("grpo.entropy_coef=0.01", "entropy_coef", 0.01),
    ("grpo.adaptive_entropy=false", "use_adaptive_entropy", False),
    ("grpo.entropy_target=0.5", "entropy_target", 0.5),
    ("grpo.entropy_coef_max=0.05", "entropy_coef_max", 0.05),
    ("grpo.entropy_coef_delta=0.001", "entropy_coef_delta", 0.001),
    ("grpo.loss_type=grpo", "loss_type", "grpo"),
    ("grpo.mask_truncated_completions=true", "mask_truncated_completions", True),
    ("grpo.scale_rewards=batch", "scale_rewards", "batch"),
    ("grpo.num_iterations=2", "num_iterations", 2),
    ("logging.logging_steps=5", "logging_steps", 5),
    ("logging.report_to=[tensorboard]", "report_to", ["tensorboard"]),
    ("logging.progress_bar=false", "disable_tqdm", True),
    ("output.save_steps=7", "save_steps", 7),
    ("output.checkpoints_kept=5", "save_total_limit", 5),
]
for _override, _attr, _ in GRPO_ARGS:
    FIELD_TESTS.setdefault(_override.split("=")[0], SEAM + "test_field_reaches_grpo_config")


def _test_exists(ref: str) -> bool:
    path, _, name = ref.partition("::")
    file = TESTS.parent / path
    return file.is_file() and re.search(rf"^(async )?def {re.escape(name)}\(", file.read_text(encoding="utf-8"), re.M) is not None


def test_every_field_is_covered():
    fields = set(field_values(RunConfig()))
    missing = sorted(fields - set(FIELD_TESTS))
    stale = sorted(set(FIELD_TESTS) - fields)
    assert not missing, f"config fields with no test showing they change the run (add one to FIELD_TESTS): {missing}"
    assert not stale, f"FIELD_TESTS names fields the config no longer has: {stale}"
    for name, ref in FIELD_TESTS.items():
        if ref.startswith(("planner-only:", "hub-only:", "docs-only:")):
            assert len(ref.split(":", 1)[1].strip()) > 20, f"{name}: say why it cannot change a test run"
            continue
        assert _test_exists(ref), f"{name}: {ref} does not exist"


def _grpo_args(*overrides: str):
    from pipeline.training.worker import build_grpo_config

    cfg = load_config(None, list(overrides))
    return build_grpo_config(cfg, Path("/tmp/unused"), on_gpu=False, is_rank0=True, reward_weights=[1.0, 0, 0, 0])


@pytest.mark.parametrize("override,attr,expected", GRPO_ARGS, ids=[o for o, _, _ in GRPO_ARGS])
def test_field_reaches_grpo_config(override, attr, expected):
    base, changed = getattr(_grpo_args(), attr), getattr(_grpo_args(override), attr)
    value = getattr(changed, "value", changed)  # enums (lr_scheduler_type, optim)
    assert value == expected and changed != base, (base, changed)


def test_vllm_engine_settings_reach_grpo_config():
    """Sleep mode reaches TRL on a GPU only (the CPU build has none); the engine's context is the longest
    prompt plus the most the run generates, training cap or evaluation budget."""
    from pipeline.training.worker import build_grpo_config

    def args(on_gpu: bool, *overrides: str):
        cfg = load_config(None, ["generation.backend=vllm", "optimization.precision=fp32", *overrides])
        return build_grpo_config(cfg, Path("/tmp/unused"), on_gpu=on_gpu, is_rank0=True, reward_weights=[1.0, 0, 0, 0])

    assert args(True, "generation.vllm_sleep_mode=true").vllm_enable_sleep_mode is True
    assert args(True).vllm_enable_sleep_mode is False and args(False, "generation.vllm_sleep_mode=true").vllm_enable_sleep_mode is False
    assert args(False, "generation.max_completion_length=48", "data.max_prompt_length=100").vllm_max_model_length == 148
    assert args(False, "generation.max_completion_length=48", "generation.length_schedule=[[5, 64]]",
                "data.max_prompt_length=100").vllm_max_model_length == 164
    assert args(False, "generation.max_completion_length=48", "eval.max_new_tokens=80",
                "data.max_prompt_length=100").vllm_max_model_length == 180
    adaptive = args(False, "generation.max_completion_length=adaptive", "generation.adaptive.start=10", "generation.adaptive.floor=8",
                    "generation.adaptive.ceiling=null", "data.max_prompt_length=100")
    assert adaptive.vllm_max_model_length == 140  # no ceiling set and no planner on CPU: 4x the start


@pytest.mark.parametrize("override,attr,expected", [
    ("lora.r=4", "r", 4), ("lora.alpha=32", "lora_alpha", 32), ("lora.dropout=0.05", "lora_dropout", 0.05),
    ("lora.target_modules=[q_proj, v_proj]", "target_modules", {"q_proj", "v_proj"}),
])
def test_field_reaches_lora_config(override, attr, expected):
    from pipeline.training.worker import lora_config

    base, changed = lora_config(load_config(None)), lora_config(load_config(None, [override]))
    assert getattr(changed, attr) == expected != getattr(base, attr)
    assert lora_config(load_config(None, ["lora.enabled=false"])) is None


@pytest.mark.parametrize("override,check", [
    ("distributed.zero_stage=2", lambda ds: ds["zero_optimization"]["stage"] == 2),
    ("distributed.offload_optimizer=true", lambda ds: ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"),
    ("distributed.offload_params=true", lambda ds: ds["zero_optimization"]["offload_param"]["device"] == "cpu"),
])
def test_field_reaches_the_deepspeed_config(override, check):
    from pipeline.training.worker import deepspeed_config

    stage = "distributed.zero_stage=3" if "offload_params" in override else "distributed.zero_stage=2"
    assert deepspeed_config(load_config(None)) is None  # stage 0: plain DDP
    assert check(deepspeed_config(load_config(None, [stage, override])))


def test_field_reaches_the_ray_train_trainer(tmp_path):
    from pipeline.training.driver import build_trainer, default_run_dir

    cfg = load_config(None, [
        "distributed.num_workers=2", "distributed.use_gpu=true", "distributed.gpus_per_worker=0.5",
        "distributed.cpus_per_worker=0.75", "distributed.max_failures=5", "distributed.resize_check_s=5",
        "distributed.placement=spread", "output.checkpoints_kept=4",
        f"output.root={tmp_path}", "output.run_name=seam",
    ])
    run_dir = default_run_dir(cfg)
    assert run_dir == tmp_path / "seam"
    trainer = build_trainer(cfg, run_dir, pool=None)
    sc, rc = trainer.scaling_config, trainer.run_config
    assert (sc.num_workers, sc.use_gpu) == (2, True)
    assert sc.resources_per_worker == {"CPU": 0.75, "GPU": 0.5}
    assert sc.elastic_resize_monitor_interval_s == 5
    assert sc.placement_strategy == "SPREAD"
    assert build_trainer(load_config(None), run_dir, pool=None).scaling_config.placement_strategy == "PACK"  # Ray's default
    assert rc.failure_config.max_failures == 5 and rc.checkpoint_config.num_to_keep == 4
    assert Path(rc.storage_path) == run_dir.resolve()


def test_field_changes_the_loaded_records():
    from pipeline.data.sources import load_records, to_trl_rows

    def load(*overrides):
        return load_records(load_config(None, list(overrides)).data, log=None)

    train, held, rep = load()
    assert len(load("data.max_samples=50")[0]) + len(load("data.max_samples=50")[1]) == 50
    assert len(load("data.eval_fraction=0.5")[1]) > 2 * len(held)
    assert len(load("data.min_reference_words=10")[0]) < len(train)
    cfg = load_config(None, ["data.system_prompt=Antworte kurz."])
    assert to_trl_rows(train[:1], cfg.data.system_prompt)[0]["prompt"][0]["content"] == "Antworte kurz."


def test_language_filters_synth_rows(tmp_path):
    import json

    from pipeline.data.sources import load_records

    rows = [{"query": f"F{i}?", "synthetic_answer": "A.", "language": "de" if i % 2 else "en", "synth_id": str(i)}
            for i in range(20)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    de = load_records(load_config(None, ["data.source=local", f"data.path={path}"]).data, log=None)[2]
    en = load_records(load_config(None, ["data.source=local", f"data.path={path}", "data.language=en"]).data, log=None)[2]
    assert de.used == en.used == 10 and de.skipped["wrong_language"] == 10


def test_split_reaches_the_streamed_dataset(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.sources import load_records

    rows = [{"query": f"Frage {i}?", "synthetic_answer": "Antwort.", "language": "de", "synth_id": str(i)} for i in range(12)]
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / "train-00000.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:4]), tmp_path / "data" / "test-00000.parquet")
    train = load_records(load_config(None, ["data.source=synth", f"data.hub_id={tmp_path}"]).data, log=None)[2]
    test = load_records(load_config(None, ["data.source=synth", f"data.hub_id={tmp_path}", "data.split=test"]).data, log=None)[2]
    assert (train.used, test.used) == (12, 4)


@pytest.mark.parametrize("override", ["rewards.eos_bonus=0.5", "rewards.truncation_penalty=0.5",
                                      "rewards.overlong_buffer=2", "rewards.overlong_weight=0.5",
                                      "rewards.brevity_weight=0.5"])
def test_field_changes_the_eos_reward(override):
    from pipeline.scoring.clients import eos_kwargs
    from rewards.eos import eos_component_batch

    # An ended completion near the cap and one cut at it: every eos field moves one of the two scores.
    ids = [[5] * 7 + [2], [5] * 10]
    base = eos_component_batch(ids, [2], 10, **eos_kwargs(load_config(None)))
    changed = eos_component_batch(ids, [2], 10, **eos_kwargs(load_config(None, [override])))
    assert changed != base, (override, base, changed)


def test_pool_fields_reach_the_actors(ray_local):
    from pipeline.scoring.pool import start_pool, stop_pool

    cfg = load_config(None, ["judge.num_actors=2", "judge.num_scorer_actors=2", "judge.max_retries=1",
                             "judge.max_input_tokens=24", "judge.cpus_per_actor=0.25"])
    pool = start_pool(cfg)
    try:
        assert (len(pool.judges), len(pool.scorers), pool.max_retries) == (2, 2, 1)
        limits = ray_local.get([a.max_input_tokens.remote() for a in pool.judges])
        assert limits == [24, 24]
    finally:
        stop_pool(pool)


def test_logging_fields_reach_the_callbacks(tmp_path, ray_local):
    from types import SimpleNamespace

    from pipeline.training.callbacks import MetricsSink, SamplesWriter

    writer = SamplesWriter(tmp_path, every=3, num_samples=2)
    assert (writer.every, writer.num) == (3, 2)
    state = SimpleNamespace(is_world_process_zero=True, global_step=1)
    off, on = MetricsSink(tmp_path / "off", "r", ray_metrics=False), MetricsSink(tmp_path / "on", "r", ray_metrics=True)
    for sink in (off, on):
        sink.path.parent.mkdir()
        sink.on_log(None, state, None, logs={"reward": 0.5})
    assert not off._gauges and "reward" in on._gauges  # the Ray dashboard gauge exists only when asked for


def test_attn_implementation_reaches_the_loaded_policy(tiny_policy):
    from pipeline.training.worker import load_policy

    _, model, _ = load_policy(load_config(None, ["model.attn_implementation=eager"]), on_gpu=False)
    assert model.config._attn_implementation == "eager"
    _, model, _ = load_policy(load_config(None, ["model.attn_implementation=sdpa"]), on_gpu=False)
    assert model.config._attn_implementation == "sdpa"
