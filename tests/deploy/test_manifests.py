"""deploy/: every Kustomize build validates against the Kubernetes schemas (kubernetes-validate), the
compose file against the compose specification (the schema check-jsonschema vendors), and every
command in them parses with the real `llmesh` CLI parser. The Dockerfile is parsed, not built (no
docker on test machines): its stages, user and that each CMD/HEALTHCHECK is an `llmesh` command.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from importlib import resources
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from llmesh.cli import SERVICE_CONFIGS, parse_command
from tests.helpers.kustomize import build

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
BUILDS = ["base", "overlays/cpu", "overlays/gpu"]
# The oldest Kubernetes the manifests target (preStop `sleep` is 1.30+) and the newest known.
K8S_VERSIONS = ["1.31.0", kubernetes_validate.utils.latest_version()]


def _pod_specs(resources_: list[dict]) -> list[tuple[str, dict]]:
    return [
        (f"{r['kind']}/{r['metadata']['name']}", r["spec"]["template"]["spec"])
        for r in resources_
        if "template" in r.get("spec", {})
    ]


@pytest.fixture(scope="module", params=BUILDS)
def kustomize_build(request) -> tuple[str, list[dict]]:
    return request.param, build(DEPLOY / "k8s" / request.param)


def test_every_kustomize_build_validates_against_the_kubernetes_schemas(kustomize_build) -> None:
    name, built = kustomize_build
    assert len(built) > 20, name
    for resource in built:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(resource, version, strict=True)


def test_kubernetes_validate_is_no_rubber_stamp() -> None:
    broken = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {"replicas": "2"},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def _k8s_command(container: dict) -> list[str]:
    """The container's llmesh command line, `$(VAR)` expanded as the kubelet does (with stand-ins)."""
    words = [*container.get("command", []), *container.get("args", [])]
    if words[:1] == ["llmesh"]:
        words = words[1:]
    return [re.sub(r"\$\((\w+)\)", lambda m: {"POD_IP": "10.0.0.7"}.get(m[1], "pod-0"), w) for w in words]


def test_every_manifest_command_parses_with_the_llmesh_cli(kustomize_build) -> None:
    name, built = kustomize_build
    seen = set()
    for where, spec in _pod_specs(built):
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            if container["name"] == "redis":
                continue
            argv = _k8s_command(container)
            parse_command(argv)  # exits 2 (fails the test) on a flag the CLI does not accept
            seen.add(argv[0])
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = container.get(probe, {}).get("exec", {}).get("command")
                if command:
                    assert command[0] == "llmesh", (where, probe)
                    parse_command(command[1:])
    assert {"scheduler", "worker", "gateway", "kvstore", "convert"} <= seen, name


def _llmesh_environment_names() -> set[str]:
    """Every LLMESH_* variable some service reads: LLMESH_<SERVICE>_<FIELD>, LLMESH_<FIELD>."""
    import importlib

    names = {"LLMESH_CACHE"}  # read by services.model_files, not a config field
    for service, (module, cls_name) in SERVICE_CONFIGS.items():
        cls = getattr(importlib.import_module(module), cls_name)
        for f in dataclasses.fields(cls):
            names |= {f"LLMESH_{f.name.upper()}", f"LLMESH_{service.upper()}_{f.name.upper()}"}
    return names


def test_every_llmesh_variable_in_the_manifests_is_one_a_service_reads(kustomize_build) -> None:
    _, built = kustomize_build
    known = _llmesh_environment_names()
    used = {k for r in built if r["kind"] == "ConfigMap" for k in r["data"]}
    for _, spec in _pod_specs(built):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            used |= {e["name"] for e in c.get("env", [])}
    assert {n for n in used if n.startswith("LLMESH_")} - known == set()


