"""The runtime's rule, probed: every public call of :class:`TieredKVCache` completes, or raises a
typed error and changes nothing.

Each probe builds a cache holding 40 tokens per layer (two configurations: the one of the
issue's reproductions, and a four-tier one with pages demoted to DDR/CXL and moved to disk),
makes one bad call -- bad arguments, negative, duplicate or out-of-range indices, faults injected
into disk writes, disk reads and copies (ENOSPC, EIO, KeyboardInterrupt), a full tier, crafted
save files whose checksums are valid -- and checks that

1. the call raised the expected typed error (a :class:`~tierattn.errors.TierAttnError`;
   ``KeyboardInterrupt`` where one was injected),
2. ``gather()`` of every live token of every layer and sequence is byte-equal before and after,
   and the disk tier holds the same files,
3. the cache is still usable: more tokens appended (a prompt chunk and decode steps) and
   attended, every output equal to dense attention over a shadow copy, every stored token
   byte-equal to the shadow.

The counts (tried / typed / state unchanged) go to the figures table; docs/tests.md says what
they cover.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from helpers import Shadow, disk_segments, fail_disk_reads, fail_disk_writes, run_loop

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import TierConfig, TierSpec
from tierattn.errors import (KernelInputError, KVCapacityError, KVFileError, KVIOError,
                             TierAttnError, TierConfigError)
from tierattn.storage.kvfile import read_kv_file, read_kv_header, write_kv_file
from tierattn.storage.pagemap import NONE

L, HKV, HQ, D, B = 2, 2, 4, 16, 2
PROMPT = 40


def config(kind: str, tmp: Path) -> TierConfig:
    if kind == "issue":  # the reproductions' configuration, verbatim
        return TierConfig(hot_budget=32, max_context=256, prefill_chunk_size=64,
                          backend="torch")
    tiers_ = (TierSpec("hbm"), TierSpec("ddr", capacity_pages=6), TierSpec("cxl"),
              TierSpec("disk", path=str(tmp / "disk"), capacity_pages=8))
    cfg = TierConfig(page_size=4, hot_budget=0.25, sink_pages=1, recent_pages=1,
                     max_context=128, prefill_chunk_size=16, tiers=tiers_, backend="torch")
    # "tiers-topk": the same tiers under recall (disk pages staged from the last selection)
    return cfg.replace(attend="topk", recall_budget=0.5) if kind == "tiers-topk" else cfg


class Subject:
    """A cache after ``PROMPT`` tokens per layer, and its shadow."""

    def __init__(self, kind: str, tmp: Path, seed: int = 0):
        self.tmp = tmp
        self.cfg = config(kind, tmp)
        self.cache = self.new_cache()
        self.shadow = Shadow(L, B, HKV, D, torch.float32)
        self.gen = torch.Generator().manual_seed(seed)
        self.feed(prompt=PROMPT, steps=0)
        if kind.startswith("tiers"):  # a page of each sequence on disk, one in each memory tier
            c = self.cache
            for layer in range(L):
                for b in range(B):
                    c.move(layer, b, 3, 3)
        self.undo = lambda: None  # gives back what a probe's setup took

    def new_cache(self, **kw) -> TieredKVCache:
        return TieredKVCache(self.cfg, num_layers=L, num_kv_heads=HKV, head_dim=D,
                             batch_size=B, dtype=torch.float32, device="cpu",
                             poison_freed=True, **kw)

    def feed(self, prompt: int, steps: int) -> None:
        c = self.cache
        alive = c.pages.alive.clone()

        def check(layer, out, q):
            keep = torch.zeros(B, c.length(layer), dtype=torch.bool)
            for b in range(B):
                keep[b, c.gather(layer, b)[0]] = True
            want = self.shadow.attend(layer, q, keep)
            err = float((out.double() - want)[alive].abs().max())
            assert err <= 2e-5, f"layer {layer}: |out - dense| = {err}"
            return err

        run_loop(c, self.shadow, prompt=prompt, steps=steps, hq=HQ, gen=self.gen,
                 chunk=min(16, c.config.prefill_chunk_size),
                 check=check if c.config.attend == "all" else None)  # (recall: approximate)

    def kv(self, t: int = 1, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(B, HKV, t, D, generator=self.gen).to(dtype)

    def q(self, t: int = 1) -> torch.Tensor:
        return torch.randn(B, HQ, t, D, generator=self.gen)

    def state(self) -> list:
        """Every live token's bytes, per layer and sequence, the lengths and the disk files."""
        c = self.cache
        out: list = [c.length(layer) for layer in range(L)]
        for layer in range(L):
            for b in range(B):
                if bool(c.pages.alive[b]):
                    pos, kv = c.gather(layer, b)
                    out.append((layer, b, pos.tolist(), kv.view(torch.int32).clone()))
        disk = self.tmp / "disk"
        out.append(sorted(p.name for p in disk.iterdir()) if disk.exists() else None)
        return out

    def matches_shadow(self) -> None:
        c = self.cache
        for layer in range(L):
            for b in range(B):
                if not bool(c.pages.alive[b]):
                    continue
                pos, kv = c.gather(layer, b)
                want = torch.stack([self.shadow.k[layer][b], self.shadow.v[layer][b]])
                want = want.permute(2, 0, 1, 3)[pos]
                assert torch.equal(kv.view(torch.int32), want.view(torch.int32)), \
                    f"layer {layer} sequence {b} differs from the shadow"


