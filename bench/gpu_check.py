"""The GPU path, checked in one command: the real pipeline on random-init models of the real shapes,
measured memory per phase against `synth-grpo plan`.

GPU (default): the policy has Llama-3.1-8B's shape and the judge Qwen2.5-7B's (the planner's built-in
shapes), both random-initialised here, so nothing is downloaded; a byte-level BPE trained on the bundled
data is padded to each real vocabulary. They are saved like hub models and run through the project's own
code: `pipeline.training.driver.run_training` (Ray Train, one worker per GPU), `pipeline.training.worker` (LoRA r32
all-linear, bf16, fused AdamW, HF generation, or vLLM when it is installed), `pipeline.scoring.pool` (the
judge as a Ray actor on the same GPU). For num_generations 4, 8, 16 and the largest the planner says fits,
a few GRPO steps each, measuring peak memory per phase (generation, training) with
`torch.cuda.max_memory_allocated` / `max_memory_reserved`, seconds per step, generated tokens/s; and the
judge's scores/s in one forward pass vs generate-and-parse. Cases run smallest first; when the time
budget runs short the largest are skipped, and the output says so.

CPU (`--device cpu`): the same plumbing with tiny shapes in fp32, for CI. The weight, LoRA, gradient and
optimizer terms, counted from the real tensors inside the Ray Train worker, must equal the planner's to
the byte (`exact_terms_ok`); on a GPU the same check runs in bf16.

    python -m bench.gpu_check --minutes 8 --out results/          # one GPU machine, table
    python -m bench.gpu_check --device cpu --json --out /tmp/gc     # CI: tiny shapes, JSON

Exit codes: 0 all cases that ran passed and the exact terms match; 1 a case failed or a term differs;
2 bad arguments (before Ray or any model starts).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (python bench/gpu_check.py): the repo root in bench/'s place, as python -m has it
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import print_json
from pipeline.config import REPO_ROOT, ConfigError, DataSection, load_config
from pipeline.data.sources import load_records
from pipeline.data.tiny_models import CHAT_TEMPLATE, train_byte_level_bpe
from pipeline.plan import memory as M
import pipeline.training.driver as driver
import pipeline.training.worker as worker
from pipeline.training.driver import init_ray, prepare_run_dir, run_training
from pipeline.seams.trl_seams import replace_rollout_methods, rollout_methods

GIB = M.GIB
BUILD_VERSION = 1  # bump when the model/tokenizer recipe below changes (the model cache is keyed by it)
EXACT_TERMS = ("base_weights", "lora_weights", "gradients", "optimizer_states")
TOKENIZER_TRAINED_SIZE = 1000  # BPE merges learned from the bundled data; the rest of the vocabulary is filler
CHAT_SPECIALS = ("<|system|>", "<|user|>", "<|assistant|>")
# Ray GPU shares: each worker takes 0.9 of a GPU, so two never share one, and the judge's 0.1 puts it
# beside one of them (judge.placement same_gpu, as the planner counts it).
JUDGE_GPU_SHARE = 0.1


@dataclass(frozen=True)
class Mode:
    """Shapes and run sizes of one mode; the run's other settings come from configs/sauerkraut-8b.yaml."""

    name: str
    policy: M.ModelShape
    judge: M.ModelShape
    generations: tuple[int, ...]  # cases, smallest first; the planner's largest that fits is added on a GPU
    completion_length: int
    steps: int
    lora_r: int
    precision: str
    batch: int  # per-device batch at num_generations 8 (scaled with num_generations, prompts per round kept)
    grad_accum: int
    steps_per_generation: int
    judge_batches: int  # batches timed for judge scores/s


def gpu_mode() -> Mode:
    policy = M.builtin_shape("meta-llama/Llama-3.1-8B-Instruct")
    judge = M.builtin_shape("Qwen/Qwen2.5-7B-Instruct")
    assert policy is not None and judge is not None
    # sauerkraut-8b.yaml's batch structure (batch 8, accumulation 4, 8 steps per generation): 2 optimizer
    # steps per generation round; completions cut at 256 so four cases fit in eight minutes.
    return Mode("gpu", policy, judge, (4, 8, 16), 256, 2, 32, "bf16", 8, 4, 8, 6)


def cpu_mode() -> Mode:
    policy = M.ModelShape(64, 176, 2, 4, 2, 1024, max_positions=1024, source="tiny Llama shape")
    judge = M.ModelShape(64, 128, 2, 4, 2, 1280, qkv_bias=True, max_positions=2048, source="tiny Qwen2 shape")
    return Mode("cpu", policy, judge, (2, 4), 12, 2, 8, "fp32", 8, 1, 1, 2)


# ---------------------------------------------------------------- tokenizer and random-init models


def training_texts() -> list[str]:
    """Questions, answers and contexts of the bundled data, the system prompt and the judge's rubric."""
    from rewards.judge import RUBRIC  # lazy: imports torch and transformers

    train, held, _ = load_records(DataSection(source="bundled"), log=None)
    texts = [t for r in train + held for t in (r["question"], r["reference"], r.get("context") or "") if t]
    return texts + [DataSection().system_prompt, RUBRIC]


