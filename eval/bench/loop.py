"""A multi-layer decode loop over random KV (no model weights): drives the tiered runtime in any
preset and reports its telemetry. ``tierattn loop --help`` lists the knobs."""

from __future__ import annotations

import json
import time

import torch
from tqdm import tqdm

from tierattn.runtime.cache import TieredKVCache
from tierattn.config import TierConfig
from tierattn.eval.report import save_json

__all__ = ["format_stats", "run_loop"]


def run_loop(*, preset: str = "offload", num_layers: int = 32, num_q_heads: int = 32,
             num_kv_heads: int = 8, head_dim: int = 128, batch_size: int = 1,
             prompt: int = 1024, steps: int = 16, page_size: int = 16,
             dtype: torch.dtype = torch.bfloat16, device: str | None = None,
             progress: bool = True, **overrides) -> dict:
    """Prefill ``prompt`` random tokens (in chunks) and decode ``steps`` more on every layer.

    Returns ``{"config": ..., "stats": cache.stats(), "wall_s": ...}``.
    """
    chunk = min(512, prompt) if prompt else 1
    cfg = TierConfig.preset(preset, page_size=page_size, max_context=prompt + steps,
                            prefill_chunk_size=chunk, **overrides)
    cache = TieredKVCache(cfg, num_layers=num_layers, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, batch_size=batch_size, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(cfg.seed)
    sizes = [min(chunk, prompt - i) for i in range(0, prompt, chunk)] + [1] * steps
    t0 = time.perf_counter()
    for t in tqdm(sizes, desc=f"{preset}: prefill + decode", unit="step", disable=not progress):
        for layer in range(num_layers):
            k = torch.randn(batch_size, num_kv_heads, t, head_dim, generator=gen).to(dtype)
            v = torch.randn(batch_size, num_kv_heads, t, head_dim, generator=gen).to(dtype)
            q = torch.randn(batch_size, num_q_heads, t, head_dim, generator=gen).to(dtype)
            cache.update(layer, k.to(cache.device), v.to(cache.device))
            cache.attend(layer, q.to(cache.device))
    wall = time.perf_counter() - t0
    return {
        "config": {"preset": preset, "layers": num_layers, "heads": f"{num_q_heads}/{num_kv_heads}",
                   "head_dim": head_dim, "batch": batch_size, "prompt": prompt, "steps": steps,
                   "page_size": page_size, "dtype": str(dtype).removeprefix("torch."),
                   "hot_budget": cfg.hot_budget, "evict_budget": cfg.evict_budget,
                   "attend": cfg.attend, "tiers": [t.kind for t in cfg.tiers],
                   "device": str(cache.device), "backend": cfg.backend},
        "stats": cache.stats(),
        "wall_s": wall,
    }


def format_stats(result: dict) -> str:
    c, total = result["config"], result["stats"]["total"]
    mib = 1 / 2**20
    lines = [
        f"{c['preset']}: {c['layers']} layers, heads {c['heads']}, d={c['head_dim']}, "
        f"batch {c['batch']}, {c['prompt']} prompt + {c['steps']} decoded tokens, page "
        f"{c['page_size']}, {c['dtype']}, hot_budget {c['hot_budget']}, evict_budget "
        f"{c['evict_budget']}, attend={c['attend']}, tiers {c['tiers']}, {c['device']}",
        f"  resident fraction     {json.dumps({k: round(v, 3) for k, v in total['resident_fraction'].items()})}",  # noqa: E501
        f"  H2D                   {total['h2d_bytes_total'] * mib:.2f} MiB "
        f"{json.dumps(total['h2d_bytes'])}",
        f"  D2H                   {total['d2h_bytes_total'] * mib:.2f} MiB "
        f"{json.dumps(total['d2h_bytes'])}",
        f"  copy launches         {total['copy_launches']} "
        f"({total.get('copy_launches_per_layer_per_step', 0):.2f} per layer per step)",
        f"  kernel launches       {total['kernel_launches']}",
        f"  prefetch hit rate     {total['prefetch_hit_rate']}  (hits {total['prefetch_hits']}, "
        f"late misses {total['late_misses']}, wasted {total['wasted_prefetches']})",
        f"  demoted pages         {total['demoted_pages']}",
        f"  evicted tokens        {total['evicted_tokens']}",
        f"  host time             {total['host_time_s']:.2f} s over {total['attend_calls']} "
        f"attend calls; wall {result['wall_s']:.2f} s (CPU wall time, not a GPU figure)",
    ]
    return "\n".join(lines)


def main(out: str | None = None, **kwargs) -> dict:
    result = run_loop(**kwargs)
    print(format_stats(result))
    save_json(result, out)
    return result
