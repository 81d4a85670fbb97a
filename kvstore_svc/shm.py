"""Shared memory segments between a KV store client and a store on the same host.

A client (a worker) creates segments under /dev/shm, named `llmesh-kv-<pid>-<random>`,
and names a region of one in GetShared / PutShared (kvstore.proto): payload bytes then
cross between the two processes through that memory instead of through gRPC.

- `Segment` / `SegmentPool` are the client's side: it owns the files (mode 0600, pages
  committed up front with posix_fallocate, so that a full tmpfs is an error when the
  segment is made, never a SIGBUS in the middle of a copy) and unlinks them when it closes,
  at exit, or, for segments of a process that died, the next time a pool of the same user
  starts. One caller at a time per segment (a lease).
- `SegmentMaps` is the store's side: it opens only names with the fixed prefix directly
  under the directory (no links), checks every region against the file's size, and keeps
  a bounded number of mappings, dropped once their file is gone or replaced.

Plain Python (os, mmap): no torch, no protobuf.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "llmesh-kv-"
_NAME = re.compile(r"llmesh-kv-[A-Za-z0-9_-]{8,80}")
_OWN_NAME = re.compile(r"llmesh-kv-(\d+)-[0-9a-f]+")
# Payloads start at multiples of this in a region: any dtype's view of them is aligned.
ALIGN = 64
DEFAULT_SEGMENT_BYTES = 128 << 20
# Mappings the store keeps at once (least recently used dropped beyond).
MAX_STORE_MAPS = 64
# How often, at most, the store checks that the files of its mappings still exist.
SWEEP_EVERY_S = 1.0


class SegmentUnavailable(Exception):
    """The store cannot use the segment a client named (another host or container, gone, resized)."""


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def copy_into(dst: memoryview, src) -> None:
    """dst[:] = src for large payloads without holding the GIL: numpy's copy releases it, where a
    memoryview assignment holds it for the whole memcpy (~3 ms per 32 MiB chunk), stalling a
    worker's step thread while its sender thread puts."""
    import numpy as np

    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def check_name(name: str) -> None:
    """ValueError unless `name` is a segment name a store may open."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"segment name {name[:100]!r} is not {PREFIX!r} followed by 8..80 of [A-Za-z0-9_-]")


def available(root: str = SHM_DIR) -> bool:
    """Whether this host offers a shared memory directory this process can write."""
    return os.path.isdir(root) and os.access(root, os.W_OK | os.X_OK)


@dataclass(frozen=True)
class Region:
    """[offset, offset + length) of a segment of `segment_bytes` bytes (kvstore.proto SharedRegion)."""

    segment: str
    segment_bytes: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def check(self) -> None:
        """ValueError naming what is wrong: a bad name, an empty region, one past the segment's end."""
        check_name(self.segment)
        if self.segment_bytes < 1:
            raise ValueError("segment_bytes must be >= 1")
        if self.length < 1 or self.end > self.segment_bytes:
            raise ValueError(
                f"region [{self.offset}, {self.end}) is empty or outside the segment of "
                f"{self.segment_bytes} bytes"
            )

    def holds(self, offset: int, length: int) -> bool:
        """Whether [offset, offset + length) lies inside the region."""
        return self.offset <= offset and offset + length <= self.end


