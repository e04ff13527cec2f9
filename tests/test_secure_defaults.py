"""Secure defaults: no Hugging Face token in any config, remote code off unless the config turns it on,
safetensors preferred over pickles, checkpoints read without unpickling code, a local Ray on loopback.
All fast (one short-lived local Ray, no training)."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import typing
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, RunConfig, config_from_dict, load_config
from pipeline.training.driver import prepare_run_dir

REPO = Path(__file__).resolve().parents[1]
FAKE_TOKEN = "hf_SyNtHgRpOtEsTtOkEnDoNoTlEaK0123456789"
TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACEHUB_API_TOKEN")
SECRET_WORDS = ("hf_token", "token", "auth_token", "use_auth_token", "api_key", "apikey", "password", "secret")


def all_fields(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            yield from all_fields(hints[f.name], f"{prefix}{f.name}.")


def test_run_config_has_no_secret_field():
    names = list(all_fields(RunConfig))
    assert "model.trust_remote_code" in names and "judge.max_input_tokens" in names  # the walk reaches nested groups
    leaked = [n for n in names if n.rsplit(".", 1)[-1].lower() in SECRET_WORDS]
    assert leaked == [], f"a config field that can hold a credential ends up in config.yaml: {leaked}"


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_resolved_config_never_holds_the_hf_token(config, tmp_path, monkeypatch):
    for var in TOKEN_ENV:
        monkeypatch.setenv(var, FAKE_TOKEN)
    cfg = load_config(REPO / "configs" / config, [f"output.root={tmp_path}"])
    run_dir = tmp_path / "run"
    prepare_run_dir(cfg, run_dir, log=None)
    text = (run_dir / "config.yaml").read_text(encoding="utf-8")
    assert FAKE_TOKEN not in text and FAKE_TOKEN not in cfg.to_yaml()
    assert "hf_token" not in yaml.safe_load(text)["model"]


@pytest.mark.parametrize("key", ["model.hf_token", "model.token", "judge.hf_token", "data.token"])
def test_token_override_is_rejected_and_not_echoed(key, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={FAKE_TOKEN}"])
    assert any(p.startswith(f"{key}: unknown key") for p in e.value.problems), e.value.problems
    assert FAKE_TOKEN not in str(e.value)

    from pipeline.cli.main import main

    assert main(["train", "--set", f"{key}={FAKE_TOKEN}"]) == 2  # bad input, before Ray or any model starts
    err = capsys.readouterr().err
    assert f"{key}: unknown key" in err and FAKE_TOKEN not in err


def test_a_token_in_a_config_file_is_rejected(tmp_path):
    path = tmp_path / "leaky.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "tiny", "hf_token": FAKE_TOKEN}}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "model.hf_token: unknown key" in "\n".join(e.value.problems) and FAKE_TOKEN not in str(e.value)


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_trust_remote_code_is_off_in_the_default_and_every_shipped_config(config):
    assert RunConfig().model.trust_remote_code is False
    assert load_config(REPO / "configs" / config).model.trust_remote_code is False


# ---------------------------------------------------------------- remote code: the worker's real loading path

REMOTE_CODE = '''
from pathlib import Path
Path({marker!r}).write_text("remote code ran")
raise RuntimeError("remote code ran")
'''


def remote_code_model(tiny_policy: Path, dest: Path) -> tuple[Path, Path]:
    """The tiny policy re-labelled as a model type only its own (remote) code defines; the code leaves a marker."""
    shutil.copytree(tiny_policy, dest)
    marker = dest.parent / f"{dest.name}.ran"
    (dest / "evil_model.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    config = json.loads((dest / "config.json").read_text())
    config["model_type"] = "synth_grpo_evil"
    config["architectures"] = ["EvilForCausalLM"]
    config["auto_map"] = {"AutoConfig": "evil_model.EvilConfig", "AutoModelForCausalLM": "evil_model.EvilForCausalLM"}
    (dest / "config.json").write_text(json.dumps(config))
    return dest, marker


class FakeContext:
    def get_world_rank(self):
        return 0

    def get_world_size(self):
        return 1

    def get_local_rank(self):
        return 0


def run_worker_until_loading(monkeypatch, cfg_data: dict):
    """Run pipeline.training.worker.train_loop_per_worker outside Ray Train up to its model loading."""
    import ray.train

    from pipeline.training.worker import WorkerArgs, train_loop_per_worker

    monkeypatch.setattr(ray.train, "get_context", lambda: FakeContext())
    cfg = config_from_dict(cfg_data)
    train_loop_per_worker(WorkerArgs(cfg, Path("/nonexistent"), pool=None).loop_config())


def test_worker_refuses_remote_code_unless_the_config_allows_it(tiny_policy, tmp_path, monkeypatch):
    model, marker = remote_code_model(tiny_policy, tmp_path / "evil")
    with pytest.raises(Exception) as e:
        run_worker_until_loading(monkeypatch, {"model": {"name_or_path": str(model)}})
    assert "trust_remote_code" in str(e.value), e.value
    assert not marker.exists(), "the model's own code ran although model.trust_remote_code is false"


class Stop(Exception):
    pass


@pytest.mark.parametrize("allowed", [False, True])
def test_worker_passes_trust_remote_code_from_the_config(allowed, tiny_policy, monkeypatch):
    import transformers

    calls = []

    def record(name):
        def from_pretrained(path, *args, **kwargs):
            calls.append((name, kwargs))
            if name == "model":
                raise Stop
            return real_tok(path, *args, **kwargs)

        return from_pretrained

    real_tok = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", record("tokenizer"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record("model"))
    with pytest.raises(Stop):
        run_worker_until_loading(monkeypatch, {"model": {"name_or_path": str(tiny_policy), "trust_remote_code": allowed}})
    assert [n for n, _ in calls] == ["tokenizer", "model"]
    assert all(kw.get("trust_remote_code") is allowed for _, kw in calls), calls


def test_judge_never_runs_remote_code(tiny_policy, tmp_path):
    """The frozen judge has no remote-code switch at all: load_judge always loads with trust_remote_code=False."""
    from rewards.judge import load_judge

    model, marker = remote_code_model(tiny_policy, tmp_path / "evil-judge")
    for backend in ("llm", "embedding"):
        with pytest.raises(Exception) as e:
            load_judge(backend, str(model))
        assert "trust_remote_code" in str(e.value), (backend, e.value)
    assert not marker.exists()


# ---------------------------------------------------------------- safetensors over pickles


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).write_text, ("pickle ran",))


def test_safetensors_loaded_and_pickle_never_unpickled(tiny_policy, tmp_path):
    """Next to model.safetensors, a pytorch_model.bin that runs code when unpickled is never opened.

    The worker and the judge call from_pretrained without use_safetensors, i.e. transformers' default,
    which takes the safetensors file whenever there is one."""
    import torch
    from transformers import AutoModelForCausalLM

    assert (tiny_policy / "model.safetensors").is_file()
    assert not list(tiny_policy.glob("*.bin")), "the project's own policy is saved as safetensors only"
    model_dir = tmp_path / "both"
    shutil.copytree(tiny_policy, model_dir)
    marker = tmp_path / "pickle.ran"
    (model_dir / "pytorch_model.bin").write_bytes(pickle.dumps({"x": _Payload(str(marker))}))
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=False)
    reference = AutoModelForCausalLM.from_pretrained(tiny_policy)
    assert not marker.exists()
    a, b = model.state_dict(), reference.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_checkpoint_rank_count_is_read_without_running_pickled_code(tmp_path):
    """The elastic resume reads a checkpoint from storage before DeepSpeed does: that read unpickles
    tensors and plain data only, so a crafted model-states file cannot run code through it."""
    import torch

    from pipeline.seams.deepspeed_seams import zero_world_size as checkpoint_world_size

    marker = tmp_path / "ran"
    step = tmp_path / "global_step4"
    step.mkdir()
    (tmp_path / "latest").write_text("global_step4")
    torch.save({"dp_world_size": 2, "payload": _RunsCode(str(marker))}, step / "mp_rank_00_model_states.pt")
    with pytest.raises(pickle.UnpicklingError):
        checkpoint_world_size(tmp_path)
    assert not marker.exists()
    torch.save({"dp_world_size": 3, "param_shapes": [{"w": torch.Size([2, 2])}], "ds_version": "0.19"},
               step / "mp_rank_00_model_states.pt")
    assert checkpoint_world_size(tmp_path) == 3


class _RunsCode:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_local_run_opens_ray_ports_on_loopback_only(tmp_path):
    """`synth-grpo train` without a cluster address starts Ray bound to 127.0.0.1: no port of its
    GCS, raylet or workers answers on another interface (the CLI sets this before Ray is imported)."""
    code = """