def test_manifests_hold_what_the_issue_asks(kustomize_build) -> None:
    name, built = kustomize_build
    kinds = {(r["kind"], r["metadata"]["name"]) for r in built}
    for svc in ("gateway", "scheduler", "worker", "kvstore", "redis"):
        assert ("Deployment", f"llmesh-{svc}") in kinds
    for svc in ("gateway", "scheduler", "worker", "kvstore"):
        assert ("PodDisruptionBudget", f"llmesh-{svc}") in kinds
        assert ("NetworkPolicy", f"llmesh-{svc}") in kinds
    assert {
        ("HorizontalPodAutoscaler", "llmesh-gateway"),
        ("HorizontalPodAutoscaler", "llmesh-worker"),
    } <= kinds
    for where, spec in _pod_specs(built):
        if where.endswith("redis"):
            continue
        assert spec["securityContext"]["runAsNonRoot"] is True
        # The drain (LLMESH_SHUTDOWN_GRACE_S=30, uvicorn's 30 s) plus the preStop sleep fit in the grace.
        assert spec["terminationGracePeriodSeconds"] >= 30 + 5
        for c in spec["containers"]:
            assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c), where
            assert "requests" in c["resources"], where
    gpu = "nvidia.com/gpu" in json.dumps([s for w, s in _pod_specs(built) if w.endswith("worker")])
    assert gpu == (name == "overlays/gpu")


# -- docker compose -------------------------------------------------------------------------------


def compose_file() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_the_compose_file_validates_against_the_compose_specification() -> None:
    # The compose-spec JSON schema, vendored by check-jsonschema (builtin schema `vendor.compose-spec`).
    schema = json.loads(
        resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    )
    validator = jsonschema.validators.validator_for(schema)(schema)
    compose = compose_file()
    assert [e.message for e in validator.iter_errors(compose)] == []
    broken = {**compose, "services": {"x": {"image": "llmesh", "depends_on": {"y": {"condition": "soon"}}}}}
    assert list(validator.iter_errors(broken))  # the schema has teeth


def test_every_compose_command_parses_with_the_llmesh_cli() -> None:
    services = compose_file()["services"]
    llmesh = {name: s for name, s in services.items() if "llmesh" in str(s.get("image", ""))}
    assert {"convert", "kvstore", "scheduler", "worker", "worker-gpu", "gateway"} <= set(llmesh)
    for service in llmesh.values():
        parse_command(service["command"])
    assert "gpu" in services["worker-gpu"]["profiles"]


# -- the Dockerfile (parsed; no docker here) ------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    text = (DEPLOY / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_the_dockerfile_has_cpu_and_cuda_targets_non_root_with_llmesh_healthchecks() -> None:
    instructions = _dockerfile()
    stages = [arg.split()[-1] for op, arg in instructions if op == "FROM" and " AS " in arg.upper()]
    assert {"stubs", "build-cpu", "build-cuda", "cpu", "cuda"} <= set(stages)
    final: dict[str, list[tuple[str, str]]] = {}
    current = None
    for op, arg in instructions:
        if op == "FROM":
            current = arg.split()[-1]
            final[current] = []
        elif current:
            final[current].append((op, arg))
    for target in ("cpu", "cuda"):
        ops = final[target]
        assert ("USER", "10001:10001") in ops, target
        health = [arg for op, arg in ops if op == "HEALTHCHECK"]
        assert len(health) == 1 and "CMD" in health[0]
        command = json.loads(health[0].split("CMD", 1)[1])
        assert command[0] == "llmesh"
        parse_command(command[1:])
        # Runtime images copy the venv from a build stage; no [test] extra anywhere.
        assert any(op == "COPY" and "--from=build-" in arg for op, arg in ops), target
    assert not any("[test]" in arg for _, arg in instructions)
    assert any("gen_protos" in arg for op, arg in final["stubs"] if op == "RUN")
    entry = [json.loads(arg) for op, arg in final["runtime-base"] if op in ("ENTRYPOINT", "CMD")]
    assert entry == [["llmesh"], ["--help"]]  # the command names the service: `docker run IMAGE worker ...`
    volume = [shlex.split(arg) for op, arg in final["runtime-base"] if op == "VOLUME"]
    assert volume and "/models" in volume[0][0]


# -- secrets: generated, mounted as files, never a value in a manifest ---------------------------

MESH_SECRET = "llmesh-mesh"


