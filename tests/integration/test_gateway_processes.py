"""`--api-server-count 2`: two gateway processes share one port (SO_REUSEPORT) in front of the
session's real mesh; metrics add up over both; a dead one is restarted; SIGTERM drains."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from services.launcher import free_port
from tests.integration.test_gateway_openai import metric


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())


def _wait(check, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.2)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def two_process_gateway(gateway_mesh, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("gateway-2p") / "gateway.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.service", "--port", str(port), "--api-server-count", "2",
         "--scheduler", gateway_mesh.scheduler.address, "--log-format", "text"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _healthy(url), "the two-process gateway")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            for child in _children(proc.pid):
                os.kill(child, signal.SIGKILL)
            proc.wait()
        log.close()


def _complete(url: str, i: int) -> int:
    # A client of its own per request: a new connection each, which the kernel spreads.
    with httpx.Client(base_url=url, timeout=120) as client:
        body = {"prompt": f"Count to {i}:", "max_tokens": 3, "ignore_eos": True, "stream": i % 2 == 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if body["stream"]:
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1])
        return r.json()["usage"]["completion_tokens"]


def test_processes_share_the_port_and_metrics_add_up(two_process_gateway):
    url, proc = two_process_gateway
    assert len(_children(proc.pid)) == 2
    text = httpx.get(f"{url}/metrics").text
    before = metric(text, "llmesh:request_success_total") if "llmesh:request_success_total{" in text else 0
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(list(pool.map(lambda i: _complete(url, i), range(12))))
    # Whichever process answers the scrape, it reports the requests both served.
    for _ in range(4):
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "llmesh:request_success_total") - before == 12
        assert metric(text, "llmesh:gateway_requests_active") == 0
        assert metric(text, "llmesh:scheduler_up") == 1  # the scheduler's gauges once, not summed


def test_a_dead_process_is_restarted_and_sigterm_drains(two_process_gateway):
    url, proc = two_process_gateway
    victim = _children(proc.pid)[0]
    os.kill(victim, signal.SIGKILL)
    _wait(lambda: len(c := _children(proc.pid)) == 2 and victim not in c, "a restarted process")
    for i in range(4):  # the survivor serves meanwhile; then both again
        assert _complete(url, i)
    # A stream under way when SIGTERM arrives runs to its end; then every process exits, and so
    # does the supervisor, with 0.
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(proc.pid, signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert proc.wait(60) == 0
    assert not _children(proc.pid)
