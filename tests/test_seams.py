"""Library seams (pipeline/seams/): the pins in pyproject.toml, the rule that nothing outside
pipeline/seams/ touches a private name of TRL, transformers, DeepSpeed, Ray, PEFT or Accelerate, and
each seam's effect checked on a real GRPOTrainer (tiny policy, in process, no Ray) or the library
itself: an upgrade that moves one fails here, and at run time with a message naming it, instead of
silently doing nothing. No test reads a library's source text."""

from __future__ import annotations

import ast
import math
import sys
import types
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from transformers import TrainerCallback

from pipeline.config import load_config
from pipeline.plan.inert import one_step_per_rollout
from pipeline.seams import deepspeed_seams, ray_seams, transformers_seams, trl_seams
from pipeline.seams.trl_seams import set_generation_cap

REPO = Path(__file__).resolve().parents[1]
PINNED = ("ray", "transformers", "trl", "peft", "deepspeed")
STEPS, WARMUP, LR = 4, 0.5, 1e-3


def _requirements() -> dict[str, Requirement]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps)}


def test_installed_versions_are_within_the_pinned_minors():
    """The seams are written against one minor version each: the pins allow its patch releases only."""
    reqs = _requirements()
    for name in PINNED:
        spec = reqs[name].specifier
        assert any(s.operator == "<" for s in spec) and any(s.operator == ">=" for s in spec), (name, str(spec))
        assert spec.contains(version(name), prereleases=True), f"{name} {version(name)} is outside {spec}"
        v = Version(version(name))
        assert not spec.contains(f"{v.major}.{v.minor + 1}.0"), f"{name}: {spec} admits the next minor version"


# --- the private-name rule -------------------------------------------------------------------------

LIBRARIES = ("trl", "transformers", "deepspeed", "ray", "peft", "accelerate")
SEAMS = Path("pipeline") / "seams"
# Private by spelling, public by contract: the stdlib's namedtuple API.
PUBLIC_UNDERSCORE = {"_asdict", "_replace", "_fields", "_field_defaults", "_make"}
ATTR_FUNCS = ("getattr", "hasattr", "setattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name not in PUBLIC_UNDERSCORE


def _imports(tree: ast.Module) -> dict[str, str]:
    """{local name: dotted origin} of every import in a module (``from trl import GRPOTrainer`` -> trl.GRPOTrainer)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return out


def _dotted(node: ast.AST, imports: dict[str, str]) -> str | None:
    """``hf_trainer.deepspeed_load_checkpoint`` -> transformers.trainer.deepspeed_load_checkpoint; None if not an import."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in imports:
        return ".".join([imports[node.id], *reversed(parts)])
    return None


def _library(dotted: str | None) -> bool:
    return dotted is not None and dotted.split(".")[0] in LIBRARIES


def _resolve(dotted: str):
    """The object a dotted library name names (``trl.GRPOTrainer``), imported."""
    import importlib

    module, _, attr = dotted.rpartition(".")
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return getattr(importlib.import_module(module), attr)


class _Class:
    def __init__(self, node: ast.ClassDef, imports: dict[str, str]):
        self.node, self.name = node, node.name
        self.library_bases = [d for d in (_dotted(b, imports) for b in node.bases) if _library(d)]
        self.project_bases = [b.id for b in node.bases if isinstance(b, ast.Name) and not _library(imports.get(b.id))]
        self.defines = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        self.defines |= {t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                         for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        for n in ast.walk(node):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in ("self", "cls"):
                        self.defines.add(e.attr)


def _modules(root: Path) -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(encoding="utf-8")) for pkg in ("pipeline", "rewards")
            for p in sorted((root / pkg).rglob("*.py")) if SEAMS not in p.relative_to(root).parents}


def _project_defined(trees: dict[Path, ast.Module]) -> set[str]:
    """Every private name the project defines: functions, classes, module and class attributes,
    attributes set on ``self``/``cls``, parameters. ``obj._x`` of another name is a library's."""
    out = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.arg):
                out.add(n.arg)
        for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            out |= _Class(c, {}).defines
    return out


