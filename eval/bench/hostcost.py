"""Host cost of the tiered path: Python orchestration per layer and decode step, and the decode
step time of the tiny reasoner against transformers' own attention, measured side by side.

Two tools:

* :class:`KernelTimer` (a context manager) wraps the kernel entry points of a cache
  (``cache.kernels``: every kernel and page-copy launch of the runtime and its transfer engine
  goes through that one object) and the cache's ``attend``/``update`` with timing wrappers --
  instrumentation, not mocks: the real functions still run -- and restores them on exit.
  ``attend`` wall time minus the time spent inside kernel and copy calls is the host
  orchestration of the tiered runtime (tables, policy, telemetry, small torch ops).
  :func:`attend_host_overhead` runs a decode step function under it and reports that per layer
  per decode step (``tierattn bench`` uses the timer on Llama-8B-shaped KV at 4K..128K).
* :func:`reasoner_step_times` times one greedy decode step (a forward of one token with the
  cache, then argmax; no tokenizer work) of the shipped tiny reasoner with (a) transformers'
  ``sdpa`` and its default ``DynamicCache``, (b) the tiered path with everything hot and (c) the
  tiered path at 50% hot (exact: the cold half is fetched back every step), in one run with the
  variants interleaved per repeat so that machine noise hits all of them alike.

    python -m tierattn.eval.bench.hostcost --steps 32 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator

import torch

from tierattn.kernels import KernelSet
from tierattn.storage.transfer import CPUTransferEngine

__all__ = ["HOST_VARIANTS", "KERNEL_NAMES", "HostReads", "KernelTimer", "MetaEngine",
           "OpCounter", "attend_host_overhead", "host_row", "reasoner_step_times",
           "stub_kernels"]

#: the kernel entry points the runtime calls through ``cache.kernels``
KERNEL_NAMES = KernelSet.names()


def _cuda_sync_needed(sync: bool | None) -> bool:
    if sync is not None:
        return sync and torch.cuda.is_available()
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class KernelTimer:
    """Time spent inside the runtime's kernel and copy calls, and in ``attend``/``update``.

    ``with KernelTimer(cache) as kt: ...`` replaces, for the duration of the block:

    * every kernel entry point of ``cache.kernels`` (:data:`KERNEL_NAMES`, the page copies of
      its transfer engine included) by a wrapper that calls the original and adds the call's
      wall time;
    * the cache's ``attend`` and ``update`` (instance attributes, so only that cache) by
      wrappers that record each call's wall time and the kernel/copy time spent inside it.

    Everything is restored on exit, also after an exception. Not re-entrant across threads.

    Args:
        cache: the :class:`~tierattn.runtime.cache.TieredKVCache` whose calls are split into kernel
        and
            host time.
        sync: synchronize CUDA before and after every wrapped call, so that a kernel's device
            time counts as kernel time and not as host time of whoever syncs next (default: when
            CUDA is initialized). It serialises the pipeline: measure step times without it.

    Attributes:
        kernel_s: total seconds inside wrapped kernel and copy calls (anywhere).
        calls: ``Counter`` of wrapped calls by name; ``seconds``: seconds by name.
        attend: per ``attend`` call, ``(layer, T, wall_s, kernel_s)``; ``update``: likewise.
    """

    def __init__(self, cache, *, sync: bool | None = None) -> None:
        self.cache = cache
        self.sync = _cuda_sync_needed(sync)
        self.kernel_s = 0.0
        self.calls: Counter[str] = Counter()
        self.seconds: dict[str, float] = defaultdict(float)
        self.attend: list[tuple[int, int, float, float]] = []
        self.update: list[tuple[int, int, float, float]] = []
        self._saved: list[tuple[object, str, object]] = []

    def _sync(self) -> None:
        if self.sync:
            torch.cuda.synchronize()

    def _wrap_kernel(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                dt = time.perf_counter() - t0
                self.kernel_s += dt
                self.calls[name] += 1
                self.seconds[name] += dt
        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def _wrap_call(self, fn: Callable, into: list, t_of: Callable) -> Callable:
        def timed(layer, x, *args, **kwargs):
            self._sync()
            k0, t0 = self.kernel_s, time.perf_counter()
            try:
                return fn(layer, x, *args, **kwargs)
            finally:
                self._sync()
                into.append((layer, t_of(x), time.perf_counter() - t0, self.kernel_s - k0))
        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def _replace(self, owner: object, name: str, new: object) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, new)

    def __enter__(self) -> KernelTimer:
        c = self.cache
        try:
            for name in KERNEL_NAMES:
                self._replace(c.kernels, name, self._wrap_kernel(name, getattr(c.kernels, name)))
            self._replace(c, "attend", self._wrap_call(c.attend, self.attend,
                                                       lambda q: q.shape[2]))
            self._replace(c, "update", self._wrap_call(c.update, self.update,
                                                       lambda k: k.shape[2]))
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        while self._saved:
            owner, name, old = self._saved.pop()
            if old is _MISSING:
                delattr(owner, name)  # an instance attribute we added: the method shows again
            else:
                setattr(owner, name, old)

    def __exit__(self, *exc) -> None:
        self._restore()

    # --- summaries -------------------------------------------------------------------------

    def summary(self, *, decode_only: bool = True) -> dict:
        """Per ``attend`` call (= per layer per step when ``decode_only``), in microseconds:
        mean and median of the wall time, the kernel/copy time inside it and the remainder
        (host orchestration); the same for ``update``; and the wrapped call counts."""
        out: dict = {"kernel_calls": dict(self.calls),
                     "kernel_s_by_name": {k: round(v, 6) for k, v in self.seconds.items()}}
        for what, rows in (("attend", self.attend), ("update", self.update)):
            rows = [r for r in rows if r[1] == 1] if decode_only else rows
            out[f"{what}_calls"] = len(rows)
            if not rows:
                continue
            wall = [r[2] * 1e6 for r in rows]
            kern = [r[3] * 1e6 for r in rows]
            host = [w - k for w, k in zip(wall, kern)]
            for key, xs in (("wall", wall), ("kernel", kern), ("host", host)):
                out[f"{what}_{key}_us_mean"] = statistics.fmean(xs)
                out[f"{what}_{key}_us_median"] = statistics.median(xs)
            out[f"{what}_host_fraction"] = sum(host) / max(sum(wall), 1e-12)
        return out


_MISSING = object()


# --- kernels replaced by instant stubs, and host reads counted --------------------------------

def stub_kernels() -> KernelSet:
    """A :class:`KernelSet` whose entry points return outputs of the right shapes at once (they
    compute nothing): what is left of a step is the runtime's own work. Buffers passed as
    ``out=`` are returned as they are; outputs are allocated on the inputs' device."""
    from tierattn.kernels import DecodeOutput, PageSelection, PrefillOutput

    def sparse_decode(q, kv_pool, page_table, *, out=None, lse=None, return_page_mass=False,
                      page_lse=None, **_):
        b, hq, d = q.shape
        out = out if out is not None else torch.empty(b, hq, d, device=q.device)
        lse = lse if lse is not None else torch.empty(b, hq, device=q.device)
        mass = torch.zeros(page_table.indices.numel(), kv_pool.shape[3], device=q.device) \
            if return_page_mass else None
        return DecodeOutput(out, lse, mass, page_lse)

    def paged_prefill(q, kv_pool, page_table, qo_indptr, *, return_page_mass=False, **_):
        n, hq, d = q.shape
        mass = torch.zeros(page_table.indices.numel(), kv_pool.shape[3], device=q.device) \
            if return_page_mass else None
        return PrefillOutput(torch.zeros(n, hq, d, device=q.device),
                             torch.zeros(n, hq, device=q.device), mass)

    def merge_states(o, lse, *, out=None, out_lse=None, **_):
        return (out if out is not None else torch.empty(o.shape[1:], device=o.device),
                out_lse if out_lse is not None else torch.empty(lse.shape[1:], device=o.device))

    def merge_page_mass(o, lse, page_lse, mass, *, out=None, out_lse=None, **_):
        return merge_states(o, lse, out=out, out_lse=out_lse)

    def host_decode(q, kv_pool, page_table, *, out=None, lse=None, page_lse=None, **_):
        b, hq, d = q.shape
        return DecodeOutput(out if out is not None else torch.zeros(b, hq, d),
                            lse if lse is not None else torch.zeros(b, hq), None, page_lse)

    def per_entry(table, heads, device):
        return torch.zeros(table.indices.numel(), heads, device=device)

    def select_pages(scores, k, *, cand_slots, out_lse=None, out_first=None, out_dst=None,
                     **_):
        b, dev = scores.shape[0], scores.device
        slots = torch.full((cand_slots.shape[0], b, k), -1, dtype=torch.int32, device=dev)
        new = lambda out: out if out is not None else \
            torch.empty(b, k, dtype=torch.int32, device=dev)  # noqa: E731
        return PageSelection(torch.full((b, k), -1, device=dev), slots, slots, new(out_lse),
                             out_first, new(out_dst))

    return KernelSet(
        sparse_decode=sparse_decode,
        decode_page_mass=lambda page_lse, lse, table, hkv, **_: per_entry(table, hkv,
                                                                          lse.device),
        merge_states=merge_states,
        merge_page_mass=merge_page_mass,
        page_metadata=lambda pool, slots, lens, *, kmin=None, kmax=None, **_: (kmin, kmax),
        paged_prefill=paged_prefill,
        paged_prefill_mass=lambda q, pool, table, qo, lse, **_: per_entry(table, pool.shape[3],
                                                                          q.device),
        quest_score=lambda q, kmin, kmax, table, **_: per_entry(table, kmin.shape[1], q.device),
        sketch_score=lambda q, codes, kmin, kmax, table, **_: per_entry(table, kmin.shape[1],
                                                                        q.device),
        select_pages=select_pages,
        copy_pages=lambda *a, **k: None,
        host_decode=host_decode)


