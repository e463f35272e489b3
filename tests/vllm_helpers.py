"""Helpers of tests/test_vllm.py: tiny random models saved for vLLM, an in-process engine run
(rounds of the same greedy prompts, a metrics snapshot after each), and the disk-tier faults.

Imported only after ``pytest.importorskip("vllm")``; vLLM itself is imported inside the
functions, so the engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the test
module before vLLM is imported).
"""

from __future__ import annotations

import gc
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: the model geometry: 2 layers x 2 KV heads x head_dim 32 in fp32 -> 128 KiB per vLLM block
#: (128 tokens on CPU), so :data:`TIGHT_KV_BYTES` is a KV cache of 7 blocks
GEOMETRY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=2048, tie_word_embeddings=False)
BLOCK_TOKENS = 128
BLOCK_BYTES = 2 * 2 * 2 * BLOCK_TOKENS * 32 * 4  # layers x (K, V) x heads x tokens x D x fp32
#: seven blocks: four requests of up to 285 tokens (three blocks each) preempt one another
TIGHT_KV_BYTES = 7 * BLOCK_BYTES
#: four prompts of 200..221 random token ids, 64 greedy tokens each
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(GEOMETRY["vocab_size"]) for _ in range(200 + 7 * i)] for i in range(4)]
NEW_TOKENS = 64


def save_tiny_models(root: Path) -> dict[str, str]:
    """Random llama and qwen3 checkpoints (fixed seed) under ``root``: family -> folder."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out = {}
    for family, config_cls, model_cls in (("llama", LlamaConfig, LlamaForCausalLM),
                                          ("qwen3", Qwen3Config, Qwen3ForCausalLM)):
        torch.manual_seed(0)
        model = model_cls(config_cls(**GEOMETRY)).to(torch.float32)
        model.save_pretrained(root / family)
        out[family] = str(root / family)
    return out


def snapshot(metrics) -> dict[tuple[str, str | None], float]:
    """``llm.get_metrics()`` as ``{(name, tier label or None): value}`` (counters and gauges;
    values of the same name and tier summed over the other labels)."""
    out: dict[tuple[str, str | None], float] = {}
    for m in metrics:
        value = getattr(m, "value", None)
        if not isinstance(value, (int, float)):
            continue
        key = (m.name, m.labels.get("tier"))
        out[key] = out.get(key, 0) + value
    return out


@dataclass
class Run:
    """What an engine did: per round the tokens and ``num_cached_tokens`` of each request, and
    the metrics after it (``metrics[0]``: right after the engine was built)."""

    name: str
    tokens: list[list[list[int]]] = field(default_factory=list)
    cached: list[list[int]] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    notes: dict = field(default_factory=dict)

    def value(self, name: str, tier: str | None = None, *, after: int | None = None) -> float:
        """Metric ``vllm:<name>`` (of ``tier``) after round ``after`` (default: the last); 0
        when vLLM never reported it."""
        snap = self.metrics[len(self.metrics) - 1 if after is None else after + 1]
        return snap.get(("vllm:" + name, tier), 0)

    def delta(self, name: str, tier: str | None = None, *, round: int) -> float:
        """How much metric ``vllm:<name>`` (of ``tier``) grew during round ``round``."""
        return self.value(name, tier, after=round) - self.value(name, tier, after=round - 1)


def run_engine(name: str, model: str, kv_transfer_config: dict | None = None, *, rounds: int = 2,
               between: Callable[[int, Run], None] | None = None,
               before: Callable[[], None] | None = None) -> Run:
    """Build ``vllm.LLM`` on ``model`` with a 7-block KV cache (preemptions), call
    ``before()`` once it is built, generate :data:`PROMPTS` greedily ``rounds`` times
    (``between(r, run)`` after round ``r`` but the last), and shut the engine down before
    returning what it did."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=model, dtype="float32", max_model_len=512, enforce_eager=True,
                  skip_tokenizer_init=True, kv_cache_memory_bytes=TIGHT_KV_BYTES,
                  disable_log_stats=False, seed=0)
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    llm = LLM(**kwargs)
    run = Run(name)
    try:
        run.metrics.append(snapshot(llm.get_metrics()))
        if before is not None:
            before()
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        for r in range(rounds):
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                                use_tqdm=False)
            run.tokens.append([list(o.outputs[0].token_ids) for o in outs])
            run.cached.append([o.num_cached_tokens or 0 for o in outs])
            run.metrics.append(snapshot(llm.get_metrics()))
            if between is not None and r + 1 < rounds:
                between(r, run)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return run


def disk_files(path: str | Path) -> list[Path]:
    """The disk tiers' segment files under ``path`` (every engine's subfolder)."""
    return sorted(Path(path).rglob("*.kvseg"))


def disk_pages(path: str | Path) -> int:
    """Pages written into the segment files under ``path`` (slots holding any nonzero byte)."""
    return len(_written_slots(path))


def _written_slots(path: str | Path) -> list[tuple[Path, int]]:
    from tierattn.storage.segment import ALIGN, MAGIC
    out = []
    for f in disk_files(path):
        data = f.read_bytes()
        size = json.loads(data[len(MAGIC):ALIGN].rstrip(b"\0"))["slot_bytes"]
        out += [(f, o) for o in range(ALIGN, len(data), size) if any(data[o:o + size])]
    return out


def corrupt_files(path: str | Path) -> int:
    """Flip the first byte of every written page of the segment files under ``path`` (its
    checksum no longer matches). Returns the number of pages."""
    slots = _written_slots(path)
    for f, offset in slots:
        with open(f, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([byte[0] ^ 0xFF]))
    return len(slots)


def delete_files(path: str | Path) -> int:
    """Delete every segment file under ``path``. Returns the number of pages they held."""
    n = disk_pages(path)
    for f in disk_files(path):
        f.unlink()
    return n
