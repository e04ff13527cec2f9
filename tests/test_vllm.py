"""generation.backend vllm for real: TRL's colocated vLLM engine (vLLM's CPU build, which
`./scripts/setup.sh test` installs where there is no GPU) inside Ray Train workers, one worker through
`synth-grpo train` and two with ZeRO-2, the length cap, floor and schedule measured from what the engine
generated, the held-out evaluation sampled by the same engine, and the engine's weights following the
optimizer (same prompt and seed, different log-probabilities). Both runs are made once per module:
each engine starts in ~45 s on 2 cores."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config
from pipeline.rundir.files import read_metrics
from pipeline.training.vllm_engine import CPU_KV_CACHE_ENV, cpu_kv_cache_gib, reserve_cpu_kv_cache

REPO = Path(__file__).resolve().parents[1]
NO_VLLM = "vLLM is not installed (./scripts/setup.sh test installs its CPU build on a machine without a GPU)"
# Installed, asked of the file system: conftest keeps vLLM unloaded in this process (None in sys.modules).
VLLM_INSTALLED = importlib.machinery.PathFinder.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not VLLM_INSTALLED, reason=NO_VLLM)


# ---------------------------------------------------------------- before any engine starts


@pytest.mark.parametrize("command", ["train", "tune"])
def test_backend_vllm_without_vllm_exits_2_naming_the_field_and_the_install(tmp_path, command):
    # None in sys.modules is Python's own way of making a module unimportable.
    code = ("import sys; sys.modules['vllm'] = None; from pipeline.cli.main import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, command, "--set", "generation.backend=vllm",
                           "--set", f"output.root={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "generation.backend" in proc.stderr and "./scripts/setup.sh vllm" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "[ray]" not in proc.stdout
    assert not any(tmp_path.iterdir())  # nothing written: no run directory, no search


def test_cpu_kv_cache_is_sized_for_the_run_and_a_set_value_is_kept(monkeypatch):
    from transformers import LlamaConfig

    llama8b = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    cfg8b = load_config(REPO / "configs" / "sauerkraut-8b.yaml")
    # 64 sequences (8 per device x steps_per_generation 8) x (512 + 512) tokens x 128 KiB of K and V per token
    assert cpu_kv_cache_gib(llama8b, cfg8b, dtype_bytes=2) == 8
    tiny = load_config(None)
    assert cpu_kv_cache_gib(llama8b, tiny, dtype_bytes=2) == 1  # 8 x (256 + 96) tokens: under 1 GiB, vLLM's unit

    class Model:  # what reserve_cpu_kv_cache reads of the policy: its config and one parameter's dtype
        config = llama8b

        def parameters(self):
            import torch

            yield torch.zeros(1, dtype=torch.bfloat16)

    vllm_cfg = load_config(REPO / "configs" / "sauerkraut-8b.yaml", ["distributed.use_gpu=false"])
    monkeypatch.setenv(CPU_KV_CACHE_ENV, "")  # empty counts as unset; monkeypatch restores the original after
    reserve_cpu_kv_cache(load_config(None), Model(), on_gpu=False)  # hf: nothing to reserve
    reserve_cpu_kv_cache(vllm_cfg, Model(), on_gpu=True)  # a GPU: vLLM's gpu_memory_utilization
    assert os.environ[CPU_KV_CACHE_ENV] == ""
    reserve_cpu_kv_cache(vllm_cfg, Model(), on_gpu=False)
    assert os.environ[CPU_KV_CACHE_ENV] == "8"
    monkeypatch.setenv(CPU_KV_CACHE_ENV, "3")
    reserve_cpu_kv_cache(vllm_cfg, Model(), on_gpu=False)
    assert os.environ[CPU_KV_CACHE_ENV] == "3"


@needs_vllm
def test_an_hf_worker_does_not_load_vllm_with_trl():
    """trl 1.16 imports vLLM with GRPOTrainer whenever it is installed: seconds per Ray Train worker of an
    hf run, for nothing. The worker keeps it unloaded (trl_seams.keep_vllm_unloaded), and TRL sees no vLLM."""
    code = ("import sys; from pipeline.seams.trl_seams import keep_vllm_unloaded; keep_vllm_unloaded(); "
            "from trl import GRPOTrainer; from trl.import_utils import is_vllm_available; "
            "print(is_vllm_available(), sys.modules.get('vllm') is None, "
            "any(m.startswith('vllm.') for m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False", "True", "False"], proc.stderr[-2000:]


# ---------------------------------------------------------------- the engine in Ray Train workers


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory, request):
    """(one-worker run directory, its CLI process, two-worker run directory)."""
    if not VLLM_INSTALLED:
        pytest.skip(NO_VLLM)
    root = tmp_path_factory.mktemp("vllm")
    # One worker through the CLI: the adaptive cap starts at 4 and the reference floor lifts it to 33;
    # dynamic sampling refills groups whose rewards barely differ (min_std 0.2: some always do); sampling
    # at temperature 0.8, which the engine's log-probs are processed with as the trainer's are.
    one = subprocess.run([
        sys.executable, "-m", "pipeline", "train", "--set", "generation.backend=vllm",
        "--set", "optimization.max_steps=4", "--set", "eval.every_steps=4", "--set", "eval.num_prompts=4",
        "--set", "generation.adaptive.start=4", "--set", "generation.temperature=0.8",
        "--set", "grpo.dynamic_sampling.enabled=true",
        "--set", "grpo.dynamic_sampling.min_std=0.2", "--set", "grpo.dynamic_sampling.max_rounds=1",
        "--set", "output.save_steps=4", "--set", "logging.progress_bar=false",
        "--set", f"output.root={root}", "--set", "output.run_name=one",
    ], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]

    # Two workers, ZeRO-2, in this session's Ray: a fixed cap of 16 that the schedule cuts to 4 once one step is done
    # (its steps count completed optimizer steps: the second step generates at 4).
    request.getfixturevalue("ray_local")
    from pipeline.config import config_from_dict
    from pipeline.training.driver import prepare_run_dir, run_training

    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    data["generation"].update(backend="vllm", max_completion_length=16, length_schedule=[[1, 4]])
    data["optimization"].update(max_steps=2, per_device_train_batch_size=4)
    data["distributed"].update(num_workers=2, zero_stage=2, cpus_per_worker=0.5, max_failures=0)
    data["judge"].update(cpus_per_actor=0.25)
    data["eval"].update(num_prompts=2, samples_per_prompt=2, every_steps=2)
    data["output"].update(save_steps=2, root=str(root), run_name="two")
    data.setdefault("logging", {}).update(progress_bar=False)
    cfg = config_from_dict(data)
    prepare_run_dir(cfg, root / "two", log=None)
    run_training(cfg, root / "two", log=None)
    return root / "one", one, root / "two"


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r]


@needs_vllm
@pytest.mark.slow
def test_one_worker_generates_with_vllm_at_the_floor_and_refills_through_it(vllm_runs):
    run_dir, proc, _ = vllm_runs
    assert "=== synth-grpo summary ===" in proc.stdout
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # TRL logs how far the engine's sampling log-probs are from the trainer's only when vLLM generated;
    # small at every step: the engine holds the weights the optimizer just wrote and samples at the
    # run's temperature (at vLLM's default of 1.0 instead of 0.8 they would differ by far more).
    assert all(r["sampling/sampling_logp_difference/mean"] < 0.05 for r in rows), rows
    # The floor (33, the length 90% of the references fit in) replaced the start (4) in the engine's budget.
    assert {r["generation/max_completion_length"] for r in rows} == {33}
    lengths = [r["completions/max_length"] for r in rows]
    assert max(lengths) > 4 and all(n <= 33 for n in lengths), lengths
    assert sum(r["dynamic_sampling/rounds"] for r in rows) >= 1  # refill rounds ran, through the same engine


@needs_vllm
@pytest.mark.slow
def test_evaluation_samples_from_the_engine_holding_the_current_weights(vllm_runs):
    run_dir, _, _ = vllm_runs
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/score" in r]
    assert [r["step"] for r in evals] == [0, 4] and {r["eval/max_new_tokens"] for r in evals} == {96}
    answers = read_metrics(run_dir / "eval_samples.jsonl")
    assert len(answers) == 2 * 4 * 4 and all("engine_logprob" in a for a in answers)
    assert any(a["ended_with_eos"] for a in answers)  # the engine stops at the policy's EOS token
    # The engine's log-probability of each answer is the policy's own (fp32 on both sides): the engine
    # was synced before sampling, at step 0 and after 4 optimizer steps alike.
    gaps = [abs(a["engine_logprob"] - a["policy_logprob"]) for a in answers]
    assert max(gaps) < 0.5 and sum(gaps) / len(gaps) < 0.1, gaps
    # Same prompt, same seed, before and after training: the same tokens where the policy barely moved,
    # never the same log-probability.
    before = {(a["id"], a["sample"]): a for a in answers if a["step"] == 0}
    after = {(a["id"], a["sample"]): a for a in answers if a["step"] == 4}
    assert before.keys() == after.keys()
    assert all(before[k]["engine_logprob"] != after[k]["engine_logprob"] for k in before)
    assert any(before[k]["completion"] == after[k]["completion"] for k in before)


@needs_vllm
@pytest.mark.slow
def test_two_workers_zero2_follow_the_schedule_and_evaluate_through_vllm(vllm_runs):
    _, _, run_dir = vllm_runs
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["generation/max_completion_length"] for r in rows] == [16, 4]
    lengths = [r["completions/max_length"] for r in rows]
    assert 4 < lengths[0] <= 16 and lengths[1] <= 4, lengths
    assert all("sampling/sampling_logp_difference/mean" in r for r in rows)
    ckpt = run_dir / "ray_train" / "checkpoint-000002"
    assert len(list((ckpt / "global_step2").glob("*optim_states.pt"))) == 2  # one ZeRO-2 shard per rank
    answers = read_metrics(run_dir / "eval_samples.jsonl")
    # both evaluations (steps 0 and 2), both ranks' shares, all sampled by the engines
    assert len(answers) == 2 * 2 * 2 and all("engine_logprob" in a for a in answers)


@needs_vllm
@pytest.mark.slow
def test_doctor_and_compare_read_vllm_runs_as_any_other(vllm_runs, tmp_path):
    one, _, two = vllm_runs
    doctor = subprocess.run([sys.executable, "-m", "pipeline", "doctor", str(one), "--json"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert doctor.returncode == 0, doctor.stderr[-2000:]
    assert isinstance(json.loads(doctor.stdout), list) and (one / "report.md").is_file()
    out = tmp_path / "cmp"
    compare = subprocess.run([sys.executable, "-m", "pipeline", "compare", str(one), str(two), "--out", str(out)],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert compare.returncode == 0, compare.stderr[-2000:]
    assert (out / "compare.md").is_file()
