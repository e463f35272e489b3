"""The tiered runtime behind :class:`~tierattn.runtime.cache.TieredKVCache`: one decode step's
parts, in the order a layer meets them.

* :mod:`.validate` -- argument checks shared by the public calls (before anything is mutated);
* :mod:`.importance` -- page scores (kernel scores, sketches) that rank pages for the hot set;
* :mod:`.policy` -- which pages stay hot, which are demoted and recalled (the presets' rules);
* :mod:`.planner` -- what a step must move, priced by the cost model;
* :mod:`.prefetch` -- recalls issued a layer ahead, waited on by events;
* :mod:`.hostattn` -- split attention: cold pages attended where they live;
* :mod:`.attention` -- one layer's attention over the hot set (and the cold part), merged;
* :mod:`.graphs` -- CUDA-graph capture of the decode step;
* :mod:`.snapshot` -- save and restore a cache;
* :mod:`.cache` -- :class:`TieredKVCache`, the facade that owns them all.
"""