def same(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, tuple):
            if x[:3] != y[:3] or not torch.equal(x[3], y[3]):
                return False
        elif x != y:
            return False
    return True


# --- faults -------------------------------------------------------------------------------

def fail_copies(monkeypatch, cache: TieredKVCache, exc: BaseException, after: int = 0) -> None:
    real = cache.engine.copy
    calls = {"n": 0}

    def copy(*a, **k):
        calls["n"] += 1
        if calls["n"] > after:
            raise exc
        return real(*a, **k)

    monkeypatch.setattr(cache.engine, "copy", copy)


ENOSPC = OSError(errno.ENOSPC, "No space left on device")
EIO = OSError(errno.EIO, "Input/output error")
FAULTS = {"ENOSPC": (ENOSPC, KVIOError), "EIO": (EIO, KVIOError),
          "interrupt": (KeyboardInterrupt(), KeyboardInterrupt)}


# --- crafted save files (valid checksums, inconsistent tables) ------------------------------

def crafted(s: Subject, edit) -> Path:
    """A file saved from ``s``'s cache, its tensors edited by ``edit(tensors)`` and rewritten
    with a fresh, valid checksum."""
    path = s.cache.save(s.tmp)
    header = read_kv_header(path, max_file_bytes=1 << 30)
    tensors = read_kv_file(path, lambda h: None, max_file_bytes=1 << 30)
    edit(tensors)
    meta = {k: v for k, v in header.meta.items() if k not in ("checksum", "format_version")}
    out = s.tmp / "crafted"
    out.mkdir(exist_ok=True)
    return write_kv_file(out, "crafted", tensors, meta)


def _set(name, idx, value):
    def edit(t):
        t[name][idx] = value
    return edit


def _drop_page(t):  # the tables keep a page the data no longer holds
    t["layer0.pages"] = t["layer0.pages"][1:].clone()


def _evict_live(t):  # a page both live and evicted
    t["layer0.evicted"][0, 0] = 1


def _neither(t):  # a page of a live sequence neither stored nor evicted
    t["layer1.pages"] = t["layer1.pages"][1:].clone()
    t["layer1.tier"][0, 1] = NONE


def _freed_holds_pages(t):
    t["alive"][1] = 0


def _everything_in_ddr(t):  # more DDR pages than the target's capacity
    t["layer0.tier"][t["layer0.tier"] != NONE] = 1


def _short_length(t):
    t["layer0.length"][0] = 10


# --- the probes -----------------------------------------------------------------------------

def other_geometry_file(s: Subject) -> Path:
    other = TieredKVCache(s.cfg, num_layers=L, num_kv_heads=HKV, head_dim=8, batch_size=B,
                          dtype=torch.float32, device="cpu")
    other.update(0, torch.zeros(B, HKV, 4, 8), torch.zeros(B, HKV, 4, 8))
    return other.save(s.tmp)


