"""`ray up cluster.yaml` for real, on two machines: the shipped file with only its FILL IN values replaced
(`worker_ips: [the worker]`), a head and a worker reached by SSH, a `ray job submit` training job across both,
the worker's Ray stopped and started again mid-run, Prometheus scraping both, `ray down`, and both machines
cleaned as docs/cluster.md says, back to what they were.

Each "machine" is this one inside its own network, PID, mount and UTS namespaces (`unshare`): its own hostname,
address (10.213.0.2 the head, 10.213.0.3 the worker, on a veth pair between the two) and a second address as the
source of its default route (what Ray would pick by itself: the nodes must register under the first), a private
/tmp and /run, of the host's temp folder only its own folder and the shared one (the disk both mount, NFS in real
life, used as `output.storage`), and sshd for a throwaway user `sgnode` (uid 0, home in its folder, added to a
private copy of /etc/passwd). So the worker sees nothing of the head but what `ray up` copies and the shared
folder; cluster.yaml's fixed ports and `ray stop` reach nothing of other Ray users on this machine; and killing
the namespaces ends everything the test started. The user who runs `ray up` and submits the jobs works on the
head (the checkout bound into each machine, wherever it is: under /tmp too). Needs root (CI runs as root);
installs openssh-server, prometheus and rsync from the system packages when missing.

The machines are set up like ones where synth-grpo is already installed and current: each ~/synth-grpo/.venv is
this checkout's .venv (a link), so `ray up`'s scripts/setup.sh takes its "up to date" path instead of a
multi-minute install.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml

from pipeline.training.callbacks import prometheus_name, read_metrics
from tests.test_cluster import CLUSTER_YAML, RAY_NS, REPO, clean_env, ray_cli

FILL_IN_KEYS = {"head_ip", "worker_ips", "ssh_user", "ssh_private_key"}
HEAD_IP, WORKER_IP = "10.213.0.2", "10.213.0.3"  # head_ip and worker_ips: the addresses the nodes must register under
# Each machine's other address, the source of its default route (and of the worker's route to the head): what
# Ray's own address detection would pick, so a node found under HEAD_IP / WORKER_IP got it from cluster.yaml.
DECOY = {HEAD_IP: "10.213.1.2", WORKER_IP: "10.213.1.3"}
NODE_USER = "sgnode"
PACKAGES = {"sshd": ("/usr/sbin/sshd", "openssh-server"), "prometheus": ("/usr/bin/prometheus", "prometheus"),
            "rsync": ("/usr/bin/rsync", "rsync")}
JOB_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           # after the node loss, a restart that still asks for the lost node's worker gives up after 10 s, not 60: a
           # start that times out is retried without limit (Ray Train's controller_failure_limit: -1), not a failure
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}

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


class Machine:
    """One machine of the cluster: its own network, PID, mount and UTS namespaces (see the module docstring)."""

    def __init__(self, root: Path, name: str, ip: str):
        self.root, self.name, self.ip = root, name, ip
        self.dir = root / name  # all this machine keeps of the host's /var/tmp folder: its home, sshd, passwd
        self.home = self.dir / "home"  # the node user's home
        self.client = self.dir / "client"  # on the head: HOME of the user who runs `ray up` and submits jobs
        self.key = self.client / ".ssh" / "id_ed25519"
        self.proc: subprocess.Popen | None = None
        self.init_pid = 0

    def prepare(self, public_key: str) -> dict[str, str]:
        """The machine's home, sshd and passwd; its home's tree as it is before `ray up`."""
        for d in (self.home / ".ssh", self.dir / "sshd"):
            d.mkdir(parents=True, mode=0o700)
        for name in (".bashrc", ".profile"):
            src = Path("/etc/skel") / name
            (self.home / name).write_text(src.read_text() if src.is_file() else "")
        # The machine's own environment, not cluster.yaml: custom metrics reach /metrics each second (default 10 s),
        # so a short job is scraped by Prometheus (every 10 s) more than once; and the head's autoscaler does not
        # restart a worker's Ray by itself (after 30 s without a heartbeat): the node-loss part restarts it.
        with (self.home / ".bashrc").open("a") as f:
            f.write("export RAY_metrics_report_interval_ms=1000\nexport AUTOSCALER_HEARTBEAT_TIMEOUT_S=3600\n")
        (self.home / ".ssh" / "authorized_keys").write_text(public_key)
        before = tree(self.home)
        # synth-grpo already installed and current (this checkout's .venv): setup.sh takes its fast path.
        (self.home / "synth-grpo").mkdir()
        (self.home / "synth-grpo" / ".venv").symlink_to(REPO / ".venv")
        host_key = self.dir / "sshd" / "host_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
        (self.dir / "sshd" / "sshd_config").write_text(
            f"Port 22\nHostKey {host_key}\nPidFile {self.dir}/sshd/sshd.pid\n"
            "AuthorizedKeysFile .ssh/authorized_keys\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
            f"AllowUsers {NODE_USER}\nMaxSessions 64\nMaxStartups 64\n")
        # First in the file: uid 0's home is then the node user's for ssh, which expands "~" in `-i ~/...` (the head's
        # autoscaler reaches the worker with ~/ray_bootstrap_key.pem) from the passwd entry of its uid, not $HOME.
        user = f"{NODE_USER}:x:0:0:synth-grpo ray up test:{self.home}:/bin/bash\n"
        (self.dir / "passwd").write_text(user + Path("/etc/passwd").read_text())
        (self.dir / "hosts").write_text(f"127.0.0.1 localhost\n{HEAD_IP} sg-head\n{WORKER_IP} sg-worker\n"
                                        f"{DECOY[HEAD_IP]} sg-head-lan\n{DECOY[WORKER_IP]} sg-worker-lan\n")
        return before

    def start(self, shared: Path) -> None:
        """The namespaces, with a private /tmp and /run; of the host's /var/tmp folder only this machine's own
        folder and the shared disk; the checkout bound back in (wherever it is, /tmp included); sshd."""
        keep = {"self": self.dir, "shared": shared, "repo": REPO}
        init = "; ".join([
            "set -e", "ip link set lo up", f"hostname {self.name}", "mount -t tmpfs -o mode=755 tmpfs /run",
            *(f"mkdir -p /run/keep/{k} && mount --bind {v} /run/keep/{k}" for k, v in keep.items()),
            "mount -t tmpfs -o mode=1777 tmpfs /tmp", f"mount -t tmpfs -o mode=755 tmpfs {self.root}",
            *(f"mkdir -p {v} && mount --move /run/keep/{k} {v}" for k, v in keep.items()),
            "mkdir -m 755 /run/sshd", f"mount --bind {self.dir}/passwd /etc/passwd", f"mount --bind {self.dir}/hosts /etc/hosts",
            f"/usr/sbin/sshd -D -f {self.dir}/sshd/sshd_config -E {self.dir}/sshd/sshd.log & wait $!",
        ])
        self.proc = subprocess.Popen(
            ["unshare", "--net", "--pid", "--mount", "--uts", "--fork", "--kill-child", "--mount-proc", "--propagation",
             "private", "bash", "-c", init], start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=(self.root / f"{self.name}-init.log").open("w"))
        deadline = time.time() + 30
        while time.time() < deadline and not self.init_pid:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            if children.exists() and children.read_text().split():
                self.init_pid = int(children.read_text().split()[0])
            time.sleep(0.1)
        assert self.init_pid, (self.root / f"{self.name}-init.log").read_text()

    def net(self, *cmd: str) -> None:
        subprocess.run(["nsenter", "--target", str(self.init_pid), "--net", *cmd], check=True, capture_output=True)

    def run(self, cmd: list[str], timeout: float = 120, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
        """A command on this machine, as its user who runs `ray up` (HOME: self.client)."""
        # --wd: entering a mount namespace resets the working directory to its root.
        return subprocess.run(["nsenter", "--target", str(self.init_pid), "--net", "--mount", "--pid", "--uts", f"--wd={REPO}",
                               "--", *cmd], env=env or self.env(), cwd=REPO, capture_output=True, text=True, timeout=timeout, **kw)

    def env(self, **extra: str) -> dict[str, str]:
        return {**clean_env(), "HOME": str(self.client), **extra}

    def ssh(self, ip: str, command: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """`command` on the machine at `ip`, over SSH from this one with the cluster's key, in a login shell
        as Ray's own SSH runs its commands (interactive: ~/.bashrc's cluster lines apply)."""
        return self.run(["ssh", *ssh_opts(self.key), f"{NODE_USER}@{ip}", f"bash --login -c -i {shlex.quote(command)}"],
                        timeout=timeout, **kw)

    def http(self, url: str, token: str | None = None) -> tuple[int, str]:
        auth = ["-H", f"Authorization: Bearer {token}"] if token else []
        r = self.run(["curl", "-s", "-m", "10", "-w", "\n%{http_code}", *auth, url], timeout=30)
        body, _, code = r.stdout.rpartition("\n")
        return int(code or 0), body

    def processes(self) -> list[str]:
        """Command lines of the processes in this machine's PID namespace, but its init and sshd."""
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


