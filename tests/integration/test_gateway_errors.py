"""Every way a request can be wrong gets OpenAI's error shape and the right status, never a 500;
API keys; a scheduler that goes away and comes back."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from services.grpc_server import open_sync_channel
from services.launcher import free_port
from tests.integration.test_mesh import stats, wait_blocks_free

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def assert_error(r: httpx.Response, status: int, param: str | None = "", code: str | None = None) -> dict:
    """OpenAI's shape: {"error": {"message", "type", "param", "code"}}; param "" = not checked."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "":
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---------------------------------------------------------------------------- the body itself


@pytest.mark.parametrize(
    "content, ctype, status",
    [
        (b'{"messages": [', "application/json", 400),  # malformed JSON
        (b"\xff\xfe{", "application/json", 400),  # not even text
        (b"[1, 2]", "application/json", 400),  # not an object
        (b'"hello"', "application/json", 400),
        (b"null", "application/json", 400),
        (b"", "application/json", 400),  # no body at all
        (json.dumps({"messages": MSGS}).encode(), "text/plain", 415),  # wrong content type
        (json.dumps({"messages": MSGS}).encode(), "application/x-www-form-urlencoded", 415),
    ],
)
def test_bad_bodies(gateway_http, content, ctype, status):
    for path in (CHAT, COMP):
        assert_error(gateway_http.post(path, content=content, headers={"content-type": ctype}), status)


def test_body_over_the_size_limit(gateway_http):
    big = {"prompt": "x " * (600 << 10)}  # ~1.2 MB > the fixture's 1 MiB cap
    assert_error(gateway_http.post(COMP, json=big), 413, code="request_too_large")
    # chunked (no Content-Length): the limit still holds while reading
    chunks = (json.dumps(big).encode()[i : i + 65536] for i in range(0, 1300 << 10, 65536))
    r = gateway_http.post(COMP, content=chunks, headers={"content-type": "application/json"})
    assert_error(r, 413)


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": [{"content": "no role"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        (COMP, {}, "prompt"),
        (COMP, {"prompt": ""}, "prompt"),
        (COMP, {"prompt": []}, "prompt"),
        (COMP, {"prompt": [[]]}, "prompt"),
        (COMP, {"prompt": ["ok", ""]}, "prompt[1]"),
        (COMP, {"prompt": "\ud800"}, "prompt"),
    ],
)
def test_missing_or_empty_inputs(gateway_http, path, body, param):
    raw = json.dumps(body).encode()  # ASCII JSON: "\\ud800" travels as an escape, as clients may send it
    r = gateway_http.post(path, content=raw, headers={"content-type": "application/json"})
    err = assert_error(r, 400)
    assert err["param"] is not None and err["param"].startswith(param), err


def test_unknown_model(gateway_http, openai_client):
    import openai

    for path, body in ((CHAT, {"messages": MSGS}), (COMP, {"prompt": "x"})):
        assert_error(
            gateway_http.post(path, json={**body, "model": "gpt-9"}), 404, "model", "model_not_found"
        )
    assert_error(gateway_http.get("/v1/models/gpt-9"), 404, "model")
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="gpt-9", messages=MSGS)


def test_context_length(gateway_http):
    err = assert_error(gateway_http.post(COMP, json={"prompt": "hi", "max_tokens": 8192}), 400, "max_tokens")
    assert "8192" in err["message"] and err["code"] == "context_length_exceeded"
    err = assert_error(
        gateway_http.post(CHAT, json={"messages": MSGS, "max_completion_tokens": 9000}),
        400,
        "max_completion_tokens",
    )
    assert_error(gateway_http.post(CHAT, json={"messages": MSGS, "max_tokens": 9000}), 400, "max_tokens")
    assert_error(gateway_http.post(COMP, json={"prompt": [100] * 8192, "max_tokens": 1}), 400, "prompt")


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("seed", 2**64),
        ("max_tokens", 0),
        ("n", 0),
        ("temperature", "hot"),
        ("n", 1.5),
        ("stop", 5),
        ("stop", [""]),
        ("logit_bias", {"50": 10}),
        ("min_tokens", 100),  # > max_tokens
    ],
)
def test_out_of_range_sampling_values(gateway_http, field, value):
    for path, body in ((CHAT, {"messages": MSGS, "max_tokens": 4}), (COMP, {"prompt": "x", "max_tokens": 4})):
        assert_error(gateway_http.post(path, json={**body, field: value}), 400, field)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