# -- the client's side -------------------------------------------------------------


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Segment:
    """A shared memory file this process made and owns; `close()` unmaps and unlinks it."""

    def __init__(self, size: int, root: str = SHM_DIR) -> None:
        if size < ALIGN:
            raise ValueError(f"segment size must be >= {ALIGN} bytes, got {size}")
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.size = size
        self.path = os.path.join(root, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            _unlink(self.path)
            raise
        finally:
            os.close(fd)
        # Set when a call on it ended without its answer (a deadline, a dead store): the store may
        # still be writing into it, so it is never handed out again (see SegmentPool.lease).
        self.spoiled = False
        # Unlinked even if the owner forgets close() or the interpreter exits first.
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        self.view = memoryview(self._mm)

    def region(self) -> Region:
        return Region(self.name, self.size, 0, self.size)

    def close(self) -> None:
        self._finalizer()  # unlinks (once): the store's mapping, if any, dies with its last user
        self.view.release()
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view: the mapping goes with it
            pass


def sweep_orphans(root: str = SHM_DIR, pattern: re.Pattern[str] = _OWN_NAME) -> int:
    """Unlink this user's files named by `pattern` (group 1: the creating pid) whose creating
    process is gone (it was killed): how many. Segments by default; the store's arenas too."""
    removed = 0
    uid = os.getuid()
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != uid:
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            _unlink(path)
            removed += 1
        except OSError:  # gone meanwhile, or a live process of another user
            continue
    return removed


class SegmentPool:
    """Up to `count` segments of `size` bytes, made when first needed; a lease gives one to one caller.

    `on_create(segment)` / `on_close(segment)` let the owner act on each segment once (e.g.
    page-lock it for a device); they run under no lock of the pool's.
    """

    def __init__(
        self,
        size: int = DEFAULT_SEGMENT_BYTES,
        count: int = 2,
        root: str = SHM_DIR,
        on_create: Callable[[Segment], None] | None = None,
        on_close: Callable[[Segment], None] | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.size, self.count, self.root = size, count, root
        self.on_create, self.on_close = on_create, on_close
        self._free: list[Segment] = []
        self._all: list[Segment] = []
        self._cond = threading.Condition()
        self._closed = False
        # Now, not at the first segment: a worker restarted after a crash may not load or put
        # for a long time, and its dead self's segments hold memory until someone sweeps them.
        if available(root) and (n := sweep_orphans(root)):
            log.info("removed shared memory segments of dead processes", extra={"segments": n})

    @contextlib.contextmanager
    def lease(self) -> Iterator[Segment]:
        """A segment for this caller alone until the block ends (waits while all are leased).

        A block that raises spoils its segment: it is unlinked and never handed out again (the
        store may still be copying into it for a call the caller gave up on).

        OSError when a new segment cannot be made (e.g. /dev/shm is full).
        """
        segment = self._take()
        try:
            yield segment
        except BaseException:
            segment.spoiled = True  # a call that failed may leave the store writing into it
            raise
        finally:
            self._give_back(segment)

    def prepare(self) -> None:
        """Make every segment now (and run `on_create`), not at the first transfers."""
        taken: list[Segment] = []
        try:
            while len(taken) < self.count and not self.full():
                taken.append(self._take())
        finally:
            for segment in taken:
                self._give_back(segment)

    def full(self) -> bool:
        """Whether every segment the pool may hold exists (made, or being made)."""
        with self._cond:
            return len(self._all) >= self.count

    def _take(self) -> Segment:
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the segment pool is closed")
                if self._free:
                    return self._free.pop()
                if len(self._all) < self.count:
                    self._all.append(None)  # type: ignore[arg-type]  # a place reserved while it is made
                    break
                self._cond.wait()
        try:
            segment = Segment(self.size, self.root)
            if self.on_create is not None:
                self.on_create(segment)
        except BaseException:
            with self._cond:
                self._all.remove(None)  # type: ignore[arg-type]
                self._cond.notify()
            raise
        with self._cond:
            self._all[self._all.index(None)] = segment  # type: ignore[arg-type]
        return segment

    def _give_back(self, segment: Segment) -> None:
        with self._cond:
            drop = self._closed or segment.spoiled
            if drop:
                self._all.remove(segment)  # a spoiled one: a fresh one is made for the next caller
            else:
                self._free.append(segment)
            self._cond.notify()
        if drop:
            self._close_one(segment)

    def _close_one(self, segment: Segment) -> None:
        if self.on_close is not None:
            try:
                self.on_close(segment)
            except Exception as e:  # noqa: BLE001  # the unlink below matters more
                log.warning("closing a shared memory segment", extra={"error": repr(e)})
        segment.close()

    @property
    def names(self) -> list[str]:
        with self._cond:
            return [s.name for s in self._all if s is not None]

    def close(self) -> None:
        """Unlink every segment now; a leased one is unmapped when its lease ends."""
        with self._cond:
            self._closed = True
            free, self._free = self._free, []
            leased = [s for s in self._all if s is not None and s not in free]
            self._all = [s for s in self._all if s not in free]
            self._cond.notify_all()
        for segment in leased:
            segment._finalizer()  # unlink now; unmapped by _give_back
        for segment in free:
            self._close_one(segment)


# -- the store's side --------------------------------------------------------------


class _Mapping:
    def __init__(self, mm: mmap.mmap, ident: tuple[int, int], size: int) -> None:
        self.mm, self.ident, self.size = mm, ident, size
        self.users = 0
        self.dropped = False

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # pragma: no cover  # every view is released before users reaches 0
            pass


class SegmentMaps:
    """The store's mappings of its clients' segments, by name (thread-safe).

    A mapping is reused while the file under the name is the same one (device, inode) and of
    the size the call names; a client that made a new segment under an old name, resized it
    or went away gets a fresh mapping or a SegmentUnavailable. At most `max_maps` are kept.
    """

    def __init__(self, root: str = SHM_DIR, max_maps: int = MAX_STORE_MAPS) -> None:
        self.root, self.max_maps = root, max_maps
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._lock = threading.Lock()
        self._next_sweep = 0.0

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)

    @contextlib.contextmanager
    def open(self, region: Region) -> Iterator[memoryview]:
        """The whole segment of `region`, writable, for the duration of the block.

        ValueError for a malformed region; SegmentUnavailable when the file cannot be opened
        here or is not a regular file of region.segment_bytes bytes.
        """
        region.check()
        mapping = self._acquire(region.segment, region.segment_bytes)
        view = memoryview(mapping.mm)
        try:
            yield view
        finally:
            view.release()
            self._release(mapping)

    def _acquire(self, name: str, size: int) -> _Mapping:
        self._sweep()
        path = os.path.join(self.root, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise SegmentUnavailable(f"cannot open shared memory segment {name}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentUnavailable(f"{name} is not a regular file")
            if st.st_size != size:
                raise SegmentUnavailable(f"segment {name} is {st.st_size} bytes, the call says {size}")
            ident = (st.st_dev, st.st_ino)
            with self._lock:
                mapping = self._maps.get(name)
                if mapping is not None and mapping.ident == ident and mapping.size == size:
                    self._maps.move_to_end(name)
                    mapping.users += 1
                    return mapping
            try:
                mm = mmap.mmap(fd, size)
            except (OSError, ValueError) as e:
                raise SegmentUnavailable(f"cannot map segment {name}: {e}") from None
        finally:
            os.close(fd)
        fresh = _Mapping(mm, ident, size)
        fresh.users = 1
        with self._lock:
            old = self._maps.pop(name, None)
            self._maps[name] = fresh
            stale = [old] if old is not None else []
            while len(self._maps) > self.max_maps:
                stale.append(self._maps.popitem(last=False)[1])
            to_close = self._drop(stale)
        for m in to_close:
            m.close()
        return fresh

    def _drop(self, mappings: list[_Mapping]) -> list[_Mapping]:
        """Under the lock: mark `mappings` dropped; those no call uses now are returned to close."""
        out = []
        for m in mappings:
            m.dropped = True
            if m.users == 0:
                out.append(m)
        return out

    def _release(self, mapping: _Mapping) -> None:
        with self._lock:
            mapping.users -= 1
            close = mapping.dropped and mapping.users == 0
        if close:
            mapping.close()

    def _sweep(self) -> None:
        """Drop mappings whose file is gone or was replaced (its client closed or died)."""
        now = time.monotonic()
        with self._lock:
            if now < self._next_sweep:
                return
            self._next_sweep = now + SWEEP_EVERY_S
            names = list(self._maps.items())
        gone = []
        for name, m in names:
            try:
                st = os.stat(os.path.join(self.root, name), follow_symlinks=False)
                if (st.st_dev, st.st_ino) == m.ident:
                    continue
            except OSError:
                pass
            gone.append(name)
        if not gone:
            return
        with self._lock:
            stale = [self._maps.pop(n) for n in gone if n in self._maps]
            to_close = self._drop(stale)
        for m in to_close:
            m.close()

    def close(self) -> None:
        with self._lock:
            to_close = self._drop(list(self._maps.values()))
            self._maps.clear()
        for m in to_close:
            m.close()
