"""German QA data: PleIAs/SYNTH (streamed), local SYNTH-schema files, SQuAD-format JSON, bundled sample.

Every source yields the same record: ``id``, ``question``, ``reference``, ``context``. Bad rows are
skipped and counted by reason; the split is by a hash of the row id so it never depends on order.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from pipeline.config import DataSection

BUNDLED_DATA = Path(__file__).resolve().parent / "sample_data" / "de_qa.jsonl"
# SYNTH exercises whose question is about the seed text; for the others (memorization, ...)
# the seed text is the source the question was written from, and showing it would leak the answer.
CONTEXT_EXERCISES = ("rag",)


class DataError(ValueError):
    """No usable rows, or a source that cannot be read."""


@dataclass
class SkipReport:
    read: int = 0
    used: int = 0
    skipped: Counter = field(default_factory=Counter)

    def summary(self, source: str) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items())) or "none"
        return f"data[{source}]: {self.read} rows read, {self.used} used, skipped {sum(self.skipped.values())} ({reasons})"


def _text(value: Any) -> str | None:
    return value.strip() if isinstance(value, str) else None


def synth_record(row: Any, language: str | None) -> tuple[dict | None, str | None]:
    """A SYNTH-schema row to a record, or (None, reason)."""
    if not isinstance(row, dict):
        return None, "wrong_type"
    q, a = row.get("query"), row.get("synthetic_answer")
    if q is not None and not isinstance(q, str) or a is not None and not isinstance(a, str):
        return None, "wrong_type"
    q, a = _text(q), _text(a)
    if not q:
        return None, "missing_question"
    if not a:
        return None, "missing_answer"
    lang = row.get("language")
    if language and lang is not None and lang != language:
        return None, "wrong_language"
    rid = row.get("synth_id")
    rid = str(rid) if rid not in (None, "") else hashlib.sha1(f"{q}\x00{a}".encode()).hexdigest()[:16]
    context = _text(row.get("query_seed_text")) or "" if row.get("exercise") in CONTEXT_EXERCISES else ""
    return {"id": rid, "question": q, "reference": a, "context": context}, None


def _read_jsonl(path: Path, report: SkipReport) -> Iterator[Any]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                report.read += 1
                report.skipped["broken_json"] += 1


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet"))
    if not files:
        raise DataError(f"data.path: {path} holds no .jsonl or .parquet files")
    return files


def _iter_local(path: Path, report: SkipReport) -> Iterator[Any]:
    for f in _local_files(path):
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
                yield from batch.to_pylist()
        else:
            yield from _read_jsonl(f, report)


def _iter_synth_hub(cfg: DataSection) -> Iterator[Any]:
    import datasets

    ds = datasets.load_dataset(cfg.hub_id, split=cfg.split, streaming=True)
    if cfg.language:
        ds = ds.filter(lambda r: r.get("language") == cfg.language)
    return iter(ds)


def squad_records(path: Path, report: SkipReport, max_context_chars: int) -> Iterator[dict]:
    """SQuAD-format JSON (GermanQuAD, XQuAD, MLQA-de): question + context, first answer as reference."""
    for f in _local_files(path):
        try:
            doc = json.loads(f.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"data.path: {f} is not valid JSON ({e})") from None
        articles = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(articles, list):
            raise DataError(f"data.path: {f} is not SQuAD format (expected a top-level 'data' list)")
        for article in articles:
            for para in article.get("paragraphs", []) if isinstance(article, dict) else []:
                context = _text(para.get("context")) or ""
                for qa in para.get("qas", []):
                    report.read += 1
                    if not isinstance(qa, dict):
                        report.skipped["wrong_type"] += 1
                        continue
                    q = _text(qa.get("question"))
                    answers = qa.get("answers") or []
                    a = _text(answers[0].get("text")) if answers and isinstance(answers[0], dict) else None
                    if not q:
                        report.skipped["missing_question"] += 1
                    elif not a:
                        report.skipped["missing_answer"] += 1
                    else:
                        rid = str(qa.get("id") or hashlib.sha1(f"{q}\x00{a}".encode()).hexdigest()[:16])
                        yield {"id": rid, "question": q, "reference": a, "context": context[:max_context_chars]}


def iter_records(cfg: DataSection, report: SkipReport) -> Iterator[dict]:
    if cfg.source == "squad":
        yield from squad_records(Path(cfg.path), report, cfg.max_context_chars)
        return
    rows: Iterable[Any]
    if cfg.source == "bundled":
        rows = _read_jsonl(BUNDLED_DATA, report)
    elif cfg.source == "local":
        rows = _iter_local(Path(cfg.path), report)
    elif cfg.source == "synth":
        rows = _iter_synth_hub(cfg)
    else:
        raise DataError(f"data.source: {cfg.source!r} is not one of bundled, synth, local, squad")
    for row in rows:
        report.read += 1
        rec, reason = synth_record(row, cfg.language)
        if rec is None:
            report.skipped[reason] += 1
            continue
        yield rec


def is_eval(row_id: str, eval_fraction: float) -> bool:
    """Stable across runs, machines and row order: the first 8 bytes of sha256(id) as a fraction."""
    h = int.from_bytes(hashlib.sha256(row_id.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < eval_fraction


def load_records(cfg: DataSection, log=print) -> tuple[list[dict], list[dict], SkipReport]:
    """(train, eval, report). Raises DataError when nothing usable is left."""
    report = SkipReport()
    train: list[dict] = []
    held: list[dict] = []
    seen: set[str] = set()
    for rec in iter_records(cfg, report):
        if cfg.min_reference_words and len(rec["reference"].split()) < cfg.min_reference_words:
            report.skipped["short_reference"] += 1
            continue
        if rec["id"] in seen:
            report.skipped["duplicate_id"] += 1
            continue
        seen.add(rec["id"])
        (held if is_eval(rec["id"], cfg.eval_fraction) else train).append(rec)
        report.used += 1
        if cfg.max_samples and report.used >= cfg.max_samples:
            break
    if log:
        log(report.summary(cfg.source))
    if not train:
        raise DataError(
            f"data[{cfg.source}]: no usable training rows ({report.summary(cfg.source)}); "
            "each row needs a non-empty question (query) and answer (synthetic_answer) in language "
            f"{cfg.language!r}"
        )
    return train, held, report


def user_message(rec: dict) -> str:
    if rec.get("context"):
        return f"Text:\n{rec['context']}\n\nFrage: {rec['question']}"
    return rec["question"]


def to_prompt(rec: dict, system_prompt: str) -> list[dict[str, str]]:
    """Conversational prompt: TRL applies the policy tokenizer's chat template to it."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": user_message(rec)}]


def to_trl_rows(records: list[dict], system_prompt: str) -> list[dict]:
    """Rows for TRL's GRPOTrainer; the extra columns reach every reward function as kwargs."""
    return [
        {"prompt": to_prompt(r, system_prompt), "question": r["question"], "reference": r["reference"], "id": r["id"]}
        for r in records
    ]
