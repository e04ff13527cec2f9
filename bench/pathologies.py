"""The headline claim, measured: the baseline run's settings against ours, same policy, data, steps and seed.

Trains the offline tiny policy twice in one Ray session: `configs/seed-baseline.yaml` (self-judging,
no EOS reward, no entropy control, 4 generations, the baseline run's learning rate, a fixed length schedule
below the policy's natural answer length, as the baseline run's 160 tokens were) and the project's default
(`configs/tiny.yaml`: frozen judge, EOS reward, adaptive cap, adaptive entropy, clip-higher,
8 generations). Reports per run what the baseline run's author saw only after 18,000 steps, and the
doctor's findings. Both are evaluated the same way: a fixed budget (``--eval-budget`` tokens, so
neither arm's training cap decides what the evaluation sees), several samples per held-out prompt,
the same evaluation seed throughout; every seed in ``--seeds`` trains both arms, and each gain is
reported with its standard error (from ``eval/score_stderr``) and the spread over seeds.

    python -m bench.pathologies [--steps N] [--seeds 42 43] [--json] [--figure DIR]

With ``--figure DIR`` the first seed's two runs also go through `synth-grpo compare`
(pipeline/report/compare.py): one PNG per metric family and compare.md in DIR.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file (python bench/pathologies.py): the repo root in bench/'s place, as python -m has it
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import REPO, init_local_ray, machine, print_json
from pipeline.config import load_config
from pipeline.diagnosis.rules import diagnose
from pipeline.rundir.files import METRICS, read_metrics
from pipeline.rundir.metric_names import CAP_METRIC, is_train_row
from pipeline.training.driver import prepare_run_dir, run_training

# The task, the same for both runs: SYNTH's answers are long (several sentences), longer than the
# seed's cap; the bundled data's long answers (>= 10 words: explanations, summaries, word problems)
# give the tiny policy that profile. With all the short answers in, the tiny policy stops on its
# own well before any cap and neither run can show the baseline run's length pathology.
TASK = ["data.min_reference_words=10"]
RUNS = {"baseline": REPO / "configs" / "seed-baseline.yaml", "ours": REPO / "configs" / "tiny.yaml"}


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return sum(xs) / len(xs) if xs else None


def cap_changes(train: list[dict], band: tuple[float, float] | None) -> dict:
    """How often the cap moved, and how often after the clipped ratio (8-step running mean) entered the band."""

    caps = [(r["step"], r[CAP_METRIC]) for r in train if CAP_METRIC in r]
    moves = [s for (s, c), (_, prev) in zip(caps[1:], caps) if c != prev]
    entered = None
    if band:
        clipped = [r.get("completions/clipped_ratio") for r in train]
        for i in range(len(clipped)):
            w = [x for x in clipped[max(0, i - 7): i + 1] if x is not None]
            if w and band[0] <= sum(w) / len(w) <= band[1]:
                entered = train[i]["step"]
                break
    return {"cap_changes": len(moves), "cap_entered_band_at": entered,
            "cap_changes_after_entering": len([s for s in moves if entered is not None and s > entered])}


def summarize_run(rows: list[dict], config, seconds: float) -> dict:
    """The benchmark's figures from a run's metrics.jsonl rows."""
    train = [r for r in rows if is_train_row(r)]
    evals = [r for r in rows if "eval/score" in r]
    n = len(train)
    tail = train[int(n * 0.8):] or train
    head = train[: max(3, n // 10)]
    ent_start, ent_end = _mean([r.get("entropy") for r in head]), _mean([r.get("entropy") for r in tail])
    findings = diagnose(rows, config=config)
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    se = [e.get("eval/score_stderr") for e in (first, last)]
    a = config.generation.adaptive
    return {
        "steps": n,
        "clipped_ratio_tail": _mean([r.get("completions/clipped_ratio") for r in tail]),
        "clipped_ratio_last_half": _mean([r.get("completions/clipped_ratio") for r in train[n // 2:]]),
        "entropy_start": ent_start,
        "entropy_end": ent_end,
        "entropy_retained": ent_end / ent_start if ent_start else None,
        "eval_score_first": first.get("eval/score"),
        "eval_score_last": last.get("eval/score"),
        "eval_score_gain": last["eval/score"] - first["eval/score"] if len(evals) > 1 else None,
        "eval_score_gain_se": math.sqrt(se[0] ** 2 + se[1] ** 2) if len(evals) > 1 and None not in se else None,
        "kl_to_initial_last": last.get("eval/kl_to_initial"),
        "kl_to_initial_se_last": last.get("eval/kl_to_initial_stderr"),
        "eval_eos_rate_last": last.get("eval/eos_rate"),
        "eval_first_to_last": {k: [first.get(f"eval/{k}"), last.get(f"eval/{k}")]
                               for k in ("rouge_l", "length", "judge", "eos_rate", "mean_length")},
        "frac_reward_zero_std": _mean([r.get("frac_reward_zero_std") for r in train]),
        "clip_ratio_region": _mean([r.get("clip_ratio/region_mean") for r in train]),
        "reward_std": _mean([r.get("reward_std") for r in train]),
        "cap_trajectory": [[r["step"], r[CAP_METRIC]] for r in train if CAP_METRIC in r][:: max(1, n // 12)],
        **cap_changes(train, (a.band_low, a.band_high) if config.adaptive_length else None),
        "findings": [f.rule for f in findings],
        "sec_per_step": seconds / n if n else None,
    }


def train_run(config: Path, overrides: list[str], run_name: str, root: Path, steps: int, seed: int,
              eval_budget: int, eval_samples: int, eval_every: int | None = None):
    """Train one arm on the benchmark's task and evaluation; (config, metrics rows, training seconds)."""
    cfg = load_config(config, [
        *overrides, f"optimization.max_steps={steps}", f"optimization.seed={seed}", f"output.root={root}",
        f"output.run_name={run_name}", "output.save_steps=100000", "logging.progress_bar=false",
        f"eval.every_steps={eval_every or max(5, steps // 6)}", f"eval.max_new_tokens={eval_budget}", "eval.num_prompts=48",
        f"eval.samples_per_prompt={eval_samples}", *TASK,
    ])
    run_dir = root / run_name
    prepare_run_dir(cfg, run_dir, log=None)
    t0 = time.perf_counter()
    run_training(cfg, run_dir, log=None)
    rows = read_metrics(run_dir / METRICS)
    final = next((r for r in reversed(rows) if "train_runtime" in r), None)
    return cfg, rows, final["train_runtime"] if final else time.perf_counter() - t0