def ssh_opts(key: Path) -> list[str]:
    return ["-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR"]


def connect(head: Machine, worker: Machine) -> None:
    """A cable between the two machines (a veth pair, no bridge on the host): each end holds the machine's
    address and its decoy, the decoy as the source of the default route; the worker reaches the head from it."""
    head.net("ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", str(worker.init_pid))
    for m in (head, worker):
        m.net("ip", "addr", "add", f"{m.ip}/24", "dev", "eth0")
        m.net("ip", "addr", "add", f"{DECOY[m.ip]}/32", "dev", "eth0")
        m.net("ip", "link", "set", "eth0", "up")
        m.net("ip", "route", "add", "default", "dev", "eth0", "src", DECOY[m.ip])
    worker.net("ip", "route", "add", f"{HEAD_IP}/32", "dev", "eth0", "src", DECOY[WORKER_IP])


def namespaces_or_skip() -> None:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "nsenter", "ip")):
        pytest.skip("needs root, util-linux's unshare/nsenter and iproute2 (namespaces for isolated sshd machines)")
    probe = subprocess.run(["unshare", "--net", "--pid", "--mount", "--uts", "--fork", "ip", "link", "add", "sgp0", "type", "veth",
                            "peer", "name", "sgp1"], capture_output=True, text=True)
    if probe.returncode != 0:  # a container without CAP_SYS_ADMIN / CAP_NET_ADMIN
        pytest.skip(f"this machine does not allow new namespaces with a veth pair: {probe.stderr.strip()[:200]}")


