"""The offline tiny policy: builds deterministically, caches, loads like a hub model, writes German and stops."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.data.sources import to_prompt
from pipeline.data.tiny_models import SYSTEM_PROMPT, TinyRecipe, build, ensure_tiny, policy_dir


def test_build_is_deterministic_for_a_seed(tmp_path):
    recipe = TinyRecipe(max_sft_steps=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=400)
    a = build(recipe, tmp_path / "a", log=None)
    b = build(recipe, tmp_path / "b", log=None)
    ma, mb = AutoModelForCausalLM.from_pretrained(a), AutoModelForCausalLM.from_pretrained(b)
    for (na, ta), (nb, tb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and torch.equal(ta, tb), na
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_cache_is_keyed_by_inputs(tmp_path):
    assert policy_dir(TinyRecipe(), tmp_path) == policy_dir(TinyRecipe(), tmp_path)
    assert policy_dir(TinyRecipe(seed=1), tmp_path) != policy_dir(TinyRecipe(seed=2), tmp_path)


def test_tiny_policy_loads_and_sometimes_stops(tiny_policy):
    assert ensure_tiny() == tiny_policy  # second call is a cache hit
    info = json.loads((tiny_policy / "synth_grpo_tiny.json").read_text())
    assert 1.2 < info["sft_loss"] < 2.2  # kept in the high-entropy regime on purpose
    tok = AutoTokenizer.from_pretrained(tiny_policy)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy)
    assert tok.eos_token == "</s>" and tok.pad_token == "<pad>" and tok.chat_template
    ids = tok.encode("Größe Straße Übung", add_special_tokens=False)
    assert tok.decode(ids) == "Größe Straße Übung"  # byte-level: no unknown tokens for umlauts and ß
    torch.manual_seed(0)
    enc = tok.apply_chat_template([to_prompt({"question": "Was ist die Hauptstadt von Frankreich?"}, SYSTEM_PROMPT)],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=40, do_sample=True, num_return_sequences=16, pad_token_id=tok.pad_token_id)
    completions = out[:, enc["input_ids"].shape[1]:]
    stopped = sum(bool((row == tok.eos_token_id).any()) for row in completions)
    assert 0 < stopped  # it does end with EOS at times
    text = tok.decode(completions[0], skip_special_tokens=True)
    assert any(c.isalpha() for c in text)


class _Saves:
    """Writes what save_pretrained would, so the folder logic runs on real files without a model build."""

    def __init__(self, name: str):
        self.name = name

    def save_pretrained(self, folder, **_):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / self.name).write_text("{}")


def test_a_cache_folder_without_a_model_is_replaced_not_returned(tmp_path):
    from pipeline.data.tiny_models import _save_atomic

    target = tmp_path / "policy"
    (target / "leftover").mkdir(parents=True)  # a half-deleted cache: files, no config.json
    _save_atomic(_Saves("config.json"), _Saves("tokenizer.json"), target, {"sft_steps": 1})
    assert (target / "config.json").is_file() and not (target / "leftover").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]  # no temporary or set-aside folder left
    _save_atomic(_Saves("model.safetensors"), _Saves("tokenizer.json"), target, {})  # a complete one is kept
    assert not (target / "model.safetensors").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
