"""The remote store below disk: KV blocks in Mooncake Store, which every engine instance that
points at the same master shares, keyed by content so that another instance finds them.

Mooncake Store (the KV store behind Kimi's serving) keeps objects in memory segments that its
clients lend to the pool; a master places them and answers lookups. Its Python client reports
every error as a return value (``-900`` for a failed RPC, ``b""`` for a failed get), and after
the master dies each call blocks for seconds while ``health_check()`` still says healthy. This
module puts tierattn's terms around it:

* **keys by content**: ``tierattn/<fingerprint>/<digest>`` -- the fingerprint names what the
  bytes are (model, layout, dtype, block size, rank), the digest which tokens they hold (a
  token-prefix hash, e.g. vLLM's block hash), so any instance serving the same model finds a
  block another one stored;
* **checked values**: each value is a 24-byte header (magic, format version, payload length,
  XXH3-64 of the payload) and the payload; a read that fails the check is refused, counted and
  removed from the store, never served;
* **a deadline on every call**: calls run on the store's own thread; one that does not answer
  within ``deadline_s`` (or fails its RPC) marks the store down, and for ``retry_s`` every call
  is skipped at once -- a dead store costs a request at most one deadline, like a failed disk
  the caller recomputes -- after which the next call probes it again;
* **typed errors**: setting up the client raises :class:`~tierattn.errors.TierConfigError` for a
  bad address and :class:`RemoteStoreError` (a :class:`~tierattn.errors.KVIOError`) for a store
  that does not answer; a failed put or get is a result (``False``, ``None``) whose Mooncake code
  is counted by name in :meth:`RemoteStore.stats` and kept as :attr:`RemoteStore.last_error`.

vLLM's connector keys blocks by content through this client; the remote tier of a cache or a
swap (:class:`tierattn.storage.tiers.RemoteTier`) keys pages by owner and slot and puts them
hard-pinned (``put(..., pin=True)``).

``mooncake-transfer-engine-non-cuda`` (the ``[remote]`` extra; its binaries need Debian's
``libibverbs1``) is imported only when a store is built. On one machine keep every socket on
loopback: ``MC_TCP_BIND_ADDRESS=127.0.0.1`` (set here when ``local_host`` is a loopback address).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from tierattn.config import RemoteConfig
from tierattn.errors import KernelInputError, KVIOError, TierConfigError

__all__ = ["MOONCAKE_ERRORS", "RemoteConfig", "RemoteStore", "RemoteStoreError", "frame",
           "unframe"]

#: Mooncake Store's error codes (``mooncake-store/include/types.h``) by value
MOONCAKE_ERRORS = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND", -102: "SEGMENT_ALREADY_EXISTS", -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE", -300: "INVALID_VERSION", -400: "INVALID_KEY",
    -500: "WRITE_FAIL", -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE",
    -701: "INVALID_READ", -702: "INVALID_REPLICA", -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED", -800: "TRANSFER_FAIL", -801: "CHECKSUM_MISMATCH", -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT", -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
#: codes that mean the store, not the request, is in trouble: the store is marked down
UNREACHABLE = {-900, -901, -103, -1010}
#: a put of a key that exists stores nothing new -- content keys: the same bytes are there
ALREADY_THERE = {-705, -706}

#: a pinned put of values smaller than this on average goes as one framed batch
PARTS_MIN_BYTES = 1 << 20
#: keys per Mooncake call: its TCP transfer fails a batch of 4,096 values of 24 KiB (2,048 pass;
#: measured with 0.3.13.post1), so larger puts and gets go in batches of this many, each under
#: its own deadline
BATCH_KEYS = 1024

MAGIC, VERSION = b"TAKV", 1
HEADER = struct.Struct("<4sB3xQQ")  # magic, version, (pad), payload bytes, XXH3-64 of payload


def _checksum(payload) -> int:
    try:
        import xxhash
    except ImportError:  # the package depends on xxhash; zlib keeps a bare install working
        import zlib

        return zlib.crc32(payload)
    return xxhash.xxh3_64_intdigest(payload)


def frame(payload: bytes | bytearray | memoryview) -> bytes:
    """``payload`` (any buffer: its bytes in C order) with its header: what the store holds."""
    data = memoryview(payload).cast("B")  # one copy below, into the value
    return b"".join((HEADER.pack(MAGIC, VERSION, data.nbytes, _checksum(data)), data))


def unframe(value: bytes) -> memoryview | None:
    """The payload of a stored ``value``, or None when its header or checksum does not hold."""
    if len(value) < HEADER.size:
        return None
    magic, version, length, digest = HEADER.unpack_from(value)
    payload = memoryview(value)[HEADER.size:]
    if magic != MAGIC or version != VERSION or length != len(payload) or \
            digest != _checksum(payload):
        return None
    return payload


class RemoteStoreError(KVIOError):
    """The remote store refused or did not answer; ``code`` is Mooncake's (None: a deadline)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.code_name = MOONCAKE_ERRORS.get(code, f"code {code}") if code is not None \
            else "DEADLINE"


class _Down(Exception):
    """The store is taken for down: the call was skipped or ran past its deadline."""