def _rep1_load_capacity(s: Subject):  # issue item 1: a file whose pages do not fit
    src_cfg = TierConfig(hot_budget=200, max_context=256, prefill_chunk_size=64,
                         backend="torch")
    src = TieredKVCache(src_cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=B,
                        dtype=torch.float32, device="cpu")
    for _ in range(3):
        for layer in range(L):
            src.update(layer, s.kv(64), s.kv(64))
    s.cache.load(src.save(s.tmp))


def page_in(s: Subject, layer: int, seq: int, where: tuple[int, ...]) -> int:
    """A page of ``seq`` in one of the tiers ``where`` (not the page being filled)."""
    st, c = s.cache.pages.layers[layer], s.cache
    last = c.num_pages(layer) - (1 if c.length(layer) % c.page_size else 0)
    return next(pg for pg in range(last) if int(st.tier[seq, pg]) in where)


def hog(s: Subject, tier: int, layers=range(L)) -> None:
    """Take every free slot of ``tier`` (given back by ``s.undo`` after the probe)."""
    t = s.cache.tiers[tier]
    taken = [(layer, t.alloc(layer, t.num_free(layer))) for layer in layers]
    prev = s.undo
    s.undo = lambda: ([t.release(layer, slots) for layer, slots in taken], prev())


PROBES: list[tuple] = []  # (id, config kind, setup, fault, call, expected)


def probe(pid: str, call, expected, kind: str = "issue", setup=None, fault=None) -> None:
    """``setup(s, monkeypatch)`` runs before the state is recorded, ``fault(s, monkeypatch)``
    after it (a fault would break the recording's reads); the fault is lifted before the
    state is compared."""
    PROBES.append((pid, kind, setup, fault, call, expected))


# issue reproductions, item by item (3: negative indices everywhere)
probe("rep1-load-does-not-fit", _rep1_load_capacity, KVCapacityError)
probe("rep2-evict-duplicate", lambda s: s.cache.evict(0, 0, [1, 1]), KernelInputError)
probe("rep3-move-tier-minus-1", lambda s: s.cache.move(0, 0, 0, -1), KernelInputError)
probe("rep3-update-layer-minus-1", lambda s: s.cache.update(-1, s.kv(), s.kv()),
      KernelInputError)
probe("rep3-free-minus-1", lambda s: s.cache.free(-1), KernelInputError)
probe("rep3-evict-layer-minus-1", lambda s: s.cache.evict(-1, 0, [1]), KernelInputError)
probe("rep3-move-sequence-minus-1", lambda s: s.cache.move(0, -1, 0, 1), KernelInputError)
probe("rep4-evict-page-being-filled", lambda s: s.cache.evict(0, 0, [2]), KernelInputError)
probe("rep5-disk-full-during-move", lambda s: s.cache.move(0, 0, 1, 3), KVIOError, "tiers",
      lambda s, mp: fail_disk_writes(mp, ENOSPC))
probe("rep7-load-length-below-pages", lambda s: s.cache.load(crafted(s, _short_length)),
      KVFileError)
probe("rep7-load-pad-out-of-range", lambda s: s.cache.load(crafted(s, _set("pad", 0, 9999))),
      KVFileError)
probe("rep8-update-int64", lambda s: s.cache.update(0, s.kv().long(), s.kv().long()),
      KernelInputError)
probe("rep8-reorder-floats", lambda s: s.cache.reorder([0.9, 1.2]), KernelInputError)
probe("rep8-attend-list", lambda s: s.cache.attend(0, [[0.0]]), KernelInputError)
probe("rep8-attend-3d", lambda s: s.cache.attend(0, torch.zeros(B, HQ, D)), KernelInputError)
probe("rep8-update-layer-L", lambda s: s.cache.update(L, s.kv(), s.kv()), KernelInputError)
probe("rep8-free-B", lambda s: s.cache.free(B), KernelInputError)

