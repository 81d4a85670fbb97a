"""The worker's side of the KV tiers: its host (CPU) tier and its connection to the KV store.

The scheduler decides every move (`services.step.KVTransfers`); this module
only copies bytes, in the order the contract gives, before a plan's forward:

- the host tier is one tensor of `num_host_blocks` slots, each one KV block of
  every layer, laid out layer by layer (pinned memory on CUDA, so copies are DMA);
  saves and loads move many blocks at once, one gather/scatter per layer, never
  one copy per block. On CUDA a load runs layer by layer on a stream of its own
  and the forward's layer i waits only for layer i's blocks (`take_layer_events`,
  LMCache's layer-wise pipelining): the forward runs behind the transfer instead
  of after it;
- a store put copies a chunk of blocks to host memory now (on CUDA one DMA into
  a slot of a pinned pool, `kv_put_staging`) and hands it to a background thread
  that sends it (the step never waits on the store; when the pool is full a put
  is dropped, which loses nothing but a later hit);
- a store load fetches chunks and scatters them into the sequence's fresh
  blocks. A chunk that cannot be had (a miss, a corrupt entry, the store down)
  is not an error: the caller computes the sequence from that chunk on instead.

The store is untrusted storage (services/kv_mac.py): every chunk put carries a MAC under the mesh
secret, over a keyed digest of its bytes taken where they are (`kernels.kv_digest`: on the GPU, one
int8 GEMM on the copy stream as the chunk is gathered, or over the device buffer a load was
uploaded into), and a loaded chunk whose MAC does not verify is a miss, counted, and never
scattered into the cache: no forward reads it.

The store client is passed in (`KVStoreLink`), so this module knows no transport.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kernels.kv_digest import digest_key, kv_digest, kv_digest_batch
from services.kv_mac import KVMac
from services.mesh_secret import client_key
from services.step import KVTransfers, StoreLoad, StorePut, store_fingerprint
from worker_svc.kv_cache import KVCacheSpec
from worker_svc.kv_diagnostics import diag
from worker_svc.kv_load_staging import LoadStaging
from worker_svc.kv_put_staging import PutStaging

if TYPE_CHECKING:
    from worker_svc.kv_shards import KVShardExchange

log = logging.getLogger(__name__)

# Entry layout: chunk blocks outermost, so that a chunk is one contiguous run of whole blocks.
LAYOUT = "blocks,layers,kv,block_size,kv_heads,head_dim"
# uint8: an fp8 cache's blocks, moved as bytes (the worker's fingerprint names their encoding).
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.uint8: "uint8",
}
# Bytes of store puts waiting for the background sender (the worker's kv_store_put_bytes);
# past this, new puts are dropped.
DEFAULT_PUT_BYTES = 512 << 20
# Pinned host memory that store loads over the bulk path land in (kv_load_staging); a larger load
# goes in rounds. An 8k-token prefix of an 8B model is 1 GiB.
DEFAULT_LOAD_BYTES = 1 << 30


def wait_for_loads(events: list[torch.cuda.Event] | None, device: torch.device) -> None:
    """Order `device`'s current stream after a layer-by-layer load (all of its layers)."""
    if events:
        torch.cuda.current_stream(device).wait_event(events[-1])


class KVStoreLink(Protocol):
    """What the worker needs of a KV store client (kvstore_svc.client.KVStoreClient)."""

    def put(self, fingerprint: bytes, entries: list) -> int: ...

    def get(self, fingerprint: bytes, keys: list[bytes]) -> list: ...


@dataclass
class KVTierCounters:
    saved_blocks: int = 0
    host_loaded_blocks: int = 0
    store_loaded_blocks: int = 0
    store_put_chunks: int = 0
    store_put_dropped: int = 0
    store_put_failed: int = 0
    store_load_failures: int = 0
    store_verify_failures: int = 0  # chunks whose MAC did not verify (forged, altered, swapped, unsigned)
    # Time and bytes of loads (the achieved bandwidth of each path).
    host_load_seconds: float = 0.0
    store_load_seconds: float = 0.0
    store_get_seconds: float = 0.0  # of which waiting for the store's bytes
    host_loaded_bytes: int = 0
    store_loaded_bytes: int = 0
    store_bulk_loads: int = 0  # store loads that went over the bulk path (into pinned staging)


