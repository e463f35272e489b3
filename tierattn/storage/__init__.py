"""Where KV pages live and how they move, below the runtime and the serving core.

* :mod:`.pagemap` -- the page table: which tier and slot hold each page;
* :mod:`.tiers` -- the tiers (device, DDR/CXL host memory, disk) and their slots;
* :mod:`.segment` -- the disk tier's segment files and their I/O pool;
* :mod:`.kvfile` -- the on-disk page format with per-page checksums;
* :mod:`.transfer` -- transfer engines (CPU copies, CUDA streams and events);
* :mod:`.mover` -- batched page moves between tiers, rolled back on failure;
* :mod:`.staging` -- pinned staging buffers between the disk and the device.
"""
