"""Direct KV handover between workers of one host: export a paged KV cache, open a peer's, copy blocks.

A prefill worker exports its cache (`export_caches`) and advertises the export to the scheduler in
its WorkerInfo; a decode worker gets the export inside a plan's `PeerCopy` and copies the handed
over request's blocks straight out of the prefill worker's cache into its own (`PeerCopier`),
instead of the two going through the KV store. The same code path on both devices:

* CUDA: each layer's tensor travels as the fields of torch's `UntypedStorage._share_cuda_()` (a
  CUDA IPC handle, offsets, the producer's ref counter and event) in protobuf, never pickled. The
  decode worker opens them on its own device: the driver maps the peer's memory there and enables
  peer access (cudaIpcMemLazyEnablePeerAccess), so a worker that sees only its GPU
  (CUDA_VISIBLE_DEVICES) still reads its peer's over NVLink, and the copy is a kernel on the decode
  worker's stream, ordered before the forward that reads the blocks (Mooncake opens IPC handles
  on the caller's device for the same reason).
* CPU: the prefill worker allocates its cache in a POSIX shared-memory segment (mode 0600: the
  worker's user only; unlinked when the worker closes), `SharedKVSegment`; the decode worker maps
  it. This is what the CPU tests exercise.

A peer is trusted only as far as the scheduler's authenticated step stream that named it: the
export says which host it is on (`host_id`: boot id and hostname; another host never matches),
and the layout (dtype, layers, block shape) is checked before any byte moves. Any failure to
open or copy is reported per sequence and the decode worker computes those blocks instead.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.step import CudaIpcHandle, KVExport, PeerCopy

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "llmesh-kv-"
# Peers' exports kept open at once (least recently used closed first): a prefill worker that
# restarts exports anew, and its old mapping must not pin the dead process's memory for good.
MAX_OPEN_PEERS = 8
# More (src, dst) runs than this per copy: one gather and one scatter per layer instead of a
# slice copy per run (each a kernel launch, or a memcpy on the CPU).
MAX_SLICE_RUNS = 8


def host_id() -> str:
    """This host's identity: the kernel's boot id and the hostname (a container's own: two pods of
    one node differ, and neither maps the other's /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{boot}/{socket.gethostname()}"


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV dtype {name!r}")
    return dtype


# ----- export -----
class SharedKVSegment:
    """Every layer's KV tensor in one POSIX shared-memory segment (the CPU worker's exportable cache).

    Created with O_EXCL and mode 0600 under a random name; zero-filled, as `allocate_kv_cache`'s
    are. Its pages are allocated up front (posix_fallocate): a /dev/shm too small for it (Docker's
    default is 64 MiB) raises OSError here, where a sparse file would have killed the worker with
    SIGBUS at its first write past the limit. `close` unlinks the name: peers that mapped it keep
    their mapping, new ones cannot open it.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int) -> None:
        sweep_stale_segments()
        self.name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.shape, self.dtype, self.num_layers = shape, dtype, num_layers
        elem = torch.empty((), dtype=dtype).element_size()
        self.layer_bytes = elem * int(torch.Size(shape).numel())
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(self.layer_bytes * num_layers, 1))
            self._map = mmap.mmap(fd, max(self.layer_bytes * num_layers, 1))
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        # Unlinked at close, or when this object goes, or at exit: no name outlives its worker.
        self._unlink = weakref.finalize(self, _unlink, self.path)
        self.tensors = _layers_of(self._map, shape, dtype, num_layers, self.layer_bytes)

    def close(self) -> None:
        """Unlink the name (idempotent); the mapping lives on while tensors view it."""
        self._unlink()


def sweep_stale_segments() -> None:
    """Unlink the segments of workers that died without closing theirs (SIGKILL, a crash): the
    name holds the creator's pid; only this user's, and only where that pid is gone."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        pid = name.removeprefix(SHM_PREFIX).partition("-")[0]
        if not name.startswith(SHM_PREFIX) or not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _layers_of(
    buf, shape: Sequence[int], dtype: torch.dtype, num_layers: int, layer_bytes: int
) -> list[torch.Tensor]:
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    return [
        whole[i * layer_bytes : (i + 1) * layer_bytes].view(dtype).view(*shape) for i in range(num_layers)
    ]


def export_caches(caches: list[torch.Tensor], segment: SharedKVSegment | None) -> KVExport | None:
    """`caches` as peers on this host open them (None: they cannot be exported)."""
    if not caches:
        return None
    first = caches[0]
    common = dict(
        export_id=secrets.token_hex(8),
        host_id=host_id(),
        dtype=str(first.dtype).removeprefix("torch."),
        num_layers=len(caches),
        layer_shape=list(first.shape),
    )
    if first.device.type == "cuda":
        return KVExport(kind="cuda_ipc", layers=[_ipc_handle(t) for t in caches], **common)  # type: ignore[arg-type]
    if segment is not None and all(
        t.data_ptr() == s.data_ptr() for t, s in zip(caches, segment.tensors, strict=True)
    ):
        return KVExport(kind="shm", shm_name=segment.name, **common)  # type: ignore[arg-type]
    return None


def _ipc_handle(t: torch.Tensor) -> CudaIpcHandle:
    if t.storage_offset() != 0 or not t.is_contiguous():
        raise ValueError("only whole contiguous KV tensors are exported")
    device, handle, size, offset, ref_handle, ref_offset, event, sync = t.untyped_storage()._share_cuda_()
    return CudaIpcHandle(
        int(device),
        bytes(handle),
        int(size),
        int(offset),
        bytes(ref_handle),
        int(ref_offset),
        bytes(event),
        bool(sync),
    )


def import_kind(device: torch.device, tensor_parallel_size: int) -> str:
    """The export kind a worker on `device` can copy from ("": none; a tensor-parallel worker's
    cache is split over ranks that would all have to copy)."""
    if tensor_parallel_size != 1:
        return ""
    return "cuda_ipc" if device.type == "cuda" else "shm"


# ----- import -----
def _open(export: KVExport, device: torch.device) -> list[torch.Tensor]:
    dtype = torch_dtype(export.dtype)
    shape = tuple(export.layer_shape)
    if export.kind == "shm":
        if "/" in export.shm_name or not export.shm_name.startswith(SHM_PREFIX):
            raise ValueError(f"not a KV segment name: {export.shm_name!r}")
        elem = torch.empty((), dtype=dtype).element_size()
        layer_bytes = elem * int(torch.Size(shape).numel())
        fd = os.open(os.path.join(SHM_DIR, export.shm_name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < layer_bytes * export.num_layers:
                raise ValueError("the KV segment is smaller than its export says")
            m = mmap.mmap(fd, layer_bytes * export.num_layers)
        finally:
            os.close(fd)
        return _layers_of(m, shape, dtype, export.num_layers, layer_bytes)
    if export.kind == "cuda_ipc":
        if device.type != "cuda":
            raise ValueError("a CUDA export opens on a CUDA worker only")
        index = device.index if device.index is not None else torch.cuda.current_device()
        return [_open_ipc(h, index, dtype, shape) for h in export.layers]
    raise ValueError(f"unknown KV export kind {export.kind!r}")


def _open_ipc(
    h: CudaIpcHandle, device_index: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """One peer layer, mapped on this worker's device (not the producer's index, which names
    another GPU or none here)."""
    storage = torch.UntypedStorage._new_shared_cuda(
        device_index, h.handle, h.size_bytes, h.offset_bytes, h.ref_counter_handle, h.ref_counter_offset,
        h.event_handle, h.event_sync_required,
    )  # fmt: skip
    t = torch.empty((0,), dtype=dtype, device=torch.device("cuda", device_index))
    t.set_(storage, 0, shape)
    return t


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs where both ids go up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copy_blocks(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], src_ids: list[int], dst_ids: list[int]
) -> int:
    """Copy blocks src_ids[i] -> dst_ids[i] in every layer (dim 1 of [2, blocks, ...]), as bytes;
    queued on the current stream. Returns the bytes copied."""
    if not src_ids:
        return 0
    runs = _runs(src_ids, dst_ids)
    s_idx = d_idx = None
    if len(runs) > MAX_SLICE_RUNS:
        device = dst[0].device
        s_idx = torch.tensor(src_ids, dtype=torch.int64).to(device, non_blocking=True)
        d_idx = torch.tensor(dst_ids, dtype=torch.int64).to(device, non_blocking=True)
    nbytes = 0
    for s, d in zip(src, dst, strict=True):
        s8, d8 = s.view(torch.uint8), d.view(torch.uint8)
        if s_idx is None:
            for s0, d0, n in runs:
                d8[:, d0 : d0 + n].copy_(s8[:, s0 : s0 + n], non_blocking=True)
        else:
            assert d_idx is not None
            d8.index_copy_(1, d_idx, s8.index_select(1, s_idx))
        nbytes += d8[:, :1].numel() * len(src_ids)
    return nbytes


@dataclass
class CopyReport:
    failed: dict[str, int]  # seq_id -> index (in the sequence's blocks) of its first block to compute
    nbytes: int = 0
    seconds: float = 0.0


class PeerCopier:
    """The decode side: opens peers' exports (once each, cached by export id) and copies blocks."""

    def __init__(self, caches: list[torch.Tensor], device: torch.device) -> None:
        self.caches = caches  # the live list (sleep empties and refills it)
        self.device = device
        self._opened: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
        self.host = host_id()

    def apply(self, copies: list[PeerCopy], index_of: Callable[[str, int], int]) -> CopyReport:
        """Do a plan's peer copies; `index_of(seq_id, block)`: the block's index in the sequence."""
        report = CopyReport({})
        started = time.perf_counter()
        for c in copies:
            if not c.dst_block_ids:
                continue
            try:
                src = self._peer(c.source)
                self._check_ids(c, src[0].shape[1])
                report.nbytes += copy_blocks(src, self.caches, c.src_block_ids, c.dst_block_ids)
            except Exception as e:  # anything: the sequence computes these blocks instead
                log.warning("kv peer copy failed", extra={"seq_id": c.seq_id, "error": repr(e)})
                report.failed[c.seq_id] = index_of(c.seq_id, c.dst_block_ids[0])
        report.seconds = time.perf_counter() - started
        return report

    def _check_ids(self, c: PeerCopy, peer_blocks: int) -> None:
        """Out-of-range ids raise here, on the host: on CUDA an index kernel would assert on the
        device and take the worker's context down with it."""
        if len(c.src_block_ids) != len(c.dst_block_ids):
            raise ValueError("src and dst block ids differ in length")
        mine = self.caches[0].shape[1]
        ok_src = all(0 <= b < peer_blocks for b in c.src_block_ids)
        if not ok_src or not all(0 <= b < mine for b in c.dst_block_ids):
            raise ValueError("a block id is out of range")

    def _peer(self, export: KVExport) -> list[torch.Tensor]:
        layers = self._opened.get(export.export_id)
        if layers is None:
            self._check_layout(export)
            layers = _open(export, self.device)
            self._opened[export.export_id] = layers
            while len(self._opened) > MAX_OPEN_PEERS:
                self._opened.popitem(last=False)
        self._opened.move_to_end(export.export_id)
        return layers

    def _check_layout(self, export: KVExport) -> None:
        if export.host_id != self.host:
            raise ValueError(f"the peer is on another host ({export.host_id})")
        if not self.caches:
            raise ValueError("this worker's KV cache is released (asleep)")
        mine = self.caches[0]
        theirs = list(export.layer_shape)
        if export.dtype != str(mine.dtype).removeprefix("torch.") or export.num_layers != len(self.caches):
            raise ValueError(f"peer layout {export.dtype} x {export.num_layers} layers differs")
        if len(theirs) != mine.dim() or theirs[0] != mine.shape[0] or theirs[2:] != list(mine.shape[2:]):
            raise ValueError(f"peer block shape {theirs} differs from {list(mine.shape)}")

    def forget(self) -> None:
        self._opened.clear()