class MetaEngine(CPUTransferEngine):
    """A transfer engine for a runtime on PyTorch's ``meta`` device (no data): its device-to-
    host copies (:meth:`to_host`, the runtime's one sanctioned way back) are counted, not made."""

    def __init__(self, backend: str | None = None) -> None:
        super().__init__(backend)
        self.to_host_calls = 0

    def to_host(self, src, dst):
        self.to_host_calls += 1
        return None


#: Tensor methods that read device data into host Python values
_READ_METHODS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__",
                 "__index__")
#: operators whose output shape or value depends on the data (a sync on a GPU)
_READ_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.unique",
             "aten._unique", "aten.masked_select", "aten.repeat_interleave.Tensor",
             "aten.is_nonzero", "aten.allclose")


class HostReads:
    """Counts host reads of device data while the block runs, for a runtime on the ``meta``
    device (where every device tensor has no data, so a read cannot be served).

    ``with HostReads() as reads: ...``: a ``Tensor`` method that reads values
    (:data:`_READ_METHODS`) or an operator whose result depends on the data
    (:data:`_READ_OPS`, boolean-mask indexing included) applied to a meta tensor is recorded
    with the line of tierattn code that made it, and answered with a placeholder (zeros,
    False) so the run goes on. Host tensors (the runtime's host map) are not counted.
    ``reads.count`` and ``reads.sites`` hold the result.
    """

    def __init__(self) -> None:
        self.count = 0
        self.sites: Counter[str] = Counter()
        self._saved: list[tuple[str, object]] = []
        self._mode = None

    def _record(self, what: str) -> None:
        import traceback

        self.count += 1
        frames = [f for f in traceback.extract_stack()[:-2] if "/tierattn/" in f.filename
                  or "/kernels/" in f.filename or "/models/" in f.filename]
        where = f"{frames[-1].filename.rsplit('/', 2)[-2:]}:{frames[-1].lineno}" if frames \
            else "?"
        self.sites[f"{what} at {where}"] += 1

    def __enter__(self) -> HostReads:
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self

        def patched(name: str, original):
            def read(t, *args, **kwargs):
                if isinstance(t, torch.Tensor) and t.is_meta:
                    reads._record(f"Tensor.{name}()")
                    if name in ("__bool__",):
                        return False
                    if name in ("__int__", "__index__", "item"):
                        return 0
                    if name == "__float__":
                        return 0.0
                    if name == "tolist":
                        return torch.zeros(t.shape, dtype=t.dtype).tolist()
                    return torch.zeros(t.shape, dtype=t.dtype)
                return original(t, *args, **kwargs)
            return read

        for name in _READ_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved.append((name, torch.Tensor.__dict__.get(name, _MISSING)))
            setattr(torch.Tensor, name, patched(name, original))

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                indices = args[1] if name == "aten.index" and len(args) > 1 else ()
                bool_index = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                 for i in (indices or ()))
                if any(t.is_meta for t in tensors) and (
                        name in _READ_OPS or str(func) in _READ_OPS or bool_index):
                    reads._record(name)
                    if name == "aten._local_scalar_dense":
                        return 0
                    if name in ("aten.equal", "aten.is_nonzero", "aten.allclose"):
                        return False
                    if name == "aten.nonzero":
                        return torch.empty(0, tensors[0].dim(), dtype=torch.long, device="meta")
                    return torch.empty(0, device="meta")
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)
        self._saved = []


