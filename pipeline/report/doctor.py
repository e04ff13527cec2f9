"""`synth-grpo doctor RUN_DIR|STORAGE_URI [--json]`, and the doctor's public names in one place.

The parts live in ``pipeline/diagnosis/``: ``rules`` (the health rules, shared with the live
``pipeline.training.health.HealthCallback``), ``history`` (the metric stream they read), ``run_reader``
(a run directory's rows and config) and ``report`` (report.md, the text and JSON printed here).
"""

from __future__ import annotations

import sys

from pipeline.errors import cli_error
from pipeline.diagnosis.history import History
from pipeline.report.markdown import doctor, findings_text, input_warnings
from pipeline.diagnosis.rules import RULES, Finding, RuleSettings, check, diagnose
from pipeline.report.run_reader import RunDirError, load_run
from pipeline.rundir.storage import StorageError, is_uri, local_copy

__all__ = ["RULES", "Finding", "History", "RunDirError", "RuleSettings", "check", "diagnose", "doctor", "doctor_cli",
           "load_run"]


def doctor_cli(args) -> int:
    """`synth-grpo doctor RUN_DIR [--json]`: 0 when diagnosed (findings or not), 2 for bad input."""
    try:
        run_dir = args.run_dir
        if is_uri(run_dir):  # a run in output.storage: read it with no node alive
            run_dir = local_copy(run_dir)
            print(f"{args.run_dir}: copied to {run_dir}", file=sys.stderr)
        run, findings, report, plots = doctor(run_dir)
    except (RunDirError, StorageError) as e:
        return cli_error("doctor", e)
    except OSError as e:  # could not write the report or plots
        return cli_error("doctor", f"could not write the report in {args.run_dir!r}: {e}", code=1)
    for line in input_warnings(run):
        print(f"synth-grpo doctor: {line}", file=sys.stderr)
    if getattr(args, "json", False):
        print(Finding.to_json(findings))
        print(f"synth-grpo doctor: wrote {report} and {len(plots)} plots", file=sys.stderr)
        return 0
    print(findings_text(run, findings, report, plots))
    return 0