# update
for name, bad in [("1.0", 1.0), ("True", True), ("'0'", "0"), ("None", None), ("L+5", L + 5),
                  ("tensor1.0", torch.tensor(1.0)), ("tensor[0]", torch.tensor([0]))]:
    probe(f"update-layer-{name}", lambda s, bad=bad: s.cache.update(bad, s.kv(), s.kv()),
          KernelInputError)
for name, make in [
        ("k-int32", lambda s: (s.kv().int(), s.kv())),
        ("v-bool", lambda s: (s.kv(), s.kv() > 0)),
        ("k-3d", lambda s: (s.kv()[0], s.kv())),
        ("k-5d", lambda s: (s.kv()[None], s.kv()[None])),
        ("k-list", lambda s: (s.kv().tolist(), s.kv())),
        ("k-numpy", lambda s: (s.kv().numpy(), s.kv())),
        ("kv-mismatch", lambda s: (s.kv(1), s.kv(2))),
        ("wrong-batch", lambda s: (torch.zeros(B + 1, HKV, 1, D),) * 2),
        ("wrong-heads", lambda s: (torch.zeros(B, HKV + 1, 1, D),) * 2),
        ("wrong-dim", lambda s: (torch.zeros(B, HKV, 1, D * 2),) * 2),
        ("T=0", lambda s: (torch.zeros(B, HKV, 0, D),) * 2),
        ("T>chunk", lambda s: (s.kv(65), s.kv(65))),
        ("None", lambda s: (None, None))]:
    probe(f"update-{name}", lambda s, make=make: s.cache.update(0, *make(s)), KernelInputError)
probe("update-past-max-context", lambda s: s.cache.update(0, s.kv(6), s.kv(6)),
      KVCapacityError, setup=lambda s, mp: s.feed(prompt=211, steps=0))

# attend
for name, bad in [("-1", -1), ("L", L), ("0.0", 0.0), ("True", True), ("'1'", "1")]:
    probe(f"attend-layer-{name}", lambda s, bad=bad: s.cache.attend(bad, s.q()),
          KernelInputError)
for name, make in [
        ("q-int", lambda s: s.q().long()),
        ("q-5d", lambda s: s.q()[None]),
        ("q-2d", lambda s: s.q()[0, 0]),
        ("q-None", lambda s: None),
        ("q-numpy", lambda s: s.q().numpy()),
        ("q-wrong-batch", lambda s: torch.zeros(B + 1, HQ, 1, D)),
        ("q-wrong-dim", lambda s: torch.zeros(B, HQ, 1, D + 1)),
        ("q-heads-not-multiple", lambda s: torch.zeros(B, HKV + 1, 1, D)),
        ("q-T=0", lambda s: torch.zeros(B, HQ, 0, D)),
        ("q-T>length", lambda s: torch.zeros(B, HQ, PROMPT + 1, D))]:
    probe(f"attend-{name}", lambda s, make=make: s.cache.attend(0, make(s)), KernelInputError)
for kw in [{"sm_scale": -1.0}, {"sm_scale": 0}, {"sm_scale": float("nan")},
           {"sm_scale": "x"}, {"sm_scale": True}, {"softcap": -5.0},
           {"softcap": float("inf")}, {"sliding_window": 0}, {"sliding_window": -4},
           {"sliding_window": 2.5}, {"sliding_window": True},
           {"sinks": torch.zeros(HQ + 1)}, {"sinks": torch.zeros(HQ, dtype=torch.long)},
           {"sinks": [0.0] * HQ}]:
    (k, v), = kw.items()
    probe(f"attend-{k}={v if not isinstance(v, torch.Tensor) else list(v.shape)}",
          lambda s, kw=kw: s.cache.attend(0, s.q(), **kw), KernelInputError)

