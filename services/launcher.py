"""`llmesh up`: the whole local mesh as child processes on loopback, kept alive by a supervisor.

Starts the scheduler, N workers (each registering with the scheduler), the
gateway when it exists and the KV store (unless --no-kvstore), waits until each
answers grpc.health.v1 (or HTTP /health), prints where each listens, then supervises: a child that dies is
started again with the same arguments and port (a worker keeps its --worker-id,
so it re-registers as itself; the scheduler keeps its port, so the gateway and
the workers find it again), with exponential backoff. Ctrl-C / SIGTERM stops
everything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.config import load_config
from services.grpc_server import PLAINTEXT, ChannelSecurity, open_sync_channel
from services.mesh_secret import with_mesh_secret
from services.parent_watch import launcher_env
from services.ports import free_port
from services.tls import TLSConfig

log = logging.getLogger(__name__)

# The flags `start_mesh` gives each child itself (where it listens, its peers, the model): a
# launcher's user may not set them per service (`llmesh up` offers every other knob of each).
LAUNCHER_SETS = {
    "scheduler": ("host", "port", "model", "kvstore_address", "shard_id"),
    "worker": ("host", "port", "scheduler", "kvstore_address", "worker_id", "model"),
    "gateway": ("host", "port", "scheduler", "model"),
    "kvstore": ("host", "port"),
    "router": ("host", "port", "shards"),
}


@dataclass
class Child:
    name: str
    address: str
    proc: subprocess.Popen
    # How it was started, so that a supervisor can start it again identically (same port, same id).
    module: str = ""
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    log_dir: str | None = None
    started_at: float = field(default_factory=time.monotonic)  # of the current process
    security: ChannelSecurity | None = None  # how its health is probed (TLS when the mesh uses it)

    def respawn(self) -> None:
        self.proc = _spawn(self.module, self.args, self.env, self.log_dir, self.name)
        self.started_at = time.monotonic()

    def age(self) -> float:
        return time.monotonic() - self.started_at


@dataclass
class LocalMesh:
    """A running local mesh; `stop()` (or the context manager) ends every process."""

    scheduler: Child  # the gRPC front door: the scheduler, or with several shards the router
    workers: list[Child] = field(default_factory=list)
    gateway: Child | None = None
    kvstore: Child | None = None
    internal_key: str | None = None  # the mesh secret its internal RPCs need (None: mutual TLS)
    shards: list[Child] = field(default_factory=list)  # scheduler shards behind the router (N > 1)

    @property
    def security(self) -> ChannelSecurity:
        """How a client dials this mesh's internal services: its TLS settings and its secret."""
        return dataclasses.replace(self.scheduler.security or PLAINTEXT, key=self.internal_key)

    @property
    def children(self) -> list[Child]:
        # The KV store first, so that stop() (reversed) ends it last: the others may still write to it.
        return (
            ([self.kvstore] if self.kvstore else [])
            + [self.scheduler, *self.shards, *self.workers]
            + ([self.gateway] if self.gateway else [])
        )

    @property
    def kvstore_address(self) -> str | None:
        """host:port of the KV store (llmesh.v1.KVStore), None when the mesh runs without one."""
        return self.kvstore.address if self.kvstore else None

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def stop(self, timeout: float = 20.0) -> None:
        # Gateway first, scheduler last: each drains while what it depends on is still up.
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


def grpc_serving(
    address: str, service: str = "", timeout: float = 1.0, security: ChannelSecurity | None = None
) -> bool:
    try:
        with open_sync_channel(address, security) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def child_ready(child: Child, timeout: float = 1.0) -> bool:
    """Whether a child answers its readiness check: HTTP /health (gateway) or grpc.health.v1."""
    if child.name == "gateway":
        return http_ok(child.address, timeout)
    return grpc_serving(child.address, timeout=timeout, security=child.security)


def probe_security(env: dict[str, str]) -> ChannelSecurity:
    """How to probe services that read their TLS settings from `env` (LLMESH_TLS_*), as they do."""
    return ChannelSecurity.of(load_config(TLSConfig, [], env, prog="llmesh up"))


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


