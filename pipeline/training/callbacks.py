"""Trainer callbacks that write the run directory and feed Ray: metrics, samples, eval, checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import TrainerCallback

from pipeline.config import REWARD_COMPONENTS, RunConfig
from pipeline.data.sources import to_prompt
from pipeline.rundir import eval_samples
from pipeline.rundir.files import METRICS, SAMPLES, read_metrics, write_atomic
from pipeline.rundir.storage import rank_part
from pipeline.seams.transformers_seams import tensorboard_writer
from pipeline.seams.trl_seams import logged_samples
from pipeline.training.vllm_engine import engine_sample
from rewards.eos import is_terminated
from rewards.trl_rewards import completion_text

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


def truncate_jsonl(path: Path, last_step: int) -> None:
    """On resume, drop rows past the checkpoint so no step appears twice."""
    if path.exists():
        rows = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
        write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


class MetricsSink(TrainerCallback):
    """metrics.jsonl (rank 0, one object per logged step) and Ray custom-metric gauges."""

    def __init__(self, run_dir: Path, run_name: str, ray_metrics: bool = True):
        self.path = Path(run_dir) / METRICS
        self.run_name = run_name
        self.ray_metrics = ray_metrics
        self._gauges: dict[str, Any] = {}
        self.history: list[dict] = []

    def write(self, row: Mapping[str, Any]) -> None:
        """One row appended to metrics.jsonl (the worker's phase timings come this way, outside the log)."""
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

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
        self.write(row)
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
        self.path = Path(run_dir) / SAMPLES
        self.every, self.num = every, num_samples
        self.trainer = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.trainer is None or not state.is_world_process_zero or state.global_step % self.every:
            return
        if not logs or "completions/clipped_ratio" not in logs:
            return
        tlogs = logged_samples(self.trainer)
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


def score_stderr(groups: list[int], scores: list[float]) -> float:
    """Standard error of the mean score given the prompts: within-prompt variance of the samples
    (sum over prompts of var_p / k_p, over prompts squared); with one sample per prompt, the
    spread over all completions."""
    by: dict[int, list[float]] = {}
    for g, s in zip(groups, scores):
        by.setdefault(g, []).append(s)
    if len(scores) < 2:
        return 0.0
    if all(len(v) < 2 for v in by.values()):
        return math.sqrt(statistics.variance(scores) / len(scores))
    return math.sqrt(sum(statistics.variance(v) / len(v) for v in by.values() if len(v) > 1)) / len(by)


def log_row(trainer, state, logs: dict[str, Any]) -> None:
    """A row of its own, straight to the callbacks: TRL's trainer.log would fold (and clear) the pending train
    metrics. DefaultFlowCallback.on_log clears control.should_log; this step's own train log is kept."""
    should_log = trainer.control.should_log
    trainer.callback_handler.on_log(trainer.args, state, trainer.control, logs=logs)
    trainer.control.should_log = should_log


def _completion_logps(model, seqs, attn, width: int, temperature: float):
    """Per-token log-probabilities of the completion tokens (positions ``width`` on) under ``model``."""
    keep = seqs.shape[1] - width + 1
    logits = model(input_ids=seqs, attention_mask=attn, logits_to_keep=keep).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, seqs[:, width:, None]).squeeze(-1)


def _initial_policy(model, trainer):
    """A context manager yielding the initial policy: the base with LoRA adapters disabled, else TRL's
    reference model (present when grpo.beta > 0); None when neither exists."""
    if hasattr(model, "disable_adapter"):
        @contextlib.contextmanager
        def base():
            with model.disable_adapter():
                yield model
        return base
    ref = getattr(trainer, "ref_model", None)
    return (lambda: contextlib.nullcontext(ref)) if ref is not None else None