def test_non_finite_values(gateway_http, field, literal):
    raw = f'{{"prompt": "x", "max_tokens": 2, "{field}": {literal}}}'.encode()  # Python's json reads these
    assert_error(
        gateway_http.post(COMP, content=raw, headers={"content-type": "application/json"}), 400, field
    )


def test_caps(gateway_http):
    assert_error(gateway_http.post(CHAT, json={"messages": MSGS, "n": 17}), 400, "n")
    assert_error(gateway_http.post(COMP, json={"prompt": "x", "logprobs": 21}), 400, "logprobs")
    assert_error(
        gateway_http.post(CHAT, json={"messages": MSGS, "logprobs": True, "top_logprobs": 21}),
        400,
        "top_logprobs",
    )
    assert_error(gateway_http.post(CHAT, json={"messages": MSGS, "top_logprobs": 2}), 400, "top_logprobs")
    stops = [f"s{i}" for i in range(17)]
    assert_error(gateway_http.post(COMP, json={"prompt": "x", "stop": stops}), 400, "stop")
    assert_error(gateway_http.post(COMP, json={"prompt": "x", "stop": ["y" * 300]}), 400, "stop")
    assert_error(gateway_http.post(COMP, json={"prompt": ["x"] * 65}), 400, "prompt")


def test_token_ids_outside_the_vocabulary(gateway_http):
    assert_error(gateway_http.post(COMP, json={"prompt": [1, 49152]}), 400, "prompt")
    assert_error(gateway_http.post(COMP, json={"prompt": [-1]}), 400, "prompt")
    assert_error(gateway_http.post(COMP, json={"prompt": [[5], [10**12]]}), 400, "prompt[1]")
    assert_error(
        gateway_http.post(COMP, json={"prompt": "x", "stop_token_ids": [10**6]}), 400, "stop_token_ids"
    )
    assert_error(gateway_http.post("/detokenize", json={"tokens": [99999999]}), 400, "tokens")


