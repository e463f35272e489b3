"""Helpers of the remote-store tests: a Mooncake Store started here on 127.0.0.1 -- a master
with its HTTP metadata server, and a long-lived ``mooncake_client`` that lends the pool its
memory -- on free ports, each ended by its own PID."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tierattn.config import RemoteConfig

BIN = Path(sys.executable).parent
MASTER, POOL = BIN / "mooncake_master", BIN / "mooncake_client"
LOOPBACK = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def mooncake_importable() -> bool:
    """Mooncake's client imports (its binaries need Debian's libibverbs1) and its master is
    installed next to this interpreter."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError:
        return False
    return MASTER.exists() and POOL.exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{proc.args[0]} did not listen on 127.0.0.1:{port}")


class Master:
    """A mooncake_master on loopback with its HTTP metadata server; ``stop`` kills it by PID.
    ``pool_mib``: also a ``mooncake_client`` lending that much memory to the pool, so values
    outlive the clients that wrote them (engines then lend none: ``segment_gib=0``)."""

    def __init__(self, log: Path, pool_mib: int = 0) -> None:
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.proc = subprocess.Popen(
            [str(MASTER), "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc}",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics}", "--default_kv_lease_ttl=200"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=LOOPBACK)
        _wait_listening(self.rpc, self.proc)
        _wait_listening(self.http, self.proc)
        self.pool = None
        if pool_mib:
            port = free_port()
            self.pool = subprocess.Popen(
                [str(POOL), f"--global_segment_size={pool_mib}MB", "--host=127.0.0.1",
                 f"--port={port}", "--protocol=tcp",
                 f"--master_server_address=127.0.0.1:{self.rpc}",
                 f"--metadata_server=http://127.0.0.1:{self.http}/metadata"],
                stdout=log.with_suffix(".pool.log").open("w"), stderr=subprocess.STDOUT,
                env=LOOPBACK)
            _wait_listening(port, self.pool)

    def config(self, **kw) -> RemoteConfig:
        kw = {"segment_gib": 0.0625, "buffer_mib": 32, "deadline_s": 1.0, "retry_s": 2.0, **kw}
        return RemoteConfig(master=f"127.0.0.1:{self.rpc}",
                            metadata=f"http://127.0.0.1:{self.http}/metadata", **kw)

    def stop(self) -> None:
        for proc in (self.pool, self.proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