def _spawn(
    module: str, args: list[str], env: dict[str, str] | None, log_dir: str | None, name: str
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", module, *args]
    env = launcher_env(env)  # the child leaves if this process dies, even by SIGKILL
    if not log_dir:
        return subprocess.Popen(cmd, env=env)
    # The child holds its own copy of the log file; closing ours keeps restarts from leaking descriptors.
    with open(os.path.join(log_dir, f"{name}.log"), "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _start_child(
    name: str, address: str, module: str, args: list[str], env: dict[str, str], log_dir: str | None
) -> Child:
    proc = _spawn(module, args, env, log_dir, name)
    return Child(name, address, proc, module, args, env, log_dir, security=probe_security(env))


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
    kvstore: bool = False,
    kvstore_port: int = 0,
    kvstore_args: list[str] | None = None,
    log_dir: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
    num_schedulers: int = 1,
    router_args: list[str] | None = None,
    worker_roles: list[str] | None = None,
    per_worker_args: list[list[str]] | None = None,
    per_worker_env: list[dict[str, str]] | None = None,
) -> LocalMesh:
    """Start scheduler + workers (+ gateway when `gateway_port` is not None) and wait until ready.

    kvstore=True adds a KV store (memory tier unless `kvstore_args` say more); `llmesh up` does
    by default. Its address is `mesh.kvstore_address`, passed to the scheduler (which looks new
    prompts up there) and to every worker (which puts and loads chunks of KV there).

    Every port is explicit (a free one is picked for 0), so that a child restarted by
    `Supervisor` binds the same address and its peers find it again.

    num_schedulers > 1: a router (router_svc) takes `scheduler_port` and fronts that many
    scheduler shards (`mesh.shards`), worker i registering with shard i mod N; the gateway and
    gRPC clients dial the router as they would a scheduler. 1: no router (the usual topology).

    worker_roles: worker i's --role (disaggregated prefill/decode: "prefill", "decode"); None: none.
    per_worker_args: worker i's own flags after `worker_args`.
    per_worker_env: worker i's own environment on top of `env` (e.g. CUDA_VISIBLE_DEVICES=i: a
    worker steps on a thread of its own, whose current CUDA device is the first visible one).
    """
    # Secure by default: one fresh secret per mesh, in each child's environment (never argv).
    env, internal_key = with_mesh_secret({**os.environ, **(env or {})})
    model_args = ["--model", model] if model else []
    sched_addr = f"{host}:{scheduler_port or free_port(host)}"
    sched_port = sched_addr.rsplit(":", 1)[1]
    kv_port = (kvstore_port or free_port(host)) if kvstore else 0
    # The store may come up after its clients: they treat it as a miss until it answers.
    kv_args = ["--kvstore-address", f"{host}:{kv_port}"] if kvstore else []
    sched_args = ["--host", host, "--port", sched_port, *model_args, *kv_args, *(scheduler_args or [])]
    if num_schedulers > 1:
        mesh = _start_router_and_shards(
            num_schedulers, host, sched_addr, sched_args, router_args, env, log_dir
        )
    else:
        mesh = LocalMesh(
            _start_child("scheduler", sched_addr, "scheduler_svc.service", sched_args, env, log_dir)
        )
    mesh.internal_key = internal_key
    try:
        if kvstore:
            mesh.kvstore = _start_kvstore(host, kv_port, kvstore_args or [], env, log_dir)
        for i in range(num_workers):
            port = free_port(host)
            # A fixed --worker-id: a restarted worker re-registers as itself.
            shard = mesh.shards[i % len(mesh.shards)].address if mesh.shards else sched_addr
            args = ["--host", host, "--port", str(port), "--scheduler", shard, *kv_args]
            args += ["--worker-id", f"worker-{i}", *model_args, *(worker_args or [])]
            if worker_roles:
                args += ["--role", worker_roles[i]]
            if per_worker_args:
                args += per_worker_args[i]
            worker_env = {**env, **per_worker_env[i]} if per_worker_env else env
            mesh.workers.append(
                _start_child(f"worker-{i}", f"{host}:{port}", "worker_svc.service", args, worker_env, log_dir)
            )
        procs = [c.proc for c in mesh.children]
        if mesh.kvstore:
            wait_until(lambda: child_ready(mesh.kvstore), "kvstore", procs, timeout)
        for w in mesh.workers:
            wait_until(lambda w=w: child_ready(w), w.name, procs, timeout)
        for shard in mesh.shards[: num_workers or None]:  # a shard without a worker never serves
            wait_until(lambda shard=shard: child_ready(shard), shard.name, procs, timeout)
        wait_until(lambda: child_ready(mesh.scheduler), mesh.scheduler.name, procs, timeout)
        if gateway_port is not None:
            args = [*model_args, *(gateway_args or [])]
            if mesh.shards:  # the router picks a shard (ShardPicker.Route), the gateway streams from it
                args = ["--direct-to-shards", *args]
            mesh.gateway = _start_gateway(host, gateway_port, sched_addr, args, env, log_dir)
            wait_until(lambda: http_ok(mesh.gateway.address), "gateway", [mesh.gateway.proc], timeout)
    except BaseException:
        mesh.stop()
        raise
    return mesh


