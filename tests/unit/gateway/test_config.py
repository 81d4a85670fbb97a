"""GatewayConfig from flags and the environment."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfig
from services.config import load_config


def test_defaults_and_env():
    cfg = load_config(GatewayConfig, [], {}, service="gateway")
    assert (cfg.host, cfg.port, cfg.api_key, cfg.served_model_name) == ("127.0.0.1", 8000, None, [])
    cfg = load_config(
        GatewayConfig, [], {"LLMESH_API_KEY": "k", "LLMESH_GATEWAY_PORT": "9000"}, service="gateway"
    )
    assert cfg.api_key == "k" and cfg.port == 9000
    cfg = load_config(GatewayConfig, ["--served-model-name", "a,b", "--port", "0"], {}, service="gateway")
    assert cfg.served_model_name == ["a", "b"] and cfg.port == 0


def test_bad_values_exit():
    with pytest.raises(SystemExit):
        load_config(GatewayConfig, ["--max-n", "0"], {}, service="gateway")
    assert GatewayConfig(api_key="").api_key is None  # an empty key must not mean "auth with ''"


def test_shares_the_request_limits():
    from services.limits import RequestLimits

    assert issubclass(GatewayConfig, RequestLimits)
    cfg = load_config(
        GatewayConfig,
        ["--max-stop-token-ids", "5", "--max-seqs-per-request", "32", "--max-concurrent-prompts", "2"],
        {"LLMESH_GATEWAY_MAX_N": "4", "LLMESH_MAX_STOP_CHARS": "10"},
        service="gateway",
    )
    assert (cfg.max_stop_token_ids, cfg.max_seqs_per_request, cfg.max_concurrent_prompts) == (5, 32, 2)
    assert (cfg.max_n, cfg.max_stop_chars, cfg.max_logprobs, cfg.max_stop) == (4, 10, 20, 16)
    for flag in ("--max-stop-token-ids", "--max-seqs-per-request", "--max-concurrent-prompts", "--max-stop"):
        with pytest.raises(SystemExit):
            load_config(GatewayConfig, [flag, "0"], {}, service="gateway")
    with pytest.raises(SystemExit):
        load_config(GatewayConfig, ["--max-logprobs", "-1"], {}, service="gateway")


def test_processes_and_http_flags():
    import socket

    from gateway.processes import claim_port

    cfg = load_config(
        GatewayConfig,
        ["--api-server-count", "4", "--http-keep-alive-s", "30", "--http-backlog", "512"],
        {},
        service="gateway",
    )
    assert (cfg.api_server_count, cfg.reuse_port) == (4, False)
    assert (cfg.http_keep_alive_s, cfg.http_backlog) == (30, 512)
    assert GatewayConfig().http_keep_alive_s > 5  # longer than clients' pools keep idle connections
    for flag in ("--api-server-count", "--http-keep-alive-s", "--http-backlog"):
        with pytest.raises(SystemExit):
            load_config(GatewayConfig, [flag, "0"], {}, service="gateway")
    # The supervisor claims the port without SO_REUSEPORT: a taken one is refused, not shared.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            claim_port("127.0.0.1", taken.getsockname()[1])
    assert claim_port("127.0.0.1", 0) > 0


def test_api_keys_from_flags_env_and_a_file(tmp_path):
    remote = {"LLMESH_GATEWAY_SCHEDULER": "scheduler.example:50051"}
    cfg = load_config(GatewayConfig, [], {"LLMESH_GATEWAY_API_KEY": "k1, k2", **remote}, service="gateway")
    assert cfg.api_keys == ("k1", "k2") and cfg.scheduler_key == "k1, k2"  # as `llmesh up` hands both
    keys = tmp_path / "keys"
    keys.write_text("# one a line\nk2\nk3\n")
    cfg = load_config(
        GatewayConfig, ["--api-key-file", str(keys)], {"LLMESH_API_KEY": "k1,k2"}, service="gateway"
    )
    assert cfg.api_keys == ("k1", "k2", "k3")
    cfg = load_config(GatewayConfig, ["--api-key-file", str(keys)], remote, service="gateway")
    assert cfg.api_keys == ("k2", "k3") and cfg.scheduler_key is None  # clients' keys, not the mesh's
    assert GatewayConfig().api_keys == ()
    keys.write_text("# none\n\n")
    for argv, env in (
        (["--api-key-file", str(keys)], {}),  # no key in it would mean no auth at all
        (["--api-key-file", str(tmp_path / "missing")], {}),
        (["--api-key", ","], {}),
        (["--cache-salt-by-api-key"], {}),  # nothing to salt by
    ):
        with pytest.raises(SystemExit):
            load_config(GatewayConfig, argv, env, service="gateway")
    cfg = load_config(GatewayConfig, ["--cache-salt-by-api-key"], {"LLMESH_API_KEY": "k"}, service="gateway")
    assert cfg.cache_salt_by_api_key and not GatewayConfig().cache_salt_by_api_key


def test_the_scheduler_gets_the_mesh_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMESH_CACHE", str(tmp_path))
    monkeypatch.delenv("LLMESH_INTERNAL_KEY", raising=False)
    secret = tmp_path / "secret"
    secret.write_text("a-mounted-secret-of-the-mesh\n")
    cfg = GatewayConfig(api_key="k", internal_key_file=str(secret), scheduler="scheduler.example:50051")
    assert cfg.scheduler_key == "a-mounted-secret-of-the-mesh"
    assert (
        GatewayConfig(api_key="k", internal_key="explicit-internal-key").scheduler_key
        == "explicit-internal-key"
    )
    # On loopback, with nothing set: this user's local key, as every service started by hand uses.
    local = GatewayConfig(api_key="k").scheduler_key
    assert local and local != "k" and local == (tmp_path / "internal.key").read_text().strip()
