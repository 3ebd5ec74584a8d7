"""KV tiers below the pool: blocks the prefix cache evicted, kept in host memory and on disk.

One :class:`KVTiers` per rank holds that rank's part of each block (its K/V heads of every
layer) as one flat payload, keyed by the block's prefix hash (docs/kv-tiers.md):

- **host**: payloads in memory, LRU within ``host_bytes``; a block it evicts goes to the disk
  tier when there is one (or is dropped).
- **disk**: one file per block in a folder private to this engine, LRU within
  ``disk_bytes``; written by one writer thread, never by the engine's loop. The bytes waiting
  for the writer are bounded (``max_backlog_bytes``): past the bound a block is dropped and
  the drop counted, so a slow disk never holds a step. ``prefetch`` has a reader thread copy
  blocks a queued request will want from disk into the host tier (checked as any read), so
  its admission loads them from memory.

Each block carries a header (:data:`HEADER`: a magic, the pool's layout fingerprint, the
block's hash, the payload's length and its CRC-32), written with it and checked on every read:
a block that fails any check, or a file that cannot be read, is a miss (and is forgotten),
never a payload of the wrong content. A disk folder left by an earlier engine is never
trusted: each engine writes into a folder of its own, made at start, and deletes those of
engines that are no longer alive.

Threads: the engine's loop calls :meth:`KVTiers.save`, :meth:`KVTiers.read`,
:meth:`KVTiers.tier_of` and :meth:`KVTiers.prefetch`; the writer thread moves blocks to disk,
the reader thread prefetched ones up; one lock guards the indexes and the counters they
share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import secrets
import shutil
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from pdserve.worker_api import KV_TIER_DISK, KV_TIER_HOST

logger = logging.getLogger(__name__)

MAGIC = b"PDKVTIER"
# magic, layout fingerprint, block hash, payload bytes, CRC-32 of the payload
HEADER = struct.Struct("<8s32s32sQI")
FOLDER_PREFIX = "pdserve-kv-"  # an engine's folder: FOLDER_PREFIX + "<pid>-<random>"


@dataclasses.dataclass
class TierCounters:
    """What the tiers did since the engine started (the worker's stats report them)."""

    host_read_bytes: int = 0
    disk_read_bytes: int = 0
    host_read_s: float = 0.0
    disk_read_s: float = 0.0
    host_written_bytes: int = 0
    disk_written_bytes: int = 0
    evictions: int = 0  # blocks dropped from the lowest tier holding them
    read_failures: int = 0  # blocks that failed a check or a read
    write_failures: int = 0  # disk writes that failed, or blocks dropped for the backlog
    prefetched_blocks: int = 0  # blocks copied from disk to host for a queued request


class KVTiers:
    """The host and disk tiers of one rank's pool."""

    def __init__(self, fingerprint: bytes, block_nbytes: int, host_bytes: int,
                 disk_bytes: int = 0, disk_dir: str | None = None, events=None,
                 max_backlog_bytes: int | None = None):
        if len(fingerprint) != 32:
            raise ValueError("fingerprint must be 32 bytes")
        self.fingerprint = fingerprint
        self.block_nbytes = block_nbytes
        self.host_capacity = host_bytes
        self.disk_capacity = disk_bytes
        self.events = events  # a KVEventLog told of every block gained and lost (or None)
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._host: OrderedDict[bytes, tuple[np.ndarray, int]] = OrderedDict()  # LRU first
        self._host_used = 0
        self._disk: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, LRU first
        self._disk_used = 0
        self.folder: Path | None = None
        self._queue: queue.Queue | None = None
        self._backlog = 0  # bytes queued for the writer
        self._writing: dict[bytes, tuple[np.ndarray, int]] = {}  # queued blocks: readable
        # (from memory) until their file is written
        self.max_backlog_bytes = (max_backlog_bytes if max_backlog_bytes is not None
                                  else max(64 << 20, 8 * block_nbytes))
        self._prefetches: queue.Queue | None = None
        self._coming_up: set[bytes] = set()  # on disk, queued for the reader thread
        if disk_bytes and disk_dir:
            self.folder = _own_folder(Path(disk_dir))
            if self.folder is not None:
                self._queue = queue.Queue()
                self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                                name="kv-tier-writer")
                self._writer.start()
                if host_bytes:
                    self._prefetches = queue.Queue()
                    self._reader = threading.Thread(target=self._prefetch_loop, daemon=True,
                                                    name="kv-tier-reader")
                    self._reader.start()

    # ---- what is held -------------------------------------------------------------------

    def tier_of(self, block_hash: bytes) -> int | None:
        """The best tier holding ``block_hash`` (KV_TIER_HOST or KV_TIER_DISK), or None."""
        with self._lock:
            if block_hash in self._host:
                return KV_TIER_HOST
            if block_hash in self._disk or block_hash in self._writing:
                return KV_TIER_DISK
        return None

    def usage(self) -> dict[str, int]:
        """Blocks and bytes per tier now."""
        with self._lock:
            return dict(host_blocks=len(self._host), host_bytes=self._host_used,
                        disk_blocks=len(self._disk), disk_bytes=self._disk_used)

    # ---- down ---------------------------------------------------------------------------

    def save(self, block_hash: bytes, payload: np.ndarray) -> None:
        """Keep ``payload`` (one block, flat uint8, owned by the tiers from now on) in the host
        tier, or, with no host tier, hand it to the disk writer. Never raises, never waits."""
        crc = zlib.crc32(payload)
        nbytes = payload.nbytes
        if nbytes > self.host_capacity:
            self._to_disk(block_hash, payload, crc)
            return
        evicted = []
        with self._lock:
            old = self._host.pop(block_hash, None)
            if old is not None:
                self._host_used -= old[0].nbytes
            self._host[block_hash] = (payload, crc)
            self._host_used += nbytes
            while self._host_used > self.host_capacity:
                h, (data, old_crc) = self._host.popitem(last=False)
                self._host_used -= data.nbytes
                evicted.append((h, data, old_crc))
            self.counters.host_written_bytes += nbytes
        self._tell(block_hash, KV_TIER_HOST, True)
        for h, data, old_crc in evicted:
            self._tell(h, KV_TIER_HOST, False)
            self._to_disk(h, data, old_crc)

    def _to_disk(self, block_hash: bytes, payload: np.ndarray, crc: int) -> None:
        with self._lock:
            if self._queue is None:
                self.counters.evictions += 1
                return
            if self._backlog + payload.nbytes > self.max_backlog_bytes:
                self.counters.write_failures += 1
                self.counters.evictions += 1
                return
            self._backlog += payload.nbytes
            self._writing[block_hash] = (payload, crc)
        self._queue.put((block_hash, payload, crc))

    def _write_loop(self) -> None:
        assert self._queue is not None and self.folder is not None
        while (item := self._queue.get()) is not None:
            block_hash, payload, crc = item
            with self._lock:  # (forgotten or queued again since: not this write)
                current = self._writing.get(block_hash, (None,))[0] is payload
            try:
                if current:
                    self._write(block_hash, payload, crc)
            finally:
                with self._lock:
                    self._backlog -= payload.nbytes
                    if current:
                        del self._writing[block_hash]

    def _write(self, block_hash: bytes, payload: np.ndarray, crc: int) -> None:
        assert self.folder is not None
        path = self.folder / block_hash.hex()
        temp = path.with_suffix(".part")
        header = HEADER.pack(MAGIC, self.fingerprint, block_hash, payload.nbytes, crc)
        try:
            with open(temp, "wb") as f:
                f.write(header)
                f.write(memoryview(payload))
            os.replace(temp, path)
        except OSError as exc:
            with self._lock:
                self.counters.write_failures += 1
                self.counters.evictions += 1
            logger.warning("KV disk tier: writing a block to %s failed (%s); it is dropped",
                           self.folder, exc)
            with contextlib.suppress(OSError):
                temp.unlink()
            return
        size = HEADER.size + payload.nbytes
        dropped = []
        with self._lock:
            old = self._disk.pop(block_hash, None)
            self._disk_used += size - (old or 0)
            self._disk[block_hash] = size
            while self._disk_used > self.disk_capacity and self._disk:
                h, h_size = self._disk.popitem(last=False)
                self._disk_used -= h_size
                dropped.append(h)
            self.counters.disk_written_bytes += size
            self.counters.evictions += len(dropped)
        self._tell(block_hash, KV_TIER_DISK, True)
        for h in dropped:
            self._unlink(h)
            self._tell(h, KV_TIER_DISK, False)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until the writer has written everything queued (tests, close)."""
        deadline = time.monotonic() + timeout_s
        while self._queue is not None and time.monotonic() < deadline:
            with self._lock:
                if not self._backlog:
                    return
            time.sleep(0.005)

    # ---- up -----------------------------------------------------------------------------

    @property
    def prefetches(self) -> bool:
        """Whether :meth:`prefetch` does anything (a disk tier and a host tier)."""
        return self._prefetches is not None

    def prefetch(self, hashes: list[bytes]) -> None:
        """Copy the blocks of ``hashes`` (a prefix's, in order) that are on disk into the host
        tier, on the reader thread (nothing without a disk and a host tier); returns at once.
        Those already in host memory are used first, so the copies do not push them down."""
        if self._prefetches is not None and hashes:
            with self._lock:
                self._coming_up.update(h for h in hashes
                                       if h not in self._host and h in self._disk)
            self._prefetches.put(hashes)

    def coming_up(self, hashes: list[bytes]) -> bool:
        """Whether any of ``hashes`` is on its way from disk to host memory (queued by
        :meth:`prefetch`, not read yet)."""
        with self._lock:
            return not self._coming_up.isdisjoint(hashes)

    def _prefetch_loop(self) -> None:
        assert self._prefetches is not None
        while (hashes := self._prefetches.get()) is not None:
            with self._lock:
                for block_hash in hashes:
                    if block_hash in self._host:
                        self._host.move_to_end(block_hash)
            try:
                for block_hash in hashes:
                    with self._lock:
                        on_disk = block_hash not in self._host and block_hash in self._disk
                    if on_disk:
                        payload = self.read(block_hash)
                        if payload is None:
                            break  # (the chain ends at a block that failed)
                        self.save(block_hash, payload)
                        with self._lock:
                            self.counters.prefetched_blocks += 1
                    with self._lock:
                        self._coming_up.discard(block_hash)
            finally:
                with self._lock:
                    self._coming_up.difference_update(hashes)

    def read(self, block_hash: bytes) -> np.ndarray | None:
        """The payload of ``block_hash`` from the best tier holding it, checked; None when no
        tier holds it or its check or read failed (then it is forgotten)."""
        start = time.perf_counter()
        with self._lock:
            held = self._host.get(block_hash)
            tier = KV_TIER_HOST
            if held is not None:
                self._host.move_to_end(block_hash)
            else:
                held, tier = self._writing.get(block_hash), KV_TIER_DISK
            on_disk = held is None and block_hash in self._disk
            if on_disk:
                self._disk.move_to_end(block_hash)
        if held is not None:  # in memory: the host tier, or on its way to disk
            payload, crc = held
            if payload.nbytes == self.block_nbytes and zlib.crc32(payload) == crc:
                self._count_read(tier, payload.nbytes, time.perf_counter() - start)
                return payload
            self._fail(block_hash, tier, "its checksum does not match")
            return None
        if not on_disk:
            return None
        payload, why = self._read_file(block_hash)
        if payload is None:
            self._fail(block_hash, KV_TIER_DISK, why)
            return None
        self._count_read(KV_TIER_DISK, payload.nbytes, time.perf_counter() - start)
        return payload

    def _count_read(self, tier: int, nbytes: int, seconds: float) -> None:
        c = self.counters
        with self._lock:  # (the loop and the reader thread both read)
            if tier == KV_TIER_HOST:
                c.host_read_bytes += nbytes
                c.host_read_s += seconds
            else:
                c.disk_read_bytes += nbytes
                c.disk_read_s += seconds

    def _read_file(self, block_hash: bytes) -> tuple[np.ndarray | None, str]:
        """(the checked payload, "") or (None, why not)."""
        assert self.folder is not None
        try:
            with open(self.folder / block_hash.hex(), "rb") as f:
                header = f.read(HEADER.size)
                if len(header) != HEADER.size:
                    return None, "its file is truncated"
                magic, fingerprint, stored_hash, nbytes, crc = HEADER.unpack(header)
                if magic != MAGIC or fingerprint != self.fingerprint \
                        or stored_hash != block_hash or nbytes != self.block_nbytes:
                    return None, "its file's header does not match this pool's block"
                payload = np.empty(nbytes, dtype=np.uint8)
                if f.readinto(memoryview(payload)) != nbytes or f.read(1):
                    return None, "its file has the wrong length"
        except OSError as exc:
            return None, f"reading its file failed ({exc})"
        if zlib.crc32(payload) != crc:
            return None, "its checksum does not match"
        return payload, ""

    def _fail(self, block_hash: bytes, tier: int, why: str) -> None:
        with self._lock:
            self.counters.read_failures += 1
        logger.warning("KV %s tier: block %s… is not used, %s; its tokens are recomputed",
                       "host" if tier == KV_TIER_HOST else "disk", block_hash.hex()[:12], why)
        self.forget(block_hash)

    def forget(self, block_hash: bytes) -> None:
        """Drop ``block_hash`` from every tier."""
        with self._lock:
            held = self._host.pop(block_hash, None)
            if held is not None:
                self._host_used -= held[0].nbytes
            size = self._disk.pop(block_hash, None)
            if size is not None:
                self._disk_used -= size
            self._writing.pop(block_hash, None)
        if held is not None:
            self._tell(block_hash, KV_TIER_HOST, False)
        if size is not None:
            self._unlink(block_hash)
            self._tell(block_hash, KV_TIER_DISK, False)

    # ---- the rest -----------------------------------------------------------------------

    def _unlink(self, block_hash: bytes) -> None:
        assert self.folder is not None
        with contextlib.suppress(OSError):
            (self.folder / block_hash.hex()).unlink()

    def _tell(self, block_hash: bytes, tier: int, held: bool) -> None:
        if self.events is not None:
            (self.events.tier_stored if held else self.events.tier_removed)(block_hash, tier)

    def close(self) -> None:
        """Stop the reader and the writer and delete this engine's disk folder."""
        if self._prefetches is not None:
            self._prefetches.put(None)
            self._reader.join(timeout=10)
            self._prefetches = None
        if self._queue is not None:
            self._queue.put(None)
            self._writer.join(timeout=10)
            self._queue = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def _own_folder(root: Path) -> Path | None:
    """A new folder of this engine's under ``root`` (made mode 0700, as ``root`` when it is
    made here), after deleting the folders of engines no longer alive; None, with a warning,
    when ``root`` cannot be used (another user's, or not writable): no disk tier then."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = root.stat()
        if info.st_uid != os.getuid():
            raise PermissionError(f"it belongs to uid {info.st_uid}, this worker runs as "
                                  f"uid {os.getuid()}")
        if stat.S_IMODE(info.st_mode) & 0o077:
            os.chmod(root, 0o700)
        for old in root.glob(FOLDER_PREFIX + "*"):
            pid = old.name[len(FOLDER_PREFIX):].partition("-")[0]
            if not pid.isdigit() or not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        folder = root / f"{FOLDER_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        folder.mkdir(mode=0o700)
        return folder
    except OSError as exc:
        logger.warning("KV disk tier off: %s cannot be used (%s); give --kv-offload-dir a "
                       "folder this worker owns", root, exc)
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
