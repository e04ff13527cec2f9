"""A node lost mid-run on a real multi-node Ray cluster on one machine (``ray.cluster_utils.Cluster``).

Run as ``python -m tests.multinode SCENARIO WORKDIR`` (by tests/test_storage.py, in its own process:
one Python process can join only one Ray, and the suite's session Ray stays untouched). Two nodes
hold one training worker each. When the first checkpoint is in storage, the node of one worker is
removed. ``fixed``: ``num_workers: 2``, 1-CPU nodes, the judge on the head (no CPU); the run waits,
then a replacement node is added and it resumes from storage. ``elastic``: ``num_workers: [1, 2]``,
2-CPU nodes, workers asking for 1.5 CPUs and two judges for 0.01 each, which SPREAD puts one on each
worker node (the head has no CPU), so the lost node takes a judge with it; Ray restarts it on the node
left (a worker and both judges fit). The run goes on with one worker; then a replacement node is added and the
group grows back to two. ``shared``: ``synth-grpo train`` (the CLI's own code, on this cluster) with
``output.storage`` a plain folder standing in for a disk all nodes mount (NFS), under a run name the
folder has never seen; then the same command with two more steps after the local run directory is
deleted: it resumes from the folder. Writes WORKDIR/result.json; the test asserts on it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

# Enough steps that the node is gone well before the end: it is removed as soon as the first
# checkpoint is registered in storage, and a step of the tiny policy takes about half a second.
STEPS = 20
ELASTIC_STEPS = 40  # one more restart (the grow back) and steps at half speed on one worker in between


def main(scenario: str, workdir: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from pipeline.config import config_from_dict
    from pipeline.scoring.pool import start_pool, stop_pool
    from pipeline.rundir.storage import RunStorage
    from pipeline.training.driver import prepare_run_dir, run_training
    from tests.test_train_ray import small
    from tests.test_tune import registered_checkpoints

    storage = sys.argv[3]
    elastic = scenario == "elastic"
    data = small(workdir, distributed={"num_workers": [1, 2] if elastic else 2, "zero_stage": 2,
                                       "cpus_per_worker": 1.5 if elastic else 1,
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

    # The head has no CPU: Ray Train's elastic policy counts each node's CPUs (rounded down) as worker
    # slots, not what other actors hold, so a head CPU held by the judge would be counted as a free slot.
    # elastic: a 2-CPU node is one slot of 1.5 CPUs with room for two 0.01-CPU judges beside its worker (a
    # judge that lost its node must not take CPU a worker needs: Ray Train would count a slot that cannot start).
    cluster = _retry(lambda: Cluster(initialize_head=True, shutdown_at_exit=True,
                                     head_node_args={"num_cpus": 0, "include_dashboard": False}))
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=True)
    node_cpus = 2 if elastic else 1
    nodes = [_retry(lambda: cluster.add_node(num_cpus=node_cpus)) for _ in range(2)]
    cluster.wait_for_nodes()
    pool = start_pool(cfg)
    judges_at_start = _judge_nodes(pool)
    prepare_run_dir(cfg, run_dir, log=None)
    result: dict = {"scenario": scenario, "judge_nodes": judges_at_start, "head": cluster.head_node.node_id,
                    "training_nodes": [n.node_id for n in nodes]}
    victim = nodes[1]

    def last_step() -> int:
        return max([r["step"] for r in _rows(run_dir) if "reward" in r], default=0)

    def chaos() -> None:
        while not registered_checkpoints(store) and thread.is_alive():
            time.sleep(0.2)
        result["step_at_removal"] = last_step()
        log.append(f"{time.time():.1f} removing node {victim.node_id}")
        result["removed"] = victim.node_id
        try:
            cluster.remove_node(victim, allow_graceful=False)
        except AssertionError as e:  # Ray's zombie check after the kill can trip on a loaded machine
            log.append(f"remove_node: {e}")
        if elastic:  # capacity returns once the group trains on one worker: it grows back
            while thread.is_alive() and not any(e.get("event") == "resize" for e in _rows(run_dir, "events.jsonl")):
                time.sleep(0.2)
            result["judges_at_shrink"] = _judge_nodes(pool)
            result["step_at_replacement"] = last_step()
        else:
            time.sleep(10)  # the group cannot restart with one node: it waits for capacity
            result["steps_while_waiting"] = last_step()
        log.append(f"{time.time():.1f} adding a replacement node")
        result["added"] = _retry(lambda: cluster.add_node(num_cpus=node_cpus)).node_id
        log.append(f"{time.time():.1f} replacement node up")

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
    ray.shutdown()
    cluster.shutdown()
    (workdir / "result.json").write_text(json.dumps(result, indent=1))


def shared_folder(workdir: Path, storage: str) -> None:
    import shutil

    import ray
    import yaml
    from ray.cluster_utils import Cluster

    from pipeline.cli.main import main as cli
    from tests.test_train_ray import small

    # Two 1-CPU nodes, one training worker each; the judge (no CPU) and the driver on the head.
    t0 = time.time()
    cluster = _retry(lambda: Cluster(initialize_head=True, shutdown_at_exit=True,
                                     head_node_args={"num_cpus": 0, "include_dashboard": False}))
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=True)
    for _ in range(2):
        _retry(lambda: cluster.add_node(num_cpus=1))
    cluster.wait_for_nodes()
    data = small(workdir, distributed={"num_workers": 2, "cpus_per_worker": 1},
                 judge={"cpus_per_actor": 0, "num_actors": 1}, optimization={"per_device_train_batch_size": 4, "max_steps": 2},
                 eval={"num_prompts": 0}, output={"storage": storage, "save_steps": 2})
    data["output"]["run_name"] = "shared-run"
    config = workdir / "shared.yaml"
    config.write_text(yaml.safe_dump(data))
    argv = ["train", "--config", str(config), "--address", cluster.address]  # joins the cluster this process is on
    result: dict = {"cluster_seconds": time.time() - t0}
    result["first"] = cli(argv)
    result["first_seconds"] = time.time() - t0 - result["cluster_seconds"]
    shutil.rmtree(workdir / "shared-run")  # this machine never saw the run: only the shared folder has it
    result["again"] = cli([*argv, "--set", "optimization.max_steps=4"])
    result["ok"] = result["first"] == result["again"] == 0
    result["seconds"] = time.time() - t0
    ray.shutdown()
    cluster.shutdown()
    (workdir / "result.json").write_text(json.dumps(result, indent=1))


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
    if sys.argv[1] == "shared":
        shared_folder(Path(sys.argv[2]), sys.argv[3])
    else:
        main(sys.argv[1], Path(sys.argv[2]))
