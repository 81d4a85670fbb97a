"""deploy/k8s on the direct path (issue 30): the gateway asks the router which shard runs a request
and streams from that shard's pod itself (--direct-to-shards), so every build must let the gateway
pods through the shards' NetworkPolicy on the port the headless `llmesh-scheduler-shards` names
(the address the router hands out: a shard pod's IP and gRPC port)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmesh.cli import parse_command
from tests.deploy.test_manifests import _k8s_command
from tests.helpers.kustomize import build

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
BUILDS = ["base", "overlays/cpu", "overlays/gpu", "overlays/gpu-disaggregated"]


def _named(built: list[dict], kind: str, name: str) -> dict:
    return next(r for r in built if r["kind"] == kind and r["metadata"]["name"] == name)


def _admits(policy: dict, labels: dict[str, str], port: int) -> bool:
    """Whether an Ingress rule of `policy` lets a pod with `labels` (same namespace) reach `port`."""
    for rule in policy["spec"].get("ingress", []):
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        peers = rule.get("from")
        if peers is None:
            return True  # from anywhere
        for peer in peers:
            if set(peer) != {"podSelector"}:
                continue  # namespace or IP block rules: not how llmesh pods find each other
            wanted = peer["podSelector"].get("matchLabels", {})
            if all(labels.get(k) == v for k, v in wanted.items()):
                return True
    return False


@pytest.mark.parametrize("where", BUILDS)
def test_the_gateway_streams_from_the_shards_and_may_reach_them(where: str) -> None:
    built = build(K8S / where)
    gateway = _named(built, "Deployment", "llmesh-gateway")["spec"]["template"]
    argv = _k8s_command(next(c for c in gateway["spec"]["containers"] if c["name"] == "gateway"))
    parse_command(argv)
    assert "--direct-to-shards" in argv
    assert argv[argv.index("--scheduler") + 1].startswith("llmesh-router:")  # a router picks

    scheduler = _named(built, "Deployment", "llmesh-scheduler")["spec"]["template"]
    containers = scheduler["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}
    shards = _named(built, "Service", "llmesh-scheduler-shards")["spec"]
    assert shards["clusterIP"] == "None"  # the router resolves it to one address per ready pod
    target = shards["ports"][0]["targetPort"]
    grpc_port = ports[target] if isinstance(target, str) else target

    policy = _named(built, "NetworkPolicy", "llmesh-scheduler")
    assert _admits(policy, gateway["metadata"]["labels"], grpc_port)
    router = _named(built, "Deployment", "llmesh-router")["spec"]["template"]
    assert _admits(policy, router["metadata"]["labels"], grpc_port)
    # The policy's own default-deny still holds: a pod of no llmesh role is not let in.
    assert not _admits(policy, {"app.kubernetes.io/name": "somebody-else"}, grpc_port)
