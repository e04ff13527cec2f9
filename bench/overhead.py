"""What does Ray cost? The same tiny GRPO run through this pipeline and through plain TRL, side by side.

Ours: `run_training` on an embedded local Ray, one Ray Train worker, the reward pool's actors.
Plain: TRL's GRPOTrainer in this process with the same model, data, config, seeds and reward
components, no Ray: the in-process functions of `rewards.trl_rewards` with the same frozen MiniLM
judge, where ours uses the pool's clients (`pipeline.scoring.clients`); both score the components
`rewards.trl_rewards.scored_components` names, and the table lists what each run logged.
Seconds per step are HF's `train_runtime / steps` (the training loop only: Ray start-up and model
loading are reported apart). Both use one torch thread, as the Ray worker does with
`distributed.cpus_per_worker: 1`.

    python -m bench.overhead [--steps 20] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file (python bench/overhead.py): the repo root in bench/'s place, as python -m has it
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import REPO, init_local_ray, machine, print_json
from pipeline.config import load_config
from pipeline.data.sources import load_records
from pipeline.rundir.files import METRICS, read_metrics
from pipeline.rundir.metric_names import is_train_row
from pipeline.training.driver import prepare_run_dir, run_training
from pipeline.training.worker import build_grpo_trainer, load_policy
from rewards.trl_rewards import COMPONENTS, make_reward_funcs


def bench_config(steps: int):
    return load_config(REPO / "configs" / "tiny.yaml", [
        f"optimization.max_steps={steps}", "generation.max_completion_length=32", "eval.num_prompts=0",
        "output.save_steps=100000", "logging.progress_bar=false", "distributed.cpus_per_worker=1",
    ])


def _train_stats(rows: list[dict], steps: int) -> dict:
    final = next(r for r in reversed(rows) if "train_runtime" in r)

    train = [r for r in rows if is_train_row(r)]
    step_times = [r["step_time"] for r in train[2:] if "step_time" in r]
    return {
        "sec_per_step": final["train_runtime"] / steps,
        "median_step_time": statistics.median(step_times) if step_times else None,
        "first_reward": train[0]["reward"] if train else None,
        "steps": len(train),
        "components": [c for c in COMPONENTS if any(f"rewards/{c}/mean" in r for r in train)],
    }


def run_plain(steps: int, workdir: Path) -> dict:
    import torch
    from transformers import TrainerCallback

    from pipeline.scoring.clients import eos_kwargs  # lazy: imports ray and torch
    from rewards.judge import load_judge  # lazy: imports torch and transformers

    torch.set_num_threads(1)
    cfg = bench_config(steps)
    t0 = time.perf_counter()
    train, _, _ = load_records(cfg.data, log=None)
    tokenizer, model, eos_ids = load_policy(cfg, on_gpu=False)
    judge = load_judge(cfg.judge.backend, cfg.judge.model, max_input_tokens=cfg.judge.max_input_tokens)
    cap = cfg.initial_max_completion_length
    funcs, weights = make_reward_funcs(cfg.rewards.weights, judge, eos_ids, lambda: cap, eos_kwargs(cfg))

    rows: list[dict] = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            rows.append(dict(logs or {}, step=state.global_step))

    trainer = build_grpo_trainer(cfg, workdir, tokenizer, model, train, funcs, weights, [Keep()])
    setup = time.perf_counter() - t0
    trainer.train()
    return {**_train_stats(rows, steps), "setup_seconds": setup, "wall_seconds": time.perf_counter() - t0}


def run_ours(steps: int, workdir: Path) -> dict:
    import ray  # lazy: Ray loads for a run, not for --help

    cfg = bench_config(steps)
    cfg.output.run_name = "ours"
    run_dir = workdir / "ours"
    t0 = time.perf_counter()
    init_local_ray()
    prepare_run_dir(cfg, run_dir, log=None)
    run_training(cfg, run_dir, log=None)
    wall = time.perf_counter() - t0
    ray.shutdown()
    stats = _train_stats(read_metrics(run_dir / METRICS), steps)
    return {**stats, "wall_seconds": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plain = run_plain(args.steps, Path(tmp) / "plain")
        ours = run_ours(args.steps, Path(tmp))
    result = {
        "steps": args.steps,
        "ray_over_trl_ratio": ours["sec_per_step"] / plain["sec_per_step"],
        "ours": ours,
        "plain_trl": plain,
        "machine": machine(with_platform=True),
    }
    if args.json:
        print_json(result)
        return 0
    print(f"tiny GRPO run, {args.steps} steps, configs/tiny.yaml (cap 32, no eval), {result['machine']}")
    print(f"{'':24}{'sec/step':>10}{'median step_time':>18}{'first reward':>14}{'wall s':>9}")
    for name, r in (("plain TRL (1 process)", plain), ("ours (Ray, 1 worker)", ours)):
        med = f"{r['median_step_time']:.3f}" if r["median_step_time"] is not None else "n/a"
        print(f"{name:24}{r['sec_per_step']:>10.3f}{med:>18}{r['first_reward']:>14.4f}{r['wall_seconds']:>9.1f}")
    print(f"reward components: plain {', '.join(plain['components'])}; ours {', '.join(ours['components'])}")
    print(f"ray_over_trl_ratio: {result['ray_over_trl_ratio']:.3f}  (aim <= 1.15)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
