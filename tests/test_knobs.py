"""Settings that used to do nothing: prompt truncation, the judge's micro-batch and placement."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pipeline.config import config_from_dict, load_config
from pipeline.data.sources import fit_prompt, load_records, prompt_token_count
from tests.conftest import REPO

LONG_CONTEXT = " ".join(f"Satz {i}: Die Stadt liegt am Fluss und hat viele alte Häuser." for i in range(400))


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_policy):
    from pipeline.training.worker import load_tokenizer

    return load_tokenizer(load_config(None))


def test_long_context_is_cut_to_the_limit_and_the_question_kept(tiny_tokenizer):
    rec = {"id": "x", "question": "Wo liegt die Stadt?", "reference": "Am Fluss.", "context": LONG_CONTEXT}
    system = load_config(None).data.system_prompt
    assert prompt_token_count(rec, tiny_tokenizer, system) > 3000
    cut = fit_prompt(rec, tiny_tokenizer, system, 128)
    n = prompt_token_count(cut, tiny_tokenizer, system)
    assert 100 < n <= 128  # as much context as fits, not all of it dropped
    assert cut["question"] == rec["question"] and LONG_CONTEXT.startswith(cut["context"].rstrip(" …"))
    assert fit_prompt(rec, tiny_tokenizer, system, 100_000) is rec  # fits: untouched
    assert fit_prompt({**rec, "context": "", "question": LONG_CONTEXT}, tiny_tokenizer, system, 128) is None


def test_data_summary_counts_truncated_prompts(tmp_path, tiny_tokenizer):
    rows = [{"query": f"Frage {i}?", "synthetic_answer": "Antwort.", "language": "de", "synth_id": f"r{i}",
             "exercise": "rag", "query_seed_text": LONG_CONTEXT if i % 2 else "Kurz."} for i in range(10)]
    rows.append({"query": LONG_CONTEXT, "synthetic_answer": "Antwort.", "language": "de", "synth_id": "long-q"})
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    lines = []
    cfg = load_config(None, ["data.source=local", f"data.path={path}", "data.max_prompt_length=128"])
    train, held, rep = load_records(cfg.data, log=lines.append, tokenizer=tiny_tokenizer)
    assert rep.truncated == 5 and rep.skipped["prompt_too_long"] == 1 and len(train) + len(held) == 10
    assert "5 prompts truncated to 128 tokens" in lines[0] and "prompt_too_long 1" in lines[0]


@pytest.mark.slow
def test_prompt_ids_that_reach_generation_respect_max_prompt_length(tmp_path, tiny_policy):
    """A real GRPOTrainer step: every prompt TRL tokenizes for generation fits data.max_prompt_length."""
    from pipeline.scoring.clients import eos_kwargs
    from pipeline.training.worker import build_grpo_trainer, load_policy
    from rewards.trl_rewards import make_reward_funcs

    rows = [{"query": f"Wie heißt Satz {i}?", "synthetic_answer": f"Satz {i}.", "language": "de", "synth_id": f"r{i}",
             "exercise": "rag", "query_seed_text": LONG_CONTEXT} for i in range(8)]
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    cfg = load_config(None, [
        "data.source=local", f"data.path={path}", "data.max_prompt_length=160", "data.eval_fraction=0.01",
        "optimization.max_steps=1", "generation.max_completion_length=8", "generation.num_generations=4",
        "optimization.per_device_train_batch_size=4", "logging.progress_bar=false", "output.save_steps=100",
    ])
    tokenizer, model, eos_ids = load_policy(cfg, on_gpu=False)
    train, _, rep = load_records(cfg.data, log=None, tokenizer=tokenizer)
    assert rep.truncated == len(train) > 0
    funcs, weights = make_reward_funcs({"rouge_l": 1.0}, None, eos_ids, lambda: 8, eos_kwargs(cfg))
    trainer = build_grpo_trainer(cfg, tmp_path, tokenizer, model, train, funcs, weights, [])
    seen: list[int] = []
    tokenize = trainer._tokenize_prompts

    def recording(prompts):
        out = tokenize(prompts)
        seen.extend(len(ids) for ids in out[0])
        return out

    trainer._tokenize_prompts = recording
    trainer.train()
    assert seen and max(seen) <= 160 and min(seen) > 120  # cut to the limit, not far below it


def test_judge_max_batch_size_bounds_every_forward_pass(ray_local):
    """The judge actor's forward passes never exceed judge.max_batch_size rows."""
    from pipeline.scoring.pool import start_pool, stop_pool

    cfg = load_config(None, ["judge.max_batch_size=3", "judge.cpus_per_actor=0.25"])
    pool = start_pool(cfg)
    try:
        n = 10
        scores = pool.run(pool.judge(["Frage?"] * n, ["Die Antwort ist vier."] * n, [f"Antwort {i}" for i in range(n)]))
        assert len(scores) == n
        stats = ray_local.get(pool.judges[0].stats.remote())
        assert stats["largest_forward"] == 3
    finally:
        stop_pool(pool)


def test_placement_decides_the_judge_actors_ray_resources():
    """A real Ray with one (advertised) GPU: own_gpu and same_gpu show in the actors' assigned resources."""
    script = textwrap.dedent(
        """
        import json, ray
        from pipeline.config import config_from_dict
        from pipeline.scoring.pool import start_pool, stop_pool, training_worker_gpus
        ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, logging_level="ERROR")
        out = {}
        for name, judge, dist in [
            ("none", {"placement": "none"}, {}),
            ("own_gpu", {"placement": "own_gpu", "gpus_per_actor": 0.5}, {}),
            ("same_gpu", {"placement": "same_gpu", "gpus_per_actor": 0.25}, {"use_gpu": True}),
        ]:
            cfg = config_from_dict({"judge": {"cpus_per_actor": 0.5, **judge}, "distributed": dist})
            pool = start_pool(cfg)
            out[name] = {"actor": ray.get(pool.judges[0].assigned_resources.remote()),
                         "worker_gpus": training_worker_gpus(cfg)}
            stop_pool(pool)
        print("RESULT" + json.dumps(out))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=240)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert line, proc.stderr[-3000:]
    out = json.loads(line[0][len("RESULT"):])
    assert out["none"]["actor"].get("GPU", 0) == 0 and out["none"]["actor"]["CPU"] == 0.5
    assert out["own_gpu"]["actor"]["GPU"] == 0.5 and out["own_gpu"]["worker_gpus"] == 1.0
    assert out["same_gpu"]["actor"]["GPU"] == 0.25 and out["same_gpu"]["worker_gpus"] == 0.75


@pytest.mark.parametrize("judge,dist,fields", [
    ({"placement": "own_gpu", "gpus_per_actor": 0}, {"use_gpu": True}, ("judge.placement", "judge.gpus_per_actor")),
    ({"placement": "none", "gpus_per_actor": 1}, {}, ("judge.placement", "judge.gpus_per_actor")),
    ({"placement": "same_gpu", "gpus_per_actor": 0.5}, {}, ("judge.placement", "distributed.use_gpu")),
    ({"placement": "same_gpu", "gpus_per_actor": 1.0}, {"use_gpu": True}, ("judge.placement", "judge.gpus_per_actor")),
])
def test_contradictory_placement_names_both_fields(judge, dist, fields):
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError) as e:
        config_from_dict({"judge": judge, "distributed": dist})
    text = "\n".join(e.value.problems)
    assert all(f in text for f in fields), text
