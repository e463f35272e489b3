"""The remote store (tierattn.storage.remote) against a real Mooncake Store: a master started
here on 127.0.0.1 (free ports, ended by its own PID), clients in this process and in another.

Values come back byte-equal across processes; a value that fails its checksum is refused and
counted; a killed master costs a call at most one deadline, after which the store is skipped
at once; every Mooncake return code is counted by name; a bad address is a typed error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from mooncake_helpers import Master, free_port, mooncake_importable

from tierattn.errors import KernelInputError, TierConfigError
from tierattn.storage.remote import (HEADER, RemoteConfig, RemoteStore, RemoteStoreError, frame,
                                     unframe)

needs_mooncake = pytest.mark.skipif(
    not mooncake_importable(), reason="needs mooncake-transfer-engine-non-cuda (the [remote] "
    "extra) and libibverbs1; .ci/run installs both")


@pytest.fixture
def master(tmp_path):
    m = Master(tmp_path / "master.log")
    yield m
    m.stop()


# --- values: the header and its checksum ------------------------------------------------------

def test_a_value_is_its_payload_behind_a_checked_header():
    payload = os.urandom(4096)
    value = frame(payload)
    assert len(value) == HEADER.size + len(payload) and bytes(unframe(value)) == payload
    flipped = bytearray(value)
    flipped[HEADER.size + 100] ^= 1
    assert unframe(bytes(flipped)) is None  # one bit of the payload
    assert unframe(value[:-1]) is None and unframe(value[:10]) is None  # truncated
    assert unframe(b"XXXX" + value[4:]) is None  # not ours
    assert bytes(unframe(frame(b""))) == b""
    import numpy as np  # any buffer: its bytes in C order, whatever its shape

    blocks = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    assert bytes(unframe(frame(blocks.data))) == blocks.tobytes()


@pytest.mark.parametrize("kw,knob", [
    ({"master": "localhost"}, "master"), ({"master": "127.0.0.1:0"}, "master"),
    ({"metadata": "127.0.0.1:8080/metadata"}, "metadata"), ({"protocol": "udp"}, "protocol"),
    ({"deadline_s": 0}, "deadline_s"), ({"segment_gib": -1}, "segment_gib"),
    ({"buffer_mib": True}, "buffer_mib"),
])
def test_a_bad_config_names_its_knob(kw, knob):
    base = {"master": "127.0.0.1:50051", "metadata": "http://127.0.0.1:8080/metadata"}
    with pytest.raises(TierConfigError, match=knob):
        RemoteConfig(**{**base, **kw})


class _Faulty:
    """A client that answers every call with Mooncake's code ``code`` (forces a fault)."""

    def __init__(self, code: int) -> None:
        self.code = code

    def put_batch(self, keys, values):
        return self.code

    def get_batch(self, keys):
        return [b""] * len(keys)

    def batch_is_exist(self, keys):
        return self.code

    def remove(self, key):
        return self.code


@pytest.mark.parametrize("code,name,down", [(-200, "NO_AVAILABLE_HANDLE", False),
                                            (-900, "RPC_FAIL", True),
                                            (-707, "LEASE_EXPIRED", False)])
def test_every_return_code_is_counted_by_name(code, name, down):
    config = RemoteConfig(master="127.0.0.1:1", metadata="http://127.0.0.1:2/metadata",
                          retry_s=60)
    with RemoteStore(config, client=_Faulty(code)) as store:
        assert store.put(["a", "b"], [b"1", b"2"]) == [False, False]
        assert store.stats()["codes"] == {name: 1} and store.stats()["put_failed"] == 2
        assert isinstance(store.last_error, RemoteStoreError)
        assert store.last_error.code == code and name in str(store.last_error)
        assert store.up is (not down)
        if down:  # skipped at once from now on, counted
            assert store.get(["a"]) == [None] and store.stats()["skipped"] == 1
        with pytest.raises(KernelInputError, match="one payload per key"):
            store.put(["a"], [])


# --- a real store -----------------------------------------------------------------------------

