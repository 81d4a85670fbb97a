"""`llmesh gateway` / `python -m gateway.service`: the OpenAI-compatible API on uvicorn (uvloop)."""

from __future__ import annotations

import logging
import signal
import sys

from gateway.config import GatewayConfig
from services.config import load_config
from services.logging_setup import setup_logging

log = logging.getLogger(__name__)


def _loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # e.g. Windows: asyncio's loop works, just slower
        return "asyncio"
    return "uvloop"


def main(argv: list[str] | None = None) -> int:
    config = load_config(GatewayConfig, argv, service="gateway", prog="llmesh gateway")
    setup_logging("gateway", config.log_level, fmt=config.log_format)  # type: ignore[arg-type]

    import uvicorn

    from gateway.app import create_app

    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            loop=_loop(),
            log_config=None,  # our JSON logging, not uvicorn's formatters
            access_log=False,  # /metrics counts requests; per-request log lines cost throughput
            timeout_graceful_shutdown=30,
        )
    )
    print(f"llmesh gateway on http://{config.host}:{config.port} -> scheduler {config.scheduler}", flush=True)
    # uvicorn drains on SIGTERM/SIGINT, then restores the handlers it found and raises the
    # signal again; with the default handlers there the process would die of it (-15) after a
    # clean drain. No-op handlers make a drained gateway exit 0, like the gRPC services.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