def padded_tokenizer(texts: list[str], vocab_size: int):
    """`pipeline.data.tiny_models.train_byte_level_bpe` (+ the tiny policy's chat template), its BPE vocabulary padded
    with filler tokens up to `vocab_size`, so every id a random model samples decodes. Filler tokens are
    3-byte strings no merge produces: encoding is unchanged, decoding gives random bytes."""
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    trained = train_byte_level_bpe(texts, min(TOKENIZER_TRAINED_SIZE, vocab_size), extra_special=CHAT_SPECIALS)
    data = json.loads(trained.backend_tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    n, k = len(alphabet), 0
    while len(vocab) < vocab_size:
        token = alphabet[k // (n * n) % n] + alphabet[k // n % n] + alphabet[k % n]
        k += 1
        if token not in vocab:
            vocab[token] = len(vocab)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=list(CHAT_SPECIALS), padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) != vocab_size:
        raise RuntimeError(f"padded tokenizer has {len(fast)} tokens, expected {vocab_size}")
    return fast


def hf_config(shape: M.ModelShape, tokenizer, family: str):
    """A transformers config of exactly this shape (the planner's ModelShape, read back by resolve_shape)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions, tie_word_embeddings=shape.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    if family == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common, attention_bias=shape.o_bias, mlp_bias=shape.mlp_bias)


def _model_key(mode: Mode) -> str:
    blob = json.dumps([BUILD_VERSION, dataclasses.asdict(mode.policy), dataclasses.asdict(mode.judge), mode.precision],
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_models(mode: Mode, root: Path, device: str, log=print) -> tuple[Path, Path]:
    """Random-init policy and judge saved with save_pretrained (cached under `root` by shape); returns the folders."""
    import torch
    from transformers import AutoModelForCausalLM

    base = root / f"models-{mode.name}-{_model_key(mode)}"
    folders = (base / "policy", base / "judge")
    if all((f / "config.json").is_file() for f in folders):
        return folders
    texts = training_texts()
    dtype = torch.bfloat16 if mode.precision == "bf16" else torch.float32
    for folder, shape, family, seed in ((folders[0], mode.policy, "llama", 0), (folders[1], mode.judge, "qwen2", 1)):
        t0 = time.perf_counter()
        tokenizer = padded_tokenizer(texts, shape.vocab_size)
        torch.manual_seed(seed)
        with torch.device(device):  # initialised on the GPU: seconds, not minutes, for 8B parameters
            model = AutoModelForCausalLM.from_config(hf_config(shape, tokenizer, family), dtype=dtype)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        tmp.rename(folder)
        if log:
            log(f"[gpu_check] built {family} {shape.source} ({shape.param_count() / 1e9:.3f}B params) in "
                f"{time.perf_counter() - t0:.0f}s: {folder}")
    return folders


# ---------------------------------------------------------------- the run config of one case


def case_config(mode: Mode, g: int, backend: str, policy: Path, judge: Path, work: Path, num_gpus: int,
                use_gpu: bool, steps: int, completion_length: int, extra: list[str]):
    """configs/sauerkraut-8b.yaml with the random-init models, bundled data, one GPU's share per worker and
    the judge on GPU 0; the per-device batch grows with num_generations (prompts per round kept), rounded
    up to TRL's divisibility rule exactly as `synth-grpo plan`'s sweep does."""
    base = load_config(REPO_ROOT / "configs" / "sauerkraut-8b.yaml", [
        f"distributed.num_workers={num_gpus}", "distributed.zero_stage=0",
        f"optimization.per_device_train_batch_size={mode.batch}", "generation.num_generations=8",
        f"optimization.gradient_accumulation_steps={mode.grad_accum}",
        f"generation.steps_per_generation={mode.steps_per_generation}",
    ])
    batch = M.scaled_batch(base, g, num_gpus)
    sets = [
        f"model.name_or_path={policy}", f"judge.model={judge}", f"judge.placement={'same_gpu' if use_gpu else 'none'}", "judge.num_actors=1",
        f"judge.gpus_per_actor={JUDGE_GPU_SHARE if use_gpu else 0}", f"judge.cpus_per_actor={1 if use_gpu else 0.5}",
        "data.source=bundled", f"lora.r={mode.lora_r}", f"optimization.precision={mode.precision}",
        f"distributed.num_workers={num_gpus}", f"distributed.use_gpu={str(use_gpu).lower()}",
        "distributed.gpus_per_worker=1",  # same_gpu: the workers ask for 1 - the judge's share (reward_pool.training_worker_gpus)
        f"distributed.cpus_per_worker={2 if use_gpu else 1}",
        "distributed.zero_stage=0", "distributed.max_failures=0",
        f"generation.num_generations={g}", f"generation.backend={backend}",
        f"generation.max_completion_length={completion_length}",
        f"generation.steps_per_generation={mode.steps_per_generation}",
        f"optimization.per_device_train_batch_size={batch}", f"optimization.gradient_accumulation_steps={mode.grad_accum}",
        f"optimization.max_steps={steps}", "optimization.warmup_ratio=0.0",
        "logging.report_to=[]", "logging.progress_bar=false", "logging.ray_metrics=false", "logging.samples_every=1000",
        f"output.root={work / 'runs'}", f"output.run_name=g{g}-{backend}", "output.save_steps=1000000",
        "output.checkpoints_kept=1", "eval.num_prompts=0",
        *extra,
    ]
    return load_config(REPO_ROOT / "configs" / "sauerkraut-8b.yaml", sets)


def planned(cfg, gpu_gib: float | None, num_gpus: int, prompt_width: int | None = None) -> M.MemoryPlan:
    """`synth-grpo plan` for this case, at the prompt width the run really had when it is known."""
    if prompt_width:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_length=prompt_width))
    return M.plan_run(cfg, gpu_gib, num_gpus)


# ---------------------------------------------------------------- measuring inside the Ray Train worker


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Probe:
    """Measures one Ray Train worker: wraps the GRPOTrainer instance's generation and training step (the
    methods still run unchanged) and counts the real tensors behind each persistent planner term."""

    def __init__(self, run_dir: Path, rank: int):
        import torch

        self.cuda = torch.cuda.is_available()
        self.run_dir, self.rank = run_dir, rank
        self.rec: dict[str, Any] = {"rank": rank, "gen": [], "train": [], "steps": [], "generate_calls": []}
        self._step_t0: float | None = None

    # -- memory -------------------------------------------------------------------------------------
    def _mem(self) -> dict[str, int]:
        import torch

        if not self.cuda:
            return {}
        free, total = torch.cuda.mem_get_info()
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
                "device_used": total - free, "device_total": total}

    def _start(self) -> tuple[dict[str, int], float]:
        """A phase starts: peak counters reset; (memory now, time now)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return self._mem(), time.perf_counter()

    def _phase(self, start: dict[str, int], t0: float, **extra) -> dict[str, Any]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        end = self._mem()
        row = {"seconds": time.perf_counter() - t0, **extra}
        if end:
            row.update(start_allocated=start["allocated"], peak_allocated=end["peak_allocated"],
                       peak_reserved=end["peak_reserved"], reserved=end["reserved"], device_used=end["device_used"],
                       device_total=end["device_total"],
                       # the whole card (every process) at this phase's peak: now + what the allocator has since let go
                       device_peak=end["device_used"] + max(0, end["peak_reserved"] - end["reserved"]))
        return row

    # -- wrapping ------------------------------------------------------------------------------------
    def attach(self, trainer) -> None:
        from transformers import TrainerCallback

        probe, step = self, trainer.training_step
        generate_one, gen_and_score = rollout_methods(trainer)

        def generate_single_turn(prompt_ids, *args, **kwargs):
            start, t0 = probe._start()
            completion_ids, *rest = generate_one(prompt_ids, *args, **kwargs)
            probe.rec["generate_calls"].append(probe._phase(
                start, t0, sequences=len(completion_ids), prompt_width=max(len(p) for p in prompt_ids),
                tokens=sum(len(c) for c in completion_ids), max_completion=max(len(c) for c in completion_ids)))
            return (completion_ids, *rest)

        def generate_and_score(*args, **kwargs):
            start, t0 = probe._start()
            out = gen_and_score(*args, **kwargs)
            probe.rec["gen"].append(probe._phase(start, t0))
            probe._train_start, probe._train_t0 = probe._start()  # the training phase starts here
            return out

        def training_step(model, inputs, *args, **kwargs):
            probe._train_start, probe._train_t0 = probe._start()
            had_grads = any(p.grad is not None for p in probe._trainable(trainer))
            out = step(model, inputs, *args, **kwargs)
            grads = _bytes(p.grad for p in probe._trainable(trainer) if p.grad is not None)
            # gradients allocated by this backward are a persistent term, not the phase's transient
            probe.rec["train"].append(probe._phase(probe._train_start, probe._train_t0, new_grads=0 if had_grads else grads))
            probe.rec["gradients"] = grads
            return out

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                probe._step_t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                probe.rec["steps"].append(time.perf_counter() - (probe._step_t0 or time.perf_counter()))
                probe.count_persistent(trainer)

        replace_rollout_methods(trainer, generate_single_turn, generate_and_score)
        trainer.training_step = training_step
        trainer.add_callback(StepTimer())

    @staticmethod
    def _trainable(trainer):
        return [p for p in trainer.model.parameters() if p.requires_grad]

    def count_persistent(self, trainer) -> None:
        """Bytes of the real tensors behind base_weights, lora_weights and optimizer_states (after a step)."""
        params = list(trainer.model.parameters())
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        state = [t for s in opt.state.values() for k, t in s.items() if hasattr(t, "numel")]
        moments = [t for s in opt.state.values() for k, t in s.items() if hasattr(t, "numel") and k != "step"]
        self.rec.update(
            base_weights=_bytes(p for p in params if not p.requires_grad),
            lora_weights=_bytes(p for p in params if p.requires_grad),
            optimizer_states=_bytes(moments), optimizer_step_counters=_bytes(state) - _bytes(moments),
            optimizer=type(opt).__name__ + (" (fused)" if getattr(opt, "defaults", {}).get("fused") else ""),
            param_dtypes=sorted({str(p.dtype) for p in params}),
            trainable_dtypes=sorted({str(p.dtype) for p in params if p.requires_grad}),
        )

    def write(self) -> None:
        (self.run_dir / f"gpu_check_rank{self.rank}.json").write_text(json.dumps(self.rec))


