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
# SYNTH exercises whose question is about the source text (SYNTH's `query_seed_text`); for the others (memorization, ...)
# that text is the source the question was written from, and showing it would leak the answer.
CONTEXT_EXERCISES = ("rag",)


class DataError(ValueError):
    """No usable rows, or a source that cannot be read."""


@dataclass
class SkipReport:
    read: int = 0
    used: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0  # prompts whose context was shortened to data.max_prompt_length
    max_prompt_length: int | None = None

    def summary(self, source: str) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items())) or "none"
        line = f"data[{source}]: {self.read} rows read, {self.used} used, skipped {sum(self.skipped.values())} ({reasons})"
        if self.max_prompt_length is not None:
            line += f", {self.truncated} prompts truncated to {self.max_prompt_length} tokens"
        return line


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
    rid = row_id(row.get("synth_id"), q, a)
    context = _text(row.get("query_seed_text")) or "" if row.get("exercise") in CONTEXT_EXERCISES else ""
    return {"id": rid, "question": q, "reference": a, "context": context}, None


def row_id(given: Any, question: str, answer: str) -> str:
    """The row's own id, else a stable one from its text (the same row keeps its id, so its split)."""
    return str(given) if given not in (None, "") else hashlib.sha1(f"{question}\x00{answer}".encode()).hexdigest()[:16]


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
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
                    yield from batch.to_pylist()
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"data.path: {f} is not a readable Parquet file ({type(e).__name__}: {e})") from None
        else:
            try:
                yield from _read_jsonl(f, report)
            except UnicodeDecodeError as e:
                raise DataError(f"data.path: {f} is not UTF-8 text ({e})") from None


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
                        rid = row_id(qa.get("id") or None, q, a)
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


def check_source(cfg: DataSection) -> None:
    """Before Ray starts: read until the first usable row (all of an unusable file). Raises DataError
    naming the file and the reason, so bad data exits 2 instead of failing inside every worker."""
    report = SkipReport()
    try:
        for rec in iter_records(cfg, report):
            if not cfg.min_reference_words or len(rec["reference"].split()) >= cfg.min_reference_words:
                return
            report.skipped["short_reference"] += 1
    except OSError as e:
        raise DataError(f"data.path: cannot read {e.filename or cfg.path}: {e.strerror or e}") from None
    field, where = ("data.path", cfg.path) if cfg.source in ("local", "squad") else ("data.hub_id", cfg.hub_id)
    if cfg.source == "bundled":
        field, where = "data.source", f"bundled ({BUNDLED_DATA})"
    raise DataError(
        f"{field}: {where} yields no usable rows ({report.summary(cfg.source)}); each row needs a non-empty "
        f"question and answer" + (f" in language {cfg.language!r}" if cfg.source in ("synth", "local") else "")
    )


def is_eval(row_id: str, eval_fraction: float) -> bool:
    """Stable across runs, machines and row order: the first 8 bytes of sha256(id) as a fraction."""
    h = int.from_bytes(hashlib.sha256(row_id.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < eval_fraction


def load_records(cfg: DataSection, log=print, tokenizer=None) -> tuple[list[dict], list[dict], SkipReport]:
    """(train, eval, report). Raises DataError when nothing usable is left.

    With the policy's ``tokenizer``, every prompt is fitted to ``data.max_prompt_length`` tokens
    (``fit_prompt``): TRL 1.x no longer truncates prompts itself.
    """
    report = SkipReport(max_prompt_length=cfg.max_prompt_length if tokenizer is not None else None)
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
        if tokenizer is not None:
            fitted = fit_prompt(rec, tokenizer, cfg.system_prompt, cfg.max_prompt_length)
            if fitted is None:
                report.skipped["prompt_too_long"] += 1
                continue
            report.truncated += fitted is not rec
            rec = fitted
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


def prompt_token_count(rec: dict, tokenizer, system_prompt: str) -> int:
    """Tokens of the prompt as TRL tokenizes it for generation (chat template, generation prompt)."""
    ids = tokenizer.apply_chat_template(to_prompt(rec, system_prompt), add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return len(ids)


def fit_prompt(rec: dict, tokenizer, system_prompt: str, max_tokens: int) -> dict | None:
    """``rec`` if its prompt fits ``max_tokens``; else a copy with the context's tail cut (the question
    is what the answer needs, so it is never shortened); None when the question alone does not fit."""
    def fits(r: dict) -> bool:
        return prompt_token_count(r, tokenizer, system_prompt) <= max_tokens

    if fits(rec):
        return rec
    context = rec.get("context") or ""
    bare = {**rec, "context": ""}
    if not context or not fits(bare):
        return None
    lo, hi = 0, len(context)  # the longest prefix (in characters) that fits, by bisection
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits({**rec, "context": context[:mid] + " …"}) else (lo, mid)
    head = context[:lo]
    if " " in head[-40:]:  # end on a word boundary when one is near
        head = head[: head.rstrip().rfind(" ")]
    cut = {**rec, "context": head.rstrip() + " …"} if head.strip() else bare
    return cut if fits(cut) else bare
