"""Disaggregated prefill/decode with real processes on loopback: a scheduler, a KV store, one prefill
worker and two decode workers (SmolLM2), requests over the Scheduler gRPC API.

Long prompts are prefilled on the prefill worker and handed over directly (a decode worker copies
their blocks out of the prefill worker's shared-memory cache), short ones run whole on a decode
worker: every greedy token equals the aggregated engine's. Then a decode worker is killed (SIGKILL)
while it decodes, and the prefill worker while it prefills: every request still completes with the
same tokens (or fails cleanly), and the survivor's blocks all come back.
"""

from __future__ import annotations

import random
import threading

import grpc
import pytest

from llmesh.v1 import generation_pb2 as g
from llmesh.v1 import generation_pb2_grpc as gg
from services.grpc_server import open_sync_channel
from services.launcher import start_mesh
from tests.integration.conftest import service_logs
from tests.integration.test_mesh import stats, wait_for
from worker_svc import kv_peer

CHUNK_TOKENS = 32
MAX_TOKENS = 24
LENGTHS = [200, 24, 180, 30, 220, 20]  # long ones disaggregate (threshold 64), short ones stay whole


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference() -> dict[int, list[list[int]]]:
    from llmesh import LLM, SamplingParams

    llm = LLM(kv_cache_memory=64 << 20, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeds = (1, 2, 3)
    prompts = [p for seed in seeds for p in make_prompts(seed)]  # one batch: a third of the decode steps
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return {seed: outs[i * len(LENGTHS) : (i + 1) * len(LENGTHS)] for i, seed in enumerate(seeds)}


@pytest.fixture
def mesh(tmp_path):
    worker_args = ["--kv-cache-memory", str(64 << 20), "--kv-chunk-tokens", str(CHUNK_TOKENS)]
    # A lost worker's requests move at once; a dead one is removed within 3 s. Every long prompt goes
    # to the prefill worker whatever its queue (the queue rule's own tests are in test_disaggregation.py).
    sched_args = [
        "--disaggregation-threshold", "64", "--failover-after-s", "0", "--worker-dead-after-s", "3",
        "--disaggregation-max-queue-s", "1000",
    ]  # fmt: skip
    try:
        mesh = start_mesh(
            3,
            worker_args=worker_args,
            worker_roles=["prefill", "decode", "decode"],
            scheduler_args=sched_args,
            kvstore=True,
            log_dir=str(tmp_path),
        )
        # The scheduler serves once one worker has joined: a request placed before the prefill
        # worker joins stays whole on a decode worker (no prefill pool yet), which the counts
        # below would miss (it happened once in a full run on the 2-core machine).
        address = mesh.scheduler.address
        wait_for(lambda: sum(w.connected for w in stats(address).workers) == 3, "3 workers connected", 60)
    except Exception as e:
        raise RuntimeError(f"the mesh did not start: {e}\n{service_logs(tmp_path)}") from e
    mesh.log_dir = tmp_path  # type: ignore[attr-defined]
    yield mesh
    mesh.stop()
    kv_peer.sweep_stale_segments()  # the killed prefill worker's shared KV segment


class Run:
    """Requests streamed on threads; `started` is set once every stream has its first token."""

    def __init__(self, address: str, prompts: list[list[int]]) -> None:
        self.address, self.prompts = address, prompts
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.errors: list[grpc.RpcError | None] = [None] * len(prompts)
        self._first = [threading.Event() for _ in prompts]
        self._threads = [threading.Thread(target=self._one, args=(i,)) for i in range(len(prompts))]
        for t in self._threads:
            t.start()

    def _one(self, i: int) -> None:
        req = g.GenerateRequest(
            prompt_token_ids=g.TokenIds(ids=self.prompts[i]),
            sampling_params=g.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        try:
            with open_sync_channel(self.address) as channel:
                for r in gg.SchedulerStub(channel).Generate(req, timeout=180):
                    self.tokens[i].extend(r.token_ids)
                    if self.tokens[i]:
                        self._first[i].set()
        except grpc.RpcError as e:
            self.errors[i] = e
        finally:
            self._first[i].set()

    def wait_first(self, timeout: float = 120) -> None:
        for e in self._first:
            assert e.wait(timeout)

    def join(self) -> None:
        for t in self._threads:
            t.join(240)

    def check(self, expected: list[list[int]]) -> None:
        for tokens, error, want in zip(self.tokens, self.errors, expected, strict=True):
            if error is not None:  # a clean failure: the caller hears why, no token was wrong
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                assert tokens == want[: len(tokens)]
            else:
                assert tokens == want


def survivors_settle(address: str) -> None:
    def freed() -> bool:
        s = stats(address)
        return s.active_requests == 0 and all(w.free_blocks == w.num_blocks for w in s.workers)

    wait_for(freed, "every block back in the free pool", timeout=30)


def test_disaggregated_tokens_and_workers_killed(mesh, reference):
    address = mesh.scheduler.address
    try:
        # 1. Greedy tokens equal the aggregated engine's; the long prompts were handed over.
        run = Run(address, make_prompts(1))
        run.join()
        assert run.errors == [None] * len(LENGTHS)
        run.check(reference[1])
        s = stats(address)
        assert s.pd_disaggregated == s.pd_handovers == 3 and s.pd_kept_whole == 3
        assert s.pd_fallbacks == 0 and s.pd_handover_seconds > 0
        # Direct: the decode workers copied the prompts' blocks out of the prefill worker's shared
        # memory segment (one host), none went through the store.
        assert s.pd_direct == 3 and s.pd_direct_failed == 0 and s.pd_direct_bytes > 0
        assert all(w.store_hit_tokens == 0 for w in s.workers)
        survivors_settle(address)

        # 2. A decode worker killed while it decodes: its requests move to the other decode worker.
        run = Run(address, make_prompts(2))
        run.wait_first()
        mesh.child("worker-1").proc.kill()
        run.join()
        run.check(reference[2])

        # 3. The prefill worker killed while it prefills: its requests are computed by the decode worker.
        prompts = make_prompts(3)
        run = Run(address, prompts)
        wait_for(lambda: any(run.tokens[i] for i in (1, 3, 5)), "a short request's first token", 120)
        mesh.child("worker-0").proc.kill()
        run.join()
        run.check(reference[3])
        wait_for(lambda: len(stats(address).workers) == 1, "the dead workers removed", 30)
        survivors_settle(address)
    except BaseException as e:
        raise AssertionError(f"{e}\n{service_logs(mesh.log_dir)}") from e