# move
for pid, args in [("layer-L", (L, 0, 0, 1)), ("layer-1.0", (1.0, 0, 0, 1)),
                  ("sequence-B", (0, B, 0, 1)), ("sequence-True", (0, True, 0, 1)),
                  ("page-minus-1", (0, 0, -1, 1)), ("page-max", (0, 0, 10**6, 1)),
                  ("page-0.0", (0, 0, 0.0, 1)), ("page-past-end", (0, 0, 5, 1)),
                  ("page-being-filled", (0, 0, 2, 1)), ("tier-len", (0, 0, 0, 2)),
                  ("tier-string", (0, 0, 0, "ddr")), ("tier-None", (0, 0, 0, None)),
                  ("tier-1.5", (0, 0, 0, 1.5))]:
    probe(f"move-{pid}", lambda s, args=args: s.cache.move(*args), KernelInputError)
probe("move-freed-sequence", lambda s: s.cache.move(0, 1, 0, 1), KernelInputError,
      setup=lambda s, mp: s.cache.free(1))
probe("move-evicted-page", lambda s: s.cache.move(0, 0, 1, 1), KernelInputError,
      setup=lambda s, mp: s.cache.evict(0, 0, [1]))

# evict
for pid, args in [("layer-L", (L, 0, [1])), ("sequence-B", (0, B, [1])),
                  ("sequence-minus-1", (0, -1, [1])), ("page-minus-1", (0, 0, [-1])),
                  ("page-max", (0, 0, [10**6])), ("page-1.0", (0, 0, [1.0])),
                  ("page-True", (0, 0, [True])), ("pages-int", (0, 0, 1)),
                  ("pages-str", (0, 0, "1")), ("pages-None", (0, 0, None)),
                  ("pages-float-tensor", (0, 0, torch.tensor([1.0]))),
                  ("pages-2d-tensor", (0, 0, torch.tensor([[1]]))),
                  ("page-past-end", (0, 0, [7])), ("sink", (0, 0, [0])),
                  ("dup-in-tensor", (0, 0, torch.tensor([1, 1]))),
                  ("one-good-one-bad", (0, 0, [1, 99]))]:
    probe(f"evict-{pid}", lambda s, args=args: s.cache.evict(*args), KernelInputError)
probe("evict-twice", lambda s: s.cache.evict(0, 0, [1]), KernelInputError,
      setup=lambda s, mp: s.cache.evict(0, 0, [1]))
probe("evict-freed-sequence", lambda s: s.cache.evict(0, 1, [1]), KernelInputError,
      setup=lambda s, mp: s.cache.free(1))

# free
for name, bad in [("1.0", 1.0), ("True", True), ("'0'", "0"), ("None", None),
                  ("B+1", B + 1), ("list", [0])]:
    probe(f"free-{name}", lambda s, bad=bad: s.cache.free(bad), KernelInputError)
probe("free-twice", lambda s: s.cache.free(1), KernelInputError,
      setup=lambda s, mp: s.cache.free(1))

# reorder
for name, bad in [("minus-1", [-1, 0]), ("out-of-range", [0, B]), ("short", [0]),
                  ("long", [0, 1, 0]), ("str", "01"), ("None", None), ("bools", [True, False]),
                  ("float-tensor", torch.tensor([0.0, 1.0])), ("nested", [[0], [1]]),
                  ("int", 0)]:
    probe(f"reorder-{name}", lambda s, bad=bad: s.cache.reorder(bad), KernelInputError)

# set_padding
for name, bad in [("negative", [-1, 0]), ("short", [0]), ("long", [0, 0, 0]),
                  ("float", [1.5, 0]), ("past-max-context", [10**6, 0]), ("str", "x"),
                  ("None", None), ("float-tensor", torch.tensor([1.0, 0.0])),
                  ("bools", [True, False])]:
    probe(f"set_padding-{name}", lambda s, bad=bad: s.cache.set_padding(bad), KernelInputError)

# gather
for name, args in [("layer-minus-1", (-1, 0)), ("sequence-B", (0, B)), ("layer-1.0", (1.0, 0))]:
    probe(f"gather-{name}", lambda s, args=args: s.cache.gather(*args), KernelInputError)