#: aten operators that only change a tensor's view (no kernel on a GPU)
_VIEW_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.slice", "aten.select", "aten.unsqueeze",
    "aten.squeeze", "aten.t", "aten.expand", "aten.permute", "aten.alias", "aten.as_strided",
    "aten._reshape_alias", "aten.detach", "aten.transpose", "aten.reshape", "aten.unbind",
    "aten.split", "aten.split_with_sizes", "aten.lift_fresh", "aten.view_as_real",
    "aten._to_copy_noop"})


class OpCounter:
    """Counts the torch operators a cache's own code dispatches while the block runs, the
    kernel entry points of ``cache.kernels`` excluded (views are counted apart: on a GPU they
    launch nothing)."""

    def __init__(self, cache) -> None:
        self.cache, self.ops, self.views = cache, 0, 0
        self._paused = 0
        self._saved: list[tuple[str, object]] = []

    def __enter__(self) -> OpCounter:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        for name in KERNEL_NAMES:
            fn = getattr(self.cache.kernels, name)
            self._saved.append((name, fn))

            def paused(*a, _fn=fn, **k):
                counter._paused += 1
                try:
                    return _fn(*a, **k)
                finally:
                    counter._paused -= 1
            setattr(self.cache.kernels, name, paused)

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not counter._paused:
                    name = str(getattr(func, "overloadpacket", func))
                    if name in _VIEW_OPS:
                        counter.views += 1
                    else:
                        counter.ops += 1
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for name, fn in self._saved:
            setattr(self.cache.kernels, name, fn)


