"""Cluster operation: cluster.yaml through Ray's own `ray up` validation, the Grafana dashboard's metric
names, and (slow) a real token-authenticated local head that runs a `ray job submit` training job
while its Prometheus endpoint is scraped."""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from pipeline.config import REWARD_COMPONENTS
from pipeline.training.health import COUNTER_NAME
from pipeline.training.callbacks import prometheus_name, read_metrics

REPO = Path(__file__).resolve().parents[1]
CLUSTER_YAML = REPO / "cluster.yaml"
DASHBOARD = REPO / "docs" / "grafana" / "synth_grpo_dashboard.json"
RAY_NS = "ray_"  # Ray exports custom metrics under its "ray" namespace: Gauge("synth_grpo_x") -> ray_synth_grpo_x


def bootstrap(config: dict) -> dict:
    """What `ray up` does with the parsed YAML before touching any machine (prepare, JSON-schema validate)."""
    from ray.autoscaler._private.commands import _bootstrap_config

    return _bootstrap_config(copy.deepcopy(config), no_config_cache=True)


# ---------------------------------------------------------------- cluster.yaml


def test_cluster_yaml_passes_rays_own_validation():
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    out = bootstrap(config)
    assert out["provider"]["type"] == "local"
    (node_type,) = out["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(config["provider"]["worker_ips"])


BROKEN = {
    "misspelled top-level key": ("file_mounts:", "file_mount:"),
    "worker_ips not a list": ("worker_ips: [192.168.1.11]", "worker_ips: 192.168.1.11"),
    "misspelled ssh user": ("ssh_user:", "ssh_usr:"),
    "start commands not a list": ("worker_start_ray_commands:\n  - ray stop\n",
                                  "worker_start_ray_commands: ray stop\nworker_setup_commands:\n"),
    "no head_ip": ("  head_ip:", "  # head_ip:"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_cluster_yaml_is_rejected(name, tmp_path):
    import click
    import jsonschema

    old, new = BROKEN[name]
    text = CLUSTER_YAML.read_text()
    assert old in text, f"mutation {name!r} no longer applies to cluster.yaml"
    broken = tmp_path / "cluster.yaml"
    broken.write_text(text.replace(old, new, 1))
    with pytest.raises((jsonschema.ValidationError, click.ClickException)):
        bootstrap(yaml.safe_load(broken.read_text()))


def _start_commands(config: dict, kind: str) -> list[str]:
    return [c for c in config[f"{kind}_start_ray_commands"] if "ray start" in c]


def test_cluster_yaml_secure_settings():
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    (head,) = _start_commands(config, "head")
    (worker,) = _start_commands(config, "worker")
    for cmd in (head, worker):
        assert re.search(r"(^|[\s;])RAY_AUTH_MODE=token\s", cmd), cmd  # fails closed: no token, no start
        assert "--num-gpus" not in cmd, cmd  # Ray counts each node's GPUs; a CPU node must not advertise any
        assert "${node_ip:+--node-ip-address=$node_ip}" in cmd  # the address cluster.yaml gives (next test)
        assert "--metrics-export-port=" in cmd
    assert "--dashboard-host=127.0.0.1" in head
    assert re.search(r"(^|\s)RAY_enable_autoscaler_v2=0\s", head), head  # v2 never launches local-provider workers
    assert config["worker_start_ray_commands"][-1].startswith("~/synth-grpo/scripts/stop_with_head.sh $RAY_HEAD_IP")
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    setup = "\n".join(config["setup_commands"])
    assert "chmod 600 ~/.ray/auth_token" in setup and "export RAY_AUTH_MODE=token" in setup
    assert "./scripts/setup.sh" in setup
    assert "0.0.0.0" not in CLUSTER_YAML.read_text()


def _setup_command(config: dict, word: str) -> str:
    (cmd,) = [c for c in config["setup_commands"] if word in c]
    return cmd


def _fake_pci(root: Path, devices: dict[str, tuple[str, str]]) -> None:
    for name, (vendor, cls) in devices.items():
        (root / name).mkdir(parents=True)
        (root / name / "vendor").write_text(vendor + "\n")
        (root / name / "class").write_text(cls + "\n")


GPU_CASES = {  # PCI devices, nvidia-smi present, expected exit status, expected output
    "cpu machine": ({"0000:00:02.0": ("0x8086", "0x030000"), "0000:00:1f.0": ("0x10de", "0x060100")}, False, 0, "a CPU node"),
    "gpu, driver sees it": ({"0000:3b:00.0": ("0x10de", "0x030200")}, True, 0, "GPU 0: fake"),
    "gpu, no driver": ({"0000:3b:00.0": ("0x10de", "0x030200")}, False, 1, "nvidia-smi cannot see it"),
}


@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_check_runs_only_where_an_nvidia_gpu_is(case, tmp_path):
    """cluster.yaml's GPU check, run as is against a fake PCI bus (a tmpfs over /sys/bus/pci/devices in a private
    mount namespace): nvidia-smi is required only where an NVIDIA display/3D controller is."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to put a fake PCI bus in a private mount namespace")
    devices, has_smi, rc, out = GPU_CASES[case]
    cmd = _setup_command(yaml.safe_load(CLUSTER_YAML.read_text()), "nvidia-smi")
    _fake_pci(tmp_path / "pci", devices)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if has_smi:  # stands in for the driver's tool, which this machine does not have
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: fake (UUID: GPU-0)'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    script = f"mount -t tmpfs tmpfs /sys/bus/pci/devices && cp -r {tmp_path}/pci/. /sys/bus/pci/devices/ && {cmd}"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(tmp_path)}
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                       env=env, capture_output=True, text=True, timeout=30)
    assert (r.returncode != 0) == bool(rc) and out in r.stdout + r.stderr, (r.returncode, r.stdout, r.stderr)


def test_file_limit_raised_only_where_allowed():
    """The start commands' ulimit prefix: 65536 where the hard limit allows, else the hard limit and a warning."""
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    for kind in ("head", "worker"):
        (cmd,) = _start_commands(config, kind)
        prefix = cmd[: cmd.index("RAY_AUTH_MODE=token")]
        assert prefix.strip().startswith("{ ulimit -n 65536"), prefix
        low = subprocess.run(["bash", "-c", f"ulimit -Sn 1024; ulimit -Hn 4096; {prefix} ulimit -Sn"],
                             capture_output=True, text=True, timeout=10)
        assert low.returncode == 0 and low.stdout.splitlines()[-1] == "4096", low
        assert "WARNING: open-file hard limit 4096 < 65536" in low.stdout
        hard = subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip()
        if hard == "unlimited" or int(hard) >= 65536:
            ok = subprocess.run(["bash", "-c", f"{prefix} ulimit -Sn"], capture_output=True, text=True, timeout=10)
            assert ok.stdout.strip() == "65536" and "WARNING" not in ok.stdout, ok


@pytest.mark.parametrize("env, flag", [
    ({"RAY_CLOUD_INSTANCE_ID": "10.0.0.5", "SSH_CONNECTION": "10.0.0.9 51000 10.0.0.7 22"}, "--node-ip-address=10.0.0.5"),
    ({"SSH_CONNECTION": "10.0.0.9 51000 10.0.0.7 22"}, "--node-ip-address=10.0.0.7"),  # autoscaler v1's workers
    ({}, ""),  # by hand, not over SSH: Ray picks
], ids=["head (ray up sets the id)", "worker (the address SSH reached)", "neither"])
def test_start_commands_register_the_node_under_its_configured_address(env, flag):
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    for kind in ("head", "worker"):
        (cmd,) = _start_commands(config, kind)
        (assign,) = re.findall(r'node_ip="[^;]*";', cmd)
        out = subprocess.run(["bash", "-c", f"{assign} echo ${{node_ip:+--node-ip-address=$node_ip}}"],
                             env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=10)
        assert out.stdout.strip() == flag, (kind, out)


def test_cluster_yaml_mounts_what_setup_needs():
    """`ray up` hashes every file under each mounted folder: mount the package, not the checkout with .venv/.git."""
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    mounts = {k: v for k, v in config["file_mounts"].items() if k.startswith("~/synth-grpo/")}
    assert "." not in mounts.values() and all((REPO / v).exists() for v in mounts.values())
    pyproject = (REPO / "pyproject.toml").read_text()
    packages = re.search(r"include = \[(.*?)\]", pyproject).group(1)
    tops = {p.strip().strip('"').split(".")[0] for p in packages.split(",")}
    assert tops | {"pyproject.toml", "README.md", "scripts"} <= set(mounts.values()), sorted(mounts.values())
    assert mounts["~/synth-grpo/docs"] == "docs"  # start_monitoring.sh copies docs/grafana/ to Grafana


# ---------------------------------------------------------------- Grafana dashboard

# Every key the pipeline logs that the dashboard may chart (TRL's names, the pool's, the length cap, eval).
EXPORTED_KEYS = (
    ["reward", "reward_std", "frac_reward_zero_std", "entropy", "entropy_coef", "loss", "grad_norm", "learning_rate",
     "completions/clipped_ratio", "completions/mean_length", "completions/max_length", "completions/min_length",
     "completions/mean_terminated_length", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
     "pool/judge_seconds", "pool/judge_per_second", "generation/max_completion_length",
     "eval/score", "eval/eos_rate", "eval/mean_length"]
    + [f"rewards/{c}/{s}" for c in REWARD_COMPONENTS for s in ("mean", "std")]
    + [f"eval/{c}" for c in REWARD_COMPONENTS]
)
GAUGES = {RAY_NS + prometheus_name(k) for k in EXPORTED_KEYS}
HEALTH_COUNTER = RAY_NS + COUNTER_NAME + "_total"  # a Ray Counter is exported with Prometheus' _total suffix
REQUIRED = {RAY_NS + prometheus_name(k) for k in
            ["reward", "entropy", "completions/clipped_ratio", "completions/mean_length", "completions/max_length",
             "generation/max_completion_length", "pool/judge_seconds", "pool/judge_per_second"]
            + [f"rewards/{c}/mean" for c in REWARD_COMPONENTS]} | {HEALTH_COUNTER}
PROMQL_WORDS = {"max", "min", "sum", "avg", "by", "without", "rate", "increase", "irate", "label_values", "on", "ignoring"}


def dashboard_metric_names(dash: dict) -> dict[str, set[str]]:
    """Metric names used by each panel's PromQL (and by the template variables, under '$vars')."""
    def names(expr: str) -> set[str]:
        expr = re.sub(r'"[^"]*"', '""', expr)  # label values
        expr = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers
        expr = re.sub(r"\[[^\]]*\]", "[]", expr)  # ranges
        expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)  # grouping labels
        expr = re.sub(r"(label_values\([^,()]*(?:\{\})?),\s*\w+\)", r"\1)", expr)  # label_values(metric, label)
        return {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr) if w not in PROMQL_WORDS}

    out = {p["title"]: set().union(*(names(t["expr"]) for t in p["targets"])) for p in dash["panels"]}
    out["$vars"] = set().union(*(names(v["query"]["query"]) for v in dash["templating"]["list"] if v["type"] == "query"))
    return out


def test_grafana_dashboard_uses_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    per_panel = dashboard_metric_names(dash)
    used = set().union(*per_panel.values())
    unknown = used - GAUGES - {HEALTH_COUNTER}
    assert not unknown, f"PromQL refers to metrics the pipeline does not export: {sorted(unknown)}"
    assert REQUIRED <= used, f"not charted: {sorted(REQUIRED - used)}"
    for title, metrics in per_panel.items():
        assert metrics, f"panel {title!r} has no metric"


def test_grafana_dashboard_format_matches_rays_dashboards():
    """Loadable next to Ray's own dashboards: a ${datasource} variable of type prometheus, unique ids, a grid."""
    dash = json.loads(DASHBOARD.read_text())
    ray_base = Path(__import__("ray").__file__).parent / "dashboard/modules/metrics/dashboards/default_grafana_dashboard_base.json"
    ray_ds = next(v for v in json.loads(ray_base.read_text())["templating"]["list"] if v["name"] == "datasource")
    ours = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
    assert (ours["type"], ours["query"]) == (ray_ds["type"], ray_ds["query"]) == ("datasource", "prometheus")
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"] == "${datasource}" and {"h", "w", "x", "y"} <= set(p["gridPos"])
        assert all(t["datasource"] == "${datasource}" and t["expr"] and t["refId"] for t in p["targets"])
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


# ---------------------------------------------------------------- a real head, a real job (slow)


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http(url: str, token: str | None = None, timeout: float = 5.0) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


class LocalHead:
    """`ray start --head --block` with token auth in its own session and temp dir; stopped by its own ids.

    `ray stop` would stop every Ray on the machine (other tests', other users'), so this head is stopped
    by signalling its `ray start` process and then killing whatever is left in its session."""

    def __init__(self, root: Path, token_path: Path, extra_env: dict[str, str]):
        self.root = root
        (self.port, self.dashboard_port, self.metrics_port, self.client_port, self.agent_port, self.agent_grpc_port,
         self.runtime_env_port, self.node_manager_port, self.object_manager_port) = free_ports(9)
        self.env = clean_env()
        self.env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(token_path),
            # A single-node cluster on the loopback (Ray otherwise advertises the host's interface address).
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
            RAY_metrics_report_interval_ms="1000",  # custom metrics reach /metrics within ~1 s (default 10 s)
            RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # SIGTERM tears down at once (default: drain 30 s)
            RAY_USAGE_STATS_ENABLED="0",
            **extra_env,
        )
        self.proc: subprocess.Popen | None = None
        self.log = root / "head.log"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self, timeout: float = 120.0) -> None:
        cmd = [
            ray_cli(), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={self.port}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}", "--include-dashboard=true",
            f"--metrics-export-port={self.metrics_port}", f"--temp-dir={self.root / 'ray'}",
            f"--ray-client-server-port={self.client_port}", f"--dashboard-agent-listen-port={self.agent_port}",
            f"--dashboard-agent-grpc-port={self.agent_grpc_port}", f"--runtime-env-agent-port={self.runtime_env_port}",
            f"--node-manager-port={self.node_manager_port}", f"--object-manager-port={self.object_manager_port}",
            "--num-cpus=4", "--num-gpus=0", "--disable-usage-stats",
        ]
        self.proc = subprocess.Popen(cmd, env=self.env, cwd=self.root, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            status, _ = http(f"{self.dashboard}/api/jobs/", timeout=2)
            if status == 401:  # up, and asking for a token
                return
            time.sleep(1)
        raise TimeoutError(f"the head's dashboard did not answer in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")

    def session_pids(self) -> list[int]:
        if self.proc is None:
            return []
        pids = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if os.getsid(int(d.name)) == self.proc.pid:
                        pids.append(int(d.name))
                except OSError:
                    pass
        return pids

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + timeout
        while time.time() < deadline and self.session_pids():
            time.sleep(0.5)
        for pid in self.session_pids():  # stragglers of this head only: same session as its `ray start`
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "PYTEST_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def ray_cli_run(args: list[str], env: dict[str, str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([ray_cli(), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def scrape(port: int) -> dict[str, list[str]]:
    """Metric name -> its sample lines, from a Prometheus text-format endpoint."""
    status, body = http(f"http://127.0.0.1:{port}/metrics")
    out: dict[str, list[str]] = {}
    if status == 200:
        for line in body.splitlines():
            if line and not line.startswith("#"):
                out.setdefault(re.split(r"[{\s]", line, 1)[0], []).append(line)
    return out


FAKE_HF_TOKEN = "hf_SyNtHgRpOcLuStErNoTlEaKeD0123456789"


@pytest.mark.slow
def test_job_submission_with_token_auth_and_dashboard_metrics(tiny_policy, tmp_path):
    root = Path(tempfile.mkdtemp(prefix="sg-head-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    token = secrets.token_hex(32)
    token_path = root / "auth_token"
    token_path.write_text(token)
    token_path.chmod(0o600)
    wrong_path = root / "wrong_token"
    wrong_path.write_text(secrets.token_hex(32))
    out_root = (tmp_path / "runs").resolve()  # absolute: the job runs in Ray's copy of the working dir
    run_name = "cluster-job"
    # The node's environment holds an HF token (as a real node's would); it must not end up anywhere.
    head = LocalHead(root, token_path, {"HF_TOKEN": FAKE_HF_TOKEN})
    client = clean_env()  # the submitting machine: no RAY_AUTH_MODE
    authed = {**client, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    sub_id = f"synth-grpo-{secrets.token_hex(4)}"
    try:
        head.start()
        addr = ["--address", head.dashboard]

        # Refused: no token (whatever ~/.ray/auth_token holds, a client without RAY_AUTH_MODE=token sends none),
        # then a wrong one. Nothing is uploaded or run.
        r = ray_cli_run(["job", "submit", *addr, "--", "echo", "pwned"], client)
        assert r.returncode != 0 and "Unauthorized: Missing authentication token" in r.stdout + r.stderr, r.stderr[-2000:]
        r = ray_cli_run(["job", "submit", *addr, "--", "echo", "pwned"],
                        {**client, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong_path)})
        assert r.returncode != 0 and "Invalid authentication token" in r.stdout + r.stderr, r.stderr[-2000:]
        assert http(f"{head.dashboard}/api/jobs/")[0] == 401
        assert http(f"{head.dashboard}/api/jobs/", token)[0] == 200
        assert json.loads(http(f"{head.dashboard}/api/jobs/", token)[1]) == []  # no job was created

        runtime_env = {
            "excludes": [".venv", ".cache", ".git", "runs", "*.egg-info"],  # besides .gitignore, which Ray honours
            "env_vars": {"SYNTH_GRPO_CACHE": os.environ["SYNTH_GRPO_CACHE"], "HF_HUB_OFFLINE": "1",
                         "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
        }
        entrypoint = [
            "python", "-m", "pipeline", "train",
            "--set", "optimization.max_steps=6", "--set", "eval.num_prompts=4", "--set", "eval.every_steps=3",
            "--set", "output.save_steps=3", "--set", "logging.samples_every=2", "--set", "logging.progress_bar=false",
            "--set", f"output.root={out_root}", "--set", f"output.run_name={run_name}",
        ]
        r = ray_cli_run(["job", "submit", *addr, "--no-wait", "--submission-id", sub_id, "--working-dir", ".",
                         "--runtime-env-json", json.dumps(runtime_env), "--", *entrypoint], authed)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

        # While it runs: the training metrics on the node's Prometheus endpoint.
        seen: dict[str, list[str]] = {}
        status, deadline = "PENDING", time.time() + 240
        while time.time() < deadline:
            for name, lines in scrape(head.metrics_port).items():
                if name.startswith(RAY_NS + "synth_grpo"):
                    seen[name] = lines
            code, body = http(f"{head.dashboard}/api/jobs/{sub_id}", token)
            assert code == 200, body
            status = json.loads(body)["status"]
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(0.5)
        logs = ray_cli_run(["job", "logs", *addr, sub_id], authed)
        assert status == "SUCCEEDED", f"job {status}:\n{logs.stdout[-4000:]}"
        assert logs.returncode == 0 and "=== synth-grpo summary ===" in logs.stdout

        reward = RAY_NS + prometheus_name("reward")
        assert reward in seen, f"{reward} never appeared on :{head.metrics_port}/metrics; saw {sorted(seen)}"
        assert any(f'run="{run_name}"' in line for line in seen[reward])
        value = float(seen[reward][-1].rsplit(" ", 1)[1])
        assert -2.0 < value < 3.0
        # Every gauge the Grafana dashboard charts was really exported by this run.
        charted = set().union(*dashboard_metric_names(json.loads(DASHBOARD.read_text())).values()) - {HEALTH_COUNTER}
        assert charted <= set(seen), f"charted but never exported: {sorted(charted - set(seen))}"

        # The run directory, where the config put it.
        run_dir = out_root / run_name
        assert f"[run] starting {run_dir}" in logs.stdout
        rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r]
        assert [r["step"] for r in rows] == list(range(1, 7))
        assert (run_dir / "config.yaml").is_file() and (run_dir / "summary.txt").is_file()
        adapter = run_dir / "adapter"
        # Weights as safetensors; the only pickle is transformers' training_args.bin, which nothing here loads.
        assert (adapter / "adapter_model.safetensors").is_file()
        assert [p.name for p in adapter.glob("*.bin")] in ([], ["training_args.bin"])

        # The working dir Ray unpacked for the job: the code, not the virtualenv or caches.
        pkgs = [p for p in (root / "ray").glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*") if p.is_dir()]
        assert pkgs and all((p / "pipeline" / "training" / "driver.py").is_file() for p in pkgs)
        for p in pkgs:
            assert not any((p / d).exists() for d in (".venv", ".cache", ".git", "runs")), sorted(x.name for x in p.iterdir())

        # The node's HF token is in no file the run wrote and in no log line.
        for f in run_dir.rglob("*"):
            if f.is_file() and f.stat().st_size < 5_000_000:
                assert FAKE_HF_TOKEN.encode() not in f.read_bytes(), f
        assert FAKE_HF_TOKEN not in logs.stdout
    finally:
        head.stop()
        leftover = head.session_pids()
        shutil.rmtree(root, ignore_errors=True)
    assert leftover == [], f"processes of the test's head still alive: {leftover}"
