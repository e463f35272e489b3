"""Importance of pages: attention mass from the kernels, Quest metadata and bounds, on the device.

Per layer, ``mass`` accumulates each page's attention mass on the device (flat
``[B * max_pages + 1]``: page ``pg`` of sequence ``b`` at ``b * max_pages + pg``, the last entry a
trash row for unused table entries). A decode step scatters every attended page's LSE into one
per-page buffer (``page_lse``, written by the attention kernels themselves); one kernel merges
the step's partial states and adds the mass under the merged LSE; nothing is read back.
``snap`` holds SnapKV's observation-window mass of the last prefill chunk. Where a policy needs
them, the key range of *every* page (Quest metadata: element-wise ``kmin``/``kmax`` of its keys,
per KV head) and its key sketch (every key at a few bits per channel, in one range per layer,
KV head and channel: :mod:`tierattn.kernels.sketch`; with ``key_rank`` < 1 the keys projected
first, :func:`key_basis`) stay on the device, so cold pages are
scored without moving them; both are written when a page is filled (or a prompt chunk lands)
and count in HBM (:func:`tierattn.storage.tiers.plan_memory`).

Policies rank pages on the host from a **snapshot**: when a structural decision is due at the
next step (a page filled, an eviction target grows), :meth:`Importance.snapshot` copies what the
policy reads to pinned host memory asynchronously; :meth:`Importance.host` returns it, waiting on
its event only if the copy has not landed (it was issued a whole step earlier). So ranks are at
most one step old and a decode step never blocks on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierattn.kernels import KernelSet, PageTable
from tierattn.kernels.sketch import quantize_keys, sketch_width
from tierattn.storage.pagemap import DeviceTable, PageMap
from tierattn.telemetry import Telemetry
from tierattn.storage.transfer import TransferEngine

__all__ = ["HostImportance", "Importance", "key_basis", "project_keys", "sketch_range"]


@dataclass
class HostImportance:
    """A host copy of one layer's importance (``[B, max_pages]`` CPU tensors)."""

    mass: torch.Tensor
    snap: torch.Tensor | None
    bound: torch.Tensor | None  # Quest bound of the latest decode query (None: none yet)
    recent: torch.Tensor | None = None  # mass of the last decode_window decode queries
    tickets: list = None  # the transfer engine's tickets of the copies
    extra: torch.Tensor | None = None  # the eviction policy's own score (``Importance.extra``)

    @property
    def window(self) -> torch.Tensor | None:
        """The observation window's mass: the last decode steps' once decoding has begun, else
        the prompt's last queries' (SnapKV's)."""
        return self.recent if self.recent is not None else self.snap

    def ready(self, engine: TransferEngine) -> HostImportance:
        for ticket in self.tickets:
            engine.wait_host(ticket)
        self.tickets = []
        return self