def ray_up(client: Machine, config: Path) -> tuple[subprocess.CompletedProcess, str]:
    up = client.run([ray_cli(), "up", "-y", str(config)], timeout=600)
    log = up.stdout + up.stderr
    for _ in range(2):
        if up.returncode == 0 or "The current node timed out during startup" not in up.stdout + up.stderr:
            break
        # `ray start` gives the raylet a hard-coded 30 s to register; a loaded machine can miss it. `ray up`
        # is made to be run again (setup skips what is done, the start commands restart Ray).
        up = client.run([ray_cli(), "up", "-y", str(config)], timeout=600)
        log += "\n--- ray up, again ---\n" + up.stdout + up.stderr
    return up, log


def state(client: Machine, token: str, what: str) -> list[dict]:
    """Rows of the dashboard's state API (nodes, actors)."""
    code, body = client.http(f"http://127.0.0.1:8265/api/v0/{what}?limit=1000&detail=1", token)
    return json.loads(body)["data"]["result"]["result"] if code == 200 else []


class Job:
    """A `ray job submit --no-wait` of `synth-grpo train` on configs/tiny.yaml, from the head's user."""

    def __init__(self, client: Machine, token: str, run_name: str, storage: Path, sets: list[str]):
        self.client, self.token, self.run_name = client, token, run_name
        self.store = storage / run_name  # the shared disk, as a plain folder: read straight from the host
        self.id = f"synth-grpo-{secrets.token_hex(4)}"
        self.started = time.time()
        runtime_env = {"excludes": [".venv", ".cache", ".git", "runs", "*.egg-info"],
                       "env_vars": {"SYNTH_GRPO_CACHE": os.environ["SYNTH_GRPO_CACHE"], **JOB_ENV}}
        self.metadata = {"run_name": run_name, "config": "configs/tiny.yaml"}
        args = ["--config", "configs/tiny.yaml", "--set", "eval.num_prompts=2", "--set", "logging.progress_bar=false",
                "--set", "output.root=/tmp/sg-runs", "--set", f"output.storage={storage}", "--set", f"output.run_name={run_name}"]
        for s in sets:
            args += ["--set", s]
        submit = client.run([
            ray_cli(), "job", "submit", "--address", "http://127.0.0.1:8265", "--no-wait", "--submission-id", self.id,
            "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--metadata-json", json.dumps(self.metadata),
            "--", "python", "-m", "pipeline", "train", *args], env=client.env(RAY_AUTH_MODE="token"))
        assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
        self.actors: dict[str, dict] = {}  # actor id -> the latest row the state API gave
        self.node_ips: dict[str, str] = {}  # node id -> address, of every node seen
        self.first_step_at = 0.0  # when its first step reached storage, as the polls saw it
        self.seen: dict[int, float] = {}  # step -> when the polls first saw it in storage

    def poll(self) -> str:
        for a in state(self.client, self.token, "actors"):
            self.actors[a["actor_id"]] = a
        self.node_ips |= {n["node_id"]: n["node_ip"] for n in state(self.client, self.token, "nodes")}
        for step in self.steps():
            self.seen.setdefault(step, time.time())
        self.first_step_at = self.first_step_at or min(self.seen.values(), default=0.0)
        code, body = self.client.http(f"http://127.0.0.1:8265/api/jobs/{self.id}", self.token)
        assert code == 200, body
        self.info = json.loads(body)
        return self.info["status"]

    def wait(self, timeout: float, until=lambda: False, every: float = 2) -> str:
        """Poll until the job ends, or `until()` holds (asked each `every` seconds, the job's state each 2 s);
        the job's status."""
        status, deadline, polled = "PENDING", time.time() + timeout, 0.0
        while time.time() < deadline:
            if time.time() - polled >= 2:
                status, polled = self.poll(), time.time()
            if status in ("SUCCEEDED", "FAILED", "STOPPED") or until():
                break
            time.sleep(every)
        return status

    def logs(self, keep: Path) -> str:
        code, logs = self.client.http(f"http://127.0.0.1:8265/api/jobs/{self.id}/logs", self.token)
        logs = json.loads(logs)["logs"] if code == 200 else logs
        (keep / f"{self.run_name}.log").write_text(logs)  # kept by pytest for a look after a failure
        for name in ("events.jsonl", "metrics.jsonl"):
            if (self.store / name).is_file():
                shutil.copy(self.store / name, keep / f"{self.run_name}.{name}")
        (keep / f"{self.run_name}.seen.json").write_text(json.dumps({"submitted": self.started, **self.seen}))
        return logs

    def steps(self) -> list[int]:
        return [r["step"] for r in read_metrics(self.store / "metrics.jsonl") if "reward" in r]

    def events(self, *kinds: str) -> list[dict]:
        return [e for e in read_metrics(self.store / "events.jsonl") if e.get("event") in kinds]

    def ips(self, class_name: str) -> list[str]:
        """Node addresses of the job's actors of a class (alive or not)."""
        return sorted(self.node_ips.get(a.get("node_id") or "", "?") for a in self.actors.values()
                      if class_name in (a.get("class_name") or ""))

    def named(self, prefix: str) -> list[str]:
        return sorted(self.node_ips.get(a.get("node_id") or "", "?") for a in self.actors.values()
                      if (a.get("name") or "").startswith(prefix) and self.run_name in a["name"])