def _start_router_and_shards(
    n: int,
    host: str,
    router_addr: str,
    sched_args: list[str],
    router_args: list[str] | None,
    env: dict[str, str],
    log_dir: str | None,
) -> LocalMesh:
    """A router at `router_addr` and `n` scheduler shards on free ports, each with `sched_args`
    (its --host/--port replaced). The router is given the shards' addresses (they keep them over
    restarts); shards could register instead (--routers), as they do where addresses are not known
    in advance (docs/architecture.md)."""
    addresses = [f"{host}:{free_port(host)}" for _ in range(n)]
    shards = []
    for i, address in enumerate(addresses):
        args = [*sched_args, "--port", address.rsplit(":", 1)[1], "--shard-id", f"scheduler-{i}"]
        shards.append(_start_child(f"scheduler-{i}", address, "scheduler_svc.service", args, env, log_dir))
    return LocalMesh(start_router(router_addr, addresses, router_args, env, log_dir), shards=shards)


def start_router(
    address: str,
    shards: list[str],
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    log_dir: str | None = None,
) -> Child:
    """A router (router_svc) at `address` (host:port) in front of the scheduler shards at `shards`;
    not waited for (`child_ready`)."""
    host, port = address.rsplit(":", 1)
    argv = ["--host", host, "--port", port, "--shards", ",".join(shards), *(args or [])]
    return _start_child("router", address, "router_svc.service", argv, {**os.environ, **(env or {})}, log_dir)


def _start_kvstore(host: str, port: int, args: list[str], env: dict[str, str], log_dir: str | None) -> Child:
    """A KV store child on `port` (0 = a free one); `env` adds to this process's environment."""
    env = {**os.environ, **env}
    port = port or free_port(host)
    args = ["--host", host, "--port", str(port), *args]
    return _start_child("kvstore", f"{host}:{port}", "kvstore_svc.service", args, env, log_dir)


def _start_gateway(host, port, sched_addr, args, env, log_dir) -> Child:
    port = port or free_port(host)
    args = ["--host", host, "--port", str(port), "--scheduler", sched_addr, *args]
    return _start_child("gateway", f"{host}:{port}", "gateway.service", args, env, log_dir)


