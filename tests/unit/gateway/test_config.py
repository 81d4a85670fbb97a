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
