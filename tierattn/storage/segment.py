"""Segment files: the disk tier's storage, one file of page-aligned slots per tier generation.

A segment holds ``num_layers x capacity`` slots of ``slot_bytes`` (a page rounded up to
:data:`ALIGN`), after one :data:`ALIGN`-byte header (magic, format version, then JSON: the cache
fingerprint, page shape, dtype, layers, capacity, slot size). Slot ``(layer, slot)`` starts at
``ALIGN + (layer * capacity + slot) * slot_bytes``: a page is one aligned extent and the unit
of I/O (read amplification 1). The file is created sparse (``ftruncate``), so it takes disk
space only where pages were written.

What the file does not hold, the :class:`Segment` keeps in memory -- its page map: per slot,
the first token of the page written there (-1: none) and a 64-bit checksum of its bytes
(xxHash's XXH3, :func:`page_digest`). A read checks the map before any I/O and every page's
checksum after it, and raises :class:`~tierattn.errors.KVFileError` naming the slot; the header
is checked when the segment is opened and the file's link count and size before every batch
(a deleted or truncated segment is a fault, not a silent read of stale bytes).

I/O is batched: the slots of a call are sorted, adjacent ones coalesced into one ``pwritev`` /
``preadv`` (up to ``IOV_MAX`` buffers, the pages' own memory: no copy), and large batches split
over a small thread pool (the calls and the checksums release the GIL). Nothing is fsynced: a
tier is a cache of the running process, and its segment is deleted when the tier goes.
:func:`~tierattn.runtime.snapshot.save` is the durable path.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import uuid
import weakref
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from tierattn.errors import KVFileError

try:  # XXH3: ~40 GB/s on one core here, 1.4 us per 64 KiB page (BENCHMARKS.md, "Disk tier")
    import xxhash

    page_digest: Callable[[memoryview], int] = xxhash.xxh3_64_intdigest
    DIGEST = "xxh3_64"
except ImportError:  # a machine without the wheel (a GPU box installed --no-deps): zlib's CRC-32
    page_digest = zlib.crc32
    DIGEST = "crc32"

__all__ = ["ALIGN", "DIGEST", "MAGIC", "Segment", "page_digest", "pool_for", "submit"]

#: slot alignment and header size: a page starts on a 4 KiB boundary (the block size of NVMe
#: drives and of the page cache)
ALIGN = 4096
MAGIC = b"TIERSEG\x01"
#: buffers per preadv/pwritev call (Linux: 1024)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
#: a batch smaller than this is done on the calling thread (a hand-off costs more)
POOL_MIN_BYTES = 1 << 20
THREAD_PREFIX = "tierattn-io"
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None) if hasattr(os, "posix_fadvise") else None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Segment:
    """One segment file and its page map.

    Args:
        directory: folder of the file (created by the caller).
        fingerprint: the cache's identity, recorded in the header.
        num_layers, capacity: slots per layer.
        page_shape, dtype: of a page.
        generation: part of the file name (a snapshot load writes the next generation).
        pool: the thread pool large batches are split over (None: every call inline).
    """

    def __init__(self, directory: Path, fingerprint: str, num_layers: int, capacity: int,
                 page_shape: tuple[int, ...], dtype: torch.dtype, generation: int,
                 pool: ThreadPoolExecutor | None) -> None:
        self.num_layers, self.capacity = num_layers, capacity
        self.page_shape, self.dtype = tuple(page_shape), dtype
        self.page_bytes = int(np.prod(page_shape)) * torch.empty((), dtype=dtype).element_size()
        self.slot_bytes = _round_up(self.page_bytes, ALIGN)
        self.size = ALIGN + num_layers * capacity * self.slot_bytes
        self.pool = pool
        self.header = {"format": 1, "fingerprint": fingerprint, "page_shape": list(page_shape),
                       "dtype": str(dtype).removeprefix("torch."), "num_layers": num_layers,
                       "capacity": capacity, "slot_bytes": self.slot_bytes, "digest": DIGEST}
        # unique to this tier object: two caches sharing a folder never share a segment
        self.path = directory / f"{uuid.uuid4().hex[:16]}-g{generation}.kvseg"
        #: the page map: first token of the page in each slot (-1: none), its checksum
        self.starts = np.full((num_layers, capacity), -1, dtype=np.int64)
        self.sums = np.zeros((num_layers, capacity), dtype=np.uint64)
        #: writes per slot: a page read earlier is still the slot's page while this is unchanged
        self.writes = np.zeros((num_layers, capacity), dtype=np.int64)
        self._zeros = bytes(self.slot_bytes - self.page_bytes)
        self._per = 1 if not self._zeros else 2  # buffers per slot in a run (page, padding)
        self._scratch = threading.local()  # per-thread sink of the padding read between slots
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o600)
        self._closer = weakref.finalize(self, _close, fd, str(self.path))
        self.fd = fd
        try:
            head = MAGIC + json.dumps(self.header, sort_keys=True).encode()
            if len(head) > ALIGN:
                raise KVFileError(f"{self.path}: segment header of {len(head)} bytes exceeds "
                                  f"{ALIGN}; use a shorter cache fingerprint.")
            os.ftruncate(fd, self.size)  # sparse: disk space is taken where pages land
            _write_all(fd, head.ljust(ALIGN, b"\0"), 0)
            self.check_header()
        except BaseException:
            self.close()
            raise

    # --- checks ----------------------------------------------------------------------------

    def check_header(self) -> None:
        """The file's header names this segment's fingerprint and geometry (on open)."""
        raw = os.pread(self.fd, ALIGN, 0)
        try:
            if raw[:len(MAGIC)] != MAGIC:
                raise ValueError("bad magic")
            got = json.loads(raw[len(MAGIC):].rstrip(b"\0"))
        except ValueError as e:
            raise KVFileError(f"{self.path}: not a tierattn segment ({e}); the disk tier's "
                              "folder holds a foreign or damaged file.") from None
        for k, want in self.header.items():
            if got.get(k) != want:
                raise KVFileError(f"{self.path}: segment header {k}={got.get(k)!r}, this tier "
                                  f"expects {want!r}.")

    def _check_file(self) -> None:
        st = os.fstat(self.fd)
        if st.st_nlink == 0:
            raise KVFileError(f"{self.path}: the segment file was deleted while its pages were "
                              "in use; they cannot be read back.")
        if st.st_size < self.size:
            raise KVFileError(f"{self.path}: the segment file was truncated to {st.st_size} "
                              f"bytes ({self.size} expected); its pages cannot be read back.")

    def expect(self, layer: int, slots: Sequence[int], token_starts: Sequence[int]) -> None:
        """Raise :class:`KVFileError` unless every slot holds the page starting at its token."""
        have = self.starts[layer, np.asarray(slots, dtype=np.int64)]
        bad = np.nonzero(have != np.asarray(token_starts, dtype=np.int64))[0]
        if len(bad):
            i = int(bad[0])
            what = "no page (released or never written)" if have[i] < 0 else \
                f"the page of token {int(have[i])}"
            raise KVFileError(f"{self.path}: layer {layer} slot {slots[i]} holds {what}, not "
                              f"the page of token {token_starts[i]}; nothing was read.")

    # --- I/O -------------------------------------------------------------------------------

    def _offset(self, layer: int, slot: int) -> int:
        return ALIGN + (layer * self.capacity + slot) * self.slot_bytes

    def _runs(self, layer: int, slots: Sequence[int], views: list[memoryview], pad) -> list:
        """``(offset, buffers)`` per run of adjacent slots (sorted), at most IOV_MAX buffers."""
        order = sorted(range(len(slots)), key=slots.__getitem__)
        runs, prev = [], None
        per = self._per
        for i in order:
            s = slots[i]
            if prev is None or s != prev + 1 or len(runs[-1][1]) + per > IOV_MAX:
                runs.append((self._offset(layer, s), []))
            runs[-1][1].append(views[i])
            if self._zeros:
                runs[-1][1].append(pad)
            prev = s
        return runs

    def _spread(self, runs: list, work: Callable[[list], None], nbytes: int) -> None:
        """Run ``work`` over the runs: inline, or split over the pool for a large batch."""
        if self.pool is None or nbytes < POOL_MIN_BYTES or len(runs) < 2 or \
                threading.current_thread().name.startswith(THREAD_PREFIX):
            work(runs)  # (a pool thread never waits on the pool: that could deadlock)
            return
        n = self.pool._max_workers
        if len(runs) < n:  # long runs are cut, so every thread has I/O and checksums to do
            runs = self._cut(runs, n)
        parts = [runs[i::n] for i in range(n)]
        futures = [self.pool.submit(work, p) for p in parts if p]
        err = None
        for f in futures:  # every part lands (or fails) before the call returns
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, first one wins
                err = err or e
        if err is not None:
            raise err

    def _cut(self, runs: list, parts: int) -> list:
        """Each run cut into up to ``parts`` pieces of whole slots, none under
        :data:`POOL_MIN_BYTES`."""
        out = []
        least = -(-POOL_MIN_BYTES // self.slot_bytes)
        for off, bufs in runs:
            slots = len(bufs) // self._per
            step = max(least, -(-slots // parts))
            for i in range(0, slots, step):
                out.append((off + i * self.slot_bytes, bufs[i * self._per:(i + step) * self._per]))
        return out

    def write(self, layer: int, slots: Sequence[int], pages: torch.Tensor,
              token_starts: Sequence[int]) -> None:
        """Store ``pages [n, *page_shape]`` (CPU) in ``slots``. The page map changes only when
        every byte landed: on an error the slots read as empty and the error propagates."""
        n = len(slots)
        flat = pages.detach().contiguous().view(torch.uint8).reshape(-1)
        mv = memoryview(flat.numpy())
        pb = self.page_bytes
        views = [mv[i * pb:(i + 1) * pb] for i in range(n)]
        sums = np.fromiter((page_digest(v) for v in views), dtype=np.uint64, count=n)
        idx = np.asarray(slots, dtype=np.int64)
        self.starts[layer, idx] = -1  # a slot being rewritten holds nothing until it lands
        self.writes[layer, idx] += 1
        self._check_file()

        def work(runs):
            for off, bufs in runs:
                got = os.pwritev(self.fd, bufs, off)
                want = sum(len(b) for b in bufs)
                if got != want:  # pwritev on a regular file is short only on ENOSPC/EFBIG
                    raise OSError(errno.ENOSPC, f"short write to {self.path} ({got} of {want} "
                                  "bytes)")

        self._spread(self._runs(layer, slots, views, self._zeros), work, n * pb)
        self.sums[layer, idx] = sums
        self.starts[layer, idx] = np.asarray(token_starts, dtype=np.int64)

    def read_into(self, layer: int, slots: Sequence[int], token_starts: Sequence[int],
                  out: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """Read ``slots`` into ``out[rows[i]]`` (``out``: a contiguous CPU ``[m, *page_shape]``
        tensor; ``rows`` default ``0..n-1``), each page's checksum verified. Raises
        :class:`KVFileError` (a slot without that page, a deleted or truncated file, a checksum
        mismatch) or ``OSError``; the rows written so far are then undefined."""
        n = len(slots)
        if not n:
            return
        self.expect(layer, slots, token_starts)
        self._check_file()
        rows = range(n) if rows is None else rows
        mv = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        pb = self.page_bytes
        views = [mv[r * pb:(r + 1) * pb] for r in rows]
        want = self.sums[layer, np.asarray(slots, dtype=np.int64)]
        owner = {id(v): i for i, v in enumerate(views)}

        def work(runs):
            pad = self._pad()
            for off, bufs in runs:
                bufs = [pad if b is self._zeros else b for b in bufs]
                got, total = os.preadv(self.fd, bufs, off), sum(len(b) for b in bufs)
                if got != total:
                    raise KVFileError(f"{self.path}: short read ({got} of {total} bytes at "
                                      f"offset {off}); the segment file was truncated.")
                for b in bufs:
                    i = owner.get(id(b))
                    if i is not None and page_digest(b) != int(want[i]):
                        raise KVFileError(
                            f"{self.path}: layer {layer} slot {slots[i]}: checksum mismatch "
                            "(the segment was changed on disk); nothing was loaded.")

        runs = self._runs(layer, slots, views, self._zeros)
        if _WILLNEED is not None and len(runs) > 1:
            # scattered slots: the device gets every run at once (queue depth), exactly (no
            # readahead past a run); one run is left to the kernel's sequential readahead
            for off, bufs in runs:
                os.posix_fadvise(self.fd, off, len(bufs) // self._per * self.slot_bytes,
                                 _WILLNEED)
        self._spread(runs, work, n * pb)

    def _pad(self) -> memoryview | bytes:
        """This thread's sink for the padding between slots."""
        buf = getattr(self._scratch, "buf", None)
        if buf is None:
            buf = self._scratch.buf = memoryview(bytearray(len(self._zeros)))
        return buf

    def forget(self, layer: int, slots: Sequence[int]) -> None:
        """The slots hold nothing (released): a read of them raises."""
        self.starts[layer, np.asarray(slots, dtype=np.int64)] = -1

    def flush(self) -> None:
        """fsync the file (benchmarks; the tier itself never needs it)."""
        os.fsync(self.fd)

    def drop_cache(self) -> None:
        """Ask the kernel to drop the file's clean pages from the page cache (benchmarks:
        reads then come from the device)."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close and delete the file (also when the segment is garbage-collected)."""
        self._closer()

    @property
    def closed(self) -> bool:
        return not self._closer.alive


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _close(fd: int, path: str) -> None:
    try:
        os.close(fd)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def pool_for(threads: int) -> ThreadPoolExecutor | None:
    """The I/O pool of a disk tier (None for ``threads <= 1``)."""
    return ThreadPoolExecutor(threads, thread_name_prefix=THREAD_PREFIX) if threads > 1 else None


def submit(pool: ThreadPoolExecutor | None, fn: Callable[[], None]) -> Future:
    """``fn`` on the pool (or run now, for no pool), as a future."""
    if pool is not None:
        return pool.submit(fn)
    f: Future = Future()
    try:
        fn()
        f.set_result(None)
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        f.set_exception(e)
    return f
