"""Every value checked before Ray: each number finite and in its declared range, each name one the
libraries accept (with a did-you-mean), the run name one folder, and every config file read without a
traceback. The numeric cases are generated from the config classes, so a new field is covered by itself."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Union

import pytest
import yaml
from annotated_types import Ge, Gt, Le, Lt

from pipeline.config import (ATTN_IMPLEMENTATIONS, HUB_KERNEL, LORA_ALL_LINEAR, LR_SCHEDULERS, REPORT_TO, ConfigError,
                             RunConfig, config_from_dict, load_config, read_yaml, set_path)
from pipeline.tune.search_space import SpaceError, load_space

REPO = Path(__file__).resolve().parents[1]

# Numbers whose range is a rule across fields or items, checked in config.validate, with a value it refuses.
CROSS_FIELD = {"generation.length_schedule": [[0, 0]]}


def _leaves(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, Any]]:
    for name, tp in typing.get_type_hints(cls, include_extras=True).items():
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", tp


def _numeric(tp: Any) -> tuple[type, list] | None:
    """(int or float, its declared bounds) for a field that holds a number; None for other fields."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        kind = _numeric(args[0])
        return kind and (kind[0], kind[1] + [m for m in args[1:] if isinstance(m, (Ge, Gt, Le, Lt))])
    if origin in (Union, types.UnionType):
        return next((k for k in map(_numeric, args) if k), None)
    if origin is dict:
        return _numeric(args[1])
    return (tp, []) if tp in (int, float) else None


def _outside(kind: type, bound: Any) -> Any:
    """The nearest value of ``kind`` that ``bound`` refuses."""
    if isinstance(bound, Ge):
        return bound.ge - (1 if kind is int else 0.5)
    if isinstance(bound, Le):
        return bound.le + (1 if kind is int else 0.5)
    return bound.gt if isinstance(bound, Gt) else bound.lt


def _cases() -> list[tuple[str, Any]]:
    cases = []
    for path, tp in _leaves(RunConfig):
        kind = _numeric(tp)
        if kind is None or path in CROSS_FIELD:
            continue
        if typing.get_origin(typing.get_type_hints(_section(path))[path.rsplit(".", 1)[1]]) is dict:
            path += ".rouge_l"  # a weights mapping: one of its components
        cases.append((path, math.nan))
        if kind[0] is float:
            cases += [(path, math.inf), (path, -math.inf)]
        cases += [(path, _outside(kind[0], b)) for b in kind[1]]
        if kind[0] is int:
            cases.append((path, 10**30))  # over 64 bits
    return cases + list(CROSS_FIELD.items())


def _section(path: str) -> type:
    cls = RunConfig
    for part in path.split(".")[:-1]:
        cls = typing.get_type_hints(cls)[part]
    return cls


def test_every_number_has_a_declared_range():
    """A new numeric field must say its range (annotated_types on the field) or be a CROSS_FIELD rule."""
    missing = [p for p, tp in _leaves(RunConfig) if (k := _numeric(tp)) and not k[1] and p not in CROSS_FIELD]
    assert missing == [], f"numeric fields without a declared range: {missing}"
    assert len(_cases()) > 150  # the walk reaches every group


@pytest.mark.parametrize("path,value", _cases(), ids=lambda v: str(v) if not isinstance(v, int) or v < 10**9 else "huge")
def test_each_number_out_of_range_is_refused_naming_the_field(path, value):
    data: dict = {}
    set_path(data, path, value)
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert any(p.startswith(f"{path}") and ("must" in p or "expected" in p or "64 bits" in p)
               for p in e.value.problems), e.value.problems


def _float_fields() -> list[str]:
    """Every float field of the models by its dotted path (a weights mapping by one of its components)."""
    paths = [p for p, tp in _leaves(RunConfig) if (k := _numeric(tp)) and k[0] is float]
    return [p + ".rouge_l" if typing.get_origin(typing.get_type_hints(_section(p))[p.rsplit(".", 1)[1]]) is dict else p
            for p in paths]


@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf"])
def test_nan_and_infinities_are_refused_for_every_float_field_from_yaml_and_set(text, tmp_path):
    """YAML's .nan/.inf/-.inf, in a file and through --set, for all float fields at once: each named."""
    floats = _float_fields()
    assert len(floats) > 25 and "grpo.beta" in floats and "rewards.weights.rouge_l" in floats
    data: dict = {}
    for path in floats:
        set_path(data, path, text)
    path = tmp_path / "nan.yaml"
    path.write_text(yaml.safe_dump(data).replace(f"'{text}'", text), encoding="utf-8")
    for args in ((path, None), (None, [f"{p}={text}" for p in floats])):
        with pytest.raises(ConfigError) as e:
            load_config(*args)
        named = {p.split(":", 1)[0] for p in e.value.problems if "must be a finite number" in p}
        assert named == set(floats), (sorted(set(floats) - named), e.value.problems)


