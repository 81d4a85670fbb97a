"""Tenants of one gateway: several API keys, `cache_salt` checked and passed to the scheduler, salts
derived from the presented key (`--cache-salt-by-api-key`), and readiness that means serving."""

from __future__ import annotations

import hashlib
import json

import pytest

from gateway.cache_salt import effective_salt, tenant_salt
from tests.unit.gateway.conftest import FakeScheduler

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


def body(path: str, **extra) -> dict:
    base = {"prompt": "Hello"} if path == COMP else {"messages": MSGS}
    return {**base, "max_tokens": 1, **extra}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("path", [COMP, CHAT])
@pytest.mark.parametrize(
    "salt, why",
    [
        ("", "non-empty"),
        ("x" * 257, "at most 256 bytes"),
        ("é" * 129, "got 258"),  # bytes of UTF-8, not characters
        (5, "string"),
        ("\ud800", "Unicode"),  # a lone surrogate, as JSON may spell it
    ],
)
async def test_a_bad_cache_salt_is_a_400_naming_it(make_gateway, path, salt, why):
    h = await make_gateway(FakeScheduler(reply=[1]))
    raw = json.dumps(body(path, cache_salt=salt))  # ASCII JSON: "\ud800" stays an escape
    r = await h.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == "cache_salt" and err["type"] == "invalid_request_error", err
    assert why in err["message"], err
    assert h.fake.requests == []


@pytest.mark.parametrize("path", [COMP, CHAT])
async def test_cache_salt_reaches_the_scheduler_on_every_call(make_gateway, path):
    h = await make_gateway(FakeScheduler(reply=[1]))
    longest = "é" * 128  # 256 bytes: the most allowed
    for salt in ("tenant-a", longest):
        r = await h.client.post(path, json=body(path, cache_salt=salt, n=2, stream=True))
        assert r.status_code == 200, r.text
        assert [q.cache_salt for q in h.fake.requests] == [salt, salt]  # each choice's own call
        h.fake.requests.clear()
    assert (await h.client.post(path, json=body(path))).status_code == 200
    assert [q.cache_salt for q in h.fake.requests] == [""]  # none given: unsalted, shared as before


async def test_every_prompt_of_a_batch_carries_the_salt(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1]))
    r = await h.client.post(COMP, json={"prompt": ["a", "b", "c"], "max_tokens": 1, "cache_salt": "s"})
    assert r.status_code == 200 and [q.cache_salt for q in h.fake.requests] == ["s"] * 3


async def test_several_api_keys(make_gateway, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nk3\n\n  k4  \n")
    h = await make_gateway(FakeScheduler(reply=[1]), api_key="k1, k2", api_key_file=str(keys))
    for key in ("k1", "k2", "k3", "k4"):
        assert (await h.client.get("/v1/models", headers=bearer(key))).status_code == 200, key
    for wrong in ("k1, k2", "k1,k2", "k5", "", "# tenants"):
        assert (await h.client.get("/v1/models", headers=bearer(wrong))).status_code == 401, wrong
    assert (await h.client.get("/health")).status_code == 200
    # The client's salt goes through unchanged unless salting by key is asked for.
    r = await h.client.post(COMP, json=body(COMP, cache_salt="mine"), headers=bearer("k3"))
    assert r.status_code == 200 and h.fake.requests[-1].cache_salt == "mine"


async def test_salt_by_api_key_keeps_tenants_apart(make_gateway):
    h = await make_gateway(FakeScheduler(reply=[1]), api_key="alpha,beta", cache_salt_by_api_key=True)

    async def salt_of(key: str, **extra) -> str:
        r = await h.client.post(COMP, json=body(COMP, **extra), headers=bearer(key))
        assert r.status_code == 200, r.text
        return h.fake.requests[-1].cache_salt

    a, b = await salt_of("alpha"), await salt_of("beta")
    assert a != b and a == await salt_of("alpha")  # apart from each other, stable for one tenant
    assert a == tenant_salt("alpha") and len(a) == 64 and "alpha" not in a
    assert a != hashlib.sha256(b"alpha").hexdigest()  # domain-separated: not a bare hash of the key
    a_salted = await salt_of("alpha", cache_salt="x")
    assert a_salted not in (a, "x") and a_salted == effective_salt("x", "alpha")
    assert a_salted != await salt_of("beta", cache_salt="x")  # the same salt from another tenant
    assert await salt_of("beta", cache_salt=a) != a  # nor can one tenant send another's salt
    r = await h.client.post(CHAT, json=body(CHAT, cache_salt="x" * 256), headers=bearer("beta"))
    assert r.status_code == 200 and len(h.fake.requests[-1].cache_salt) == 64  # under the cap


def test_effective_salt():
    assert effective_salt(None, None) == "" and effective_salt("s", None) == "s"
    assert effective_salt(None, "k") == effective_salt("", "k") == tenant_salt("k")
    assert effective_salt("s", "k") != effective_salt("s", "k2")
    assert effective_salt("s\nt", "k") != effective_salt("s", "k\nt")


async def test_health_waits_for_the_scheduler_to_serve(make_gateway):
    # A restarted scheduler reports its re-registered worker while its tokenizer still loads
    # (Generate answers 503 meanwhile): only its health says whether a request would be served.
    h = await make_gateway(FakeScheduler(reply=[1]))
    assert (await h.client.get("/health")).status_code == 200
    h.fake.set_serving(False)
    r = await h.client.get("/health")
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "service_unavailable" and "not serving" in err["message"]
    h.fake.set_serving(True)
    assert (await h.client.get("/health")).status_code == 200