def http_ok(address: str, timeout: float = 1.0) -> bool:
    """Whether an HTTP service (the gateway) answers 200 on /health."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def gateway_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("gateway.service") is not None


# -- supervision -------------------------------------------------------------------


@dataclass(frozen=True)
class Backoff:
    """Delay before restart attempt n: initial * factor^(n-1), at most max_s.

    A child that stayed up reset_after_s counts as healthy: its next crash is attempt 1 again.
    """

    initial_s: float = 1.0
    factor: float = 2.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def delay(self, attempt: int) -> float:
        return min(self.initial_s * self.factor ** max(attempt - 1, 0), self.max_s)


@dataclass
class _Watch:
    """What the supervisor knows about one child."""

    child: Child
    started_at: float
    attempt: int = 0  # consecutive crashes without a reset_after_s stretch of uptime between them
    restarts: int = 0  # every restart attempt, for reporting
    restart_at: float | None = None  # set while dead and waiting out the backoff
    ready: bool = True  # False from a restart until the child answers its health check


class Supervisor:
    """Keeps every child of a `LocalMesh` running: a dead one is restarted, the others keep serving.

    `poll()` is one pass (tests drive it with a fake clock); `run()` loops in the foreground
    until `stop()`; `start()` / the context manager run it on a thread (and stop the mesh at exit).
    Never gives up on a crash-looping child: the backoff caps the restart rate instead.
    """

    def __init__(
        self,
        mesh: LocalMesh,
        backoff: Backoff | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        ready: Callable[[Child], bool] = lambda c: child_ready(c, timeout=0.5),
    ) -> None:
        self.mesh = mesh
        self.backoff = backoff or Backoff()
        self._clock = clock
        self._ready = ready
        now = clock()
        # Uptime counts from each process's start (in this supervisor's clock), not from ours.
        self._watches = {c.name: _Watch(c, now - c.age()) for c in mesh.children}
        # A plain flag, not a threading.Event: Event.set() from a signal handler can deadlock on the
        # lock its own thread's wait() holds at that moment.
        self._stopping = False
        self._thread: threading.Thread | None = None

    def restarts(self, name: str) -> int:
        return self._watches[name].restarts

    def poll(self) -> None:
        """Notice exits, restart children whose backoff is over, log restarted children once ready."""
        for w in self._watches.values():
            if self._stopping:
                return  # Ctrl-C reaches the children too: their exits now are no crashes
            now = self._clock()
            if w.restart_at is None and (code := w.child.proc.poll()) is not None:
                self._schedule_restart(w, code, now)
            if w.restart_at is not None and now >= w.restart_at:
                self._restart(w, now)
            elif not w.ready and w.restart_at is None and self._ready(w.child):
                w.ready = True
                self._log_ready(w, now)

    def _log_ready(self, w: _Watch, now: float) -> None:
        after = round(now - w.started_at, 1)
        log.info(
            "%s is serving again after %.1f s",
            w.child.name,
            after,
            extra={"child": w.child.name, "pid": w.child.proc.pid, "after_s": after},
        )

    def _schedule_restart(self, w: _Watch, code: int, now: float) -> None:
        uptime = now - w.started_at
        w.attempt = 1 if uptime >= self.backoff.reset_after_s else w.attempt + 1
        delay = self.backoff.delay(w.attempt)
        w.restart_at = now + delay
        log.warning(
            "%s exited with code %s after %.1f s; restart attempt %d in %.1f s",
            w.child.name,
            code,
            uptime,
            w.attempt,
            delay,
            extra={"child": w.child.name, "exit_code": code, "attempt": w.attempt, "delay_s": delay},
        )

    def _restart(self, w: _Watch, now: float) -> None:
        w.restart_at, w.started_at, w.ready = None, now, False
        w.restarts += 1
        try:
            w.child.respawn()
        except OSError as e:  # e.g. out of file descriptors: try again later, as for a crash
            log.error("%s could not be started: %s", w.child.name, e, extra={"child": w.child.name})
            w.attempt += 1
            w.restart_at = now + self.backoff.delay(w.attempt)
            return
        log.warning(
            "%s restarted (attempt %d, pid %d)",
            w.child.name,
            w.attempt,
            w.child.proc.pid,
            extra={"child": w.child.name, "attempt": w.attempt, "pid": w.child.proc.pid},
        )

    def run(self, interval: float = 0.25) -> None:
        while not self._stopping:
            time.sleep(interval)  # a signal interrupts it; its handler calls stop()
            self.poll()

    def stop(self) -> None:
        """Stop supervising (safe from a signal handler); the children keep running until `close()`."""
        self._stopping = True

    def start(self, interval: float = 0.25) -> Supervisor:
        self._thread = threading.Thread(target=self.run, args=(interval,), name="supervisor", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop supervising, then stop every child (no restart can race the shutdown)."""
        self.stop()
        if self._thread is not None:
            self._thread.join()
        self.mesh.stop()

    def __enter__(self) -> Supervisor:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _print_addresses(mesh: LocalMesh) -> None:
    print("llmesh is up:")
    for c in mesh.children:
        print(f"  {c.name:<10} {c.address}  (pid {c.proc.pid})")
    if mesh.gateway:
        print(f"OpenAI API: http://{mesh.gateway.address}/v1   (Ctrl-C stops everything)", flush=True)
    else:
        api = f"gRPC API: {mesh.scheduler.address} (llmesh.v1.Scheduler)"
        print(f"{api}   (Ctrl-C stops everything)", flush=True)


def run_up(
    num_workers: int,
    model: str | None,
    host: str,
    port: int,
    scheduler_port: int,
    worker_args: list[str],
    *,
    scheduler_args: list[str] | None = None,
    gateway_args: list[str] | None = None,
    kvstore: bool = True,
    kvstore_port: int = 0,
    kvstore_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    backoff: Backoff | None = None,
    num_schedulers: int = 1,
    router_args: list[str] | None = None,
    worker_roles: list[str] | None = None,
    per_worker_env: list[dict[str, str]] | None = None,
) -> int:
    """Foreground `llmesh up`: start, print addresses, supervise until Ctrl-C / SIGTERM, stop all."""
    from services.logging_setup import setup_logging

    setup_logging("launcher", "info", fmt="text")
    supervisor: Supervisor | None = None
    interrupted = False

    def on_signal(signum, frame):  # noqa: ARG001
        nonlocal interrupted
        if supervisor is not None:
            supervisor.stop()
        elif not interrupted:  # still starting: unwind start_mesh, which stops what it started
            interrupted = True  # once: a second Ctrl-C must not break that cleanup
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        mesh = start_mesh(
            num_workers,
            model=model,
            host=host,
            scheduler_port=scheduler_port,
            gateway_port=port if gateway_available() else None,
            worker_args=worker_args,
            scheduler_args=scheduler_args,
            gateway_args=gateway_args,
            kvstore=kvstore,
            kvstore_port=kvstore_port,
            kvstore_args=kvstore_args,
            env=env,
            num_schedulers=num_schedulers,
            router_args=router_args,
            worker_roles=worker_roles,
            per_worker_env=per_worker_env,
        )
    except KeyboardInterrupt:
        return 130
    supervisor = Supervisor(mesh, backoff)
    _print_addresses(mesh)
    try:
        supervisor.run()
    finally:
        print("stopping the mesh", file=sys.stderr, flush=True)
        mesh.stop()
    return 0
