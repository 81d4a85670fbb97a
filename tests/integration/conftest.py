"""One real mesh with the gateway (scheduler + 1 worker + gateway, processes on loopback),
shared by every gateway test of the session.

Fixture names say `gateway`: other integration tests start meshes of their own.
"""

from __future__ import annotations

import pathlib

import httpx
import pytest

from services.launcher import LocalMesh, start_mesh

# 256 MiB of KV cache (364 blocks of 16 tokens for SmolLM2-135M); a 1 MiB body cap so that
# the 413 test need not send megabytes.
# LoRA on (tests/integration/test_gateway_lora.py and docs/lora.md load adapters at run time).
GATEWAY_WORKER_ARGS = ["--kv-cache-memory", str(256 << 20), "--enable-lora"]
GATEWAY_ARGS = ["--max-body-bytes", str(1 << 20), "--log-format", "text", "--allow-runtime-lora-updating"]


def service_logs(log_dir: pathlib.Path, tail: int = 3000) -> str:
    """The last `tail` characters of each service's log (for failure messages)."""
    return "\n".join(
        f"--- {f.name} ---\n" + f.read_text(errors="replace")[-tail:] for f in sorted(log_dir.glob("*.log"))
    )


@pytest.fixture(scope="session", autouse=True)
def _sweep_killed_stores_arenas():
    """Tests kill KV stores (SIGKILL); a killed store's arena stays in /dev/shm until the next
    store of this user starts, so the session removes those of dead processes when it ends."""
    yield
    from kvstore_svc.arena import ARENA_NAME
    from kvstore_svc.shm import SHM_DIR, sweep_orphans

    sweep_orphans(SHM_DIR, ARENA_NAME)


@pytest.fixture(scope="session")
def gateway_mesh(tmp_path_factory) -> LocalMesh:
    log_dir = tmp_path_factory.mktemp("gateway-mesh")
    try:
        mesh = start_mesh(
            1,
            gateway_port=0,
            worker_args=GATEWAY_WORKER_ARGS,
            gateway_args=GATEWAY_ARGS,
            log_dir=str(log_dir),
        )
    except Exception as e:
        raise RuntimeError(f"the gateway mesh did not start: {e}\n{service_logs(log_dir)}") from e
    mesh.log_dir = log_dir  # type: ignore[attr-defined]
    yield mesh
    mesh.stop()


@pytest.fixture(scope="session")
def gateway_url(gateway_mesh: LocalMesh) -> str:
    return f"http://{gateway_mesh.gateway.address}"


@pytest.fixture(scope="session")
def gateway_http(gateway_url: str) -> httpx.Client:
    with httpx.Client(base_url=gateway_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def openai_client(gateway_url: str):
    import openai

    # The official client, unchanged: only base_url points at the gateway.
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)
