"""The gRPC server bootstrap every llmesh service shares.

    server = GrpcServer([Service.of("llmesh.v1.Worker", add_WorkerServicer_to_server, servicer)], cfg)
    await server.start()              # bound, answering; health NOT_SERVING
    ...load the model...
    await server.set_serving()        # health SERVING
    await server.run_until_stopped()  # SIGTERM/SIGINT -> drain -> return (exit 0)

or, in one call, `await serve(services, cfg, on_started=load_then_set_serving)`.

What it gives every service:
- a grpc.aio server on 127.0.0.1 by default (ServerConfig.host), port 0 =
  ephemeral (the bound port is returned);
- message size limits and keepalive set deliberately (constants below);
- grpc.health.v1, NOT_SERVING for "" and every service until set_serving();
- server reflection for the services, health and reflection itself;
- graceful drain on SIGTERM/SIGINT or stop(): health goes NOT_SERVING, drain
  callbacks run (servicers end long-lived streams), new RPCs are refused,
  in-flight RPCs get up to `shutdown_grace_s` to finish and are cancelled
  after that; a second signal cancels them at once.

Deadlines: grpc.aio cancels a handler whose deadline passes (CancelledError
in the handler), so handlers need do nothing but let the cancellation through
and pass `context.time_remaining()` on to calls they make downstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # health: SERVICE_NAME, OVERALL_HEALTH

try:  # reflection is a debugging aid: a machine without grpcio-reflection still serves
    from grpc_reflection.v1alpha import reflection
except ImportError:  # pragma: no cover - depends on the install
    reflection = None

from services.auth import aio_key_interceptors, server_auth, sync_key_interceptor
from services.config import option
from services.mesh_secret import client_key, resolve_internal_key
from services.tls import TLSConfig, channel_credentials, server_credentials, server_name_options

log = logging.getLogger(__name__)

# Largest message either way. gRPC's default receive limit (4 MiB) is too small
# for us: a step plan that re-sends preempted sequences in full, a long text
# prompt, or a batch of KV blocks (a few MiB each for 8B-class models) exceed
# it. 64 MiB bounds the memory one message can pin while leaving headroom;
# anything bigger must be chunked by its protocol, not sent whole.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Keepalive. Step, Generate and health Watch streams live long and may sit idle
# for hours; HTTP/2 pings detect a peer that vanished (node loss, half-open TCP,
# a SIGSTOPped process) within keepalive + timeout instead of the OS's hours.
#
# The two sides must agree, or the server kills the connection: a server counts
# a ping that arrives sooner than its `grpc.http2.min_ping_interval_without_data_ms`
# (default 5 minutes!) after the last one as a strike, and after
# `grpc.http2.max_ping_strikes` (default 2) strikes answers GOAWAY
# ENHANCE_YOUR_CALM "too_many_pings" and drops every stream on the connection.
# That is what killed idle meshes after ~60 s (a 20 s client ping, 3 strikes)
# when the server option was misspelled. So: every llmesh server accepts pings
# as often as every MIN_CLIENT_PING_INTERVAL_MS, with or without calls, and no
# llmesh client pings more often than that (keepalive_s >= 1 is enforced).
#
# A ping that goes unanswered must also end the connection: since gRPC 1.5x
# that is `grpc.http2.ping_timeout_ms` (default one minute), which
# `grpc.keepalive_timeout_ms` alone no longer sets; both are set below, so a
# SIGSTOPped or partitioned peer is noticed within keepalive + timeout.
DEFAULT_KEEPALIVE_S = 20.0
KEEPALIVE_TIMEOUT_S = 10.0
MIN_CLIENT_PING_INTERVAL_MS = 1_000
DEFAULT_GRACE_S = 30.0
# Received calls that may wait for the server to take them, and for how long (see server_options).
MAX_PENDING_CALLS = 1 << 20
UNREQUESTED_CALL_WAIT_S = 24 * 3600


@dataclass
class ServerConfig(TLSConfig):
    """gRPC server settings; service configs subclass this to inherit the flags (TLS's too)."""

    host: str = option(
        "127.0.0.1", help="address to bind; 127.0.0.1 keeps it private, a wildcard address exposes it"
    )
    port: int = option(0, help="port to bind; 0 = any free port (the bound port is logged)")
    shutdown_grace_s: float = option(
        DEFAULT_GRACE_S, help="seconds in-flight RPCs get to finish after SIGTERM before they are cancelled"
    )
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, help="largest gRPC message sent or received, in bytes")
    max_concurrent_rpcs: int = option(0, help="RPCs served at once before RESOURCE_EXHAUSTED; 0 = no limit")
    keepalive_s: float = option(
        DEFAULT_KEEPALIVE_S, help="idle seconds between HTTP/2 pings on every connection (>= 1)"
    )
    internal_key: str | None = option(
        None,
        help="mesh secret: every RPC served (health, reflection and an open public API aside) needs "
        "`authorization: Bearer KEY`, and every channel opened sends it. Set it in the environment "
        "(LLMESH_INTERNAL_KEY) or --internal-key-file, never here (argv shows in `ps`). Default: "
        "none needed under mutual TLS, this user's local key on loopback, else refused "
        "(services/mesh_secret.py)",
    )
    internal_key_file: str = option("", help="file holding the mesh secret (a mounted Secret)")

    def __post_init__(self) -> None:
        TLSConfig.__post_init__(self)
        # Secure by default: a key is always resolved (or mTLS authenticates), never "open".
        self.internal_key = resolve_internal_key(
            self.internal_key, self.internal_key_file, host=self.host, mutual_tls=self.tls_client_auth
        )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be > 0, got {self.max_message_bytes}")
        if self.max_concurrent_rpcs < 0:
            raise ValueError(f"max_concurrent_rpcs must be >= 0, got {self.max_concurrent_rpcs}")
        if self.keepalive_s < MIN_CLIENT_PING_INTERVAL_MS / 1000:
            raise ValueError(f"keepalive_s must be >= 1, got {self.keepalive_s}")