class WorkerKVTiers:
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        spec: KVCacheSpec,
        fingerprint: bytes,
        num_host_blocks: int,
        store: KVStoreLink | None,
        chunk_blocks: int,
        shards: KVShardExchange | None = None,
        put_bytes: int = DEFAULT_PUT_BYTES,
        mac: KVMac | None = None,
        load_bytes: int = DEFAULT_LOAD_BYTES,
    ) -> None:
        """`spec` describes whole blocks (every KV head); with tensor parallelism `kv_caches`
        holds this rank's heads and `shards` moves the others' to and from rank 0. `mac`: the
        mesh's entry MAC (default: from the key a client told nothing carries, mesh_secret);
        `load_bytes`: the pinned staging of store loads over the bulk path (CUDA)."""
        self.kv_caches = kv_caches
        self.shards = shards
        self.spec = spec
        self.device = kv_caches[0].device
        self.num_host_blocks = num_host_blocks
        self.store = store
        self.chunk_blocks = chunk_blocks if store is not None else 0
        self.store_fingerprint = store_fingerprint(fingerprint, self.chunk_blocks)
        self.mac = mac if mac is not None or store is None else KVMac(client_key())
        # The digest's key matrix (1 MiB), on the device where payloads are digested.
        self._digest_key = digest_key(self.mac.digest_secret, self.device) if self.mac is not None else None
        self._counters = KVTierCounters()
        # Loads whose copy time is read from CUDA events once they have fired (no host sync):
        # (start, end, True for the host tier / False for the store). The step thread adds them;
        # whoever reads `counters` (a stats call's thread too) folds them in, under the lock.
        self._timed_loads: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []
        self._timing_lock = threading.Lock()
        block_shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.block_shape = block_shape
        pin = self.device.type == "cuda"
        # torch.empty: on CPU pages are committed only as slots are written (pinned memory, on CUDA,
        # is locked at once: its size is the operator's choice). Layers outermost: one layer of
        # a run of slots is contiguous, so a load can move (and hand over) one layer at a time.
        host_shape = (spec.num_layers, num_host_blocks, *block_shape[1:])
        self.host = torch.empty(host_shape, dtype=spec.dtype, pin_memory=pin)
        wants_copies = num_host_blocks > 0 or store is not None
        # Saves into host slots still being copied on the copy stream: (slots, copies done).
        self._saves_in_flight: list[tuple[frozenset[int], torch.cuda.Event]] = []
        self.copy_stream = torch.cuda.Stream(self.device) if pin and wants_copies else None
        # Host loads run on their own stream, layer by layer; the events of the last plan's load,
        # one per layer, until the runner takes them for its forward.
        self.load_stream = torch.cuda.Stream(self.device) if pin and num_host_blocks else None
        self._layer_events: list[torch.cuda.Event] | None = None
        if (
            pin
            and store is not None
            and hasattr(store, "on_segments")
            and not diag("LLMESH_KV_DIAG_NO_SEGMENT_LOCK")
        ):
            # The store client's shared memory segments, page-locked: chunks loaded from them
            # reach the device by DMA, with no staging copy.
            store.on_segments(_page_lock, _page_unlock)
        if (
            pin
            and store is not None
            and hasattr(store, "on_arena")
            and not diag("LLMESH_KV_DIAG_NO_ARENA_LOCK")
        ):
            # The store's arena, mapped read-only: page-locked once per mapping (the read-only
            # flag: the pages are never written from here), so in-place loads are one DMA each.
            store.on_arena(_page_lock_arena, _page_unlock_arena)
        self._preparing: threading.Thread | None = None
        # Store loads over the bulk path land here (pinned on CUDA; on the CPU in the load's own buffer).
        chunk_shape = (self.chunk_blocks, *block_shape)
        bulk = store is not None and getattr(store, "uses_bulk", False)
        self.load_staging = (
            LoadStaging(chunk_shape, spec.dtype, load_bytes, pinned=not diag("LLMESH_KV_DIAG_PAGEABLE_LOAD"))
            if pin and bulk
            else None
        )
        # (blocks, bytes, seconds) of each store load since the last take_load_reports: the
        # scheduler's load predictor learns each path's bandwidth from them (StepResult).
        self._load_reports: list[tuple[int, int, float]] = []
        if store is not None and hasattr(store, "prepare"):
            # Map (and page-lock) the store's arena or segments while the engine starts: locking
            # 4 GiB took over a second on an H100 host, and the first load used to wait for it.
            self._preparing = threading.Thread(target=self._prepare, name="llmesh-kv-prepare", daemon=True)
            self._preparing.start()
        self._puts: queue.Queue = queue.Queue()
        put_pin = pin and not diag("LLMESH_KV_DIAG_PAGEABLE_PUT")
        self.staging = PutStaging(chunk_shape, spec.dtype, put_bytes if self.chunk_blocks else 0, put_pin)
        self._sender: threading.Thread | None = None
        if self.chunk_blocks:
            self._sender = threading.Thread(target=self._send_puts, name="llmesh-kv-put", daemon=True)
            self._sender.start()

    # ----- block gather / scatter -----
    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """[n, layers, 2, block_size, heads, head_dim] copy of blocks, on the cache's device
        (every rank's heads with tensor parallelism)."""
        local = gather_blocks(self.kv_caches, block_ids)
        return self.shards.gather(local, block_ids) if self.shards is not None else local

    def _scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write [n, layers, 2, ...] into blocks `block_ids` (data on any device)."""
        data = data.to(self.device, non_blocking=True)
        if self.shards is not None:
            data = self.shards.scatter(data, block_ids)  # this rank's heads; the others get theirs
        scatter_blocks(self.kv_caches, block_ids, data)

    # ----- a plan's transfers -----
    def apply(self, kv: KVTransfers, block_index: Callable[[str, int], int]) -> dict[str, int]:
        """Do a plan's transfers; {seq_id: block index to compute from} for failed store loads.

        `block_index(seq_id, block_id)` is the position of a block in that sequence's table.

        On CUDA, saves and puts run on a copy stream: the forward waits only for the gathers
        (device-side, microseconds) that read blocks it may overwrite, while the device-to-host
        copies into pinned memory overlap it. Host loads wait for earlier saves to land.
        """
        c = self._counters
        self.wait_for_loads(self.take_layer_events())  # a load no forward waited for
        if kv.save_block_ids or kv.store_puts:
            self._save_and_put(kv)
        if kv.load_block_ids:
            self._load_from_host(kv.load_host_slots, kv.load_block_ids)
            c.host_loaded_blocks += len(kv.load_block_ids)
            c.host_loaded_bytes += len(kv.load_block_ids) * self.spec.bytes_per_block
        failed: dict[str, int] = {}
        for load in kv.store_loads:
            started = time.perf_counter()
            blocks_before = c.store_loaded_blocks
            with self._timed(host=False):
                first_missing = self._load_from_store(load)
            # Wall time on this thread: through the MAC check, which waits for the bytes on the device.
            n = c.store_loaded_blocks - blocks_before
            self._load_reports.append((n, n * self.spec.bytes_per_block, time.perf_counter() - started))
            if first_missing is not None:
                failed[load.seq_id] = block_index(load.seq_id, first_missing)
                c.store_load_failures += 1
        return failed

    def take_load_reports(self) -> list[tuple[int, int, float]]:
        """(blocks, bytes, seconds) of each store load since the last call, in plan order."""
        reports, self._load_reports = self._load_reports, []
        return reports

    @property
    def verify_failures(self) -> int:
        """Store chunks refused so far because their MAC did not verify."""
        return self._counters.store_verify_failures

    def take_layer_events(self) -> list[torch.cuda.Event] | None:
        """The last plan's host load, one event per layer that fires once that layer's blocks are
        in the cache (None: nothing loading on the side). The caller's forward must wait on
        layer i's event before layer i reads or writes its cache, and on the last before anything
        else it runs after the load (`wait_for_loads`)."""
        events, self._layer_events = self._layer_events, None
        return events

    def wait_for_loads(self, events: list[torch.cuda.Event] | None) -> None:
        """Order the current stream after a layer-by-layer load (all of its layers)."""
        wait_for_loads(events, self.device)

    @contextlib.contextmanager
    def _timed(self, host: bool) -> Iterator[None]:
        """Time a load. On CUDA by events read once they have fired: no host sync, so the
        forward's launches (an 8B prefill's ~20 ms of Python on an H100), queued behind the
        copies on the same stream, overlap the transfer (~23 ms for 1 GiB) instead of following it."""
        if self.device.type != "cuda":
            started = time.perf_counter()
            yield
            seconds = time.perf_counter() - started
            if host:
                self._counters.host_load_seconds += seconds
            else:
                self._counters.store_load_seconds += seconds
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._add_timed_load(start, end, host)

    @property
    def counters(self) -> KVTierCounters:
        """The counters, with the copy time of every load that has completed."""
        with self._timing_lock:
            pending = []
            for start, end, host in self._timed_loads:
                if not end.query():
                    pending.append((start, end, host))
                elif host:
                    self._counters.host_load_seconds += start.elapsed_time(end) / 1e3
                else:
                    self._counters.store_load_seconds += start.elapsed_time(end) / 1e3
            self._timed_loads = pending
        return self._counters

    def _add_timed_load(self, start: torch.cuda.Event, end: torch.cuda.Event, host: bool) -> None:
        with self._timing_lock:
            self._timed_loads.append((start, end, host))

    def _save_and_put(self, kv: KVTransfers) -> None:
        cs = self.copy_stream
        room = self._room_for(kv.store_puts)  # puts that find no room are never gathered
        # One gather (two kernels a layer) for every block the plan saves or puts: a gather per
        # put chunk cost the step thread ~1,500 launches for a batch of 8 new prompts of an 8B model.
        n_saved = len(kv.save_block_ids)
        ids = kv.save_block_ids + [b for put, _ in room for b in put.block_ids]
        if not ids:
            return
        if cs is None:  # CPU: plain copies
            gathered = self._gather(ids)
            if n_saved:
                slots = torch.tensor(kv.save_host_slots, dtype=torch.long)
                self.host[:, slots] = gathered[:n_saved].transpose(0, 1)
            for (put, (slot, _)), data in zip(room, self._split_puts(gathered, n_saved, room), strict=True):
                self._queue_put(put.key, data, None, slot, None)
        else:
            main = torch.cuda.current_stream(self.device)
            cs.wait_stream(main)  # the blocks were written by earlier plans' forwards
            with torch.cuda.stream(cs):
                gathered = self._gather(ids)
            main.wait_stream(cs)  # this plan's forward may overwrite them once they are gathered
            with torch.cuda.stream(cs):
                gathered.record_stream(cs)
                if n_saved:
                    for i, slot, n in _runs(kv.save_host_slots):
                        for layer in range(self.spec.num_layers):  # one layer of a run: contiguous
                            self.host[layer, slot : slot + n].copy_(
                                gathered[i : i + n, layer], non_blocking=True
                            )
                    landed = torch.cuda.Event()
                    landed.record(cs)
                    self._saves_in_flight.append((frozenset(kv.save_host_slots), landed))
                chunks = self._split_puts(gathered, n_saved, room)
                for (put, (slot, pinned)), data in zip(room, chunks, strict=True):
                    if pinned is None:  # not a whole chunk, or no pinned pool: a buffer of its own
                        pinned = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
                    pinned.copy_(data, non_blocking=True)
                    # The MAC's digest, from the bytes on the device (one GEMM; 64 B per 64 KiB back).
                    digest = kv_digest(data, self._digest_key).to("cpu", non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(cs)
                    self._queue_put(put.key, pinned, done, slot, digest)
        self._counters.saved_blocks += n_saved

    @staticmethod
    def _split_puts(gathered: torch.Tensor, start: int, room: list) -> list[torch.Tensor]:
        """Each put's rows of a joint gather (views), in order, after the `start` saved ones."""
        out = []
        for put, _ in room:
            out.append(gathered[start : start + len(put.block_ids)])
            start += len(put.block_ids)
        return out

    def _room_for(self, puts: list[StorePut]) -> list[tuple[StorePut, tuple[int, torch.Tensor | None]]]:
        """The puts that find room in the staging memory, with their slot (the others are dropped)."""
        out = []
        for put in puts:
            room = self.staging.take((len(put.block_ids), *self.block_shape))
            if room is None:
                self._counters.store_put_dropped += 1
            else:
                out.append((put, room))
        return out

    def _load_from_host(self, slots: list[int], block_ids: list[int]) -> None:
        if self.copy_stream is None:  # CPU
            started = time.perf_counter()
            self._scatter(block_ids, self.host[:, torch.tensor(slots, dtype=torch.long)].transpose(0, 1))
            self._counters.host_load_seconds += time.perf_counter() - started
            return
        main = torch.cuda.current_stream(self.device)
        if self.shards is not None:  # tensor parallelism: one scatter collective for the whole load
            with self._timed(host=True):
                self._wait_for_saves_into(slots, main)
                data = torch.empty((len(slots), *self.block_shape), dtype=self.spec.dtype, device=self.device)
                for layer in range(self.spec.num_layers):
                    for i, slot, n in _runs(slots):
                        data[i : i + n, layer].copy_(self.host[layer, slot : slot + n], non_blocking=True)
                self._scatter(block_ids, data)
            return
        ls = self.load_stream
        assert ls is not None
        # The fresh blocks may have been another sequence's, still read by forwards in flight.
        ls.wait_stream(main)
        self._wait_for_saves_into(slots, ls)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events = []
        with torch.cuda.stream(ls):
            start.record(ls)
            idx = block_index(block_ids, self.device)
            layer_shape = (len(slots), *self.block_shape[1:])
            for layer, cache in enumerate(self.kv_caches):
                data = torch.empty(layer_shape, dtype=self.spec.dtype, device=self.device)
                for i, slot, n in _runs(slots):
                    data[i : i + n].copy_(self.host[layer, slot : slot + n], non_blocking=True)
                cache.index_copy_(1, idx, data.transpose(0, 1))
                ready = torch.cuda.Event()
                ready.record(ls)
                events.append(ready)
            end.record(ls)
        self._add_timed_load(start, end, True)
        self._layer_events = events

    def _wait_for_saves_into(self, slots: list[int], stream: torch.cuda.Stream) -> None:
        """Make `stream` wait for the saves still copying into `slots`, and only those: a load
        waiting for every save in flight waited ~25 ms on an H100 for the 1 GiB another
        request's eviction was saving into other slots."""
        wanted = set(slots)
        pending = []
        for saved_slots, landed in self._saves_in_flight:
            if landed.query():
                continue
            if saved_slots & wanted:
                stream.wait_event(landed)
            pending.append((saved_slots, landed))
        self._saves_in_flight = pending

    def _fence(self) -> Callable[[], None]:
        """The store client's fence: a wait for the copies queued so far (theirs are among them)."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done.synchronize

    def _load_from_store(self, load: StoreLoad) -> int | None:
        """Fill the blocks of `load`; the first block id not filled, or None when all were.

        Each chunk goes from the store's bytes (a view of the store's arena read in place, of a
        shared memory segment, or of the in-process store's memory) toward the cache while the
        store hands it over. On CUDA the copies are asynchronous: each chunk is one DMA into a
        device buffer, the client keeps each view valid until its fence says the copies are done
        (read in place, without holding this thread), and one scatter per layer puts the whole
        load in place, so the forward's launches overlap the transfer as with the host tier. (A
        scatter per chunk launched 32 kernels a chunk: ~1,000 launches, ~30 ms of host time, for
        an 8k-token prefix of an 8B model.) On the CPU each chunk is scattered as it comes.
        Over the bulk path (a store on another host) the chunks land in pinned staging and go
        up as each arrives (`_fetch_bulk`), then are verified and scattered the same way.
        """
        c = self.chunk_blocks
        if not c or len(load.block_ids) != len(load.keys) * c:
            raise ValueError(f"store load for {load.seq_id!r}: {len(load.block_ids)} blocks, chunk size {c}")
        loaded = 0
        copy_seconds = 0.0
        headers = []  # of the chunks staged on the device, verified once they are all there
        started = time.perf_counter()
        bulk = self._fetch_bulk(load)
        staged: torch.Tensor | None
        if bulk is not None:  # over the bulk path: straight into (pinned) staging, then verified
            loaded, headers, staged = bulk
            self._counters.store_get_seconds += time.perf_counter() - started
        elif self.device.type == "cuda":
            staged = torch.empty(
                (len(load.block_ids), *self.block_shape), dtype=self.spec.dtype, device=self.device
            )
        else:
            staged = None

        def consume(key: bytes, header, payload) -> bool:
            nonlocal loaded, copy_seconds
            started = time.perf_counter()
            chunk = self._chunk_tensor((key, header, payload), load.keys[loaded])
            if chunk is None:
                return False
            if staged is not None:
                staged[loaded * c : (loaded + 1) * c].copy_(chunk, non_blocking=True)
                headers.append(header)
            elif self._verified(key, header, kv_digest(chunk, self._digest_key)):
                self._load_chunk(load.block_ids[loaded * c : (loaded + 1) * c], chunk)
            else:
                return False
            loaded += 1
            copy_seconds += time.perf_counter() - started
            return True

        try:
            get_each = getattr(self.store, "get_each", None)
            if bulk is not None:
                pass
            elif get_each is not None:
                fence = self._fence if self.device.type == "cuda" else None
                get_each(self.store_fingerprint, list(load.keys), consume, fence=fence)
            elif self.store is not None:
                for entry in self.store.get(self.store_fingerprint, list(load.keys)):
                    if not consume(*entry):
                        break
        except Exception as e:  # the store is down or slow: compute the rest instead
            log.warning("kv store get failed", extra={"seq_id": load.seq_id, "error": repr(e)})
        if bulk is None:
            self._counters.store_get_seconds += time.perf_counter() - started - copy_seconds
        if staged is not None and loaded:
            loaded = self._verified_prefix(load.keys[:loaded], headers, staged[: loaded * c])
            if loaded:
                self._load_chunk(load.block_ids[: loaded * c], staged[: loaded * c])
        if loaded == len(load.keys):
            return None
        return next((b for b in load.block_ids[loaded * c :] if b >= 0), None)

    def _fetch_bulk(self, load: StoreLoad) -> tuple[int, list, torch.Tensor] | None:
        """Fetch a load's chunks over the store's bulk path: (leading chunks received whole, their
        headers, the buffer holding them: on the device, or on the CPU the host buffer itself);
        None when the store has no bulk path (the caller takes the other paths).

        Each payload is received by the transfer threads straight into a slot of the pinned
        staging (`LoadStaging`), and the thread that received it queues its asynchronous DMA to
        the device at once (overlapping the chunks still arriving): no per-piece Python copy or
        join. Nothing here is trusted yet: the caller verifies every
        chunk's MAC over the bytes on the device before any is scattered into the cache.
        """
        get_into = getattr(self.store, "get_into", None)
        if get_into is None or not getattr(self.store, "uses_bulk", False):
            return None
        c, keys = self.chunk_blocks, list(load.keys)
        chunk_shape = (c, *self.block_shape)
        on_device = self.device.type == "cuda"
        staged = torch.empty((len(keys) * c, *self.block_shape), dtype=self.spec.dtype, device=self.device)
        rounds = self.load_staging.max_chunks if on_device and self.load_staging is not None else len(keys)
        headers: list = []
        loaded = 0
        for first in range(0, len(keys), rounds):
            part = keys[first : first + rounds]
            if on_device and self.load_staging is not None:
                host = self.load_staging.take()[: len(part)]
            elif on_device:  # no staging (it could not be made): a pinned buffer of its own
                host = torch.empty((len(part), *chunk_shape), dtype=self.spec.dtype, pin_memory=True)
            else:
                host = staged[first * c : (first + len(part)) * c].view(len(part), *chunk_shape)
            rows = host.view(len(part), -1).view(torch.uint8)
            chunk_bytes = rows.shape[1]

            def alloc(i: int, header, rows=rows, chunk_bytes=chunk_bytes):
                # An entry of another size is received into its own buffer and refused below.
                if header.payload_length != chunk_bytes:
                    return bytearray(header.payload_length)
                return memoryview(rows[i].numpy())

            received = None
            if on_device:
                # Each chunk's DMA is queued by its transfer thread as soon as it is whole, so
                # the copies to the device overlap the chunks still arriving.
                stream = torch.cuda.current_stream(self.device)

                def received(
                    i: int, header, view, host=host, first=first, stream=stream, nbytes=chunk_bytes
                ) -> None:
                    if header.payload_length != nbytes:
                        return  # refused below
                    try:
                        # Inference mode is per thread: `staged` was made under the step's, and an
                        # in-place copy into an inference tensor outside it raises. Every upload
                        # failed so (issue 32), and a load verified only the chunks whose bytes an
                        # earlier load had left in the recycled device memory.
                        with (
                            torch.inference_mode(),
                            torch.cuda.device(self.device),
                            torch.cuda.stream(stream),
                        ):
                            staged[(first + i) * c : (first + i + 1) * c].copy_(host[i], non_blocking=True)
                    except Exception as e:  # never breaks the transfer; the check below refuses it
                        log.warning("kv bulk upload failed: %r", e, extra={"error": repr(e)})

            got = get_into(self.store_fingerprint, part, alloc, received=received)
            if got is None:
                if first == 0:
                    return None  # no bulk path after all (unreachable): the other paths
                break
            n = 0
            for i, item in enumerate(got):
                if item is None or not self._fits(item[0], part[i]) or item[1].nbytes != chunk_bytes:
                    break
                headers.append(item[0])
                n += 1
            if on_device and n:  # the uploads were queued by the transfer threads (`received`)
                if self.load_staging is not None:
                    done = torch.cuda.Event()
                    done.record(torch.cuda.current_stream(self.device))
                    self.load_staging.uploaded(done)
            loaded += n
            if n < len(part):
                break
        self._counters.store_bulk_loads += 1
        return loaded, headers, staged

    def _fits(self, header, key: bytes) -> bool:
        """Whether an entry's header describes a chunk of this worker's cache layout."""
        want = (self.chunk_blocks, *self.block_shape)
        ok = tuple(header.shape) == want and header.dtype == DTYPE_NAMES.get(self.spec.dtype)
        if not ok:
            log.warning("kv store entry does not fit this worker's cache layout; computing instead")
        return ok

    def _load_chunk(self, targets: list[int], chunk: torch.Tensor) -> None:
        """Copy loaded chunks ([n, layers, 2, ...]: a view of bytes valid only until this returns,
        or the device buffer they were staged in) into their target blocks."""
        keep = [j for j, b in enumerate(targets) if b >= 0]
        if not keep:
            return
        if len(keep) < len(targets):  # blocks the GPU cache already holds are skipped
            rows = block_index(keep, chunk.device)
            self._scatter([targets[j] for j in keep], chunk.index_select(0, rows))
        else:
            self._scatter(targets, chunk)  # straight from the view: no intermediate copy
        self._counters.store_loaded_blocks += len(keep)
        self._counters.store_loaded_bytes += len(keep) * self.spec.bytes_per_block

    def _verified(self, key: bytes, header, digest: torch.Tensor) -> bool:
        """Whether a chunk's MAC is this mesh's over its name, header and digest (counted if not)."""
        assert self.mac is not None
        signed, fp = header.signed_bytes(), self.store_fingerprint
        ok = self.mac.verify(header.mac, fp, key, signed, _le_bytes(digest))
        if not ok:
            self._counters.store_verify_failures += 1
            log.warning(
                "kv store entry failed its MAC (forged, altered, swapped or unsigned): computing instead",
                extra={"key": key.hex()[:16]},
            )
        return ok

    def _verified_prefix(self, keys: list[bytes], headers: list, staged: torch.Tensor) -> int:
        """How many leading chunks uploaded to `staged` verify: one digest GEMM on the device for
        them all, then one wait for 64 bytes per 64 KiB; the first that fails ends the run (its
        blocks and the rest are computed, as for a miss)."""
        chunks = staged.view(len(keys), -1)  # each chunk's bytes, as its own row of elements
        digests = kv_digest_batch(chunks, self._digest_key).cpu()
        for i, (key, header) in enumerate(zip(keys, headers, strict=True)):
            if not self._verified(key, header, digests[i]):
                return i
        return len(keys)

    def _chunk_tensor(self, entry: tuple, key: bytes) -> torch.Tensor | None:
        """The chunk's KV as [chunk_blocks, layers, 2, ...], or None if it is not what we expect."""
        got_key, header, payload = entry
        want_shape = (self.chunk_blocks, *self.block_shape)
        dtype_name = DTYPE_NAMES.get(self.spec.dtype)
        if got_key != key or tuple(header.shape) != want_shape or header.dtype != dtype_name:
            log.warning("kv store entry does not fit this worker's cache layout; computing instead")
            return None
        with warnings.catch_warnings():  # read-only bytes: only ever copied into the cache
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(payload, dtype=torch.uint8)
        return flat.view(self.spec.dtype).view(want_shape)

    # ----- background puts -----
    def _queue_put(
        self,
        key: bytes,
        data: torch.Tensor,
        ready: torch.cuda.Event | None,
        slot: int,
        digest: torch.Tensor | None,
    ) -> None:
        """Hand a chunk (host memory, complete once `ready` fires; staging `slot`) to the sender,
        with its MAC digest (host memory, landed with `ready`; None: the sender takes it)."""
        self._puts.put((key, data, ready, slot, digest))

    def _send_puts(self) -> None:
        from services.kv_entry import make_header  # the store's value format (no torch)

        dtype_name = DTYPE_NAMES[self.spec.dtype]
        while True:
            item = self._puts.get()
            if item is None:
                return
            key, data, ready, slot, digest = item
            try:
                if ready is not None:
                    ready.synchronize()  # the device-to-host copy has landed
                if digest is None:
                    digest = kv_digest(data, self._digest_key)
                payload = memoryview(data.reshape(-1).view(torch.uint8).numpy())
                header = make_header(
                    self.store_fingerprint,
                    dtype_name,
                    tuple(data.shape),
                    LAYOUT,
                    self.chunk_blocks * self.spec.block_size,
                    payload,
                )
                assert self.mac is not None and self.store is not None
                tag = self.mac.tag(self.store_fingerprint, key, header.signed_bytes(), _le_bytes(digest))
                header = dataclasses.replace(header, mac=tag)
                self.store.put(self.store_fingerprint, [(key, header, payload)])
                self._counters.store_put_chunks += 1
            except Exception as e:  # a put that fails costs a future hit, nothing more
                self._counters.store_put_failed += 1
                log.info("kv store put failed", extra={"error": repr(e)})
            finally:
                self.staging.give_back(slot, tuple(data.shape))

    def _prepare(self) -> None:
        """Map (and page-lock) the store's arena or segments, and pin the bulk path's staging."""
        assert self.store is not None
        self.store.prepare(self.store_fingerprint)  # type: ignore[attr-defined]
        if self.load_staging is not None:
            self.load_staging.reserve()

    def wait_prepared(self, timeout_s: float = 30.0) -> bool:
        """Wait until the store's arena or segments are mapped (and page-locked): True once they
        are (or there is nothing to prepare). Benchmarks call it to time a worker that has served."""
        if self._preparing is not None:
            self._preparing.join(timeout_s)
            return not self._preparing.is_alive()
        return True

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until queued puts are sent (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self.staging.pending_bytes and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is queued, then stop the sender and wait for it (and for the store client's
        preparation): the caller closes the store client next, which unmaps the memory those
        threads read (a sender still copying out of it crashed the process)."""
        if self._sender is not None:
            self._puts.put(None)
            self._sender.join(timeout_s)
        if self._preparing is not None:
            self._preparing.join(timeout_s)


def _le_bytes(digest: torch.Tensor) -> bytes:
    """A digest's int32 words as little-endian bytes (what the MAC covers, on every host)."""
    return digest.cpu().contiguous().numpy().astype("<i4", copy=False).tobytes()


def block_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as an index tensor on `device`, uploaded without a host sync.

    `torch.tensor(ids, device="cuda")` copies from pageable memory and then synchronizes the
    stream: behind a 1 GiB load that held the step thread for the whole transfer (~22 ms on an
    H100), and behind the previous step's forward for every save.
    """
    idx = torch.tensor(block_ids, dtype=torch.long)
    if device.type != "cuda":
        return idx
    return idx.pin_memory().to(device, non_blocking=True)  # the pinned buffer is kept until copied


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """[n, layers, 2, block_size, heads, head_dim] copy of this cache's blocks, on its device."""
    first = kv_caches[0]  # [2, num_blocks, block_size, heads, head_dim]
    idx = block_index(block_ids, first.device)
    shape = (len(block_ids), len(kv_caches), first.shape[0], *first.shape[2:])
    out = torch.empty(shape, dtype=first.dtype, device=first.device)
    for layer, cache in enumerate(kv_caches):  # one gather per layer, straight into place
        out[:, layer].copy_(cache.index_select(1, idx).transpose(0, 1))
    return out


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], data: torch.Tensor) -> None:
    """Write [n, layers, 2, ...] (on the cache's device) into blocks `block_ids`."""
    idx = block_index(block_ids, kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(1, idx, data[:, layer].transpose(0, 1))


def _segment_address(segment) -> int:
    buf = ctypes.c_char.from_buffer(segment.view)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf  # no buffer export outlives this: the segment can still be unmapped


def _page_lock(segment) -> None:
    """cudaHostRegister a shared memory segment (CUDA only; failure leaves it pageable)."""
    err = torch.cuda.cudart().cudaHostRegister(_segment_address(segment), segment.size, 0)
    if int(err) != 0:
        log.warning("could not page-lock a shared memory segment", extra={"error": int(err)})


def _page_unlock(segment) -> None:
    torch.cuda.cudart().cudaHostUnregister(_segment_address(segment))


# cudaHostRegisterReadOnly: the device only reads the pages (a PROT_READ mapping cannot be pinned
# for writing).
_HOST_REGISTER_READ_ONLY = 0x08


def _page_lock_arena(arena) -> None:
    """cudaHostRegister the store's read-only arena mapping (failure leaves it pageable: slower
    copies, same bytes)."""
    err = torch.cuda.cudart().cudaHostRegister(arena.address, arena.size, _HOST_REGISTER_READ_ONLY)
    arena.page_locked = int(err) == 0
    if not arena.page_locked:
        log.warning("could not page-lock the KV store's arena", extra={"error": int(err)})


def _page_unlock_arena(arena) -> None:
    if getattr(arena, "page_locked", False):
        torch.cuda.cudart().cudaHostUnregister(arena.address)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index in `slots`, first slot, length) of each run of consecutive slots: one copy per run."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs
