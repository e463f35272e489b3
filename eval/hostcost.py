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

    python -m tierattn.eval.hostcost --steps 32 --repeats 5
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

__all__ = ["KERNEL_NAMES", "KernelTimer", "attend_host_overhead", "reasoner_step_times"]

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
        cache: the :class:`~tierattn.cache.TieredKVCache` whose calls are split into kernel and
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


def attend_host_overhead(cache, step: Callable[[int], object], steps: int, *,
                         warmup: int = 1, sync: bool | None = None) -> dict:
    """Host orchestration of ``cache`` per layer per decode step.

    Args:
        cache: the :class:`~tierattn.cache.TieredKVCache` whose ``attend`` calls are measured
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
                        device: str | torch.device | None = None) -> dict:
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
    the attend host time per layer per step.

    Returns:
        ``{"variants": {name: {median_ms, p10_ms, p90_ms, n, ratio_to_sdpa, ...}},
        "ratios": {name: median / sdpa median}, "config": {...}, "host_breakdown": {...}}``.
    """
    from tierattn.config import TierConfig
    from tierattn.eval.train_reasoner import load_reasoner
    from tierattn.models.cache import TieredCache
    from tierattn.models.patch import patch

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
            stats = cache.stats()["total"] if cfg is not None else {}
            return times, stats, (kt.summary() if timer else None)
        finally:
            if handle is not None:
                handle.unpatch()
            model.set_attn_implementation(orig_attn)

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    stats: dict[str, dict] = {}
    with _threads(threads):
        for r in range(repeats + 1):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
            for name in order:
                t, st, _ = run(name)
                if r:  # repeat 0 warms up every path
                    times[name] += t
                    stats[name] = st
            if progress:
                msg = "warm-up" if r == 0 else f"repeat {r}/{repeats}"
                print(f"[hostcost] {msg}: " + ", ".join(
                    f"{v} {statistics.median(times[v]) * 1e3:.2f} ms" for v in VARIANTS
                    if times[v]), file=sys.stderr, flush=True)
        breakdown = {name: run(name, timer=True)[2] for name in VARIANTS[1:]} \
            if host_breakdown else {}
    res = {v: _quantiles(times[v]) for v in VARIANTS}
    base = res["sdpa"]["median_ms"]
    ratios = {v: res[v]["median_ms"] / base for v in VARIANTS}
    for v in VARIANTS:
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
    return {
        "variants": res, "ratios": ratios,
        "target": {"tiered_hot100_ratio_max": 1.3,
                   "met": ratios["tiered_hot100"] <= 1.3},
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
