"""Version seams: the pins in pyproject.toml, the warmup they guarantee, and each private TRL attribute
the pipeline still touches, checked on a real GRPOTrainer (tiny policy, in process, no Ray). An upgrade
that moves one fails here, and at run time with a message naming it, instead of silently doing nothing."""

from __future__ import annotations

import inspect
import math
import sys
import types
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from transformers import TrainerCallback

from pipeline.config import load_config
from pipeline.training.length_control import apply_max_completion_length

REPO = Path(__file__).resolve().parents[1]
PINNED = ("ray", "transformers", "trl", "peft", "deepspeed")
STEPS, WARMUP, LR = 4, 0.5, 1e-3


def _requirements() -> dict[str, Requirement]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps)}


def test_installed_versions_are_within_the_pinned_majors():
    reqs = _requirements()
    for name in PINNED:
        spec = reqs[name].specifier
        assert any(s.operator == "<" for s in spec) and any(s.operator == ">=" for s in spec), (name, str(spec))
        assert spec.contains(version(name), prereleases=True), f"{name} {version(name)} is outside {spec}"


class _Rows(TrainerCallback):
    def __init__(self):
        self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "learning_rate" in logs:
            self.rows.append(dict(logs, step=state.global_step))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_policy):
    """A real TRL GRPOTrainer built as the workers build it, trained for a few steps."""
    from pipeline.data.sources import load_records
    from pipeline.scoring.clients import eos_kwargs
    from pipeline.training.worker import build_grpo_trainer, load_policy
    from rewards.trl_rewards import make_reward_funcs

    cfg = load_config(None, [
        f"optimization.max_steps={STEPS}", f"optimization.warmup_ratio={WARMUP}", f"optimization.learning_rate={LR}",
        "optimization.lr_scheduler_type=cosine", "optimization.per_device_train_batch_size=4",
        "generation.num_generations=4", "generation.max_completion_length=8", "logging.progress_bar=false",
        f"output.save_steps={STEPS}", "rewards.weights={rouge_l: 0.5, length: 0.5, judge: 0, eos: 1}",
    ])
    train, _, _ = load_records(cfg.data, log=None)
    tokenizer, model, eos_ids = load_policy(cfg, on_gpu=False)
    funcs, weights = make_reward_funcs(cfg.rewards.weights, None, eos_ids, lambda: 8, eos_kwargs(cfg))
    rows = _Rows()
    run_dir = tmp_path_factory.mktemp("seams")
    trainer = build_grpo_trainer(cfg, run_dir, tokenizer, model, train, funcs, weights, [rows])
    trainer.train()
    return trainer, rows.rows, run_dir / "trainer" / f"checkpoint-{STEPS}"


@pytest.mark.slow  # one real GRPOTrainer, 4 steps, shared by the module
def test_learning_rate_follows_the_configured_warmup(trained):
    # optimization.warmup_ratio reaches TRL as warmup_steps=0.5, a ratio of max_steps only from transformers 5
    # (an int of steps before): 2 warmup steps here, then cosine. Logged at step k: the LR step k ran with.
    _, rows, _ = trained
    w = math.ceil(WARMUP * STEPS)
    expected = [LR * (k / w if k < w else 0.5 * (1 + math.cos(math.pi * (k - w) / (STEPS - w)))) for k in range(STEPS)]
    got = [r["learning_rate"] for r in rows if r["step"] >= 1][:STEPS]
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-12), got
    # a ramp 0 -> LR/2 -> LR: with no warmup (0.5 read as 0 steps) step 1 would run at the full LR
    assert got[:3] == pytest.approx([0.0, LR / 2, LR])


@pytest.mark.slow  # one real GRPOTrainer, 4 steps, shared by the module
def test_attributes_the_length_control_writes_are_what_trl_generation_reads(trained):
    from trl import GRPOTrainer

    trainer, _, _ = trained
    assert hasattr(trainer, "use_vllm") and not trainer.use_vllm
    apply_max_completion_length(trainer, 13)
    assert trainer.max_completion_length == 13 and trainer.generation_config.max_new_tokens == 13
    assert trainer.generation_kwargs["max_new_tokens"] == 13
    # TRL's generation (HF path) passes exactly these to generate(); the vLLM path reads its generator's cap.
    src = inspect.getsource(GRPOTrainer)
    assert "generation_config=self.generation_config" in src and "generation_kwargs=self.generation_kwargs" in src
    assert "max_completion_length=self.max_completion_length" in src  # handed to VLLMGeneration
    from trl.generation.vllm_generation import VLLMGeneration

    assert "max_completion_length = self.max_completion_length" in inspect.getsource(VLLMGeneration)


@pytest.mark.slow  # one real GRPOTrainer, 4 steps, shared by the module
def test_trl_logs_hold_what_the_samples_writer_reads(trained):
    from pipeline.training.callbacks import trl_logs

    trainer, _, _ = trained
    logs = trl_logs(trainer)
    n = len(logs["prompt"])
    assert n > 0 and len(logs["completion"]) == n
    assert set(logs["rewards"]) == {f.__name__ for f in trainer.reward_funcs}
    assert all(len(v) == n for v in logs["rewards"].values())


@pytest.mark.slow  # one real GRPOTrainer, 4 steps, shared by the module
def test_a_finished_run_exports_the_adapter_from_its_checkpoint(trained, tmp_path, tiny_policy):
    """The worker's "finished already" branch: the checkpoint's adapter, loaded by PEFT's public API, is
    the trained one (no Trainer._load_from_checkpoint)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.training.worker import export_trained_weights

    trainer, _, checkpoint = trained
    export_trained_weights(checkpoint, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    assert not list((tmp_path / "adapter").glob("optimizer*")) and not (tmp_path / "adapter" / "trainer_state.json").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_policy), tmp_path / "adapter")
    want = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    got = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert want and set(got) == set(want)
    assert all(torch.equal(got[k], want[k].cpu()) for k in want)
    assert any(v.abs().sum() > 0 for k, v in got.items() if "lora_B" in k)  # trained: B left its zero init
    with pytest.raises(FileNotFoundError, match="no adapter or model weights"):
        export_trained_weights(tmp_path, tmp_path / "nothing")


def test_trls_one_step_per_rollout_rule_is_the_one_inert_settings_uses():
    from trl import GRPOTrainer

    src = inspect.getsource(GRPOTrainer)
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in src
    assert "self.args.gradient_accumulation_steps % generate_every != 0" in src
    assert "per_token_logps.detach() if old_per_token_logps is None" in src  # the ratio is exactly 1 then


def test_a_missing_seam_raises_naming_it():
    from pipeline.training.callbacks import SamplesWriter

    gone = types.SimpleNamespace(args=types.SimpleNamespace(), max_completion_length=8, use_vllm=False,
                                 generation_kwargs={"max_new_tokens": 8})
    with pytest.raises(RuntimeError, match=r"generation_config.*trl"):
        apply_max_completion_length(gone, 16)
    with pytest.raises(RuntimeError, match=r"max_completion_length"):
        apply_max_completion_length(types.SimpleNamespace(args=types.SimpleNamespace()), 16)
    vllm = types.SimpleNamespace(args=types.SimpleNamespace(), max_completion_length=8, use_vllm=True, vllm_generation=None)
    with pytest.raises(RuntimeError, match=r"vllm_generation"):
        apply_max_completion_length(vllm, 16)
    writer = SamplesWriter(REPO, every=1, num_samples=1)
    writer.trainer = types.SimpleNamespace()
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=1)
    with pytest.raises(RuntimeError, match=r"_logs"):
        writer.on_log(None, state, None, logs={"completions/clipped_ratio": 1.0})