@dataclass(frozen=True)
class Service:
    """One gRPC service to host: its full name (for health and reflection) and how to register it."""

    name: str  # e.g. "llmesh.v1.Scheduler"
    register: Callable[[grpc.aio.Server], None]

    @classmethod
    def of(cls, name: str, add_to_server: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> Service:
        """From a generated `add_XServicer_to_server` function and a servicer instance."""
        return cls(name, lambda server: add_to_server(servicer, server))


def host_port(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _keepalive_ms(keepalive_s: float) -> tuple[int, int]:
    """(ping interval, ping timeout) in ms; the timeout shrinks with short test keepalives."""
    interval = max(int(keepalive_s * 1000), MIN_CLIENT_PING_INTERVAL_MS)
    return interval, min(int(KEEPALIVE_TIMEOUT_S * 1000), interval)


def server_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    reuse_port: bool = False,
) -> list[tuple[str, int]]:
    """`reuse_port`: share the port with sibling processes (the scheduler's API processes)."""
    interval, timeout = _keepalive_ms(keepalive_s)
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # gRPC sets SO_REUSEPORT by default on Linux: a second server on a taken
        # port would then bind "successfully" and steal half the connections.
        ("grpc.so_reuseport", int(reuse_port)),
        # The server pings its clients too (a vanished gateway or scheduler frees its streams).
        ("grpc.keepalive_time_ms", interval),
        ("grpc.keepalive_timeout_ms", timeout),
        ("grpc.http2.ping_timeout_ms", timeout),
        ("grpc.keepalive_permit_without_calls", 1),
        # The ping policy (see the comment on the constants): clients may ping this often, idle or not.
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
        # Calls the transport has received wait until the asyncio server takes them, and grpc.aio
        # takes one per event-loop turn. gRPC cancels waiting calls past a backlog (randomly above
        # `max_pending_requests`, default 1,000, all above the hard limit, default 3,000) and past
        # an age (default 30 s): the client sees CANCELLED, and the handler never ran. That was the
        # quarter of requests cancelled at 2,048 streams (issue 30): 2,048 calls opened at once,
        # then a new one as each stream finished, outran a busy scheduler's long loop turns. They
        # wait instead: the caller's deadline bounds the wait, and overload is answered by the
        # service itself (the scheduler's admission control: RESOURCE_EXHAUSTED before it starts).
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
        ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_WAIT_S),
    ]


