"""Conservation: a randomised walk over every operation of the tiered cache -- append (with the
policy's demotion and eviction), demote, spill to disk, reload, prefetch into staging, evict,
free, batch reorder, save/load -- after which every live token's K/V must be bytewise equal to
a shadow copy, and the missing tokens must be exactly the evicted ones.

CI runs 20 seeds x 2,000 operations. ``TIERATTN_CONSERVATION=SEEDSxOPS`` (e.g. ``100x10000``)
runs more.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tierattn.runtime.cache import TieredKVCache
from tierattn.storage.pagemap import HOT, NONE
from tierattn.config import TierConfig, TierSpec
from tierattn.storage.transfer import FakeAsyncEngine

SEEDS, OPS = (int(x) for x in os.environ.get("TIERATTN_CONSERVATION", "20x2000").split("x"))
L, HKV, HQ, D, B, P, CTX = 2, 2, 4, 8, 3, 4, 96


class Walk:
    def __init__(self, seed: int, tmp_path):
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.tmp = tmp_path
        self.seed = seed
        self.new_cache()

    def new_cache(self):
        r = self.rng
        evict = r.random() < 0.3
        hot = r.choice([0.25, 0.5, 0.75])
        tiers = (TierSpec("hbm"), TierSpec("ddr", capacity_pages=r.choice([6, 20, 60])),
                 TierSpec("cxl"), TierSpec("disk", path=str(self.tmp / f"disk{r.random()}"),
                                           capacity_pages=4))
        cfg = TierConfig(page_size=P, hot_budget=hot,
                         evict_budget=(round(1 - hot, 2) / 2 if evict else 0),
                         evict_policy=r.choice(["h2o", "random", "streaming"]),
                         attend=r.choice(["all", "topk"]), tiers=tiers, max_context=CTX,
                         prefill_chunk_size=12, backend="torch", seed=self.seed,
                         recent_pages=r.choice([0, 1, 2]), sink_pages=r.choice([0, 1]))
        engine = FakeAsyncEngine(seed=self.seed, backend="torch") if r.random() < 0.5 else None
        self.cache = TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D,
                                   batch_size=B, dtype=torch.float32, device="cpu",
                                   engine=engine, poison_freed=True)
        self.kv = [[torch.zeros(0, 2, HKV, D) for _ in range(B)] for _ in range(L)]
        self.dropped = [[set() for _ in range(B)] for _ in range(L)]
        self.alive = [True] * B

    # --- operations -------------------------------------------------------------------------

    def append(self):
        t = 1 if self.rng.random() < 0.7 else self.rng.randint(2, 12)
        if self.cache.length() + t > CTX:
            return self.new_cache()
        for layer in range(L):
            k = torch.randn(B, HKV, t, D, generator=self.gen)
            v = torch.randn(B, HKV, t, D, generator=self.gen)
            self.cache.update(layer, k, v)
            for b in range(B):
                if self.alive[b]:
                    self.kv[layer][b] = torch.cat([self.kv[layer][b],
                                                   torch.stack([k[b], v[b]]).permute(2, 0, 1, 3)])
            before = self.cache.telemetry.layers[layer].evicted_tokens
            out = self.cache.attend(layer, torch.randn(B, HQ, t, D, generator=self.gen))
            assert not torch.isnan(out[torch.tensor(self.alive)]).any()
            evicted = self.cache.telemetry.layers[layer].evicted_tokens - before
            st = self.cache.pages.layers[layer]
            # the policy's evictions: adopt them from the page tables, then cross-check counts
            new = 0
            for b in range(B):
                if not self.alive[b]:
                    continue
                for pg in st.evicted[b].nonzero().flatten().tolist():
                    toks = set(range(pg * P, pg * P + P))
                    new += len(toks - self.dropped[layer][b])
                    self.dropped[layer][b] |= toks
            assert new == evicted, (new, evicted)

    def pick(self, where, skip_first: int = 0):
        cands = []
        for layer in range(L):
            st = self.cache.pages.layers[layer]
            n = self.cache.num_pages(layer)
            for b in range(B):
                if self.alive[b]:
                    for pg in range(skip_first, max(0, n - 1)):  # never the page being filled
                        if where(int(st.tier[b, pg])):
                            cands.append((layer, b, pg))
        return self.rng.choice(cands) if cands else None

    def move(self, src, dst):
        c = self.pick(lambda t: t in src)
        if c and self.cache.tiers[dst].num_free(c[0]):
            self.cache.move(*c, dst)

    def demote(self):
        self.move((HOT,), self.rng.choice([1, 2]))

    def spill(self):
        self.move((1, 2), 3)

    def reload(self):
        self.move((1, 2, 3), self.rng.choice([HOT, 1]))

    def evict(self):
        sinks = self.cache.config.sink_pages  # never evicted (no left padding here)
        c = self.pick(lambda t: t != NONE, skip_first=sinks)
        if c:
            layer, b, pg = c
            self.cache.evict(layer, b, [pg])
            self.dropped[layer][b] |= set(range(pg * P, pg * P + P))

    def prefetch(self):
        layer = self.rng.randrange(L)
        cache = self.cache
        tabs = cache.pages.tables(layer, cache.tiers)
        mp = cache.max_pages
        for table, pool in cache.prefetcher.stage(layer, tabs, self.rng.randrange(2)):
            # staging slot i holds the batch's entry i: page lse_index[i] of the map (unused
            # entries name the trash row B * max_pages)
            for i, row in enumerate(table.lse_index.tolist()):
                if row == B * mp:
                    continue
                b, pg = divmod(row, mp)
                got = pool[i].permute(1, 0, 2, 3)
                want = self.kv[layer][b][pg * P:(pg + 1) * P]
                assert torch.equal(got.view(torch.int32), want.view(torch.int32))

    def free(self):
        alive = [b for b in range(B) if self.alive[b]]
        if len(alive) > 1:
            b = self.rng.choice(alive)
            self.cache.free(b)
            self.alive[b] = False

    def reorder(self):
        index = [self.rng.randrange(B) for _ in range(B)]
        self.cache.reorder(index)
        self.kv = [[self.kv[layer][i] for i in index] for layer in range(L)]
        self.dropped = [[set(self.dropped[layer][i]) for i in index] for layer in range(L)]
        self.alive = [self.alive[i] for i in index]

    def save_load(self):
        path = self.cache.save(self.tmp)
        self.cache.load(path)
        path.unlink()

    OPS = {"append": 8, "demote": 3, "spill": 2, "reload": 2, "evict": 1, "prefetch": 2,
           "free": 0.3, "reorder": 0.5, "save_load": 0.1}

    def step(self) -> str:
        name = self.rng.choices(list(self.OPS), weights=list(self.OPS.values()))[0]
        getattr(self, name)()
        return name

    # --- the invariant ----------------------------------------------------------------------

    def check(self):
        for layer in range(L):
            n = self.cache.length(layer)
            for b in range(B):
                if not self.alive[b]:
                    continue
                pos, kv = self.cache.gather(layer, b)
                want_pos = [t for t in range(n) if t not in self.dropped[layer][b]]
                assert pos.tolist() == want_pos, f"layer {layer} seq {b}: live tokens differ"
                want = self.kv[layer][b][pos]
                assert torch.equal(kv.view(torch.int32), want.view(torch.int32)), \
                    f"layer {layer} seq {b}: K/V differ bytewise"


@pytest.mark.parametrize("seed", range(SEEDS))
def test_conservation_walk(seed, tmp_path, figures):
    walk = Walk(seed, tmp_path)
    done: dict[str, int] = {}
    for i in range(OPS):
        name = walk.step()
        done[name] = done.get(name, 0) + 1
        try:
            walk.check()
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, operation {i} ({name}): {e}") from None
    figures.count("conservation operations (0 mismatches)", OPS)
    figures.count("conservation seeds", 1)
    assert done.get("append", 0) > OPS // 4