def run_one(name: str, steps: int, root: Path, seed: int, eval_budget: int, eval_samples: int,
            eval_every: int | None = None) -> dict:
    cfg, rows, seconds = train_run(RUNS[name], [], f"{name}-{seed}", root, steps, seed, eval_budget, eval_samples,
                                   eval_every)
    return summarize_run(rows, cfg, seconds)


def across_seeds(per_seed: dict[int, dict]) -> dict:
    """One arm over its seeds: the mean gain, its spread (sd over seeds) and the mean standard error."""
    gains = [r["eval_score_gain"] for r in per_seed.values() if r["eval_score_gain"] is not None]
    ses = [r["eval_score_gain_se"] for r in per_seed.values() if r["eval_score_gain_se"] is not None]
    kls = [r["kl_to_initial_last"] for r in per_seed.values() if r["kl_to_initial_last"] is not None]
    return {"eval_score_gain": _mean(gains),
            "eval_score_gain_sd_over_seeds": statistics.stdev(gains) if len(gains) > 1 else None,
            "eval_score_gain_se": math.sqrt(sum(x * x for x in ses)) / len(ses) if ses else None,
            "kl_to_initial_last": _mean(kls), "seeds": per_seed}


def compare(ours: dict[int, dict], base: dict[int, dict]) -> dict:
    """ours - baseline gain per seed, with its standard error, and over the seeds."""
    per, var = {}, []
    for seed in ours:
        o, b = ours[seed], base[seed]
        if None in (o["eval_score_gain"], b["eval_score_gain"], o["eval_score_gain_se"], b["eval_score_gain_se"]):
            continue
        v = o["eval_score_gain_se"] ** 2 + b["eval_score_gain_se"] ** 2
        per[seed] = {"diff": o["eval_score_gain"] - b["eval_score_gain"], "se": math.sqrt(v)}
        var.append(v)
    diffs = [d["diff"] for d in per.values()]
    mean = _mean(diffs)
    se = math.sqrt(sum(var)) / len(var) if var else None
    return {"per_seed": per, "diff": mean, "se": se, "diff_over_se": mean / se if mean is not None and se else None}


