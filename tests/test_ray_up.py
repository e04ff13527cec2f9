"""`ray up cluster.yaml` for real: the shipped file with only its FILL IN values replaced, a head reached by
SSH, a `ray job submit` training job, Prometheus scraping its metrics, `ray down`, and the node cleaned as
docs/cluster.md says, back to what it was.

The "machine" is this one, inside its own network, PID and mount namespaces (`unshare`): a loopback with
127.0.0.1 and two more addresses, 10.213.0.1 (the default route's source: what Ray would pick by itself)
and 10.213.0.2 (`head_ip`, under which the node must register), a private /tmp and /run, and sshd for a
throwaway user `sgnode` (uid 0, home in a temp dir, added to a private copy of /etc/passwd). So
cluster.yaml's fixed ports and `ray stop` reach nothing of other Ray users on this machine, and killing
the namespace ends everything the test started. Needs root (CI runs as root); installs openssh-server,
prometheus and rsync from the system packages when missing.

The node is set up like a machine where synth-grpo is already installed and current: its
~/synth-grpo/.venv is this checkout's .venv (a link), so `ray up`'s scripts/setup.sh takes its
"up to date" path instead of a multi-minute install.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from pipeline.training.callbacks import prometheus_name, read_metrics
from tests.test_cluster import CLUSTER_YAML, RAY_NS, REPO, clean_env, ray_cli

FILL_IN_KEYS = {"head_ip", "worker_ips", "ssh_user", "ssh_private_key"}
LAN_IP = "10.213.0.1"  # what Ray's own address detection finds in the namespace (the default route's source)
HEAD_IP = "10.213.0.2"  # head_ip: the machine's other address, under which the node must register
NODE_USER = "sgnode"
PACKAGES = {"sshd": ("/usr/sbin/sshd", "openssh-server"), "prometheus": ("/usr/bin/prometheus", "prometheus"),
            "rsync": ("/usr/bin/rsync", "rsync")}


def fill_in(text: str, values: dict[str, str]) -> str:
    """cluster.yaml with the value of each `key: value  # FILL IN...` line replaced; every other byte kept."""
    seen, out = set(), []
    for line in text.splitlines(keepends=True):
        m = re.match(r"^(\s*)(\w+):\s*(.*?)(\s+# FILL IN.*\n?)$", line)
        if m:
            seen.add(m.group(2))
            line = f"{m.group(1)}{m.group(2)}: {values[m.group(2)]}{m.group(4)}"
        out.append(line)
    assert seen == FILL_IN_KEYS, f"cluster.yaml's FILL IN keys changed: {sorted(seen)}"
    return "".join(out)


def test_fill_in_changes_only_the_fill_in_values():
    text = CLUSTER_YAML.read_text()
    filled = fill_in(text, {"head_ip": HEAD_IP, "worker_ips": "[]", "ssh_user": "me", "ssh_private_key": "/k"})
    changed = [(a, b) for a, b in zip(text.splitlines(), filled.splitlines()) if a != b]
    assert len(filled.splitlines()) == len(text.splitlines()) and len(changed) == len(FILL_IN_KEYS)
    assert all("# FILL IN" in a and "# FILL IN" in b for a, b in changed)


def install_missing_packages() -> None:
    missing = [pkg for path, pkg in PACKAGES.values() if not Path(path).exists()]
    if not missing:
        return
    # policy-rc.d 101: the packages' services are not started (CI images usually ship this file already).
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, capture_output=True, timeout=300)
        r = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    finally:
        if ours:
            policy.unlink()


def tree(home: Path) -> dict[str, str]:
    """Every path under home -> its content hash (files), link target (links) or 'dir'."""
    out = {}
    for p in sorted(home.rglob("*")):
        rel = str(p.relative_to(home))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def docs_block(marker: str) -> str:
    text = (REPO / "docs" / "cluster.md").read_text()
    m = re.search(re.escape(marker) + r"\s*```bash\n(.*?)```", text, re.S)
    assert m, f"docs/cluster.md has no ```bash block after {marker}"
    return m.group(1)


class Node:
    """This machine as a cluster node, in its own namespaces (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = root
        self.home = root / "home"  # the node user's home
        self.client = root / "client"  # HOME of the machine `ray up` runs from
        self.sshd_dir = root / "sshd"
        self.key = self.client / ".ssh" / "id_ed25519"
        self.proc: subprocess.Popen | None = None
        self.init_pid = 0

    def prepare(self) -> None:
        for d in (self.home / ".ssh", self.client / ".ssh", self.client / ".ray", self.sshd_dir):
            d.mkdir(parents=True, mode=0o700)
        for name in (".bashrc", ".profile"):
            src = Path("/etc/skel") / name
            (self.home / name).write_text(src.read_text() if src.is_file() else "")
        # The node's own environment, not cluster.yaml: custom metrics reach /metrics each second (default 10 s),
        # so a short job is scraped by Prometheus (every 10 s) more than once.
        with (self.home / ".bashrc").open("a") as f:
            f.write("export RAY_metrics_report_interval_ms=1000\n")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sg-rayup-test", "-f", str(self.key)], check=True)
        (self.home / ".ssh" / "authorized_keys").write_text(self.key.with_suffix(".pub").read_text())
        host_key = self.sshd_dir / "host_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
        (self.sshd_dir / "sshd_config").write_text(
            f"ListenAddress 127.0.0.1\nListenAddress {HEAD_IP}\nPort 22\nHostKey {host_key}\nPidFile {self.sshd_dir}/sshd.pid\n"
            "AuthorizedKeysFile .ssh/authorized_keys\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
            f"AllowUsers {NODE_USER}\nMaxSessions 64\nMaxStartups 64\n"
        )
        passwd = Path("/etc/passwd").read_text()
        (self.root / "passwd").write_text(passwd + f"{NODE_USER}:x:0:0:synth-grpo ray up test:{self.home}:/bin/bash\n")
        token = self.client / ".ray" / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)

    def start(self) -> None:
        init = (
            "set -e; ip link set lo up; "
            f"ip addr add {LAN_IP}/32 dev lo; ip addr add {HEAD_IP}/32 dev lo; ip route add default dev lo src {LAN_IP}; "
            "mount -t tmpfs -o mode=1777 tmpfs /tmp; mount -t tmpfs -o mode=755 tmpfs /run; mkdir -m 755 /run/sshd; "
            f"mount --bind {self.root}/passwd /etc/passwd; "
            f"/usr/sbin/sshd -D -f {self.sshd_dir}/sshd_config -E {self.sshd_dir}/sshd.log & wait $!"
        )
        self.proc = subprocess.Popen(
            ["unshare", "--net", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc", "--propagation", "private",
             "bash", "-c", init], start_new_session=True, stdout=subprocess.DEVNULL, stderr=(self.root / "init.log").open("w"))
        deadline = time.time() + 30
        while time.time() < deadline and not self.init_pid:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            if children.exists() and children.read_text().split():
                self.init_pid = int(children.read_text().split()[0])
            time.sleep(0.1)
        assert self.init_pid, (self.root / "init.log").read_text()
        while time.time() < deadline:
            r = self.run(["ssh", *self.ssh_opts(), f"{NODE_USER}@{HEAD_IP}", "true"], timeout=20)
            if r.returncode == 0:
                return
            time.sleep(0.5)
        raise TimeoutError(f"sshd did not answer: {r.stderr}\n{(self.root / 'init.log').read_text()}")

    def ssh_opts(self) -> list[str]:
        return ["-i", str(self.key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]

    def env(self, **extra: str) -> dict[str, str]:
        return {**clean_env(), "HOME": str(self.client), **extra}

    def run(self, cmd: list[str], timeout: float = 120, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
        """A command on this machine inside the node's namespaces (as the machine `ray up` runs from)."""
        # --wd: entering a mount namespace resets the working directory to its root.
        return subprocess.run(["nsenter", "--target", str(self.init_pid), "--net", "--mount", "--pid", f"--wd={REPO}", "--", *cmd],
                              env=env or self.env(), cwd=REPO, capture_output=True, text=True, timeout=timeout, **kw)

    def http(self, url: str, token: str | None = None) -> tuple[int, str]:
        auth = ["-H", f"Authorization: Bearer {token}"] if token else []
        r = self.run(["curl", "-s", "-m", "10", "-w", "\n%{http_code}", *auth, url], timeout=30)
        body, _, code = r.stdout.rpartition("\n")
        return int(code or 0), body

    def processes(self) -> list[str]:
        """Command lines of the processes in the node's PID namespace, but its init and sshd."""
        ns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        out = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and int(d.name) != self.init_pid and os.readlink(d / "ns" / "pid") == ns:
                    cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                    if cmd and "sshd" not in cmd.split()[0] and (d / "stat").read_text().split()[2] != "Z":
                        out.append(cmd)
            except OSError:
                pass
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # --kill-child: the namespace's init dies, and with it everything in the namespace
            self.proc.wait(timeout=30)


@pytest.mark.slow
def test_ray_up_job_prometheus_ray_down(tiny_policy, tmp_path):
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        pytest.skip("needs root and util-linux's unshare/nsenter (namespaces for an isolated sshd node)")
    probe = subprocess.run(["unshare", "--net", "--pid", "--mount", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:  # a container without CAP_SYS_ADMIN
        pytest.skip(f"this machine does not allow new namespaces: {probe.stderr.strip()[:200]}")
    r = subprocess.run([str(REPO / "scripts" / "setup.sh")], env={**os.environ, "CHECK": "1"},
                       capture_output=True, text=True)
    assert r.returncode == 0, f"{r.stdout}: run ./scripts/setup.sh test first (the node uses this .venv)"
    install_missing_packages()

    machine_before = {p: p.read_bytes() if p.is_file() else None
                      for p in (Path.home() / ".bashrc", Path.home() / ".ray" / "auth_token")}
    root = Path(tempfile.mkdtemp(prefix="sg-rayup-", dir="/var/tmp"))  # not /tmp: the node has a private /tmp
    node = Node(root)
    try:
        node.prepare()
        home_before = tree(node.home)
        # The node has synth-grpo installed already (this checkout's .venv): setup.sh finds it current.
        (node.home / "synth-grpo").mkdir()
        (node.home / "synth-grpo" / ".venv").symlink_to(REPO / ".venv")
        node.start()

        config = root / "cluster.yaml"
        config.write_text(fill_in(CLUSTER_YAML.read_text(), {
            "head_ip": HEAD_IP, "worker_ips": "[]", "ssh_user": NODE_USER, "ssh_private_key": str(node.key)}))

        t0 = time.time()
        up = node.run([ray_cli(), "up", "-y", str(config)], timeout=600)
        up_log = up.stdout + up.stderr
        for _ in range(2):
            if up.returncode == 0 or "The current node timed out during startup" not in up.stdout + up.stderr:
                break
            # `ray start` gives the raylet a hard-coded 30 s to register; a loaded machine can miss it. `ray up`
            # is made to be run again (setup skips what is done, the start commands restart Ray).
            up = node.run([ray_cli(), "up", "-y", str(config)], timeout=600)
            up_log += "\n--- ray up, again ---\n" + up.stdout + up.stderr
        up_s = time.time() - t0
        (tmp_path / "ray_up.log").write_text(up_log)  # kept by pytest for a look after a failure
        assert up.returncode == 0, up_log[-6000:]
        assert "nothing to install" in up_log, up_log[-3000:]  # setup.sh's fast path
        assert "no NVIDIA GPU on" in up_log  # the GPU check ran and passed on a CPU machine
        hard = subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip()
        low_limit = hard != "unlimited" and int(hard) < 65536
        assert ("WARNING: open-file hard limit" in up_log) == low_limit, hard
        assert "Prometheus" in up_log and "127.0.0.1:9090" in up_log, up_log[-3000:]
        print(f"ray up: {up_s:.0f} s")

        token = (node.client / ".ray" / "auth_token").read_text()
        assert (node.home / ".ray" / "auth_token").read_text() == token
        code, body = node.http("http://127.0.0.1:8265/api/v0/nodes?detail=1", token)
        assert code == 200, body
        nodes = json.loads(body)["data"]["result"]["result"]
        assert [(n["node_ip"], n["state"]) for n in nodes] == [(HEAD_IP, "ALIVE")], nodes  # not LAN_IP
        resources = nodes[0]["resources_total"]
        assert resources.get("GPU", 0) == 0 and resources["CPU"] >= 1, resources  # detected, not hard-coded

        # A tiny training job, with its run name and config as metadata.
        run_name = "ray-up-job"
        out_root = root / "runs"
        sub_id = f"synth-grpo-{secrets.token_hex(4)}"
        runtime_env = {
            "excludes": [".venv", ".cache", ".git", "runs", "*.egg-info"],
            "env_vars": {"SYNTH_GRPO_CACHE": os.environ["SYNTH_GRPO_CACHE"], "HF_HUB_OFFLINE": "1",
                         "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
        }
        metadata = {"run_name": run_name, "config": "configs/tiny.yaml"}
        submit = node.run([
            ray_cli(), "job", "submit", "--address", "http://127.0.0.1:8265", "--no-wait", "--submission-id", sub_id,
            "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--metadata-json", json.dumps(metadata),
            "--", "python", "-m", "pipeline", "train", "--config", "configs/tiny.yaml",
            # 40 steps: the run's gauges live as long as its training worker, which must outlast a 10 s scrape interval.
            "--set", "optimization.max_steps=40", "--set", "eval.num_prompts=2", "--set", "eval.every_steps=40",
            "--set", "output.save_steps=40", "--set", "logging.progress_bar=false",
            "--set", f"output.root={out_root}", "--set", f"output.run_name={run_name}",
        ], env=node.env(RAY_AUTH_MODE="token"))
        assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]

        actors: set[str] = set()
        status, deadline = "PENDING", time.time() + 400
        while time.time() < deadline:
            code, body = node.http("http://127.0.0.1:8265/api/v0/actors?limit=1000&detail=1", token)
            if code == 200:
                actors |= {a.get("name") or "" for a in json.loads(body)["data"]["result"]["result"]}
            code, body = node.http(f"http://127.0.0.1:8265/api/jobs/{sub_id}", token)
            assert code == 200, body
            job = json.loads(body)
            status = job["status"]
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(2)
        code, logs = node.http(f"http://127.0.0.1:8265/api/jobs/{sub_id}/logs", token)
        logs = json.loads(logs)["logs"] if code == 200 else logs
        (tmp_path / "job.log").write_text(logs)
        assert status == "SUCCEEDED", f"job {status}:\n{logs[-5000:]}"
        assert metadata.items() <= job["metadata"].items(), job["metadata"]

        # The run directory, where the config put it.
        run_dir = out_root / run_name
        rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r]
        assert [r["step"] for r in rows] == list(range(1, 41))
        assert (run_dir / "config.yaml").is_file() and (run_dir / "summary.txt").is_file()
        # The reward pool's actors carry their role and the run's name on the dashboard.
        assert any(a.startswith("judge-0") and run_name in a for a in actors), sorted(actors)
        assert any(a.startswith("scorer-0") and run_name in a for a in actors), sorted(actors)
        # Quiet job log: no bytecode listing (dill's, leaked by Ray Train's print patch), no line twice, no
        # error-level line from Ray Train's preemption watcher.
        assert "PreemptionWatcher" not in logs and not re.search(r"\bLOAD_(GLOBAL|FAST|ATTR)\b", logs), logs[-3000:]
        summary_lines = [line for line in logs.splitlines() if "data[bundled]:" in line]  # the worker's data line
        assert len(summary_lines) == 1, summary_lines

        # Prometheus, started by the head's start commands, scraped the run's reward from the node.
        reward = RAY_NS + prometheus_name("reward")
        q = f'max_over_time({reward}{{run="{run_name}"}}[30m])'
        code, body = node.http("http://127.0.0.1:9090/api/v1/query?query=" + urllib_quote(q))
        assert code == 200, body
        result = json.loads(body)["data"]["result"]
        assert result, f"Prometheus has no {reward} for run {run_name}: {body}"
        assert -2.0 < float(result[0]["value"][1]) < 3.0
        code, body = node.http("http://127.0.0.1:9090/api/v1/targets")
        targets = json.loads(body)["data"]["activeTargets"]
        assert targets and all(t["labels"]["instance"].startswith(f"{HEAD_IP}:") for t in targets), targets

        down = node.run([ray_cli(), "down", "-y", str(config)], timeout=300)
        assert down.returncode == 0, (down.stdout + down.stderr)[-4000:]
        deadline = time.time() + 30  # the monitoring watcher notices Ray's exit within 5 s
        while time.time() < deadline and node.processes():
            time.sleep(1)
        assert node.processes() == [], "left running after `ray down`"

        # What ray up/down left on the node, as docs/cluster.md lists it; then its clean-up, over SSH as a user would.
        assert "# synth-grpo cluster.yaml" in (node.home / ".bashrc").read_text()
        for left in ("synth-grpo", "ray_bootstrap_key.pem", "ray_bootstrap_config.yaml", ".ray/auth_token"):
            assert (node.home / left).exists(), left
        clean = node.run(["ssh", *node.ssh_opts(), f"{NODE_USER}@{HEAD_IP}", "bash -s"],
                         input=docs_block("<!-- node-cleanup -->"))
        assert clean.returncode == 0, clean.stderr
        after = {k: v for k, v in tree(node.home).items() if k != ".cache" and not k.startswith(".cache/")}
        changed = sorted(set(after.items()) ^ set(home_before.items()))
        assert after == home_before, f"the node's home differs from before `ray up` (~/.cache aside): {changed}"
        assert (REPO / ".venv" / "bin" / "python").exists()  # the clean-up removed the link, not the checkout's .venv
    finally:
        node.stop()
        shutil.rmtree(root, ignore_errors=True)
    for p, content in machine_before.items():
        assert (p.read_bytes() if p.is_file() else None) == content, f"{p} changed"


def urllib_quote(s: str) -> str:
    from urllib.parse import quote

    return quote(s, safe="")