class Evaluator(TrainerCallback):
    """Held-out evaluation: ``eval.samples_per_prompt`` completions per eval prompt, scored with the pool.

    ``eval/score`` uses fixed weights (``eval.score_weights``) with the EOS rate as the eos term, so
    it stays comparable when Ray Tune changes the training reward weights. It is generated at a fixed
    budget (``max_new_tokens``: ``eval.max_new_tokens`` or the run's largest length), never at the
    moving training cap, which would make it follow the cap rather than learning; from the same seed
    at every evaluation (equal policies score equal; a gain is not sampling luck between two draws),
    inside ``torch.random.fork_rng`` so training's sample stream is the same with or without it.
    ``eval/score_stderr``: the sampling error of ``eval/score`` given the prompts (within-prompt
    variance over the samples). ``eval/kl_to_initial``: how far the policy has moved, per token on the
    eval completions (k3 estimator, as TRL's ``kl``; the initial policy is the base with LoRA
    adapters disabled, or TRL's reference model without LoRA).
    """

    def __init__(self, cfg: RunConfig, records: list[dict], tokenizer, pool, eos_token_ids: list[int],
                 max_new_tokens: int, report: Callable[[dict], None] | None = None):
        self.cfg = cfg
        self.records = records[: cfg.eval.num_prompts]
        self.prompts = [to_prompt(r, cfg.data.system_prompt) for r in self.records]
        self.tokenizer, self.pool = tokenizer, pool
        self.eos_ids = eos_token_ids
        self.max_new_tokens = cfg.eval.max_new_tokens or max_new_tokens
        self.report = report
        self.trainer = None
        self.last: dict[str, float] = {}
        self.samples_path: Path | None = None  # rank 0: every answer with its scores (pipeline/rundir/eval_samples.py)

    def _encode(self, items: list[int]) -> dict:
        """The prompts ``items`` as one left-padded batch (the chat template applied)."""
        return self.tokenizer.apply_chat_template(
            [self.prompts[i] for i in items], add_generation_prompt=True, tokenize=True,
            padding=True, return_tensors="pt", return_dict=True,
        )

    def _cut(self, row: list[int]) -> list[int]:
        """A completion up to and including its first EOS token."""
        return row[:next((j + 1 for j, t in enumerate(row) if t in self.eos_ids), len(row))]

    def _engine_samples(self, batches: list[dict], seed: int) -> list[list[tuple[list[int], float]]]:
        """Each batch's completions from the run's vLLM engine, in one call (every rank makes it, with
        prompts or not: it syncs the weights first), at the same budget and sampling settings as HF's."""
        prompts = [ids[mask.bool()].tolist() for enc in batches for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
        g = self.cfg.generation
        sampled = engine_sample(self.trainer, prompts, max_tokens=self.max_new_tokens, temperature=g.temperature,
                                top_p=g.top_p, stop_token_ids=self.eos_ids, seed=seed)
        out, at = [], 0
        for enc in batches:
            out.append(sampled[at:at + len(enc["input_ids"])])
            at += len(enc["input_ids"])
        return out

    def _complete(self, model, enc: dict, sampled: list[tuple[list[int], float]] | None) -> list[tuple]:
        """(completion ids, mean per-token k3 KL to the initial policy, and with the engine its log-probability
        and the policy's of the same tokens) for one batch: sampled by HF generate, or taken from the engine."""
        width = enc["input_ids"].shape[1]
        if sampled is None:
            seqs = model.generate(
                **enc, max_new_tokens=self.max_new_tokens, do_sample=True, temperature=self.cfg.generation.temperature,
                top_p=self.cfg.generation.top_p, pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.eos_ids,
            )
            rows = [self._cut(row) for row in seqs[:, width:].tolist()]
            kls, _ = self._logprobs(model, enc, rows, policy=False)
            return [(r, kl, None, None) for r, kl in zip(rows, kls)]
        rows = [self._cut(ids) for ids, _ in sampled]
        kls, policy = self._logprobs(model, enc, rows, policy=True)
        return [(r, kl, engine, mine) for r, kl, (_, engine), mine in zip(rows, kls, sampled, policy)]

    def _logprobs(self, model, enc: dict, rows: list[list[int]], policy: bool) -> tuple[list, list]:
        """Per completion: the mean per-token k3 KL of the current policy to the initial one (None without
        one), and if ``policy`` the current policy's log-probability of it (else None)."""
        initial = _initial_policy(model, self.trainer)
        longest = max((len(r) for r in rows), default=0)
        if (initial is None and not policy) or not longest:
            return [None] * len(rows), [None] * len(rows)
        width = enc["input_ids"].shape[1]
        ids = enc["input_ids"]
        completions = torch.full((len(rows), longest), self.tokenizer.pad_token_id, dtype=ids.dtype, device=ids.device)
        mask = torch.zeros_like(completions)
        for i, r in enumerate(rows):
            completions[i, : len(r)] = torch.tensor(r, dtype=ids.dtype)
            mask[i, : len(r)] = 1
        seqs, attn = torch.cat([ids, completions], dim=1), torch.cat([enc["attention_mask"], mask], dim=1)
        temp = self.cfg.generation.temperature
        now = _completion_logps(model, seqs, attn, width, temp)
        mine = (now * mask).sum(1).tolist() if policy else [None] * len(rows)
        if initial is None:
            return [None] * len(rows), mine
        with initial() as base:
            before = _completion_logps(base, seqs, attn, width, temp)
        r = before - now
        k3 = (torch.exp(r) - 1 - r) * mask
        return (k3.sum(1) / mask.sum(1).clamp(min=1)).tolist(), mine

    def evaluate(self, step: int) -> dict[str, float]:
        """Every rank generates its share of the eval completions; all are gathered, scored and summed up."""
        acc = self.trainer.accelerator
        k = self.cfg.eval.samples_per_prompt
        items = [i for i in range(len(self.records)) for _ in range(k)]
        mine = list(range(acc.process_index, len(items), acc.num_processes))
        results = self._generate_share([items[j] for j in mine])
        texts = [self.tokenizer.decode(result[0], skip_special_tokens=True) for result in results]
        gathered = acc.gather_for_metrics([(j, t, *result) for j, t, result in zip(mine, texts, results)],
                                          use_gather_object=True)
        gathered = sorted(gathered, key=lambda x: x[0])
        self.last = self._metrics(step, items, gathered) if gathered else {}
        return self.last

    def _generate_share(self, prompts: list[int]) -> list[tuple]:
        """This rank's completions (``_complete``), from the same seed at every evaluation: equal weights,
        equal samples, with either engine."""
        from trl.models import unwrap_model_for_generation  # trl: loaded with the trainer

        tr = self.trainer
        acc = tr.accelerator
        seed = self.cfg.optimization.seed + 1000 * acc.process_index
        chunk = max(1, self.cfg.generation_batch_size // self.cfg.distributed.num_workers)
        batches = [self._encode(prompts[s:s + chunk]) for s in range(0, len(prompts), chunk)]
        # vLLM samples outside the unwrap context: its weight sync gathers ZeRO-3 shards by itself.
        sampled = self._engine_samples(batches, seed) if self.cfg.generation.backend == "vllm" else [None] * len(batches)
        results: list[tuple] = []
        devices = [acc.device] if acc.device.type == "cuda" else []
        # Every rank enters the unwrap context (ZeRO-3 gathers parameters collectively there).
        with unwrap_model_for_generation(tr.model_wrapped, acc) as model, torch.no_grad(), \
                torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)  # the same eval samples every time
            if batches:
                was_training = model.training
                model.eval()
                for enc, engine_rows in zip(batches, sampled):
                    results += self._complete(model, {k: v.to(acc.device) for k, v in enc.items()}, engine_rows)
                model.train(was_training)
        return results

    def _metrics(self, step: int, items: list[int], gathered: list[tuple]) -> dict[str, float]:
        """eval/* of all ranks' completions (``gathered``: index, text, ids, KL); rank 0 also writes them out."""
        js, cands, ids, kls, engine_lps, policy_lps = (list(column) for column in zip(*gathered))
        recs = [self.records[items[j]] for j in js]
        scores = self._score(recs, cands, ids)
        ended = [is_terminated(x, self.eos_ids) for x in ids]
        if self.samples_path is not None:
            rows = eval_samples.eval_rows(step, recs, cands, ended, scores, self.cfg.eval.score_weights,
                                          engine_lps, policy_lps)
            eval_samples.write(self.samples_path, rows)
            to_tensorboard(self.trainer, step, rows)
        n = len(cands)
        metrics = {**{f"eval/{key}": sum(v) / n for key, v in scores.items()}, "eval/eos_rate": sum(ended) / n,
                   "eval/mean_length": sum(len(x) for x in ids) / n, "eval/max_new_tokens": self.max_new_tokens,
                   "eval/num_completions": n}
        w = self.cfg.eval.score_weights
        per = [eval_samples.answer_score({c: v[i] for c, v in scores.items()}, ended[i], w) for i in range(n)]
        metrics["eval/score"] = sum(per) / n
        metrics["eval/score_stderr"] = score_stderr([items[j] for j in js], per)
        kls = [kl for kl in kls if kl is not None]
        if kls:
            metrics["eval/kl_to_initial"] = sum(kls) / len(kls)
            var = statistics.variance(kls) if len(kls) > 1 else 0.0
            metrics["eval/kl_to_initial_stderr"] = math.sqrt(var / len(kls))
        return metrics

    def _score(self, recs: list[dict], cands: list[str], ids: list[list[int]]) -> dict[str, list[float]]:
        """The four reward components of each completion, from the pool, in parallel as in training."""
        from pipeline.scoring.clients import eos_kwargs  # imports ray

        q, ref = [r["question"] for r in recs], [r["reference"] for r in recs]
        pool, max_new = self.pool, self.max_new_tokens

        async def score_all():
            return await asyncio.gather(
                pool.rouge_l(cands, ref), pool.length(cands, ref), pool.judge(q, ref, cands),
                pool.eos(ids, self.eos_ids, max_new, eos_kwargs(self.cfg)),
            )

        return dict(zip(REWARD_COMPONENTS, pool.run(score_all())))

    def _run(self, state) -> None:
        metrics = self.evaluate(state.global_step)
        log_row(self.trainer, state, dict(metrics))
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
    Not Ray's public ``ray.train.huggingface.transformers.RayTrainReportCallback``, because it
    reports from every rank a full copy of the same checkpoint folder, nests it under ``checkpoint/``
    with Ray's own directory names (resume reads ``trainer_state.json`` at the top and
    ``train.registered_checkpoints`` uses ``checkpoint-<step>``), and reports the merged log history,
    so an old ``eval/score`` would ride along with every checkpoint into Tune's scheduler.

    ``flush`` (rank 0 with ``output.storage``: ``RunFileSync.flush``) runs before each report, so
    storage holds the run's files up to the checkpoint's step before Ray Train can register it: a
    node that resumes from the checkpoint pulls them, and the rows up to it are all there.
    """

    def __init__(self, flush=None):
        self.latest: dict[str, Any] = {}
        self.trainer = None
        self.flush = flush
        self._save_start: float | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:  # the Evaluator reports eval/* itself, at its own step; keep them off checkpoint reports
            self.latest.update({k: v for k, v in _jsonable(logs).items() if not k.startswith("eval/")})

    def on_step_end(self, args, state, control, **kwargs):
        self._save_start = time.perf_counter() if control.should_save else None

    def on_save(self, args, state, control, **kwargs):
        import ray.train  # ray: only inside a Ray Train worker
        from ray.train import CheckpointUploadMode

        t0 = self._save_start or time.perf_counter()
        rank = ray.train.get_context().get_world_rank()
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        part = rank_part(ckpt, rank, Path(args.output_dir) / f".ray-part-{state.global_step}-rank{rank}")
        metrics = {**{k: v for k, v in self.latest.items() if v is not None}, "step": state.global_step}
        if self.flush is not None:
            self.flush()
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(part)),
                         checkpoint_dir_name=f"checkpoint-{state.global_step:06d}",
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC)
        seconds = time.perf_counter() - t0  # HF's save + this rank's part (+ the run's files) + the hand-over
        if self.trainer is not None and state.is_world_process_zero:  # a row of its own, like the evaluator's
            log_row(self.trainer, state, {"checkpoint/seconds": round(seconds, 3)})


def training_callbacks(*, length_control, samples, health, events, metrics, reporter, evaluator, sync=None) -> list:
    """The worker's callbacks in the order the trainer must call them (HF calls them in list order).

    They share one ``logs`` dict per logged step, and the length control writes the cap that step was
    generated under (``generation/max_completion_length``) into it: it comes first, so the samples,
    the health rules, metrics.jsonl and Ray Train's reports all see the cap. ``events`` writes the
    length control's cap changes and the health callback's findings to events.jsonl: it comes after
    both, so each is recorded at the step it happened. The storage sync uploads the files the others
    wrote: last.
    """
    out = [length_control, samples, health, events, metrics, reporter, evaluator]
    return out + ([sync] if sync is not None else [])


def to_tensorboard(trainer, step: int, rows: Sequence[Mapping[str, Any]]) -> bool:
    """The evaluation's best and worst answers as TensorBoard text (tag ``eval/samples``), through
    the run's own TensorBoardCallback writer; False when the run does not report to TensorBoard."""
    from transformers.integrations import TensorBoardCallback

    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, TensorBoardCallback):
            if tensorboard_writer(cb, trainer.args) is None or not rows:
                return False
            cb.tb_writer.add_text("eval/samples", "\n".join(eval_samples.markdown(step, rows)), global_step=step)
            cb.tb_writer.flush()
            return True
    return False