class RemoteStore:
    """A Mooncake Store client with content keys, checked values and deadlines.

    Args:
        config: where the store is (:class:`RemoteConfig`).
        client: a client object with Mooncake's interface, already set up (tests inject a
            faulty one); None builds ``MooncakeDistributedStore`` and sets it up under the
            deadline.

    Raises:
        TierConfigError: ``mooncake`` is not installed.
        RemoteStoreError: the store did not answer the set-up within the deadline, or refused
            it (its code named).
    """

    def __init__(self, config: RemoteConfig, *, client=None) -> None:
        self.config = config
        self.counters: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self.last_error: RemoteStoreError | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierattn-remote")
        self._client = client if client is not None else self._connect()

    def _connect(self):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            self._pool.shutdown(wait=False)
            raise TierConfigError(
                "a remote tier needs Mooncake Store's client: pip install 'tierattn[remote]' "
                "(mooncake-transfer-engine-non-cuda; its binaries need Debian's libibverbs1)."
            ) from e
        c = self.config
        # set-up holds the interpreter while Mooncake retries a missing master (about 90 s):
        # ask the master's and the metadata server's ports first, within the deadline
        for knob, (host, port) in c.endpoints().items():
            try:
                socket.create_connection((host, port), timeout=c.deadline_s).close()
            except OSError as e:
                self._pool.shutdown(wait=False)
                raise RemoteStoreError(f"remote {knob}={getattr(c, knob)!r}: nothing answers there "
                                       f"({e.strerror or e}); start mooncake_master (with "
                                       "--enable_http_metadata_server=true) or fix the "
                                       "address") from None
        if c.local_host.startswith("127.") or c.local_host == "localhost":
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # keep it on loopback
        client = MooncakeDistributedStore()
        args = (c.local_host, c.metadata, int(c.segment_gib * 2**30), c.buffer_mib << 20,
                c.protocol, c.device, c.master)
        future = self._pool.submit(client.setup, *args)
        try:
            rc = future.result(timeout=max(c.deadline_s, 10.0))  # a set-up mounts a segment
        except FutureTimeout:
            raise RemoteStoreError(f"remote master={c.master!r}: set-up did not answer in "
                                   f"{max(c.deadline_s, 10.0):.0f} s; is mooncake_master "
                                   "running there?") from None
        if rc != 0:
            self._pool.shutdown(wait=False)
            raise RemoteStoreError(f"remote master={c.master!r}, metadata={c.metadata!r}: "
                                   f"set-up refused ({MOONCAKE_ERRORS.get(rc, rc)}); check "
                                   "that the master runs with its HTTP metadata server", rc)
        return client

    # --- the deadline -------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        """False while the store is taken for down (until ``retry_s`` after it failed)."""
        return time.monotonic() >= self._down_until

    def _fault(self, code: int | None, what: str) -> None:
        err = RemoteStoreError(f"remote {what}: {MOONCAKE_ERRORS.get(code, code)}"
                               if code is not None else
                               f"remote {what}: no answer within {self.config.deadline_s} s",
                               code)
        self.last_error = err
        self.codes[err.code_name] += 1
        if code is None or code in UNREACHABLE:
            with self._lock:
                self._down_until = time.monotonic() + self.config.retry_s
            self.counters["down"] += 1

    def _call(self, what: str, fn, *args):
        if not self.up:
            self.counters["skipped"] += 1
            raise _Down
        try:
            future = self._pool.submit(fn, *args)
        except RuntimeError:  # closed (or the interpreter is exiting): nothing to ask
            raise _Down from None
        try:
            return future.result(timeout=self.config.deadline_s)
        except FutureTimeout:
            self._fault(None, what)
            raise _Down from None

    # --- keys and values ----------------------------------------------------------------------

    @staticmethod
    def key(fingerprint: str, digest: bytes | str) -> str:
        """The store key of a block: ``tierattn/<fingerprint>/<digest as hex>``."""
        return f"tierattn/{fingerprint}/{digest.hex() if isinstance(digest, bytes) else digest}"

    def put(self, keys: Sequence[str], payloads: Sequence[bytes | bytearray | memoryview], *,
            pin: bool = False) -> list[bool]:
        """Store ``payloads`` (any buffers) under ``keys``; per key, whether the store holds it
        now (a key that exists holds the same bytes: keys name content). One deadline covers
        each batch of :data:`BATCH_KEYS`. ``pin``: the store never evicts them (Mooncake's hard
        pin; a full store refuses the put instead), for data that exists nowhere else. Never
        raises for the store's faults: they are counted and the result is False."""
        if len(keys) != len(payloads):
            raise KernelInputError(f"put: {len(keys)} keys for {len(payloads)} payloads; give "
                                   "one payload per key")
        return [ok for lo in range(0, len(keys), BATCH_KEYS)
                for ok in self._put(keys[lo:lo + BATCH_KEYS], payloads[lo:lo + BATCH_KEYS], pin)]

    def _put(self, keys: Sequence[str], payloads: Sequence, pin: bool) -> list[bool]:
        """:meth:`put` of one batch of at most :data:`BATCH_KEYS` keys."""
        if not keys:
            return []
        views = [memoryview(p).cast("B") for p in payloads]
        try:
            extra = {"config": self._pinned()} if pin else {}
            # a value sent as its header and payload in two parts is never copied, but each
            # key is a round trip to the master: small pinned values (pages of a tier, whose
            # keys are new by construction) go framed, in one batch
            small = pin and sum(v.nbytes for v in views) < PARTS_MIN_BYTES * len(views)
            if hasattr(self._client, "put_parts") and not small:
                codes = self._call("put", self._put_parts, list(keys), views, extra)
            else:  # a client without it: the framed values, one batch
                code = self._call("put", lambda k, v: self._client.put_batch(k, v, **extra),
                                  list(keys), [frame(v) for v in views])
                codes = [code] * len(keys)
        except _Down:
            self.counters["put_failed"] += len(keys)
            return [False] * len(keys)
        out = []
        for code, view in zip(codes, views):
            ok = code == 0 or code in ALREADY_THERE
            out.append(ok)
            if ok:
                self.counters["put"] += 1
                self.counters["put_bytes"] += HEADER.size + view.nbytes
            else:
                self.counters["put_failed"] += 1
        for code in {c for c in codes if c != 0 and c not in ALREADY_THERE}:
            self._fault(code, "put")
        return out

    def _pinned(self):
        """Mooncake's replica config of a hard-pinned object."""
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.with_hard_pin = True
        return config

    def _put_parts(self, keys: list[str], views: list[memoryview], extra: dict) -> list[int]:
        """Each key's value as its header and its payload, without joining them (no copy of
        the payload); stops at the first code that says the store is unreachable."""
        codes: list[int] = []
        for key, view in zip(keys, views):
            header = HEADER.pack(MAGIC, VERSION, view.nbytes, _checksum(view))
            code = self._client.put_parts(key, header, view, **extra)
            codes.append(code)
            if code in UNREACHABLE:
                codes += [code] * (len(keys) - len(codes))
                break
        return codes

    def get(self, keys: Sequence[str]) -> list[memoryview | None]:
        """The payloads under ``keys`` (batches of :data:`BATCH_KEYS`); None for a key the store
        lacks, a value that fails its check (removed from the store), or every key while the
        store is down."""
        return [v for lo in range(0, len(keys), BATCH_KEYS)
                for v in self._get(keys[lo:lo + BATCH_KEYS])]

    def _get(self, keys: Sequence[str]) -> list[memoryview | None]:
        """:meth:`get` of one batch."""
        if not keys:
            return []
        try:
            values = self._call("get", self._client.get_batch, list(keys))
        except _Down:
            self.counters["get_failed"] += len(keys)
            return [None] * len(keys)
        out: list[memoryview | None] = []
        bad = []
        for k, v in zip(keys, values):
            if not v:
                self.counters["get_missed"] += 1
                out.append(None)
                continue
            payload = unframe(v)
            if payload is None:
                self.counters["corrupt"] += 1
                bad.append(k)
            else:
                self.counters["get"] += 1
                self.counters["get_bytes"] += len(v)
            out.append(payload)
        if bad:
            self.remove(bad)
        return out

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether the store holds it (one batch; all False while it is down)."""
        if not keys:
            return []
        try:
            found = self._call("lookup", self._client.batch_is_exist, list(keys))
        except _Down:
            return [False] * len(keys)
        if isinstance(found, int):  # a failed call answers one code for the batch
            self._fault(found, "lookup")
            return [False] * len(keys)
        for code in found:
            if code < 0:
                self._fault(code, "lookup")
        return [code == 1 for code in found]

    def remove(self, keys: Sequence[str]) -> bool:
        """Drop ``keys`` from the store, leased or pinned (only their writer reads them); one
        batch. Returns False when the store did not answer (the keys may remain)."""
        if not keys:
            return True
        try:
            if hasattr(self._client, "batch_remove"):
                self._call("remove", self._client.batch_remove, list(keys), True)
            else:
                for k in keys:
                    self._call("remove", self._client.remove, k)
        except _Down:
            return False
        return True

    def stats(self) -> dict:
        """Counters (``put``, ``put_bytes``, ``put_failed``, ``get``, ``get_bytes``,
        ``get_missed``, ``get_failed``, ``corrupt``, ``skipped``, ``down``), Mooncake's error
        codes seen, by name, and whether the store is up."""
        return {**{k: self.counters[k] for k in ("put", "put_bytes", "put_failed", "get",
                                                  "get_bytes", "get_missed", "get_failed",
                                                  "corrupt", "skipped", "down")},
                "codes": dict(self.codes), "up": self.up}

    def close(self) -> None:
        """Close the client (its segment leaves the pool) and its thread; idempotent."""
        client, self._client = self._client, None
        if client is not None and hasattr(client, "close"):
            try:
                self._pool.submit(client.close).result(timeout=self.config.deadline_s)
            except FutureTimeout:
                pass
            except RuntimeError:  # interpreter exit: the thread pools are already shut down
                client.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