# save
probe("save-into-a-file", lambda s: s.cache.save(s.cache.save(s.tmp)), KernelInputError)
probe("save-missing-folder", lambda s: s.cache.save(s.tmp / "missing"), KernelInputError)
probe("save-int", lambda s: s.cache.save(3), KernelInputError)
for fault, (exc, typed) in FAULTS.items():
    probe(f"save-{fault}", lambda s: s.cache.save(s.tmp), typed,
          fault=lambda s, mp, exc=exc: fail_disk_writes(mp, exc))

# load: files that fail validation, crafted ones with valid checksums, faults while loading
probe("load-missing-file", lambda s: s.cache.load(s.tmp / "none.safetensors"), KVFileError)
probe("load-other-geometry", lambda s: s.cache.load(other_geometry_file(s)), KVFileError)
probe("load-truncated", lambda s: s.cache.load(
    (lambda p: (p.write_bytes(p.read_bytes()[:-100]), p)[1])(s.cache.save(s.tmp))),
    KVFileError)
for name, edit in [("length-past-max", _set("layer0.length", 0, 10**6)),
                   ("length-negative", _set("layer1.length", 0, -1)),
                   ("tier-out-of-range", _set("layer0.tier", (0, 0), 9)),
                   ("tier-below-none", _set("layer0.tier", (0, 0), -7)),
                   ("page-count", _drop_page), ("live-and-evicted", _evict_live),
                   ("neither-stored-nor-evicted", _neither),
                   ("freed-sequence-holds-pages", _freed_holds_pages),
                   ("alive-flag-2", _set("alive", 0, 2)),
                   ("evicted-flag-3", _set("layer1.evicted", (1, 10), 3)),
                   ("pad-negative", _set("pad", 1, -3)),
                   ("mass-nan", _set("layer0.mass", (0, 0), float("nan"))),
                   ("page-past-length", _set("layer1.tier", (0, 10), 0))]:
    probe(f"load-crafted-{name}", lambda s, edit=edit: s.cache.load(crafted(s, edit)),
          KVFileError)
probe("load-crafted-ddr-overfull", lambda s: s.cache.load(crafted(s, _everything_in_ddr)),
      KVCapacityError, "tiers")
for fault, (exc, typed) in FAULTS.items():
    probe(f"load-disk-write-{fault}", lambda s: s.cache.load(s.saved), typed, "tiers",
          setup=lambda s, mp: setattr(s, "saved", s.cache.save(s.tmp)),
          fault=lambda s, mp, exc=exc: fail_disk_writes(mp, exc, after=1))

# faults while pages move (disk writes, disk reads, copies), with the rollback checked
for fault, (exc, typed) in FAULTS.items():
    probe(f"move-to-disk-{fault}", lambda s: s.cache.move(1, 1, 1, 3), typed, "tiers",
          fault=lambda s, mp, exc=exc: fail_disk_writes(mp, exc))
    probe(f"move-disk-to-hbm-read-{fault}", lambda s: s.cache.move(0, 0, 3, 0), typed,
          "tiers", fault=lambda s, mp, exc=exc: fail_disk_reads(mp, exc))
    probe(f"move-disk-to-cxl-read-{fault}", lambda s: s.cache.move(0, 1, 3, 2), typed,
          "tiers", fault=lambda s, mp, exc=exc: fail_disk_reads(mp, exc))
    probe(f"move-ddr-to-disk-{fault}",
          lambda s: s.cache.move(0, 1, page_in(s, 0, 1, (1,)), 3), typed, "tiers",
          fault=lambda s, mp, exc=exc: fail_disk_writes(mp, exc))
    probe(f"reorder-duplicate-disk-{fault}", lambda s: s.cache.reorder([0, 0]), typed, "tiers",
          fault=lambda s, mp, exc=exc: fail_disk_writes(mp, exc, after=1))