@needs_mooncake
def test_round_trip_and_lookup(master):
    with RemoteStore(master.config()) as store:
        keys = [RemoteStore.key("smollm2-bf16-b16-r0", bytes([i]) * 32) for i in range(3)]
        payloads = [os.urandom(64 << 10) for _ in keys]
        assert keys[0].startswith("tierattn/smollm2-bf16-b16-r0/") and len(set(keys)) == 3
        assert store.contains(keys) == [False] * 3
        assert store.put(keys, payloads) == [True] * 3
        assert store.put(keys[:1], payloads[:1]) == [True]  # the same content: already there
        assert store.contains([*keys, "tierattn/x/absent"]) == [True, True, True, False]
        got = store.get([keys[2], "tierattn/x/absent", keys[0]])
        assert bytes(got[0]) == payloads[2] and got[1] is None and bytes(got[2]) == payloads[0]
        stats = store.stats()
        assert stats["get"] == 2 and stats["get_missed"] == 1 and stats["corrupt"] == 0
        assert stats["put_bytes"] >= 4 * (64 << 10) and stats["up"]


CHILD = textwrap.dedent("""
    import sys
    from tierattn.storage.remote import RemoteConfig, RemoteStore
    config = RemoteConfig(master=sys.argv[1], metadata=sys.argv[2], segment_gib=0.0625,
                          buffer_mib=32)
    with RemoteStore(config) as store:
        ok = store.put([f"tierattn/test/{i}" for i in range(4)],
                       [bytes([i]) * (i + 1) * 100_000 for i in range(4)])
        print("STORED", all(ok), flush=True)
        sys.stdin.readline()  # its segment holds the values: stay until the parent has read
""")


@needs_mooncake
def test_another_process_finds_what_one_stored(master, tmp_path):
    """Two clients, two processes: one lends its memory and stores, the other (lending none)
    finds the keys and reads the bytes back equal -- another engine instance's view."""
    cfg = master.config(segment_gib=0.0)
    child = subprocess.Popen([sys.executable, "-c", CHILD, cfg.master, cfg.metadata],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    try:
        assert child.stdout.readline().strip() == "STORED True"
        with RemoteStore(cfg) as store:
            keys = [f"tierattn/test/{i}" for i in range(4)]
            assert store.contains(keys) == [True] * 4
            got = store.get(keys)
            assert [bytes(g) for g in got] == [bytes([i]) * (i + 1) * 100_000 for i in range(4)]
    finally:
        child.communicate("done\n", timeout=30)
    assert child.returncode == 0


@needs_mooncake
def test_a_corrupted_value_is_refused_and_counted(master):
    with RemoteStore(master.config()) as store:
        good = frame(os.urandom(8192))
        bad = bytearray(good)
        bad[-1] ^= 0xFF
        # forced fault: bytes changed behind tierattn's back, through the raw client
        assert store._client.put("tierattn/test/bad", bytes(bad)) == 0
        assert store.get(["tierattn/test/bad"]) == [None]
        assert store.stats()["corrupt"] == 1 and store.stats()["get"] == 0


@needs_mooncake
def test_a_dead_store_costs_at_most_one_deadline_then_is_skipped(master):
    config = master.config(deadline_s=1.0, retry_s=30.0)
    with RemoteStore(config) as store:
        assert store.put(["tierattn/test/k"], [b"v" * 1000]) == [True]
        master.stop()
        t0 = time.monotonic()
        store.contains(["tierattn/test/k"])  # the master is gone: a failed RPC or no answer
        store.put(["tierattn/test/k2"], [b"w"])
        first = time.monotonic() - t0
        assert not store.up, store.stats()
        t1 = time.monotonic()
        assert store.get(["tierattn/test/k"]) == [None]
        assert store.put(["tierattn/test/k3"], [b"x"]) == [False]
        skipped = time.monotonic() - t1
        stats = store.stats()
    assert first < 2 * config.deadline_s + 0.5, first  # at most one deadline per call
    assert skipped < 0.1, skipped  # skipped at once while down
    assert stats["skipped"] >= 2 and stats["down"] >= 1
    assert set(stats["codes"]) <= {"RPC_FAIL", "DEADLINE", "RPC_TIMEOUT", "CLIENT_NOT_FOUND"}


@needs_mooncake
def test_no_master_at_the_address_is_a_typed_error(tmp_path):
    port = free_port()
    config = RemoteConfig(master=f"127.0.0.1:{port}", metadata=f"http://127.0.0.1:{port}/m",
                          segment_gib=0.0625, buffer_mib=32, deadline_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RemoteStoreError, match="remote master=.*nothing answers there"):
        RemoteStore(config)
    assert time.monotonic() - t0 < 2 * config.deadline_s
