"""The store's shared memory arena: one file under /dev/shm that holds the memory tier's payloads.

The STORE owns it (`llmesh-kvstore-<pid>-<random>`, mode 0600: only processes of the store's
user may open it, so workers must run as that user to read in place; others fall back to
GetShared / Get). Workers on the same host map it read-only and copy entries straight out of
it (GetInPlace, kvstore.proto), so a load costs one pass over the bytes instead of three.

- `ArenaFile`: the file and its writable mapping; pages are committed (posix_fallocate) in
  64 MiB steps as the allocator first reaches them, before any byte is written there, so a
  store's budget costs memory only once it is used, and a full /dev/shm refuses a put
  instead of raising SIGBUS in the middle of a copy. Unlinked on close, at exit, or by the
  next store of the same user if this one was killed.
- `FreeSpace`: the allocator over [0, size): free runs indexed by start and by end (O(1)
  coalescing) and by power-of-two size class (first fit within a class, O(number of classes)
  per op). Entries of one fingerprint are mostly one size, so runs rarely fragment.

Plain Python (os, mmap); the tier that uses it (LRU, leases) is kvstore_svc/tiers/arena.py.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import threading
import weakref
from itertools import islice

from kvstore_svc.shm import ALIGN, SHM_DIR, align, sweep_orphans

ARENA_PREFIX = "llmesh-kvstore-"
ARENA_NAME = re.compile(r"llmesh-kvstore-(\d+)-[0-9a-f]{16}")
_CLASSES = 64
# Pages of the arena are committed this many bytes at a time as the allocator reaches them.
COMMIT_STEP = 64 << 20
# Runs of the request's own class looked at before a larger class is split (first fit, bounded).
_SCAN = 16


def check_arena_name(name: str) -> None:
    """ValueError unless `name` is an arena name a worker may open."""
    if not ARENA_NAME.fullmatch(name):
        raise ValueError(f"arena name {name[:100]!r} is not {ARENA_PREFIX!r}<pid>-<16 hex digits>")


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class ArenaFile:
    """A shared memory file of `size` bytes this (store) process made and owns, mapped read-write."""

    def __init__(self, size: int, root: str = SHM_DIR) -> None:
        if size < ALIGN:
            raise ValueError(f"arena size must be >= {ALIGN} bytes, got {size}")
        sweep_orphans(root, ARENA_NAME)  # arenas of killed stores of this user
        st = os.statvfs(root)
        if st.f_bavail * st.f_frsize < size:  # e.g. a container's 64 MiB /dev/shm: keep to the heap
            raise OSError(
                errno.ENOSPC, f"{root} has {st.f_bavail * st.f_frsize} bytes free, the arena needs {size}"
            )
        self.name = f"{ARENA_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.size = size
        self.path = os.path.join(root, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)  # sparse: pages are committed by `commit` as they are first used
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _unlink(self.path)
            raise
        self._fd = fd
        self._committed = 0  # [0, committed) has its pages
        self._commit_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        self.view = memoryview(self._mm)

    def commit(self, end: int) -> bool:
        """Make sure the pages of [0, end) exist; False when /dev/shm has no room for them."""
        if end <= self._committed:
            return True
        with self._commit_lock:
            if end <= self._committed:
                return True
            target = min(self.size, -(-end // COMMIT_STEP) * COMMIT_STEP)
            try:
                os.posix_fallocate(self._fd, self._committed, target - self._committed)
            except OSError:
                try:  # no room for a whole step: just what was asked for
                    os.posix_fallocate(self._fd, self._committed, end - self._committed)
                    target = end
                except OSError:
                    return False
            self._committed = target
            return True

    @property
    def committed(self) -> int:
        return self._committed

    def close(self) -> None:
        """Unlink (workers' mappings stay valid until they drop them) and unmap."""
        self._finalizer()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self.view.release()
        try:
            self._mm.close()
        except BufferError:  # a view is still exported: the mapping goes with it
            pass


def _class(n: int) -> int:
    return n.bit_length() - 1


class FreeSpace:
    """Free runs of [0, size) in ALIGN units; `alloc` / `free` are O(number of size classes)."""

    def __init__(self, size: int) -> None:
        self.size = size - size % ALIGN
        self._by_start: dict[int, int] = {}  # start -> length
        self._by_end: dict[int, int] = {}  # end -> start
        # Runs of length in [2^k, 2^(k+1)), by start (a dict: an ordered set with O(1) removal).
        self._classes: list[dict[int, None]] = [{} for _ in range(_CLASSES)]
        self.free_bytes = 0
        if self.size:
            self._add(0, self.size)

    def _add(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._classes[_class(length)][start] = None
        self.free_bytes += length

    def _remove(self, start: int) -> int:
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        del self._classes[_class(length)][start]
        self.free_bytes -= length
        return length

    def _take(self, start: int, n: int) -> int:
        length = self._remove(start)
        if length > n:
            self._add(start + n, length - n)
        return start

    def alloc(self, n: int) -> int | None:
        """Start of a free run of align(n) bytes now taken, or None if no run is that long."""
        n = align(max(n, 1))
        if n > self.size:
            return None
        k = _class(n)
        own = self._classes[k]
        for start in islice(own, _SCAN):  # runs of n's class may be shorter than n
            if self._by_start[start] >= n:
                return self._take(start, n)
        for j in range(k + 1, _CLASSES):  # any run of a larger class fits
            if self._classes[j]:
                return self._take(next(iter(self._classes[j])), n)
        for start in list(islice(own, _SCAN, None)):  # the rest of n's class, before giving up
            if self._by_start[start] >= n:
                return self._take(start, n)
        return None

    def free(self, start: int, n: int) -> int:
        """Give back [start, start + align(n)); the length of the free run it is now part of."""
        n = align(max(n, 1))
        if start % ALIGN or start < 0 or start + n > self.size:
            raise ValueError(f"[{start}, {start + n}) is not an allocated run of this arena")
        end = start + n
        before = self._by_end.get(start)
        if before is not None:  # coalesce with the run that ends where this one starts
            self._remove(before)
            start = before
        if end in self._by_start:  # ... and with the one that starts where it ends
            end += self._remove(end)
        self._add(start, end - start)
        return end - start

    def largest(self) -> int:
        """The longest free run (O(runs): tests and stats only)."""
        return max(self._by_start.values(), default=0)

    def runs(self) -> list[tuple[int, int]]:
        return sorted(self._by_start.items())