def probed_train_loop(config: dict) -> None:
    """The project's Ray Train loop (`pipeline.training.worker.train_loop_per_worker`), with a Probe attached to the
    trainer it builds. Runs in the Ray Train worker; the measurements land in the run directory."""
    import ray.train

    probe = Probe(worker.WorkerArgs.of(config).run_dir, ray.train.get_context().get_world_rank())
    build = worker.build_grpo_trainer

    def build_and_probe(*args, **kwargs):
        trainer = build(*args, **kwargs)
        probe.attach(trainer)
        return trainer

    worker.build_grpo_trainer = build_and_probe
    try:
        worker.train_loop_per_worker(config)
    finally:
        worker.build_grpo_trainer = build
        probe.write()


@contextlib.contextmanager
def pickled_by_value():
    """Ship this script's functions to Ray processes by value (they cannot import bench/ by name)."""
    import ray.cloudpickle

    module = sys.modules[__name__]
    if module.__name__ != "__main__":  # __main__ is pickled by value anyway
        ray.cloudpickle.register_pickle_by_value(module)
    yield


@contextlib.contextmanager
def probed_worker_loop():
    """`pipeline.training.driver.build_trainer` hands Ray Train `driver.ray_train_loop`; point it at the probed loop
    for this run only (pickled by value; the workers import the unmodified modules and the probed loop calls into them)."""
    original = driver.ray_train_loop
    driver.ray_train_loop = probed_train_loop
    try:
        yield
    finally:
        driver.ray_train_loop = original


