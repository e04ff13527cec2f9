"""Trainer callbacks that write the run directory and feed Ray: metrics, samples, eval, checkpoints."""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerCallback

from pipeline.config import REWARD_COMPONENTS, RunConfig

METRIC_PREFIX = "synth_grpo_"


def prometheus_name(key: str) -> str:
    return METRIC_PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_")


def _jsonable(logs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in logs.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
    return out


def read_metrics(path: Path) -> list[dict]:
    """Rows of a JSONL file (none if it is missing); broken lines (a run killed mid-write) are skipped."""
    from pipeline.doctor import read_metrics as read_rows

    return read_rows(path)[0] if path.exists() else []


def truncate_jsonl(path: Path, last_step: int) -> None:
    """On resume, drop rows past the checkpoint so no step appears twice."""
    if path.exists():
        rows = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


class MetricsSink(TrainerCallback):
    """metrics.jsonl (rank 0, one object per logged step) and Ray custom-metric gauges."""

    def __init__(self, run_dir: Path, run_name: str, ray_metrics: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.run_name = run_name
        self.ray_metrics = ray_metrics
        self._gauges: dict[str, Any] = {}
        self.history: list[dict] = []

    def _gauge(self, key: str):
        if key not in self._gauges:
            from ray.util.metrics import Gauge

            self._gauges[key] = Gauge(prometheus_name(key), description=f"synth-grpo {key}", tag_keys=("run",))
        return self._gauges[key]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {"step": state.global_step, **_jsonable(logs)}
        self.history.append(row)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        if self.ray_metrics:
            try:
                for k, v in row.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        self._gauge(k).set(float(v), tags={"run": self.run_name})
            except Exception:  # metrics are best effort: never stop training for the dashboard
                self.ray_metrics = False


TRL_LOG_KEYS = ("prompt", "completion", "rewards", "extra")


def trl_logs(trainer) -> dict:
    """TRL's private per-step sample buffer (GRPOTrainer._logs: prompts, completions, per-function rewards,
    extra dataset columns). No public API exposes it; tests/test_seams.py pins its shape, and a TRL that
    moved it fails here by name instead of writing no samples."""
    logs = getattr(trainer, "_logs", None)
    missing = [k for k in TRL_LOG_KEYS if not isinstance(logs, dict) or k not in logs]
    if missing:
        from importlib.metadata import version

        raise RuntimeError(f"samples.jsonl: GRPOTrainer._logs ({', '.join(missing)}) is gone in trl {version('trl')}; "
                           "use the TRL version pinned in pyproject.toml (tests/test_seams.py checks it)")
    return logs


class SamplesWriter(TrainerCallback):
    """samples.jsonl every N steps, from TRL's own completion log (prompt, completion, per-component rewards)."""

    def __init__(self, run_dir: Path, every: int, num_samples: int):
        self.path = Path(run_dir) / "samples.jsonl"
        self.every, self.num = every, num_samples
        self.trainer = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.trainer is None or not state.is_world_process_zero or state.global_step % self.every:
            return
        if not logs or "completions/clipped_ratio" not in logs:
            return
        from rewards.trl_rewards import completion_text

        tlogs = trl_logs(self.trainer)
        prompts, completions = list(tlogs["prompt"]), list(tlogs["completion"])
        extra = {k: list(v) for k, v in tlogs["extra"].items()}
        rewards = {k: list(v) for k, v in tlogs["rewards"].items()}
        n = min(self.num, len(completions))
        with self.path.open("a", encoding="utf-8") as f:
            for i in range(n):
                prompt = prompts[i]
                question = prompt[-1]["content"] if isinstance(prompt, list) and prompt else str(prompt)
                f.write(json.dumps({
                    "step": state.global_step,
                    "prompt": question,
                    "completion": completion_text(completions[i]),
                    "reference": extra.get("reference", [None] * (i + 1))[i],
                    "ended_with_eos": extra.get("ended_with_eos", [None] * (i + 1))[i],
                    "scores": {k: v[i] for k, v in rewards.items() if i < len(v)},
                }, ensure_ascii=False) + "\n")


class Evaluator(TrainerCallback):
    """Held-out evaluation: generate one completion per eval prompt, score with the pool.

    ``eval/score`` uses fixed weights (``eval.score_weights``) with the EOS rate as the eos term, so
    it stays comparable when Ray Tune changes the training reward weights.
    """

    def __init__(self, cfg: RunConfig, records: list[dict], tokenizer, pool, eos_token_ids: list[int],
                 current_max_len: Callable[[], int], report: Callable[[dict], None] | None = None):
        from pipeline.data import to_prompt

        self.cfg = cfg
        self.records = records[: cfg.eval.num_prompts]
        self.prompts = [to_prompt(r, cfg.data.system_prompt) for r in self.records]
        self.tokenizer, self.pool = tokenizer, pool
        self.eos_ids = eos_token_ids
        self.current_max_len = current_max_len
        self.report = report
        self.trainer = None
        self.last: dict[str, float] = {}
        self.samples_path: Path | None = None  # rank 0: every answer with its scores (pipeline/eval_samples.py)

    def evaluate(self, step: int) -> dict[str, float]:
        import torch
        from trl.models import unwrap_model_for_generation

        from pipeline.reward_clients import eos_kwargs
        from rewards.eos import is_terminated

        tr = self.trainer
        acc = tr.accelerator
        rank, world = acc.process_index, acc.num_processes
        mine = list(range(rank, len(self.records), world))
        max_new = self.cfg.eval.max_new_tokens or self.current_max_len()
        texts, ids_out = [], []
        # Every rank enters the unwrap context (ZeRO-3 gathers parameters collectively there).
        with unwrap_model_for_generation(tr.model_wrapped, acc) as model, torch.no_grad():
            if mine:
                enc = self.tokenizer.apply_chat_template(
                    [self.prompts[i] for i in mine], add_generation_prompt=True, tokenize=True, padding=True,
                    return_tensors="pt", return_dict=True,
                )
                enc = {k: v.to(acc.device) for k, v in enc.items()}
                was_training = model.training
                model.eval()
                rng_state = torch.get_rng_state()
                torch.manual_seed(self.cfg.optimization.seed + 1000 * rank + step)  # same eval sample stream every run
                out = model.generate(
                    **enc, max_new_tokens=max_new, do_sample=True, temperature=self.cfg.generation.temperature,
                    top_p=self.cfg.generation.top_p, pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=self.eos_ids,
                )
                torch.set_rng_state(rng_state)
                model.train(was_training)
                width = enc["input_ids"].shape[1]
                for row in out[:, width:].tolist():
                    cut = next((j + 1 for j, t in enumerate(row) if t in self.eos_ids), len(row))
                    row = [t for t in row[:cut] if t != self.tokenizer.pad_token_id or t in self.eos_ids]
                    ids_out.append(row)
                    texts.append(self.tokenizer.decode(row, skip_special_tokens=True))
        gathered = acc.gather_for_metrics([(i, t, ids) for i, t, ids in zip(mine, texts, ids_out)], use_gather_object=True)
        gathered = sorted(gathered, key=lambda x: x[0])
        metrics: dict[str, float] = {}
        if gathered:
            recs = [self.records[i] for i, _, _ in gathered]
            cands = [t for _, t, _ in gathered]
            ids = [x for _, _, x in gathered]
            q, ref = [r["question"] for r in recs], [r["reference"] for r in recs]
            pool = self.pool

            async def score_all():  # the four components in parallel, as in training
                return await asyncio.gather(
                    pool.rouge_l(cands, ref), pool.length(cands, ref), pool.judge(q, ref, cands),
                    pool.eos(ids, self.eos_ids, max_new, eos_kwargs(self.cfg)),
                )

            scores = dict(zip(REWARD_COMPONENTS, pool.run(score_all())))
            if self.samples_path is not None:
                from pipeline import eval_samples

                ended = [is_terminated(x, self.eos_ids) for x in ids]
                rows = eval_samples.eval_rows(step, recs, cands, ended, scores, self.cfg.eval.score_weights)
                eval_samples.write(self.samples_path, rows)
                eval_samples.to_tensorboard(tr, step, rows)
            n = len(cands)
            eos_rate = sum(is_terminated(x, self.eos_ids) for x in ids) / n
            for k, v in scores.items():
                metrics[f"eval/{k}"] = sum(v) / n
            metrics["eval/eos_rate"] = eos_rate
            metrics["eval/mean_length"] = sum(len(x) for x in ids) / n
            w = self.cfg.eval.score_weights
            terms = {**{k: metrics[f"eval/{k}"] for k in REWARD_COMPONENTS}, "eos": eos_rate}
            total = sum(w.values()) or 1.0
            metrics["eval/score"] = sum(w.get(k, 0.0) * terms[k] for k in REWARD_COMPONENTS) / total
        self.last = metrics
        return metrics

    def _run(self, state) -> None:
        metrics = self.evaluate(state.global_step)
        # Straight to the callbacks: TRL's trainer.log would fold (and clear) the pending train metrics.
        # DefaultFlowCallback.on_log clears control.should_log; keep this step's own train log.
        tr = self.trainer
        should_log = tr.control.should_log
        tr.callback_handler.on_log(tr.args, state, tr.control, logs=dict(metrics))
        tr.control.should_log = should_log
        if self.report is not None:
            self.report({**metrics, "step": state.global_step})

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0 and self.records:
            self._run(state)

    def on_step_end(self, args, state, control, **kwargs):
        if self.records and (state.global_step % self.cfg.eval.every_steps == 0 or state.global_step == state.max_steps):
            self._run(state)


class RayTrainReporter(TrainerCallback):
    """Hands each HF checkpoint to Ray Train (kept K, restored on worker restart or re-run).

    Not Ray's public ``ray.train.huggingface.transformers.RayTrainReportCallback``, because it
    (1) reports from every rank a full copy of the same shared HF checkpoint folder (N uploads of the
    same files; here rank 0 uploads the folder that already holds every rank's shards);
    (2) nests the folder under ``checkpoint/`` with Ray's own directory names, while resume (the
    worker reads ``trainer_state.json`` at the top) and ``train.registered_checkpoints`` use
    ``checkpoint-<step>``; and (3) reports the merged log history, so an old ``eval/score`` would ride
    along with every checkpoint into Tune's scheduler, without the ``step`` ASHA counts by.
    """

    def __init__(self):
        self.latest: dict[str, Any] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:  # the Evaluator reports eval/* itself, at its own step; keep them off checkpoint reports
            self.latest.update({k: v for k, v in _jsonable(logs).items() if not k.startswith("eval/")})

    def on_save(self, args, state, control, **kwargs):
        import ray.train

        # Rank 0 uploads: the HF checkpoint folder already holds every rank's shards on the
        # run's storage (multi-node runs put output.root on shared storage, as Ray Train requires).
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        metrics = {**{k: v for k, v in self.latest.items() if v is not None}, "step": state.global_step}
        checkpoint = ray.train.Checkpoint.from_directory(str(ckpt)) if state.is_world_process_zero else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=f"checkpoint-{state.global_step:06d}")