#: the runtime variants of the host-cost rows: preset and overrides
HOST_VARIANTS = {
    "dense": ("dense", {}),
    "offload": ("offload", {"hot_budget": 0.5}),
    "topk": ("topk", {}),
}


def host_row(variant: str, context: int, batch: int, *, steps: int = 64, layers: int = 2,
             page_size: int = 16, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
             threads: int | None = 1) -> dict:
    """The tiered runtime's own work per layer and decode step, kernels replaced by stubs.

    Llama-8B-shaped KV (``q_heads``/``kv_heads``, ``head_dim``, bf16) at ``context`` tokens and
    ``batch`` sequences, ``layers`` layers; after the prefill, ``steps`` decode steps (several
    pages filled, so the structural work -- new pages, demotions, table rebuilds -- is in the
    mean) are measured three ways:

    * on the CPU under :class:`KernelTimer` with :func:`stub_kernels`: ``update`` + ``attend``
      wall time minus the time inside the stubs, per layer and step (mean and median);
    * on PyTorch's ``meta`` device (no data) under :class:`HostReads` and :class:`OpCounter`:
      host reads of device data, torch operators and views the runtime dispatches;
    * from the runtime's telemetry: kernel and copy launches.

    Returns:
        one row: ``variant, context, batch, host_us_per_layer_step`` (mean),
        ``host_us_median``, ``launches_per_layer_step``, ``device_reads_per_layer_step``,
        ``torch_ops_per_layer_step``, ``views_per_layer_step``,
        ``to_host_copies_per_layer_step`` (asynchronous snapshots of the importance).
    """
    from tierattn.runtime.cache import TieredKVCache
    from tierattn.config import TierConfig

    preset, overrides = HOST_VARIANTS[variant]
    chunk = min(context, 8192)
    cfg = TierConfig.preset(preset, page_size=page_size, max_context=context + steps + page_size,
                            prefill_chunk_size=chunk, backend="torch", **overrides)
    per = steps * layers

    def run(device: str, measure) -> tuple[TieredKVCache, object]:
        engine = MetaEngine() if device == "meta" else None
        cache = TieredKVCache(cfg, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                              batch_size=batch, dtype=torch.bfloat16, device=device,
                              kernels=stub_kernels(), engine=engine)
        kv = lambda t: torch.zeros(batch, kv_heads, t, head_dim, dtype=torch.bfloat16,
                                   device=device)
        q = lambda t: torch.zeros(batch, q_heads, t, head_dim, dtype=torch.bfloat16,
                                  device=device)
        for start in range(0, context, chunk):
            for layer in range(layers):
                t = min(chunk, context - start)
                cache.update(layer, kv(t), kv(t))
                cache.attend(layer, q(t))  # a prompt chunk (a projected key sketch is fitted)
        cache.telemetry.reset()
        one, q1 = kv(1), q(1)
        with measure(cache) as m:
            for _ in range(steps):
                for layer in range(layers):
                    cache.update(layer, one, one)
                    cache.attend(layer, q1)
        return cache, m

    with _threads(threads):
        cache, timer = run("cpu", KernelTimer)
        tot = cache.stats()["total"]
        launches = (tot["kernel_launches"] + tot["copy_launches_decode"]) / per
        del cache

        @contextlib.contextmanager
        def reads_and_ops(c):
            with HostReads() as reads, OpCounter(c) as ops:
                yield (reads, ops)

        meta, (reads, ops) = run("meta", reads_and_ops)
    host = [a[2] - a[3] + u[2] - u[3] for a, u in zip(timer.attend, timer.update)]
    return {
        "variant": variant, "context": context, "batch": batch, "steps": steps,
        "layers": layers,
        "host_us_per_layer_step": statistics.fmean(host) * 1e6,
        "host_us_median": statistics.median(host) * 1e6,
        "launches_per_layer_step": launches,
        "device_reads_per_layer_step": reads.count / per,
        "torch_ops_per_layer_step": ops.ops / per,
        "views_per_layer_step": ops.views / per,
        "to_host_copies_per_layer_step": meta.engine.to_host_calls / per,
        "read_sites": dict(reads.sites),
    }


