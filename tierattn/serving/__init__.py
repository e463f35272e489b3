"""Serving many sequences: preempted requests kept in the tiers instead of recomputed.

* :mod:`.costmodel` -- the measured cost model: a swap-in against a recompute, per request;
* :mod:`.swaptiers` -- the tiers' slots for whole swapped blocks;
* :mod:`.swapcore` -- the one swap core the engine adapters (transformers' continuous
  batching, vLLM) share: reserve, copy out, copy back, release.
"""
