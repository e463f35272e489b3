"""``tierattn bench --disk``: the disk tier against the disk it sits on, measured in one run.

For pages of Llama-8B's KV geometry (16 tokens x 8 KV heads x head dim 128, K and V, bf16:
64 KiB), at each page count:

* **raw**: the physical limit of the folder -- one plain file of the same bytes written with
  large sequential writes (then ``fsync``) and read back cold (its pages dropped from the page
  cache first), the way ``dd`` measures a disk;
* **tier write**: :class:`~tierattn.storage.tiers.DiskTier` storing the pages in batches of
  ``batch`` pages (a spill: what a demotion hands it), timed without ``fsync`` (the spill
  path: a tier is a cache of the process) and with one ``fsync`` at the end (the bytes on the
  device: the figure comparable with raw);
* **tier read**: the pages read back cold in batches, each page's checksum verified;
* **mixed**: spill and recall interleaved (a batch written to fresh slots, then a batch of
  random held pages read), cold;
* **CPU time per page**: the process's CPU time (every thread) over the pages moved.

Then **through the runtime**: a 32-layer cache at 32K context (batch 1, 10% hot, a small DDR
tier, the rest on disk) is filled -- the spills -- and decodes a few tokens with exact
attention, every cold page read back each step through the disk stage (read a layer ahead on
the I/O pool); its telemetry gives the pages staged ahead and read synchronously.

Rates here are this machine's, and the page cache sits between the tier and the device: the
cold reads drop it first (``posix_fadvise``), the fsynced writes wait for the device. Results
go to ``disk.json`` / ``disk.csv`` / ``disk.png`` in a new results folder.
"""

from __future__ import annotations

import os
import platform
import random
import resource
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from tierattn.eval.report import (format_table, new_results_dir, save_json, target_lines,
                                  write_csv)
from tierattn.storage.segment import DIGEST
from tierattn.storage.tiers import DiskTier

__all__ = ["DiskBenchSpec", "disk_summary", "run_disk_bench"]

#: one page of Llama-8B's KV: K and V x 16 tokens x 8 KV heads x 128, bf16 (64 KiB)
PAGE_SHAPE = (2, 16, 8, 128)
PAGE_BYTES = 2 * 16 * 8 * 128 * 2
RAW_CHUNK = 8 << 20  # bytes per call of the raw sequential baseline (dd-like)


@dataclass(frozen=True)
class DiskBenchSpec:
    """What ``tierattn bench --disk`` measures."""

    pages: tuple[int, ...] = (1024, 4096, 16384, 65536)
    batch: int = 128  # pages per tier call (a 2K-token prefill chunk's pages of one layer)
    io_threads: int = 4
    runtime_context: int = 32768  # tokens of the runtime row (0: skip it)
    runtime_layers: int = 32
    runtime_steps: int = 2
    reps: int = 3  # raw/tier runs per phase and page count, alternating (medians reported)
    seed: int = 0

    @classmethod
    def smoke(cls) -> DiskBenchSpec:
        return cls(pages=(256, 1024), runtime_context=2048, runtime_layers=4, runtime_steps=2,
                   reps=1)


