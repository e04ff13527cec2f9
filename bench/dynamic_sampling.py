"""Dynamic sampling, measured: the same run with and without it, where many groups are near-constant.

The setting is the baseline run's (`configs/seed-baseline.yaml`: 4 generations, a fixed cap of 8 -> 12
tokens below the policy's natural answers, `grpo` loss) on the long-answer task of
bench/pathologies.py, trained on a sparse binary reward: the EOS term alone (+0.1 if the completion
stopped, -0.1 if the cap cut it), like DAPO's 0/1 accuracy reward. With most completions cut,
many groups of 4 are all cut (or all stopped) and tie exactly. (With the baseline run's own blend, ROUGE-L
and the self-judge's continuous grade leave no group below 0.01 on the tiny policy: measured, see
docs/benchmarks.md.) Both arms: the same tiny policy, data, steps and seed, one after the other in this process
(TRL's GRPOTrainer built by `pipeline.training.worker.build_grpo_trainer`, the reward pool's Ray actors,
the project's Evaluator for the held-out `eval/score`).

Reported per arm: the fraction of trained groups whose weighted total reward has std < 0.01 (every
generated group without dynamic sampling; the groups that reach the loss with it), the held-out
`eval/score` gain (last - first evaluation), and seconds per optimizer step (HF's train_runtime).

    python -m bench.dynamic_sampling [--steps N] [--seed S] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file (python bench/dynamic_sampling.py): the repo root in bench/'s place, as python -m has it
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import REPO, init_local_ray, machine, print_json
from pipeline.config import load_config
from pipeline.data.sources import load_records
from pipeline.training.worker import build_grpo_trainer, load_policy

LOW_STD = 0.01
TASK = ["data.min_reference_words=10"]  # bench/pathologies.py's long-answer task
REWARD = ["rewards.weights={rouge_l: 0.0, length: 0.0, judge: 0.0, eos: 1.0}"]  # sparse: stopped or cut


def bench_config(steps: int, seed: int, root: Path, dynamic: bool, learning_rate: float | None = None):
    lr = [f"optimization.learning_rate={learning_rate}"] if learning_rate else []
    return load_config(REPO / "configs" / "seed-baseline.yaml", [*lr,
        f"optimization.max_steps={steps}", f"optimization.seed={seed}", f"output.root={root}",
        "output.save_steps=100000", "logging.progress_bar=false", f"eval.every_steps={max(5, steps // 4)}",
        "eval.max_new_tokens=96", "eval.samples_per_prompt=8",  # bench/pathologies.py's fixed evaluation
        f"grpo.dynamic_sampling.enabled={str(dynamic).lower()}", *TASK, *REWARD,
    ])


def run_arm(steps: int, seed: int, root: Path, dynamic: bool, pool, learning_rate: float | None = None) -> dict:
    """One arm in this process: the worker's own construction, minus Ray Train."""
    import torch
    from transformers import TrainerCallback

    from pipeline.training.dynamic_sampling import group_std  # lazy: imports trl and torch
    from pipeline.training.length_control import CompletionLengthControl  # lazy: imports transformers and torch
    from pipeline.scoring.clients import make_pool_reward_funcs  # lazy: imports ray and torch
    from pipeline.training.callbacks import Evaluator  # lazy: imports transformers and torch
    from rewards.judge import SelfJudge  # lazy: imports torch and transformers
    from pipeline.seams.trl_seams import observe_rewards  # lazy: beside the trainer it patches (imports trl)

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    cfg = bench_config(steps, seed, root, dynamic, learning_rate)
    run_dir = root / ("with" if dynamic else "without")
    train, evals, _ = load_records(cfg.data, log=None)
    tokenizer, model, eos_ids = load_policy(cfg, on_gpu=False)
    length_ctl = CompletionLengthControl(cfg, log=lambda _m: None)
    self_judge = SelfJudge(tokenizer, cfg.judge.max_input_tokens) if cfg.judge.backend == "self" else None
    funcs, weights = make_pool_reward_funcs(pool, cfg, eos_ids, lambda: length_ctl.current, self_judge)
    eval_rows: list[dict] = []
    evaluator = Evaluator(cfg, evals, tokenizer, pool, eos_ids, length_ctl.budget, report=eval_rows.append)
    history: list[dict] = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            history.append(dict(logs or {}))

    trainer = build_grpo_trainer(cfg, run_dir, tokenizer, model, train, funcs, weights, [length_ctl, Keep(), evaluator])
    length_ctl.bind(trainer)
    evaluator.trainer = trainer
    if self_judge is not None:
        self_judge.trainer = trainer

    G = cfg.generation.num_generations
    stds: list[float] = []  # per trained group
    if not dynamic:  # every generated group is trained: record them as TRL scores them
        def record(r):
            total = (r * trainer.reward_weights.to(r.device)).nansum(dim=1).float().cpu()
            stds.extend(group_std(total, G).tolist())

        observe_rewards(trainer, record)
    trainer.train()
    if dynamic:
        stds = [s for t in trainer.dynamic_sampling_trace for s in t["trained_std"]]
    return _arm_summary(stds, history, eval_rows, steps)


