"""The headline claim, measured: the seed's settings against ours, same policy, data, steps and seed.

Trains the offline tiny policy twice in one Ray session: `configs/seed-baseline.yaml` (self-judging,
no EOS reward, no entropy control, 4 generations, the seed's learning rate, a fixed length schedule
below the policy's natural answer length, as the seed's 160 tokens were) and the project's default
(`configs/tiny.yaml`: frozen judge, EOS reward, adaptive cap, adaptive entropy, clip-higher,
8 generations). Reports per run what the seed's author saw only after 18,000 steps, and the
doctor's findings.

    python bench/pathologies.py [--steps N] [--json] [--figure DIR]

With ``--figure DIR`` the two runs also go through `synth-grpo compare` (pipeline/compare.py):
one PNG per metric family and compare.md in DIR, the figure in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The task, the same for both runs: SYNTH's answers are long (several sentences), longer than the
# seed's cap; the bundled data's long answers (>= 10 words: explanations, summaries, word problems)
# give the tiny policy that profile. With all the short answers in, the tiny policy stops on its
# own well before any cap and neither run can show the seed's length pathology.
TASK = ["data.min_reference_words=10"]
RUNS = {"baseline": REPO / "configs" / "seed-baseline.yaml", "ours": REPO / "configs" / "tiny.yaml"}


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return sum(xs) / len(xs) if xs else None


def summarize_run(rows: list[dict], config, seconds: float) -> dict:
    """The benchmark's figures from a run's metrics.jsonl rows."""
    from pipeline.doctor import diagnose

    train = [r for r in rows if "reward" in r and "train_runtime" not in r]
    evals = [r for r in rows if "eval/score" in r]
    n = len(train)
    tail = train[int(n * 0.8):] or train
    head = train[: max(3, n // 10)]
    ent_start, ent_end = _mean([r.get("entropy") for r in head]), _mean([r.get("entropy") for r in tail])
    findings = diagnose(rows, config=config)
    return {
        "steps": n,
        "clipped_ratio_tail": _mean([r.get("completions/clipped_ratio") for r in tail]),
        "entropy_start": ent_start,
        "entropy_end": ent_end,
        "entropy_retained": ent_end / ent_start if ent_start else None,
        "eval_score_first": evals[0]["eval/score"] if evals else None,
        "eval_score_last": evals[-1]["eval/score"] if evals else None,
        "eval_score_gain": evals[-1]["eval/score"] - evals[0]["eval/score"] if len(evals) > 1 else None,
        "eval_eos_rate_last": evals[-1].get("eval/eos_rate") if evals else None,
        "frac_reward_zero_std": _mean([r.get("frac_reward_zero_std") for r in train]),
        "clip_ratio_region": _mean([r.get("clip_ratio/region_mean") for r in train]),
        "reward_std": _mean([r.get("reward_std") for r in train]),
        "cap_trajectory": [[r["step"], r["generation/max_completion_length"]] for r in train
                           if "generation/max_completion_length" in r][:: max(1, n // 12)],
        "findings": [f.rule for f in findings],
        "sec_per_step": seconds / n if n else None,
    }


def run_one(name: str, steps: int, root: Path, seed: int) -> dict:
    from pipeline.config import load_config
    from pipeline.run_callbacks import read_metrics
    from pipeline.train import prepare_run_dir, run_training

    cfg = load_config(RUNS[name], [
        f"optimization.max_steps={steps}", f"optimization.seed={seed}", f"output.root={root}",
        f"output.run_name={name}", "output.save_steps=100000", "logging.progress_bar=false",
        f"eval.every_steps={max(5, steps // 6)}", *TASK,
    ])
    run_dir = root / name
    prepare_run_dir(cfg, run_dir, log=None)
    t0 = time.perf_counter()
    run_training(cfg, run_dir, log=None)
    rows = read_metrics(run_dir / "metrics.jsonl")
    final = next((r for r in reversed(rows) if "train_runtime" in r), None)
    seconds = final["train_runtime"] if final else time.perf_counter() - t0
    return summarize_run(rows, cfg, seconds)


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, list):
        return ", ".join(map(str, v)) or "none"
    return str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", default=None, help="keep the run directories here (default: a temporary folder)")
    ap.add_argument("--figure", default=None, help="write the compare plots and compare.md here (e.g. docs/img/pathologies)")
    args = ap.parse_args()

    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp).resolve()
        result = {name: run_one(name, args.steps, root, args.seed) for name in RUNS}
        if args.figure:
            from pipeline.compare import compare

            table, images = compare([root / name for name in RUNS], args.figure)
            result["figure"] = {"table": str(table), **{k: str(v) for k, v in images.items()}}
    ray.shutdown()
    result["meta"] = {"steps": args.steps, "seed": args.seed, "seconds": time.time() - t0,
                      "machine": f"{os.cpu_count()} CPUs"}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    keys = ["clipped_ratio_tail", "entropy_start", "entropy_end", "entropy_retained", "eval_score_first",
            "eval_score_last", "eval_score_gain", "eval_eos_rate_last", "frac_reward_zero_std",
            "clip_ratio_region", "reward_std", "sec_per_step", "findings", "cap_trajectory"]
    print(f"seed's settings vs ours, tiny policy, {args.steps} steps, seed {args.seed}, {result['meta']['machine']}")
    print(f"{'':22}{'baseline (seed)':>22}  {'ours':<40}")
    for k in keys:
        print(f"{k:22}{_fmt(result['baseline'][k]):>22}  {_fmt(result['ours'][k]):<40}")
    print(f"total {result['meta']['seconds']:.0f} s")
    if "figure" in result:
        print(f"figure: {result['figure']['table']} and {len(result['figure']) - 1} PNGs beside it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