# ---------------------------------------------------------------- judge: one pass vs generate-and-parse


def _bench_rewards():
    """bench/rewards.py: the baseline run's generate-and-parse judge and its parser."""
    return importlib.import_module("bench.rewards")


def judge_batches(batch_size: int, n: int) -> list[tuple[list[str], list[str], list[str]]]:
    """Groups of 8 candidates per bundled question: its reference, sentences of it, other answers."""
    import random

    rows, _, _ = load_records(DataSection(source="bundled"), log=None)
    rng = random.Random(0)
    out = []
    for _ in range(n):
        q, r, c = [], [], []
        while len(c) < batch_size:
            row = rng.choice(rows)
            for k in range(min(8, batch_size - len(c))):
                q.append(row["question"])
                r.append(row["reference"])
                c.append(row["reference"] if k == 0 else rng.choice(rows)["reference"])
        out.append((q, r, c))
    return out


def _judge_throughput(actor, batches, new_tokens: int) -> dict[str, Any]:
    """Runs inside the judge actor (`__ray_call__`): scores/s of its loaded judge both ways, and its memory."""
    import torch

    gen = _bench_rewards()
    judge = actor.judge
    device = next(judge.model.parameters()).device

    def generate_and_parse(batch):
        if device.type == "cuda":
            torch.cuda.synchronize()
        with torch.device(device):  # bench/rewards.py builds its input ids with the default device
            return gen.generative_scores(judge, batch, new_tokens)

    def one_pass(batch):
        out = judge.score(*batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    one_pass(batches[0])
    generate_and_parse(batches[0])
    one, two, fails, n = [], [], 0, 0
    for b in batches:  # interleaved, so that load from other processes hits both alike
        t0 = time.perf_counter()
        one_pass(b)
        one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _, failed, _ = generate_and_parse(b)
        two.append(time.perf_counter() - t0)
        fails, n = fails + failed, n + len(b[0])
    size = len(batches[0][0])
    res = {"batch": size, "batches": len(batches), "generated_tokens": new_tokens,
           "one_pass_scores_per_s": size / statistics.median(one),
           "generate_parse_scores_per_s": size / statistics.median(two),
           "generate_parse_failures": fails / max(1, n)}
    res["speedup"] = res["one_pass_scores_per_s"] / res["generate_parse_scores_per_s"]
    return {**res, **judge_memory(actor)}


def judge_memory(actor) -> dict[str, int]:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved()}


# ---------------------------------------------------------------- cases, budget, report


@dataclass
class Case:
    num_generations: int
    backend: str = "hf"
    why: str = ""  # how it was chosen ("planner's largest that fits")
    status: str = "pending"  # ok | failed | skipped
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)