def sketch_range(keys: torch.Tensor, lens: torch.Tensor, margin: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The key sketch's quantization range, ``lo, hi [H_kv, D]`` fp32, from keys
    ``[n, P, H_kv, D]`` (``lens[i]`` valid tokens in page ``i``): their range per KV head and
    channel, widened by ``margin`` of its span on each side (later keys may reach further)."""
    valid = (torch.arange(keys.shape[1], device=keys.device)[None, :] < lens[:, None])
    v = valid[:, :, None, None]
    lo = torch.where(v, keys.float(), float("inf")).amin(dim=(0, 1))
    hi = torch.where(v, keys.float(), float("-inf")).amax(dim=(0, 1))
    span = (hi - lo) * margin
    return lo - span, hi + span


def key_basis(keys: torch.Tensor, lens: torch.Tensor, rank: int,
              queries: torch.Tensor | None = None) -> torch.Tensor:
    """The key sketch's projection, ``[H_kv, D, rank]`` fp32 with orthonormal columns: per KV
    head, the ``rank`` directions that carry most of the logits ``q . k`` -- the top
    eigenvectors of ``Cq^1/2 Ck Cq^1/2``, ``Ck`` the second moment of keys ``[n, P, H_kv, D]``
    (``lens[i]`` valid tokens in page ``i``) and ``Cq`` that of ``queries [N, H_kv, G, D]``
    (the GQA group's heads pooled; None: ``Cq = I``, the keys' own principal directions).

    A key is then kept as ``basis^T k`` and scored as ``(basis^T q) . (basis^T k)``. Post-RoPE
    keys spread over many directions (the rotation moves them with the position), so their
    own principal directions rank pages poorly at a quarter of the head dim; weighting by the
    queries keeps the directions the queries actually read. Moments, not covariances: the
    keys' mean is part of every logit. Measured on SmolLM2 (``tierattn eval keytier``, 2K
    context, 8-token pages, 10% recalled, 4-bit codes): 16 of 64 channels miss 1.08x the
    oracle's attention mass through this basis, 3.19x through the keys' own centred principal
    directions (the first version); every channel 1.03x."""
    valid = (torch.arange(keys.shape[1], device=keys.device)[None, :] < lens[:, None])
    k = keys.float() * valid[:, :, None, None]  # padding rows count nothing (no host sync)
    ck = torch.einsum("nphd,nphe->hde", k, k)  # scale-free: only the eigenvectors are used
    if queries is not None:
        q = queries.float().transpose(0, 1).flatten(1, 2)  # [H_kv, N * G, D]
        cq = q.transpose(1, 2) @ q
        val, vec = torch.linalg.eigh(cq)
        root = vec @ torch.diag_embed(val.clamp_min(0).sqrt()) @ vec.transpose(1, 2)
        ck = root @ ck @ root
    _, vecs = torch.linalg.eigh(ck)  # ascending eigenvalues
    return vecs.flip(-1)[..., :rank].contiguous()


def project_keys(keys: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Keys ``[n, P, H_kv, D]`` in a key sketch's channels: ``[n, P, H_kv, rank]`` fp32, through
    ``basis [H_kv, D, rank]`` (:func:`key_basis`)."""
    return torch.einsum("npkd,kdr->npkr", keys.float(), basis.float())


