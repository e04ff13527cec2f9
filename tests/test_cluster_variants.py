"""The cloud variants beside cluster.yaml (cluster-aws.yaml, cluster-gcp.yaml): valid for Ray, and in step
with the shipped file: the same mounts, setup, security, monitoring and log settings. Offline: nothing
here calls a cloud (what only a cloud can check is listed in docs/cluster.md)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"aws": REPO / "cluster-aws.yaml", "gcp": REPO / "cluster-gcp.yaml"}
# What the head's autoscaler needs to launch the provider's machines (Ray's own defaults install the same).
PROVIDER_SDK = {"aws": "boto3", "gcp": "google-api-python-client"}
# Local provider only: there RAY_CLOUD_INSTANCE_ID is the node's address; on a cloud it is the instance's id or name.
NODE_IP_FROM_PROVIDER = "${node_ip:+--node-ip-address=$node_ip}"
# What only Ray's local provider needs (docs/cluster.md): each node's address from cluster.yaml, autoscaler v1
# on the head (v2 never launches local-provider workers), a worker's Ray stopped with the head's (a cloud's
# `ray down` ends the instances).
LOCAL_ONLY = ('node_ip="${RAY_CLOUD_INSTANCE_ID:-$(echo $SSH_CONNECTION | cut -d\' \' -f3)}";', NODE_IP_FROM_PROVIDER,
              "RAY_enable_autoscaler_v2=0")
SAME_AS_CLUSTER_YAML = ("file_mounts", "rsync_filter", "rsync_exclude", "setup_commands", "idle_timeout_minutes")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def prepared(config: dict) -> dict:
    """What `ray up` does before it calls the provider: fill in the provider's defaults, then Ray's JSON schema.
    Ray has no public validation API: ray.autoscaler._private is read here, in a test, on purpose."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    out = prepare_config(copy.deepcopy(config))
    validate_config(out)
    return out


def without_node_ip(commands: list[str]) -> list[str]:
    """The commands without what only the local provider needs."""
    out = []
    for c in commands:
        if "stop_with_head.sh" in c:
            continue
        for part in LOCAL_ONLY:
            c = c.replace(part, "")
        out.append(" ".join(c.split()))
    return out


@pytest.mark.parametrize("provider", sorted(VARIANTS))
def test_cloud_variant_passes_rays_validation_and_a_typo_does_not(provider):
    import jsonschema

    config = load(VARIANTS[provider])
    out = prepared(config)
    assert out["provider"]["type"] == provider
    assert set(out["available_node_types"]) == {out["head_node_type"], "gpu_worker"}
    assert any(PROVIDER_SDK[provider] in c for c in config["head_setup_commands"])
    broken = copy.deepcopy(config)
    worker = broken["available_node_types"]["gpu_worker"]
    worker["node_confg"] = worker.pop("node_config")
    with pytest.raises(jsonschema.ValidationError):
        prepared(broken)


@pytest.mark.parametrize("provider", sorted(VARIANTS))
def test_cloud_variant_carries_cluster_yamls_settings(provider):
    """Mounts, setup (token, venv, GPU check), start commands (token auth, loopback dashboard, metrics port,
    Grafana/Prometheus hosts, the log switches, the monitoring script) as cluster.yaml's, but the node address."""
    local, cloud = load(REPO / "cluster.yaml"), load(VARIANTS[provider])
    for key in SAME_AS_CLUSTER_YAML:
        assert cloud[key] == local[key], key
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert any(NODE_IP_FROM_PROVIDER in c for c in local[key])  # else this comparison compares nothing new
        assert " ".join(cloud[key]).count("RAY_CLOUD_INSTANCE_ID") == 0, key
        assert without_node_ip(cloud[key]) == without_node_ip(local[key]), key