@pytest.mark.parametrize("path,value", [("optimization.max_grad_norm", 0), ("generation.top_p", 1), ("generation.top_k", 0),
                                        ("judge.max_retries", 0), ("judge.max_restarts", -1), ("distributed.max_failures", -1),
                                        ("optimization.seed", 2**32 - 1), ("data.max_prompt_length", 1),
                                        ("grpo.dynamic_sampling.max_rounds", 0), ("distributed.num_workers", [1, 2])])
def test_edge_values_that_mean_something_are_accepted(path, value):
    data: dict = {}
    set_path(data, path, value)
    if path == "distributed.num_workers":
        data["optimization"] = {"gradient_accumulation_steps": 2}
    config_from_dict(data)


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("override,needle", [
    ("optimization.lr_scheduler_type=cosnie", "optimization.lr_scheduler_type: 'cosnie' is not one of"),
    ("optimization.lr_scheduler_type=cosnie", "(did you mean 'cosine'?)"),
    ("model.attn_implementation=flash_attention2", "(did you mean 'flash_attention_2'?)"),
    ("logging.report_to=[tensorboard, wandbb]", "logging.report_to[1]: 'wandbb' is not one of"),
    ("lora.target_modules=[q_proj, 'v proj']", "lora.target_modules: 'v proj' is not a module name"),
    ("lora.target_modules=[]", "lora.target_modules: empty"),
    ("lora.target_modules=(q|v_proj", "lora.target_modules: '(q|v_proj' is neither 'all-linear' nor a regular expression"),
    ("generation.backend=vlm", "(did you mean 'vllm'?)"),
    ("grpo.loss_type=dapoo", "(did you mean 'dapo'?)"),
    ("distributed.zero_stage=4", "distributed.zero_stage: 4 must be in [0, 3]"),
    ("generation.vllm_gpu_memory_utilization=0", "generation.vllm_gpu_memory_utilization: 0 must be in (0, 1]"),
    ("generation.vllm_gpu_memory_utilization=1.5", "generation.vllm_gpu_memory_utilization: 1.5 must be in (0, 1]"),
])
def test_a_wrong_name_is_refused_with_a_suggestion(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert any(needle in p for p in e.value.problems), e.value.problems


@pytest.mark.parametrize("override", ["model.attn_implementation=sdpa", "model.attn_implementation=kernels-community/flash-attn3",
                                      "logging.report_to=[all]", "logging.report_to=[tensorboard, mlflow]",
                                      "lora.target_modules=.*(q|v)_proj", "lora.target_modules=[q_proj, layers.0.mlp.up_proj]",
                                      "optimization.lr_scheduler_type=warmup_stable_decay"])
def test_names_the_libraries_accept_pass(override):
    load_config(None, [override])


def test_the_name_lists_are_those_of_the_installed_libraries():
    """The copies in pipeline/config/schema.py (importing transformers at startup costs seconds) against the originals."""
    from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.trainer_utils import SchedulerType

    assert set(LR_SCHEDULERS) == {s.value for s in SchedulerType}
    assert set(ATTN_IMPLEMENTATIONS) == {"eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()}
    assert set(REPORT_TO) == {*INTEGRATION_TO_CALLBACK, "all", "none"}
    assert LORA_ALL_LINEAR == INCLUDE_LINEAR_LAYERS_SHORTHAND
    for name in ("kernels-community/flash-attn3", "org/repo@v1:fn", "sdpa", "a/b/c", "org/repo:x:y"):
        assert bool(HUB_KERNEL.fullmatch(name)) == is_kernel(name), name


# ---------------------------------------------------------------- run names


@pytest.mark.parametrize("name", ["../x", "../../escape", "/", "..", ".", "a/b", "", "a b", "run\n", "/abs/run", "ünï"])
def test_a_run_name_that_is_not_one_folder_is_refused(name):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"output": {"run_name": name}})
    assert any(p.startswith("output.run_name:") for p in e.value.problems), e.value.problems


