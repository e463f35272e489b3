"""The accuracy evals (``tierattn eval SUBCOMMAND``): eviction against offload at equal HBM.

* :mod:`.tasks` and :mod:`.runner` -- the pointer-chasing task and one decoding loop for all;
* :mod:`.methods` and :mod:`.metrics` -- the compared methods and their metrics;
* :mod:`.reasoning` -- ``eval reasoning``: the tiny reasoner (short and long task);
* :mod:`.qa` -- ``eval qa``: any local checkpoint on a JSONL of questions;
* :mod:`.fidelity` -- ``eval fidelity``: SmolLM2-135M's KL, top-1, perplexity and passkeys;
* :mod:`.keytier` -- ``eval keytier``: the attention each recall selector misses;
* :mod:`.anymodel` -- ``tierattn models``: every causal-LM type of transformers, patched.
"""
