"""`llmesh scheduler --api-server-count 2`: API processes in front of the scheduler core, as real
processes with SmolLM2 on the CPU: the same tokens, workers registering through them, the
gateway and the `openai` client in front, and an API process killed and brought back."""

from __future__ import annotations

import os
import signal
import subprocess

import grpc
import pytest

from services.launcher import gateway_available, start_mesh
from tests.integration.test_mesh import (
    PROMPTS,
    WORKER_ARGS,
    generate,
    reference,  # noqa: F401 (a fixture)
    run_concurrently,
    stats,
    wait_blocks_free,
    wait_for,
)

API_SERVERS = 2


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with start_mesh(
        1,
        worker_args=WORKER_ARGS,
        scheduler_args=["--api-server-count", str(API_SERVERS)],
        gateway_port=0 if gateway_available() else None,
        log_dir=str(tmp_path_factory.mktemp("api-server-logs")),
    ) as m:
        yield m


def api_processes(mesh) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(mesh.scheduler.proc.pid)], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _serves(address: str) -> bool:
    try:
        return len(generate(address, PROMPTS[0], max_tokens=1)) == 1
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e  # a reset connection, nothing else
        return False


def test_text_prompts_through_the_api_processes_match_the_offline_engine(mesh, reference):  # noqa: F811
    assert len(api_processes(mesh)) == API_SERVERS
    outs = run_concurrently(lambda p: generate(mesh.scheduler.address, p), [(p,) for p in PROMPTS])
    assert dict(zip(PROMPTS, outs, strict=True)) == reference
    # The worker registered through an API process; its stats come through one too.
    assert [w.worker_id for w in stats(mesh.scheduler.address).workers]
    wait_blocks_free(mesh.scheduler.address)


def test_the_openai_client_through_the_gateway(mesh):
    if mesh.gateway is None:
        pytest.skip("the gateway's dependencies are not installed")
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{mesh.gateway.address}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], max_tokens=8)
    assert out.choices[0].text and out.usage.completion_tokens == 8


def test_prompt_logprobs_and_embeddings_through_the_api_processes(mesh):
    """What travels only in CoreDelta's newer fields: the echoed prompt's logprobs and a vector."""
    if mesh.gateway is None:
        pytest.skip("the gateway's dependencies are not installed")
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{mesh.gateway.address}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=0
    )
    lp = out.choices[0].logprobs.token_logprobs
    assert out.choices[0].text == PROMPTS[0] and lp[0] is None
    assert len(lp) > 2 and all(v is not None and v <= 0 for v in lp[1:])
    emb = client.embeddings.create(model="SmolLM2-135M-Instruct", input=PROMPTS[:2]).data
    assert len(emb) == 2 and all(sum(v * v for v in e.embedding) == pytest.approx(1, rel=1e-4) for e in emb)
    wait_blocks_free(mesh.scheduler.address)


def test_a_killed_api_process_is_restarted_and_the_other_keeps_serving(mesh, reference):  # noqa: F811
    victim = api_processes(mesh)[0]
    os.kill(victim, signal.SIGKILL)
    # Connections the kernel had queued on its socket are reset (a client dials again): wait
    # until it is gone and a first fresh connection is served.
    wait_for(lambda: not _running(victim), "the API process died")
    wait_for(lambda: _serves(mesh.scheduler.address), "a fresh connection served", timeout=10)
    for prompt in PROMPTS[:3]:  # a fresh connection each: the kernel gives it to a live process
        assert generate(mesh.scheduler.address, prompt) == reference[prompt]
    wait_for(
        lambda: len(api_processes(mesh)) == API_SERVERS and victim not in api_processes(mesh),
        "the killed API process restarted",
    )
    wait_blocks_free(mesh.scheduler.address)


def test_the_core_and_its_api_processes_serve_without_torch(mesh):
    from tests.integration.test_light_services import torch_mappings

    assert generate(mesh.scheduler.address, PROMPTS[1], max_tokens=2)
    for pid in [mesh.scheduler.proc.pid, *api_processes(mesh)]:
        assert torch_mappings(pid) == [], pid
    assert torch_mappings(mesh.workers[0].proc.pid), "the check would not see torch"