def private_name_uses(root: Path) -> list[str]:
    """``path:line: what`` for each touch of a private name of LIBRARIES outside pipeline/seams/: a
    private import, ``obj._x`` / ``getattr(obj, "_x")`` of a name the project does not define, a
    ``self._x`` a library base class defines, an override of a library class's private method, an
    assignment into a library module (a monkey-patch)."""
    trees = _modules(root)
    defined = _project_defined(trees)
    classes: dict[str, _Class] = {}
    for tree in trees.values():
        imports = _imports(tree)
        classes.update({n.name: _Class(n, imports) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)})

    def lineage(c: _Class, seen=()) -> tuple[list[str], set[str]]:
        """(library base classes, private names the project classes in the lineage define)."""
        libs, names = list(c.library_bases), set(c.defines)
        for b in c.project_bases:
            if b in classes and b not in seen:
                more_libs, more_names = lineage(classes[b], (*seen, c.name))
                libs, names = libs + more_libs, names | more_names
        return libs, names

    out = []
    for path, tree in trees.items():
        rel, imports = path.relative_to(root), _imports(tree)

        def report(node: ast.AST, what: str):
            out.append(f"{rel}:{node.lineno}: {what}")

        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [f"{node.module}.{a.name}" for a in node.names]
                for name in names:
                    if _library(name) and any(_private(p) for p in name.split(".")):
                        report(node, f"imports {name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr) and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) and not _is_super(node.value):
                if _library(_dotted(node.value, imports)) or node.attr not in defined:
                    report(node, f"reads {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTR_FUNCS \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                obj, attr = node.args[0], node.args[1].value
                if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                    continue  # checked with the class below
                if _library(_dotted(obj, imports)) or (_private(attr) and attr not in defined):
                    report(node, f"{node.func.id}({ast.unparse(obj)}, {attr!r})")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Attribute) and _library(_dotted(t.value, imports)):
                        report(node, f"patches {_dotted(t, imports)}")
        for c in (classes[n.name] for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            libs, own = lineage(c)
            if not libs:
                continue
            for n in c.node.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(n.name) \
                        and any(hasattr(_resolve(b), n.name) for b in libs):
                    report(n, f"overrides {n.name} of {', '.join(libs)}")
            for n in ast.walk(c.node):
                attr = None
                if isinstance(n, ast.Attribute) and (_is_super(n.value) or (
                        isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))):
                    attr = n.attr
                elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ATTR_FUNCS and \
                        len(n.args) >= 2 and isinstance(n.args[0], ast.Name) and n.args[0].id in ("self", "cls") \
                        and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
                    attr = n.args[1].value
                if attr and _private(attr) and attr not in own:
                    report(n, f"reads {attr} of {', '.join(libs)} ({c.name})")
    return sorted(set(out))


def _is_super(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def test_no_module_outside_the_seams_touches_a_library_private_name():
    uses = private_name_uses(REPO)
    assert not uses, "move these into pipeline/seams/ (one module per library):\n" + "\n".join(uses)


PLANTED = {
    "pipeline/seams/trl_seams.py": "def logs(trainer):\n    return trainer._logs\n",  # the one place allowed
    "pipeline/planted.py": """\
import transformers.trainer as hf_trainer
from ray.train.v2._internal.execution import context
from trl import GRPOTrainer
from transformers import TrainerCallback


def samples(trainer, cb, args):
    cb._init_summary_writer(args)
    hf_trainer.deepspeed_load_checkpoint = None
    return trainer._logs, getattr(trainer, "_metrics")


class Sampling(GRPOTrainer):
    def _calculate_rewards(self, inputs, prompts, completions, ids):
        return super()._calculate_rewards(inputs, prompts, completions, ids)

    def step(self):
        return self._tokenizer, self._refills

    def _own(self):
        self._refills = 0


class Counter(TrainerCallback):
    def __init__(self):
        self._seen = 0

    def _bump(self):
        self._seen += 1

    def on_log(self, args, state, control, **kwargs):
        self._bump()
""",
    "rewards/own.py": """\
class Pad:
    def _pad(self, rows):
        return rows


def pad(judge: Pad, row):
    return judge._pad([row]), row._replace(x=1)
""",
}


def test_the_private_name_rule_finds_each_kind_in_a_planted_tree(tmp_path):
    for rel, text in PLANTED.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = [line.split(": ", 1)[1] for line in private_name_uses(tmp_path)]
    assert sorted(found) == sorted([
        "imports ray.train.v2._internal.execution.context",
        "reads cb._init_summary_writer",
        "patches transformers.trainer.deepspeed_load_checkpoint",
        "reads trainer._logs",
        "getattr(trainer, '_metrics')",
        "overrides _calculate_rewards of trl.GRPOTrainer",
        "reads _tokenizer of trl.GRPOTrainer (Sampling)",
    ]), found


class _Rows(TrainerCallback):
    def __init__(self):
        self.rows = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "learning_rate" in logs:
            self.rows.append(dict(logs, step=state.global_step))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_policy):
    """A real TRL GRPOTrainer built as the workers build it, trained for a few steps."""
    from pipeline.data.sources import load_records
    from pipeline.scoring.clients import eos_kwargs
    from pipeline.training.worker import build_grpo_trainer, load_policy
    from rewards.trl_rewards import make_reward_funcs

    cfg = load_config(None, [
        f"optimization.max_steps={STEPS}", f"optimization.warmup_ratio={WARMUP}", f"optimization.learning_rate={LR}",
        "optimization.lr_scheduler_type=cosine", "optimization.per_device_train_batch_size=4",
        "generation.num_generations=4", "generation.max_completion_length=8", "logging.progress_bar=false",
        f"output.save_steps={STEPS}", "rewards.weights={rouge_l: 0.5, length: 0.5, judge: 0, eos: 1}",
    ])
    train, _, _ = load_records(cfg.data, log=None)
    tokenizer, model, eos_ids = load_policy(cfg, on_gpu=False)
    funcs, weights = make_reward_funcs(cfg.rewards.weights, None, eos_ids, lambda: 8, eos_kwargs(cfg))
    rows = _Rows()
    run_dir = tmp_path_factory.mktemp("seams")
    trainer = build_grpo_trainer(cfg, run_dir, tokenizer, model, train, funcs, weights, [rows])
    trainer.train()
    return trainer, rows.rows, run_dir / "trainer" / f"checkpoint-{STEPS}"


@pytest.mark.slow  # one real GRPOTrainer, 4 steps, shared by the module
def test_learning_rate_follows_the_configured_warmup(trained):
    # optimization.warmup_ratio reaches TRL as warmup_steps=0.5, a ratio of max_steps only from transformers 5
    # (an int of steps before): 2 warmup steps here, then cosine. Logged at step k: the LR step k ran with.
    _, rows, _ = trained
    w = math.ceil(WARMUP * STEPS)
    expected = [LR * (k / w if k < w else 0.5 * (1 + math.cos(math.pi * (k - w) / (STEPS - w)))) for k in range(STEPS)]
    got = [r["learning_rate"] for r in rows if r["step"] >= 1][:STEPS]
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-12), got
    # a ramp 0 -> LR/2 -> LR: with no warmup (0.5 read as 0 steps) step 1 would run at the full LR
    assert got[:3] == pytest.approx([0.0, LR / 2, LR])


