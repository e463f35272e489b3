"""Decode steps captured in CUDA graphs and replayed.

Between structural edits a layer's decode step is the same sequence of launches on buffers at
fixed addresses: the token's K/V write at the device-side write position, attention over the
fixed-capacity hot table, the cold pages' copy and attention, the merge and page mass. So it is
captured once per layer into a CUDA graph (:class:`DecodeGraphs`) and replayed with one launch;
the new token's ``k``, ``v`` and ``q`` are copied into the graph's static inputs first. What a
replay cannot see is kept out of the graph or in its key:

* structural work (a new page, a demotion, a table rebuild) runs on the host between replays,
  editing the device tables in place, so the graph stays valid;
* host values the launches bake in -- the table storage, the number of cold batches, the recall
  budget ``k``, softcap, scale, padding -- form the graph's key; a new key captures again;
* the runtime's host counters are advanced by what the captured step counted, per replay.

The first decode step of a layer runs eagerly (it compiles the kernels), the second captures and
replays. ``backend="eager"`` re-runs the captured function instead of a graph: the same static
buffers, keys and counters on a CPU, for tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierattn.telemetry import Telemetry

__all__ = ["DecodeGraphs"]

#: counters of a layer that a decode step advances (added per replay)
_COUNTED = ("copy_launches", "copy_launches_decode", "d2h_launches_decode", "kernel_launches",
            "h2d_decode_bytes", "prefetch_hits", "late_misses", "wasted_prefetches")


@dataclass
class _Captured:
    key: tuple
    graph: object  # torch.cuda.CUDAGraph, or the function itself (backend "eager")
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # static k, v, q
    out: torch.Tensor
    counts: dict  # counter deltas of one step
    h2d: dict  # h2d_bytes deltas by tier


class DecodeGraphs:
    """Per layer, the decode step captured once per key and replayed.

    Args:
        telemetry: the runtime's counters (advanced per replay by the captured step's deltas).
        backend: ``"cuda"`` (``torch.cuda.CUDAGraph``) or ``"eager"`` (re-run the function).
    """

    def __init__(self, telemetry: Telemetry, backend: str = "cuda") -> None:
        if backend not in ("cuda", "eager"):
            raise ValueError(f"backend must be 'cuda' or 'eager', got {backend!r}.")
        self.telemetry, self.backend = telemetry, backend
        self.graphs: dict[int, _Captured] = {}
        self.warm: set[int] = set()
        self.captures = 0
        self.replays = 0

    def reset(self) -> None:
        """Forget every graph (the cache's geometry or content was replaced)."""
        self.graphs.clear()
        self.warm.clear()

    def run(self, layer: int, key: tuple, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
            step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
            ) -> torch.Tensor:
        """``step(k, v, q)`` for ``layer``: eagerly the first time, then captured under ``key``
        and replayed (again captured when the key changes). Returns the step's output; with a
        graph, a buffer the next replay of this layer overwrites."""
        if layer not in self.warm:
            self.warm.add(layer)
            return step(k, v, q)
        cap = self.graphs.get(layer)
        if cap is None or cap.key != key:
            cap = self.graphs[layer] = self._capture(layer, key, k, v, q, step)
            if self.backend == "eager":  # the stand-in's recording run was the real step
                return cap.out
        for dst, src in zip(cap.inputs, (k, v, q)):
            dst.copy_(src)
        if self.backend == "cuda":
            cap.graph.replay()
        else:
            with self._muted(layer):
                cap.out.copy_(cap.graph(*cap.inputs))
        self._count(layer, cap)
        self.replays += 1
        return cap.out

    def _capture(self, layer: int, key: tuple, k: torch.Tensor, v: torch.Tensor,
                 q: torch.Tensor, step: Callable) -> _Captured:
        inputs = (k.clone(), v.clone(), q.clone())
        c = self.telemetry.layers[layer]
        before = dataclasses.replace(c, h2d_bytes=dict(c.h2d_bytes), d2h_bytes=dict(c.d2h_bytes))
        if self.backend == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step(*inputs)
        else:  # the eager stand-in records by running the step (this call's real step)
            graph, out = step, step(*inputs).clone()
        after = self.telemetry.layers[layer]
        counts = {f: getattr(after, f) - getattr(before, f) for f in _COUNTED}
        h2d = {t: n - before.h2d_bytes.get(t, 0) for t, n in after.h2d_bytes.items()}
        if self.backend == "cuda":  # the capture launched nothing: the replays count
            for f in _COUNTED:
                setattr(after, f, getattr(before, f))
            after.h2d_bytes.clear()
            after.h2d_bytes.update(before.h2d_bytes)
        self.captures += 1
        return _Captured(key, graph, inputs, out, counts, h2d)

    def _count(self, layer: int, cap: _Captured) -> None:
        c = self.telemetry.layers[layer]
        for f, n in cap.counts.items():
            setattr(c, f, getattr(c, f) + n)
        for t, n in cap.h2d.items():
            c.h2d_bytes[t] += n

    def _muted(self, layer: int):
        """Counting off while the eager stand-in re-runs the step (a replay counts instead)."""
        tel = self.telemetry
        c = tel.layers[layer]
        saved = dataclasses.replace(c, h2d_bytes=dict(c.h2d_bytes), d2h_bytes=dict(c.d2h_bytes))

        class _Restore:
            def __enter__(self):
                return None

            def __exit__(self, *exc):
                for f in _COUNTED:
                    setattr(c, f, getattr(saved, f))
                c.h2d_bytes.clear()
                c.h2d_bytes.update(saved.h2d_bytes)

        return _Restore()
