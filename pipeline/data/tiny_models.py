"""The offline tiny policy: a byte-level BPE tokenizer and a small Llama, warm-started on the bundled data.

Built once, cached by a hash of its inputs, saved with ``save_pretrained`` so that the training code
loads it exactly like a hub model. The warm start stops at a loss near 1.7 on purpose: an
over-trained tiny policy is near-deterministic (entropy ~0.2 before any RL), which hides the very
pathologies this project is about; at ~1.7 its entropy is ~2.5-3, like a real instruct model.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.data.sources import BUNDLED_DATA, to_prompt

BUILD_VERSION = 1  # bump when the recipe below changes
SYSTEM_PROMPT = "Du bist ein hilfreicher Assistent. Antworte kurz auf Deutsch."
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class TinyRecipe:
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    target_loss: float = 1.7  # stop the warm start here (see module docstring)
    max_sft_steps: int = 600
    batch_size: int = 16
    learning_rate: float = 3e-3
    seed: int = 1234


def cache_root() -> Path:
    return Path(os.environ.get("SYNTH_GRPO_CACHE") or Path.home() / ".cache" / "synth-grpo")


def recipe_hash(recipe: TinyRecipe) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({**asdict(recipe), "v": BUILD_VERSION, "t": CHAT_TEMPLATE}, sort_keys=True).encode())
    h.update(BUNDLED_DATA.read_bytes())
    return h.hexdigest()[:12]


def policy_dir(recipe: TinyRecipe = TinyRecipe(), root: Path | None = None) -> Path:
    return (root or cache_root()) / f"tiny-policy-{recipe_hash(recipe)}"


def _records() -> list[dict]:
    with BUNDLED_DATA.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        {"question": r["query"], "reference": r["synthetic_answer"],
         "context": r["query_seed_text"] if r.get("exercise") == "rag" else ""}
        for r in rows
    ]


def train_byte_level_bpe(texts, vocab_size: int, extra_special: tuple[str, ...] = (), padding_side: str = "left"):
    """A byte-level BPE tokenizer (no unknown bytes: umlauts and ß always encode) with <pad>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=list(extra_special) or None, padding_side=padding_side,
    )


def build_tokenizer(records: list[dict], recipe: TinyRecipe):
    texts = [SYSTEM_PROMPT] + [t for r in records for t in (r["question"], r["reference"], r["context"]) if t]
    fast = train_byte_level_bpe(texts, recipe.vocab_size, extra_special=("<|system|>", "<|user|>", "<|assistant|>"))
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _sft_examples(tokenizer, records: list[dict]) -> list[tuple[list[int], int]]:
    """(ids, prompt_len): the loss covers the answer and its EOS, never the prompt."""
    out = []
    for r in records:
        prompt = tokenizer.apply_chat_template(to_prompt(r, SYSTEM_PROMPT), add_generation_prompt=True, tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(r["reference"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((p_ids + a_ids, len(p_ids)))
    return out


def build(recipe: TinyRecipe = TinyRecipe(), out: Path | None = None, log=print) -> Path:
    """Train tokenizer + warm-start the policy; returns the saved folder."""
    import torch  # lazy: only building the tiny models needs torch
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: imports torch

    target = out or policy_dir(recipe)
    t0 = time.time()
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    records = _records()
    tokenizer = build_tokenizer(records, recipe)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, max_position_embeddings=recipe.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    examples = _sft_examples(tokenizer, records)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
    rng = random.Random(recipe.seed)
    ema, step = None, 0
    model.train()
    for step in range(1, recipe.max_sft_steps + 1):
        input_ids, mask, labels = _sft_batch(rng.sample(examples, recipe.batch_size), tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if step % 50 == 0 and log:
            log(f"build-tiny: step {step} loss {ema:.3f} ({time.time() - t0:.0f}s)")
        if step >= 50 and ema <= recipe.target_loss:
            break
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    _save_atomic(model, tokenizer, target, {"recipe": asdict(recipe), "sft_steps": step, "sft_loss": ema,
                                            "seconds": time.time() - t0})
    if log:
        log(f"build-tiny: {target} (SFT {step} steps, loss {ema:.2f}, {time.time() - t0:.0f}s)")
    return target


def _sft_batch(batch: list[tuple[list[int], int]], pad_id: int):
    """(input_ids, attention_mask, labels) of (token ids, prompt length) pairs, right-padded; the loss
    counts the answer tokens only."""
    import torch  # lazy: only building the tiny models needs torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (ids, plen) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, plen : len(ids)] = torch.tensor(ids[plen:])
        mask[i, : len(ids)] = 1
    return input_ids, mask, labels


def _save_atomic(model, tokenizer, target: Path, meta: dict) -> None:
    """Save to a temporary sibling folder, then rename it into place."""
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "synth_grpo_tiny.json").write_text(json.dumps(meta, indent=1))
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(target)  # atomic: a concurrent builder either wins or finds it done
    except OSError:
        if not (target / "config.json").is_file():  # a folder without a model (half deleted): set aside, then replaced
            aside = target.with_name(target.name + f".broken{os.getpid()}")
            target.rename(aside)
            tmp.rename(target)
            shutil.rmtree(aside, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_tiny(recipe: TinyRecipe = TinyRecipe(), root: Path | None = None, force: bool = False, log=print) -> Path:
    """The cached tiny policy folder, built on first use."""
    target = policy_dir(recipe, root)
    if force:
        shutil.rmtree(target, ignore_errors=True)
    if (target / "config.json").is_file():
        return target
    return build(recipe, target, log=log)


def build_tiny_cli(args) -> int:
    path = ensure_tiny(root=Path(args.out) if args.out else None, force=args.force)
    print(path)
    return 0