def fmt_value(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, list):
        return ", ".join(map(fmt_value, v)) or "none"
    if isinstance(v, dict):
        return " ".join(f"{k} {fmt_value(x[0])}->{fmt_value(x[1])}" if isinstance(x, list) else f"{k} {fmt_value(x)}" for k, x in v.items())
    return str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    ap.add_argument("--eval-budget", type=int, default=96, help="eval max_new_tokens, the same for both arms")
    ap.add_argument("--eval-samples", type=int, default=8, help="completions per held-out prompt")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default: steps / 6)")
    ap.add_argument("--only", choices=list(RUNS), default=None,
                    help="train one arm (its figures only; run the other in another process to use more cores)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", default=None, help="keep the run directories here (default: a temporary folder)")
    ap.add_argument("--figure", default=None, help="write the compare plots and compare.md here (e.g. docs/img/pathologies)")
    args = ap.parse_args()

    import ray  # lazy: Ray loads for a run, not for --help

    init_local_ray()
    t0 = time.time()
    arms = [args.only] if args.only else list(RUNS)
    per: dict[str, dict[int, dict]] = {name: {} for name in arms}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp).resolve()
        for seed in args.seeds:
            for name in arms:
                per[name][seed] = run_one(name, args.steps, root, seed, args.eval_budget, args.eval_samples,
                                          args.eval_every)
        figure = None
        if args.figure and not args.only:
            from pipeline.report.compare import compare as compare_runs  # lazy: imports matplotlib

            table, images = compare_runs([root / f"{name}-{args.seeds[0]}" for name in RUNS], args.figure)
            figure = {"table": str(table), **{k: str(v) for k, v in images.items()}}
    ray.shutdown()
    result = {name: across_seeds(per[name]) for name in arms}
    if args.only:
        print_json(result)
        return 0
    result["ours_minus_baseline"] = compare(per["ours"], per["baseline"])
    if figure:
        result["figure"] = figure
    result["meta"] = {"steps": args.steps, "seeds": args.seeds, "eval_budget": args.eval_budget,
                      "eval_samples": args.eval_samples, "seconds": time.time() - t0, "machine": machine()}
    if args.json:
        print_json(result)
    else:
        print_table(result, per, args)
    return 0


def print_table(result: dict, per: dict[str, dict[int, dict]], args: argparse.Namespace) -> None:
    """The readable form of the result: each seed's figures side by side, then the gains."""
    keys = ["clipped_ratio_tail", "clipped_ratio_last_half", "entropy_retained", "eval_score_first", "eval_score_last",
            "eval_score_gain", "eval_score_gain_se", "kl_to_initial_last", "kl_to_initial_se_last", "eval_eos_rate_last",
            "eval_first_to_last", "frac_reward_zero_std", "reward_std", "cap_changes", "cap_changes_after_entering",
            "sec_per_step", "findings", "cap_trajectory"]
    print(f"seed's settings vs ours, tiny policy, {args.steps} steps, seeds {args.seeds}, eval at "
          f"{args.eval_budget} tokens x {args.eval_samples} samples, {result['meta']['machine']}")
    for seed in args.seeds:
        print(f"-- seed {seed}")
        print(f"{'':28}{'baseline (seed)':>24}  {'ours':<40}")
        for k in keys:
            print(f"{k:28}{fmt_value(per['baseline'][seed][k]):>24}  {fmt_value(per['ours'][seed][k]):<40}")
    for name in RUNS:
        r = result[name]
        print(f"{name}: eval/score gain {fmt_value(r['eval_score_gain'])} (se {fmt_value(r['eval_score_gain_se'])}, "
              f"sd over seeds {fmt_value(r['eval_score_gain_sd_over_seeds'])}), KL to initial {fmt_value(r['kl_to_initial_last'])}")
    c = result["ours_minus_baseline"]
    print(f"ours - baseline gain: {fmt_value(c['diff'])} (se {fmt_value(c['se'])}, {fmt_value(c['diff_over_se'])} se); per seed "
          + "; ".join(f"{s}: {fmt_value(d['diff'])} +- {fmt_value(d['se'])}" for s, d in c["per_seed"].items()))
    print(f"total {result['meta']['seconds']:.0f} s")
    if "figure" in result:
        print(f"figure: {result['figure']['table']} and {len(result['figure']) - 1} PNGs beside it")


if __name__ == "__main__":
    raise SystemExit(main())
