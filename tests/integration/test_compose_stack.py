"""The compose stack, run without docker: every llmesh service of deploy/docker-compose.yml starts
as a real process with exactly the command and environment the compose file gives it; only the
addresses change (0.0.0.0 and compose host names -> loopback, fixed ports -> free ones) and the
secrets volume is a temporary folder. The `secrets` service's own script makes the secrets there;
redis is a real redis-server loading the ACL file it wrote. Start order follows `depends_on` and
its conditions, health is judged by `llmesh health` as the image's HEALTHCHECK does (from the
service's own command line), and one request goes through the gateway with the official `openai`
client.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import openai
import pytest
import yaml

from services.grpc_server import PLAINTEXT, ChannelSecurity
from services.healthcheck import check, target_of_command
from services.launcher import free_port
from services.mesh_secret import ENV_KEY
from tests.helpers.redis_server import RedisServer
from tests.integration.test_zero_trust import call_empty, proto_services

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "docker-compose.yml"
DEFAULT_PROFILE_ORDER = ("convert", "kvstore", "scheduler", "worker", "gateway")
SECRETS_MOUNT = "/run/llmesh"  # where the services mount the volume `secrets`
MODELS_MOUNT = "/models"  # ... and the volume `models` (convert's --link, the scheduler's --model)


def _interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` / `${VAR}` substitution, and `$$` for a literal `$`."""

    def substitute(m: re.Match) -> str:
        return "$" if m[0] == "$$" else environ.get(m[1]) or (m[2] or "")

    return re.sub(r"\$\$|\$\{(\w+)(?::-([^}]*))?\}", substitute, value)


def make_secrets(services: dict, folder: Path, environ: dict[str, str] | None = None) -> None:
    """Run the `secrets` service's script as compose would, on `folder` instead of the volume."""
    service = services["secrets"]
    assert service["volumes"] == [f"secrets:{SECRETS_MOUNT}"]
    words = [_interpolate(w, {}) for w in [*service["entrypoint"], *service["command"]]]
    env = {k: _interpolate(str(v), environ or {}) for k, v in service["environment"].items()}
    script = words[-1].replace(SECRETS_MOUNT, str(folder))
    subprocess.run([*words[:-1], script], env={**os.environ, **env}, check=True, timeout=30)


def test_the_secrets_service_makes_private_secrets_once_and_takes_a_given_key(tmp_path) -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    make_secrets(services, tmp_path)
    files = {p.name: p for p in tmp_path.iterdir()}
    assert set(files) == {"internal-key", "redis-password", "users.acl"}
    assert all(p.stat().st_mode & 0o777 == 0o400 for p in files.values())
    key, password = files["internal-key"].read_text(), files["redis-password"].read_text()
    assert re.fullmatch("[0-9a-f]{64}", key) and re.fullmatch("[0-9a-f]{64}", password) and key != password
    assert f" on >{password} ~llmesh:* " in files["users.acl"].read_text()
    assert "user default off" in files["users.acl"].read_text()
    make_secrets(services, tmp_path)  # a second `up`: the same secrets
    assert files["internal-key"].read_text() == key and files["redis-password"].read_text() == password
    make_secrets(services, tmp_path, {"LLMESH_INTERNAL_KEY": "an-operator-chosen-key"})
    assert files["internal-key"].read_text() == "an-operator-chosen-key"
    assert files["redis-password"].read_text() == password


def _assert_redis_is_locked(server: RedisServer) -> None:
    """No anonymous access; the store's ACL user cannot wipe or list Redis."""
    import redis

    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2).get("llmesh:kv:x")
    with pytest.raises(redis.exceptions.NoPermissionError):
        server.client().flushall()
    assert server.client().get("llmesh:kv:x") is None  # its own keys it may read


def _redis_from_compose(services: dict, secrets: Path, workdir: Path) -> RedisServer:
    """redis-server as the compose `redis` service runs it: users from the `secrets` ACL file."""
    command = services["redis"]["command"]
    acl = command[command.index("--aclfile") + 1]
    assert acl.startswith(SECRETS_MOUNT + "/")
    password = (secrets / "redis-password").read_text()
    return RedisServer(workdir, user="llmesh", password=password, acl_file=secrets / Path(acl).name)


def _port_of(command: list[str]) -> str | None:
    return command[command.index("--port") + 1] if "--port" in command else None