def channel_options(
    max_message_bytes: int = MAX_MESSAGE_BYTES, keepalive_s: float = DEFAULT_KEEPALIVE_S
) -> list[tuple[str, int]]:
    """Options for every llmesh client channel (scheduler -> worker, gateway/worker -> scheduler)."""
    interval, timeout = _keepalive_ms(keepalive_s)
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", interval),
        ("grpc.keepalive_timeout_ms", timeout),
        ("grpc.http2.ping_timeout_ms", timeout),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC backs off up to 120 s between reconnect attempts by default; a peer
        # that restarts should be found again within a couple of seconds.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


@dataclass(frozen=True)
class ChannelSecurity:
    """How a service's channels dial: TLS credentials (None = plaintext), extra options, a bearer key."""

    credentials: grpc.ChannelCredentials | None = None
    options: tuple[tuple[str, Any], ...] = ()
    key: str | None = None

    @classmethod
    def of(cls, tls: TLSConfig, key: str | None = None) -> ChannelSecurity:
        """From a service's TLS flags and the key its calls carry (its internal key, usually)."""
        return cls(channel_credentials(tls), tuple(server_name_options(tls)), key or None)


PLAINTEXT = ChannelSecurity()  # no TLS, no key: only for calls that must show what a stranger gets


def default_security() -> ChannelSecurity:
    """What a channel given no security carries: plaintext with the key this host's services use
    when told nothing (services/mesh_secret.py: the environment's, else this user's local key)."""
    return ChannelSecurity(key=client_key())


def open_channel(
    target: str,
    security: ChannelSecurity | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
) -> grpc.aio.Channel:
    """An asyncio channel with llmesh's options, TLS when configured and the key on every call."""
    security = default_security() if security is None else security
    options = [*channel_options(max_message_bytes, keepalive_s), *security.options]
    interceptors = aio_key_interceptors(security.key) or None
    if security.credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, security.credentials, options=options, interceptors=interceptors)


def open_sync_channel(
    target: str,
    security: ChannelSecurity | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
) -> grpc.Channel:
    """The blocking twin of `open_channel` (the worker's KV store client, health probes)."""
    security = default_security() if security is None else security
    options = [*channel_options(max_message_bytes, keepalive_s), *security.options]
    if security.credentials is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, security.credentials, options=options)
    interceptor = sync_key_interceptor(security.key)
    return grpc.intercept_channel(channel, interceptor) if interceptor else channel


AddToServer = Callable[[Any, Any], None]


