"""Disaggregated prefill/decode: which worker computes a prompt, and the KV handover to a decode worker.

Worker roles (`WorkerInfo.role`, the worker's `--role`): a "prefill" worker computes prompts
and samples their first token; a "decode" or "both" worker takes the decode of handed-over
requests and whole requests too short to hand over. A pool with no prefill worker serves
every request whole, as before; one with prefill workers only serves whole requests there.

Per request, Dynamo's conditional disaggregation: a request goes to a prefill worker when the
prompt tokens its decode worker would have to compute (those not in its GPU cache or host tier)
reach `threshold`, and it is a plain generation: no output yet (a moved request continues where
it is), more than one token wanted, no prompt logprobs, not pooling, and a KV store to hand the
KV over through. Short prompts stay whole on the decode worker: their prefill costs the decode
batch less than a handover would.

The handover goes through the KV store, reusing what every worker already does:
1. the prefill worker gets the request with max_tokens = 1 (its caller's parameters kept here):
   it computes the prompt, puts each completed chunk into the store (as any worker does, from a
   background thread after the step) and samples the first token, which streams to the caller
   from there (time to first token is the prefill side's);
2. its planner finishes it there (its blocks go back to its prefix cache). The stream stays open
   while the mesh waits until the store holds the prompt's complete chunks, at most
   `timeout_s`, and not at all once the prefill worker is gone;
3. the request (prompt + first token, its caller's parameters, the same id and stream) is placed
   on a decode worker, whose admission looks the prompt up in the store, loads the chunks and
   computes only the tail: the prompt's last partial chunk and the first token.

Every failure ends in a recompute, never a wrong token: a chunk missing or corrupt in the store is
computed by the decode worker (the worker's store-load fallback); a prefill worker lost before its
first token moves the request elsewhere with its caller's parameters (as any failover); one lost
after it leaves the decode worker to compute what the store lacks; a decode worker lost moves
its requests to another decode worker (prompt + tokens so far, as any failover).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from scheduler_svc.prefix_hash import extend_block_keys
from scheduler_svc.request import FinishReason, Request, RequestDelta
from services.sampling_params import SamplingParams
from services.step import WorkerInfo, store_fingerprint

if TYPE_CHECKING:
    from scheduler_svc.mesh import WorkerSlot

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
# Polling the store for a handover's chunks: first interval, then doubled up to the last.
POLL_FIRST_S, POLL_MAX_S = 0.002, 0.01


class ChunkLookup(Protocol):
    async def lookup(self, fingerprint: bytes, keys: list[bytes]) -> int: ...


def is_prefill_only(info: WorkerInfo) -> bool:
    return info.role == "prefill"


@dataclass
class DisaggregationStats:
    handovers: int = 0  # requests moved from a prefill worker to a decode worker
    handover_seconds: float = 0.0  # sum over handovers: first token out -> placed on the decode worker
    # Handovers whose prompt KV was not all in the store when placed (the prefill worker was lost,
    # a put was dropped or late): the decode worker computes what is missing.
    fallbacks: int = 0
    kept_whole: int = 0  # requests a prefill worker could have taken, kept whole (short prompt)
    disaggregated: int = 0  # requests sent to a prefill worker


@dataclass
class Handover:
    """A request on (or coming back from) a prefill worker."""

    request: Request  # the prefill-side request (max_tokens = 1)
    params: SamplingParams  # its caller's
    prefill_worker: str
    first_token_at: float = 0.0
    task: asyncio.Task | None = None

    def aborted(self) -> RequestDelta:
        """The last delta of a request aborted between the two workers."""
        req = self.request
        n_prompt, n_out = len(req.prompt_token_ids), len(req.output_token_ids)
        return RequestDelta(req.request_id, [], [], FinishReason.ABORT, n_prompt, n_out)


class Disaggregation:
    def __init__(self, threshold: int, timeout_s: float) -> None:
        self.threshold = threshold
        self.timeout_s = timeout_s
        self.pending: dict[str, Handover] = {}
        self.stats = DisaggregationStats()

    # ----- routing -----
    @staticmethod
    def pools(slots: list[WorkerSlot]) -> tuple[list[WorkerSlot], list[WorkerSlot]]:
        """(decode pool, prefill pool): whole and decode work never goes to a prefill worker,
        unless no other worker is there (then the prefill workers serve whole requests)."""
        prefill = [s for s in slots if is_prefill_only(s.info)]
        decode = [s for s in slots if not is_prefill_only(s.info)]
        return (decode, prefill) if decode else (prefill, [])

    def wants(self, req: Request, uncached_tokens: int, chunk_blocks: int, has_store: bool) -> bool:
        """Whether a request whose decode worker lacks `uncached_tokens` of it goes to a prefill worker."""
        sp = req.sampling_params
        plain = not (req.output_token_ids or req.computes_whole_prompt or sp.max_tokens == 1)
        if not (plain and has_store and chunk_blocks):
            return False
        if uncached_tokens < self.threshold:
            self.stats.kept_whole += 1
            return False
        return True

    def send_to_prefill(self, req: Request, worker_id: str) -> None:
        """Make `req` a prefill-side request: it ends after its first token (its params kept here)."""
        sp = req.sampling_params
        self.pending[req.request_id] = Handover(req, sp, worker_id)
        # min_tokens stays 1 where it was more: the first token is sampled with EOS masked alike.
        req.sampling_params = replace(sp, max_tokens=1, min_tokens=min(sp.min_tokens, 1))
        self.stats.disaggregated += 1

    def restore(self, req: Request) -> Request:
        """A request placed again (a failover, the handover itself) runs with its caller's params."""
        h = self.pending.get(req.request_id)
        if h is not None and (h.task is None or h.task is asyncio.current_task()):
            del self.pending[req.request_id]
            req.sampling_params = h.params
        return req

    # ----- the handover -----
    def continues(self, request_id: str, max_model_len: int) -> Handover | None:
        """The handover of a prefill-side request that just finished, or None if it is done for good
        (EOS or a stop token as its first token, the context full): then its caller hears the end."""
        h = self.pending.get(request_id)
        if h is None:
            return None
        req, max_tokens = h.request, h.params.max_tokens
        more = max_tokens is None or len(req.output_token_ids) < max_tokens
        if req.finish_reason is FinishReason.LENGTH and more and req.num_tokens < max_model_len:
            h.first_token_at = time.monotonic()
            return h
        del self.pending[request_id]
        return None

    def decode_request(self, h: Handover) -> Request:
        """The request as the decode worker gets it: prompt + first token, its caller's params."""
        return h.request.moved(h.params, handed_over=True)

    async def wait_for_kv(
        self, store: ChunkLookup, info: WorkerInfo, req: Request, alive: Callable[[], bool]
    ) -> bool:
        """Wait until the store holds every complete chunk of the prompt (True), or give up (False):
        after `timeout_s`, once the prefill worker is gone, or when the store does not answer."""
        chunk = info.kv_chunk_blocks
        prompt = req.prompt_token_ids
        keys = extend_block_keys([], prompt, info.block_size, info.fingerprint, req.cache_root)
        chunk_keys = keys[chunk - 1 :: chunk]
        if not chunk_keys:
            return True
        fingerprint = store_fingerprint(info.fingerprint, chunk)
        deadline = time.monotonic() + self.timeout_s
        delay = POLL_FIRST_S
        while True:
            try:
                if await store.lookup(fingerprint, chunk_keys) >= len(chunk_keys):
                    return True
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the store is down: the decode worker computes the prompt
                log.info("kv store lookup failed", extra={"request_id": req.request_id, "error": repr(e)})
                return False
            if not alive() or time.monotonic() + delay > deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def placed(self, h: Handover, complete: bool) -> None:
        self.stats.handovers += 1
        self.stats.handover_seconds += time.monotonic() - h.first_token_at
        if not complete:
            self.stats.fallbacks += 1

    def cancel(self, request_id: str) -> Handover | None:
        """The request was aborted: forget it, stop its handover."""
        h = self.pending.pop(request_id, None)
        if h is not None and h.task is not None and h.task is not asyncio.current_task():
            h.task.cancel()
        return h