def _drop(fd: int) -> None:
    """The file's pages out of the page cache (they are clean: written and fsynced)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class _Timer:
    """Wall time and this process's CPU time (every thread), split into user time (the code's
    own work: Python, checksums) and system time (the kernel's: syscalls, page-cache copies,
    the block layer -- which a plain ``write`` pays as well)."""

    def __init__(self) -> None:
        self.wall, self.user, self.sys = time.perf_counter(), *_cpu()

    def stop(self) -> tuple[float, float, float]:
        user, sys_ = _cpu()
        return time.perf_counter() - self.wall, user - self.user, sys_ - self.sys


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _cpu_fields(prefix: str, user: float, sys_: float, pages: float) -> dict:
    return {f"{prefix}_user_us_per_page": 1e6 * user / pages,
            f"{prefix}_sys_us_per_page": 1e6 * sys_ / pages,
            f"{prefix}_cpu_us_per_page": 1e6 * (user + sys_) / pages}


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


class _Raw:
    """The baseline: one plain file of the same bytes, written in large sequential chunks
    (then fsynced) and read back the same way -- how ``dd`` measures a folder."""

    def __init__(self, folder: Path, nbytes: int) -> None:
        self.path, self.nbytes = folder / "raw.bin", nbytes
        self.buf = memoryview(os.urandom(RAW_CHUNK))
        self.into = memoryview(bytearray(RAW_CHUNK))
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

    def write(self) -> dict:
        os.ftruncate(self.fd, 0)  # a fresh file each time, as the tier gets a fresh segment
        t, done = _Timer(), 0
        while done < self.nbytes:
            done += os.pwrite(self.fd, self.buf[:min(RAW_CHUNK, self.nbytes - done)], done)
        wall, user, sys_ = t.stop()
        os.fsync(self.fd)
        return {"raw_write_Bps": self.nbytes / wall, "raw_write_sync_Bps": self.nbytes /
                t.stop()[0]} | _cpu_fields("raw_write", user, sys_, self.nbytes / PAGE_BYTES)

    def read(self) -> dict:
        t, got = _Timer(), 0
        while got < self.nbytes:
            n = os.preadv(self.fd, [self.into[:min(RAW_CHUNK, self.nbytes - got)]], got)
            if n <= 0:
                break
            got += n
        wall, user, sys_ = t.stop()
        return {"raw_read_Bps": self.nbytes / wall} | _cpu_fields("raw_read", user, sys_,
                                                                   self.nbytes / PAGE_BYTES)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink()


class _TierRun:
    """The same bytes through a :class:`DiskTier` (capacity ``2n``: the mixed pattern spills
    into the second half), ``batch`` pages per call."""

    def __init__(self, folder: Path, n: int, spec: DiskBenchSpec, gen: torch.Generator) -> None:
        self.folder, self.n, self.spec, self.b = folder, n, spec, spec.batch
        # one batch of source pages reused (the data's content does not change the I/O)
        self.data = torch.randn(self.b, *PAGE_SHAPE, generator=gen).to(torch.bfloat16)
        self.out = torch.empty(self.b, *PAGE_SHAPE, dtype=torch.bfloat16)
        self.tier: DiskTier | None = None

    def _batches(self, first: int = 0):
        for s in range(0, self.n, self.b):
            k = min(self.b, self.n - s)
            yield list(range(first + s, first + s + k)), k

    def write(self) -> dict:
        if self.tier is not None:  # a fresh segment each time, as raw gets a fresh file
            self.tier.close()
        self.tier = DiskTier(1, 2 * self.n, PAGE_SHAPE, torch.bfloat16, self.folder, "bench",
                             io_threads=self.spec.io_threads)
        t = _Timer()
        for slots, k in self._batches():
            self.tier.write(0, slots, self.data[:k], slots)
        wall, user, sys_ = t.stop()
        self.tier.segment().flush()
        nbytes = self.n * PAGE_BYTES
        return {"write_Bps": nbytes / wall, "write_sync_Bps": nbytes / t.stop()[0]} | \
            _cpu_fields("write", user, sys_, self.n)

    def read(self) -> dict:
        t = _Timer()
        for slots, k in self._batches():
            self.tier.read_into(0, slots, slots, self.out, list(range(k)))
        wall, user, sys_ = t.stop()
        return {"read_Bps": self.n * PAGE_BYTES / wall} | _cpu_fields("read", user, sys_, self.n)

    def mixed(self, rng: random.Random) -> dict:
        """Spill a batch into the fresh half, recall a batch of random held pages; repeat."""
        t, moved = _Timer(), 0
        for slots, k in self._batches(first=self.n):
            self.tier.write(0, slots, self.data[:k], list(range(k)))
            pick = sorted(rng.sample(range(self.n), k))
            self.tier.read_into(0, pick, pick, self.out, list(range(k)))
            moved += 2 * k
        wall, user, sys_ = t.stop()
        self.tier.segment().forget(0, list(range(self.n, 2 * self.n)))
        return {"mixed_Bps": moved * PAGE_BYTES / wall} | _cpu_fields("mixed", user, sys_, moved)

    def drop(self) -> None:
        self.tier.segment().drop_cache()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()


def measure(folder: Path, n: int, spec: DiskBenchSpec, gen: torch.Generator) -> dict:
    """Raw and tier side by side on the same bytes, phase by phase (writes alternate, then
    cold reads alternate, each after ``sync()`` and with both files out of the page cache),
    ``spec.reps`` times; the median of each figure."""
    raw, tier = _Raw(folder, n * PAGE_BYTES), _TierRun(folder, n, spec, gen)
    rng = random.Random(spec.seed)
    try:
        writes, reads, mixed = [], [], []
        for _ in range(spec.reps):
            os.sync()
            w = raw.write()
            os.sync()
            writes.append(w | tier.write())
        for _ in range(spec.reps):
            r = {}
            for side in (raw, tier):
                _drop(raw.fd)
                tier.drop()
                os.sync()
                r |= side.read()
            reads.append(r)
        for _ in range(spec.reps):
            tier.drop()
            mixed.append(tier.mixed(rng))
    finally:
        raw.close()
        tier.close()
    return {"pages": n, "page_bytes": PAGE_BYTES, "bytes": n * PAGE_BYTES, "batch": spec.batch,
            "io_threads": spec.io_threads, "reps": spec.reps} | _median(writes) | \
        _median(reads) | _median(mixed)


def _instrument(fn, acc: dict, pages=None):
    """``fn`` timed into ``acc`` (wall, user and system seconds; pages when given)."""
    def timed(*args, **kw):
        t = _Timer()
        try:
            return fn(*args, **kw)
        finally:
            wall, user, sys_ = t.stop()
            acc["s"] += wall
            acc["user"] += user
            acc["sys"] += sys_
            if pages is not None:
                acc["pages"] += pages(*args)
    return timed


def _runtime(folder: Path, spec: DiskBenchSpec, disk: bool) -> dict:
    """Fill a ``runtime_layers``-layer cache with ``runtime_context`` tokens (10% hot; the rest
    on disk behind a 16-page DDR tier, or all in DDR for ``disk=False``) and decode
    ``runtime_steps`` tokens with exact attention."""
    from tierattn.runtime.cache import TieredKVCache
    from tierattn.config import TierConfig, TierSpec

    ctx, layers = spec.runtime_context, spec.runtime_layers
    chunk = min(4096, ctx)
    tiers = (TierSpec("hbm"), TierSpec("ddr", capacity_pages=16),
             TierSpec("disk", path=str(folder))) if disk else (TierSpec("hbm"), TierSpec("ddr"))
    cfg = TierConfig(page_size=PAGE_SHAPE[1], hot_budget=0.1, attend="all", tiers=tiers,
                     max_context=ctx + spec.runtime_steps + 16, prefill_chunk_size=chunk,
                     backend="torch", sink_pages=1, recent_pages=1)
    hkv, d = PAGE_SHAPE[2], PAGE_SHAPE[3]
    cache = TieredKVCache(cfg, num_layers=layers, num_kv_heads=hkv, head_dim=d, batch_size=1,
                          dtype=torch.bfloat16, device="cpu")
    spilled = {"s": 0.0, "user": 0.0, "sys": 0.0, "pages": 0}
    stalled = {"s": 0.0, "user": 0.0, "sys": 0.0}
    if disk:  # the spill path's own time, and the time a layer waits on disk reads
        tier = cache.tiers[2]
        tier.write = _instrument(tier.write, spilled, lambda layer, slots, *a: len(slots))
        stage = cache.prefetcher.disk
        stage._wait = _instrument(stage._wait, stalled)
    gen = torch.Generator().manual_seed(spec.seed)
    kv = torch.randn(1, hkv, chunk, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, 4 * hkv, 1, d, generator=gen).to(torch.bfloat16)
    try:
        t = _Timer()
        # the prompt in chunks, each attended by its last token only (a 32K prefill attention
        # is not what is measured; the demotions and spills are the same)
        for s in tqdm(range(0, ctx, chunk), desc=f"runtime fill ({'disk' if disk else 'ddr'})",
                      unit="chunk", leave=False):
            k = min(chunk, ctx - s)
            for layer in range(layers):
                cache.update(layer, kv[:, :, :k], kv[:, :, :k])
                cache.attend(layer, q)
        fill_s = t.stop()[0]
        before = cache.stats()["total"]
        if disk:  # (clean pages can be dropped: the steps read from the device)
            cache.tiers[2].segment().flush()
            cache.tiers[2].segment().drop_cache()
        stalled["s"] = 0.0
        t = _Timer()
        for _ in range(spec.runtime_steps):
            for layer in range(layers):
                cache.update(layer, kv[:, :, :1], kv[:, :, :1])
                cache.attend(layer, q)
        step_s = t.stop()[0] / spec.runtime_steps
        tot = cache.stats()["total"]
        out = {"fill_s": fill_s, "step_s": step_s,
               "cold_pages": sum(n for r in cache.residency() for k, n in r.items()
                                 if k != "hbm")}
        if disk:
            staged = tot["disk_staged_pages"] - before["disk_staged_pages"]
            sync = tot["disk_sync_pages"] - before["disk_sync_pages"]
            page = cache.page_bytes
            pages = sum(cache.tiers[2].num_used(layer) for layer in range(layers))
            out |= {"disk_pages": pages, "disk_bytes": pages * page,
                    "spilled_pages": spilled["pages"], "spill_s": spilled["s"],
                    "spill_Bps": spilled["pages"] * page / max(spilled["s"], 1e-9),
                    **_cpu_fields("spill", spilled["user"], spilled["sys"],
                                  max(1, spilled["pages"])),
                    "read_pages_per_step": (staged + sync) / spec.runtime_steps,
                    "stall_s_per_step": stalled["s"] / spec.runtime_steps,
                    "disk_staged_pages": staged, "disk_sync_pages": sync,
                    "files": len(list(folder.glob("*.kvseg")))}
        return out
    finally:
        cache.close()


def runtime_row(folder: Path, spec: DiskBenchSpec) -> dict:
    """The runtime with a disk tier, and the same run with every cold page in DDR (the step
    time a disk tier should not change)."""
    row = {"context": spec.runtime_context, "layers": spec.runtime_layers,
           "steps": spec.runtime_steps}
    with_disk = _runtime(folder, spec, disk=True)
    ddr = _runtime(folder, spec, disk=False)
    return row | with_disk | {"ddr_fill_s": ddr["fill_s"], "ddr_step_s": ddr["step_s"]}


TABLE = [("pages", "pages", "d"), ("GiB", "gib", ".2f"),
         ("raw w+sync MB/s", "raw_write_sync_MBps", ".0f"),
         ("tier w+sync", "write_sync_MBps", ".0f"), ("%", "write_pct", ".0f"),
         ("tier w (spill)", "write_MBps", ".0f"), ("pages/s", "write_pages_per_s", ".0f"),
         ("raw read", "raw_read_MBps", ".0f"), ("tier read", "read_MBps", ".0f"),
         ("%", "read_pct", ".0f"), ("pages/s", "read_pages_per_s", ".0f"),
         ("mixed", "mixed_MBps", ".0f")]
CPU_TABLE = [("pages", "pages", "d"),
             ("tier user w", "write_user_us_per_page", ".1f"),
             ("r", "read_user_us_per_page", ".1f"), ("mixed", "mixed_user_us_per_page", ".1f"),
             ("raw user w", "raw_write_user_us_per_page", ".1f"),
             ("r", "raw_read_user_us_per_page", ".1f"),
             ("tier sys w", "write_sys_us_per_page", ".1f"),
             ("r", "read_sys_us_per_page", ".1f"), ("mixed", "mixed_sys_us_per_page", ".1f"),
             ("raw sys w", "raw_write_sys_us_per_page", ".1f"),
             ("r", "raw_read_sys_us_per_page", ".1f")]


def _derive(row: dict) -> dict:
    mb = 1e6
    row = dict(row, gib=row["bytes"] / 2**30)
    for k in ("raw_write", "raw_write_sync", "raw_read", "write", "write_sync", "read", "mixed"):
        row[f"{k}_MBps"] = row[f"{k}_Bps"] / mb
    row["write_pct"] = 100 * row["write_sync_Bps"] / row["raw_write_sync_Bps"]
    row["read_pct"] = 100 * row["read_Bps"] / row["raw_read_Bps"]
    row["write_pages_per_s"] = row["write_Bps"] / row["page_bytes"]
    row["read_pages_per_s"] = row["read_Bps"] / row["page_bytes"]
    return row


def run_disk_bench(spec: DiskBenchSpec = DiskBenchSpec(), *, folder: str | Path | None = None,
                   out_root: str | Path | None = "results", progress: bool = True) -> dict:
    """Measure every page count (raw and tier side by side), then the runtime row; ``folder``
    is where the files go (default: a temporary folder under the system's temp dir)."""
    from tierattn.eval.report import git_state

    gen = torch.Generator().manual_seed(spec.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tierattn-disk-", dir=folder) as tmp:
        work = Path(tmp)
        measure(work, spec.batch, replace(spec, reps=1), gen)  # warm-up: first calls
        for n in tqdm(spec.pages, desc="disk rows", unit="row", disable=not progress):
            rows.append(_derive(measure(work, n, spec, gen)))
        runtime = runtime_row(work, spec) if spec.runtime_context else None
        where = os.statvfs(work)
    targets = []
    for key, name in (("write_pct", "batched write (fsynced) vs raw write+fsync"),
                      ("read_pct", "batched cold read vs raw cold read")):
        worst = min(r[key] for r in rows)
        targets.append({"target": f"{name}: >= 70%", "value": f"min {worst:.0f}% over "
                        f"{len(rows)} page counts", "met": worst >= 70})
    cpu = max(r[f"{k}_user_us_per_page"] for r in rows for k in ("write", "read", "mixed"))
    targets.append({"target": "<= 20 us of the tier's own CPU (user time) per page: write, "
                    "read, mixed", "value": f"max {cpu:.1f} us", "met": cpu <= 20})
    extra = max(r[f"{k}_sys_us_per_page"] - r[f"raw_{k}_sys_us_per_page"] for r in rows
                for k in ("write", "read"))
    targets.append({"target": "kernel (system) CPU per page no more than the raw path's "
                    "(+5 us)", "value": f"max {extra:+.1f} us over raw", "met": extra <= 5})
    if runtime:
        targets.append({"target": "a decode step with pages on disk waits on no read (runtime "
                        "row: time in the stage's waits per step)",
                        "value": f"{runtime['stall_s_per_step']:.3f} s of "
                        f"{runtime['step_s']:.2f} s", "met":
                        runtime["stall_s_per_step"] <= 0.05 * runtime["step_s"]})
        targets.append({"target": "files independent of pages (runtime row)",
                        "value": f"{runtime['files']} file for {runtime['disk_pages']} pages",
                        "met": runtime["files"] == 1})
    result = {"spec": asdict(spec), "page_shape": list(PAGE_SHAPE), "digest": DIGEST,
              "rows": rows, "runtime": runtime, "targets": targets, "commit": git_state()["commit"],
              "environment": {"torch": torch.__version__, "python": platform.python_version(),
                              "machine": platform.machine(), "cpus": os.cpu_count(),
                              "folder_fs_block": where.f_bsize}}
    if out_root:
        out = new_results_dir(out_root, "disk-" + "_".join(
            f"{n // 1024}k" if n >= 1024 else str(n) for n in spec.pages))
        result["out"] = str(out)
        save_json(result, out / "disk.json", quiet=True)
        write_csv(rows, out / "disk.csv")
        result["plot"] = _plot(rows, out / "disk.png")
    return result


def _plot(rows: list[dict], path: Path) -> str | None:
    """MB/s against pages: the tier's write/read next to the raw limits."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    x = [r["pages"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label, style in (("raw_write_sync_MBps", "raw write + fsync", "k--"),
                              ("write_sync_MBps", "tier write + fsync", "C0-o"),
                              ("write_MBps", "tier write (spill path, no fsync)", "C0:"),
                              ("raw_read_MBps", "raw cold read", "k-."),
                              ("read_MBps", "tier cold read (checksummed)", "C1-s"),
                              ("mixed_MBps", "tier mixed spill/recall", "C2-^")):
        ax.plot(x, [r[key] for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pages of 64 KiB")
    ax.set_ylabel("MB/s")
    ax.set_title("Disk tier vs the folder's sequential bandwidth (same run)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def disk_summary(result: dict) -> str:
    """The printed report of :func:`run_disk_bench`."""
    lines = [f"Disk tier vs the same folder's raw sequential bandwidth (pages of 64 KiB, "
             f"{result['spec']['batch']} pages per call, {result['spec']['io_threads']} I/O "
             f"threads, checksum {result['digest']}; reads cold; medians of "
             f"{result['spec']['reps']} alternating raw/tier runs; MB/s):",
             format_table(result["rows"], TABLE), "",
             "CPU time per page, us (user: the code's own work; system: the kernel's, which a "
             "plain write/read pays too):", format_table(result["rows"], CPU_TABLE)]
    rt = result.get("runtime")
    if rt:
        lines += ["", f"Through the runtime ({rt['layers']} layers x {rt['context']} tokens, "
                  f"batch 1, 10% hot, exact attention, torch kernels on this CPU): "
                  f"{rt['disk_pages']} pages on disk ({rt['disk_bytes'] / 2**30:.2f} GiB), one "
                  f"segment file ({rt['files']}); {rt['spilled_pages']} pages spilled in "
                  f"{rt['spill_s']:.1f} s of tier writes ({rt['spill_Bps'] / 1e6:.0f} MB/s; "
                  f"{rt['spill_user_us_per_page']:.1f} us user + "
                  f"{rt['spill_sys_us_per_page']:.1f} us system CPU per page, the gather out of "
                  "the memory tier included).",
                  f"A decode step reads {rt['read_pages_per_step']:.0f} disk pages back cold "
                  f"({rt['disk_staged_pages']} staged a layer ahead, {rt['disk_sync_pages']} "
                  f"read at their layer): {rt['step_s']:.2f} s per step, of which "
                  f"{rt['stall_s_per_step']:.2f} s waiting on reads; the same cache with every "
                  f"cold page in DDR: {rt['ddr_step_s']:.2f} s per step (fill "
                  f"{rt['fill_s']:.0f} s with disk, {rt['ddr_fill_s']:.0f} s DDR)."]
    lines += target_lines(result["targets"])
    if result.get("out"):
        lines.append(f"\nresults: {result['out']}/disk.json, disk.csv, disk.png")
    return "\n".join(lines)