def choose_cases(generations: tuple[int, ...], planner_max: int | None, vllm: bool) -> list[Case]:
    """Smallest first, so a short budget skips the largest; the vLLM case sits beside num_generations 8."""
    cases = [Case(g) for g in sorted(set(generations))]
    if planner_max and planner_max not in set(generations):
        cases.append(Case(planner_max, why="planner's largest that fits"))
        cases.sort(key=lambda c: c.num_generations)
    elif planner_max:
        next(c for c in cases if c.num_generations == planner_max).why = "planner's largest that fits"
    if vllm:
        at = min(cases, key=lambda c: abs(c.num_generations - 8)).num_generations
        i = max(i for i, c in enumerate(cases) if c.num_generations == at)
        cases.insert(i + 1, Case(at, "vllm"))
    return cases


def estimate_seconds(case: Case, done: list[Case]) -> float | None:
    """Fixed start-up (workers, model load) of the last finished case + its step time scaled by the batch."""
    finished = [c for c in done if c.status == "ok"]
    if not finished:
        return None
    last = finished[-1]
    steps = last.result["train_seconds"]
    return last.result["wall_seconds"] - steps + steps * case.num_generations / last.num_generations


def budget_left_for(case: Case, done: list[Case], elapsed: float, budget: float, reserve: float) -> tuple[bool, str]:
    """(run it, why not): skip when the estimate says it would end past the budget minus the reserve."""
    est = estimate_seconds(case, done)
    if elapsed + reserve >= budget:
        return False, f"time budget spent ({elapsed:.0f}s of {budget:.0f}s)"
    if est is not None and elapsed + est + reserve > budget:
        return False, f"would need ~{est:.0f}s, {budget - elapsed - reserve:.0f}s left of the {budget / 60:g}-minute budget"
    return True, ""


def _gib(b: float | None) -> float | None:
    return None if b is None else b / GIB


def summarize_case(cfg, plan: M.MemoryPlan, ranks: list[dict], judge_mem: dict[str, int], wall: float,
                   train_seconds: float, num_gpus: int) -> dict[str, Any]:
    """Measured vs planned, per component and in total, for the rank that holds the judge (rank 0)."""
    r0 = min(ranks, key=lambda r: r["rank"])
    comp = plan.components
    exact = {t: {"measured_bytes": r0.get(t), "planned_bytes": round(comp[t] * GIB)} for t in EXACT_TERMS}
    gens, trains, calls = r0["gen"], r0["train"], r0["generate_calls"]
    tokens = sum(c["tokens"] for r in ranks for c in r["generate_calls"])
    gen_seconds = max(sum(c["seconds"] for c in r["generate_calls"]) for r in ranks)
    out: dict[str, Any] = {
        "batch": cfg.optimization.per_device_train_batch_size, "steps": cfg.optimization.max_steps,
        "prompt_width": max(c["prompt_width"] for c in calls), "completion_length": max(c["max_completion"] for c in calls),
        "sequences_per_generate": max(c["sequences"] for c in calls),
        "sec_per_step": train_seconds / max(1, cfg.optimization.max_steps),
        "step_seconds": r0["steps"], "generated_tokens": tokens,
        "generated_tokens_per_s": tokens / gen_seconds if gen_seconds else None,
        "wall_seconds": wall, "train_seconds": train_seconds,
        "optimizer": r0.get("optimizer"), "param_dtypes": r0.get("param_dtypes"), "trainable_dtypes": r0.get("trainable_dtypes"),
        "optimizer_step_counters_bytes": r0.get("optimizer_step_counters"),
        "exact_terms": exact,
        "exact_terms_ok": all(v["measured_bytes"] == v["planned_bytes"] for v in exact.values()),
        "planned_total_gib": plan.total_gib, "planned_peak_phase": plan.peak_phase,
        "planned": {k: round(v, 4) for k, v in comp.items()}, "measured_peak_gib": None, "rows": [],
    }
    if calls and "peak_allocated" in calls[0]:
        gen_extra = max(c["peak_allocated"] - c["start_allocated"] for c in calls)
        score_extra = max(g["peak_allocated"] - g["start_allocated"] for g in gens) if gens else None
        train_extra = max(t["peak_allocated"] - t["start_allocated"] - t["new_grads"] for t in trains)
        peak_alloc = max(x["peak_allocated"] for x in calls + gens + trains)
        peak_res = max(x["peak_reserved"] for x in calls + gens + trains)
        device_peak = max(x["device_peak"] for x in calls + gens + trains)
        judge_res = judge_mem.get("peak_reserved", 0)
        contexts = max(0, min(x["device_used"] - x["reserved"] for x in calls + gens + trains) - judge_res)
        out["measured"] = {
            "generation": _gib(gen_extra), "generation_and_scoring": _gib(score_extra), "training": _gib(train_extra),
            "peak_allocated": _gib(peak_alloc), "peak_reserved": _gib(peak_res),
            "allocator_slack": _gib(peak_res - peak_alloc), "judge_reserved": _gib(judge_res), "cuda_contexts": _gib(contexts),
        }
        out["measured_peak_gib"] = _gib(device_peak)
        out["rows"] = [
            ("generation (kv cache + transient)", _gib(gen_extra), comp["generation_kv_cache"] + comp["generation_transient"]),
            ("training (activations + logits)", _gib(train_extra), comp["activations"] + comp["logits"]),
            ("judge (weights + scoring, reserved)", _gib(judge_res) if judge_res else None,
             max(0.0, comp["judge"] - M.JUDGE_CONTEXT_GIB)),
            ("allocator slack (reserved - allocated)", _gib(peak_res - peak_alloc),
             comp["framework_overhead"] - M.CUDA_CONTEXT_GIB),
            ("CUDA contexts (card - reserved)", _gib(contexts), M.CUDA_CONTEXT_GIB + (M.JUDGE_CONTEXT_GIB if judge_res else 0)),
        ]
    return out


