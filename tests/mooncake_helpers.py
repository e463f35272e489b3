"""Helpers of the remote-store tests: the Mooncake Store the benchmark starts on 127.0.0.1 (a
master with its HTTP metadata server and, with ``pool_mib``, a ``mooncake_client`` lending the
pool its memory), on free ports, each process ended by its own PID."""

from tierattn.eval.bench.remote import LOOPBACK, free_port, mooncake_importable
from tierattn.eval.bench.remote import LocalMooncake as Master

__all__ = ["LOOPBACK", "Master", "free_port", "mooncake_importable"]
