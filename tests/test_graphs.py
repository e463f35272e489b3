"""Decode steps replayed from captured graphs equal eager decode steps.

On a CPU the graphs' ``eager`` stand-in re-runs the captured step instead of replaying a CUDA
graph: the same static inputs, graph keys (a new one captures again), fixed staging buffers,
copies on the compute stream and counters advanced per replay. The CUDA capture itself is
checked by the GPU check (replay token-identical to eager, under sync-debug mode "error").
"""

from __future__ import annotations

import pytest
import torch
from helpers import Shadow, run_loop

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import TierConfig, TierSpec
from tierattn.errors import TierConfigError

L, HKV, HQ, D = 3, 2, 4, 16

CONFIGS = {
    "dense": dict(hot_budget=1.0, tiers=(TierSpec("hbm"),)),
    "offload": dict(hot_budget=0.3),
    "offload-ddr+cxl": dict(hot_budget=0.25, tiers=(TierSpec("hbm"),
                                                    TierSpec("ddr", capacity_pages=6),
                                                    TierSpec("cxl"))),
    "topk": dict(hot_budget=0.25, attend="topk", recall_budget=8),
    "evict-h2o": dict(hot_budget=0.5, evict_budget=0.5, tiers=(TierSpec("hbm"),)),
}


def _run(cfg: TierConfig, graphs: bool, seed: int, pad: list[int] | None):
    # graph mode has no layer-ahead prefetch (each graph copies its own cold pages): the eager
    # reference fetches synchronously too, so the counts compare like with like
    cfg = cfg.replace(cuda_graphs=graphs, prefetch="none")
    cache = TieredKVCache(cfg, num_layers=L, num_kv_heads=HKV, head_dim=D, batch_size=3,
                          device="cpu", graph_backend="eager" if graphs else None)
    if pad:
        cache.set_padding(pad)
    outs = []
    run_loop(cache, Shadow(L, 3, HKV, D, torch.float32), prompt=30, steps=40, hq=HQ,
             gen=torch.Generator().manual_seed(seed), chunk=16,
             check=lambda layer, out, q: outs.append(out.clone()) or 0.0)
    return cache, outs


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("pad", [None, [0, 3, 9]], ids=["unpadded", "padded"])
def test_replayed_steps_equal_eager_steps(name, pad, seed):
    cfg = TierConfig(page_size=4, max_context=160, prefill_chunk_size=16, backend="torch",
                     sink_pages=1, recent_pages=1, **CONFIGS[name])
    eager, want = _run(cfg, False, seed, pad)
    graphed, got = _run(cfg, True, seed, pad)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), f"output {i} differs"
    assert graphed.graphs.replays > 30 * L  # most steps were replays
    # a captured step counts what it launches and moves, per replay
    te, tg = eager.stats()["total"], graphed.stats()["total"]
    for key in ("kernel_launches", "copy_launches", "h2d_bytes_total", "d2h_bytes_total",
                "demoted_pages", "evicted_tokens", "decode_steps"):
        assert tg[key] == te[key], key
    for layer in range(L):
        for b in range(3):
            pe, kve = eager.gather(layer, b)
            pg, kvg = graphed.gather(layer, b)
            assert torch.equal(pe, pg) and torch.equal(kve, kvg)


def test_cuda_graphs_need_a_cuda_device():
    cfg = TierConfig(cuda_graphs=True, backend="torch")
    with pytest.raises(TierConfigError, match="^cuda_graphs: .*CUDA device"):
        TieredKVCache(cfg, num_layers=1, num_kv_heads=1, head_dim=8, device="cpu")
    with pytest.raises(TierConfigError, match="^cuda_graphs"):
        TierConfig(cuda_graphs="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["dense", "offload", "topk"])
def test_cuda_graph_replay_equals_eager_without_a_sync(name):
    """On a GPU: the captured steps replay what eager steps compute (bitwise: the same
    kernels on the same inputs), and whole decode steps -- every layer's update and attend --
    run under ``torch.cuda.set_sync_debug_mode("error")``."""
    cfg = TierConfig(page_size=16, max_context=1024, prefill_chunk_size=256, backend="auto",
                     **CONFIGS[name]).replace(prefetch="none")
    outs = {}
    for graphs in (False, True):
        cache = TieredKVCache(cfg.replace(cuda_graphs=graphs), num_layers=L, num_kv_heads=HKV,
                              head_dim=64, batch_size=2, dtype=torch.bfloat16, device="cuda")
        gen = torch.Generator().manual_seed(0)
        rand = lambda *s, g=gen: torch.randn(*s, generator=g).to("cuda", torch.bfloat16)
        got = []
        for step, t in enumerate([300] + [1] * 40):
            kvs = [rand(2, HKV, t, 64) for _ in range(2 * L)]
            qs = [rand(2, HQ, t, 64) for _ in range(L)]
            mode = "error" if graphs and step > 3 else "default"
            torch.cuda.set_sync_debug_mode(mode)
            try:
                for layer in range(L):
                    cache.update(layer, kvs[2 * layer], kvs[2 * layer + 1])
                    got.append(cache.attend(layer, qs[layer]).clone())
            finally:
                torch.cuda.set_sync_debug_mode("default")
        outs[graphs] = got
        if graphs:
            assert cache.graphs.replays > 30
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)