def case_json(c: Case) -> dict[str, Any]:
    """One case as it appears in --json: the issue's keys first, then everything measured."""
    return {"num_generations": c.num_generations, "backend": c.backend, "why": c.why, "status": c.status,
            "reason": c.reason, "measured_peak_gib": c.result.get("measured_peak_gib"),
            "planned_total_gib": c.result.get("planned_total_gib"), "sec_per_step": c.result.get("sec_per_step"),
            **{k: v for k, v in c.result.items() if k != "rows"},
            "components": [{"name": n, "measured_gib": m, "planned_gib": p} for n, m, p in c.result.get("rows", [])]}


def run_case(case: Case, cfg, pool, gpu_gib: float | None, num_gpus: int, log) -> dict[str, Any]:
    import ray  # lazy: Ray loads for a run, not for --help

    run_dir = Path(cfg.output.root) / cfg.output.run_name
    shutil.rmtree(run_dir, ignore_errors=True)
    prepare_run_dir(cfg, run_dir, log=None)
    t0 = time.perf_counter()
    with pickled_by_value(), probed_worker_loop():
        run_training(cfg, run_dir, pool=pool, log=None)
    wall = time.perf_counter() - t0
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("gpu_check_rank*.json"))]
    if not ranks or not ranks[0]["generate_calls"]:
        raise RuntimeError(f"the worker wrote no measurements to {run_dir}")
    train_seconds = max(sum(r["steps"]) for r in ranks)
    with pickled_by_value():
        judge_mem = ray.get(pool.judges[0].__ray_call__.remote(judge_memory)) if gpu_gib else {}
    width = max(c["prompt_width"] for r in ranks for c in r["generate_calls"])
    plan = planned(cfg, gpu_gib, num_gpus, width)
    return summarize_case(cfg, plan, ranks, judge_mem, wall, train_seconds, num_gpus)