def _one_group(trainer, prompts: int = 1) -> list[dict]:
    """Rows for one rollout step of the fixture's trainer: each prompt num_generations times."""
    return [dict(trainer.train_dataset[i]) for i in range(prompts) for _ in range(trainer.num_generations)]


def _completion_lengths(out: dict) -> list[int]:
    return out["completion_mask"].sum(dim=1).tolist()


@pytest.mark.slow  # one real GRPOTrainer, 4 steps, shared by the module
def test_the_length_cap_reaches_trl_generation(trained):
    """The cap the length control sets is the one TRL generates under, lowered and raised mid-run
    (HF backend; the vLLM attributes need a GPU and vLLM, which this suite does not have)."""
    trainer, _, _ = trained
    assert hasattr(trainer, "use_vllm") and not trainer.use_vllm
    try:
        for cap in (2, 5):
            set_generation_cap(trainer, cap)
            out = trl_seams.generate_and_score(trainer, _one_group(trainer, prompts=2))
            lengths = _completion_lengths(out)
            assert out["completion_ids"].shape[1] <= cap and max(lengths) == cap, (cap, lengths)  # cut at the cap
    finally:
        set_generation_cap(trainer, 8)


@pytest.mark.slow  # one real GRPOTrainer, 4 steps, shared by the module
def test_trl_logs_hold_what_the_samples_writer_reads(trained):
    trainer, _, _ = trained
    logs = trl_seams.logged_samples(trainer)
    n = len(logs["prompt"])
    assert n > 0 and len(logs["completion"]) == n
    assert set(logs["rewards"]) == {f.__name__ for f in trainer.reward_funcs}
    assert all(len(v) == n for v in logs["rewards"].values())