def _loopback_commands(
    services: dict, redis_address: str, secrets: Path
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each service's command and environment with compose addresses rewritten to loopback ones,
    the secrets volume to the folder `secrets`, the models volume to a `models` folder beside it."""
    models = secrets.parent / "models"
    models.mkdir(exist_ok=True)
    addresses = {"redis:6379": redis_address}
    ports = {}
    for name in DEFAULT_PROFILE_ORDER:
        port = _port_of(services[name]["command"])
        if port is not None:
            ports[name] = str(free_port())
            addresses[f"{name}:{port}"] = f"127.0.0.1:{ports[name]}"

    def rewrite(word: str) -> str:
        for compose_address, loopback in addresses.items():
            word = word.replace(compose_address, loopback)
        if word == "0.0.0.0":
            return "127.0.0.1"
        return word.replace(SECRETS_MOUNT, str(secrets)).replace(f"{MODELS_MOUNT}/", f"{models}/")

    out = {}
    for name in DEFAULT_PROFILE_ORDER:
        command = [rewrite(w) for w in services[name]["command"]]
        if name in ports:
            command[command.index("--port") + 1] = ports[name]
        env = {
            k: rewrite(_interpolate(str(v), {})) for k, v in (services[name].get("environment") or {}).items()
        }
        out[name] = (command, env)
    return out


def _without_session_key(environ) -> dict[str, str]:
    """The test session's environment without its mesh secret (tests/conftest.py sets one)."""
    return {k: v for k, v in environ.items() if k != ENV_KEY}


def _assert_internal_rpcs_need_the_secret(plan: dict, key_file: Path) -> None:
    """Every internal RPC of the stack refuses a stranger, and answers the generated secret."""
    address = {
        name: target_of_command(plan[name][0], {**os.environ, **plan[name][1]}).address
        for name in ("scheduler", "worker", "kvstore")
    }
    hosts = {"llmesh.v1.Registry": "scheduler", "llmesh.v1.Worker": "worker", "llmesh.v1.KVStore": "kvstore"}
    internal = [
        (address[hosts[svc]], m) for svc, methods in proto_services().items() if svc in hosts for m in methods
    ]
    assert len(internal) >= 10, internal
    refused = {m.full_name: call_empty(a, m, PLAINTEXT) for a, m in internal}
    assert set(refused.values()) == {grpc.StatusCode.UNAUTHENTICATED}, refused
    key = ChannelSecurity(key=key_file.read_text().strip())
    answered = {m.full_name: call_empty(a, m, key) for a, m in internal}
    assert grpc.StatusCode.UNAUTHENTICATED not in answered.values(), answered


def _wait(what: str, ready, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if ready():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not healthy after {timeout} s")


@pytest.mark.timeout(240)
def test_the_compose_services_serve_a_request_with_their_own_flags(tmp_path) -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    make_secrets(services, secrets)
    redis_server = _redis_from_compose(services, secrets, tmp_path / "redis")
    plan = _loopback_commands(services, f"127.0.0.1:{redis_server.port}", secrets)
    # What the compose file pins beyond addresses stays as written (the checks above rewrote only those).
    assert plan["worker"][0][:1] == ["worker"] and "--kvstore-address" in plan["worker"][0]
    assert plan["kvstore"][1]["REDIS_URL"] == f"redis://llmesh@127.0.0.1:{redis_server.port}/0"
    assert all(plan[name][1]["LLMESH_INTERNAL_KEY_FILE"] == str(secrets / "internal-key") for name in plan)
    procs: dict[str, subprocess.Popen] = {}
    try:
        redis_server.start()
        for name in DEFAULT_PROFILE_ORDER:
            command, env = plan[name]
            for dependency, rule in (services[name].get("depends_on") or {}).items():
                if dependency in ("redis", "secrets"):
                    continue  # made and started above
                condition = rule["condition"]
                if condition == "service_completed_successfully":
                    assert procs[dependency].wait(timeout=300) == 0, f"{dependency} failed"
                elif condition == "service_healthy":
                    dep_command, dep_env = plan[dependency]
                    target = target_of_command(dep_command, {**os.environ, **dep_env})
                    _wait(dependency, lambda t=target: check(t, timeout_s=1.0), procs[dependency])
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - the child holds it
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "llmesh.cli", *command],
                env={**_without_session_key(os.environ), **env},  # the key comes from the secrets file
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        command, env = plan["gateway"]
        gateway = target_of_command(command, {**os.environ, **env})
        _wait("gateway", lambda: check(gateway, timeout_s=1.0), procs["gateway"])
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0)
        resp = client.chat.completions.create(
            model=None, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, temperature=0
        )
        assert resp.usage.completion_tokens >= 1 and resp.choices[0].message.content
        _assert_redis_is_locked(redis_server)
        _assert_internal_rpcs_need_the_secret(plan, secrets / "internal-key")
    except BaseException:
        for f in sorted(tmp_path.glob("*.log")):
            print(f"--- {f.name} ---\n{f.read_text(errors='replace')[-2000:]}")
        raise
    finally:
        for proc in reversed(list(procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        redis_server.stop()