def registered(job: Job) -> list[str]:
    snap = job.store / "ray_train" / "checkpoint_manager_snapshot.json"
    try:
        return [c["checkpoint_dir_name"] for c in json.loads(snap.read_text())["checkpoint_results"]]
    except (OSError, ValueError, KeyError):
        return []


def worker_start(config: dict) -> str:
    """cluster.yaml's worker start commands as the head's autoscaler runs them (RAY_HEAD_IP exported)."""
    return "\n".join(["set -e", f"export RAY_HEAD_IP={HEAD_IP}", *config["worker_start_ray_commands"]])


@pytest.mark.slow
def test_ray_up_two_nodes_job_node_loss_ray_down(tiny_policy, tmp_path):
    namespaces_or_skip()
    r = subprocess.run([str(REPO / "scripts" / "setup.sh")], env={**os.environ, "CHECK": "1"}, capture_output=True, text=True)
    assert r.returncode == 0, f"{r.stdout}: run ./scripts/setup.sh test first (the nodes use this .venv)"
    install_missing_packages()

    machine_before = {p: p.read_bytes() if p.is_file() else None
                      for p in (Path.home() / ".bashrc", Path.home() / ".ray" / "auth_token")}
    root = Path(tempfile.mkdtemp(prefix="sg-rayup-", dir="/var/tmp"))  # not /tmp: each machine has a private /tmp
    head, worker = Machine(root, "sg-head", HEAD_IP), Machine(root, "sg-worker", WORKER_IP)
    shared = root / "shared"  # the disk both machines mount (NFS in real life): output.storage
    timings: dict[str, float] = {}
    try:
        for d in (head.client / ".ssh", head.client / ".ray", shared):
            d.mkdir(parents=True, mode=0o700)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sg-rayup-test", "-f", str(head.key)], check=True)
        token = secrets.token_hex(32)
        (head.client / ".ray" / "auth_token").write_text(token)
        (head.client / ".ray" / "auth_token").chmod(0o600)
        homes_before = {m.name: m.prepare(head.key.with_suffix(".pub").read_text()) for m in (head, worker)}
        for m in (head, worker):
            m.start(shared)
        connect(head, worker)
        deadline = time.time() + 30
        while time.time() < deadline:
            answers = [head.ssh(ip, "true", timeout=20).returncode for ip in (HEAD_IP, WORKER_IP)]
            if answers == [0, 0]:
                break
            time.sleep(0.5)
        assert answers == [0, 0], [(root / f"{m.name}-init.log").read_text() for m in (head, worker)]
        # Isolated: the worker sees neither the head's home nor its /tmp, only the shared disk.
        seen = head.ssh(WORKER_IP, f"ls {head.home} {shared}; hostname")
        assert "No such file" in seen.stderr and seen.stdout.split()[-1] == "sg-worker", (seen.stdout, seen.stderr)

        config_text = fill_in(CLUSTER_YAML.read_text(), {"head_ip": HEAD_IP, "worker_ips": f"[{WORKER_IP}]",
                                                         "ssh_user": NODE_USER, "ssh_private_key": str(head.key)})
        config = head.client / "cluster.yaml"
        config.write_text(config_text)

        t0 = time.time()
        up, up_log = ray_up(head, config)
        (tmp_path / "ray_up.log").write_text(up_log)
        assert up.returncode == 0, up_log[-6000:]
        timings["ray up"] = time.time() - t0
        assert "nothing to install" in up_log and "no NVIDIA GPU on" in up_log, up_log[-3000:]
        hard = subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip()
        assert ("WARNING: open-file hard limit" in up_log) == (hard != "unlimited" and int(hard) < 65536), hard
        assert "Prometheus" in up_log and "127.0.0.1:9090" in up_log, up_log[-3000:]
        assert (head.home / ".ray" / "auth_token").read_text() == token

        # The worker joins: the head's autoscaler sets it up over SSH (rsync, setup.sh) and starts its Ray,
        # registered under worker_ips' address (not its decoy, which its route to the head would give).
        nodes, deadline = [], time.time() + 240
        while time.time() < deadline:
            nodes = state(head, token, "nodes")
            if sorted((n["node_ip"], n["state"]) for n in nodes) == [(HEAD_IP, "ALIVE"), (WORKER_IP, "ALIVE")]:
                break
            time.sleep(2)
        monitor = "\n".join(p.read_text(errors="replace") for p in head_ray_logs(head, "monitor.*"))
        (tmp_path / "monitor.log").write_text(monitor)
        assert sorted((n["node_ip"], n["state"]) for n in nodes) == [(HEAD_IP, "ALIVE"), (WORKER_IP, "ALIVE")], (nodes, monitor[-4000:])
        timings["ray up -> worker joined"] = time.time() - t0
        for n in nodes:  # detected, not hard-coded
            assert n["resources_total"].get("GPU", 0) == 0 and n["resources_total"]["CPU"] >= 2, n
        assert (worker.home / ".ray" / "auth_token").read_text() == token and (worker.home / "synth-grpo" / "pipeline").is_dir()
        assert not (worker.home / "ray_bootstrap_key.pem").exists()

        job = spread_job_loses_a_node(head, token, shared, tmp_path, timings, t0, yaml.safe_load(config_text),
                                      min(n["resources_total"]["CPU"] for n in nodes))

        prometheus_scraped_both(head, job.run_name)
        ray_down_and_clean(head, worker, config, homes_before, timings)
    finally:
        for m in (head, worker):
            m.stop()
        shutil.rmtree(root, ignore_errors=True)
        print("timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    for p, content in machine_before.items():
        assert (p.read_bytes() if p.is_file() else None) == content, f"{p} changed"


def prometheus_scraped_both(head: Machine, run_name: str) -> None:
    """Prometheus on the head scraped both machines (the targets Ray's service discovery lists, both up, and Ray's
    node metrics under each one's instance label) and the run's reward from its rank 0."""
    def query(q: str) -> list[dict]:
        code, body = head.http("http://127.0.0.1:9090/api/v1/query?query=" + quote(q, safe=""))
        return json.loads(body)["data"]["result"] if code == 200 else []

    code, body = head.http("http://127.0.0.1:9090/api/v1/targets")
    targets = json.loads(body)["data"]["activeTargets"]
    assert {t["labels"]["instance"].split(":")[0] for t in targets if t["health"] == "up"} == {HEAD_IP, WORKER_IP}, targets
    per_node = query("count by (instance) (max_over_time(ray_node_cpu_utilization[30m]))")
    names = {ip: query(f'count by (__name__) ({{instance="{ip}:8080"}})') for ip in (HEAD_IP, WORKER_IP)}
    assert {s["metric"]["instance"] for s in per_node} == {f"{HEAD_IP}:8080", f"{WORKER_IP}:8080"}, (per_node, names)
    reward = RAY_NS + prometheus_name("reward")
    assert query(f'max_over_time({reward}{{run="{run_name}"}}[30m])'), (reward, names)


def head_ray_logs(head: Machine, pattern: str) -> list[Path]:
    """Ray's logs on the head: its private /tmp, seen through its init's root."""
    root = Path(f"/proc/{head.init_pid}/root")
    session = root / "tmp" / "ray" / "session_latest"
    return sorted((root / os.readlink(session).lstrip("/") / "logs").glob(pattern)) if session.is_symlink() else []


def spread_job_loses_a_node(head: Machine, token: str, shared: Path, keep: Path, timings: dict, t0: float, config: dict,
                            cpus: float) -> Job:
    """One job, ZeRO-2, the run in the shared folder, `num_workers: [1, 2]` spread over both machines (each worker asks
    for all of a machine's CPUs but the judge's 0.5: one slot per machine, since Ray Train's elastic policy counts
    slots from a node's total CPUs). While both train: one Train worker per machine, and the first registered
    checkpoint holds both ranks' optimizer shards. Then `ray stop` on the worker over SSH; the group shrinks to the
    head's worker and trains on; cluster.yaml's worker start commands bring the machine back and the group grows to
    two again. Every step is logged once, with the same samples per optimizer step throughout.

    The order is made certain, not left to a step count: the surviving Train worker is frozen (SIGSTOP) while the
    other machine goes and while it comes back, so no group can train to the end ahead of the loss or the return;
    it goes on (SIGCONT) once the worker's Ray is stopped, and again once Ray Train has decided to grow."""
    steps = 24  # each freeze starts within about a second of what it waits for: a few steps at most
    job = Job(head, token, "two-nodes", shared, [
        "distributed.num_workers=[1,2]", f"distributed.cpus_per_worker={cpus - 0.5}", "distributed.placement=spread",
        "distributed.zero_stage=2", "distributed.resize_check_s=2", "distributed.max_failures=3",
        "optimization.per_device_train_batch_size=4", f"optimization.max_steps={steps}", "output.save_steps=4",
        f"eval.every_steps={steps}"])
    status = job.wait(600, until=lambda: bool(registered(job)), every=0.2)
    assert status == "RUNNING" and registered(job), f"job {status}:\n{job.logs(keep)[-5000:]}"
    with frozen(head, job):  # both ranks stop training: the head's frozen, the worker's blocked in its collectives
        timings["ray up -> first training step"] = job.first_step_at - t0
        job.poll()
        assert sorted(job.ips("RayTrainWorker")) == [HEAD_IP, WORKER_IP], job.actors  # one Train worker per machine
        ckpt = job.store / "ray_train" / registered(job)[-1]
        step = int(ckpt.name.rsplit("-", 1)[1])
        shards = sorted(p.name.split("_mp_")[0] for p in ckpt.glob(f"global_step{step}/*optim_states.pt"))
        assert shards == ["zero_pp_rank_0", "zero_pp_rank_1"], sorted(str(p) for p in ckpt.rglob("*"))
        # The data line once: Ray Train's print patch (off in cluster.yaml) would print each line of a worker twice.
        logs = job.logs(keep)
        assert len([line for line in logs.splitlines() if "data[bundled]:" in line]) == 1, logs[-3000:]
        lost_at = time.time()
        stop = head.ssh(WORKER_IP, "ray stop")
        assert stop.returncode == 0, stop.stdout[-2000:] + stop.stderr[-2000:]

    shrunk = lambda: [e for e in job.events("resize") if e["num_workers"] == 1]  # noqa: E731
    status = job.wait(300, until=shrunk)
    assert status == "RUNNING" and shrunk(), f"job {status}, events {job.events('workers', 'resize')}:\n{job.logs(keep)[-5000:]}"
    timings["node loss -> training again"] = time.time() - lost_at
    status = job.wait(120, until=lambda: max(head_steps(head, job), default=0) > shrunk()[0]["step"], every=0.2)
    assert status == "RUNNING", f"job {status}:\n{job.logs(keep)[-5000:]}"

    with frozen(head, job, until_grown=True):  # the group of one trained a step; it waits for the machine's return
        back_at = time.time()
        start = head.ssh(WORKER_IP, worker_start(config), timeout=300)
        assert start.returncode == 0, start.stdout[-3000:] + start.stderr[-3000:]
        timings["worker start commands"] = time.time() - back_at
    timings["node return -> decision to grow"] = time.time() - back_at
    grown = lambda: [e for e in job.events("resize") if e["num_workers"] == 2]  # noqa: E731
    status = job.wait(600)
    logs = job.logs(keep)
    timings["job, submission to end"] = (job.info["end_time"] - job.info["start_time"]) / 1000
    assert status == "SUCCEEDED" and grown(), f"job {status}, events {job.events('workers', 'resize')}:\n{logs[-5000:]}"
    timings["node return -> grown group"] = grown()[0]["time"] - back_at
    assert job.metadata.items() <= job.info["metadata"].items(), job.info["metadata"]
    assert job.steps() == list(range(1, steps + 1)), job.steps()
    sizes = [(e["event"], e["num_workers"]) for e in job.events("workers", "resize")]
    assert sizes[0] == ("workers", 2) and ("resize", 1) in sizes and sizes[-1] == ("resize", 2), sizes
    assert {e["samples_per_step"] for e in job.events("workers", "resize")} == {8}, job.events("workers", "resize")
    assert job.named("judge-0") and job.named("scorer-0"), sorted(a.get("name") or "" for a in job.actors.values())
    assert (job.store / "adapter" / "adapter_model.safetensors").is_file() and (job.store / "summary.txt").is_file()
    # Quiet job log: no bytecode listing, no error-level line from Ray Train's preemption watcher.
    assert "PreemptionWatcher" not in logs and not re.search(r"\bLOAD_(GLOBAL|FAST|ATTR)\b", logs), logs[-3000:]
    nodes = state(head, token, "nodes")
    assert sorted(n["node_ip"] for n in nodes if n["state"] == "ALIVE") == [HEAD_IP, WORKER_IP], nodes
    return job


def head_steps(head: Machine, job: Job) -> list[int]:
    """Steps in the run directory of the head's rank 0 (its private /tmp), as they are logged: the shared folder
    gets them every 2 s."""
    local = Path(f"/proc/{head.init_pid}/root/tmp/sg-runs") / job.run_name / "metrics.jsonl"
    return [r["step"] for r in read_metrics(local) if "reward" in r]


@contextlib.contextmanager
def frozen(head: Machine, job: Job, until_grown: bool = False):
    """The head's live Train worker stopped (SIGSTOP) for the block, then continued; with until_grown, not before Ray
    Train's controller logged its decision to grow the group (which then shuts the worker down)."""
    pids = [a["pid"] for a in state(head, job.token, "actors") if a.get("class_name") == "RayTrainWorker"
            and a.get("state") == "ALIVE" and job.node_ips.get(a.get("node_id") or "") == HEAD_IP]
    assert len(pids) == 1, pids
    head.run(["kill", "-STOP", str(pids[0])], timeout=30).check_returncode()
    try:
        yield
        deadline = time.time() + 300
        while until_grown and time.time() < deadline and not any(
                "resize the worker group from 1 -> 2" in p.read_text(errors="replace")
                for p in head_ray_logs(head, "train/ray-train-sys-controller-*.log")):
            time.sleep(0.5)
    finally:
        head.run(["kill", "-CONT", str(pids[0])], timeout=30)


def ray_down_and_clean(head: Machine, worker: Machine, config: Path, homes_before: dict, timings: dict) -> None:
    """`ray down` stops Ray on both machines (the worker's through scripts/stop_with_head.sh); each home holds
    what docs/cluster.md's table lists, and its clean-up block, run over SSH, leaves it as it was (~/.cache aside)."""
    down_at = time.time()
    down = head.run([ray_cli(), "down", "-y", str(config)], timeout=300)
    assert down.returncode == 0, (down.stdout + down.stderr)[-4000:]
    deadline = time.time() + 60  # the head's monitoring watcher looks every 5 s, the worker's watcher every 2 s
    while time.time() < deadline and (head.processes() or worker.processes()):
        time.sleep(1)
    timings["ray down -> nothing running"] = time.time() - down_at
    assert (head.processes(), worker.processes()) == ([], []), "left running after `ray down`"

    left = {head: ("synth-grpo", "ray_bootstrap_key.pem", "ray_bootstrap_config.yaml", ".ray/auth_token"),
            worker: ("synth-grpo", ".ray/auth_token")}
    for m, paths in left.items():
        assert "# synth-grpo cluster.yaml" in (m.home / ".bashrc").read_text()
        assert all((m.home / p).exists() for p in paths), [p for p in paths if not (m.home / p).exists()]
    assert not any((worker.home / p).exists() for p in left[head][1:3])  # the key copy is on the head only
    for m in (head, worker):
        clean = head.run(["ssh", *ssh_opts(head.key), f"{NODE_USER}@{m.ip}", "bash -s"], input=docs_block("<!-- node-cleanup -->"))
        assert clean.returncode == 0, clean.stderr
        after = {k: v for k, v in tree(m.home).items() if k != ".cache" and not k.startswith(".cache/")}
        changed = sorted(set(after.items()) ^ set(homes_before[m.name].items()))
        assert after == homes_before[m.name], f"{m.name}'s home differs from before `ray up` (~/.cache aside): {changed}"
    assert (REPO / ".venv" / "bin" / "python").exists()  # the clean-up removed the links, not the checkout's .venv
