"""`synth-grpo` command line: train, tune, plan, doctor, compare, build-tiny.

The subcommands that load Ray, torch or matplotlib (train, tune, compare) import their module
lazily so `--help` and config errors answer in a second, before those load.
Exit codes: 0 ok, 1 run failed, 2 bad input.
"""

from __future__ import annotations

import argparse

from pipeline.errors import cli_error
from pipeline.config import DEFAULT_CONFIG, ConfigError, load_config
from pipeline.data.tiny_models import build_tiny_cli
from pipeline.plan.inert import warn_inert
from pipeline.plan.plan_cli import plan_cli
from pipeline.report.doctor import doctor_cli
from pipeline.seams.ray_seams import bind_embedded_ray_to_loopback


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help=f"run config YAML (default: {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parent.parent)})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="GROUP.KEY=VALUE",
                   help="override one config field, e.g. --set optimization.learning_rate=1e-5 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="synth-grpo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train",
        help="run GRPO training on Ray (embedded local Ray, or the cluster in RAY_ADDRESS / ray job submit)",
        description="Train a LoRA policy with TRL GRPO on Ray Train workers, scored by a Ray reward pool. "
        "With no --config it runs configs/tiny.yaml offline. The same command with the same run name resumes.",
    )
    _add_config_args(t)
    t.add_argument("--address", default=None, help="Ray cluster address to join (default: RAY_ADDRESS, else a local Ray)")
    t.add_argument("--run-dir", default=None, help="run directory (default: output.root/output.run_name)")
    t.add_argument("--allow-config-change", action="store_true",
                   help="resume a run whose training settings changed (default: exit 2 naming the changed fields)")

    tu = sub.add_parser("tune", help="Ray Tune search over learning rate, group size and reward weights")
    _add_config_args(tu)
    tu.add_argument("--space", default="tune_spaces/default.yaml", help="search space YAML")
    tu.add_argument("--samples", type=int, default=None, help="number of trials (default: the space's num_samples)")
    tu.add_argument("--resume", action="store_true", help="resume an interrupted search (Tuner.restore)")
    tu.add_argument("--address", default=None, help="Ray cluster address to join")
    tu.add_argument("--name", default=None, help="experiment name (default: <run_name>-tune)")

    pl = sub.add_parser("plan", help="predict GPU memory for a run and the largest num_generations that fits")
    _add_config_args(pl)
    g = pl.add_mutually_exclusive_group()
    g.add_argument("--gpu", default=None, help="GPU preset, e.g. A100-80, H100, L4")
    g.add_argument("--gpu-mem", type=float, default=None, help="GPU memory in GiB")
    pl.add_argument("--num-gpus", type=int, default=None, help="GPUs the ZeRO stage shards across (default: from the config)")
    pl.add_argument("--json", action="store_true", help="print JSON")

    d = sub.add_parser("doctor", help="diagnose a run directory: findings, report.md and plots")
    d.add_argument("run_dir", metavar="RUN_DIR")
    d.add_argument("--json", action="store_true", help="print findings as JSON")

    c = sub.add_parser("compare", help="runs side by side: one PNG per metric family and a Markdown table (compare.md)")
    c.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="run directories (each holds metrics.jsonl)")
    c.add_argument("--out", default=None, help="output folder (default: ./compare-<run>-vs-<run>)")

    b = sub.add_parser("build-tiny", help="build the offline tiny tokenizer and policy (cached by a hash of their inputs)")
    b.add_argument("--out", default=None, help="cache folder (default: $SYNTH_GRPO_CACHE or ~/.cache/synth-grpo)")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in OFFLINE_TOOLS:
        try:
            return _run(args)
        except Exception as e:  # noqa: BLE001 - the last resort: a reader let something through
            return cli_error(args.command, f"could not read {_inputs_of(args)} ({type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0][:200]}); this is a bug of synth-grpo's reader, please report it")
    return _run(args)


# Commands that only read files someone else may have written: never a traceback (cli_errors.py).
OFFLINE_TOOLS = ("doctor", "compare", "plan")


def _inputs_of(args) -> str:
    """The files an offline tool read, for its last-resort message."""
    if args.command == "doctor":
        return repr(args.run_dir)
    if args.command == "compare":
        return ", ".join(map(repr, args.run_dirs))
    model = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("model.name_or_path=")), None)
    return f"config {args.config or 'default'!r}" + (f" and model {model!r}" if model else " and its model's config.json")


def _run(args) -> int:
    try:
        if args.command == "build-tiny":
            return build_tiny_cli(args)
        if args.command == "doctor":
            return doctor_cli(args)
        if args.command == "compare":
            from pipeline.report.compare import compare_cli  # lazy: imports matplotlib

            return compare_cli(args)
        cfg = load_config(args.config, args.overrides)
        if args.command in ("train", "tune"):  # before Ray: one warning line per setting that cannot change the run
            warn_inert(cfg)

            bind_embedded_ray_to_loopback(args.address)
        if args.command == "train":
            from pipeline.training.driver import train_cli  # lazy: loads ray and torch

            return train_cli(cfg, args)
        if args.command == "tune":
            from pipeline.tune.tuner import tune_cli  # lazy: imports ray

            return tune_cli(cfg, args)
        if args.command == "plan":
            return plan_cli(cfg, args)
    except ConfigError as e:
        return cli_error(args.command, "invalid config", e.problems)
    raise AssertionError(args.command)


if __name__ == "__main__":
    raise SystemExit(main())
