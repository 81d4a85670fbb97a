"""The gateway and the scheduler serve without torch: after a completion through the shared
gateway mesh (one more request on it, no mesh of its own), neither process has torch's
libraries mapped, while the worker, the positive control, does."""

from __future__ import annotations

import httpx

from services.launcher import LocalMesh


def torch_mappings(pid: int) -> list[str]:
    """The files of torch's native code (libtorch*, torch/_C*) that process `pid` has mapped."""
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        paths = {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}
    return sorted(p for p in paths if "libtorch" in p or "/torch/_C" in p)


def test_gateway_and_scheduler_serve_without_torch(
    gateway_mesh: LocalMesh, gateway_http: httpx.Client
) -> None:
    r = gateway_http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert gateway_mesh.gateway is not None
    assert torch_mappings(gateway_mesh.gateway.proc.pid) == []
    assert torch_mappings(gateway_mesh.scheduler.proc.pid) == []
    assert torch_mappings(gateway_mesh.workers[0].proc.pid), "the check would not see torch"
