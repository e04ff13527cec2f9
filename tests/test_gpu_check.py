"""bench/gpu_check.py: the real shapes it builds, its case order and time budget, bad input, and its CPU
mode end to end (real Ray Train worker, real judge actor, tensor-counted terms equal to the planner's)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.plan import memory as M

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family,model_id,params", [
    ("llama", "meta-llama/Llama-3.1-8B-Instruct", 8_030_261_248),
    ("qwen2", "Qwen/Qwen2.5-7B-Instruct", 7_615_616_512),
])
def test_gpu_mode_builds_the_real_shapes(gc, tmp_path, family, model_id, params):
    """The random-init models have exactly the planner's built-in shapes (meta device: no memory used)."""
    import torch
    from transformers import AutoModelForCausalLM

    mode = gc.gpu_mode()
    shape = mode.policy if family == "llama" else mode.judge
    assert shape.param_count() == M.builtin_shape(model_id).param_count() == params
    config = gc.hf_config(shape, SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=0), family)
    (tmp_path / "config.json").write_text(config.to_json_string())
    assert M.resolve_shape(str(tmp_path)).param_count() == params  # what the planner reads back
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == params


def test_padded_tokenizer_decodes_every_id_and_keeps_the_trained_encoding(gc):
    texts = gc.training_texts()
    tok = gc.padded_tokenizer(texts, 1500)
    trained = len(gc.padded_tokenizer(texts, gc.TOKENIZER_TRAINED_SIZE))
    assert len(tok) == 1500 and trained == gc.TOKENIZER_TRAINED_SIZE
    ids = tok("Wie groß ist die Zugspitze? Über 2962 Meter.", add_special_tokens=False)["input_ids"]
    assert ids and max(ids) < trained  # filler tokens are never produced by encoding
    assert tok.decode(ids) == "Wie groß ist die Zugspitze? Über 2962 Meter."
    assert all(isinstance(tok.decode([i]), str) and tok.convert_ids_to_tokens(i) for i in range(trained, 1500))
    assert "<|assistant|>" in tok.apply_chat_template([{"role": "user", "content": "Hallo"}], tokenize=False,
                                                      add_generation_prompt=True)


def test_cases_run_smallest_first_with_planner_max_and_vllm(gc):
    cases = gc.choose_cases((16, 4, 8), planner_max=48, vllm=True)
    assert [(c.num_generations, c.backend) for c in cases] == [(4, "hf"), (8, "hf"), (8, "vllm"), (16, "hf"), (48, "hf")]
    assert cases[-1].why == "planner's largest that fits"
    assert [c.num_generations for c in gc.choose_cases((4, 8, 16), planner_max=16, vllm=False)] == [4, 8, 16]
    assert [c.num_generations for c in gc.choose_cases((2, 4), planner_max=None, vllm=False)] == [2, 4]


def test_budget_skips_a_case_that_would_end_past_it(gc):
    first = gc.Case(4, status="ok", result={"wall_seconds": 60.0, "train_seconds": 20.0})
    # start-up 40 s + 20 s of steps scaled by 16/4 = 120 s
    assert gc.estimate_seconds(gc.Case(16), [first]) == pytest.approx(120.0)
    assert gc.budget_left_for(gc.Case(16), [first], elapsed=300, budget=480, reserve=20) == (True, "")
    ok, why = gc.budget_left_for(gc.Case(16), [first], elapsed=400, budget=480, reserve=20)
    assert not ok and "would need ~120s" in why
    assert gc.budget_left_for(gc.Case(4), [], elapsed=10, budget=480, reserve=20) == (True, "")  # nothing to go by
    ok, why = gc.budget_left_for(gc.Case(4), [], elapsed=470, budget=480, reserve=20)
    assert not ok and "time budget spent" in why


@pytest.mark.parametrize("argv,message", [
    (["--device", "cpu", "--minutes", "0"], "--minutes 0.0: must be > 0"),
    (["--device", "cpu", "--generations", "4,x"], "--generations"),
    (["--device", "cpu", "--steps", "0"], "--steps 0: must be >= 1"),
    (["--device", "cpu", "--set", "generation.temperature=0"], "generation.temperature: 0 must be > 0"),
])
def test_bad_input_exits_2_before_ray(gc, tmp_path, capsys, argv, message):
    import ray

    started = ray.is_initialized()
    assert gc.main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert ray.is_initialized() == started  # nothing was started