def _arm_summary(stds: list[float], history: list[dict], eval_rows: list[dict], steps: int) -> dict:
    """One arm's figures from the trained groups' reward stds, the trainer's logs and the eval rows."""
    final = next(r for r in reversed(history) if "train_runtime" in r)
    ds_rows = [r for r in history if "dynamic_sampling/rounds" in r]

    def mean(key):
        xs = [r[key] for r in ds_rows if key in r]
        return sum(xs) / len(xs) if xs else None

    scores = [r["eval/score"] for r in eval_rows]
    ses = [r.get("eval/score_stderr", 0.0) for r in eval_rows]
    return {
        "frac_low_std_groups_trained": sum(s < LOW_STD or s != s for s in stds) / len(stds) if stds else None,
        "groups_trained": len(stds),
        "eval_score_first": scores[0] if scores else None,
        "eval_score_last": scores[-1] if scores else None,
        "eval_score_gain": scores[-1] - scores[0] if len(scores) > 1 else None,
        "eval_score_gain_se": (ses[0] ** 2 + ses[-1] ** 2) ** 0.5 if len(ses) > 1 else None,
        "sec_per_step": final["train_runtime"] / steps,
        "frac_reward_zero_std": sum(r.get("frac_reward_zero_std", 0) for r in history) / max(1, sum("frac_reward_zero_std" in r for r in history)),
        "ds_rounds_mean": mean("dynamic_sampling/rounds"),
        "ds_frac_kept_mean": mean("dynamic_sampling/frac_kept"),
        "ds_short_steps": sum(r.get("dynamic_sampling/short_step", 0) for r in ds_rows) if ds_rows else None,
        "ds_extra_generation_seconds_mean": mean("dynamic_sampling/extra_generation_seconds"),
    }


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--learning-rate", type=float, default=None,
                    help="instead of seed-baseline.yaml's (7.5e-3 collapses the policy on this sparse reward in both arms)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from pipeline.scoring.pool import start_pool, stop_pool  # lazy: imports ray

    import ray  # lazy: Ray loads for a run, not for --help

    t0 = time.time()
    init_local_ray()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pool = start_pool(bench_config(args.steps, args.seed, root, False))
        try:
            with contextlib.redirect_stdout(sys.stderr):  # HF's log printer: keep stdout for the result
                result = {"without": run_arm(args.steps, args.seed, root, False, pool, args.learning_rate),
                          "with": run_arm(args.steps, args.seed, root, True, pool, args.learning_rate)}
        finally:
            stop_pool(pool)
    ray.shutdown()
    w, wo = result["with"], result["without"]
    result["meta"] = {"steps": args.steps, "seed": args.seed, "learning_rate": args.learning_rate, "seconds": time.time() - t0,
                      "sec_per_step_ratio": w["sec_per_step"] / wo["sec_per_step"], "machine": machine()}
    if args.json:
        print_json(result)
        return 0
    print(f"dynamic sampling off/on, seed-baseline settings, {args.steps} steps, seed {args.seed}, {result['meta']['machine']}")
    print(f"{'':34}{'without':>12}{'with':>12}")
    for k in wo:
        print(f"{k:34}{_fmt(wo[k]):>12}{_fmt(w[k]):>12}")
    print(f"sec_per_step ratio (with / without): {result['meta']['sec_per_step_ratio']:.2f}; "
          f"total {result['meta']['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
