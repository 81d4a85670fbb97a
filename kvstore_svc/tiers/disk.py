"""The disk tier: one file per entry under a directory, least recently used evicted first.

Layout: `DIR/<fingerprint hex>/<key hex>.kv`, each file one blob. Writes go to
a temp file beside the target and are renamed into place, so a reader (or a
restart after a crash) sees a whole entry or none. No fsync: this is a cache,
and a file that a power cut truncates fails its checksum on read and counts as
a miss. At start the directory is scanned (file names and sizes, no contents),
so entries survive a restart; recency comes from file mtimes, which reads
refresh. One store per directory: a lock file refuses a second one.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvstore_svc.tiers.base import Counters, EntryKey, TierStats

log = logging.getLogger(__name__)

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"


def _from_hex(text: str) -> bytes | None:
    try:
        return bytes.fromhex(text) if text and len(text) % 2 == 0 else None
    except ValueError:
        return None


class DiskTier:
    name = "disk"

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.root = Path(directory)
        self.capacity_bytes = capacity_bytes
        # Only this user: KV bytes reveal prompts, and file names (chunk keys) say which were sent.
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_file = self._take_dir_lock()
        self._index: OrderedDict[EntryKey, int] = OrderedDict()  # key -> file size, oldest first
        self._used = 0
        self._lock = threading.Lock()
        self._counters = Counters()
        self._made_dirs: set[str] = set()
        self._scan()

    # -- start-up ----------------------------------------------------------------

    def _take_dir_lock(self):
        handle = open(self.root / LOCK_NAME, "a+b")  # held open (and locked) for the tier's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise RuntimeError(f"{self.root} is in use by another KV store process") from None
        return handle

    def _scan(self) -> None:
        found: list[tuple[float, EntryKey, int]] = []
        stale = 0
        for fp_dir in os.scandir(self.root):
            fingerprint = _from_hex(fp_dir.name)
            if fingerprint is None or not fp_dir.is_dir(follow_symlinks=False):
                continue
            self._made_dirs.add(fp_dir.name)
            for f in os.scandir(fp_dir.path):
                if f.name.endswith(TMP_SUFFIX):  # a writer that died mid-write
                    self._unlink(f.path)
                    stale += 1
                    continue
                key = _from_hex(f.name.removesuffix(SUFFIX)) if f.name.endswith(SUFFIX) else None
                if key is None or not f.is_file(follow_symlinks=False):
                    continue
                st = f.stat(follow_symlinks=False)
                found.append((st.st_mtime, EntryKey(fingerprint, key), st.st_size))
        found.sort(key=lambda t: t[0])
        for _, key, size in found:
            self._index[key] = size
            self._used += size
        evicted = self._evict_to_fit(0)  # the budget may have shrunk since the last run
        for key in evicted:
            self._unlink(self._path(key))
        log.info(
            "disk tier scanned",
            extra={
                "dir": str(self.root),
                "entries": len(self._index),
                "bytes": self._used,
                "evicted": len(evicted),
                "stale_temp_files": stale,
            },
        )

    # -- paths -------------------------------------------------------------------

    def _path(self, key: EntryKey) -> Path:
        return self.root / key.fingerprint.hex() / f"{key.key.hex()}{SUFFIX}"

    def _ensure_dir(self, key: EntryKey) -> None:
        name = key.fingerprint.hex()
        if name not in self._made_dirs:
            (self.root / name).mkdir(mode=0o700, exist_ok=True)
            self._made_dirs.add(name)

    def _unlink(self, path: str | Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._counters.add("errors")
            log.warning("disk tier could not delete a file", extra={"path": str(path), "error": str(e)})

    def _evict_to_fit(self, size: int) -> list[EntryKey]:
        """Drop LRU entries from the index until `size` more bytes fit (caller holds the lock)."""
        victims: list[EntryKey] = []
        while self._index and self._used + size > self.capacity_bytes:
            key, old = self._index.popitem(last=False)
            self._used -= old
            victims.append(key)
        return victims

    # -- the Tier interface --------------------------------------------------------

    def get(self, key: EntryKey) -> bytes | None:
        with self._lock:
            present = key in self._index
            if present:
                self._index.move_to_end(key)
        if not present:
            self._counters.add("misses")
            return None
        path = self._path(key)
        try:
            blob = path.read_bytes()
            os.utime(path)  # recency survives a restart
        except FileNotFoundError:  # evicted meanwhile, or removed by hand
            self._forget(key)
            self._counters.add("misses")
            return None
        except OSError as e:
            self._counters.add("errors")
            log.warning("disk tier read failed", extra={"path": str(path), "error": str(e)})
            return None
        self._counters.add("hits")
        return blob

    def put(self, key: EntryKey, blob: bytes) -> bool:
        size = len(blob)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._index:  # content-addressed: already there is as good as written
                self._index.move_to_end(key)
                return True
        path = self._path(key)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        try:
            self._ensure_dir(key)
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(blob)
        except OSError as e:
            self._counters.add("errors")
            log.warning("disk tier write failed", extra={"path": str(path), "error": str(e)})
            self._unlink(tmp)
            return False
        with self._lock:
            if key in self._index:  # another thread wrote it meanwhile
                self._unlink(tmp)
                return True
            victims = self._evict_to_fit(size)
            # Unlinks under the lock: a victim re-put concurrently must not lose its new file.
            for victim in victims:
                self._unlink(self._path(victim))
            try:
                os.replace(tmp, path)
            except OSError as e:
                self._counters.add("errors")
                log.warning("disk tier rename failed", extra={"path": str(path), "error": str(e)})
                self._unlink(tmp)
                return False
            self._index[key] = size
            self._used += size
        self._counters.add("puts")
        if victims:
            self._counters.add("evictions", len(victims))
        return True

    def contains(self, key: EntryKey) -> bool:
        with self._lock:
            return key in self._index

    def contains_many(self, keys: Sequence[EntryKey]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def _forget(self, key: EntryKey) -> bool:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
        return size is not None

    def delete(self, key: EntryKey) -> bool:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
                self._unlink(self._path(key))
        return size is not None

    def note_corrupt(self, key: EntryKey) -> None:
        self._counters.add("corrupt")
        log.warning("corrupt entry on disk deleted", extra={"key": key.hex()})
        self.delete(key)

    def stats(self) -> TierStats:
        with self._lock:
            entries, used = len(self._index), self._used
        return self._counters.snapshot(
            self.name, entries=entries, bytes=used, capacity_bytes=self.capacity_bytes
        )

    def close(self) -> None:
        self._lock_file.close()  # releases the directory lock