def test_cuda_mode_without_a_gpu_exits_2(gc, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert gc.main(["--out", str(tmp_path)]) == 2
    assert "--device cuda: no CUDA device is visible" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_mode_end_to_end(gc, ray_local, tmp_path, capsys):
    """Two cases through Ray Train with the judge actor: tensor-counted terms equal the planner's bytes."""
    out = tmp_path / "out"
    work = ["--work", str(tmp_path / "work")]
    assert gc.main(["--device", "cpu", "--json", "--out", str(out), "--minutes", "30", *work]) == 0  # no skips
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res == json.loads((out / "gpu_check.json").read_text())
    assert "exact_terms_ok: True" in (out / "gpu_check.txt").read_text()
    assert res["exact_terms_ok"] is True and res["mode"] == "cpu"
    assert [(c["num_generations"], c["status"]) for c in res["cases"]] == [(2, "ok"), (4, "ok")]
    for c in res["cases"]:
        assert c["batch"] == c["num_generations"]  # one prompt per round kept, as the planner's sweep scales it
        assert c["sec_per_step"] > 0 and c["generated_tokens"] > 0 and c["generated_tokens_per_s"] > 0
        assert c["completion_length"] <= 12 and c["prompt_width"] > 0
        for term in gc.EXACT_TERMS:
            t = c["exact_terms"][term]
            assert t["measured_bytes"] == t["planned_bytes"] > 0, term
        assert c["trainable_dtypes"] == ["torch.float32"]
    # the larger group trains on twice the completions: more gradient steps' worth of tokens generated
    assert res["cases"][1]["generated_tokens"] > res["cases"][0]["generated_tokens"]
    j = res["judge_throughput"]
    assert j["one_pass_scores_per_s"] > 0 and j["generate_parse_scores_per_s"] > 0

    # A spent budget: every case is skipped and says why; nothing ran, so the exit code is 1.
    assert gc.main(["--device", "cpu", "--json", "--out", str(out), "--minutes", "0.001", *work]) == 1
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [c["status"] for c in res["cases"]] == ["skipped", "skipped"]
    assert all("time budget spent" in c["reason"] for c in res["cases"]) and not res["exact_terms_ok"]
    assert any("skipped for time" in n for n in res["notes"])


def test_gpu_measurements_are_set_against_the_plan(gc, tmp_path):
    """The CUDA rows (not reachable on CPU) from a worker's records: phase peaks above their start, new
    gradients kept out of the training transient, the card's peak as the total, and the report renders."""
    G = gc.GIB
    cfg = gc.case_config(gc.gpu_mode(), 8, "hf", "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
                         tmp_path, 1, True, 2, 256, [])
    assert (cfg.optimization.per_device_train_batch_size, cfg.judge.placement, cfg.distributed.zero_stage) == (8, "same_gpu", 0)
    from pipeline.scoring.pool import training_worker_gpus

    assert training_worker_gpus(cfg) + cfg.judge.gpus_per_actor == 1.0  # the worker keeps the rest of its card
    for g in (4, 16, 48):  # the batches the planner's sweep uses: 8 prompts per round on one GPU
        big = gc.case_config(gc.gpu_mode(), g, "hf", "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct",
                             tmp_path, 1, True, 2, 256, [])
        assert big.optimization.per_device_train_batch_size == g == M.scaled_batch(big, g)
    plan = gc.planned(cfg, 139.8, 1, prompt_width=90)
    assert plan.inputs["prompt_len"] == 90 and plan.inputs["completion_len"] == 256

    def sample(start, peak, reserved, used, **kw):
        return dict(start_allocated=start * G, peak_allocated=peak * G, peak_reserved=reserved * G,
                    reserved=reserved * G, device_used=used * G, device_total=140 * G, device_peak=used * G, **kw)

    exact = {t: round(plan.components[t] * G) for t in gc.EXACT_TERMS}
    grads = exact["gradients"]
    rank = {"rank": 0, "steps": [20.0, 6.0], **exact,
            "generate_calls": [sample(20, 30, 33, 51, seconds=10.0, sequences=64, prompt_width=90, tokens=64 * 256,
                                      max_completion=256)],
            "gen": [sample(20, 31, 33, 51, seconds=12.0)],
            "train": [dict(sample(20, 25 + grads / G, 34, 52, seconds=3.0), new_grads=grads),
                      dict(sample(21, 24, 34, 53, seconds=3.0), new_grads=0)]}
    res = gc.summarize_case(cfg, plan, [rank], {"peak_reserved": 16 * G}, wall=60.0, train_seconds=26.0, num_gpus=1)
    m = res["measured"]
    assert m["generation"] == pytest.approx(10) and m["generation_and_scoring"] == pytest.approx(11)
    assert m["training"] == pytest.approx(5)  # 5 GiB above the start, the new gradients not counted
    assert m["allocator_slack"] == pytest.approx(34 - 31)  # largest reserved - largest allocated
    assert m["cuda_contexts"] == pytest.approx(51 - 33 - 16)
    assert res["measured_peak_gib"] == pytest.approx(53)
    assert res["sec_per_step"] == 13.0 and res["generated_tokens_per_s"] == pytest.approx(64 * 256 / 10)
    assert res["exact_terms_ok"] and res["planned_total_gib"] == pytest.approx(plan.total_gib)

    case = gc.Case(8, status="ok", result=res)
    out = gc.case_json(case)
    assert {"num_generations", "measured_peak_gib", "planned_total_gib", "sec_per_step"} <= set(out)
    assert [c["name"] for c in out["components"]][:2] == ["generation (kv cache + transient)", "training (activations + logits)"]
    text = gc.format_report({"device": "GPU", "num_gpus": 1, "torch": "x", "trl": "y", "vllm": None, "policy": "p",
                             "judge_model": "j", "cases": [out, gc.case_json(gc.Case(64, status="skipped", reason="r"))],
                             "judge_throughput": None, "exact_terms_ok": True, "elapsed_s": 1, "budget_s": 480, "notes": []})
    assert "measured/planned" in text and "53.000" in text and "SKIPPED: r" in text
