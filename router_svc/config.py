"""`llmesh router`'s configuration: one dataclass, flags and environment derived from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from router_svc.core import RouterConfigView
from services.config import check_bounds, option
from services.grpc_server import ServerConfig


@dataclass
class RouterConfig(ServerConfig):
    """The router in front of scheduler shards: where the shards are, how to pick one, where to listen."""

    shards: list[str] = option(
        default_factory=list,
        help="scheduler shard host:port addresses routed to from the start (more may join at runtime "
        "through llmesh.v1.ShardRegistry, or --shards-dns)",
    )
    shards_dns: str = option(
        "",
        help="host:port whose DNS records are the shards (a Kubernetes headless Service: every router "
        "replica sees every shard pod), re-resolved every --dns-refresh-s",
    )
    dns_refresh_s: float = option(5.0, gt=0, help="how often --shards-dns is resolved again")
    policy: Literal["index", "load", "round-robin"] = option(
        "index",
        help="index: prefix overlap from the shards' KV events minus load; load: load only; "
        "round-robin: across ready shards",
    )
    prefix_weight: float = option(
        2.0,
        ge=0,
        help="weight of a request's own uncached prefill tokens against the load ahead of it (above "
        "1: locality outlasts larger load differences; a miss also evicts what others had cached)",
    )
    running_cost_tokens: int = option(
        32, ge=0, help="queued prefill tokens one running request counts as, in a shard's load"
    )
    session_slack_tokens: int = option(
        8192,
        ge=0,
        help="a session (x-session-id metadata) stays on its shard unless that costs this many more "
        "tokens of work than the best shard",
    )
    max_sessions: int = option(100_000, ge=1, help="sessions remembered (least recently used forgotten)")
    session_ttl_s: float = option(600.0, gt=0, help="a session idle this long is routed afresh")
    shard_dead_after_s: float = option(
        30.0, gt=0, help="a registered shard unreachable this long is forgotten (it may register again)"
    )
    load_interval_ms: int = option(100, ge=10, help="how often idle shards report their load")
    reuse_port: bool = option(
        False,
        help="share --port with other router processes on this host (SO_REUSEPORT: the kernel spreads "
        "connections over them); each keeps its own index and load view, fed by the same shards",
    )
    api_key: str | None = option(
        None,
        secret=True,
        help="llmesh.v1.Scheduler callers must send `authorization: Bearer KEY` (the gateway's key; "
        "default $LLMESH_API_KEY); set it in the environment",
    )
    log_level: str = option("info", help="debug | info | warning | error")

    def __post_init__(self) -> None:
        ServerConfig.__post_init__(self)
        check_bounds(self)
        if self.api_key == "":
            self.api_key = None

    @property
    def view(self) -> RouterConfigView:
        return RouterConfigView(
            self.policy,
            self.running_cost_tokens,
            self.session_slack_tokens,
            self.max_sessions,
            self.session_ttl_s,
            prefix_weight=self.prefix_weight,
        )
