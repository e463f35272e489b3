"""The hot set's device path in vLLM (models/vllm/hotworker.py), without vLLM: vLLM's device
cache read in place in both of its physical layouts, and :class:`DeviceHotSetWorker` driven
step by step as the connector drives it -- the copies out, then attention over hot blocks in
vLLM's cache plus the cold pages staged from the host tier, against attention over every
token. On the CPU the copies go through :class:`FakeAsyncEngine` (a copy lands only when waited
on, its destination NaN until then), so a missing wait or fence fails here; on a GPU (the GPU
check's gate) through the copy stream and a pinned host tier."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE

from tierattn.config import SwapConfig, TierConfig
from tierattn.errors import UnsupportedEngineError
from tierattn.kernels import copy_pages
from tierattn.models.vllm.hotworker import DeviceHotSetWorker, attention_view, block_pages
from tierattn.storage.transfer import FakeAsyncEngine

LAYERS, HKV, HQ, D, P = 3, 2, 4, 16, 16


def vllm_cache(blocks: int, layout: str, dtype: torch.dtype, h: int = HKV, p: int = P,
               d: int = D) -> torch.Tensor:
    """A layer's cache as vLLM 0.32 allocates it: logical ``[N, H, P, 2D]``, physically
    ``HND`` (as is) or ``NHD`` (token-major)."""
    if layout == "NHD":
        return torch.zeros((blocks, p, h, 2 * d), dtype=dtype, device=DEVICE).permute(0, 2, 1, 3)
    return torch.zeros((blocks, h, p, 2 * d), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("h,p", [(2, 16), (1, 16), (4, 1), (3, 32)])
def test_block_pages_read_keys_and_values_as_vllm_does(layout, h, p):
    cache = vllm_cache(5, layout, torch.float32, h, p)
    cache.copy_(torch.randn(cache.shape))
    pages, strides = block_pages(cache)
    view = attention_view(pages, strides)
    # vLLM's Triton and flash backends: kv_cache.transpose(1, 2).split(head_size, dim=-1)
    k, v = cache.transpose(1, 2).split(D, dim=-1)
    assert torch.equal(view[:, 0], k) and torch.equal(view[:, 1], v)
    # a page copied bitwise into a dense pool reads the same there
    pool = torch.full((7, *pages.shape[1:]), float("nan"), device=DEVICE)
    copy_pages(pages, torch.tensor([3, 0], dtype=torch.int32, device=DEVICE), pool,
               torch.tensor([6, 2], dtype=torch.int32, device=DEVICE))
    held = attention_view(pool, strides)
    assert torch.equal(held[6], view[3]) and torch.equal(held[2], view[0])


def test_blocks_apart_are_read_and_blocks_with_holes_refused():
    # blocks further apart than their size (another layer's block between them): read
    spaced = torch.randn((4, 2, HKV, P, 2 * D), device=DEVICE)[:, 0]
    pages, strides = block_pages(spaced)
    assert torch.equal(attention_view(pages, strides)[:, 1],
                       spaced.transpose(1, 2)[..., D:])
    # a block whose tokens are not one run (padding between heads): refused by name
    padded = torch.zeros((4, HKV, 2 * P, 2 * D), device=DEVICE)[:, :, :P]
    with pytest.raises(UnsupportedEngineError, match="dense pages"):
        block_pages(padded)


class Engine:
    """Two requests as vLLM's scheduler and model runner would present them: ``A`` decoding
    (one query, its pages 1 and 2 cold), ``B`` a prompt chunk (9 queries at its end, page 1
    cold); the batch lists B first. Blocks are shuffled; K/V random (keys of A's page 2 may be
    made to stand out)."""

    def __init__(self, layout: str, dtype: torch.dtype, gen: torch.Generator) -> None:
        self.dtype = dtype
        self.lens = {"B": 4 * P + 5, "A": 6 * P - 3}
        self.queries = {"B": 9, "A": 1}
        order = torch.randperm(16, generator=gen).tolist()
        self.blocks = {"B": order[:5], "A": order[5:11]}
        self.cold = {"A": {1: 4, 2: 0}, "B": {1: 2}}  # page -> host slot
        self.caches = {f"model.layers.{i}.attn": vllm_cache(16, layout, dtype)
                       for i in range(LAYERS)}
        self.kv = {}  # (layer, request) -> (K, V) [tokens, H, D] fp32
        for li, cache in enumerate(self.caches.values()):
            for r, n in self.lens.items():
                k, v = (torch.randn(n, HKV, D, generator=gen) for _ in range(2))
                self.kv[li, r] = (k, v)
                for t in range(n):
                    b = self.blocks[r][t // P]
                    cache[b, :, t % P] = torch.cat((k[t], v[t]), -1).to(dtype).to(DEVICE)
        self.q = [torch.randn(sum(self.queries.values()), HQ, D, generator=gen).to(dtype)
                  for _ in range(LAYERS)]
        rows = ["B", "A"]
        width = max(map(len, self.blocks.values()))
        table = torch.zeros((2, width), dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, :len(self.blocks[r])] = torch.tensor(self.blocks[r])
        qsl = [0, self.queries["B"], self.queries["B"] + 1]
        self.md = SimpleNamespace(block_table=table.to(DEVICE),
                                  seq_lens=torch.tensor([self.lens[r] for r in rows],
                                                        dtype=torch.int32, device=DEVICE),
                                  query_start_loc=torch.tensor(qsl, dtype=torch.int32,
                                                               device=DEVICE))
        self.impl = SimpleNamespace(scale=D ** -0.5, logits_soft_cap=0.0)

    def stores(self) -> list[tuple[int, int]]:
        return [(self.blocks[r][j], s) for r in ("A", "B") for j, s in self.cold[r].items()]

    def cold_map(self) -> dict[int, list[tuple[int, int]]]:
        return {self.blocks[r][0]: sorted(self.cold[r].items()) for r in ("A", "B")}

    def free_cold_blocks(self) -> None:
        """What vLLM does to a freed block: anything may be written there."""
        for cache in self.caches.values():
            for b, _ in self.stores():
                cache[b] = float("nan")

    def reference(self, layer: int, pages: dict[str, set[int]] | None = None) -> torch.Tensor:
        """``[T, H_q * D]`` attention of the layer's queries over every token of each row
        (``pages``: only these pages of a row), in fp32."""
        out = []
        q = self.q[layer].float()
        start = 0
        for r in ("B", "A"):
            k, v = self.kv[layer, r]
            n, nq = self.lens[r], self.queries[r]
            keep = torch.ones(n, dtype=torch.bool)
            if pages and r in pages:
                keep = torch.tensor([t // P in pages[r] for t in range(n)])
            k = k.to(self.dtype).float().repeat_interleave(HQ // HKV, 1)
            v = v.to(self.dtype).float().repeat_interleave(HQ // HKV, 1)
            qr = q[start:start + nq]  # [nq, HQ, D]
            s = torch.einsum("qhd,khd->hqk", qr, k) * D ** -0.5
            pos = torch.arange(n - nq, n).unsqueeze(1)
            mask = (torch.arange(n).unsqueeze(0) <= pos) & keep.unsqueeze(0)
            s = s.masked_fill(~mask, float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(nq, -1))
            start += nq
        return torch.cat(out)

    def run(self, worker: DeviceHotSetWorker, order: list[int] | None = None
            ) -> list[torch.Tensor]:
        """Step 1 copies the cold pages out (and vLLM frees their blocks); step 2 attends, the
        layers in ``order`` (default: the model's)."""
        worker.begin_step(self.stores(), {}, None)
        for name, cache in self.caches.items():
            worker.save(name, cache)
        worker.finish_step()
        worker.end_step()
        self.free_cold_blocks()
        worker.begin_step([], self.cold_map(), {name: self.md for name in self.caches})
        outs = {}
        names = list(self.caches)
        for li in order or range(LAYERS):
            assert worker.has_cold(self.md)
            out = torch.full((len(self.q[li]), HQ * D), float("nan"), dtype=self.dtype,
                             device=DEVICE)
            worker.attend(self.impl, SimpleNamespace(layer_name=names[li]),
                          self.q[li].to(DEVICE), self.caches[names[li]], out)
            outs[li] = out.float().cpu()
        worker.finish_step()
        worker.end_step()
        return [outs[li] for li in range(LAYERS)]


def worker_for(engine: Engine, tier: TierConfig) -> DeviceHotSetWorker:
    copies = FakeAsyncEngine(seed=1) if DEVICE.type == "cpu" else None
    return DeviceHotSetWorker(tier, SwapConfig(tiers=("ddr",)), engine.caches, 8,
                              fingerprint="test", engine=copies)


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_rows_attend_every_token_from_hot_blocks_and_staged_pages(layout, dtype, seed):
    engine = Engine(layout, dtype, torch.Generator().manual_seed(seed))
    worker = worker_for(engine, TierConfig.preset("offload", page_size=P))
    outs = engine.run(worker)
    for li, out in enumerate(outs):
        assert torch.isfinite(out).all(), "a freed block or an unlanded copy was read"
        torch.testing.assert_close(out, engine.reference(li), atol=TOL[dtype], rtol=TOL[dtype])
    if isinstance(worker.engine, FakeAsyncEngine):
        assert worker.engine.pending == 0  # every copy landed before its reader


@pytest.mark.parametrize("order", [[2, 0, 1], [0, 2, 1], [1, 1, 0, 2]])
def test_layers_out_of_the_models_order_are_staged_when_they_run(order, seed):
    # layer-ahead staging guesses the next layer; a wrong guess costs a copy, never a page
    engine = Engine("NHD", torch.float32, torch.Generator().manual_seed(seed))
    outs = engine.run(worker_for(engine, TierConfig.preset("offload", page_size=P)), order)
    for li in set(order):
        torch.testing.assert_close(outs[li], engine.reference(li), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_topk_rows_attend_the_page_their_query_points_at(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    engine = Engine(layout, torch.float32, gen)
    # layer 1: page 2 of A holds a key the decode query's head 1 points at
    q = engine.q[1]
    a_query = engine.queries["B"]
    k, v = engine.kv[1, "A"]
    k[2 * P + 3, 0] = 6 * q[a_query, 1]
    b = engine.blocks["A"][2]
    engine.caches["model.layers.1.attn"][b, 0, 3, :D] = k[2 * P + 3, 0]
    tier = TierConfig.preset("topk", page_size=P, recall_score="quest", recall_budget=P)
    outs = engine.run(worker_for(engine, tier))
    # A recalls one of its two cold pages (page 2 at layer 1); B, a prompt chunk, all of its
    torch.testing.assert_close(outs[1], engine.reference(1, {"A": {0, 2, 3, 4, 5}}),
                               atol=2e-5, rtol=2e-5)
    for li in (0, 2):
        # whichever page the layer chose, the row attends its hot pages and exactly one cold
        refs = [engine.reference(li, {"A": {0, c, 3, 4, 5}}) for c in (1, 2)]
        assert any(torch.allclose(outs[li], r, atol=2e-5, rtol=2e-5) for r in refs)


def test_a_row_without_cold_pages_and_an_idle_step_leave_vllm_in_charge(seed):
    engine = Engine("HND", torch.float32, torch.Generator().manual_seed(seed))
    worker = worker_for(engine, TierConfig.preset("offload", page_size=P))
    worker.begin_step([], {}, {name: engine.md for name in engine.caches})
    assert not worker.has_cold(engine.md)  # no cold page anywhere: vLLM's own kernel
    worker.finish_step()
    engine.cold = {"A": {1: 4, 2: 0}, "B": {}}
    outs = engine.run(worker)
    for li, out in enumerate(outs):
        torch.testing.assert_close(out, engine.reference(li), atol=2e-5, rtol=2e-5)


def test_topk_recalls_the_pages_a_pool_running_low_demoted():
    from tierattn.models.vllm.config import cold_end, recall_pages

    tier = TierConfig.preset("topk", page_size=32, hot_budget=0.25, recall_score="quest",
                             recall_budget=0.1, sink_pages=1, recent_pages=2)
    tokens = 1024 + 5  # 32 full pages and the page being written
    normal = cold_end(tier, tokens) - tier.sink_pages  # 32 - 8 recent - 1 sink = 23 cold
    budget = tier.recall_pages(33, tokens)
    assert recall_pages(tier, normal, tokens) == budget
    assert recall_pages(tier, normal - 3, tokens) == budget  # copies not made yet
    tight = cold_end(tier, tokens, tight=True) - tier.sink_pages  # the floor: 29 cold
    assert recall_pages(tier, tight, tokens) == budget + (tight - normal)  # as many attended
    assert recall_pages(tier, 2, 96) == 2  # never more than the row's cold pages