def test_a_config_file_name_that_is_no_run_name_needs_output_run_name(tmp_path):
    path = tmp_path / "my run.yaml"
    path.write_text("optimization: {max_steps: 3}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="output.run_name: 'my run' must be one folder name"):
        load_config(path)
    assert load_config(path, ["output.run_name=my-run.v2_1"]).output.run_name == "my-run.v2_1"


# ---------------------------------------------------------------- reading config files

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("content,needle", [
    (b"optimization:\n  learning_rate: \xff\xfe\n", "not UTF-8 text (byte 31: b'\\xff')"),
    (b"optimization: {learning_rate: 1e-5\n", "not valid YAML: expected ',' or '}'"),
    (BOMB.encode(), "not valid YAML: aliases (*name) are not supported"),
    (b"- a\n- b\n", "expected a mapping of groups at top level, got list"),
    (b"just text\n", "expected a mapping of groups at top level, got str"),
    (b"# big\n" + b"x" * (1 << 20), "larger than 1048576 bytes"),
    (b"[" * 5000 + b"]" * 5000, "not valid YAML"),
    (b"optimization: {max_steps: " + b"9" * 5000 + b"}\n", "not valid YAML"),
    (b"optimization: !!python/object:os.system {}\n", "not valid YAML"),
    (b"a: \x00\n", "not valid YAML"),
])
def test_a_broken_config_file_is_one_line_naming_it(tmp_path, capsys, content, needle):
    from pipeline.cli.main import main

    path = tmp_path / "broken.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    [problem] = e.value.problems
    assert problem.startswith(str(path)) and needle in problem and "\n" not in problem and len(problem) < 400, problem
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.splitlines()) == 2


def test_a_search_space_is_read_the_same_way(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(BOMB, encoding="utf-8")
    with pytest.raises(SpaceError, match="aliases"):
        load_space(path)


def test_no_shipped_config_or_space_uses_aliases():
    for path in [*(REPO / "configs").glob("*.yaml"), *(REPO / "tune_spaces").glob("*.yaml")]:
        assert read_yaml(path), path  # raises on an alias
    for path in (REPO / "tune_spaces").glob("*.yaml"):
        load_space(path)


# ---------------------------------------------------------------- the command line


def test_cli_refuses_each_bad_value_before_ray_in_seconds(tmp_path):
    sets = ["output.run_name=../x", "optimization.learning_rate=nan", "generation.top_p=7",
            "optimization.max_grad_norm=-1", "judge.max_retries=-1", "optimization.lr_scheduler_type=cosnie"]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pipeline", "train", *(a for s in sets for a in ("--set", s))],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    for field in ("output.run_name", "optimization.learning_rate", "generation.top_p", "optimization.max_grad_norm",
                  "judge.max_retries", "optimization.lr_scheduler_type"):
        assert any(line.startswith(f"  - {field}:") for line in lines), r.stderr
    assert "did you mean 'cosine'?" in r.stderr
    assert "Traceback" not in r.stderr and "ray" not in r.stderr.lower() and not (tmp_path / "runs").exists()
    assert took < 10, took



@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "configs").glob("*.yaml")))
def test_a_resolved_config_reads_back_as_the_same_config(name, tmp_path):
    """What train writes as RUN_DIR/config.yaml (and tune as best.yaml) passes the same checks."""
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml(), encoding="utf-8")
    assert load_config(path).to_dict() == cfg.to_dict()


def test_a_file_of_many_problems_shows_a_bounded_number_of_lines(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text("optimization:\n" + "".join(f"  {'k' * 200}{i}: 1\n" for i in range(1000)), encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert len(e.value.problems) == 101 and e.value.problems[-1] == "... and 900 more problems"
    assert max(map(len, e.value.problems)) < 400


@pytest.mark.parametrize("override", ['eval.score_weights={"a\\nb": 1}', 'lora.target_modules=[q_proj, "x\\ny"]',
                                      "data.source=local", 'model.a\nb=1', "output.run_name=a\x00b"])
def test_every_problem_is_one_printable_line(override):
    sets = [override, "data.path=/no/such\x00file"] if override == "data.source=local" else [override]
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert all(p.isprintable() for p in e.value.problems), e.value.problems


def test_a_damaged_config_of_a_run_being_resumed_is_one_line_naming_it(tmp_path, capsys):
    """A rerun compares the run's saved config.yaml with the new one: read as a config is read, so a
    damaged file stops the rerun with one line (exit 2, before Ray), and the run directory is kept."""
    from pipeline.cli.main import main

    run = tmp_path / "damaged"
    (run / "ray_train").mkdir(parents=True)  # the run has checkpoints: a rerun resumes it
    (run / "config.yaml").write_bytes(b"optimization: {learning_rate: \xff}\n")
    assert main(["train", "--set", f"output.root={tmp_path}", "--set", "output.run_name=damaged"]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'config.yaml'}: not UTF-8 text" in err and "Traceback" not in err, err
    assert (run / "config.yaml").read_bytes().endswith(b"\xff}\n") and (run / "ray_train").is_dir()
