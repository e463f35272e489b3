"""Swap or recompute: the cost model, fitted from timings on this machine, never assumed.

A preempted sequence is either *swapped* -- its KV stored into a tier now and loaded back when
it resumes -- or *recomputed*: dropped, and prefilled again from its tokens when it resumes.

* **Transfers**, per tier and direction (``store``: device -> tier, ``load``: tier -> device):
  ``t = latency + bytes * seconds_per_byte``, fitted from calibration probes when the store is
  built (or read from a calibration file) and then from every real store and load.
* **Forward batches** of the engine: ``t = a + b * q + c * kv + d * w`` with ``q`` the batch's
  query tokens, ``kv`` the KV tokens its requests hold (past + new: what attention reads) and
  ``w = sum_r q_r * (past_r + (q_r + 1) / 2)`` the query-key pairs it scores. Recomputing
  ``T`` tokens in chunks of ``C`` costs their marginal share, ``b * T + c * kv(T) + d * w(T)``
  summed over the chunks: the per-batch ``a`` is paid by batches that run anyway. (Measured on
  SmolLM2-135M under transformers' continuous batching on 2 CPU cores, the ``kv`` term -- the
  engine gathers every request's KV each layer -- is most of a decode step's time.)

Each fit is least squares over recent observations, kept per group (prefill batches and decode
batches apart, so a long decode phase does not push every prefill out of the window), with
coefficients constrained to be non-negative and the size term (bytes, query tokens) always
kept, so a fit never predicts a free transfer or a free prefill. With too few distinct points
to separate the terms, the size term alone (the mean rate) is used. :class:`Stopwatch` times
work without waiting on the device.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from tierattn.errors import TierConfigError

__all__ = ["CALIBRATION_FORMAT", "AttendCosts", "CostModel", "LinearFit", "Stopwatch",
           "attention_work", "prefill_work"]

#: ``format`` field of a calibration file (:meth:`CostModel.save`)
CALIBRATION_FORMAT = "tierattn-swap-calibration"
DIRECTIONS = ("store", "load")


def attention_work(query: int, past: int) -> float:
    """Query-key pairs a causal prefill of ``query`` tokens after ``past`` cached ones scores."""
    return query * (past + (query + 1) / 2)


def prefill_work(tokens: int, chunk: int | None = None) -> tuple[float, float, float]:
    """``(query tokens, KV tokens held, query-key pairs)`` of prefilling ``tokens`` tokens from
    nothing in chunks of ``chunk`` (None: one chunk), summed over the chunks."""
    chunk = max(1, chunk or tokens or 1)
    q = kv = w = 0.0
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        q, kv, w = q + n, kv + start + n, w + attention_work(n, start)
    return q, kv, w


class LinearFit:
    """``y ~ x . coef`` by least squares over the last ``window`` observations, with
    ``coef >= 0`` and feature ``keep`` always in the model (its coefficient > 0 when the data
    allow). ``prior`` answers until the first observation arrives."""

    def __init__(self, names: tuple[str, ...], *, keep: int, window: int = 64,
                 prior: Sequence[float] | None = None) -> None:
        self.names, self.keep, self.window = names, keep, window
        #: the last ``window`` observations of each group
        self.groups: dict[str, deque[tuple[tuple[float, ...], float]]] = {}
        self.prior = tuple(prior) if prior is not None else None
        self._coef: tuple[float, ...] | None = None

    def add(self, x: Sequence[float], y: float, group: str = "") -> None:
        if len(x) != len(self.names):
            raise ValueError(f"LinearFit.add: {len(x)} features, expected {self.names}.")
        if y >= 0 and all(v >= 0 for v in x) and x[self.keep] > 0:
            rows = self.groups.setdefault(group, deque(maxlen=self.window))
            rows.append((tuple(float(v) for v in x), float(y)))
            self._coef = None

    def clear(self) -> None:
        self.groups.clear()
        self._coef = None

    @property
    def rows(self) -> list[tuple[tuple[float, ...], float]]:
        return [r for rows in self.groups.values() for r in rows]

    @property
    def count(self) -> int:
        return sum(len(rows) for rows in self.groups.values())

    def coef(self) -> tuple[float, ...] | None:
        """The fitted coefficients (None: nothing observed and no prior)."""
        if not self.count:
            return self.prior
        if self._coef is None:
            self._coef = self._solve()
        return self._coef

    def _solve(self) -> tuple[float, ...]:
        rows = self.rows
        x = np.array([r[0] for r in rows], dtype=np.float64)
        y = np.array([r[1] for r in rows], dtype=np.float64)
        k = x.shape[1]
        # the mean rate of the kept feature: what is left when the terms cannot be separated
        best = np.zeros(k)
        best[self.keep] = y.sum() / x[:, self.keep].sum()
        best_err = float(((x @ best - y) ** 2).sum())
        others = [i for i in range(k) if i != self.keep]
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        for n in range(1, len(others) + 1):
            for extra in itertools.combinations(others, n):
                cols = sorted((self.keep, *extra))
                xs = x[:, cols] / scale[cols]
                if np.linalg.matrix_rank(xs) < len(cols):
                    continue
                sol, *_ = np.linalg.lstsq(xs, y, rcond=None)
                sol = sol / scale[cols]
                if (sol < 0).any():
                    continue
                full = np.zeros(k)
                full[cols] = sol
                err = float(((x @ full - y) ** 2).sum())
                if err < best_err * (1 - 1e-9):
                    best, best_err = full, err
        return tuple(float(v) for v in best)

    def predict(self, x: Sequence[float]) -> float | None:
        c = self.coef()
        return None if c is None else float(sum(a * b for a, b in zip(c, x)))


class CostModel:
    """Predicted seconds of a swap (store + load) and of a recompute, from measured fits.

    Args:
        kinds: the tiers' kinds (``ddr``, ``cxl``, ``disk``), each with a store and a load fit.
        window: observations each fit keeps.
    """

    def __init__(self, kinds: Sequence[str], *, window: int = 64) -> None:
        self.kinds = tuple(kinds)
        self.links = {(kind, d): LinearFit(("latency_s", "seconds_per_byte"), keep=1,
                                           window=window)
                      for kind in self.kinds for d in DIRECTIONS}
        self.prefill = LinearFit(("batch_s", "seconds_per_token", "seconds_per_kv_token",
                                  "seconds_per_pair"), keep=1, window=window)
        self.calibrated_from: str | None = None

    # --- observations -----------------------------------------------------------------------

    def observe_transfer(self, kind: str, direction: str, nbytes: int, seconds: float) -> None:
        self.links[(kind, direction)].add((1.0, float(nbytes)), seconds)

    def observe_batch(self, tokens: int, kv: int, pairs: float, seconds: float, *,
                      decode: bool = False) -> None:
        """One forward batch: ``tokens`` query tokens, ``kv`` KV tokens held by its requests,
        ``pairs`` query-key pairs; ``decode``: one token per request (kept apart)."""
        self.prefill.add((1.0, float(tokens), float(kv), float(pairs)), seconds,
                         "decode" if decode else "prefill")

    # --- predictions ------------------------------------------------------------------------

    def transfer_s(self, kind: str, direction: str, nbytes: int) -> float | None:
        return self.links[(kind, direction)].predict((1.0, float(nbytes)))

    def swap_s(self, placement: Sequence[tuple[str, int]]) -> float | None:
        """Store plus load of ``placement`` (``(kind, bytes)`` per tier used); None when a
        tier has no measurement yet."""
        total = 0.0
        for kind, nbytes in placement:
            for d in DIRECTIONS:
                t = self.transfer_s(kind, d, nbytes)
                if t is None:
                    return None
                total += t
        return total

    def recompute_s(self, tokens: int, chunk: int | None = None) -> float | None:
        """Prefill time of ``tokens`` tokens from scratch in chunks of ``chunk`` (None before
        any batch was timed)."""
        c = self.prefill.coef()
        if c is None:
            return None
        q, kv, w = prefill_work(tokens, chunk)
        return c[1] * q + c[2] * kv + c[3] * w

    def batch_s(self) -> float:
        """The fitted time every forward batch pays whatever it holds (0 before any)."""
        c = self.prefill.coef()
        return 0.0 if c is None else c[0]

    def marginal_s(self, query: int, past: int) -> float:
        """The part of a batch's time one request's ``query`` tokens after ``past`` cost (0
        before any batch was timed)."""
        c = self.prefill.coef()
        if c is None:
            return 0.0
        return c[1] * query + c[2] * (past + query) + c[3] * attention_work(query, past)

    # --- persistence ------------------------------------------------------------------------

    def as_dict(self) -> dict:
        links: dict = {}
        for (kind, d), fit in self.links.items():
            c = fit.coef()
            links.setdefault(kind, {})[d] = None if c is None else {
                "latency_s": c[0], "seconds_per_byte": c[1],
                "bandwidth_Bps": 1 / c[1] if c[1] > 0 else None, "observations": fit.count}
        c = self.prefill.coef()
        prefill = None if c is None else {
            **dict(zip(self.prefill.names, c)),
            "tokens_per_s_at_1k": 1000 / max(1e-12, self.recompute_s(1000)),
            "observations": self.prefill.count}
        return {"format": CALIBRATION_FORMAT, "version": 1, "links": links, "prefill": prefill,
                "calibrated_from": self.calibrated_from}

    def save(self, path: str | Path) -> None:
        """Write the fitted transfer costs as a calibration file (:meth:`load` reads it)."""
        Path(path).write_text(json.dumps(self.as_dict(), indent=2) + "\n")

    def load(self, path: str | Path) -> None:
        """Take the transfer costs of a calibration file as the fits' priors (measurements of
        this run replace them as they come); a kind the file lacks keeps no prior. (Prefill
        costs belong to a model, not a machine: they are always measured.)"""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise TierConfigError(
                f"calibration={str(path)!r}: cannot read it as JSON ({e}); give a file written "
                "by CostModel.save or `tierattn bench --serving`, or None to measure at "
                "start.") from e
        self.apply(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """A cost model predicting what ``data`` (:meth:`as_dict`) describes, prefill included."""
        model = cls(list(data.get("links", {})))
        model.apply(data, source="as_dict", prefill=True)
        return model

    def apply(self, data: dict, *, source: str, prefill: bool = False) -> None:
        """Take the costs of ``data`` (:meth:`as_dict`'s shape) as priors."""
        if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT or \
                not isinstance(data.get("links"), dict):
            raise TierConfigError(f"calibration={source!r} is not a {CALIBRATION_FORMAT} file "
                                  "(written by CostModel.save or `tierattn bench --serving`).")
        if prefill and data.get("prefill"):
            self.prefill.prior = tuple(float(data["prefill"][n]) for n in self.prefill.names)
        for kind in self.kinds:
            for d in DIRECTIONS:
                entry = (data["links"].get(kind) or {}).get(d)
                if entry is None:
                    continue
                try:
                    prior = (float(entry["latency_s"]), float(entry["seconds_per_byte"]))
                except (KeyError, TypeError, ValueError) as e:
                    raise TierConfigError(f"calibration={source!r}: {kind} {d} lacks numeric "
                                          "latency_s and seconds_per_byte.") from e
                if min(prior) < 0 or prior[1] == 0:
                    raise TierConfigError(f"calibration={source!r}: {kind} {d} has a negative "
                                          "or zero cost.")
                self.links[(kind, d)].prior = prior
        self.calibrated_from = source


class AttendCosts:
    """What attending a layer's cold pages costs each way (``attend="auto"``): recalling them
    over the link (``t = latency + bytes / link bandwidth``) or attending them on the host
    (``t = latency + bytes / host-attention rate``, plus the query and the partial state on the
    link). Priors from the given rates; with ``refit`` the host term is refitted from every
    split step's measured time (host work, timed without a device read).

    Args:
        link_bps: bytes per second between a lower tier and the device.
        host_bps: KV bytes per second the host attends.
        link_latency_s, host_latency_s: the fixed cost of a recall and of a host round trip.
        refit: follow the measured host times (False: the rates describe another machine,
            a modeled one, and are kept).
    """

    def __init__(self, link_bps: float, host_bps: float, *, link_latency_s: float = 10e-6,
                 host_latency_s: float = 30e-6, refit: bool = True) -> None:
        self.link_bps, self.host_bps, self.refit = float(link_bps), float(host_bps), refit
        self.link_latency_s = link_latency_s
        self.host = LinearFit(("call", "bytes"), keep=1, window=256,
                              prior=(host_latency_s, 1.0 / self.host_bps))

    def recall_s(self, nbytes: int) -> float:
        """Bringing ``nbytes`` of cold pages to the device."""
        return self.link_latency_s + nbytes / self.link_bps

    def split_s(self, nbytes: int, link_bytes: int) -> float:
        """Attending ``nbytes`` of cold pages on the host, ``link_bytes`` of query and partial
        state crossing the link."""
        return self.host.predict((1.0, nbytes)) + self.recall_s(link_bytes)

    def observe_host(self, nbytes: int, seconds: float) -> None:
        if self.refit:
            self.host.add((1.0, nbytes), seconds)

    def as_dict(self) -> dict:
        coef = self.host.coef()
        return {"link_bandwidth_Bps": self.link_bps, "link_latency_s": self.link_latency_s,
                "host_bandwidth_prior_Bps": self.host_bps,
                "host_bandwidth_fit_Bps": 1.0 / coef[1] if coef and coef[1] > 0 else None,
                "host_latency_fit_s": coef[0] if coef else None,
                "host_observations": self.host.count}


class Stopwatch:
    """Times work without making the host wait for the device: ``perf_counter`` around
    synchronous (CPU) work; on CUDA, events recorded on a stream and read once they completed
    (:meth:`poll`), so a timed copy or forward never adds a sync."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[object, object, Callable[[float], None]]] = []

    def start(self, stream=None) -> object:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def stop(self, start: object, done: Callable[[float], None], stream=None) -> None:
        """Call ``done(seconds)`` with the time since ``start``: now on the CPU, when the
        device reached this point on CUDA (checked by :meth:`poll`)."""
        if not self.cuda:
            done(time.perf_counter() - start)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._pending.append((start, end, done))
        self.poll()

    def poll(self, *, wait: bool = False) -> None:
        """Report the timings whose end the device has reached (all of them with ``wait``)."""
        still = []
        for start, end, done in self._pending:
            if wait or end.query():
                end.synchronize()
                done(start.elapsed_time(end) / 1e3)
            else:
                still.append((start, end, done))
        self._pending = still