for fault in ("EIO", "interrupt"):
    exc, typed = FAULTS[fault]
    probe(f"attend-disk-read-{fault}", lambda s: s.cache.attend(0, s.q()), typed, "tiers",
          fault=lambda s, mp, exc=exc: fail_disk_reads(mp, exc))
    probe(f"gather-disk-read-{fault}", lambda s: s.cache.gather(0, 0), typed, "tiers",
          fault=lambda s, mp, exc=exc: fail_disk_reads(mp, exc))
    # recall: a step noted its selection (disk pages among them); the next layer's staging
    # read, started by the layer before it, fails and its attention raises
    probe(f"topk-attend-staged-disk-read-{fault}",
          lambda s: [s.cache.attend(layer, s.q()) for layer in range(L)], typed, "tiers-topk",
          setup=lambda s, mp: s.feed(prompt=0, steps=2),
          fault=lambda s, mp, exc=exc: fail_disk_reads(mp, exc))
probe("move-copy-interrupted", lambda s: s.cache.move(0, 0, page_in(s, 0, 0, (0,)), 1),
      KeyboardInterrupt, "tiers",
      fault=lambda s, mp: fail_copies(mp, s.cache, KeyboardInterrupt()))
probe("reorder-copy-interrupted", lambda s: s.cache.reorder([1, 1]), KeyboardInterrupt,
      "tiers", fault=lambda s, mp: fail_copies(mp, s.cache, KeyboardInterrupt(), after=2))
probe("reorder-copy-failed-launch", lambda s: s.cache.reorder([1, 1]), KVIOError,
      "tiers", fault=lambda s, mp: fail_copies(mp, s.cache, EIO, after=3))

# capacity exhaustion, tier by tier (the setup takes every free slot of the tier)
for ti, name in enumerate(("hbm", "ddr", "cxl", "disk")):
    probe(f"capacity-{name}-move-in",
          lambda s, ti=ti: s.cache.move(1, 0, page_in(s, 1, 0, {0, 1, 2, 3} - {ti}), ti),
          KVCapacityError, "tiers", setup=lambda s, mp, ti=ti: hog(s, ti))
probe("capacity-reorder-copies", lambda s: s.cache.reorder([0, 0]), KVCapacityError, "tiers",
      setup=lambda s, mp: [hog(s, ti) for ti in range(4)])

# construction and configuration
for name, make in [
        ("config-dict", lambda s: TieredKVCache({"hot_budget": 0.5}, num_layers=1,
                                                num_kv_heads=1, head_dim=8)),
        ("num_layers-0", lambda s: TieredKVCache(s.cfg, num_layers=0, num_kv_heads=1,
                                                 head_dim=8)),
        ("num_layers-True", lambda s: TieredKVCache(s.cfg, num_layers=True, num_kv_heads=1,
                                                    head_dim=8)),
        ("dtype-int", lambda s: TieredKVCache(s.cfg, num_layers=1, num_kv_heads=1, head_dim=8,
                                              dtype=torch.int32)),
        ("preset-bogus-kw", lambda s: TierConfig.preset("offload", bogus=1)),
        ("replace-bogus-kw", lambda s: s.cfg.replace(bogus=1)),
        ("tiers-unknown-kind", lambda s: TierConfig(tiers=("hbm", "tape"))),
        ("tiers-int", lambda s: TierConfig(tiers=(0, 1))),
        ("disk-path-is-file", lambda s: TieredKVCache(
            TierConfig(tiers=("hbm", TierSpec("disk", path=str(s.cache.save(s.tmp))))),
            num_layers=1, num_kv_heads=1, head_dim=8, device="cpu")),
        ("seed-float", lambda s: TierConfig(seed=1.5))]:
    probe(f"construct-{name}", make, (TierConfigError, KernelInputError))


@pytest.mark.parametrize("pid,kind,setup,fault,call,expected", PROBES,
                         ids=[p[0] for p in PROBES])
def test_probe(pid, kind, setup, fault, call, expected, tmp_path, monkeypatch, figures):
    s = Subject(kind, tmp_path)
    if setup is not None:
        setup(s, monkeypatch)
    before = s.state()
    with monkeypatch.context() as mp:
        if fault is not None:
            fault(s, mp)
        figures.count("misuse probes tried", 1)
        with pytest.raises(expected) as info:
            call(s)
    if expected is not KeyboardInterrupt:
        assert isinstance(info.value, TierAttnError), f"untyped: {info.value!r}"
    figures.count("misuse probes: typed error", 1)
    assert same(s.state(), before), f"{pid}: the failed call changed the cache"
    figures.count("misuse probes: state unchanged", 1)
    s.undo()
    s.matches_shadow()
    s.feed(prompt=3, steps=2)  # still usable: a chunk and decode steps, exact
    s.matches_shadow()


