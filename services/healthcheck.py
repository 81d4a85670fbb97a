"""`llmesh health`: is a service serving? Exit 0 if so, 1 if not (Docker HEALTHCHECK, exec probes).

    llmesh health 127.0.0.1:50051            grpc.health.v1 Check (TLS per --tls-* / LLMESH_TLS_*)
    llmesh health 127.0.0.1:8000 --http      the gateway's GET /health
    llmesh health                            the service this container runs (PID 1's command line)

The last form lets one image carry one HEALTHCHECK for every service: it reads the service, its
--host/--port and --tls-* flags from PID 1's command line (environment fallbacks as the service
itself reads them), and checks that. A wildcard bind is checked on loopback.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.config import env_names, load_config, option
from services.grpc_server import ChannelSecurity, host_port
from services.launcher import grpc_serving, http_ok
from services.tls import TLSConfig

SERVICES = ("scheduler", "worker", "gateway", "kvstore", "router")
SERVICE_MODULES = {
    "scheduler_svc.service": "scheduler",
    "worker_svc.service": "worker",
    "gateway.service": "gateway",
    "kvstore_svc.service": "kvstore",
    "router_svc.service": "router",
}
DEFAULT_PORTS = {"gateway": 8000}  # the others default to 0 (any free port): a probe needs --port


@dataclass
class HealthCheckConfig(TLSConfig):
    """Checks one llmesh service once (`llmesh health --help`)."""

    http: bool = option(False, help="check HTTP GET /health (the gateway) instead of grpc.health.v1")
    service: str = option("", help="grpc.health.v1 service name to check (default: the whole server)")
    timeout_s: float = option(3.0, help="how long to wait for the answer")


@dataclass(frozen=True)
class Target:
    address: str
    http: bool
    tls: TLSConfig


def target_of_command(argv: Sequence[str], environ: Mapping[str, str]) -> Target:
    """Where the llmesh service started with `argv` listens, and its TLS settings.

    `argv` is a whole command line (`llmesh worker --port 50052 ...`, `python -m worker_svc.service
    ...`); flags it lacks come from `environ` as the service reads them, then the defaults.
    """
    words = list(argv)
    for i, word in enumerate(words):
        name = SERVICE_MODULES.get(word) or (word if word in SERVICES else None)
        if name is not None:
            service, rest = name, words[i + 1 :]
            break
    else:
        raise ValueError(f"no llmesh service in the command line {' '.join(words)!r}")
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--host")
    parser.add_argument("--port")
    known = vars(parser.parse_known_args(rest)[0])

    def setting(field: str, default: str) -> str:
        if known.get(field) is not None:
            return known[field]
        return next((environ[e] for e in env_names(field, service) if e in environ), default)

    host = setting("host", "127.0.0.1")
    port = int(setting("port", str(DEFAULT_PORTS.get(service, 0))))
    if port == 0:
        raise ValueError(f"llmesh {service} has no fixed --port to check")
    try:
        if ipaddress.ip_address(host.strip("[]")).is_unspecified:
            host = "127.0.0.1"
    except ValueError:
        pass  # a host name
    # The TLS flags as the service itself read them: its command line over its environment.
    tls_parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--tls-server-name"):
        tls_parser.add_argument(flag)
    tls_parser.add_argument("--tls-client-auth", action=argparse.BooleanOptionalAction)
    given = {k: v for k, v in vars(tls_parser.parse_known_args(rest)[0]).items() if v is not None}
    argv_tls = [f"--{k.replace('_', '-')}={v}" for k, v in given.items() if k != "tls_client_auth"]
    if "tls_client_auth" in given:
        argv_tls.append("--tls-client-auth" if given["tls_client_auth"] else "--no-tls-client-auth")
    tls = load_config(TLSConfig, argv_tls, environ, service=service, prog=f"llmesh {service}")
    return Target(host_port(host, port), service == "gateway", tls)


def check(target: Target, service: str = "", timeout_s: float = 3.0) -> bool:
    if target.http:
        return http_ok(target.address, timeout_s)
    return grpc_serving(target.address, service, timeout_s, ChannelSecurity.of(target.tls))


def _pid1_command() -> list[str]:
    with open("/proc/1/cmdline", "rb") as f:
        return [w.decode() for w in f.read().split(b"\0") if w]


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    address = argv.pop(0) if argv and not argv[0].startswith("-") else ""
    config = load_config(HealthCheckConfig, argv, environ, service="health", prog="llmesh health")
    try:
        target = (
            Target(address, config.http, config) if address else target_of_command(_pid1_command(), environ)
        )
    except (OSError, ValueError) as e:
        print(f"llmesh health: {e}", file=sys.stderr)
        return 2
    ok = check(target, config.service, config.timeout_s)
    print(f"{target.address}: {'serving' if ok else 'NOT serving'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
