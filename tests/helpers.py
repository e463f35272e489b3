"""Shared test helpers: one-row page tables, a multi-layer decode loop over random KV with a
shadow copy for the runtime tests, and disk faults."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from tierattn.runtime.cache import TieredKVCache
from tierattn.storage.segment import Segment
from tierattn.kernels import PageTable


def one_row(slots: list[int], last: int, device: str | torch.device = "cpu") -> PageTable:
    """A page table with one row over ``slots``; its last page holds ``last`` tokens."""
    n = len(slots)
    return PageTable.from_csr(torch.tensor([0, n], dtype=torch.int32, device=device),
                              torch.tensor(slots, dtype=torch.int32, device=device),
                              torch.tensor([last if n else 0], dtype=torch.int32, device=device))


class Shadow:
    """Plain dense K/V per layer, ``[B, H_kv, n, D]``, and the dense attention over it."""

    def __init__(self, num_layers: int, batch: int, hkv: int, d: int, dtype: torch.dtype):
        self.k = [torch.zeros(batch, hkv, 0, d, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(batch, hkv, 0, d, dtype=dtype) for _ in range(num_layers)]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer] = torch.cat([self.k[layer], k.cpu()], 2)
        self.v[layer] = torch.cat([self.v[layer], v.cpu()], 2)

    def attend(self, layer: int, q: torch.Tensor, keep: torch.Tensor | None = None, *,
               sm_scale: float | None = None) -> torch.Tensor:
        """fp64 causal attention of the newest ``T`` queries (scale ``sm_scale``, default
        ``D ** -0.5``); ``keep [B, n]`` masks dropped tokens."""
        k, v = self.k[layer].double(), self.v[layer].double()
        b, hq, t, d = q.shape
        g = hq // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        n = k.shape[2]
        s = q.double().cpu() @ k.transpose(-1, -2) * (sm_scale or 1 / math.sqrt(d))
        visible = torch.arange(n)[None, :] <= (n - t + torch.arange(t))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        if keep is not None:
            s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        return torch.softmax(s, -1) @ v


def run_loop(cache: TieredKVCache, shadow: Shadow, *, prompt: int, steps: int, hq: int,
             gen: torch.Generator, chunk: int | None = None, check=None) -> float:
    """Prefill ``prompt`` tokens (in chunks) then decode ``steps`` tokens on every layer;
    ``check(layer, out, q)`` is called after each attend. Returns the worst |out - dense|."""
    b, hkv, d = cache.batch_size, cache.num_kv_heads, cache.head_dim
    chunk = chunk or max(prompt, 1)
    worst = 0.0
    sizes = [min(chunk, prompt - i) for i in range(0, prompt, chunk)] + [1] * steps
    for t in sizes:
        for layer in range(cache.num_layers):
            k = torch.randn(b, hkv, t, d, generator=gen).to(cache.device, cache.dtype)
            v = torch.randn(b, hkv, t, d, generator=gen).to(cache.device, cache.dtype)
            q = torch.randn(b, hq, t, d, generator=gen).to(cache.device, cache.dtype)
            cache.update(layer, k, v)
            shadow.append(layer, k, v)
            out = cache.attend(layer, q)
            if check is not None:
                worst = max(worst, check(layer, out, q))
    return worst


def fail_disk_writes(monkeypatch, exc: BaseException, after: int = 0) -> dict:
    """Every disk write after the first ``after`` fails with ``exc``: a disk tier's batched
    positional write (``os.pwritev``; its first buffer lands before the error) or a saved
    file's fsync (``os.fsync``, so the writer's own cleanup runs). Returns the counts
    ``{"n": writes tried, "failed": writes failed}``."""
    real = {"pwritev": os.pwritev, "fsync": os.fsync}
    calls = {"n": 0, "failed": 0}

    def faulty(name):
        def call(*args):
            calls["n"] += 1
            if calls["n"] > after:
                calls["failed"] += 1
                if name == "pwritev" and len(args[1]) > 1:  # part of the batch lands first
                    real[name](args[0], args[1][:1], args[2])
                raise exc
            return real[name](*args)
        return call

    for name in real:
        monkeypatch.setattr(os, name, faulty(name))
    return calls


def fail_disk_reads(monkeypatch, exc: BaseException, every: int = 1) -> dict:
    """Every ``every``-th read of a disk tier's pages (``os.preadv``) fails with ``exc``.
    Returns the counts ``{"n": reads tried, "failed": reads failed}``."""
    real, calls = os.preadv, {"n": 0, "failed": 0}

    def preadv(*args):
        calls["n"] += 1
        if calls["n"] % every == 0:
            calls["failed"] += 1
            raise exc
        return real(*args)

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def disk_segments(folder) -> list:
    """The disk tier's segment files under ``folder``."""
    return sorted(Path(folder).glob("*.kvseg"))


def holds_nothing(tier, folder) -> bool:
    """A disk tier with every slot released: its one segment's page map is empty."""
    return disk_segments(folder) == [tier.path()] and bool((tier.segment().starts < 0).all())


def corrupt_pages(tier) -> int:
    """Flip the first byte of every page a disk tier's segment holds, on disk (after their
    checksums were recorded): the next read of any of them must fail. Returns the count."""
    seg = tier.segment()
    held = (seg.starts >= 0).nonzero()
    for layer, slot in zip(*held):
        at = seg._offset(int(layer), int(slot))
        os.pwrite(seg.fd, bytes([os.pread(seg.fd, 1, at)[0] ^ 0x01]), at)
    return len(held[0])


def corrupt_writes(monkeypatch, every: int = 3) -> dict:
    """Every ``every``-th batch a disk tier writes gets one byte of its first page flipped on
    disk right after it landed (its checksum already recorded). Returns ``{"n": batches}``."""
    real, calls = Segment.write, {"n": 0}

    def write(self, layer, slots, pages, token_starts):
        real(self, layer, slots, pages, token_starts)
        calls["n"] += 1
        if calls["n"] % every == 0:
            at = self._offset(layer, slots[0])
            byte = os.pread(self.fd, 1, at)
            os.pwrite(self.fd, bytes([byte[0] ^ 0x55]), at)

    monkeypatch.setattr(Segment, "write", write)
    return calls