def _secret_files(spec: dict, container: dict) -> dict[str, str]:
    """{path in the container: key of the Secret llmesh-mesh} for what this container mounts of it."""
    volumes = {v["name"]: v.get("secret", {}) for v in spec.get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes.get(mount["name"], {})
        if secret.get("secretName") == MESH_SECRET:
            assert mount.get("readOnly") is True
            files |= {f"{mount['mountPath']}/{i['path']}": i["key"] for i in secret["items"]}
    return files


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_every_pod_takes_the_mesh_secret_and_redis_its_password_from_the_generated_secret(
    kustomize_build,
) -> None:
    _, built = kustomize_build
    assert not [r for r in built if r["kind"] == "Secret"]  # made by make-secret.sh, never in git
    for where, spec in _pod_specs(built):
        container = spec["containers"][0]
        files, env = _secret_files(spec, container), _env(container)
        if container["name"] == "redis":
            script = container["args"][0]
            assert "--aclfile" in script and "user default off" in script and "requirepass" not in script
            assert "/etc/llmesh/mesh/redis-password" in script
            assert files == {"/etc/llmesh/mesh/redis-password": "redis-password"}
            continue
        assert "LLMESH_INTERNAL_KEY" not in env, where  # a file, not an environment value
        assert files[env["LLMESH_INTERNAL_KEY_FILE"]["value"]] == "internal-key", where
        if container["name"] == "kvstore":
            url = env["REDIS_URL"]["value"]
            assert url.startswith("redis://llmesh@") and ":" not in url.split("//")[1].split("@")[0]
            assert files[env["LLMESH_KVSTORE_REDIS_PASSWORD_FILE"]["value"]] == "redis-password"
        else:
            assert "redis-password" not in files.values(), where  # only the store needs it


def test_make_secret_makes_random_values_once_and_keeps_them(tmp_path) -> None:
    import subprocess

    fake = tmp_path / "kubectl"  # records calls; `create secret` copies the files it is given
    fake.write_text(
        '#!/bin/sh\necho "$*" >> "$FAKE/calls"\ncase "$*" in\n'
        '  *"get secret"*) [ -d "$FAKE/secret" ] ;;\n  *"get namespace"*) exit 1 ;;\n'
        '  *"create secret"*) mkdir "$FAKE/secret"; for a in "$@"; do case "$a" in --from-file=*)\n'
        '    kv=${a#--from-file=}; cp "${kv#*=}" "$FAKE/secret/${kv%%=*}";; esac; done ;;\nesac\n'
    )
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "KUBECTL": str(fake), "FAKE": str(tmp_path)}
    script = str(DEPLOY / "k8s" / "make-secret.sh")
    for _ in range(2):  # the second run finds the Secret and keeps it
        subprocess.run(["sh", script, "ns1"], env=env, check=True, timeout=30, capture_output=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "-n ns1 get secret llmesh-mesh" in calls and "create namespace ns1" in calls
    assert sum("create secret" in c for c in calls) == 1
    values = {p.name: p.read_text() for p in (tmp_path / "secret").iterdir()}
    assert set(values) == {"internal-key", "redis-password"}
    assert all(re.fullmatch("[0-9a-f]{64}", v) for v in values.values()) and len(set(values.values())) == 2
    assert not any(v in c for v in values.values() for c in calls)  # never on a command line


def test_compose_hands_every_service_the_generated_secrets_and_publishes_no_internal_port() -> None:
    compose = compose_file()
    services = compose["services"]
    assert compose["networks"]["mesh"] == {"internal": True}
    for name, service in services.items():
        for port in service.get("ports", []):
            assert name == "gateway" and str(port).startswith("127.0.0.1:"), (name, port)
        if name in ("secrets", "convert") or "llmesh" not in str(service.get("image", "")):
            continue
        env = service["environment"]
        assert (
            "LLMESH_INTERNAL_KEY" not in env and env["LLMESH_INTERNAL_KEY_FILE"] == "/run/llmesh/internal-key"
        )
        assert "secrets:/run/llmesh:ro" in service["volumes"]
        assert service["depends_on"]["secrets"] == {"condition": "service_completed_successfully"}
        assert "edge" not in service["networks"] or name == "gateway"
    kvstore = services["kvstore"]["environment"]
    assert kvstore["REDIS_URL"] == "redis://llmesh@redis:6379/0"
    assert kvstore["LLMESH_KVSTORE_REDIS_PASSWORD_FILE"] == "/run/llmesh/redis-password"
    redis = services["redis"]
    assert redis["command"][1:3] == ["--aclfile", "/run/llmesh/users.acl"] and "ports" not in redis
    assert "secrets:/run/llmesh:ro" in redis["volumes"]
