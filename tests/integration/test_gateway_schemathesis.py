"""Property-based fuzzing of every operation in /openapi.json, valid and invalid inputs: never a 5xx.

Bounded: a couple of dozen examples per operation and mode, and generation
kept to a few tokens (the schema allows max_tokens up to the context length,
which on the CPU would take minutes per example).

One test per (operation, mode), driven through schemathesis' strategies and
hypothesis directly: schemathesis' own pytest plugin (`from_fixture`) does not
run under pytest 9, and the schema is only served once the session's mesh is up.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from gateway.app import create_app
from gateway.config import GatewayConfig

MAX_GEN_TOKENS = 3
MODEL = "SmolLM2-135M-Instruct"
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
EXAMPLES = {POSITIVE: 20, NEGATIVE: 20}
# The operations, read from the app itself (no server needed), so that new routes are fuzzed too;
# invalid inputs only where there is a body to get wrong (for the rest every input is valid).
CASES = [
    pytest.param(method.upper(), path, mode, id=f"{method.upper()} {path} {mode.value}")
    for path, item in create_app(GatewayConfig()).openapi()["paths"].items()
    for method, op in item.items()
    for mode in ((POSITIVE, NEGATIVE) if "requestBody" in op else (POSITIVE,))
]


@pytest.fixture(scope="session")
def gateway_openapi(gateway_url):
    return schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")


def _bound(case, mode) -> None:
    """Cap how much a generation example may generate; invalid values stay as they are."""
    body = case.body
    if not isinstance(body, dict):
        return
    if mode is POSITIVE and isinstance(body.get("model"), str):
        body["model"] = MODEL  # a random model name is a 404 before anything interesting happens
    if not case.path.startswith("/v1/"):
        return
    limited = False
    # The Responses API names its cap max_output_tokens (and ignores max_tokens).
    keys = ("max_output_tokens",) if case.path == "/v1/responses" else ("max_tokens", "max_completion_tokens")
    for key in keys:
        value = body.get(key)
        if type(value) is int and value > MAX_GEN_TOKENS:
            body[key] = MAX_GEN_TOKENS
        limited |= key in body
    if not limited:
        body[keys[0]] = MAX_GEN_TOKENS  # chat's default is "the rest of the context"
    if type(body.get("n")) is int and body["n"] > 2:
        body["n"] = 2


@pytest.mark.parametrize("method, path, mode", CASES)
def test_no_server_errors(gateway_openapi, method, path, mode):
    operation = gateway_openapi[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        derandomize=True,  # the same examples every run: a failure here is reproducible
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case) -> None:
        _bound(case, mode)
        response = case.call(timeout=120)
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}\n"
            f"body: {case.body!r}"
        )

    check()