@pytest.mark.slow  # one real GRPOTrainer, 4 steps, shared by the module
def test_trls_one_step_per_rollout_rule_is_the_one_inert_settings_uses(trained):
    """TRL computes old log-probs (so the PPO ratio can differ from 1 and clip) exactly where
    pipeline.plan.inert says a rollout outlives its optimizer step; otherwise it uses the current
    ones detached, and the ratio is exactly 1."""
    trainer, _, _ = trained
    args, saved = trainer.args, (trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation,
                                 trainer.num_iterations)
    try:
        for ga, spg, iters in ((1, 1, 1), (1, 2, 1), (2, 1, 2), (2, 4, 1)):  # ratio 1, old, 1, old
            args.gradient_accumulation_steps, args.steps_per_generation, trainer.num_iterations = ga, spg, iters
            out = trl_seams.generate_and_score(trainer, _one_group(trainer))
            has_old = out.get("old_per_token_logps") is not None
            assert has_old == (not one_step_per_rollout(ga, spg, iters)), (ga, spg, iters)
    finally:
        args.gradient_accumulation_steps, args.steps_per_generation, trainer.num_iterations = saved


@pytest.mark.slow  # one real GRPOTrainer, 4 steps, shared by the module
def test_trl_scores_through_the_fused_lm_head_the_planner_counts(trained):
    """memory.py counts one logits tile instead of [tokens, vocab] where fuses_lm_head(): TRL's model
    then returns per-token log-probs, and no logits, for the rows it scores."""
    import torch

    trainer, _, _ = trained
    assert trl_seams.fuses_lm_head()
    ids = torch.tensor([[1, 5, 9, 4, 7, 2]])
    with torch.no_grad():
        out = trainer.model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert out.log_probs is not None and out.log_probs.shape == (1, ids.shape[1] - 1)
    assert getattr(out, "logits", None) is None


@pytest.mark.slow  # one real GRPOTrainer, 4 steps, shared by the module
def test_rollout_seams_see_each_step(trained):
    """The benchmarks' probes: the gathered rewards of each rollout step, and wrappers of its two phases."""
    trainer, _, _ = trained
    seen, calls = [], []
    trl_seams.observe_rewards(trainer, seen.append)
    single_turn, step = trl_seams.rollout_methods(trainer)

    def counted(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    trl_seams.replace_rollout_methods(trainer, counted("turn", single_turn), counted("step", step))
    try:
        trl_seams.generate_and_score(trainer, _one_group(trainer))
    finally:
        del trainer._calculate_rewards, trainer._generate_single_turn, trainer._generate_and_score_completions
    assert calls == ["step", "turn"]
    assert len(seen) == 1 and tuple(seen[0].shape) == (trainer.num_generations, len(trainer.reward_funcs))


@pytest.mark.slow  # one real GRPOTrainer, 4 steps, shared by the module
def test_a_finished_run_exports_the_adapter_from_its_checkpoint(trained, tmp_path, tiny_policy):
    """The worker's "finished already" branch: the checkpoint's adapter, loaded by PEFT's public API, is
    the trained one (no Trainer._load_from_checkpoint)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.training.worker import export_trained_weights

    trainer, _, checkpoint = trained
    export_trained_weights(checkpoint, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    assert not list((tmp_path / "adapter").glob("optimizer*")) and not (tmp_path / "adapter" / "trainer_state.json").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_policy), tmp_path / "adapter")
    want = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    got = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert want and set(got) == set(want)
    assert all(torch.equal(got[k], want[k].cpu()) for k in want)
    assert any(v.abs().sum() > 0 for k, v in got.items() if "lora_B" in k)  # trained: B left its zero init
    with pytest.raises(FileNotFoundError, match="no adapter or model weights"):
        export_trained_weights(tmp_path, tmp_path / "nothing")


def test_a_missing_seam_raises_naming_it():
    from pipeline.training.callbacks import SamplesWriter

    gone = types.SimpleNamespace(args=types.SimpleNamespace(), max_completion_length=8, use_vllm=False,
                                 generation_kwargs={"max_new_tokens": 8})
    with pytest.raises(RuntimeError, match=r"generation_config.*trl"):
        set_generation_cap(gone, 16)
    with pytest.raises(RuntimeError, match=r"max_completion_length"):
        set_generation_cap(types.SimpleNamespace(args=types.SimpleNamespace()), 16)
    vllm = types.SimpleNamespace(args=types.SimpleNamespace(), max_completion_length=8, use_vllm=True, vllm_generation=None)
    with pytest.raises(RuntimeError, match=r"vllm_generation"):
        set_generation_cap(vllm, 16)
    writer = SamplesWriter(REPO, every=1, num_samples=1)
    writer.trainer = types.SimpleNamespace()
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=1)
    with pytest.raises(RuntimeError, match=r"_logs"):
        writer.on_log(None, state, None, logs={"completions/clipped_ratio": 1.0})


def test_the_tensorboard_writer_is_made_before_training_logs(tmp_path, monkeypatch):
    """The evaluation may write before transformers' TensorBoardCallback made its writer (on_train_begin)."""
    pytest.importorskip("tensorboard")
    from transformers.integrations import TensorBoardCallback

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path))
    cb = TensorBoardCallback()
    assert cb.tb_writer is None
    writer = transformers_seams.tensorboard_writer(cb, types.SimpleNamespace())
    assert writer is not None and writer is cb.tb_writer
    writer.add_text("eval/samples", "x", global_step=1)
    writer.flush()
    assert list(tmp_path.glob("events.out.tfevents.*"))
    assert transformers_seams.tensorboard_writer(cb, None) is writer  # made once