class _HandlerRecorder:
    """Stands in for a server to capture what a generated `add_XServicer_to_server` registers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, handlers


def _strict_handler(h: Any) -> Any:
    """The same handler, taking raw bytes and parsing them itself (INVALID_ARGUMENT when they do not)."""
    parse = h.request_deserializer

    async def parse_or_abort(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return parse(raw)
        except Exception as e:  # protobuf's DecodeError, or whatever a custom deserializer raises
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request message does not parse: {e}")

    async def parse_each(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for raw in requests:
            yield await parse_or_abort(raw, context)

    field = ("stream_" if h.request_streaming else "unary_") + ("stream" if h.response_streaming else "unary")
    behaviour = getattr(h, field)

    async def request_of(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if h.request_streaming:
            return parse_each(request, context)
        return await parse_or_abort(request, context)

    # grpc.aio tells an async generator (responses yielded) from a coroutine (context.write) by its type.
    if inspect.isasyncgenfunction(behaviour):

        async def generator(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async for response in behaviour(await request_of(request, context), context):
                yield response

        return h._replace(request_deserializer=None, **{field: generator})

    async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(await request_of(request, context), context)

    return h._replace(request_deserializer=None, **{field: coroutine})


def strict_parsing(add_to_server: AddToServer) -> AddToServer:
    """A generated `add_XServicer_to_server` whose requests that do not parse get INVALID_ARGUMENT.

    Plain grpc.aio answers such a message (random bytes, another message type)
    with UNKNOWN "Unexpected DecodeError" and logs a traceback for each: a
    stranger could fill the logs. For grpc.aio servicers with async methods.
    """

    def add(servicer: Any, server: Any) -> None:
        recorder = _HandlerRecorder()
        add_to_server(servicer, recorder)
        handlers = {name: _strict_handler(h) for name, h in recorder.handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(recorder.service, handlers),))
        server.add_registered_method_handlers(recorder.service, handlers)

    return add


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for asyncio, whose Watch streams end when the server drains.

    Not grpc_health's aio servicer: its Watch never returns, so every watcher
    (a kubelet, the scheduler watching its workers) would hold a graceful stop
    for its whole grace period. Call set() from the event loop's thread.
    """

    def __init__(self) -> None:
        self._status: dict[str, health_pb2.HealthCheckResponse.ServingStatus] = {}
        self._changed = asyncio.Event()
        self._shutting_down = False
        self._watches = 0  # Watch streams open
        self._no_watch = asyncio.Event()  # set while none is open
        self._no_watch.set()

    def _notify(self) -> None:
        # Swap in a fresh event and fire the old one: every waiter wakes exactly once.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Set a service's status; ignored after enter_graceful_shutdown()."""
        if self._shutting_down:
            return
        self._status[service] = status
        self._notify()

    def status(self, service: str = "") -> health_pb2.HealthCheckResponse.ServingStatus | None:
        return self._status.get(service)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; Watch streams send it and end."""
        for service in self._status:
            self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING
        self._shutting_down = True
        self._notify()

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def watches_ended(self) -> None:
        """Return once no Watch stream is open (after enter_graceful_shutdown: each has sent
        NOT_SERVING and ended)."""
        await self._no_watch.wait()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        self._watches += 1
        self._no_watch.clear()
        try:
            last = None
            while True:
                # Take the event before reading the status, so that a change in
                # between still wakes us (no lost wake-ups; one thread, no locks).
                changed = self._changed
                status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                if status != last:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                if self._shutting_down:
                    return
                await changed.wait()
        finally:
            self._watches -= 1
            if self._watches == 0:
                self._no_watch.set()


DrainCallback = Callable[[], Awaitable[None] | None]


class GrpcServer:
    """A grpc.aio server with health, reflection, deliberate limits and graceful drain."""

    def __init__(
        self,
        services: Sequence[Service],
        config: ServerConfig | None = None,
        *,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        public_keys: Mapping[str, str | None] | None = None,
        reuse_port: bool = False,
    ) -> None:
        """`public_keys`: services of this server that also take a public API key (besides
        `config.internal_key`); a key that is None or empty leaves its service open.
        `reuse_port`: processes of one service share the port (SO_REUSEPORT)."""
        self.config = config if config is not None else ServerConfig()
        self.services = list(services)
        self.draining = asyncio.Event()  # set when a drain starts; servicers may wait on it
        self.port = 0
        self._drain_callbacks: list[DrainCallback] = []
        self._stop_requested = asyncio.Event()
        self._stopping: asyncio.Task[None] | None = None
        self._signal_count = 0
        auth = server_auth(self.config.internal_key, public_keys)
        # Authentication first: a refused call reaches no other interceptor and no handler.
        self._server = grpc.aio.server(
            interceptors=[*([auth] if auth else []), *interceptors],
            options=server_options(self.config.max_message_bytes, self.config.keepalive_s, reuse_port),
            maximum_concurrent_rpcs=self.config.max_concurrent_rpcs or None,
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        for svc in self.services:
            svc.register(self._server)
        names = [svc.name for svc in self.services]
        if reflection is not None:
            reflection.enable_server_reflection(
                [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server
            )
        else:
            log.warning("grpcio-reflection is not installed: server reflection is off")

    @property
    def server(self) -> grpc.aio.Server:
        return self._server

    @property
    def address(self) -> str:
        """`host:port` that clients dial (valid after start)."""
        return host_port(self.config.host, self.port)

    def _health_names(self) -> list[str]:
        return [health.OVERALL_HEALTH, *(svc.name for svc in self.services)]

    async def start(self) -> int:
        """Bind and start answering (health NOT_SERVING); return the bound port."""
        for name in self._health_names():
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = host_port(self.config.host, self.config.port)
        credentials = server_credentials(self.config)
        try:
            if credentials is None:
                port = self._server.add_insecure_port(address)
            else:
                port = self._server.add_secure_port(address, credentials)
        except RuntimeError as e:  # newer grpcio raises; older ones return 0
            raise OSError(f"cannot bind gRPC server to {address}: {e}") from e
        if port == 0:
            raise OSError(f"cannot bind gRPC server to {address}")
        self.port = port
        await self._server.start()
        log.info(
            "grpc server started",
            extra={
                "address": self.address,
                "services": [s.name for s in self.services],
                "tls": "mutual" if self.config.tls_client_auth else bool(credentials),
            },
        )
        return port

    async def set_serving(self, serving: bool = True) -> None:
        """Flip health of "" and every service (ignored once draining: it stays NOT_SERVING)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self._health_names():
            self.health.set(name, status)
        if not self.draining.is_set():
            log.info("health changed", extra={"serving": serving})

    def on_drain(self, callback: DrainCallback) -> None:
        """Run `callback` (sync or async) when a drain starts, before new RPCs are refused.

        For servicers with long-lived streams: end them (or stop admitting work)
        so that the drain need not wait out its grace period.
        """
        self._drain_callbacks.append(callback)

    def request_stop(self) -> None:
        """Ask run_until_stopped() to drain and return (call from the event loop's thread)."""
        self._stop_requested.set()

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, drain callbacks, refuse new RPCs, wait <= grace for in-flight ones.

        Idempotent; a second call with a smaller grace shortens the wait.
        """
        grace = self.config.shutdown_grace_s if grace is None else grace
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._drain(grace))
        elif not self._stopping.done():
            # grpc keeps the most restrictive grace of all stop() calls.
            await self._server.stop(grace)
        await asyncio.shield(self._stopping)

    async def _drain(self, grace: float) -> None:
        started = time.monotonic()
        log.info("draining", extra={"grace_s": grace})
        self.draining.set()
        self.health.enter_graceful_shutdown()
        # Each open Watch sends its NOT_SERVING and ends before the server stops: stopped first,
        # a stream could end before its last status went out (seen on a loaded 2-core machine).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.health.watches_ended(), timeout=min(1.0, grace))
        for callback in self._drain_callbacks:
            try:
                result = callback()
                if inspect.isawaitable(result):
                    # A hung callback must not hold the drain past its grace.
                    left = max(0.0, grace - (time.monotonic() - started))
                    await asyncio.wait_for(result, timeout=left)
            except Exception:  # a failing callback must not stop the drain
                log.exception("drain callback failed")
        await self._server.stop(max(0.0, grace - (time.monotonic() - started)))
        log.info("grpc server stopped", extra={"drain_s": round(time.monotonic() - started, 3)})

    def _on_signal(self, signum: int) -> None:
        self._signal_count += 1
        name = signal.Signals(signum).name
        if self._signal_count == 1:
            log.info("signal received, draining", extra={"signal": name})
            self.request_stop()
        else:
            log.warning("second signal, cancelling in-flight RPCs", extra={"signal": name})
            asyncio.ensure_future(self.stop(0))

    async def run_until_stopped(self, *, handle_signals: bool = True) -> None:
        """Wait for SIGTERM/SIGINT (or request_stop()), then drain and return."""
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        # Signal handlers can only be installed from the main thread.
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
                installed.append(sig)
        try:
            # Not server.wait_for_termination(): cancelling it cancels grpc's own
            # shutdown future, after which stop() never completes.
            await self._stop_requested.wait()
            await self.stop()
        finally:
            for sig in installed:
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(sig)


async def serve(
    services: Sequence[Service],
    config: ServerConfig | None = None,
    *,
    on_started: Callable[[GrpcServer], Awaitable[None]] | None = None,
    set_serving: bool = True,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    public_keys: Mapping[str, str | None] | None = None,
    reuse_port: bool = False,
) -> None:
    """Start a server, run `on_started` (load the model...), go SERVING, run until signalled, drain.

    Returns once drained, so that `main()` can return 0. With set_serving=False
    the service flips health itself (e.g. the scheduler once a worker registers).
    """
    server = GrpcServer(
        services, config, interceptors=interceptors, public_keys=public_keys, reuse_port=reuse_port
    )
    await server.start()
    try:
        if on_started is not None:
            await on_started(server)
        if set_serving:
            await server.set_serving(True)
        await server.run_until_stopped()
    finally:
        await server.stop()


def service_main(
    config_cls: type,
    run: Callable[[Any], Awaitable[None]],
    service: str,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """A gRPC service's `main`: config from flags/env (default os.environ), JSON logs, run until drained."""
    from services.config import load_config
    from services.logging_setup import setup_logging
    from services.parent_watch import watch_launcher

    config = load_config(config_cls, argv, environ, service=service, prog=f"llmesh {service}")
    setup_logging(service, config.log_level)
    watch_launcher()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(config))
    return 0
