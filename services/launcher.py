"""`llmesh up`: the whole local mesh as child processes on loopback.

Starts the scheduler, N workers (each registering with the scheduler) and the
gateway when it exists, waits until each answers grpc.health.v1 (or HTTP
/health), prints where each listens, and stops them all on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    address: str
    proc: subprocess.Popen


@dataclass
class LocalMesh:
    """A running local mesh; `stop()` (or the context manager) ends every process."""

    scheduler: Child
    workers: list[Child] = field(default_factory=list)
    gateway: Child | None = None

    @property
    def children(self) -> list[Child]:
        return [self.scheduler, *self.workers] + ([self.gateway] if self.gateway else [])

    def stop(self, timeout: float = 20.0) -> None:
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(max(deadline - time.monotonic(), 0.1))
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()

    def __enter__(self) -> LocalMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def grpc_serving(address: str, service: str = "") -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1.0
            )
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def wait_until(check, what: str, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited early with code {p.returncode}")
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s")


def _spawn(module: str, args: list[str], env: dict[str, str], log_dir: str | None, name: str):
    out = open(os.path.join(log_dir, f"{name}.log"), "ab") if log_dir else None  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], env=env, stdout=out, stderr=subprocess.STDOUT if out else None
    )


def start_mesh(
    num_workers: int = 1,
    *,
    model: str | None = None,
    host: str = "127.0.0.1",
    scheduler_port: int = 0,
    gateway_port: int | None = None,
    worker_args: list[str] | None = None,
    scheduler_args: list[str] | None = None,
    gateway_args: list[str] | None = None,
    log_dir: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
) -> LocalMesh:
    """Start scheduler + workers (+ gateway when `gateway_port` is not None) and wait until ready."""
    env = {**os.environ, **(env or {})}
    model_args = ["--model", model] if model else []
    sched_addr = f"{host}:{scheduler_port or free_port(host)}"
    sched = Child(
        "scheduler",
        sched_addr,
        _spawn(
            "scheduler_svc.service",
            ["--host", host, "--port", sched_addr.rsplit(":", 1)[1], *model_args, *(scheduler_args or [])],
            env,
            log_dir,
            "scheduler",
        ),
    )
    mesh = LocalMesh(sched)
    try:
        for i in range(num_workers):
            port = free_port(host)
            args = [
                "--host",
                host,
                "--port",
                str(port),
                "--scheduler",
                sched_addr,
                "--worker-id",
                f"worker-{i}",
            ]
            proc = _spawn(
                "worker_svc.service", [*args, *model_args, *(worker_args or [])], env, log_dir, f"worker-{i}"
            )
            mesh.workers.append(Child(f"worker-{i}", f"{host}:{port}", proc))
        procs = [c.proc for c in mesh.children]
        for w in mesh.workers:
            wait_until(lambda a=w.address: grpc_serving(a), w.name, procs, timeout)
        wait_until(lambda: grpc_serving(sched_addr), "scheduler", procs, timeout)
        if gateway_port is not None:
            args = [*model_args, *(gateway_args or [])]
            mesh.gateway = _start_gateway(host, gateway_port, sched_addr, args, env, log_dir)
            wait_until(lambda: _http_ok(mesh.gateway.address), "gateway", [mesh.gateway.proc], timeout)
    except BaseException:
        mesh.stop()
        raise
    return mesh


def _start_gateway(host, port, sched_addr, args, env, log_dir) -> Child:
    port = port or free_port(host)
    proc = _spawn(
        "gateway.service",
        ["--host", host, "--port", str(port), "--scheduler", sched_addr, *args],
        env,
        log_dir,
        "gateway",
    )
    return Child("gateway", f"{host}:{port}", proc)


def _http_ok(address: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=1.0) as r:
            return r.status == 200
    except OSError:
        return False


def gateway_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("gateway.service") is not None


def run_up(
    num_workers: int, model: str | None, host: str, port: int, scheduler_port: int, worker_args: list[str]
) -> int:
    """Foreground `llmesh up`: start, print addresses, wait for Ctrl-C / SIGTERM, stop all."""
    stop = {"now": False}

    def on_signal(signum, frame):  # noqa: ARG001
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    gateway_port = port if gateway_available() else None
    mesh = start_mesh(
        num_workers,
        model=model,
        host=host,
        scheduler_port=scheduler_port,
        gateway_port=gateway_port,
        worker_args=worker_args,
    )
    with mesh:
        print("llmesh is up:")
        for c in mesh.children:
            print(f"  {c.name:<10} {c.address}  (pid {c.proc.pid})")
        if mesh.gateway:
            print(f"OpenAI API: http://{mesh.gateway.address}/v1   (Ctrl-C stops everything)", flush=True)
        else:
            print(
                f"gRPC API: {mesh.scheduler.address} (llmesh.v1.Scheduler)   (Ctrl-C stops everything)",
                flush=True,
            )
        while not stop["now"]:
            if any(c.proc.poll() is not None for c in mesh.children):
                print("a service exited; stopping the mesh", file=sys.stderr)
                break
            time.sleep(0.5)
    return 0
