"""Data sources, skip counts, split determinism."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import DataSection
from pipeline.data.sources import BUNDLED_DATA, DataError, is_eval, load_records, to_prompt

GOOD = {"synth_id": "a1", "language": "de", "exercise": "memorization", "query": "Was ist die Hauptstadt von Bayern?",
        "query_seed_text": "", "synthetic_answer": "München."}


def test_bundled_sample_data_is_varied_german():
    rows = [json.loads(l) for l in BUNDLED_DATA.read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 300
    assert {"memorization", "arithmetic", "rag"} <= {r["exercise"] for r in rows}
    words = sorted(len(r["synthetic_answer"].split()) for r in rows)
    assert words[0] <= 2 and words[-1] >= 20  # a few words to a few sentences
    assert all(r["language"] == "de" for r in rows)
    assert sum("ä" in r["synthetic_answer"] or "ü" in r["synthetic_answer"] or "ö" in r["synthetic_answer"] or "ß" in r["synthetic_answer"] for r in rows) > 30


def test_bundled_split_is_deterministic_and_disjoint():
    cfg = DataSection()
    a_train, a_eval, rep = load_records(cfg, log=None)
    b_train, b_eval, _ = load_records(cfg, log=None)
    assert [r["id"] for r in a_train] == [r["id"] for r in b_train]
    assert {r["id"] for r in a_eval} == {r["id"] for r in b_eval}
    assert not {r["id"] for r in a_train} & {r["id"] for r in a_eval}
    assert 0.03 < len(a_eval) / (len(a_train) + len(a_eval)) < 0.2
    assert rep.used == len(a_train) + len(a_eval)


def test_split_depends_on_id_not_order():
    ids = [f"row{i}" for i in range(500)]
    assert [i for i in ids if is_eval(i, 0.1)] == [i for i in reversed(ids) if is_eval(i, 0.1)][::-1]


def _bad_rows():
    return [
        GOOD,
        {**GOOD, "synth_id": "a2", "query": ""},
        {**GOOD, "synth_id": "a3", "synthetic_answer": "   "},
        {**GOOD, "synth_id": "a4", "language": "en"},
        {**GOOD, "synth_id": "a5", "query": 17},
        {**GOOD, "synth_id": "a6"},
    ]


def test_local_jsonl_skips_and_counts_by_reason(tmp_path, capsys):
    path = tmp_path / "synth.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in _bad_rows()) + "\n{broken\n", encoding="utf-8")
    train, held, rep = load_records(DataSection(source="local", path=str(path), eval_fraction=0.01))
    assert {r["id"] for r in train + held} == {"a1", "a6"}
    assert rep.skipped == {"missing_question": 1, "missing_answer": 1, "wrong_language": 1, "wrong_type": 1, "broken_json": 1}
    out = capsys.readouterr().out
    assert "skipped 5" in out and "missing_answer 1" in out and "wrong_language 1" in out


def test_local_parquet_folder(tmp_path):
    rows = [{**GOOD, "synth_id": f"p{i}", "query": f"Frage {i}?", "synthetic_answer": f"Antwort {i}."} for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows[:20]), tmp_path / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[20:]), tmp_path / "part-1.parquet")
    train, held, rep = load_records(DataSection(source="local", path=str(tmp_path)), log=None)
    assert rep.used == 40 and len(train) + len(held) == 40


def test_synth_streaming_path_on_a_local_dataset(tmp_path):
    """The hub code path (datasets streaming + language filter), pointed at a local folder."""
    rows = [{**GOOD, "synth_id": f"s{i}", "language": "de" if i % 3 else "en", "query": f"Frage {i}?"} for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train-00000.parquet")
    cfg = DataSection(source="synth", hub_id=str(tmp_path), split="train", max_samples=15)
    train, held, rep = load_records(cfg, log=None)
    recs = train + held
    assert len(recs) == 15 and all(r["question"].startswith("Frage") for r in recs)
    assert {int(r["id"][1:]) % 3 for r in recs} <= {1, 2}  # English rows filtered out by the stream


def test_rag_rows_carry_their_seed_text_into_the_prompt():
    train, held, _ = load_records(DataSection(), log=None)
    rag = next(r for r in train if r["context"])
    msgs = to_prompt(rag, "System")
    assert msgs[0] == {"role": "system", "content": "System"}
    assert rag["context"] in msgs[1]["content"] and rag["question"] in msgs[1]["content"]
    plain = next(r for r in train if not r["context"])
    assert to_prompt(plain, "S")[1]["content"] == plain["question"]


def test_nothing_usable_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({**GOOD, "language": "fr"}) + "\n")
    with pytest.raises(DataError, match="no usable training rows.*wrong_language 1"):
        load_records(DataSection(source="local", path=str(path)), log=None)


def test_squad_format_xquad(xquad_path):
    train, held, rep = load_records(DataSection(source="squad", path=str(xquad_path), max_context_chars=4000), log=None)
    assert rep.used == 1190 and len(train) + len(held) == 1190
    r = train[0]
    assert r["context"] and r["question"] and r["reference"]
    assert r["reference"] in r["context"]  # SQuAD answers are spans of the paragraph


def test_squad_skips_questions_without_answers(tmp_path):
    doc = {"data": [{"paragraphs": [{"context": "Der Rhein fließt durch Köln.", "qas": [
        {"id": "q1", "question": "Welcher Fluss?", "answers": [{"text": "Der Rhein", "answer_start": 0}]},
        {"id": "q2", "question": "Welche Stadt?", "answers": []},
        {"id": "q3", "question": "", "answers": [{"text": "Köln", "answer_start": 22}]},
    ]}]}]}
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    train, held, rep = load_records(DataSection(source="squad", path=str(path), eval_fraction=0.01), log=None)
    assert [r["id"] for r in train + held] == ["q1"]
    assert rep.skipped == {"missing_answer": 1, "missing_question": 1}


def test_min_reference_words_keeps_long_answers_and_counts_the_rest():
    train, held, rep = load_records(DataSection(min_reference_words=10), log=None)
    assert all(len(r["reference"].split()) >= 10 for r in train + held)
    assert rep.skipped["short_reference"] > 0 and rep.used == len(train) + len(held)
