"""The built images, run as deploy/docker-compose.yml with podman-compose (`make test-images`).

Slow (several minutes on 2 cores) and it needs podman and the images (`make images`), so it runs
only when LLMESH_TEST_IMAGES=1 (what `make test-images` sets) and skips, saying why, everywhere
else (plain `make test`, CI). In order, against one stack of two CPU workers:
up with health-gated start (deploy/podman/compose.sh), a chat completion through the official
`openai` client, each container's resident memory (the Kubernetes requests come from it), a
worker container's main process SIGKILLed while streams run (every stream finishes; the restart
policy brings the container back and it turns healthy), and `down` leaving no container, volume
or network behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_SH = ROOT / "deploy" / "podman" / "compose.sh"
CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"
PROJECT = "llmesh"
WORKERS = 2

if os.environ.get("LLMESH_TEST_IMAGES") != "1":
    pytest.skip(
        "runs the built images for minutes: set LLMESH_TEST_IMAGES=1 "
        "(`make test-images` does, after `make images`)",
        allow_module_level=True,
    )
if shutil.which("podman") is None:
    pytest.skip(
        "podman is not installed (deploy/build-images.sh installs it with apt)", allow_module_level=True
    )

pytestmark = pytest.mark.slow


def _env(port: int) -> dict[str, str]:
    # No LLMESH_* of this session: the stack makes its own secrets.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMESH_")}
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    env["LLMESH_GATEWAY_PORT"] = str(port)
    return env


def _podman(*args: str, env: dict[str, str]) -> str:
    out = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _containers(service: str, env: dict[str, str]) -> list[str]:
    return _podman(
        "ps",
        "-a",
        "--format",
        "{{.Names}}",
        "--filter",
        f"label=com.docker.compose.project={PROJECT}",
        "--filter",
        f"label=com.docker.compose.service={service}",
        env=env,
    ).split()


def _compose(*args: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(COMPOSE_SH), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def stack():
    from services.launcher import free_port

    port = free_port()
    env = _env(port)
    for image in ("llmesh:cpu", "llmesh:light", "llmesh:gateway"):
        if subprocess.run(["podman", "image", "exists", image], env=env).returncode != 0:
            pytest.fail(f"{image} is not built: run `make images` first")
    _compose("down", env=env, timeout=300)  # a stack left by an interrupted run
    available, _ = _host_memory()
    print(f"\nhost MemAvailable before up: {available:.1f} GB (the stack takes ~4.5 GB)")
    started = time.monotonic()
    up = _compose("up", "--scale", f"worker={WORKERS}", env=env)
    assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
    print(f"\nup, health-gated, in {time.monotonic() - started:.0f} s")
    yield {"env": env, "port": port}
    _compose("down", env=env, timeout=300)


def _client(port: int):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat_completion_through_the_openai_client(stack) -> None:
    client = _client(stack["port"])
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0
    )
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def _rss_mb(container: str, env: dict[str, str]) -> float:
    """Resident memory of every process of a container, from /proc of the host."""
    total = 0
    for pid in _podman("top", container, "hpid", env=env).split()[1:]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            continue
        total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return total / 1024


def test_resident_memory_of_each_container(stack) -> None:
    rows = {}
    for service in ("redis", "kvstore", "scheduler", "worker", "gateway"):
        for name in _containers(service, stack["env"]):
            rows[name] = _rss_mb(name, stack["env"])
    print("\ncontainer RSS (MB): " + ", ".join(f"{k} {v:.0f}" for k, v in rows.items()))
    assert len(rows) == 4 + WORKERS and all(v > 0 for v in rows.values())


_progress = {"at": 0.0}  # when any stream last got a chunk (the stall watchdog reads it)


def _stream(client, model: str, prompt: str, results: list, index: int, started: threading.Event) -> None:
    try:
        text, finish = [], None
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},  # every stream runs its full length
        )
        for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
                started.set()
                _progress["at"] = time.monotonic()
        results[index] = ("".join(text), finish)
    except Exception as e:  # noqa: BLE001 - reported by the test below
        results[index] = e


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _print_logs(env: dict[str, str], tail: int = 40) -> None:
    for service in ("kvstore", "scheduler", "worker", "gateway"):
        for name in _containers(service, env):
            logs = subprocess.run(
                ["podman", "logs", "--tail", str(tail), name], env=env, capture_output=True, text=True
            )
            print(f"--- {name} ---\n{logs.stdout[-20000:]}{logs.stderr[-20000:]}")


def _dump_stacks(env: dict[str, str]) -> None:
    """Every Python thread's stack in the scheduler, gateway and worker containers, with py-spy from
    the host where it is installed ($PY_SPY or on PATH): what a stalled stack is doing."""
    py_spy = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if py_spy is None:
        print("(no py-spy on this host: no stacks)")
        return
    for service in ("scheduler", "gateway", "worker"):
        for name in _containers(service, env):
            for pid in _podman("top", name, "hpid", env=env).split()[1:]:
                out = subprocess.run(
                    [py_spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=60
                )
                print(f"--- py-spy {name} pid {pid} ---\n{out.stdout[-12000:]}{out.stderr[-2000:]}")


def _host_memory() -> tuple[float, float]:
    """(MemAvailable in GB, the share of the last 10 s some task stalled on memory, in %)."""
    meminfo = Path("/proc/meminfo").read_text()
    available = next(int(ln.split()[1]) for ln in meminfo.splitlines() if ln.startswith("MemAvailable:"))
    try:
        some = Path("/proc/pressure/memory").read_text().splitlines()[0]
        pressure = float(some.split("avg10=")[1].split()[0])
    except (OSError, IndexError, ValueError):
        pressure = 0.0
    return available / 1e6, pressure


def _oom_kills() -> str:
    out = subprocess.run(["dmesg", "-T"], capture_output=True, text=True)
    lines = out.stdout.splitlines()
    return "\n".join(line for line in lines if "Killed process" in line or "invoked oom" in line)


def _join_watching(threads: list[threading.Thread], env: dict[str, str], stall_s: float = 45) -> None:
    """Wait for the streams; if none of them moves for `stall_s`, print every container's log and
    every stack once, then keep waiting. The host's memory is watched meanwhile: the one stall seen
    (issue 33) came with the host out of memory (another process of 16 GB on the 24 GB VM without
    swap, OOM-killed while the restarted worker loaded), not from the stack."""
    deadline = time.monotonic() + 600
    reported = False
    oom_before = _oom_kills()
    low, high = _host_memory()
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(2)
        available, pressure = _host_memory()
        low, high = min(low, available), max(high, pressure)
        idle = time.monotonic() - _progress["at"]
        if idle > stall_s and not reported and any(t.is_alive() for t in threads):
            reported = True
            print(
                f"\n=== STALL: no stream moved for {idle:.0f} s; host MemAvailable {available:.1f} GB, "
                f"memory pressure {pressure:.0f} %; logs and stacks follow ==="
            )
            _print_logs(env, tail=400)
            _dump_stacks(env)
    for t in threads:
        t.join(timeout=1)
    print(f"host during the failover: MemAvailable down to {low:.1f} GB, memory pressure up to {high:.0f} %")
    new_kills = _oom_kills().removeprefix(oom_before).strip()
    if new_kills:
        print(f"the kernel OOM-killed meanwhile:\n{new_kills}")


STREAMS = 8
MAX_TOKENS = 400


def test_a_worker_killed_mid_stream_loses_no_stream_and_is_restarted(stack) -> None:
    env = stack["env"]
    client = _client(stack["port"])
    model = client.models.list().data[0].id
    workers = {
        name: int(_podman("inspect", "--format", "{{.State.Pid}}", name, env=env))
        for name in _containers("worker", env)
    }
    results: list = [None] * STREAMS
    started = [threading.Event() for _ in range(STREAMS)]
    threads = [
        threading.Thread(
            target=_stream, args=(client, model, f"Count from {i} to 500 in words.", results, i, started[i])
        )
        for i in range(STREAMS)
    ]
    for t in threads:
        t.start()
    assert all(e.wait(timeout=120) for e in started), "not every stream started"
    # The victim: the busiest worker (both carry streams; this one certainly does).
    before = {name: _cpu_ticks(pid) for name, pid in workers.items()}
    time.sleep(1)
    victim = max(workers, key=lambda name: _cpu_ticks(workers[name]) - before[name])
    restarts = int(_podman("inspect", "--format", "{{.RestartCount}}", victim, env=env))
    assert all(r is None for r in results), "a stream finished before the kill: make them longer"
    os.kill(workers[victim], signal.SIGKILL)  # its main process: a crash, not `podman kill`
    killed_at = time.monotonic()
    _progress["at"] = killed_at
    _join_watching(threads, env)
    print(f"\nkilled {victim}; every stream done {time.monotonic() - killed_at:.0f} s later")
    survivors = [name for name in workers if name != victim]
    print("RSS after the streams (MB): " + ", ".join(f"{n} {_rss_mb(n, env):.0f}" for n in survivors))
    failed = [r for r in results if not isinstance(r, tuple)]
    if failed:
        _print_logs(env)
    assert failed == [], failed
    assert all(text and finish == "length" for text, finish in results), results

    deadline = time.monotonic() + 120
    while int(_podman("inspect", "--format", "{{.RestartCount}}", victim, env=env)) == restarts:
        assert time.monotonic() < deadline, "the restart policy did not restart the worker"
        time.sleep(1)
    waited = _compose("wait", env=env)
    assert waited.returncode == 0, waited.stdout[-2000:] + waited.stderr[-2000:]
    print(f"{victim} restarted and healthy {time.monotonic() - killed_at:.0f} s after the kill")
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content


def test_down_leaves_no_container_volume_or_network(stack) -> None:
    down = _compose("down", env=stack["env"], timeout=300)
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    assert "nothing of llmesh left" in down.stdout
