"""tierattn in Hugging Face transformers, one file per role.

* :mod:`.support` -- which models the tiered cache serves, decided from their structure;
* :mod:`.cache` -- :class:`TieredCache`, a transformers ``Cache`` over the tiered runtime;
* :mod:`.patch` -- ``tierattn.patch``: the registered attention function and its handle;
* :mod:`.continuous` -- ``tierattn.swap``: continuous batching's preempted requests in the tiers.
"""
