"""Scale-out: transformers' own tensor parallelism (2 ranks under torchrun, gloo on CPU) with
tierattn serving each rank's share of the heads, and a model spread over devices
(``device_map``) with each device's layers in their own pools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import torch.distributed as dist  # noqa: E402
from test_hf import exact_config, generate, tiny  # noqa: E402

import tierattn  # noqa: E402
from tierattn.errors import UnsupportedModelError  # noqa: E402
from tierattn.models import TieredCache  # noqa: E402

WORKER = Path(__file__).with_name("tp_worker.py")
FAMILIES = ("llama", "qwen3")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_rank_tensor_parallel_is_token_identical_to_one_process(tmp_path, figures):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", str(WORKER), str(tmp_path), ",".join(FAMILIES)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, result in enumerate(ranks):
        for family in FAMILIES:
            row = result["families"][family]
            assert row["tp_size"] == 2
            for tier in ("ddr", "disk"):
                got = row[tier]
                assert got["identical"], (r, family, tier)
                assert got["kv_heads"] == 1  # this rank's share of 2 KV heads
                assert got["fingerprint"] == f"{family}-tp{r}of2"
                assert got["ranks_in_stats"] == 2 and got["all_ranks_attend_calls"] > 0
                assert got["h2d_bytes"].get("ddr", 0) + got["h2d_bytes"].get("disk", 0) > 0
            assert row["disk"]["h2d_bytes"]["disk"] > 0  # pages came back from the disk tier
            split = row["split"]  # split attention: each rank's cold pages on its own host
            assert split["identical"] and split["kv_heads"] == 1 and split["split_steps"] > 0
            assert set(split["h2d_bytes"]) == {"partial"}
            assert row["round_trip_equal"]
            assert row["other_rank_file"].startswith("refused")
            figures.count(f"tensor-parallel ranks token-identical to one process ({family})")


def test_uneven_head_split_is_refused():
    model = tiny("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    model._tp_size = 2  # as transformers records a sharded model
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads=3 does not split "
                                                    "evenly over tp_size=2"):
        tierattn.patch(model, exact_config())


def test_layers_on_two_devices_get_pools_on_each(figures):
    """A device map with two devices (here two names of the CPU, so it runs anywhere): one
    runtime per device holds its layers; the output is the reference's."""
    model = tiny("llama")
    ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    ref = generate(model, ids, attention_mask=mask)
    cache = TieredCache(model.config, exact_config(), layer_devices=["cpu", "cpu:0"])
    with tierattn.patch(model, exact_config()):
        out = generate(model, ids, attention_mask=mask, past_key_values=cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert [rt.num_layers for rt in cache.runtimes] == [1, 1]
    assert [str(rt.device) for rt in cache.runtimes] == ["cpu", "cpu:0"]
    stats = cache.stats()
    assert len(stats["layers"]) == 2 and stats["total"]["demoted_pages"] > 0
    figures.count("device-map runtimes token-identical (2 devices)")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_device_map_on_two_gpus_keeps_each_layers_pools_on_its_device():
    model = tiny("llama").to("cuda:0")
    model.model.layers[1].to("cuda:1")
    ids = torch.randint(3, 128, (1, 21), generator=torch.Generator().manual_seed(3)).cuda()
    with tierattn.patch(model, exact_config()) as handle:
        generate(model, ids)
    devices = [str(rt.device) for rt in handle.cache.runtimes]
    assert devices == ["cuda:0", "cuda:1"]


def test_cxl_numa_node_per_local_rank(monkeypatch):
    from tierattn.config import TierSpec
    from tierattn.errors import TierConfigError

    spec = TierSpec("cxl", numa_node=(0, 1))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert spec.node() == 1
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(TierConfigError, match="one node per local rank"):
        spec.node()
    for bad in ((), (0, -1), (0, 1.5), "0"):
        with pytest.raises(TierConfigError, match="numa_node"):
            TierSpec("cxl", numa_node=bad)
    assert TierSpec("cxl", numa_node=3).node() == 3
