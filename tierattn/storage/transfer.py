"""Transfer engines: move a layer's pages between two pools with one page-copy launch.

The contract every engine keeps, and the cache relies on:

* ``copy(...)`` starts the copy and returns a ticket; the destination may be read only after
  ``wait(ticket)`` (on CUDA: the compute stream waits for the copy stream's event right before the
  kernel that reads the pages);
* ``fence()`` marks "everything the compute stream did so far"; a copy given ``after=fence``
  does not start before that, so a staging buffer is never overwritten while a kernel still
  reads it.

:class:`CPUTransferEngine` copies synchronously. :class:`CUDATransferEngine` uses one copy stream
and events. :class:`FakeAsyncEngine` is for tests: copies land only when waited on, the
destination reads NaN until then, completions may be reordered, and reusing a destination
before its copy landed raises -- so a missing wait or fence fails deterministically on CPU.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tierattn.kernels import KernelSet

__all__ = ["CPUTransferEngine", "CUDATransferEngine", "FakeAsyncEngine", "TransferEngine",
           "default_engine"]


class TransferEngine(ABC):
    """Moves whole pages between pools; see the module docstring for the contract."""

    def __init__(self, backend: str | None = None) -> None:
        self.backend = backend
        self.launches = 0
        #: the page-copy kernel is called through this (the cache sets its own, so a tool that
        #: wraps or stubs the cache's kernels covers the copies too)
        self.kernels = KernelSet()

    @abstractmethod
    def copy(self, src_pool: torch.Tensor, src_slots: torch.Tensor, dst_pool: torch.Tensor,
             dst_slots: torch.Tensor, *, after: object = None) -> object:
        """Copy ``src_pool[src_slots[i]] -> dst_pool[dst_slots[i]]`` (int32 slots); a ticket."""

    def wait(self, ticket: object) -> None:  # noqa: B027 - synchronous engines: nothing to do
        """Make the destination of ``ticket`` readable by what the compute stream does next."""

    def fence(self) -> object:
        """A marker of the compute work issued so far (pass it as ``after=`` to a copy)."""
        return None

    def synchronize(self) -> None:  # noqa: B027 - synchronous engines: nothing to do
        """Block until every copy issued so far has landed."""

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> object:
        """Start copying device tensor ``src`` into host tensor ``dst`` (pinned on CUDA) after
        the compute work issued so far; returns a ticket for :meth:`wait_host`. The one way the
        runtime reads device state back: asynchronously, so no step waits on the device."""
        dst.copy_(src)
        return None

    def wait_host(self, ticket: object) -> None:  # noqa: B027 - synchronous engines: done
        """Block until the copy of ``ticket`` (from :meth:`to_host`) has landed on the host."""


class CPUTransferEngine(TransferEngine):
    """Synchronous copies (CPU tensors, or any device when overlap is not wanted)."""

    def copy(self, src_pool, src_slots, dst_pool, dst_slots, *, after=None):
        if src_slots.numel():
            self.kernels.copy_pages(src_pool, src_slots, dst_pool, dst_slots, validate=False,
                                    backend=self.backend)
            self.launches += 1
        return None


class CUDATransferEngine(TransferEngine):
    """One copy stream; events order it against the compute stream.

    The page-copy kernel runs on the copy stream and reads pinned host pools over UVA, so a
    layer's missing pages cost one launch, and the compute stream waits on the copy's event
    right before the attention kernel that reads them.
    """

    def __init__(self, device: torch.device, backend: str | None = None) -> None:
        super().__init__(backend)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def copy(self, src_pool, src_slots, dst_pool, dst_slots, *, after=None):
        if not src_slots.numel():
            return None
        compute = torch.cuda.current_stream(self.device)
        # the slot lists (and any page written by earlier kernels) come from the compute stream
        self.stream.wait_stream(compute)
        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            self.kernels.copy_pages(src_pool, src_slots, dst_pool, dst_slots, validate=False,
                                    backend=self.backend)
            done = torch.cuda.Event()
            done.record(self.stream)
        for t in (src_slots, dst_slots):
            t.record_stream(self.stream)  # keep the caching allocator from reusing them early
        self.launches += 1
        return done

    def wait(self, ticket):
        if ticket is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket)

    def fence(self):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def synchronize(self):
        self.stream.synchronize()

    def to_host(self, src, dst):
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def wait_host(self, ticket):
        if ticket is not None:
            ticket.synchronize()  # recorded a step earlier: normally already complete


@dataclass
class _Pending:
    ticket: int
    src_pool: torch.Tensor
    src_slots: torch.Tensor
    dst_pool: torch.Tensor
    dst_slots: torch.Tensor


class FakeAsyncEngine(TransferEngine):
    """Test engine: a copy lands only when waited on (or when a later wait happens to land it
    first, with ``reorder``). Until then its destination pages read NaN; issuing a copy into a
    page whose previous copy has not landed raises, as on real hardware it would race."""

    def __init__(self, *, reorder: bool = True, seed: int = 0, backend: str | None = None):
        super().__init__(backend)
        self._pending: list[_Pending] = []
        self._next = 0
        self._rng = random.Random(seed)
        self.reorder = reorder
        self.landed = 0

    def copy(self, src_pool, src_slots, dst_pool, dst_slots, *, after=None):
        # like the copy kernel, pairs with an out-of-range slot (-1 padding) copy nothing
        ok = (src_slots >= 0) & (src_slots < src_pool.shape[0]) & (dst_slots >= 0) & \
            (dst_slots < dst_pool.shape[0])
        src_slots, dst_slots = src_slots[ok], dst_slots[ok]
        if not src_slots.numel():
            return None
        dst = set(dst_slots.tolist())
        for p in self._pending:
            if p.dst_pool.data_ptr() == dst_pool.data_ptr() and dst & set(p.dst_slots.tolist()):
                raise AssertionError(
                    "FakeAsyncEngine: a destination page is reused before its previous copy "
                    f"(ticket {p.ticket}) landed; a wait or fence is missing")
        dst_pool[dst_slots.long()] = float("nan")
        self._next += 1
        self._pending.append(_Pending(self._next, src_pool, src_slots.clone(), dst_pool,
                                      dst_slots.clone()))
        self.launches += 1
        return self._next

    def _land(self, p: _Pending) -> None:
        self.kernels.copy_pages(p.src_pool, p.src_slots, p.dst_pool, p.dst_slots,
                                validate=False, backend=self.backend)
        self._pending.remove(p)
        self.landed += 1

    def wait(self, ticket):
        if ticket is None:
            return
        if self.reorder:  # unrelated copies may complete first, in any order
            for p in [p for p in self._pending if p.ticket != ticket]:
                if self._rng.random() < 0.5:
                    self._land(p)
        for p in list(self._pending):
            if p.ticket == ticket:
                self._land(p)

    def synchronize(self):
        for p in list(self._pending):
            self._land(p)

    @property
    def pending(self) -> int:
        return len(self._pending)


def default_engine(device: torch.device, backend: str | None = None) -> TransferEngine:
    """CUDA engine on a GPU, synchronous engine elsewhere."""
    if device.type == "cuda":
        return CUDATransferEngine(device, backend)
    return CPUTransferEngine(backend)