def test_at_least_150_probes():
    assert len(PROBES) >= 150, len(PROBES)


# --- a demotion that cannot happen inside a step (issue items 5 and 6) --------------------

def _step(c: TieredKVCache, shadow: Shadow, gen: torch.Generator) -> None:
    """One decode step on every layer; raises before layer 0 appends if the cache refuses."""
    for layer in range(L):
        k, v = torch.randn(B, HKV, 1, D, generator=gen), torch.randn(B, HKV, 1, D, generator=gen)
        c.update(layer, k, v)
        shadow.append(layer, k, v)
        q = torch.randn(B, HQ, 1, D, generator=gen)
        out = c.attend(layer, q)
        alive = c.pages.alive
        assert torch.allclose(out[alive].double(), shadow.attend(layer, q)[alive], atol=2e-5)


def _tables_agree(c: TieredKVCache) -> None:
    """Every tier's allocator holds exactly the slots the page tables use."""
    for layer in range(L):
        st = c.pages.layers[layer]
        for ti, t in enumerate(c.tiers):
            assert t.num_used(layer) == int((st.tier == ti).sum()), (layer, t.kind)


@pytest.mark.parametrize("fault", ["capacity", "ENOSPC", "EIO"])
def test_failed_demotion_raises_at_the_next_step_start_with_layers_in_step(fault, tmp_path,
                                                                          monkeypatch):
    lower = TierSpec("ddr", capacity_pages=3) if fault == "capacity" else \
        TierSpec("disk", path=str(tmp_path / "disk"))
    cfg = TierConfig(page_size=4, hot_budget=0.25, sink_pages=1, recent_pages=1,
                     max_context=128, prefill_chunk_size=16, tiers=(TierSpec("hbm"), lower),
                     backend="torch")
    c = TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=B,
                      device="cpu", poison_freed=True)
    shadow, gen = Shadow(L, B, HKV, D, torch.float32), torch.Generator().manual_seed(0)
    run_loop(c, shadow, prompt=12, steps=0, hq=HQ, gen=gen)
    expected = KVCapacityError if fault == "capacity" else KVIOError
    with monkeypatch.context() as mp:
        if fault != "capacity":
            fail_disk_writes(mp, FAULTS[fault][0])
        with pytest.raises(expected, match="Nothing was appended"):
            for _ in range(40):
                _step(c, shadow, gen)
        n = c.length(0)
        assert all(c.length(layer) == n for layer in range(L)), "layers out of step"
        with pytest.raises(expected):  # a retry appends nothing either
            c.update(0, torch.zeros(B, HKV, 1, D), torch.zeros(B, HKV, 1, D))
        assert c.length(0) == n
        _tables_agree(c)
        if fault != "capacity":
            # one segment, whatever failed; its page map holds exactly the slots in use
            assert [p.name for p in (tmp_path / "disk").iterdir()] == \
                [p.name for p in disk_segments(tmp_path / "disk")] and \
                len(disk_segments(tmp_path / "disk")) == 1
            seg = c.tiers[1].segment()
            for layer in range(L):
                assert int((seg.starts[layer] >= 0).sum()) == c.tiers[1].num_used(layer)
    if fault == "capacity":
        c.free(1)  # the way out the message names: room in the lower tier
    for _ in range(6):  # the deferred demotions settle; decoding goes on, exact
        _step(c, shadow, gen)
    _tables_agree(c)
    for layer in range(L):
        for b in range(B if fault != "capacity" else 1):
            pos, kv = c.gather(layer, b)
            assert pos.tolist() == list(range(c.length(layer)))
            want = torch.stack([shadow.k[layer][b], shadow.v[layer][b]]).permute(2, 0, 1, 3)
            assert torch.equal(kv, want)