def attend_host_overhead(cache, step: Callable[[int], object], steps: int, *,
                         warmup: int = 1, sync: bool | None = None) -> dict:
    """Host orchestration of ``cache`` per layer per decode step.

    Args:
        cache: the :class:`~tierattn.runtime.cache.TieredKVCache` whose ``attend`` calls are
        measured
            (for a patched HF model: ``TieredCache.runtime``).
        step: ``step(i)`` runs decode step ``i`` (every layer's ``update`` + ``attend`` with one
            query token, e.g. a model forward of one token); its return value is ignored.
        steps: measured steps, after ``warmup`` unmeasured ones.
        sync: see :class:`KernelTimer`.

    Returns:
        :meth:`KernelTimer.summary` of the decode ``attend``/``update`` calls plus ``steps``,
        ``layers_per_step`` and ``step_wall_us_median`` (the whole step, model included).
    """
    for i in range(warmup):
        step(i)
    walls = []
    with KernelTimer(cache, sync=sync) as kt:
        for i in range(warmup, warmup + steps):
            t0 = time.perf_counter()
            step(i)
            walls.append(time.perf_counter() - t0)
    out = kt.summary()
    out["steps"] = steps
    out["layers_per_step"] = out["attend_calls"] / max(1, steps)
    out["step_wall_us_median"] = statistics.median(walls) * 1e6 if walls else float("nan")
    return out


# --- the tiny reasoner -------------------------------------------------------------------------

VARIANTS = ("sdpa", "tiered_hot100", "tiered_hot50")


