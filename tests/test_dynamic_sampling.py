"""Dynamic sampling (pipeline/training/dynamic_sampling.py) on TRL's real GRPOTrainer with the tiny policy.

The rigged reward makes known prompts' groups constant; what the loss sees is recorded by wrapping
``_compute_loss`` (the recording calls through to TRL's own loss).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, config_from_dict

REPO = Path(__file__).resolve().parents[1]
G = 4


def cfg_dict(tmp_path: Path, **ds) -> dict:
    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    data["generation"].update(num_generations=G, max_completion_length=8)
    data["optimization"].update(max_steps=3, per_device_train_batch_size=8)
    data["logging"] = {"progress_bar": False, "logging_steps": 1}
    data["output"] = {"root": str(tmp_path), "save_steps": 1000}
    data["grpo"]["dynamic_sampling"] = {"enabled": True, **ds}
    return data


@pytest.mark.parametrize("field, value", [("min_std", -0.1), ("max_rounds", -1), ("oversample", 0.5)])
def test_bad_values_name_the_field(tmp_path, field, value):
    data = cfg_dict(tmp_path, **{field: value})
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert any(p.startswith(f"grpo.dynamic_sampling.{field}: {value}") for p in e.value.problems)


def test_keep_mask_follows_min_std():
    import torch

    from pipeline.training.dynamic_sampling import keep_mask

    total = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.1, 0.1, 0.1, 0.105, 0.0, 0.2, 0.4, 0.6, 0.3, float("nan"), float("nan"), float("nan")])
    assert keep_mask(total, 4, 0.01).tolist() == [False, False, True, False]  # constant, std 0.0025, spread, unscorable
    assert keep_mask(total, 4, 0.0).tolist() == [True, True, True, False]
    assert keep_mask(total, 4, 0.5).tolist() == [False, False, False, False]


def test_enabled_picks_the_subclass(tmp_path, tiny_policy):
    from trl import GRPOTrainer

    from pipeline.data.sources import load_records
    from pipeline.training.dynamic_sampling import DynamicSamplingGRPOTrainer
    from pipeline.training.worker import build_grpo_trainer, load_policy

    def reward(prompts, **kwargs):
        return [0.0] * len(prompts)

    kinds = []
    for enabled in (False, True):
        data = cfg_dict(tmp_path)
        data["grpo"]["dynamic_sampling"]["enabled"] = enabled
        cfg = config_from_dict(data)
        recs = load_records(cfg.data, log=None)[0][:16]
        tok, model, _ = load_policy(cfg, on_gpu=False)
        trainer = build_grpo_trainer(cfg, tmp_path / str(enabled), tok, model, recs, [reward], [1.0], [])
        kinds.append(type(trainer))
    assert kinds == [GRPOTrainer, DynamicSamplingGRPOTrainer]


def build(tmp_path, tiny_policy, data: dict, reward):
    """A real GRPOTrainer (the project's construction) on 40 train prompts, plus a record of the loss inputs."""
    from pipeline.data.sources import load_records, to_prompt
    from pipeline.training.dynamic_sampling import DynamicSamplingGRPOTrainer
    from pipeline.training.worker import build_grpo_trainer, load_policy

    cfg = config_from_dict(data)
    recs, _, _ = load_records(cfg.data)
    unique: dict[str, dict] = {}
    for r in recs:  # prompts told apart by their text
        unique.setdefault(to_prompt(r, cfg.data.system_prompt)[-1]["content"], r)
    recs = list(unique.values())[:40]
    tok, model, _ = load_policy(cfg, on_gpu=False)
    trainer = build_grpo_trainer(cfg, tmp_path / "run", tok, model, recs, [reward], [1.0], [])
    assert isinstance(trainer, DynamicSamplingGRPOTrainer)
    loss_inputs: list[dict] = []
    compute = trainer._compute_loss

    def record(model, inputs):
        loss_inputs.append({k: inputs[k].detach().clone() for k in ("prompt_ids", "prompt_mask", "completion_mask")})
        return compute(model, inputs)

    trainer._compute_loss = record
    contents = {r["id"]: to_prompt(r, cfg.data.system_prompt)[-1]["content"] for r in recs}
    return trainer, tok, recs, loss_inputs, contents


def prompt_ids_of(tok, batch: dict, contents: dict) -> list[str | None]:
    """The record id of each row's prompt, or None for a padding row (no completion token)."""
    ids = []
    for p, pm, cm in zip(batch["prompt_ids"], batch["prompt_mask"], batch["completion_mask"]):
        if cm.sum() == 0:
            ids.append(None)
            continue
        text = tok.decode(p[pm.bool()])
        match = [i for i, c in contents.items() if c in text]
        assert len(match) == 1, text
        ids.append(match[0])
    return ids


def test_constant_groups_never_reach_the_loss(tmp_path, tiny_policy):
    const: set[str] = set()

    def rigged(prompts, completions, id, **kwargs):  # constant for `const` prompts, 0.0/0.1/0.2/0.3 otherwise
        return [0.5 if i in const else 0.1 * (n % G) for n, i in enumerate(id)]

    trainer, tok, recs, loss_inputs, contents = build(tmp_path, tiny_policy, cfg_dict(tmp_path, max_rounds=8), rigged)
    const.update(r["id"] for k, r in enumerate(recs) if k % 5 < 3)  # 60% of the prompts give constant groups
    trainer.train()

    assert trainer.state.global_step == 3
    assert len(loss_inputs) == 3  # one micro-batch per optimizer step
    trace = trainer.dynamic_sampling_trace
    assert len(trace) == 3
    assert any(set(t["batch"]) & const for t in trace)  # the rig did hit the original batches
    for batch, t in zip(loss_inputs, trace):
        trained = prompt_ids_of(tok, batch, contents)
        assert len(trained) == 8 and None not in trained  # the batch is full: same size as without
        assert not set(trained) & const  # no constant group reached the loss
        refills = {k for keys in t["refills"] for k in keys}
        assert not refills & set(t["batch"])  # refill prompts are new to the step
        assert set(trained) <= (set(t["batch"]) | refills)
        assert [trained.count(i) for i in set(trained)] == [G] * len(set(trained))  # whole groups
    assert any(t["rounds"] > 0 for t in trace)
    for t in trace:  # round 1 asks for oversample (1.5) x the groups dropped from the batch
        dropped = len(set(t["batch"]) & const)
        assert len(t["refills"][0]) == math.ceil(1.5 * dropped) if dropped else t["refills"] == []
    logs = [h for h in trainer.state.log_history if "dynamic_sampling/rounds" in h]
    assert len(logs) == 3
    assert sum(h["dynamic_sampling/dropped_groups"] for h in logs) >= 1
    assert all(h["dynamic_sampling/short_step"] == 0 and 0 < h["dynamic_sampling/frac_kept"] <= 1 for h in logs)
    assert all(h["dynamic_sampling/extra_generation_seconds"] >= 0 for h in logs)


def test_all_constant_runs_short_and_continues(tmp_path, tiny_policy):
    def constant(prompts, completions, **kwargs):
        return [0.5] * len(prompts)

    data = cfg_dict(tmp_path, max_rounds=1)
    data["optimization"]["max_steps"] = 2
    trainer, _, _, loss_inputs, _ = build(tmp_path, tiny_policy, data, constant)
    trainer.train()

    assert trainer.state.global_step == 2  # the run went on
    assert len(loss_inputs) == 2 and all(int(b["completion_mask"].sum()) == 0 for b in loss_inputs)
    assert all(b["completion_mask"].shape[0] == 8 for b in loss_inputs)  # padded, not shrunk
    logs = [h for h in trainer.state.log_history if "dynamic_sampling/rounds" in h]
    assert [h["dynamic_sampling/short_step"] for h in logs] == [1.0, 1.0]
    assert [h["dynamic_sampling/rounds"] for h in logs] == [1.0, 1.0]
    assert [h["dynamic_sampling/missing_groups"] for h in logs] == [2.0, 2.0]
    assert [h["dynamic_sampling/frac_kept"] for h in logs] == [0.0, 0.0]
    assert [len(t["refills"]) for t in trainer.dynamic_sampling_trace] == [1, 1]  # max_rounds
    assert [len(t["refills"][0]) for t in trainer.dynamic_sampling_trace] == [3, 3]  # ceil(1.5 x 2 groups)
    assert all(h["loss"] == 0.0 for h in trainer.state.log_history if "loss" in h)


def test_plan_counts_the_refill_round(tmp_path):
    from pipeline.plan.memory import plan_run

    off = cfg_dict(tmp_path)
    off["grpo"]["dynamic_sampling"]["enabled"] = False
    on = cfg_dict(tmp_path, oversample=2.0)
    kv_off = plan_run(config_from_dict(off), gpu_gib=80).components["generation_kv_cache"]
    kv_on = plan_run(config_from_dict(on), gpu_gib=80).components["generation_kv_cache"]
    assert kv_on == pytest.approx(2 * kv_off)  # 8 rows per device -> a refill of ceil(2.0 x 2 groups) x 4
