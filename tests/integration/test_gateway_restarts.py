"""The gateway across restarts of what is behind it and of itself, with 1 s keepalives everywhere.

Real processes on loopback (scheduler + 1 worker + gateway). Tests run in file order on one mesh:
the scheduler is SIGKILLed and restarted under a gateway and a worker that stay up, then the
gateway itself is restarted, then everything idles past several keepalive periods.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from services.launcher import LocalMesh, start_mesh
from tests.integration.conftest import service_logs
from tests.integration.test_mesh import stats
from tests.integration.test_mesh_lifecycle import connected_workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEEPALIVE = ["--keepalive-s", "1"]
SCHEDULER_ARGS = ["--worker-dead-after-s", "4", "--failover-after-s", "0.5", *KEEPALIVE]
WORKER_ARGS = ["--kv-cache-memory", str(192 << 20), "--rejoin-after-s", "1", *KEEPALIVE]
GATEWAY_ARGS = ["--log-format", "text", *KEEPALIVE]
BACK_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("gateway-restarts")
    try:
        m = start_mesh(
            1,
            gateway_port=0,
            scheduler_args=SCHEDULER_ARGS,
            worker_args=WORKER_ARGS,
            gateway_args=GATEWAY_ARGS,
            log_dir=str(log_dir),
        )
    except Exception as e:
        raise RuntimeError(f"the mesh did not start: {e}\n{service_logs(log_dir)}") from e
    m.log_dir = log_dir  # type: ignore[attr-defined]
    with m:
        yield m


@pytest.fixture(scope="module")
def base(mesh: LocalMesh) -> str:
    return f"http://{mesh.gateway.address}"


@pytest.fixture(scope="module")
def model(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


def openai_client(base: str):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def health(base: str) -> int:
    try:
        return httpx.get(f"{base}/health", timeout=10).status_code
    except httpx.TransportError:
        return 0  # nothing listening (yet)


def complete(base: str, model: str) -> str:
    out = openai_client(base).completions.create(model=model, prompt="The capital of France is", max_tokens=4)
    assert out.usage.completion_tokens == 4 or out.choices[0].finish_reason == "stop", out
    return out.choices[0].text


def wait_for(check, what: str, mesh: LocalMesh, timeout: float = BACK_WITHIN_S) -> float:
    """Seconds until `check()` held (an exception counts as not yet); fails with the logs after `timeout`."""
    t0 = time.monotonic()
    last: object = None
    while True:
        try:
            if check():
                return time.monotonic() - t0
        except Exception as e:  # e.g. a 503 while the worker re-registers
            last = e
        if time.monotonic() - t0 > timeout:
            raise AssertionError(
                f"{what}: not after {timeout:.0f} s (last error: {last!r})\n{service_logs(mesh.log_dir)}"
            )
        time.sleep(0.2)


def assert_openai_503(r: httpx.Response) -> None:
    assert r.status_code == 503, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "server_error" and err["code"] == "service_unavailable", err
    assert err["message"], err


def test_scheduler_killed_and_restarted_under_a_running_gateway_and_worker(mesh, base, model):
    complete(base, model)
    gateway_pid, worker_pid = mesh.gateway.proc.pid, mesh.workers[0].proc.pid
    mesh.scheduler.proc.send_signal(signal.SIGKILL)
    mesh.scheduler.proc.wait(10)

    # Down: fast, well-formed 503s, never a hang or a 500.
    t0 = time.monotonic()
    assert health(base) == 503
    body = {"model": model, "prompt": "Hello", "max_tokens": 4}
    assert_openai_503(httpx.post(f"{base}/v1/completions", json=body, timeout=15))
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    assert_openai_503(httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=15))
    assert_openai_503(httpx.post(f"{base}/v1/chat/completions", json={**chat, "stream": True}, timeout=15))
    assert time.monotonic() - t0 < 10
    import openai

    with pytest.raises(openai.InternalServerError) as e:
        complete(base, model)
    assert e.value.status_code == 503

    mesh.scheduler.respawn()  # same port; the gateway and the worker are not touched
    restarted = time.monotonic()
    wait_for(lambda: health(base) == 200, "/health 200 again", mesh)
    # Readiness means serving: the first completion once /health says 200 is served, not retried
    # (it was 503 for ~4 s while the restarted scheduler loaded its tokenizer).
    complete(base, model)
    print(f"serving again {time.monotonic() - restarted:.1f} s after the scheduler restarted")
    assert connected_workers(mesh.scheduler.address) == ["worker-0"]
    assert (mesh.gateway.proc.pid, mesh.workers[0].proc.pid) == (gateway_pid, worker_pid)
    assert mesh.gateway.proc.poll() is None and mesh.workers[0].proc.poll() is None


def test_gateway_restarted_serves_again(mesh, base, model):
    scheduler_pid, worker_pid = mesh.scheduler.proc.pid, mesh.workers[0].proc.pid
    mesh.gateway.proc.send_signal(signal.SIGTERM)
    # uvicorn stops gracefully, then re-raises the signal it caught: the exit status is -SIGTERM.
    assert mesh.gateway.proc.wait(40) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in (mesh.log_dir / "gateway.log").read_text(errors="replace")
    assert health(base) == 0
    mesh.gateway.respawn()  # same port
    restarted = time.monotonic()
    wait_for(lambda: health(base) == 200, "restarted gateway healthy", mesh)
    wait_for(lambda: complete(base, model) is not None, "a completion through the new gateway", mesh)
    print(f"gateway serving {time.monotonic() - restarted:.1f} s after its restart")
    assert (mesh.scheduler.proc.pid, mesh.workers[0].proc.pid) == (scheduler_pid, worker_pid)


def test_idle_past_several_keepalive_periods_then_streams(mesh, base, model):
    complete(base, model)
    time.sleep(6)  # six 1 s keepalive periods on every link, nothing sent
    stream = openai_client(base).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"]), chunks
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text, chunks
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert health(base) == 200
    workers = stats(mesh.scheduler.address).workers  # the scheduler of the first test, restarted
    assert [(w.worker_id, w.connected, w.reconnects) for w in workers] == [("worker-0", True, 0)]
    assert "too_many_pings" not in service_logs(mesh.log_dir, tail=10**9), service_logs(mesh.log_dir)
    assert all(c.proc.poll() is None for c in mesh.children)
