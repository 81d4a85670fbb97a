"""A full scheduler's refusal (RESOURCE_EXHAUSTED + retry-after) is HTTP 429 with Retry-After (issue 30)."""

from __future__ import annotations

import grpc

from tests.unit.gateway.conftest import REPLY, FakeScheduler

FULL = (grpc.StatusCode.RESOURCE_EXHAUSTED, "the scheduler is full: retry in 7 s", (("retry-after", "7"),))


async def test_a_full_scheduler_is_a_429_with_retry_after_and_is_counted(make_gateway, tokenizer):
    h = await make_gateway(FakeScheduler(reply=tokenizer.encode(REPLY), fail=FULL))
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/completions", {"prompt": "x", "stream": True}),  # refused before the 200 went out
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
    ):
        r = await h.client.post(path, json=body)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "7"
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        assert "full" in err["message"]
    metrics = (await h.client.get("/metrics")).text
    refused = [line for line in metrics.splitlines() if line.startswith("llmesh:num_requests_refused_total")]
    assert refused and refused[0].endswith(" 3.0"), refused
    assert 'finished_reason="abort"' not in metrics  # a refusal is not an aborted generation
