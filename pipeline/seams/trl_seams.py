"""TRL seams: every private name of TRL's ``GRPOTrainer`` the project touches, and the trainer
attributes its generation reads. Written against trl 1.16.0; ``pyproject.toml`` pins trl to 1.16.x
and tests/test_seams.py checks each seam's effect on a real trainer (tiny policy).

TRL is imported lazily here (seconds): ``memory.py`` (the planner) must stay light."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

SAMPLE_LOG_KEYS = ("prompt", "completion", "rewards", "extra")


def seam_gone(what: str, feature: str, consequence: str = "") -> RuntimeError:
    """The error a moved seam raises: what is gone, in which TRL, and what would silently stop working."""
    try:
        from importlib.metadata import version

        trl = f"trl {version('trl')}"
    except Exception:  # pragma: no cover
        trl = "this trl"
    return RuntimeError(f"{feature}: {what} is gone in {trl}{consequence}; use the TRL version pinned in pyproject.toml "
                        "(tests/test_seams.py checks it)")


class GenerateAndScoreHooks:
    """Mixin before ``GRPOTrainer`` in a subclass's bases: TRL's private rollout step, as public hooks.

    trl 1.16.0: ``GRPOTrainer._generate_and_score_completions(inputs)`` generates, scores and
    computes advantages for one generation batch (the rows a training step consumes), and calls
    ``_calculate_rewards(inputs, prompts, completions, completion_ids_list)``, which returns the
    rewards of every process gathered, one column per reward function; ``_metrics["train"]`` holds
    the lists TRL averages into the next logged row. An override must be a method of the trainer's
    class to take effect, hence a mixin. If TRL renames either method the hooks are never called
    (dynamic sampling silently off); if it changes their signatures they raise TypeError;
    tests/test_dynamic_sampling.py and tests/test_seams.py fail on both.

    A subclass overrides ``generate_and_score`` (default: TRL's own step) and may read the gathered
    rewards of the latest TRL step in ``gathered_rewards``.
    """

    gathered_rewards = None  # [rows of all processes, reward functions] of TRL's latest rollout step

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.gathered_rewards = rewards  # gathered over all processes: the same on every rank
        return rewards

    def _generate_and_score_completions(self, inputs):
        return self.generate_and_score(inputs)

    def generate_and_score(self, inputs: list[dict]) -> dict[str, Any]:
        """The batch one training step consumes; override to change it."""
        return self.trl_generate_and_score(inputs)

    def trl_generate_and_score(self, inputs: list[dict]) -> dict[str, Any]:
        """TRL's own step: generation, rewards, advantages, logps and TRL's metrics."""
        return super()._generate_and_score_completions(inputs)

    def log_train_metric(self, name: str, value: float) -> None:
        """One value into the next logged training row (TRL averages the values since the last log)."""
        self._metrics["train"][name].append(value)

    @property
    def trl_pad_token_id(self) -> int | None:
        """The pad id TRL pads completions with (its ``_tokenizer``: the processing class's tokenizer)."""
        return self._tokenizer.pad_token_id


def generate_and_score(trainer, inputs: list[dict]) -> dict[str, Any]:
    """One rollout step of any GRPOTrainer, as a training step would run it (trl 1.16.0's private
    ``_generate_and_score_completions``). For tests and benchmarks: training calls it itself."""
    return trainer._generate_and_score_completions(inputs)


def logged_samples(trainer) -> dict:
    """TRL's per-step sample buffer (trl 1.16.0: the private ``GRPOTrainer._logs``: prompts,
    completions, per-function rewards, extra dataset columns, each a deque of the latest generation
    batch). No public API exposes it; if it moves, samples.jsonl would stay empty, so this raises by name."""
    logs = getattr(trainer, "_logs", None)
    missing = [k for k in SAMPLE_LOG_KEYS if not isinstance(logs, dict) or k not in logs]
    if missing:
        raise seam_gone(f"GRPOTrainer._logs ({', '.join(missing)})", "samples.jsonl")
    return logs


def observe_rewards(trainer, observe: Callable[[Any], None]) -> None:
    """Call ``observe(rewards)`` with the gathered rewards of each rollout step of this trainer
    instance (trl 1.16.0: wraps the private ``_calculate_rewards``; if TRL renames it, nothing is observed)."""
    if not hasattr(trainer, "_calculate_rewards"):
        raise seam_gone("GRPOTrainer._calculate_rewards", "observe_rewards")
    calculate = trainer._calculate_rewards

    def calculate_and_observe(*args, **kwargs):
        rewards = calculate(*args, **kwargs)
        observe(rewards)
        return rewards

    trainer._calculate_rewards = calculate_and_observe


def rollout_methods(trainer) -> tuple[Callable, Callable]:
    """(one generation turn, the whole rollout step) of this trainer instance, for timing probes
    (trl 1.16.0: the private ``_generate_single_turn`` and ``_generate_and_score_completions``)."""
    return trainer._generate_single_turn, trainer._generate_and_score_completions


def replace_rollout_methods(trainer, single_turn: Callable, generate_and_score_step: Callable) -> None:
    """Install wrappers of ``rollout_methods(trainer)`` on this trainer instance only."""
    trainer._generate_single_turn = single_turn
    trainer._generate_and_score_completions = generate_and_score_step


def set_generation_cap(trainer, length: int) -> None:
    """Cap the completions TRL generates from now on at ``length`` tokens, mid-run.

    trl 1.16.0 copies ``args.max_completion_length`` at start-up; its generation then reads
    ``trainer.max_completion_length`` (and dr_grpo's loss normalisation), with the HF backend
    ``trainer.generation_config.max_new_tokens`` and ``trainer.generation_kwargs`` (handed to
    ``generate``), with vLLM its ``vllm_generation.max_completion_length`` (read on each generate)
    and sampling parameters. All are set here; one that is gone raises instead of capping nothing.
    """
    def gone(what: str) -> RuntimeError:
        return seam_gone(what, "length control", ", so the completion-length cap would not reach generation")

    if not hasattr(trainer, "max_completion_length"):
        raise gone("GRPOTrainer.max_completion_length")
    trainer.max_completion_length = length
    trainer.args.max_completion_length = length  # for anything that reads args later (and for the record)
    vllm = getattr(trainer, "vllm_generation", None)
    if getattr(trainer, "use_vllm", False):
        if vllm is None or not hasattr(vllm, "max_completion_length"):
            raise gone("GRPOTrainer.vllm_generation.max_completion_length")
    else:
        gen_cfg, kwargs = getattr(trainer, "generation_config", None), getattr(trainer, "generation_kwargs", None)
        if gen_cfg is None or not hasattr(gen_cfg, "max_new_tokens"):
            raise gone("GRPOTrainer.generation_config (its max_new_tokens)")
        if not isinstance(kwargs, dict):
            raise gone("GRPOTrainer.generation_kwargs")
        gen_cfg.max_new_tokens = length
        kwargs["max_new_tokens"] = length
    if vllm is not None:
        if hasattr(vllm, "max_completion_length"):
            vllm.max_completion_length = length
        sampling = getattr(vllm, "sampling_params", None)
        if sampling is not None and hasattr(sampling, "max_tokens"):
            sampling.max_tokens = length


def fuses_lm_head() -> bool:
    """Whether TRL scores completions through its fused LM head (``trl.trainer.add_fused_lm_head``,
    in trl 1.16.0: log-probs in [4096 x 32768] tiles, never the [tokens, vocab] logits; older TRL
    built them). Reads TRL's lazy export table: importing ``trl.trainer`` loads no torch. If TRL
    renames it, the planner counts the full logits again (an over-estimate, never an OOM)."""
    try:
        import trl.trainer  # lazy module: the export table only, no torch
    except ImportError:
        return False
    return "add_fused_lm_head" in dir(trl.trainer)


@contextlib.contextmanager
def colocated_engine(trainer) -> Iterator[Any]:
    """The trainer's colocated vLLM engine (``vllm.LLM``) holding the policy's current weights, for
    generation outside TRL's rollout (the held-out evaluation).

    trl 1.16.0 pushes the weights into the engine only when its rollout sees a new optimizer step
    (private ``_last_loaded_step``) and, with sleep mode, wakes the engine for a rollout and puts it
    back to sleep (level 2: weights discarded; private ``vllm_generation._llm_weights_sleeping``).
    The same is done here, so an evaluation never samples from stale weights nor leaves the engine
    holding memory training needs. Every rank must enter (the weight sync gathers ZeRO-3 shards).
    """
    vllm = getattr(trainer, "vllm_generation", None)
    if vllm is None or not hasattr(trainer, "_last_loaded_step") or not hasattr(vllm, "sync_weights"):
        raise seam_gone("GRPOTrainer.vllm_generation / _last_loaded_step", "evaluation through vLLM",
                        ", so the evaluation could sample from stale weights")
    sleeping = bool(getattr(vllm, "_llm_weights_sleeping", False))
    if trainer._last_loaded_step != trainer.state.global_step or sleeping:
        vllm.sync_weights()
        trainer._last_loaded_step = trainer.state.global_step
        vllm._llm_weights_sleeping = False
    if vllm.enable_sleep_mode:
        vllm.llm.wake_up(tags=["kv_cache"])
    try:
        yield vllm.llm
    finally:
        if vllm.enable_sleep_mode:
            vllm.llm.sleep(level=2)
            vllm._llm_weights_sleeping = True


def keep_vllm_unloaded() -> None:
    """For a process that generates with HF ``generate``: trl 1.16.0 imports vLLM along with ``GRPOTrainer``
    whenever vLLM is installed (``trl.generation`` asks ``is_vllm_available()`` at import), seconds of
    CPU per Ray Train worker for nothing. None in ``sys.modules`` makes vLLM unimportable, so TRL finds it
    absent; a process that has already imported TRL or vLLM is left as it is."""
    if "trl" not in sys.modules and "vllm" not in sys.modules:
        sys.modules["vllm"] = None