class Importance:
    """Page mass, SnapKV window mass, Quest metadata and host snapshots, per layer.

    Args:
        pages: the page map (geometry, padding).
        num_kv_heads, head_dim, dtype: of the keys (metadata is kept in the KV dtype).
        snapkv_window: SnapKV's observation window (queries).
        window_mass: keep SnapKV's window mass (an eviction policy reads it).
        key_range: keep every page's key range (Quest metadata).
        key_bits: keep every page's key sketch at this many bits per channel (None: no
            sketch), quantized in one range per layer, KV head and channel.
        key_rank: channels of the sketch (None: every channel of the key; fewer: each key
            projected onto the directions that carry the logits of the layer's first keys
            and queries, :func:`key_basis`).
        decode_window: keep the attention mass of the last ``decode_window`` decode queries
            per page (0: none; decode-time eviction policies read it).
        kernels, backend, telemetry: kernel entry points, their backend, launch counters.
        engine: the transfer engine (its asynchronous device-to-host copies take snapshots).
    """

    def __init__(self, pages: PageMap, *, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 snapkv_window: int, window_mass: bool, kernels: KernelSet, backend: str,
                 telemetry: Telemetry, engine: TransferEngine, key_range: bool = True,
                 key_bits: int | None = None, key_rank: int | None = None,
                 decode_window: int = 0) -> None:
        self.pages, self.kernels, self.backend, self.telemetry = pages, kernels, backend, telemetry
        self.engine = engine
        self.snapkv_window, self.num_kv_heads = snapkv_window, num_kv_heads
        b, mp, n, dev = pages.batch_size, pages.max_pages, pages.num_layers, pages.device
        self.kmin = self.kmax = self.codes = None
        if key_range:
            self.kmin = torch.zeros(n, b * mp, num_kv_heads, head_dim, dtype=dtype, device=dev)
            self.kmax = torch.zeros_like(self.kmin)
        self.key_bits = key_bits
        # [layers, H_kv, D, rank]: the sketch's projection (key_rank), kept in the KV dtype like
        # the range; keys and queries go through the same rounded basis
        self.basis = None
        if key_bits is not None:
            rank = head_dim if key_rank is None or key_rank >= head_dim else key_rank
            if rank < head_dim:
                self.basis = torch.zeros(n, num_kv_heads, head_dim, rank, dtype=dtype,
                                         device=dev)
            width = sketch_width(rank, key_bits)
            self.codes = torch.zeros(n, b * mp, num_kv_heads, pages.page_size, width,
                                     dtype=torch.uint8, device=dev)
            # the sketch's quantization range: per layer, KV head and channel, set from the
            # first keys the layer stores (the prompt), widened by SKETCH_MARGIN on each side;
            # later keys outside it are clamped; kept in the KV dtype, the dtype the scoring
            # kernel reads, so a decode step converts nothing
            self.sk_lo = torch.zeros(n, num_kv_heads, rank, dtype=dtype, device=dev)
            self.sk_hi = torch.zeros_like(self.sk_lo)
        # per layer, the scoring kernel's arguments as views made once (every fit writes the
        # tensors in place), so a decode step builds none: codes, range per row, basis
        self._sketch_args = [
            (self.codes[i], self.sk_lo[i].expand(b * mp, -1, -1),
             self.sk_hi[i].expand(b * mp, -1, -1), None if self.basis is None else self.basis[i])
            for i in range(n)] if self.codes is not None else None
        self._sk_set = [False] * n
        # a projected sketch is fitted on the first prompt chunk's keys *and* queries: the
        # chunk's pages wait here (keys, lens, rows) until its attention brings the queries
        self._unfit: list[list[tuple]] = [[] for _ in range(n)]
        self.mass = torch.zeros(n, b * mp + 1, dtype=torch.float32, device=dev)
        self.snap = torch.zeros_like(self.mass) if window_mass else None
        # the last decode_window steps' mass per page (a ring), and the mass they started from
        self.recent = torch.zeros(n, decode_window, b * mp + 1, device=dev) \
            if decode_window else None
        self._prev = torch.zeros_like(self.mass) if decode_window else None
        self._ring = [0] * n  # next ring slot per layer
        self.decode_steps = [0] * n  # decode steps tracked per layer
        self.last_q: list[torch.Tensor | None] = [None] * n  # [B, H_q, D] latest decode query
        self.page_lse: torch.Tensor | None = None  # [B * max_pages + 1, H_q], built on first use
        self._pending = False  # page_lse holds a step's scatter not merged yet
        # one row per sequence over its max_pages rows of page_lse (for the mass kernel), and
        # over its metadata rows (Quest bound of every page)
        start = torch.arange(b, dtype=torch.int32, device=dev) * mp
        full = torch.full((b,), mp, dtype=torch.int32, device=dev)
        self.per_page = PageTable(indices=torch.arange(b * mp, dtype=torch.int32, device=dev),
                                  row_start=start, row_count=full,
                                  last_page_len=torch.ones(b, dtype=torch.int32, device=dev))
        self._host: list[HostImportance | None] = [None] * n
        pinned = dev.type == "cuda"
        self._host_bufs = [torch.zeros(5, b, mp, pin_memory=pinned) for _ in range(n)]
        #: ``(layer) -> [B, max_pages]`` device score an eviction policy computes itself (R-KV's
        #: redundancy), copied back with every snapshot; None: none
        self.extra: Callable[[int], torch.Tensor] | None = None

    def of(self, layer: int) -> torch.Tensor:
        """``[B, max_pages]`` view of ``layer``'s accumulated mass (on the device)."""
        b, mp = self.pages.batch_size, self.pages.max_pages
        return self.mass[layer, :b * mp].view(b, mp)

    def reset(self) -> None:
        self.mass.zero_()
        for t in (self.snap, self.recent, self._prev):
            if t is not None:
                t.zero_()
        self._ring = [0] * self.pages.num_layers
        self.decode_steps = [0] * self.pages.num_layers
        self._sk_set = [False] * self.pages.num_layers
        self._unfit = [[] for _ in range(self.pages.num_layers)]
        self.last_q = [None] * self.pages.num_layers
        self._host = [None] * self.pages.num_layers

    def clear_sequence(self, sequence: int) -> None:
        mp = self.pages.max_pages
        rows = slice(sequence * mp, (sequence + 1) * mp)
        for t in (self.mass, self.snap, self._prev):
            if t is not None:
                t[:, rows] = 0
        if self.recent is not None:
            self.recent[:, :, rows] = 0

    def track(self, layer: int, decode: bool) -> None:
        """After an attention call: a decode step's page mass enters the ring of the last
        ``decode_window`` steps (device ops, no host read); a prompt chunk's does not."""
        if self.recent is None:
            return
        if decode:
            self.recent[layer, self._ring[layer]] = self.mass[layer] - self._prev[layer]
            self._ring[layer] = (self._ring[layer] + 1) % self.recent.shape[1]
            self.decode_steps[layer] += 1
        self._prev[layer].copy_(self.mass[layer])

    # --- attention mass ------------------------------------------------------------------------

    def decode_buffer(self, num_q_heads: int) -> torch.Tensor:
        """The per-page LSE buffer of one decode step (every row -inf: the merge that consumes
        it resets the rows it read, so no step pays for a fill)."""
        rows = self.pages.batch_size * self.pages.max_pages + 1
        if self.page_lse is None or self.page_lse.shape[1] != num_q_heads:
            self.page_lse = torch.full((rows, num_q_heads), float("-inf"), dtype=torch.float32,
                                       device=self.pages.device)
        elif self._pending:  # a step stopped between its kernels and the merge
            self.page_lse.fill_(float("-inf"))
        self._pending = True
        return self.page_lse

    def merge_decode(self, layer: int, o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                     out_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge a decode step's partial states ``o [N, B, H_q, D]``, ``lse [N, B, H_q]`` and
        add every page's mass under the merged LSE to ``layer``'s importance: one kernel, on
        the device (:func:`~tierattn.kernels.merge_page_mass`)."""
        res = self.kernels.merge_page_mass(o, lse, self.page_lse, self.mass[layer],
                                           pages_per_row=self.pages.max_pages, out=out,
                                           out_lse=out_lse, backend=self.backend)
        self._pending = False
        self.telemetry.layers[layer].kernel_launches += 1
        return res

    def add_entries(self, layer: int, table: DeviceTable, values: torch.Tensor,
                    into: torch.Tensor | None = None) -> None:
        """Scatter-add per-entry ``values [cap, H_kv]`` (summed over heads) of ``table`` into
        ``layer``'s mass (or ``into``); unused entries land in the trash row."""
        target = self.mass if into is None else into
        target[layer].index_add_(0, table.lse_index, values.sum(-1).float())

    def add_prefill(self, layer: int, table: DeviceTable, pool: torch.Tensor, causal: bool, *,
                    qd: torch.Tensor, lse: torch.Tensor, scale: float, softcap: float | None,
                    mass: bool, snap: bool) -> None:
        """Importance from a prompt chunk ``qd [B, H_q, T, D]`` over one page set, under the
        merged ``lse``: the chunk's attention mass (H2O) and SnapKV's observation-window mass."""
        if not table.total:
            return
        b, hq, t, d = qd.shape
        kw = dict(sm_scale=scale, causal=causal, softcap=softcap, validate=False,
                  first_lane=table.first_lane,
                  sliding_window=self.pages.layers[layer].window if causal else None,
                  backend=self.backend)
        tel = self.telemetry.layers[layer]
        device = qd.device
        if mass:
            qf = qd.permute(0, 2, 1, 3).reshape(b * t, hq, d)
            qo = torch.arange(b + 1, dtype=torch.int32, device=device) * t
            self.add_entries(layer, table,
                             self.kernels.paged_prefill_mass(qf, pool, table.table, qo, lse, **kw))
            tel.kernel_launches += 1
        if snap:
            w = min(self.snapkv_window, t)
            qw = qd[:, :, t - w:].permute(0, 2, 1, 3).reshape(b * w, hq, d)
            lw = lse.view(b, t, hq)[:, t - w:].reshape(b * w, hq).contiguous()
            qo = torch.arange(b + 1, dtype=torch.int32, device=device) * w
            self.add_entries(layer, table,
                             self.kernels.paged_prefill_mass(qw, pool, table.table, qo, lw, **kw),
                             into=self.snap)
            tel.kernel_launches += 1

    # --- Quest metadata and bounds -------------------------------------------------------------

    def write_metadata(self, layer: int, pool: torch.Tensor, slots: torch.Tensor,
                       lens: torch.Tensor, rows: torch.Tensor, *, queries_follow: bool = False
                       ) -> None:
        """Key range (Quest ``kmin``/``kmax``) and key sketch of pages ``pool[slots[i]]``
        (``lens[i]`` tokens) into metadata rows ``rows[i]`` (``b * max_pages + page``); nothing
        when no policy reads them. ``queries_follow``: a prompt chunk whose attention comes
        next -- a projected sketch not fitted yet waits for its queries (:meth:`fit_sketch`)."""
        dev = self.pages.device
        rows = rows.to(dev, torch.int32)
        if self.kmin is not None:
            self.kernels.page_metadata(pool, slots.to(dev, torch.int32),
                                       lens.to(dev, torch.int32), kmin=self.kmin[layer],
                                       kmax=self.kmax[layer], rows=rows, validate=False,
                                       backend=self.backend)
            self.telemetry.layers[layer].kernel_launches += 1
        if self.codes is not None and slots.numel():  # rare (a page filled): no host read
            keys = pool[slots.to(pool.device).long(), 0]  # [n, P, H_kv, D]
            lens = lens.to(keys.device)
            if not self._sk_set[layer] and self._unfit[layer]:
                self.fit_sketch(layer, None)  # an earlier chunk's queries never came
            if not self._sk_set[layer]:
                self._unfit[layer].append((keys, lens, rows))
                if not (queries_follow and self.basis is not None):
                    self.fit_sketch(layer, None)
                return
            self._write_codes(layer, self._project_keys(layer, keys), rows)

    def fit_sketch(self, layer: int, queries: torch.Tensor | None) -> None:
        """Fit ``layer``'s sketch (its projection and range) on the first keys it stored, and
        write their codes; ``queries [B, H_q, T, D]``: the prompt chunk's (None: the keys
        alone). Nothing once fitted."""
        if self._sk_set[layer] or not self._unfit[layer]:
            return
        keys, lens, rows = (torch.cat(x) for x in zip(*self._unfit[layer]))
        if self.basis is not None:
            q = None
            if queries is not None:  # [B, H_q, T, D] -> [B * T, H_kv, G, D]
                b, hq, t, d = queries.shape
                q = queries.permute(0, 2, 1, 3).reshape(b * t, self.num_kv_heads, -1, d)
            self.basis[layer] = key_basis(keys, lens, self.basis.shape[-1], q)
        keys = self._project_keys(layer, keys)  # once, for the range and the codes
        self.sk_lo[layer], self.sk_hi[layer] = sketch_range(keys, lens, self.SKETCH_MARGIN)
        self._sk_set[layer], self._unfit[layer] = True, []
        self._write_codes(layer, keys, rows)

    def fit_sketch_all(self) -> None:
        """Fit every layer whose first keys still wait for queries on the keys alone (the
        cache calls it before rows move or are freed, so no pending row is stale)."""
        for layer in range(self.pages.num_layers):
            self.fit_sketch(layer, None)

    def sketch_fit_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of one layer's fitted key sketch (its range, and its basis when projected)
        as a snapshot stores them; empty without a sketch."""
        if self.codes is None:
            return {}
        shapes = {"sketch_lo": tuple(self.sk_lo.shape[1:]),
                  "sketch_hi": tuple(self.sk_hi.shape[1:])}
        if self.basis is not None:
            shapes["sketch_basis"] = tuple(self.basis.shape[1:])
        return shapes

    def sketch_fit(self, layer: int) -> dict[str, torch.Tensor]:
        """``layer``'s fitted key sketch for a snapshot (empty until fitted): a restored cache
        codes its pages as the saved one did."""
        if self.codes is None or not self._sk_set[layer]:
            return {}
        fit = {"sketch_lo": self.sk_lo[layer], "sketch_hi": self.sk_hi[layer]}
        if self.basis is not None:
            fit["sketch_basis"] = self.basis[layer]
        return fit

    def restore_sketch_fit(self, layer: int, fit: dict[str, torch.Tensor]) -> None:
        """Take ``layer``'s fitted key sketch from a snapshot (validated there); without one the
        restored pages fit it on their keys alone."""
        if not fit:
            return
        self.sk_lo[layer].copy_(fit["sketch_lo"])
        self.sk_hi[layer].copy_(fit["sketch_hi"])
        if self.basis is not None:
            self.basis[layer].copy_(fit["sketch_basis"])
        self._sk_set[layer], self._unfit[layer] = True, []

    def _write_codes(self, layer: int, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Codes of ``keys [n, P, H_kv, rank]`` (in the sketch's channels) into ``rows``."""
        n = keys.shape[0]
        lo, hi = self.sk_lo[layer].expand(n, -1, -1), self.sk_hi[layer].expand(n, -1, -1)
        self.codes[layer, rows.long()] = quantize_keys(keys, lo, hi, bits=self.key_bits)

    def _project_keys(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """``keys [n, P, H_kv, D]`` in the sketch's channels (themselves without a basis)."""
        return keys if self.basis is None else project_keys(keys, self.basis[layer])

    #: how far the sketch's range reaches past the first keys' range, on each side
    SKETCH_MARGIN = 0.1

    def sketch_score(self, layer: int, q: torch.Tensor, table: PageTable, *, reduce: str,
                     sm_scale: float, softcap: float | None) -> torch.Tensor:
        """Key-sketch score ``[nnz, H_kv]`` (the page's largest estimated logit, or its
        estimated attention mass with ``reduce="lse"``) of query ``q [B, H_q, D]`` for the
        metadata rows ``table`` lists (on the device)."""
        if not self._sk_set[layer]:  # no prompt chunk brought queries: fit on the keys
            self.fit_sketch(layer, None)
        self.telemetry.layers[layer].kernel_launches += 1
        codes, lo, hi, basis = self._sketch_args[layer]
        # a projected sketch's query goes through the basis inside the kernel (no extra launch)
        return self.kernels.sketch_score(q, codes, lo, hi, table, bits=self.key_bits,
                                         reduce=reduce, sm_scale=sm_scale, softcap=softcap,
                                         validate=False, basis=basis, backend=self.backend)

    def quest_bound(self, layer: int, q: torch.Tensor, table: PageTable) -> torch.Tensor:
        """Quest bound ``[nnz, H_kv]`` of query ``q [B, H_q, D]`` for the metadata rows
        ``table`` lists (on the device)."""
        self.telemetry.layers[layer].kernel_launches += 1
        return self.kernels.quest_score(q, self.kmin[layer], self.kmax[layer], table,
                                        validate=False, backend=self.backend)

    # --- host snapshots ------------------------------------------------------------------------

    def snapshot(self, layer: int, *, bound: bool = False) -> None:
        """Start copying ``layer``'s mass (and SnapKV mass, and with ``bound`` the Quest bound
        of its latest decode query over every page) to host memory, without waiting."""
        b, mp = self.pages.batch_size, self.pages.max_pages
        buf = self._host_bufs[layer]
        tickets = [self.engine.to_host(self.of(layer), buf[0])]
        if self.snap is not None:
            tickets.append(self.engine.to_host(self.snap[layer, :b * mp].view(b, mp), buf[1]))
        q = self.last_q[layer]
        have_bound = bound and q is not None
        if have_bound:
            scores = self.quest_bound(layer, q, self.per_page).max(-1).values.view(b, mp)
            tickets.append(self.engine.to_host(scores, buf[2]))
        have_recent = self.recent is not None and self.decode_steps[layer] > 0
        if have_recent:
            recent = self.recent[layer].sum(0)[:b * mp].view(b, mp)
            tickets.append(self.engine.to_host(recent, buf[3]))
        if self.extra is not None:
            tickets.append(self.engine.to_host(self.extra(layer), buf[4]))
        self._host[layer] = HostImportance(buf[0], buf[1] if self.snap is not None else None,
                                           buf[2] if have_bound else None,
                                           buf[3] if have_recent else None, tickets,
                                           buf[4] if self.extra is not None else None)

    def host(self, layer: int, *, bound: bool = False, fresh: bool = False) -> HostImportance:
        """The latest snapshot of ``layer`` (taken now if there is none, or with ``fresh``)."""
        snap = self._host[layer]
        if fresh or snap is None or (bound and snap.bound is None and
                                     self.last_q[layer] is not None):
            self.snapshot(layer, bound=bound)
        return self._host[layer].ready(self.engine)

    def reorder(self, index: torch.Tensor) -> None:
        """Sequence ``i`` takes old sequence ``index[i]``'s importance and metadata."""
        b, mp = self.pages.batch_size, self.pages.max_pages
        src = (index[:, None] * mp + torch.arange(mp)).flatten().to(self.mass.device)
        for t in (self.mass, self.snap, self._prev):
            if t is not None:
                t[:, :b * mp] = t[:, src]
        if self.recent is not None:
            self.recent[:, :, :b * mp] = self.recent[:, :, src]
        for t in (self.kmin, self.kmax, self.codes):
            if t is not None:
                t[:] = t[:, src]
        self._host = [None] * self.pages.num_layers
        self.last_q = [None] * self.pages.num_layers