def format_report(res: dict[str, Any]) -> str:
    lines = [f"gpu_check on {res['device']}: {res['num_gpus'] or 'no'} GPU(s), torch {res['torch']}, TRL {res['trl']}, "
             f"vLLM {res['vllm'] or 'not installed'}; policy {res['policy']}, judge {res['judge_model']} (random init)"]
    for c in res["cases"]:
        head = f"num_generations {c['num_generations']} ({c['backend']}{', ' + c['why'] if c.get('why') else ''})"
        if c["status"] != "ok":
            lines += ["", f"{head}: {c['status'].upper()}: {c.get('reason', '')}"]
            continue
        lines += ["", f"{head}: batch {c['batch']}, {c['steps']} steps, {c['sequences_per_generate']} sequences per "
                      f"generate, prompt {c['prompt_width']} + completion {c['completion_length']} tokens",
                  f"  {'component':<40}{'measured GiB':>13}{'planned GiB':>13}  note"]
        for name, v in c["exact_terms"].items():
            m, p = v["measured_bytes"], v["planned_bytes"]
            note = (f"exact ({m:,} bytes)" if m == p else f"DIFFERS: {m:,} vs {p:,} bytes" if m is not None
                    else "not measured")
            lines.append(f"  {name:<40}{(m or 0) / GIB:>13.3f}{p / GIB:>13.3f}  {note}")
        for row in c["components"]:
            name, m, p = row["name"], row["measured_gib"], row["planned_gib"]
            ratio = f"measured/planned {m / p:.2f}" if m is not None and p else ""
            lines.append(f"  {name:<40}{'-' if m is None else f'{m:.3f}':>13}{p:>13.3f}  {ratio}")
        m, p = c["measured_peak_gib"], c["planned_total_gib"]
        lines.append(f"  {'total (card peak / plan total)':<40}{'-' if m is None else f'{m:.3f}':>13}{p:>13.3f}  "
                     + (f"measured/planned {m / p:.2f}" if m else "(no CUDA: totals are not measured on CPU)"))
        tps = c["generated_tokens_per_s"]
        lines.append(f"  {c['sec_per_step']:.2f} s/step, {'-' if tps is None else f'{tps:.0f}'} generated tokens/s, "
                     f"optimizer {c['optimizer']}, trainable {','.join(c['trainable_dtypes'] or [])}")
    if res["cases"]:
        lines += ["", f"{'G':>4} {'backend':<8}{'batch':>6}{'measured peak GiB':>19}{'planned GiB':>13}{'s/step':>8}"
                      f"{'gen tok/s':>11}  status"]
        for c in res["cases"]:
            if c["status"] == "ok":
                m, tps = c["measured_peak_gib"], c["generated_tokens_per_s"]
                lines.append(f"{c['num_generations']:>4} {c['backend']:<8}{c['batch']:>6}{'-' if m is None else f'{m:.2f}':>19}"
                             f"{c['planned_total_gib']:>13.2f}{c['sec_per_step']:>8.2f}{'-' if tps is None else f'{tps:.0f}':>11}  ok")
            else:
                lines.append(f"{c['num_generations']:>4} {c['backend']:<8}{'':>6}{'':>19}{'':>13}{'':>8}{'':>11}  "
                             f"{c['status']}: {c.get('reason', '')}")
    j = res.get("judge_throughput")
    if j:
        lines += ["", f"judge scores/s, batches of {j['batch']}: one pass {j['one_pass_scores_per_s']:.1f}, generate "
                      f"{j['generated_tokens']} tokens + parse {j['generate_parse_scores_per_s']:.1f} "
                      f"({j['speedup']:.1f}x; parse failures {j['generate_parse_failures']:.0%})"]
    lines += ["", f"exact_terms_ok: {res['exact_terms_ok']}; {res['elapsed_s']:.0f}s of the {res['budget_s'] / 60:g}-minute budget"]
    lines += [f"note: {n}" for n in res["notes"]]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: real shapes; cpu: tiny shapes (CI)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--minutes", type=float, default=8.0, help="time budget; the largest cases are skipped first")
    ap.add_argument("--out", default="runs/gpu_check", help="results folder: gpu_check.json and gpu_check.txt")
    ap.add_argument("--work", default=None, help="models (31 GB on a GPU, cached by shape) and run directories "
                                                 "(default: synth-grpo-gpu-check in the temporary folder)")
    ap.add_argument("--generations", default=None, help="comma-separated num_generations (default 4,8,16 on a GPU, "
                                                          "2,4 on CPU); the planner's largest that fits is added on a GPU")
    ap.add_argument("--no-planner-max", action="store_true", help="do not add the planner's largest num_generations")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps per case (default: one generation round)")
    ap.add_argument("--completion-length", type=int, default=None, help="max completion tokens (default 256; CPU 12)")
    ap.add_argument("--num-gpus", type=int, default=None, help="Ray Train workers, one per GPU (default: every GPU)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="group.key=value",
                    help="extra run-config overrides, as synth-grpo train --set")
    args = ap.parse_args(argv)
    problems = []
    if args.minutes <= 0:
        problems.append(f"--minutes {args.minutes}: must be > 0")
    for name in ("steps", "completion_length", "num_gpus"):
        value = getattr(args, name)
        if value is not None and value < 1:
            problems.append(f"--{name.replace('_', '-')} {value}: must be >= 1")
    if args.generations is not None:
        try:
            args.generations = tuple(int(g) for g in args.generations.split(",") if g.strip())
            if not args.generations or min(args.generations) < 2:
                raise ValueError
        except ValueError:
            problems.append(f"--generations {args.generations!r}: comma-separated integers >= 2, e.g. 4,8,16")
    return args, problems


def main(argv: list[str] | None = None) -> int:
    args, problems = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        problems.append("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False); "
                        "use --device cpu for the tiny-shape check")
    if problems:
        print("gpu_check: " + "\n  ".join(["bad arguments:"] + problems), file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    budget = args.minutes * 60
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    on_gpu = args.device == "cuda"
    mode = gpu_mode() if on_gpu else cpu_mode()
    num_gpus = (args.num_gpus or torch.cuda.device_count()) if on_gpu else 1
    steps = args.steps or mode.steps
    completion = args.completion_length or mode.completion_length
    out = Path(args.out)
    work = Path(args.work) if args.work else Path(tempfile.gettempdir()) / "synth-grpo-gpu-check"
    out.mkdir(parents=True, exist_ok=True)
    gpu_gib = M.detect_gpu_gib() if on_gpu else None
    notes: list[str] = []
    # the models are built later: until then hub-id placeholders pass the model checks, the rest is validated
    models = ["synth-grpo/gpu-check-policy", "synth-grpo/gpu-check-judge"]

    def config_for(g: int, backend: str = "hf"):
        return case_config(mode, g, backend, *models, work, num_gpus, on_gpu, steps, completion, args.overrides)

    try:  # the run config is validated before Ray or any model starts
        config_for(8)
    except ConfigError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    vllm = importlib.util.find_spec("vllm") is not None and on_gpu

    import ray  # lazy: Ray loads for a run, not for --help

    from pipeline.scoring.pool import start_pool, stop_pool  # lazy: imports ray

    init_ray(None, log=log)
    log(f"[gpu_check] random-init models ({mode.policy.source}, {mode.judge.source}) under {work}")
    models[:] = build_models_here_or_on_a_gpu(mode, work, on_gpu, log)
    planner_max = None
    if on_gpu and not args.no_planner_max:
        cfg8 = config_for(8)
        planner_max = M.plan_run(cfg8, gpu_gib, num_gpus).max_num_generations
        notes.append(f"the planner's largest num_generations on this {gpu_gib:.1f} GiB GPU at prompt "
                     f"{cfg8.data.max_prompt_length} + completion {completion} tokens: {planner_max}")
    if on_gpu and not vllm:
        notes.append("vLLM is not installed: HF generation only (./scripts/setup.sh vllm adds it)")
    cases = choose_cases(args.generations or mode.generations, planner_max, vllm)
    base_cfg = config_for(cases[0].num_generations)
    t0 = time.perf_counter()
    pool = start_pool(base_cfg)
    log(f"[gpu_check] judge actor loaded in {time.perf_counter() - t0:.0f}s")
    judge_res: dict[str, Any] | None = None
    reserve = 20.0 if on_gpu else 5.0  # the judge timing and the report after the last case
    try:
        run_cases(cases, config_for, pool, gpu_gib, num_gpus, steps, lambda: time.perf_counter() - t_start, budget,
                  reserve, log)
        if time.perf_counter() - t_start < budget:
            batches = judge_batches(base_cfg.judge.max_batch_size, mode.judge_batches)
            with pickled_by_value():
                judge_res = ray.get(pool.judges[0].__ray_call__.remote(_judge_throughput, batches, 16))
        else:
            notes.append("judge throughput skipped: the time budget was spent")
    finally:
        stop_pool(pool)

    skipped = [c for c in cases if c.status == "skipped"]
    if skipped:
        notes.append("skipped for time (largest first): " + ", ".join(f"{c.num_generations} ({c.backend})" for c in skipped))
    ran = [c for c in cases if c.status == "ok"]
    res = result_json(mode, cases, ran, on_gpu, gpu_gib, num_gpus, vllm, budget, time.perf_counter() - t_start,
                      judge_res, notes)
    text = format_report(res)
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "gpu_check.txt").write_text(text + "\n")
    if args.json:
        print_json(res, indent=None, default=str)
    else:
        print(text, flush=True)
    failed = [c for c in cases if c.status == "failed"]
    return 0 if ran and not failed and res["exact_terms_ok"] else 1