def _quantiles(xs: list[float]) -> dict:
    s = sorted(xs)

    def q(f: float) -> float:  # linear interpolation between closest ranks
        pos = f * (len(s) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"median_ms": q(0.5) * 1e3, "p10_ms": q(0.1) * 1e3, "p90_ms": q(0.9) * 1e3,
            "n": len(s)}


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@torch.no_grad()
def reasoner_step_times(*, prompt_tokens: int = 256, steps: int = 32, repeats: int = 5,
                        batch: int = 1, threads: int | None = 1, host_breakdown: bool = True,
                        model=None, progress: bool = True, seed: int = 0,
                        device: str | torch.device | None = None,
                        graphs: bool = False) -> dict:
    """Median wall time of one greedy decode step of the tiny reasoner, per variant.

    Each repeat prefills the same ``[batch, prompt_tokens]`` prompt (random token ids, seeded;
    prefill not timed) and then times ``steps`` decode steps -- ``model(input_ids=[B, 1],
    attention_mask, position_ids, cache)`` and ``argmax`` of the last logits -- for each variant
    in :data:`VARIANTS`, in an order rotated per repeat: ``sdpa`` (transformers' SDPA and its
    default ``DynamicCache``), ``tiered_hot100`` (``tierattn.patch`` with
    ``TierConfig.preset("offload", hot_budget=1.0)``) and ``tiered_hot50`` (``hot_budget=0.5``:
    half of every layer's pages live in DDR and are fetched back every step). One unrecorded
    warm-up repeat runs first. With ``host_breakdown``, one more decode per tiered variant runs
    under :class:`KernelTimer` (after the timing, whose numbers it does not touch) and reports
    the attend host time per layer per step. With ``graphs`` (CUDA only) the two tiered
    variants also run with ``cuda_graphs=True`` (``*_graphs``), and the greedy tokens of every
    tiered variant are compared with sdpa's (``tokens_identical``).

    Returns:
        ``{"variants": {name: {median_ms, p10_ms, p90_ms, n, ratio_to_sdpa, ...}},
        "ratios": {name: median / sdpa median}, "config": {...}, "host_breakdown": {...}}``.
    """
    from tierattn.config import TierConfig
    from tierattn.eval.training.reasoner import load_reasoner
    from tierattn.models.hf.cache import TieredCache
    from tierattn.models.hf.patch import patch

    dev = torch.device(device or "cpu")
    if model is None:
        model, _ = load_reasoner()
    model.eval().to(dev)
    cuda = dev.type == "cuda"
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, prompt_tokens), generator=gen).to(dev)
    total = prompt_tokens + steps
    max_context = -(-total // 16) * 16
    # on a CPU the kernels' torch references run, also when TRITON_INTERPRET=1 is set (CI):
    # the interpreter's cost is not the runtime's
    common = dict(max_context=max_context, prefill_chunk_size=max_context,
                  backend="auto" if cuda else "torch")
    configs = {
        "sdpa": None,
        "tiered_hot100": TierConfig.preset("offload", hot_budget=1.0, **common),
        "tiered_hot50": TierConfig.preset("offload", hot_budget=0.5, **common),
    }
    if graphs and cuda:
        configs["tiered_hot100_graphs"] = configs["tiered_hot100"].replace(cuda_graphs=True)
        configs["tiered_hot50_graphs"] = configs["tiered_hot50"].replace(cuda_graphs=True)
    variants = tuple(configs)
    tokens: dict[str, list] = {}
    arg = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters \
        else "past_key_values"
    full_mask = torch.ones(batch, total, dtype=torch.long, device=dev)
    orig_attn = model.config._attn_implementation

    def run(name: str, timer: bool = False) -> tuple[list[float], dict, dict | None]:
        cfg = configs[name]
        handle = None
        if cfg is None:
            model.set_attn_implementation("sdpa")
            cache = None
        else:
            handle = patch(model, cfg)
            cache = TieredCache(model.config, cfg)
        try:
            pos = torch.arange(prompt_tokens, device=dev).expand(batch, -1)
            out = model(input_ids=ids, attention_mask=full_mask[:, :prompt_tokens],
                        position_ids=pos, use_cache=True, **{arg: cache})
            cache = getattr(out, arg)
            nxt = out.logits[:, -1].argmax(-1)
            times = []
            kt = KernelTimer(cache.runtime) if timer else contextlib.nullcontext()
            with kt:
                for s in range(steps):
                    n = prompt_tokens + s
                    mask = full_mask[:, :n + 1]
                    p = torch.full((batch, 1), n, dtype=torch.long, device=dev)
                    if cuda:
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=p,
                                use_cache=True, **{arg: cache})
                    nxt = out.logits[:, -1].argmax(-1)
                    if cuda:  # the step ends when the GPU is done with it
                        torch.cuda.synchronize(dev)
                    times.append(time.perf_counter() - t0)
                    tokens.setdefault(name, []).append(nxt)
            stats = cache.stats()["total"] if cfg is not None else {}
            return times, stats, (kt.summary() if timer else None)
        finally:
            if handle is not None:
                handle.undo()
            model.set_attn_implementation(orig_attn)

    times: dict[str, list[float]] = {v: [] for v in variants}
    stats: dict[str, dict] = {}
    with _threads(threads):
        for r in range(repeats + 1):
            n = len(variants)
            order = variants[r % n:] + variants[:r % n]
            for name in order:
                t, st, _ = run(name)
                if r:  # repeat 0 warms up every path
                    times[name] += t
                    stats[name] = st
            if progress:
                msg = "warm-up" if r == 0 else f"repeat {r}/{repeats}"
                print(f"[hostcost] {msg}: " + ", ".join(
                    f"{v} {statistics.median(times[v]) * 1e3:.2f} ms" for v in variants
                    if times[v]), file=sys.stderr, flush=True)
        breakdown = {name: run(name, timer=True)[2] for name in VARIANTS[1:]} \
            if host_breakdown else {}
    res = {v: _quantiles(times[v]) for v in variants}
    base = res["sdpa"]["median_ms"]
    ratios = {v: res[v]["median_ms"] / base for v in variants}
    same = {v: all(torch.equal(a, b) for a, b in zip(tokens[v], tokens["sdpa"]))
            for v in variants[1:]}
    for v in variants:
        res[v]["ratio_to_sdpa"] = ratios[v]
        st = stats.get(v) or {}
        if st:
            res[v]["resident_fraction"] = st.get("resident_fraction")
            res[v]["h2d_bytes_per_decode_step"] = st.get("h2d_bytes_per_decode_step")
            res[v]["copy_launches_per_layer_per_step"] = st.get(
                "copy_launches_per_layer_per_step")
    # the step without the time inside kernel/copy calls (measured in the breakdown run): what
    # the host costs, model included, when kernels are free (the CPU torch references are not)
    for v, b in breakdown.items():
        if b and b.get("attend_calls"):
            per_step = (b["attend_kernel_us_mean"] + b.get("update_kernel_us_mean", 0.0)) * \
                b["attend_calls"] / steps / 1e3
            res[v]["kernel_ms_per_step"] = per_step
            res[v]["step_minus_kernels_ms"] = res[v]["median_ms"] - per_step
            res[v]["step_minus_kernels_ratio_to_sdpa"] = res[v]["step_minus_kernels_ms"] / base
    best = min(ratios[v] for v in ("tiered_hot100", "tiered_hot100_graphs") if v in ratios)
    return {
        "variants": res, "ratios": ratios, "tokens_identical": same,
        "target": {"tiered_hot100_ratio_max": 1.3, "best_ratio": best, "met": best <= 1.3},
        "host_breakdown": breakdown,
        "config": {"model": "tiny-reasoner", "layers": model.config.num_hidden_layers,
                   "q_heads": model.config.num_attention_heads,
                   "kv_heads": model.config.num_key_value_heads,
                   "head_dim": getattr(model.config, "head_dim", None),
                   "prompt_tokens": prompt_tokens, "steps": steps, "repeats": repeats,
                   "batch": batch, "threads": torch.get_num_threads() if threads is None
                   else threads, "max_context": max_context, "page_size": 16,
                   "device": str(dev), "dtype": str(next(model.parameters()).dtype),
                   "torch": torch.__version__,
                   "transformers": __import__("transformers").__version__},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    out = reasoner_step_times(prompt_tokens=args.prompt_tokens, steps=args.steps,
                              repeats=args.repeats, batch=args.batch, threads=args.threads)
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