def test_deepspeed_resume_replaces_the_loader_transformers_resumes_with():
    """Inside the block, the name transformers' resume calls (``deepspeed_load_checkpoint``, looked up
    in its module's globals by ``Trainer._prepare_for_training``) is the resize-aware loader; after
    it, transformers' own. The loader's effect on a real ZeRO checkpoint: tests/test_storage.py."""
    import transformers.trainer as hf_trainer

    original = hf_trainer.deepspeed_load_checkpoint
    resume = hf_trainer.Trainer._prepare_for_training
    assert "deepspeed_load_checkpoint" in resume.__code__.co_names and resume.__globals__ is vars(hf_trainer)
    with transformers_seams.deepspeed_resume_from(None):
        assert hf_trainer.deepspeed_load_checkpoint is not original
        assert resume.__globals__["deepspeed_load_checkpoint"] is hf_trainer.deepspeed_load_checkpoint
    assert hf_trainer.deepspeed_load_checkpoint is original


def test_the_universal_converter_takes_the_namespace_its_command_line_builds(monkeypatch):
    """DeepSpeed's converter has no Python API: the Namespace handed to its ``main`` has exactly the
    options its own parser defines (a new one would be read and missing)."""
    from deepspeed.checkpoint import ds_to_universal

    monkeypatch.setattr(sys, "argv", ["ds_to_universal", "--input_folder", "in", "--output_folder", "out"])
    parsed = ds_to_universal.parse_arguments()
    ours = deepspeed_seams.universal_converter_args(Path("in"), Path("out"))
    assert set(vars(ours)) == set(vars(parsed))
    assert (ours.input_folder, ours.output_folder) == ("in", "out")


def test_ray_trains_report_logger_is_quieted():
    import logging

    from ray.train.v2._internal.execution import context

    logger = logging.getLogger(context.__file__)
    logger.setLevel(logging.NOTSET)
    ray_seams.quiet_train_report_logger()
    assert logger.level == logging.WARNING


def test_the_print_patch_switch_is_the_one_ray_train_reads():
    from ray.train.v2._internal import constants

    assert ray_seams.NO_TRAIN_PRINT_PATCH == {constants.ENABLE_PRINT_PATCH_ENV_VAR: "0"}


def test_deepspeeds_cpu_backend_starts_without_compiling_its_shm_allreduce(tmp_path):
    """What a ZeRO worker on CPU does first (worker.train_loop_per_worker): DeepSpeed's torch backend
    starts (gloo) with its shared-memory all-reduce absent, and nothing compiled into a fresh extensions
    folder. Without the seam this start compiles C++ for 45-150 s here."""
    import os
    import subprocess

    from tests.conftest import free_port

    port = free_port()
    code = ("from pipeline.seams.deepspeed_seams import skip_shm_allreduce_build; skip_shm_allreduce_build()\n"
            "import deepspeed; from deepspeed import comm\n"
            f"deepspeed.init_distributed(dist_backend='gloo', rank=0, world_size=1, distributed_port={port}, verbose=False)\n"
            "print('shm op:', comm.comm.cdb.shm_comm_op, 'world:', comm.get_world_size())\n")
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "shm op: None world: 1" in out.stdout, out.stdout + out.stderr[-2000:]
    assert not list(extensions.iterdir())  # nothing built
