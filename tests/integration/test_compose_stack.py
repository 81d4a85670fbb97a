"""The compose stack, run without docker: every llmesh service of deploy/docker-compose.yml starts
as a real process with exactly the command and environment the compose file gives it; only the
addresses change (0.0.0.0 and compose host names -> loopback, fixed ports -> free ones; redis is
a real redis-server). Start order follows `depends_on` and its conditions, health is judged by
`llmesh health` as the image's HEALTHCHECK does (from the service's own command line), and one
request goes through the gateway with the official `openai` client.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml

from services.healthcheck import check, target_of_command
from services.launcher import free_port

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "docker-compose.yml"
DEFAULT_PROFILE_ORDER = ("convert", "kvstore", "scheduler", "worker", "gateway")


def _interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's `${VAR:-default}` / `${VAR}` substitution."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: environ.get(m[1]) or (m[2] or ""), value)


def _port_of(command: list[str]) -> str | None:
    return command[command.index("--port") + 1] if "--port" in command else None


def _loopback_commands(services: dict, redis_address: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each service's command and environment with compose addresses rewritten to loopback ones."""
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
        return "127.0.0.1" if word == "0.0.0.0" else word

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
def test_the_compose_services_serve_a_request_with_their_own_flags(redis_server, tmp_path) -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    plan = _loopback_commands(services, redis_server.url.split("//", 1)[1].rsplit("/", 1)[0])
    # What the compose file pins beyond addresses stays as written (the checks above rewrote only those).
    assert plan["worker"][0][:1] == ["worker"] and "--kvstore-address" in plan["worker"][0]
    assert plan["kvstore"][1]["REDIS_URL"] == redis_server.url
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in DEFAULT_PROFILE_ORDER:
            command, env = plan[name]
            for dependency, rule in (services[name].get("depends_on") or {}).items():
                if dependency == "redis":
                    continue  # the redis_server fixture is up
                condition = rule["condition"]
                if condition == "service_completed_successfully":
                    assert procs[dependency].wait(timeout=300) == 0, f"{dependency} failed"
                elif condition == "service_healthy":
                    dep_command, dep_env = plan[dependency]
                    target = target_of_command(dep_command, {**os.environ, **dep_env})
                    _wait(dependency, lambda t=target: check(t, timeout_s=1.0), procs[dependency])
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - the child holds it
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *command],
                env={**os.environ, **env},
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