def test_unsupported_features_are_400(gateway_http):
    assert_error(gateway_http.post(COMP, json={"prompt": "x", "suffix": "y"}), 400, "suffix")
    # echo with logprobs is supported now (tests/integration/test_prompt_logprobs.py); without echo
    # there is nothing to return for max_tokens 0.
    assert_error(gateway_http.post(COMP, json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    # A tool without its function is malformed (tools themselves are supported: test_structured.py).
    err = assert_error(gateway_http.post(CHAT, json={"messages": MSGS, "tools": [{"type": "function"}]}), 400)
    assert err["param"].startswith("tools"), err
    body = {"messages": MSGS, "response_format": {"type": "json_schema"}}
    assert_error(gateway_http.post(CHAT, json=body), 400, "response_format")


def test_routes_and_methods(gateway_http):
    assert_error(gateway_http.get("/v1/nothing-here"), 404)
    assert_error(gateway_http.get(CHAT), 405)
    assert_error(gateway_http.post("/tokenize", json={}), 400)


# ---------------------------------------------------------------------------- the n fan-out

INT64_MAX = 2**63 - 1


def _scheduler_generate(address: str, **sampling) -> list[g.GenerateResponse]:
    req = g.GenerateRequest(
        prompt_token_ids=g.TokenIds(ids=[504, 3458, 282, 4649, 314]),
        sampling_params=g.SamplingParams(**sampling),
    )
    with open_sync_channel(address) as channel:
        return list(gg.SchedulerStub(channel).Generate(req, timeout=120))


def test_fanout_with_the_largest_seed_runs_every_choice(gateway_mesh, gateway_http):
    """The verified bug: a gRPC Generate with n=2, seed=2**63-1 failed with UNKNOWN after choice 0
    was submitted, and choice 0 ran on unaborted. Seeds wrap into int64 at every front door."""
    addr = gateway_mesh.scheduler.address
    sampling = dict(n=2, seed=INT64_MAX, temperature=1.0, max_tokens=4, ignore_eos=True)
    resps = _scheduler_generate(addr, **sampling)
    per_choice = {i: sum(len(r.token_ids) for r in resps if r.index == i) for i in (0, 1)}
    assert per_choice == {0: 4, 1: 4}
    assert resps[-1].usage.completion_tokens == 8
    r = gateway_http.post(COMP, json={"prompt": [504, 3458, 282], **sampling})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert r.json()["usage"]["completion_tokens"] == 8
    wait_blocks_free(addr)


def test_invalid_fanout_is_refused_before_anything_runs(gateway_mesh):
    addr = gateway_mesh.scheduler.address
    for sampling in (dict(n=17), dict(n=2, max_tokens=10**6)):
        with pytest.raises(grpc.RpcError) as e:
            _scheduler_generate(addr, **sampling)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        s = stats(addr)
        assert all(w.running == 0 and w.waiting == 0 for w in s.workers) and s.active_requests == 0


# ---------------------------------------------------------------------------- API key and scheduler loss


class TcpProxy:
    """A loopback TCP forwarder we can cut and restore: the 'scheduler' disappearing and returning."""

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.port, self.target = port, target
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen()
        self._server = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                client, _ = srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        if self._server is not None:
            # shutdown() wakes the thread blocked in accept(); close() alone leaves the port listening.
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
            self._server = None
        with self._lock:
            for s in self._conns:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._conns.clear()


KEY = "sk-test-123"


@pytest.fixture(scope="module")
def proxied_gateway(gateway_mesh, tmp_path_factory):
    """A second gateway, with an API key, reaching the mesh's scheduler through a TcpProxy (off at first)."""
    host, port = gateway_mesh.scheduler.address.rsplit(":", 1)
    proxy = TcpProxy(free_port(), (host, int(port)))
    http_port = free_port()
    log = open(tmp_path_factory.mktemp("proxied-gateway") / "gateway.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.service", "--port", str(http_port),
         "--scheduler", f"127.0.0.1:{proxy.port}", "--log-format", "text"],
        env={**os.environ, "LLMESH_API_KEY": KEY}, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url, proxy
    finally:
        proxy.stop()
        proc.terminate()
        proc.wait(20)
        log.close()


def _wait_status(url: str, status: int, timeout: float = 30.0, **kw) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url, timeout=5, **kw)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def test_api_key_and_scheduler_loss_and_recovery(proxied_gateway):
    import openai

    url, proxy = proxied_gateway
    auth = {"Authorization": f"Bearer {KEY}"}
    # The scheduler is unreachable: 503 with a message saying so, on /health and on generation.
    err = assert_error(httpx.get(f"{url}/health", timeout=10), 503)
    assert "scheduler" in err["message"]
    assert_error(httpx.post(f"{url}{COMP}", json={"prompt": "x"}, headers=auth, timeout=10), 503)

    # Auth holds whatever the scheduler's state: every route but /health.
    for path in ("/v1/models", "/metrics", "/version", "/openapi.json"):
        assert_error(httpx.get(f"{url}{path}", timeout=10), 401, code="invalid_api_key")
        assert_error(httpx.get(f"{url}{path}", headers={"Authorization": "Bearer nope"}, timeout=10), 401)
    assert_error(httpx.post(f"{url}{CHAT}", json={"messages": MSGS}, timeout=10), 401)
    assert httpx.get(f"{url}/version", headers=auth, timeout=10).status_code == 200

    # The scheduler appears: the gateway finds it and serves.
    proxy.start()
    assert _wait_status(f"{url}/health", 200).status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)
    assert resp.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()

    # It goes away: 503 (not 500, not a hang) with a clear message.
    proxy.stop()
    err = assert_error(_wait_status(f"{url}/health", 503), 503)
    assert "unavailable" in err["message"]
    r = httpx.post(f"{url}{COMP}", json={"prompt": "x", "max_tokens": 2}, headers=auth, timeout=30)
    err = assert_error(r, 503, code="service_unavailable")
    assert "scheduler" in err["message"]
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)

    # And comes back: the gateway recovers on its own.
    proxy.start()
    assert _wait_status(f"{url}/health", 200).status_code == 200
    resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)
    assert resp.usage.completion_tokens >= 1
