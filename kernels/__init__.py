"""tierattn.kernels: Triton kernels for paged KV attention, with plain-torch references."""
