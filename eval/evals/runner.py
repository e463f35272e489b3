"""One decoding loop for every method: prefill, optional oracle eviction, then greedy or
teacher-forced decoding, returning tokens, per-step log-probabilities and the cache's telemetry.

The loop is written out (rather than ``generate``) so that the full-cache reference and every
tiered method see identical inputs, teacher forcing is possible, and the oracle can drop pages
between prefill and the first decode step. Prompts of different lengths are left-padded with
position ids that skip the padding, as ``generate`` does.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field

import torch

from tierattn.config import TierConfig

__all__ = ["Decoded", "decode", "oracle_evict"]


@dataclass
class Decoded:
    """Output of :func:`decode` for ``B`` sequences and ``S`` decode steps.

    Attributes:
        tokens: ``[B, S]`` the token fed after each step (greedy choice or the forced token).
        logprobs: ``[B, S, V]`` float32 log-softmax of the logits that chose ``tokens[:, s]``.
        stats: the tiered cache's telemetry (``{}`` for the full reference).
        prompt_tokens: ``[B]`` unpadded prompt lengths.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    stats: dict = field(default_factory=dict)
    prompt_tokens: list[int] = field(default_factory=list)


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def decode(model, prompts: list[list[int]], config: TierConfig | None, *, steps: int,
           forced: list[list[int]] | None = None, eos_id: int | None = None, pad_id: int = 0,
           keep: list[list[tuple[int, int]]] | None = None, keep_fraction: float = 1.0,
           seed: int = 0) -> Decoded:
    """Prefill ``prompts`` and decode ``steps`` tokens with ``config``'s tiered cache.

    Args:
        model: a causal LM; patched with ``tierattn.patch`` for the call when ``config`` is set,
            its own attention and ``DynamicCache`` otherwise.
        prompts: token ids per sequence (left-padded into one batch).
        config: the tiered cache's config, or None for the full-cache reference.
        steps: tokens to decode (greedy stops early once every sequence emitted ``eos_id``).
        forced: teacher forcing: the tokens to feed per sequence (shorter lists are padded with
            ``eos_id``/``pad_id``; their extra steps are meaningless and should be masked).
        keep: oracle: per sequence, prompt spans ``(start, end)`` whose pages must survive the
            eviction done right after prefill (see :func:`oracle_evict`).
        keep_fraction: oracle: fraction of each prompt's tokens kept.

    Returns:
        :class:`Decoded`.
    """
    from tierattn.models.hf.cache import TieredCache
    from tierattn.models.hf.patch import patch

    ids, mask = _left_pad(prompts, pad_id)
    batch, width = ids.shape
    fill = eos_id if eos_id is not None else pad_id
    if forced is not None:
        steps = max(len(f) for f in forced)
        forced_t = torch.full((batch, steps), fill, dtype=torch.long)
        for i, f in enumerate(forced):
            forced_t[i, :len(f)] = torch.tensor(f, dtype=torch.long)
    handle = patch(model, config) if config is not None else None
    try:
        cache = TieredCache(model.config, config) if config is not None else None
        # transformers renamed `past_key_values` to `cache` during 5.x
        params = inspect.signature(model.forward).parameters
        arg = "cache" if "cache" in params else "past_key_values"
        # only the last position's logits: all of them are B x T x V floats (8 GB for 20
        # prompts of 2K tokens and a 49K vocabulary) and an lm_head matmul as large
        last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                    **{arg: cache}, **last_only)
        cache = getattr(out, arg)
        if keep is not None:
            oracle_evict(cache, [width - len(p) for p in prompts], [len(p) for p in prompts],
                         keep, keep_fraction, seed)
        tokens, logprobs = [], []
        logits, done = out.logits[:, -1].clone(), torch.zeros(batch, dtype=torch.bool)
        del out  # the prefill's activations and logits
        for s in range(steps):
            logprobs.append(torch.log_softmax(logits.float(), dim=-1))
            nxt = forced_t[:, s] if forced is not None else logits.argmax(-1)
            tokens.append(nxt)
            if eos_id is not None and forced is None:
                done |= nxt == eos_id
                if bool(done.all()):
                    break
            if s == steps - 1:
                break
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                        use_cache=True, **{arg: cache})
            logits = out.logits[:, -1]
        stats = cache.stats() if config is not None else {}
    finally:
        if handle is not None:
            handle.undo()
    return Decoded(torch.stack(tokens, 1), torch.stack(logprobs, 1), stats,
                   [len(p) for p in prompts])


def oracle_evict(cache, pad: list[int], lengths: list[int], keep: list[list[tuple[int, int]]],
                 fraction: float, seed: int) -> None:
    """Drop prompt pages so that each sequence keeps at most ``fraction`` of its prompt (whole
    pages, rounded down): the sink page, the recent window and the page being filled, then the
    pages overlapping ``keep`` spans in order while the budget lasts, then random others up to
    the budget.

    Every layer drops the same pages (the oracle knows the task, not the layer). The random
    pages depend only on ``seed`` and the item, not on the batch it is decoded in.
    """
    rt = cache.runtime
    cfg, ps = rt.config, rt.page_size
    for b, (p, n) in enumerate(zip(pad, lengths)):
        rng = random.Random(f"{seed}:{n}:{keep[b]}")
        first, last = p // ps, (p + n - 1) // ps
        pages = list(range(first, last + 1))
        budget = int(round(fraction * n)) // ps
        kept = set(pages[:cfg.sink_pages]) | set(pages[max(0, len(pages) - cfg.recent_pages - 1):])
        for s, e in keep[b]:
            for pg in range((p + s) // ps, (p + e - 1) // ps + 1):
                if len(kept) < budget:
                    kept.add(pg)
        others = [pg for pg in pages if pg not in kept]
        rng.shuffle(others)
        kept |= set(others[:max(0, budget - len(kept))])
        drop = [pg for pg in pages if pg not in kept]
        if drop:
            for layer in range(rt.num_layers):
                rt.evict(layer, b, drop)
