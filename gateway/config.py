"""The gateway's one config object: where it listens, which scheduler it fronts, its limits."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from services.config import check_bounds, option
from services.grpc_server import DEFAULT_KEEPALIVE_S
from services.limits import RequestLimits
from services.tls import TLSConfig


@dataclass
class GatewayConfig(RequestLimits, TLSConfig):
    """The OpenAI-compatible HTTP gateway: a gRPC client of the scheduler.

    The per-request caps shared with the scheduler (max_n, max_logprobs, max_stop,
    max_stop_chars, max_stop_token_ids) come from `RequestLimits`; the ones below are
    the gateway's own (batched prompts, request bodies).
    """

    host: str = option("127.0.0.1", help="address to bind; a wildcard address exposes it beyond this machine")
    port: int = option(8000, help="HTTP port; 0 = any free port")
    api_server_count: int = option(
        1,
        ge=1,
        help="gateway processes serving the port (SO_REUSEPORT), each with its own channel to the "
        "scheduler; a parent process supervises them, forwards SIGTERM and exits 0 once they drained",
    )
    reuse_port: bool = option(
        False,
        help="bind with SO_REUSEPORT and take connections only once ready (set by --api-server-count "
        "for each of its processes)",
    )
    http_keep_alive_s: float = option(
        75.0,
        gt=0,
        help="seconds an idle HTTP keep-alive connection stays open; longer than clients' pools keep "
        "them (httpx 5 s) so that a client never sends on a connection the gateway is closing",
    )
    http_backlog: int = option(4096, ge=1, help="connections the listening socket queues before accept()")
    scheduler: str = option("127.0.0.1:50051", help="scheduler host:port (llmesh.v1.Scheduler)")
    direct_to_shards: bool = option(
        False,
        help="--scheduler is a router (llmesh router): ask it which shard runs each request "
        "(llmesh.v1.ShardPicker.Route, with the internal key) and stream from that shard directly, "
        "instead of through the router; the gateway must reach the shards at the addresses they "
        "registered with the router (a plain scheduler there: relayed as without the flag)",
    )
    keepalive_s: float = option(
        DEFAULT_KEEPALIVE_S, ge=1, help="idle seconds between HTTP/2 pings to the scheduler (>= 1)"
    )
    api_key: str | None = option(
        None,
        help="clients must send `Authorization: Bearer KEY` (all but /health); several keys comma-separated "
        "(one per tenant); sent as given to the scheduler (whose public API takes the same value) when no "
        "mesh key is found (prefer the environment or --api-key-file: argv is visible in ps)",
    )
    api_key_file: str | None = option(
        None,
        help="file of client keys, one a line (blank lines and # comments skipped), taken besides --api-key; "
        "keys never need to be on a command line",
    )
    cache_salt_by_api_key: bool = option(
        False,
        help="salt every request's prefix cache by the API key it presented (a sha256 of the key, combined "
        "with the request's own cache_salt): tenants with different keys never share or probe each "
        "other's cached prompts",
    )
    internal_key: str | None = option(
        None,
        help="the mesh's internal key, sent to the scheduler first (set LLMESH_INTERNAL_KEY, not this "
        "flag: argv shows in ps); default: --internal-key-file, else this user's local key when the "
        "scheduler is on loopback (services/mesh_secret.py), else the API key",
    )
    internal_key_file: str | None = option(
        None, help="file holding the mesh's internal key (a mounted Secret)"
    )
    served_model_name: list[str] = option(
        default_factory=list, help="model ids clients use, comma-separated (default: the scheduler's)"
    )
    model: str | None = option(
        None, help="model folder/.gguf for the tokenizer (default: what the scheduler serves)"
    )
    lora_modules: list[str] = option(
        default_factory=list,
        help="LoRA adapters served as models, name=path (PEFT folders on the workers' hosts), "
        "comma-separated; a request's `model` picks one (the workers need --enable-lora)",
    )
    allow_runtime_lora_updating: bool = option(
        False,
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; off as there: they "
        "let any API key holder name folders for the workers to read)",
    )
    cache_dir: str | None = option(None, help="converted-model cache (default $LLMESH_CACHE)")
    max_prompts: int = option(64, ge=1, help="most prompts in one batched /v1/completions request")
    max_seqs_per_request: int = option(256, ge=1, help="most sequences (prompts x n) in one request")
    max_concurrent_prompts: int = option(
        8, ge=1, help="prompts of one batched request in flight to the scheduler at once (the rest wait)"
    )
    tokenizer_threads: int = option(2, ge=1, help="threads that tokenize large prompts off the event loop")
    max_body_bytes: int = option(8 << 20, ge=1, help="largest request body, in bytes (413 beyond)")
    request_timeout_s: float = option(600.0, gt=0, help="deadline of one generation on the scheduler")
    health_timeout_s: float = option(2.0, gt=0, help="how long /health waits for the scheduler")
    log_level: str = option("info", help="debug | info | warning | error")
    log_format: str = option("json", help="json | text")
    responses_store_size: int = option(
        4096, ge=1, help="most stored responses (Responses API, store=true) kept in memory; oldest go first"
    )
    responses_ttl_s: float = option(
        86400.0, gt=0, help="seconds a stored response (Responses API) is kept, in memory or in Redis"
    )
    responses_redis_url: str | None = option(
        None,
        secret=True,
        help="keep stored responses (Responses API) in this Redis (redis:// or rediss://, the mesh's "
        "KV-store Redis will do), shared by every gateway process and replica; default: in memory",
    )

    def __post_init__(self) -> None:
        RequestLimits.__post_init__(self)
        TLSConfig.__post_init__(self)  # --tls-*: how the gateway dials the scheduler (it serves plain HTTP)
        check_bounds(self)  # the `option(ge=, gt=)` of each field
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.log_format not in ("json", "text"):
            raise ValueError(f"log_format must be json or text, got {self.log_format!r}")
        if self.api_key == "":
            self.api_key = None  # an empty key would let every request in by accident of comparison
        if self.internal_key == "":
            self.internal_key = None
        if self.api_key is not None and not split_keys(self.api_key):
            raise ValueError("api_key holds no key (only commas and spaces)")
        keys = self.api_keys  # reads the key file now: a bad one stops startup, not the first request
        if self.cache_salt_by_api_key and not keys:
            raise ValueError("cache_salt_by_api_key needs API keys (--api-key or --api-key-file)")

    @functools.cached_property
    def api_keys(self) -> tuple[str, ...]:
        """Every key a client may present: --api-key's, then the key file's (read once, here)."""
        keys = split_keys(self.api_key) if self.api_key else []
        if self.api_key_file is not None:
            keys += read_api_key_file(self.api_key_file)
        return tuple(dict.fromkeys(keys))

    @property
    def scheduler_key(self) -> str | None:
        """The key the gateway's calls to the scheduler carry.

        The mesh's internal key when there is one, found as every llmesh client finds it: the
        scheduler's public API takes it as well as the API key, and its Registry (GetStats, behind
        /metrics) takes only it. Else --api-key as given (`llmesh up` hands the scheduler the same
        value); a key file's keys are only clients'.
        """
        from services.mesh_secret import MissingSecret, resolve_internal_key  # every service's rules

        try:
            # environ={}: this config has read the environment already, as for every other field.
            key = resolve_internal_key(
                self.internal_key,
                self.internal_key_file,
                host=self.scheduler.rsplit(":", 1)[0],
                mutual_tls=self.tls_client_auth,
                environ={},
            )
        except MissingSecret:  # a remote scheduler and no secret: the gateway is only a client
            key = None
        return key or self.api_key


def split_keys(text: str) -> list[str]:
    """`k1, k2` -> [k1, k2]: several tenants' keys in one flag or variable."""
    return [k.strip() for k in text.split(",") if k.strip()]


def read_api_key_file(path: str) -> list[str]:
    """Keys of a key file, one a line; a file with none is an error (it would silently mean no auth)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"api_key_file {path!r} cannot be read: {e}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"api_key_file {path!r} holds no key")
    return keys
