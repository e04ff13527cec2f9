"""TRL reward functions: names, weights, both completion formats, and a real GRPOTrainer step."""
from __future__ import annotations

import pytest

from rewards.eos import eos_component
from rewards.rouge import rouge_l
from rewards.trl_rewards import COMPONENTS, completion_text, make_reward_funcs, prompt_question

EOS = 2


class FakeJudge:
    """Records what it is asked; scores by word overlap so the result is checkable."""

    name = "fake"

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[str], list[str]]] = []

    def score(self, questions, references, candidates):
        self.calls.append((list(questions), list(references), list(candidates)))
        return [float(c == r) for r, c in zip(references, candidates)]


def test_completion_text_handles_every_format():
    assert completion_text("Köln") == "Köln"
    assert completion_text([{"role": "assistant", "content": "Köln"}]) == "Köln"
    assert completion_text([{"role": "assistant", "content": [{"type": "text", "text": "Kö"}, {"type": "text", "text": "ln"}]}]) == "Köln"
    assert completion_text([{"role": "tool", "content": "x"}, {"role": "assistant", "content": "Köln"}]) == "Köln"
    assert completion_text([]) == "" and completion_text({"content": "a"}) == "a"
    assert prompt_question([{"role": "system", "content": "s"}, {"role": "user", "content": "Wo?"}]) == "Wo?"
    assert prompt_question("Wo?") == "Wo?"


def test_names_order_and_weights():
    judge = FakeJudge()
    funcs, weights = make_reward_funcs({"rouge_l": 0.3, "length": 0.2, "judge": 0.5, "eos": 1.0}, judge, [EOS], lambda: 8, {})
    assert [f.__name__ for f in funcs] == list(COMPONENTS) and weights == [0.3, 0.2, 0.5, 1.0]
    # weight 0 keeps cheap components (logged) but drops the costly judge
    funcs, weights = make_reward_funcs({"rouge_l": 1.0, "judge": 0.0}, judge, [EOS], lambda: 8, {})
    assert [f.__name__ for f in funcs] == ["rouge_l", "length", "eos"] and weights == [1.0, 0.0, 0.0]
    funcs, _ = make_reward_funcs({"rouge_l": 1.0}, None, [EOS], lambda: 8, {})
    assert "judge" not in [f.__name__ for f in funcs]
    with pytest.raises(ValueError, match="needs a judge"):
        make_reward_funcs({"judge": 0.5}, None, [EOS], lambda: 8, {})
    with pytest.raises(ValueError, match="unknown reward components"):
        make_reward_funcs({"rouge": 1.0}, None, [EOS], lambda: 8, {})
    with pytest.raises(ValueError, match="unknown eos_kwargs"):
        make_reward_funcs({"eos": 1.0}, None, [EOS], lambda: 8, {"bonus": 1.0})


@pytest.mark.parametrize("conversational", [True, False])
def test_functions_score_a_group(conversational):
    judge = FakeJudge()
    cap = {"max": 4}
    funcs, _ = make_reward_funcs({c: 1.0 for c in COMPONENTS}, judge, [EOS], lambda: cap["max"], {"overlong_weight": 0.0})
    f = dict((fn.__name__, fn) for fn in funcs)
    texts = ["Die Größe der Stadt", "Größe", ""]
    wrap = (lambda t: [{"role": "assistant", "content": t}]) if conversational else (lambda t: t)
    prompt = [{"role": "user", "content": "Wie groß ist die Stadt?"}] if conversational else "Wie groß ist die Stadt?"
    kw = dict(
        prompts=[prompt] * 3, completions=[wrap(t) for t in texts], completion_ids=[[5, 6, EOS], [5, 6, 7, 8], [EOS]],
        reference=["Die Größe der Stadt"] * 3, question=["Wie groß?"] * 3, trainer_state=None, log_extra=None,
    )
    assert f["rouge_l"](**kw) == [1.0, rouge_l("Größe", "Die Größe der Stadt"), 0.0]
    assert f["length"](**kw) == [1.0, 0.25, 0.0]
    assert f["judge"](**kw) == [1.0, 0.0, 0.0]
    assert judge.calls[-1][0] == ["Wie groß?"] * 3 and judge.calls[-1][2] == texts
    assert f["eos"](**kw) == [0.1, -0.1, 0.1]
    cap["max"] = 16  # the cap is read on every call: the cut completion is no longer truncated
    assert f["eos"](**kw) == [0.1, 0.0, 0.1]
    # without a question column the judge gets the prompt's question
    f["judge"](**{k: v for k, v in kw.items() if k != "question"})
    assert judge.calls[-1][0] == ["Wie groß ist die Stadt?"] * 3
    with pytest.raises(KeyError, match="reference"):
        f["rouge_l"](**{k: v for k, v in kw.items() if k != "reference"})