def build_models_here_or_on_a_gpu(mode: Mode, work: Path, on_gpu: bool, log) -> tuple[Path, Path]:
    """The random-init policy and judge folders; on a GPU built in a Ray task on one GPU that then exits,
    so the driver keeps no CUDA context on the card."""
    import ray  # lazy: Ray loads for a run, not for --help

    if not on_gpu:
        return build_models(mode, work, "cpu", log)
    with pickled_by_value():
        task = ray.remote(num_gpus=1, max_calls=1)(build_models)
        return ray.get(task.remote(mode, work.resolve(), "cuda", print))


def run_cases(cases: list[Case], config_for, pool, gpu_gib: float | None, num_gpus: int, steps: int, elapsed,
              budget: float, reserve: float, log) -> None:
    """Run each case that the time left allows, in order; a failed case is reported and the next one runs."""
    done: list[Case] = []
    for case in cases:
        ok, why = budget_left_for(case, done, elapsed(), budget, reserve)
        if not ok:
            case.status, case.reason = "skipped", why
            log(f"[gpu_check] skipping num_generations {case.num_generations} ({case.backend}): {why}")
            done.append(case)
            continue
        cfg = config_for(case.num_generations, case.backend)
        log(f"[gpu_check] num_generations {case.num_generations} ({case.backend}), batch "
            f"{cfg.optimization.per_device_train_batch_size}, {steps} steps")
        try:
            case.result = run_case(case, cfg, pool, gpu_gib, num_gpus, log)
            case.status = "ok"
        except Exception as e:  # report it and go on with the next case
            cause = e
            while getattr(cause, "__cause__", None) is not None:
                cause = cause.__cause__
            case.status, case.reason = "failed", f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
            log(f"[gpu_check] num_generations {case.num_generations} ({case.backend}) failed: {case.reason}")
        done.append(case)


def result_json(mode: Mode, cases: list[Case], ran: list[Case], on_gpu: bool, gpu_gib: float | None, num_gpus: int,
                vllm: bool, budget: float, elapsed_s: float, judge_res: dict[str, Any] | None, notes: list[str]) -> dict[str, Any]:
    """The one JSON object `--json` prints and gpu_check.json holds."""
    import torch  # lazy: imports torch
    import trl  # lazy: imports trl

    return {
        "device": torch.cuda.get_device_name(0) + f" ({gpu_gib:.1f} GiB)" if on_gpu else "cpu (tiny shapes)",
        "num_gpus": num_gpus if on_gpu else 0, "mode": mode.name, "torch": torch.__version__, "trl": trl.__version__,
        "vllm": importlib.metadata.version("vllm") if vllm else None,
        "policy": mode.policy.source, "judge_model": mode.judge.source,
        "budget_s": budget, "elapsed_s": elapsed_s,
        "cases": [case_json(c) for c in cases],
        "judge_throughput": judge_res,
        "exact_terms_ok": bool(ran) and all(c.result["exact_terms_ok"] for c in ran),
        "notes": notes,
    }


if __name__ == "__main__":
    sys.exit(main())
