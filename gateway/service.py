"""`llmesh gateway` / `python -m gateway.service`: the OpenAI-compatible API on uvicorn (uvloop).

With `--api-server-count N` (N > 1) this process becomes a supervisor of N gateway processes
that share the port (gateway/processes.py); each of them runs `serve` below.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys

from gateway.config import GatewayConfig
from services.config import load_config
from services.logging_setup import setup_logging
from services.parent_watch import watch_launcher

log = logging.getLogger(__name__)


def _loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # e.g. Windows: asyncio's loop works, just slower
        return "asyncio"
    return "uvloop"


def _http() -> str:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"  # HTTP parsing and chunk framing in C instead of h11's Python


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound with SO_REUSEPORT: the kernel spreads new connections over every process
    listening on the port, each with its own accept queue. Not listening yet: uvicorn listens
    once the app is ready, and until then the kernel hands this process no connection."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    return sock


def serve(config: GatewayConfig) -> int:
    import uvicorn

    from gateway.app import create_app

    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            loop=_loop(),
            http=_http(),
            log_config=None,  # our JSON logging, not uvicorn's formatters
            access_log=False,  # /metrics counts requests; per-request log lines cost throughput
            timeout_graceful_shutdown=30,
            timeout_keep_alive=config.http_keep_alive_s,
            backlog=config.http_backlog,
        )
    )
    app.state.uvicorn = server  # its should_exit ends a startup that waits to be ready (app.py)
    sockets = None
    if config.reuse_port:
        sockets = [reuse_port_socket(config.host, config.port)]
    else:
        where = f"http://{config.host}:{config.port}"
        print(f"llmesh gateway on {where} -> scheduler {config.scheduler}", flush=True)
    # uvicorn drains on SIGTERM/SIGINT, then restores the handlers it found and raises the
    # signal again; with the default handlers there the process would die of it (-15) after a
    # clean drain. No-op handlers make a drained gateway exit 0, like the gRPC services.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=sockets)
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    config = load_config(GatewayConfig, argv, service="gateway", prog="llmesh gateway")
    setup_logging("gateway", config.log_level, fmt=config.log_format)  # type: ignore[arg-type]
    # The launcher's (`llmesh up`'s) or, in a server process, the gateway supervisor's death
    # stops it; taken out of the environment before the server processes start.
    watch_launcher()
    if config.api_server_count > 1:
        from gateway.processes import run_processes

        return run_processes(config, argv)
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