@pytest.mark.parametrize("judge_weight", [0.0, 0.5])
def test_pool_clients_score_the_same_components_as_the_in_process_functions(judge_weight):
    """One rule (scored_components) for both factories: a judge of weight 0 is scored by neither."""
    from pipeline.config import load_config
    from pipeline.scoring.clients import eos_kwargs, make_pool_reward_funcs

    cfg = load_config(None, [f"rewards.weights={{rouge_l: 0.5, length: 0.2, judge: {judge_weight}, eos: 1}}"])
    pool_funcs, pool_weights = make_pool_reward_funcs(None, cfg, [EOS], lambda: 8)
    funcs, weights = make_reward_funcs(cfg.rewards.weights, FakeJudge(), [EOS], lambda: 8, eos_kwargs(cfg))
    assert [f.__name__ for f in pool_funcs] == [f.__name__ for f in funcs] and pool_weights == weights
    assert ("judge" in [f.__name__ for f in funcs]) == (judge_weight > 0)

def test_grpo_trainer_logs_each_component(tmp_path):
    """One real GRPO step on a tiny random Llama: TRL logs rewards/<name>/mean for every component."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tests.test_judge import build_tiny_lm

    folder = build_tiny_lm(tmp_path / "tiny", "left")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    judge = FakeJudge()
    cap = 6
    seen_ids: list[list[int]] = []
    funcs, weights = make_reward_funcs(
        {"rouge_l": 0.3, "length": 0.2, "judge": 0.5, "eos": 1.0}, judge, [tok.eos_token_id], lambda: cap, {}
    )
    eos_func = funcs[-1]

    def spy(*args, **kwargs):  # keep the ids TRL passes, to recompute the eos reward independently
        seen_ids.extend(kwargs["completion_ids"])
        return eos_func(*args, **kwargs)

    spy.__name__ = "eos"
    funcs[-1] = spy
    ds = Dataset.from_list(
        [{"prompt": f"Frage {i}: Wie groß ist die Stadt?", "reference": "Die Stadt ist groß", "question": "Wie groß?"}
         for i in range(4)]
    )
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=8, max_completion_length=cap,
        max_steps=1, logging_steps=1, use_cpu=True, report_to="none", save_strategy="no", reward_weights=weights,
        bf16=False, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=funcs, args=args, train_dataset=ds)
    trainer.train()
    logs = next(h for h in trainer.state.log_history if "reward" in h)
    for name in COMPONENTS:
        assert f"rewards/{name}/mean" in logs and f"rewards/{name}/std" in logs
    assert len(seen_ids) == 8 and all(len(ids) <= cap for ids in seen_ids)
    expected = [eos_component(ids, [tok.eos_token_id], cap) for ids in seen_ids]
    assert logs["rewards/eos/mean"] == pytest.approx(sum(expected) / 8, abs=1e-6)
    clipped = sum(ids[-1] != tok.eos_token_id for ids in seen_ids) / 8
    assert logs["completions/clipped_ratio"] == pytest.approx(clipped)
