"""Generation engines, hf against vllm: the same tiny policy, prompts, sampling and token budget.

* Generation alone: Hugging Face ``model.generate`` against ``vllm.LLM(...).generate`` on the tiny
  policy (``ensure_tiny``), the bundled data's prompts through the project's loaders with the policy's
  chat template, the run's temperature/top_p/top_k and batch (its generation batch: one prompt x
  ``num_generations`` on one worker, as TRL repeats it; ``--batch`` for more prompts at once). Both are held to exactly ``--max-new-tokens``
  generated tokens (HF ``min_new_tokens``, vLLM ``min_tokens``: EOS is masked until the budget), so
  tokens/s compares the same work; the tokens are counted from the outputs, not assumed. One warm-up
  batch each, then ``--repeats`` batches; start-up (model load, for vLLM the engine) is timed apart.
  Both engines get ``--threads`` CPU threads (torch threads; vLLM's OpenMP threads bound to cores
  0..threads-1 unless ``VLLM_CPU_OMP_THREADS_BIND`` is set).
* Whole GRPO steps: the same short run (``configs/tiny.yaml``, fixed cap ``--max-new-tokens``, no
  evaluation or checkpoints, the same seed) on an embedded local Ray with ``generation.backend`` hf
  and then vllm. sec_per_step is the median ``step_time`` after the first step (which carries the
  engine's first generation); startup_s is the worker's ``timing_s/build_trainer``, where TRL starts
  the colocated vLLM engine.

vLLM's CPU build sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB): the standalone engine gets 1
unless it is set; the training runs size their own (pipeline/training/vllm_engine.py).

    python -m bench.generation [--steps 8] [--repeats 16] [--max-new-tokens 32] [--batch 8 [64 ...]] [--only generation|steps] [--json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file (python bench/generation.py): the repo root in bench/'s place, as python -m has it
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import REPO, init_local_ray, machine, print_json
from pipeline.config import load_config
from pipeline.data.sources import load_records, to_prompt
from pipeline.rundir.files import METRICS, read_metrics
from pipeline.rundir.metric_names import TIMING_PREFIX, is_train_row

BACKENDS = ("hf", "vllm")


def bench_config(backend: str, steps: int, budget: int, seed: int):
    return load_config(REPO / "configs" / "tiny.yaml", [
        f"generation.backend={backend}", f"optimization.max_steps={steps}", f"optimization.seed={seed}",
        f"generation.max_completion_length={budget}", "eval.num_prompts=0", "output.save_steps=100000",
        "logging.progress_bar=false",
    ])


def prompt_batches(cfg, tokenizer, n_batches: int, batch: int) -> list[list[list[int]]]:
    """``n_batches`` batches of ``batch`` prompts' token ids: bundled training prompts, each repeated
    ``num_generations`` times (as TRL feeds either engine), the next batch the next prompts."""
    train, _, _ = load_records(cfg.data, log=None, tokenizer=tokenizer)
    per_batch = max(1, batch // cfg.generation.num_generations)
    batches = []
    for b in range(n_batches):
        recs = [train[(b * per_batch + i) % len(train)] for i in range(per_batch)]
        ids = [tokenizer.apply_chat_template(to_prompt(r, cfg.data.system_prompt), add_generation_prompt=True,
                                             tokenize=True) for r in recs]
        ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in ids]  # transformers 5: a BatchEncoding
        batches.append([p for p in ids for _ in range(cfg.generation.num_generations)])
    return batches


def generated_length(ids: list[int], eos_ids: set[int]) -> int:
    """Tokens a completion produced: up to and including its first EOS, else all of them."""
    return next((i + 1 for i, t in enumerate(ids) if t in eos_ids), len(ids))


def timed_batches(generate, batches) -> dict:
    """One warm-up batch, then the rest timed: generated tokens per second of wall time."""
    generate(batches[0])
    tokens, t0 = 0, time.perf_counter()
    for batch in batches[1:]:
        tokens += sum(generate(batch))
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": tokens / seconds}


def timed_sizes(generate, by_size: dict[int, list]) -> dict:
    """``timed_batches`` per batch size; the first size's tokens/s is the engine's headline figure."""
    by_batch = {size: timed_batches(generate, batches) for size, batches in by_size.items()}
    return {"tokens_per_s": next(iter(by_batch.values()))["tokens_per_s"], "by_batch": by_batch}


def generate_hf(cfg, by_size: dict[int, list], budget: int, threads: int) -> dict:
    import torch

    from pipeline.training.worker import load_policy  # lazy: imports torch and transformers

    torch.set_num_threads(threads)
    torch.manual_seed(cfg.optimization.seed)
    t0 = time.perf_counter()
    tokenizer, model, eos_ids = load_policy(cfg, on_gpu=False)
    startup = time.perf_counter() - t0
    g, eos = cfg.generation, set(eos_ids)

    def generate(batch):
        inputs = tokenizer.pad({"input_ids": batch}, return_tensors="pt")  # left-padded (load_tokenizer)
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=True, temperature=g.temperature, top_p=g.top_p,
                                 top_k=g.top_k or 0, max_new_tokens=budget, min_new_tokens=budget,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids)
        return [generated_length(row.tolist(), eos) for row in out[:, inputs["input_ids"].shape[1]:]]

    return {**timed_sizes(generate, by_size), "startup_s": round(startup, 3), "eos_ids": eos_ids}


def generate_vllm(cfg, policy: str, by_size: dict[int, list], budget: int, threads: int, eos_ids: list[int]) -> dict:
    from vllm import LLM, SamplingParams  # vLLM: only this part of the bench needs it

    from pipeline.training.vllm_engine import CPU_KV_CACHE_ENV, engine_context_length  # lazy: imports trl

    g = cfg.generation
    own_env = {k: v for k, v in ((CPU_KV_CACHE_ENV, "1"), ("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}"))
               if k not in os.environ}  # set for this engine only: the training runs size their own
    os.environ.update(own_env)
    t0 = time.perf_counter()
    # the engine TRL's colocate mode builds (less its distributed launcher) with the pipeline's context length
    llm = LLM(model=policy, dtype="float32", seed=cfg.optimization.seed, max_num_batched_tokens=4096,
              max_model_len=engine_context_length(cfg))
    startup = time.perf_counter() - t0
    eos = set(eos_ids)
    params = SamplingParams(n=1, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k or 0,
                            max_tokens=budget, min_tokens=budget)

    def generate(batch):
        outs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        return [generated_length(list(o.outputs[0].token_ids), eos) for o in outs]

    result = {**timed_sizes(generate, by_size), "startup_s": round(startup, 3)}
    llm = None  # the engine (and its KV cache) goes before the next measurement
    for k in own_env:
        os.environ.pop(k)
    return result


def generation_alone(budget: int, repeats: int, threads: int, seed: int, sizes: list[int] | None) -> dict:
    from pipeline.data.tiny_models import ensure_tiny  # lazy: builds the tiny policy on first use
    from pipeline.training.worker import load_tokenizer  # lazy: imports torch and transformers

    cfg = bench_config("hf", 1, budget, seed)
    policy = str(ensure_tiny())
    tokenizer = load_tokenizer(cfg)
    by_size = {}
    for size in sizes or [cfg.generation_batch_size]:
        batches = prompt_batches(cfg, tokenizer, repeats + 1, size)
        by_size[len(batches[0])] = batches
    hf = generate_hf(cfg, by_size, budget, threads)
    return {"hf": hf, "vllm": generate_vllm(cfg, policy, by_size, budget, threads, hf["eos_ids"]),
            "batch": next(iter(by_size)), "max_new_tokens": budget, "threads": threads}


def steps_run(backend: str, steps: int, budget: int, seed: int, workdir: Path) -> dict:
    import ray  # lazy: Ray loads for a run, not for --help

    from pipeline.training.driver import prepare_run_dir, run_training  # lazy: imports ray

    cfg = bench_config(backend, steps, budget, seed)
    cfg.output.run_name = backend
    run_dir = workdir / backend
    t0 = time.perf_counter()
    init_local_ray()
    try:
        prepare_run_dir(cfg, run_dir, log=None)
        run_training(cfg, run_dir, log=None)
    finally:
        ray.shutdown()
    rows = read_metrics(run_dir / METRICS)
    train = [r for r in rows if is_train_row(r)]
    timing = {k: v for r in rows for k, v in r.items() if k.startswith(TIMING_PREFIX)}
    later = [r["step_time"] for r in train[1:] if "step_time" in r]
    return {
        "sec_per_step": statistics.median(later) if later else None,
        "first_step_s": train[0].get("step_time") if train else None,
        "startup_s": timing.get(f"{TIMING_PREFIX}build_trainer"),
        "mean_completion_tokens": statistics.mean(r["completions/mean_length"] for r in train
                                                  if "completions/mean_length" in r) if train else None,
        "steps": len(train),
        "wall_s": round(time.perf_counter() - t0, 1),
        "timing_s": timing,
    }


def whole_steps(steps: int, budget: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return {b: steps_run(b, steps, budget, seed, Path(tmp)) for b in BACKENDS}


def ratio(a, b):
    return a / b if a is not None and b else None


def summarize(gen: dict | None, steps: dict | None) -> dict:
    """``{hf, vllm}: {tokens_per_s, sec_per_step, startup_s}`` and the ratios vllm/hf."""
    out = {}
    for b in BACKENDS:
        out[b] = {"tokens_per_s": gen[b]["tokens_per_s"] if gen else None,
                  "sec_per_step": steps[b]["sec_per_step"] if steps else None,
                  "startup_s": steps[b]["startup_s"] if steps else None,
                  "generation_startup_s": gen[b]["startup_s"] if gen else None}
    out["vllm_over_hf"] = {k: ratio(out["vllm"][k], out["hf"][k]) for k in out["hf"]}
    return out


def print_table(result: dict) -> None:
    print(f"hf vs vllm on the tiny policy, {result['machine']}")
    gen = result.get("generation")
    if gen:
        print(f"generation alone: batch {gen['batch']}, exactly {gen['max_new_tokens']} new tokens each, "
              f"{gen['threads']} thread(s), {result['repeats']} timed batches")
    if result.get("steps"):
        print(f"GRPO steps: configs/tiny.yaml, {result['steps_run']} steps, cap {result['max_new_tokens']}, seed {result['seed']}")

    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    print(f"{'':14}{'tokens/s':>10}{'sec/step':>10}{'startup s':>11}{'load s (gen)':>14}")
    for name in (*BACKENDS, "vllm_over_hf"):
        r = result["summary"][name]
        print(f"{name:14}{fmt(r['tokens_per_s'], '.1f'):>10}{fmt(r['sec_per_step'], '.3f'):>10}"
              f"{fmt(r['startup_s'], '.1f'):>11}{fmt(r['generation_startup_s'], '.1f'):>14}")
    for size in (gen or {}).get("hf", {}).get("by_batch", {}):
        hf, vl = gen["hf"]["by_batch"][size]["tokens_per_s"], gen["vllm"]["by_batch"][size]["tokens_per_s"]
        print(f"batch {size}: hf {hf:.1f} tokens/s, vllm {vl:.1f} tokens/s, vllm/hf {vl / hf:.2f}")
    for b, r in (result.get("steps") or {}).items():
        print(f"{b}: first step {fmt(r['first_step_s'], '.2f')} s, mean completion {fmt(r['mean_completion_tokens'], '.1f')} tokens, "
              f"{r['steps']} steps, wall {r['wall_s']} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps per engine (default 8)")
    ap.add_argument("--repeats", type=int, default=16, help="timed generation batches per engine and size (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="the token budget B (default 32)")
    ap.add_argument("--batch", type=int, nargs="+",
                    help="completions per generation batch, one or more sizes (default: the run's generation batch, 8)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per engine (default 1, as the Ray worker)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--only", choices=("generation", "steps"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # vLLM logs to stdout: keep --json clean
    gen = generation_alone(args.max_new_tokens, args.repeats, args.threads, args.seed, args.batch) if args.only != "steps" else None
    steps = whole_steps(args.steps, args.max_new_tokens, args.seed) if args.only != "generation" else None
    result = {"summary": summarize(gen, steps), "generation": gen, "steps": steps, "steps_run": args.steps,
              "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "machine": machine(with_platform=True)}
    if args.json:
        print_json(result)
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
