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

        tlogs = self.trainer._logs
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

    Every rank reports its own part (``storage.rank_part``: rank 0 the shared files, each rank its
    ZeRO shards), uploaded in the background; Ray Train merges the parts into one checkpoint, so no
    disk needs to be shared between nodes. ``checkpoint/seconds`` is how long training waited.
    """

    def __init__(self):
        self.latest: dict[str, Any] = {}
        self.trainer = None
        self._save_start: float | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.latest.update(_jsonable(logs))

    def on_step_end(self, args, state, control, **kwargs):
        import time

        self._save_start = time.perf_counter() if control.should_save else None

    def on_save(self, args, state, control, **kwargs):
        import time

        import ray.train
        from ray.train import CheckpointUploadMode

        from pipeline.storage import rank_part

        t0 = self._save_start or time.perf_counter()
        rank = ray.train.get_context().get_world_rank()
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        part = rank_part(ckpt, rank, Path(args.output_dir) / f".ray-part-{state.global_step}-rank{rank}")
        metrics = {**{k: v for k, v in self.latest.items() if v is not None}, "step": state.global_step}
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(part)),
                         checkpoint_dir_name=f"checkpoint-{state.global_step:06d}",
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
        seconds = time.perf_counter() - t0  # HF's save + this rank's part + handing it to the upload thread
        tr = self.trainer
        if tr is not None and state.is_world_process_zero:  # a row of its own, like the evaluator's
            should_log = tr.control.should_log
            tr.callback_handler.on_log(tr.args, state, tr.control, logs={"checkpoint/seconds": round(seconds, 3)})
            tr.control.should_log = should_log