import sys
import pipeline.cli.main, pipeline.plan.inert, pipeline.config
assert "ray" not in sys.modules, "the CLI imports ray before it can bind an embedded Ray to loopback"
from pipeline.seams.ray_seams import bind_embedded_ray_to_loopback
bind_embedded_ray_to_loopback(None)
from pipeline.training.driver import init_ray
init_ray(None, log=None)
import psutil, ray
exposed = []
for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
    try:
        conns = p.net_connections(kind="inet")
    except psutil.Error:
        continue
    exposed += [f"{p.name()} {c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN
                and not (c.laddr.ip.startswith("127.") or c.laddr.ip in ("::1", "::ffff:127.0.0.1"))]
print("node", ray.util.get_node_ip_address(), "exposed", exposed)
ray.shutdown()
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "node 127.0.0.1 exposed []" in proc.stdout, proc.stdout[-2000:]


def test_monitoring_script_acts_only_on_its_own_numeric_pids_and_downloads_nothing(tmp_path):
    """scripts/start_monitoring.sh on a shared head: its state folder is private (0700), a planted pid
    file is neither executed nor used to kill, a pid of this user's it recorded is replaced, and without
    the system Prometheus it downloads nothing unless SYNTH_GRPO_DOWNLOAD_PROMETHEUS=1."""
    session = tmp_path / "ray" / "session_1"
    (session / "metrics" / "prometheus").mkdir(parents=True)
    (session / "metrics" / "prometheus" / "prometheus.yml").write_text("scrape_configs: []\n")
    (tmp_path / "ray" / "session_latest").symlink_to(session)
    tools = tmp_path / "bin"  # PATH without prometheus, grafana or ray: what a head without them has
    tools.mkdir()
    for tool in ("bash", "ps", "pgrep", "id", "head", "tr", "mkdir", "chmod", "readlink", "rm", "seq", "sleep", "grep",
                 "awk", "cat", "cp", "basename", "dirname", "setsid", "nohup", "timeout", "env"):
        (tools / tool).symlink_to(shutil.which(tool))
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    marker = tmp_path / "ran"
    (state / "prometheus.pid").write_text(f"1; touch {marker}\n")
    earlier = subprocess.Popen(["sleep", "300"])  # what an earlier run of the script started
    reaper = threading.Thread(target=earlier.wait, daemon=True)  # reaped at once: the script sees it gone
    reaper.start()
    (state / "grafana.pid").write_text(f"{earlier.pid}\n")
    env = {"PATH": str(tools), "HOME": str(tmp_path), "RAY_TMP": str(tmp_path / "ray"),
           "SYNTH_GRPO_MONITORING_DIR": str(state), "SYNTH_GRPO_MONITORING_WAIT_S": "1"}
    try:
        proc = subprocess.run(["bash", str(REPO / "scripts" / "start_monitoring.sh")], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        reaper.join(timeout=15)
        assert earlier.returncode is not None  # replaced: its recorded pid was this user's
    finally:
        earlier.kill()
    assert not marker.exists() and not list(state.glob("*.pid"))
    assert state.stat().st_mode & 0o777 == 0o700
    assert "none started" in proc.stdout and "SYNTH_GRPO_DOWNLOAD_PROMETHEUS=1" in proc.stdout
    assert not (state / "launch-prometheus.log").exists()  # nothing tried to download

    link = tmp_path / "linked-state"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "start_monitoring.sh")], capture_output=True, text=True,
                          env={**env, "SYNTH_GRPO_MONITORING_DIR": str(link)}, timeout=60)
    assert proc.returncode == 1 and "is a link" in proc.stdout
