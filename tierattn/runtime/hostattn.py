"""Split attention: cold pages attended where they live, on the host CPU.

Recall brings cold pages to the query; a layer whose attention is diffuse needs most of them
every step. :class:`HostAttention` moves the query to the pages instead: the decode query goes to
the host (``B * H_q * D`` elements), the CPU computes the cold pages' partial attention state over
each lower tier's pool in place (:func:`~tierattn.kernels.host_decode`; disk pages are read into
host memory first), and ``(out, lse)`` per query head comes back (``B * H_q * (D + 1)`` fp32) for
the device to merge with its hot set's. Exact at any budget: the link carries queries and partial
states, never KV.

The cold pages of a layer are listed per tier from the host map (:class:`HostBatch`), rebuilt
only when the layer's cold set changed (a demotion, an eviction: at most a few times per page
filled); disk pages are read into host memory on the disk tiers' I/O threads while the layers
before compute (:meth:`HostAttention.read_ahead`, from the layer-ahead prefetch). A decode step
of a split layer starts the query's copy before the device's hot-set kernel, so the host
computes while the device attends; its round trip (the query's copy awaited, the host kernel,
the partial state's copy) cannot be captured in a CUDA graph. Prompt chunks attend their
cold pages on the host too (the torch reference of the prefill kernel, which is compute-bound
there anyway), and so does their attention mass, so importance follows as with recall.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tierattn.runtime import validate
from tierattn.kernels import KernelSet, PageTable
from tierattn.storage.mover import Mover
from tierattn.storage.pagemap import PageMap
from tierattn.telemetry import Telemetry
from tierattn.storage.tiers import Tier

__all__ = ["HostAttention", "HostBatch"]


@dataclass
class HostBatch:
    """The cold pages of one layer in one lower tier, as a host page table (one row per
    sequence, entries in logical order)."""

    tier: int
    table: PageTable  # on the CPU: slots of the tier's pool (disk: rows of the read buffer)
    first_lane: torch.Tensor | None  # int32 [n] on the CPU (left padding), None: no padding
    rows: torch.Tensor  # long [n] on the device: ``b * max_pages + page`` of each entry
    pages: int
    #: a disk tier: (slots, first tokens) to read each step; None for a memory tier
    reads: tuple[list[int], list[int]] | None = None
    local: torch.Tensor | None = None  # int32 [n] arange: the entries' rows of a page-LSE buffer


class HostAttention:
    """The host side of split attention for one cache (see the module docstring).

    Args:
        pages, tiers, telemetry, kernels: the cache's parts.
        num_kv_heads, head_dim, dtype, device: the cache's geometry.
        threads: host threads (None: :func:`~tierattn.kernels.host_threads`).
    """

    def __init__(self, *, pages: PageMap, tiers: list[Tier], telemetry: Telemetry,
                 kernels: KernelSet, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, threads: int | None = None) -> None:
        self.pages, self.tiers, self.telemetry, self.kernels = pages, tiers, telemetry, kernels
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, \
            dtype, device
        self.threads = threads
        self.pinned = device.type == "cuda"  # the query and the partial state cross the link
        self._batches: list[tuple[int, list[HostBatch]] | None] = [None] * pages.num_layers
        self._query: torch.Tensor | None = None  # pinned host copy of a decode query
        #: (layer, disk tier) -> (its batch, host buffer, the read in flight)
        self._ahead: dict[tuple[int, int], tuple[HostBatch, torch.Tensor, object]] = {}
        self._event = None
        #: seconds and bytes of the last decode's host attention (the cost model's observation)
        self.last: tuple[int, float] | None = None

    # --- the cold pages, per tier ---------------------------------------------------------------

    def batches(self, layer: int) -> list[HostBatch]:
        """``layer``'s cold pages per lower tier (rebuilt when its cold set changed)."""
        st = self.pages.layers[layer]
        key = st.cold_version  # every edit of the cold set (or of padding, liveness) bumps it
        cached = self._batches[layer]
        if cached is not None and cached[0] == key:
            return cached[1]
        pm, p, mp = self.pages, self.pages.page_size, self.pages.max_pages
        cold = pm._masks(layer)[3]
        padded = bool((pm.pad > 0).any())
        out = []
        for t in range(1, len(self.tiers)):
            sel = cold & (st.tier == t)
            counts = sel.sum(1)
            n = int(counts.sum())
            if not n:
                continue
            r, c = sel.nonzero(as_tuple=True)  # row-major: by sequence, then logical page
            i32 = dict(dtype=torch.int32)
            slots = st.slot[r, c].to(torch.int32)
            tier = self.tiers[t]
            reads = None
            if not tier.is_memory:  # disk: the step reads them into a host buffer first
                reads = (slots.tolist(), (c * p).tolist())
                slots = torch.arange(n, **i32)
            starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
            table = PageTable(indices=slots.contiguous(), row_start=starts,
                              row_count=counts.to(torch.int32),
                              last_page_len=torch.where(counts > 0, p, 0).to(torch.int32))
            first = pm._first_lane(r, c).to(torch.int32).contiguous() if padded else None
            out.append(HostBatch(t, table, first, (r * mp + c).to(self.device),
                                 n, reads, torch.arange(n, **i32)))
        self._batches[layer] = (key, out)
        return out

    def cold_bytes(self, layer: int) -> int:
        """KV bytes of ``layer``'s cold pages (what a split step scans, a full recall moves)."""
        return sum(b.pages for b in self.batches(layer)) * self.tiers[0].page_bytes

    def read_ahead(self, layer: int) -> None:
        """Start reading ``layer``'s disk pages into host memory on the disk tiers' I/O threads
        while the layers before it compute; its attend takes them if its pages are unchanged."""
        for hb in self.batches(layer):
            if hb.reads is None:
                continue
            tier = self.tiers[hb.tier]
            buf = torch.empty(hb.pages, *tier.page_shape, dtype=self.dtype)
            fut = tier.read_async(layer, *hb.reads, buf, list(range(hb.pages)))
            self._ahead[(layer, hb.tier)] = (hb, buf, fut)

    def _pool(self, layer: int, hb: HostBatch) -> torch.Tensor:
        """The pool ``hb``'s table indexes: a memory tier's own, or its disk pages in host
        memory (read ahead, or now); a failed read raises :class:`KVIOError`."""
        tier = self.tiers[hb.tier]
        if hb.reads is None:
            return tier.pool(layer)
        tel = self.telemetry.layers[layer]
        ahead = self._ahead.pop((layer, hb.tier), None)
        if ahead is not None and ahead[0] is hb:  # the same pages: read while others computed
            try:
                ahead[2].result()
            except OSError as e:
                raise validate.io_error(
                    e, f"layer {layer}: reading pages of the {tier.kind} tier") from e
            tel.disk_staged_pages += hb.pages
            return ahead[1]
        tel.disk_sync_pages += hb.pages
        return Mover._read(tier, layer, *hb.reads).contiguous()  # a failure: KVIOError

    # --- decode -----------------------------------------------------------------------------------

    def send_query(self, q1: torch.Tensor) -> None:
        """Start the decode query's copy to the host, before the device's hot-set kernel is
        launched (so it does not wait for it); :meth:`decode` waits for it."""
        if not self.pinned:
            self._query = q1
            return
        if self._query is None or self._query.shape != q1.shape or \
                self._query.dtype != q1.dtype:
            self._query = torch.empty(q1.shape, dtype=q1.dtype, pin_memory=True)
        self._query.copy_(q1, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def decode(self, layer: int, out: torch.Tensor, lse: torch.Tensor, *, sm_scale: float,
               softcap: float | None, page_lse: torch.Tensor | None = None) -> None:
        """The partial state of ``layer``'s cold pages for the query :meth:`send_query` sent,
        into the device buffers ``out [B, H_q, D]`` and ``lse [B, H_q]`` (fp32); with
        ``page_lse`` (the step's per-page buffer) each cold page's LSE goes to its row."""
        q = self._query
        if self._event is not None:
            self._event.synchronize()  # the query's copy only, not the hot-set kernel
            self._event = None
        tel, t0 = self.telemetry.layers[layer], time.perf_counter()
        b, hq, d = q.shape
        batches = self.batches(layer)
        states, scanned = [], 0
        for hb in batches:
            pool = self._pool(layer, hb)
            lse_rows = torch.empty(hb.pages, hq) if page_lse is not None else None
            res = self.kernels.host_decode(
                q, pool, hb.table, sm_scale=sm_scale, softcap=softcap, first_lane=hb.first_lane,
                page_lse=lse_rows, page_lse_index=hb.local if lse_rows is not None else None,
                threads=self.threads, validate=False)
            states.append((res.out, res.lse))
            scanned += hb.pages * self.tiers[0].page_bytes
            if lse_rows is not None:
                page_lse.index_copy_(0, hb.rows, lse_rows.to(page_lse.device, non_blocking=True))
                self._count_h2d(tel, lse_rows.numel() * 4)
        if len(states) == 1:
            o, s = states[0]
        elif states:
            o, s = self.kernels.merge_states(torch.stack([x[0] for x in states]),
                                             torch.stack([x[1] for x in states]),
                                             backend="torch")
        else:  # no cold page: the empty state
            o, s = torch.zeros(b, hq, d), torch.full((b, hq), float("-inf"))
        elapsed = time.perf_counter() - t0
        out.copy_(o, non_blocking=True)
        lse.copy_(s, non_blocking=True)
        tel.kernel_launches += len(batches)
        tel.host_attn_bytes += scanned
        tel.host_attn_decode_bytes += scanned
        tel.host_attn_s += elapsed
        tel.split_steps += 1
        tel.d2h_bytes["query"] += q.numel() * q.element_size()
        self._count_h2d(tel, (o.numel() + s.numel()) * 4)
        self.last = (scanned, elapsed)

    def _count_h2d(self, tel, n: int) -> None:
        tel.h2d_bytes["partial"] += n
        if self.telemetry.decoding:
            tel.h2d_decode_bytes += n
            tel.partial_decode_bytes += n

    # --- prompt chunks ----------------------------------------------------------------------------

    def prefill(self, layer: int, qf: torch.Tensor, qo: torch.Tensor, *, sm_scale: float,
                softcap: float | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The partial states ``(out [B*T, H_q, D], lse [B*T, H_q])`` on the device of a prompt
        chunk's queries ``qf`` (rows ``qo[b]:qo[b+1]`` of sequence ``b``) over ``layer``'s cold
        pages, one per lower tier that holds some."""
        tel = self.telemetry.layers[layer]
        qh, qoh = qf.to("cpu"), qo.to("cpu")
        tel.d2h_bytes["query"] += qh.numel() * qh.element_size()
        parts = []
        for hb in self.batches(layer):
            res = self.kernels.paged_prefill(
                qh, self._pool(layer, hb), hb.table, qoh, sm_scale=sm_scale, causal=False,
                softcap=softcap, first_lane=hb.first_lane, validate=False, backend="torch")
            tel.kernel_launches += 1
            tel.host_attn_bytes += hb.pages * self.tiers[0].page_bytes
            self._count_h2d(tel, (res.out.numel() + res.lse.numel()) * 4)
            parts.append((res.out.to(self.device, torch.float32),
                          res.lse.to(self.device, torch.float32)))
        return parts

    def prefill_mass(self, layer: int, qd: torch.Tensor, lse: torch.Tensor, *, scale: float,
                     softcap: float | None, mass: torch.Tensor | None,
                     snap: torch.Tensor | None, snapkv_window: int) -> None:
        """A prompt chunk's attention mass on ``layer``'s cold pages under the merged ``lse``,
        added to ``mass`` (H2O) and to SnapKV's ``snap`` over the chunk's last
        ``snapkv_window`` queries (each ``[B * max_pages + 1]`` on the device, or None)."""
        b, hq, t, d = qd.shape
        lse_h = lse.to("cpu")
        qh = qd.to("cpu")
        for hb in self.batches(layer):
            pool = self._pool(layer, hb)
            kw = dict(sm_scale=scale, causal=False, softcap=softcap, validate=False,
                      first_lane=hb.first_lane, backend="torch")
            for target, w in ((mass, t), (snap, min(snapkv_window, t))):
                if target is None:
                    continue
                qw = qh[:, :, t - w:].permute(0, 2, 1, 3).reshape(b * w, hq, d)
                lw = lse_h.view(b, t, hq)[:, t - w:].reshape(b * w, hq).contiguous()
                qo = torch.arange(b + 1, dtype=torch.int32) * w
                values = self.kernels.paged_prefill_mass(qw, pool, hb.table, qo, lw, **kw)
                target.index_add_(0, hb.rows, values.sum(-1).float().to(target.device))
                self.telemetry.layers[layer].kernel_launches += 1

    def reset(self) -> None:
        """Forget the cached tables and the reads ahead (after a load, a reorder or a reset;
        a read in flight is let finish first)."""
        for _, _, fut in self._ahead.values():
            fut.exception()
        self._ahead.clear()
        self._batches = [None] * self.pages.num_layers


#: measured rates per (device, dtype, page shape, threads): a process measures each once
_RATES: dict[tuple, tuple[float, float]] = {}


def measure_rates(host: HostAttention, engine, *, pages: int = 256,
                  repeats: int = 3) -> tuple[float, float]:
    """``(link, host)`` bytes per second on this machine, for the cost model of
    ``attend="auto"``: ``pages`` pages of the cache's geometry copied from host memory to the
    device through the cache's transfer engine (the way recalled pages travel), and attended
    on the host by one query of four heads per KV head; the best of ``repeats``. Measured once
    per process and geometry (a cache per ``generate`` call does not measure again)."""
    key = (str(host.device), host.dtype, tuple(host.tiers[0].page_shape), host.threads,
           type(engine).__name__)
    if key not in _RATES:
        _RATES[key] = _measure(host, engine, pages, repeats)
    return _RATES[key]


def _measure(host: HostAttention, engine, pages: int, repeats: int) -> tuple[float, float]:
    tiers, dev = host.tiers, host.device
    shape = tiers[0].page_shape
    src = torch.randn(pages, *shape).to(host.dtype)
    if host.pinned:
        src = src.pin_memory()
    dst = torch.empty(pages, *shape, dtype=host.dtype, device=dev)
    idx = torch.arange(pages, dtype=torch.int32, device=dev)
    nbytes = src.numel() * src.element_size()

    def best(fn) -> float:
        times = []
        for _ in range(repeats + 1):  # the first run warms up (and compiles the host kernel)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return nbytes / max(min(times[1:]), 1e-9)

    def link() -> None:
        engine.wait(engine.copy(src, idx, dst, idx))  # slot lists live on the device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    table = PageTable(indices=torch.arange(pages, dtype=torch.int32),
                      row_start=torch.zeros(1, dtype=torch.int32),
                      row_count=torch.full((1,), pages, dtype=torch.int32),
                      last_page_len=torch.full((1,), shape[1], dtype=torch.int32))
    q = torch.randn(1, 4 * host.num_kv_heads, host.head_dim).to(host.dtype)
    src_host = src.contiguous()
    return best(link), best(lambda: host.kernels.host_decode(
        q, src_host, table, threads=host.threads, validate=False))
