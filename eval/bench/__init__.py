"""The benchmarks (``tierattn bench SUBCOMMAND``): each measures side by side in one run.

* :mod:`.kv` -- ``bench kv``: data moved per generated token against whole-layer offload;
* :mod:`.hostcost` -- the Python cost of the tiered path per layer and step (part of ``kv``);
* :mod:`.host` -- ``bench host``: split attention's host kernel against a plain read;
* :mod:`.disk` -- ``bench disk``: the disk tier against the disk's raw bandwidth;
* :mod:`.serving` -- ``bench serving``: continuous batching, recompute against swap;
* :mod:`.vllm` and :mod:`.vllm_hotset` -- ``bench vllm`` and ``bench vllm-hotset``;
* :mod:`.gpu` -- ``bench gpu``: the prepared check of every GPU figure;
* :mod:`.loop` -- ``tierattn loop``: a decode loop over random KV.
"""
