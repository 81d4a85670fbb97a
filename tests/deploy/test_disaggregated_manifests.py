"""deploy/k8s for disaggregated prefill/decode: a prefill and a decode worker Deployment of the same
image, both under the workers' NetworkPolicy, TLS and GPU patches; the prefill pool empty unless the
`disaggregated` component (overlays/gpu-disaggregated) scales it up."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate

from llmesh.cli import parse_command
from tests.deploy.test_manifests import K8S_VERSIONS, _k8s_command
from tests.helpers.kustomize import build

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def _by_name(built: list[dict], kind: str) -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in built if r["kind"] == kind}


def _env(deployment: dict) -> dict[str, str]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_the_disaggregated_overlay_has_a_prefill_and_a_decode_pool() -> None:
    built = build(K8S / "overlays" / "gpu-disaggregated")
    for resource in built:
        kubernetes_validate.validate(resource, K8S_VERSIONS[-1], strict=True)
    deployments = _by_name(built, "Deployment")
    prefill, decode = deployments["llmesh-worker-prefill"], deployments["llmesh-worker"]
    assert prefill["spec"]["replicas"] >= 1
    assert _env(prefill)["LLMESH_WORKER_ROLE"] == "prefill" and _env(decode)["LLMESH_WORKER_ROLE"] == "decode"
    for d in (prefill, decode):
        pod = d["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["image"] == decode["spec"]["template"]["spec"]["containers"][0]["image"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1  # the GPU patch
        assert any(v["name"] == "tls" for v in pod["volumes"])  # the TLS component
        parse_command(_k8s_command(container))
        labels = d["spec"]["template"]["metadata"]["labels"]
        policy = _by_name(built, "NetworkPolicy")["llmesh-worker"]["spec"]["podSelector"]["matchLabels"]
        assert policy.items() <= labels.items()  # the workers' NetworkPolicy covers both pools
    assert "llmesh-worker-prefill" in _by_name(built, "PodDisruptionBudget")


def test_the_prefill_pool_is_empty_without_the_component() -> None:
    for overlay in ("cpu", "gpu"):
        deployments = _by_name(build(K8S / "overlays" / overlay), "Deployment")
        assert deployments["llmesh-worker-prefill"]["spec"]["replicas"] == 0
        assert "LLMESH_WORKER_ROLE" not in _env(deployments["llmesh-worker"])
