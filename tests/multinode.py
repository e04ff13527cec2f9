"""A node lost mid-run on a real multi-node Ray cluster on one machine (``ray.cluster_utils.Cluster``).

Run as ``python -m tests.multinode WORKDIR S3_STORAGE SHARED_FOLDER SCENARIO...`` (by tests/test_storage.py,
in its own process: one Python process can join only one Ray, and the suite's session Ray stays
untouched). One cluster serves every scenario named, in turn (each costs half a minute to start on 2
cores): a head without CPU and two 2-CPU nodes, one training worker of 1.5 CPUs each, so two workers
never share a node. ``elastic``: ``num_workers: [1, 2]`` and two judges for 0.01 CPU each, which SPREAD
puts one on each worker node (the head has no CPU), so the lost node takes a judge with it; Ray restarts
it on the node left (a worker and both judges fit). When the first checkpoint is in storage, the node of
one worker is removed; the run goes on with one worker; once it has saved a checkpoint, a replacement node
is added and the group grows back to two. ``fixed``: ``num_workers: 2``, the judge on the head (no CPU); the
node of one worker is removed the same way, the run waits, then a replacement node is added and it resumes
from storage. No step count keeps the run going until then: the surviving Train worker is frozen (SIGSTOP)
while the node is removed, and (elastic) the group of one while the replacement comes and until Ray Train's
controller has logged its decision to grow.
``shared``: ``synth-grpo train`` (the CLI's own code, on this cluster) with ``output.storage`` a plain
folder standing in for a disk all nodes mount (NFS), under a run name the folder has never seen; then
the same command with two more steps after the local run directory is deleted: it resumes from the
folder. Each scenario writes WORKDIR/result-SCENARIO.json, which its test asserts on; a lost node's
replacement is one of the two worker nodes of the next scenario.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

# The run cannot end ahead of what it waits for: the surviving Train worker is frozen (SIGSTOP) from the first
# registered checkpoint until the node is removed, and (elastic) from the shrunk group's first checkpoint until Ray
# Train has decided to grow back. Each freeze starts a fraction of a second after its condition: a step or two.
STEPS = 8
ELASTIC_STEPS = 16
SCENARIOS = ("elastic", "fixed", "shared")  # the order they run in on the one cluster
NODE_CPUS, WORKER_CPUS = 2, 1.5  # one worker per node: two never fit on one
# A node whose raylet is killed is marked dead after health_check_failure_threshold failed checks
# health_check_period_ms apart: 1.5 s instead of Ray's 15 s (5 x 3 s), in each scenario that loses a node.
# A check of a dead node fails at once (connection refused); one of a live but busy node fails only after
# health_check_timeout_ms (Ray's 10 s, kept), so a loaded machine does not get a live node marked dead.
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}


def main(workdir: Path, storage: str, shared: str, scenarios: list[str]) -> None:
    import ray
    from ray.cluster_utils import Cluster

    # The head has no CPU: Ray Train's elastic policy counts each node's CPUs (rounded down) as worker
    # slots, not what other actors hold, so a head CPU held by the judge would be counted as a free slot.
    # A 2-CPU node is one slot of 1.5 CPUs with room for two 0.01-CPU judges beside its worker (a judge
    # that lost its node must not take CPU a worker needs: Ray Train would count a slot that cannot start).
    t0 = time.time()
    cluster = _retry(lambda: Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "_system_config": FAST_NODE_DEATH}))
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=True)
    nodes = [_retry(lambda: cluster.add_node(num_cpus=NODE_CPUS)) for _ in range(2)]
    cluster.wait_for_nodes()
    cluster_seconds = time.time() - t0
    for scenario in scenarios:
        try:
            if scenario == "shared":
                result = shared_folder(cluster, workdir, shared)
            else:
                result, nodes = node_loss(cluster, nodes, scenario, workdir, storage)
        except Exception as e:  # the scenario's test shows it; the next scenario still runs
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["cluster_seconds"] = cluster_seconds
        (workdir / f"result-{scenario}.json").write_text(json.dumps(result, indent=1))
    ray.shutdown()
    cluster.shutdown()


def node_loss(cluster, nodes: list, scenario: str, workdir: Path, storage: str) -> tuple[dict, list]:
    """One run on ``nodes`` (a worker each) that loses the second node's at its first registered
    checkpoint; returns the result and the two worker nodes left (the replacement second)."""
    from pipeline.config import config_from_dict
    from pipeline.scoring.pool import start_pool, stop_pool
    from pipeline.rundir.storage import RunStorage
    from pipeline.training.driver import prepare_run_dir, run_training
    from tests.test_train_ray import small
    from tests.test_tune import registered_checkpoints

    elastic = scenario == "elastic"
    data = small(workdir, distributed={"num_workers": [1, 2] if elastic else 2, "zero_stage": 2,
                                       "cpus_per_worker": WORKER_CPUS,
                                       "max_failures": 3, "resize_check_s": 2 if elastic else 60},
                 judge={"cpus_per_actor": 0.01, "num_actors": 2, "max_restarts": 3} if elastic else
                       {"cpus_per_actor": 0, "num_actors": 1, "max_restarts": 3},
                 optimization={"per_device_train_batch_size": 4, "max_steps": ELASTIC_STEPS if elastic else STEPS},
                 eval={"num_prompts": 0}, output={"storage": storage, "save_steps": 2})
    cfg = config_from_dict(data)
    cfg.output.run_name = f"node-loss-{scenario}"
    run_dir = workdir / cfg.output.run_name
    store = RunStorage(storage, cfg.output.run_name)
    log: list[str] = []
    pool = start_pool(cfg)
    judges_at_start = _judge_nodes(pool)
    prepare_run_dir(cfg, run_dir, log=None)
    result: dict = {"scenario": scenario, "judge_nodes": judges_at_start, "head": cluster.head_node.node_id,
                    "training_nodes": [n.node_id for n in nodes]}
    victim, replacement = nodes[1], None

    def last_step() -> int:
        return max([r["step"] for r in _rows(run_dir) if "reward" in r], default=0)

    def chaos() -> None:
        nonlocal replacement
        while not registered_checkpoints(store) and thread.is_alive():
            time.sleep(0.2)
        with _frozen(_train_worker_pids(but=victim.node_id)):
            result["step_at_removal"] = last_step()
            log.append(f"{time.time():.1f} removing node {victim.node_id}")
            result["removed"] = victim.node_id
            try:
                cluster.remove_node(victim, allow_graceful=False)
            except AssertionError as e:  # Ray's zombie check after the kill can trip on a loaded machine
                log.append(f"remove_node: {e}")
        if elastic:  # capacity returns once the group of one has trained and saved a checkpoint: it grows back
            while thread.is_alive() and not (shrunk := [e["step"] for e in _rows(run_dir, "events.jsonl")
                                                        if e.get("event") == "resize"]):
                time.sleep(0.2)
            while thread.is_alive() and not [c for c in registered_checkpoints(store) if int(c.rsplit("-", 1)[1]) > shrunk[0]]:
                time.sleep(0.2)
            result["judges_at_shrink"] = _judge_nodes(pool)
            result["step_at_replacement"] = last_step()
            with _frozen(_train_worker_pids()):
                replacement = _add_replacement(cluster, result, log)
                result["grow_decided"] = _wait_for_log(cluster, "resize the worker group from 1 -> 2", 300)
        else:
            # The group cannot restart with one node: it waits for capacity (the node is marked dead in
            # about 2 s: 5 s leaves some 3 s of waiting; with Ray's 15 s the replacement came before that)
            time.sleep(5)
            result["steps_while_waiting"] = last_step()
            replacement = _add_replacement(cluster, result, log)

    def train() -> None:
        try:
            run_training(cfg, run_dir, pool=pool, log=None)
            result["ok"] = True
        except Exception as e:  # the test shows it
            result["ok"], result["error"] = False, f"{type(e).__name__}: {e}"

    # Training in a thread, the chaos in the main thread: a node starts only from the main thread (Ray's
    # Node installs a SIGTERM handler), and Ray Train's fit() runs in any thread (as it does under Tune).
    thread = threading.Thread(target=train, daemon=True)
    t0 = time.time()
    thread.start()
    try:
        chaos()
    except Exception as e:
        result["chaos_error"] = f"{type(e).__name__}: {e}"
    thread.join(timeout=600)
    result["seconds"] = time.time() - t0
    result["log"] = log
    result["judges_at_end"] = _judge_nodes(pool)
    stop_pool(pool)
    return result, [nodes[0], replacement or victim]


def shared_folder(cluster, workdir: Path, storage: str) -> dict:
    import shutil

    import yaml

    from pipeline.cli.main import main as cli
    from tests.test_train_ray import small

    # One training worker on each node; the judge (no CPU) and the driver on the head.
    data = small(workdir, distributed={"num_workers": 2, "cpus_per_worker": WORKER_CPUS},
                 judge={"cpus_per_actor": 0, "num_actors": 1}, optimization={"per_device_train_batch_size": 4, "max_steps": 2},
                 eval={"num_prompts": 0}, output={"storage": storage, "save_steps": 2})
    data["output"]["run_name"] = "shared-run"
    config = workdir / "shared.yaml"
    config.write_text(yaml.safe_dump(data))
    argv = ["train", "--config", str(config), "--address", cluster.address]  # joins the cluster this process is on
    t0 = time.time()
    result: dict = {"first": cli(argv)}
    result["first_seconds"] = time.time() - t0
    shutil.rmtree(workdir / "shared-run")  # this machine never saw the run: only the shared folder has it
    result["again"] = cli([*argv, "--set", "optimization.max_steps=4"])
    result["ok"] = result["first"] == result["again"] == 0
    result["seconds"] = time.time() - t0
    return result


def _add_replacement(cluster, result: dict, log: list[str]):
    log.append(f"{time.time():.1f} adding a replacement node")
    node = _retry(lambda: cluster.add_node(num_cpus=NODE_CPUS))
    result["added"], result["added_at"] = node.node_id, time.time()
    log.append(f"{time.time():.1f} replacement node up")
    return node


def _train_worker_pids(but: str = "") -> list[int]:
    """Process ids of the live Ray Train workers (all nodes share this machine), but those on node ``but``."""
    import ray

    return [a["Pid"] for a in ray._private.state.actors().values() if a["ActorClassName"] == "RayTrainWorker"
            and a["State"] == "ALIVE" and a["Address"]["NodeID"] != but]


@contextlib.contextmanager
def _frozen(pids: list[int]):
    """The processes stopped (SIGSTOP) for the block, then continued: training waits, nothing else does."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # a worker of the node just lost
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _wait_for_log(cluster, text: str, timeout: float) -> bool:
    """Whether a Ray Train controller logged ``text`` (its logs are the cluster's, on this machine) in time."""
    logs = Path(cluster.head_node.get_logs_dir_path()) / "train"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(text in p.read_text(errors="replace") for p in logs.glob("ray-train-sys-controller-*.log")):
            return True
        time.sleep(0.5)
    return False


def _judge_nodes(pool) -> list[dict]:
    import ray

    states = [ray._private.state.actors(a._actor_id.hex()) for a in pool.judges]
    return [{"node": st["Address"]["NodeID"], "restarts": st["NumRestarts"], "state": st["State"]} for st in states]


def _retry(start, attempts: int = 3):
    """Ray gives a starting node 30 s to register; on an overloaded machine a second try is normal."""
    for i in range(attempts):
        try:
            return start()
        except Exception:
            if i == attempts - 1:
                raise
            time.sleep(5)


def _rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    from pipeline.training.callbacks import read_metrics

    return read_metrics(run_dir / name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:])
