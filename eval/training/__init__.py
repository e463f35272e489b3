"""Training the tiny reasoners the evals ship (``tierattn train``): :mod:`.reasoner`."""
