"""Autotuning: config spaces through the real launchers, bucketed keys, the JSON table and its
lookup modes, the sweep's check-then-time logic (fake timer), and the no-GPU error."""

from __future__ import annotations

import json

import pytest
import torch

from tierattn.errors import KernelInputError, KernelUnsupportedError, TierConfigError
from tierattn.kernels import autotune as at
from tierattn.kernels import tuning as tn
from tierattn.kernels._common import default_tiles
from tierattn.kernels.decode import sparse_decode
from tierattn.kernels.page_copy import copy_pages

#: tiny problems (interpreter-sized) per kernel; odd lengths, a partly filled last page.
TINY = {
    "decode": dict(batch=2, ctx=37, hq=4, hkv=2, d=16, page_size=8),
    "score": dict(batch=2, ctx=72, hq=4, hkv=2, d=16, page_size=8),
    "prefill": dict(batch=2, q_len=19, ctx=37, hq=4, hkv=2, d=16, page_size=8),
    "copy": dict(pages=5, page_size=4, hkv=2, d=16),
}
#: the parameters that change what the interpreter computes (it ignores warps and stages).
TILES = {"decode": ("block_n",), "score": ("block_e",), "prefill": ("block_m", "block_n"),
         "copy": ("block_bytes", "programs_per_sm")}
LLAMA_DECODE = dict(d=128, group=4, page_size=16, dtype=torch.bfloat16, ctx=32765, rows=64)


@pytest.fixture(autouse=True)
def _fresh_tables(monkeypatch):
    monkeypatch.delenv(tn.ENV_VAR, raising=False)
    tn.clear_cache()
    yield
    tn.clear_cache()


def _entry(config, us=10.0):
    return {"config": config, "us": us, "default_us": 2 * us, "checked": True}


def _table(entries, gpu="Fake GPU"):
    return {"gpu": gpu, "torch": "2.11", "triton": "3.6", "created": "2025-01-01T00:00:00+00:00",
            "entries": entries}


def test_config_spaces_are_declared_valid_and_pruned():
    for kernel in tn.KERNELS:
        space = tn.config_space(kernel)
        assert space and all(tn.check_config(kernel, c) == c for c in space)
        assert len(space) == len({json.dumps(c, sort_keys=True) for c in space})
    # pruning for a problem's sizes: tiles below the padded page, oversized tiles, dead blocks
    assert {c["block_n"] for c in tn.config_space("decode", page_size=64)} == {64, 128}
    assert {c["block_n"] for c in tn.config_space("decode", d=256)} == {16, 32, 64}
    assert all(c["block_m"] * c["block_n"] <= 64 * 64 for c in tn.config_space("prefill", d=256))
    assert {c["block_bytes"] for c in tn.config_space("copy", page_bytes=3000)} == {2048, 4096}
    with pytest.raises(KernelInputError, match="unknown"):
        tn.config_space("decode", head_dim=128)
    with pytest.raises(KernelInputError, match="kernel='attention'"):
        tn.config_space("attention")


@pytest.mark.parametrize("kernel", tn.KERNELS)
def test_configs_run_through_the_launchers(kernel, device, seed):
    """The default and a spread of the space's tile shapes pass the sweep's own check."""
    prob = at.make_problem(kernel, TINY[kernel], device, seed=seed)
    assert prob.default == tn.check_config(kernel, prob.default)
    by_tile = {}
    for c in tn.config_space(kernel, **prob.sizes):
        by_tile.setdefault(tuple(c[p] for p in TILES[kernel]), c)
    tiles = list(by_tile.values())
    picks = [prob.default] + tiles[:: max(1, len(tiles) // 3)][:4]
    for cfg in picks:
        if prob.reset is not None:
            prob.reset()
        assert prob.check(prob.run(cfg, True)) is None, cfg


def test_check_rejects_wrong_results_and_restores_in_place_state(device):
    prob = at.make_problem("decode", TINY["decode"], device)
    res = prob.run(prob.default, True)
    res.out[0, 0, 0] += 0.5
    assert prob.check(res).startswith("out:")
    # copy writes in place: after a correct run, a config that copies nothing must still fail,
    # which it does only because each checked run starts from the re-poisoned dst
    prob = at.make_problem("copy", TINY["copy"], device)
    assert prob.check(prob.run(prob.default, True)) is None
    prob.reset()
    assert "bitwise" in prob.check(None)


def test_bucket_keys_are_stable_and_monotone():
    assert tn.bucket_key("decode", **LLAMA_DECODE) == \
        "d=128,g=4,ps=16,dtype=bf16,ctx<=32768,rows<=64"
    assert tn.bucket_key("decode", **{**LLAMA_DECODE, "dtype": "bf16"}) == \
        tn.bucket_key("decode", **LLAMA_DECODE)
    assert tn.bucket_key("score", d=128, group=4, dtype=torch.bfloat16, entries=256, rows=8) == \
        "d=128,g=4,dtype=bf16,entries<=512,rows<=8"
    assert tn.bucket_key("prefill", d=128, group=4, page_size=16, dtype=torch.float16,
                         q_len=2048) == "d=128,g=4,ps=16,dtype=fp16,qlen<=4096"
    assert tn.bucket_key("copy", page_bytes=65536, path="h2d", pages=9000) == \
        "bytes=65536,path=h2d,pages>4096"
    # bucket edges only grow with the size, and a key changes only at an edge
    order = []
    for ctx in range(1, 400_000, 997):
        key = tn.bucket_key("decode", **{**LLAMA_DECODE, "ctx": ctx})
        if not order or order[-1] != key:
            order.append(key)
    assert [k.split(",")[4] for k in order] == [
        "ctx<=512", "ctx<=4096", "ctx<=32768", "ctx<=262144", "ctx>262144"]
    with pytest.raises(KernelInputError, match="missing"):
        tn.bucket_key("decode", d=128)


def test_table_round_trip_and_merge(tmp_path):
    path = tmp_path / "nested" / "fake-gpu.json"
    first = _table({"decode": {"k1": _entry({"block_n": 32, "num_warps": 4}),
                               "k2": _entry({"block_n": 16})}})
    at.save_tuned(path, first)
    assert tn.load_tuned(path) == first
    second = _table({"decode": {"k2": _entry({"block_n": 64, "num_stages": 2})},
                     "copy": {"k3": _entry({"block_bytes": 4096, "programs_per_sm": 2})}})
    merged = at.save_tuned(path, second)
    assert tn.load_tuned(path) == merged
    assert merged["entries"]["decode"]["k1"]["config"] == {"block_n": 32, "num_warps": 4}
    assert merged["entries"]["decode"]["k2"]["config"] == {"block_n": 64, "num_stages": 2}
    assert set(merged["entries"]) == {"decode", "copy"}
    with pytest.raises(TierConfigError, match="Other GPU"):
        at.save_tuned(path, _table({}, gpu="Other GPU"))


@pytest.mark.parametrize("text, match", [
    ("{not json", "cannot be read as JSON"),
    ("[]", "top level must be an object"),
    (json.dumps({"entries": {}}), "missing field 'gpu'"),
    (json.dumps(_table({"attention": {}})), "unknown kernel 'attention'"),
    (json.dumps(_table({"decode": {"k": _entry({"block_q": 16})}})), "unknown parameter"),
    (json.dumps(_table({"decode": {"k": _entry({"block_n": 48})}})), "power of two"),
    (json.dumps(_table({"decode": {"k": {**_entry({}), "checked": False}}})), "not checked"),
    (json.dumps(_table({"decode": {"k": {"config": {}, "us": 1.0}}})), "lacks"),
    (json.dumps(_table({"decode": {"k": {**_entry({}), "note": "x"}}})), "unknown field 'note'"),
], ids=["not-json", "list", "no-gpu", "kernel", "param", "pow2", "unchecked", "lacks", "field"])
def test_malformed_tables_raise_naming_the_file(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(TierConfigError, match=match) as e:
        tn.load_tuned(path)
    assert str(path) in str(e.value)


def test_env_selects_the_lookup_mode(tmp_path, monkeypatch):
    key = tn.bucket_key("decode", **LLAMA_DECODE)
    table = tmp_path / "mine.json"
    at.save_tuned(table, _table({"decode": {key: _entry({"block_n": 32, "num_stages": 2})}}))
    fake = dict(gpu_name="Fake GPU")
    assert tn.tuned_config("decode", key, **fake) is None  # no packaged table for this GPU
    monkeypatch.setattr(tn, "TUNED_DIR", tmp_path)
    (tmp_path / "fake-gpu.json").write_text(table.read_text())
    tn.clear_cache()  # tables are read once per process
    assert tn.tuned_config("decode", key, **fake) == {"block_n": 32, "num_stages": 2}
    assert tn.tuned_config("decode", "d=64,other", **fake) is None
    assert tn.tuned_config("decode", key, "cpu") is None  # no lookup off CUDA
    monkeypatch.setenv(tn.ENV_VAR, "off")
    assert tn.tuned_config("decode", key, **fake) is None
    monkeypatch.setattr(tn, "TUNED_DIR", tmp_path / "none")
    monkeypatch.setenv(tn.ENV_VAR, str(table))
    assert tn.tuned_config("decode", key, gpu_name="Any GPU") == {"block_n": 32, "num_stages": 2}
    for bad in ("on", "1", str(tmp_path / "missing.json")):
        monkeypatch.setenv(tn.ENV_VAR, bad)
        with pytest.raises(TierConfigError, match=tn.ENV_VAR):
            tn.tuned_config("decode", key, **fake)
    (tmp_path / "broken.json").write_text("{}")
    monkeypatch.setenv(tn.ENV_VAR, str(tmp_path / "broken.json"))
    with pytest.raises(TierConfigError, match="broken.json"):
        tn.tuned_config("decode", key, **fake)


def test_explicit_args_beat_tuned_entries(tmp_path, monkeypatch):
    defaults = {"block_n": 64, "num_warps": 4}
    tuned = {"block_n": 32, "num_stages": 2}
    assert tn.merge_config(defaults, None, {"block_n": None}) == defaults
    assert tn.merge_config(defaults, tuned, {"block_n": None}) == {**defaults, **tuned}
    # an explicit value wins and the tuned whole is dropped (never mixed with a caller's tiles)
    assert tn.merge_config(defaults, tuned, {"block_n": 16}) == {"block_n": 16, "num_warps": 4}
    # resolve_config on a (pretend) compiled CUDA launch reads the table only without explicits
    key = tn.bucket_key("decode", **LLAMA_DECODE)
    path = tmp_path / "t.json"
    at.save_tuned(path, _table({"decode": {key: _entry(tuned)}}))
    monkeypatch.setenv(tn.ENV_VAR, str(path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cuda = torch.device("cuda", 0)
    assert tn.resolve_config("decode", cuda, defaults, {"block_n": None}, LLAMA_DECODE) == \
        {**defaults, **tuned}
    assert tn.resolve_config("decode", cuda, defaults, {"num_warps": 8}, LLAMA_DECODE) == \
        {"block_n": 64, "num_warps": 8}
    cpu = torch.device("cpu")
    assert tn.resolve_config("decode", cpu, defaults, {"block_n": None}, LLAMA_DECODE) == defaults
    # untuned defaults are today's launch parameters
    from tierattn.kernels import decode, page_copy, prefill, score
    assert decode._default_config(128) == dict(zip(("block_n", "num_warps"), default_tiles(128)))
    assert prefill._default_config(256) == {"block_m": 64, "block_n": 32, "num_warps": 8}
    assert score._default_config(4, 128) == {"block_e": 16}
    assert page_copy._default_config() == {"block_bytes": 8192, "programs_per_sm": 4}


def test_launchers_validate_config(device):
    from tierattn.kernels.page_table import PageTable
    q = torch.randn(1, 4, 16, device=device)
    pool = torch.randn(3, 2, 8, 2, 16, device=device)
    ids = lambda *v: torch.tensor(v, dtype=torch.int32, device=device)
    pt = PageTable.from_csr(ids(0, 1), ids(1), ids(8))
    for bad, match in (({"block_q": 16}, "unknown parameter"), ({"block_n": 48}, "power of two"),
                       ({"num_warps": 0}, "positive int")):
        with pytest.raises(KernelInputError, match=match):
            sparse_decode(q, pool, pt, config=bad)
    with pytest.raises(KernelInputError, match="unknown parameter 'block_n' for copy"):
        copy_pages(pool, ids(0), pool, ids(2), config={"block_n": 16})


def _sweep_problem(device, slow=(), broken=(), raising=()):
    """The copy problem (16 KiB pages) with a fake clock: ``slow`` maps block_bytes to us."""
    prob = at.make_problem("copy", dict(pages=6, page_size=64, hkv=2, d=32), device)
    prob.default = {"block_bytes": 16384, "programs_per_sm": 4}
    real_run, last = prob.run, {}

    def run(cfg, chk):
        last["cfg"] = cfg
        if cfg["block_bytes"] in raising:
            raise RuntimeError("out of resources: shared memory")
        if cfg["block_bytes"] in broken:
            return None  # copies nothing: only the restore before each check exposes it
        return real_run(cfg, chk)

    def bench(fn):
        fn()
        cfg = last["cfg"]
        return (dict(slow).get(cfg["block_bytes"], 100.0) + cfg["programs_per_sm"] / 1e3) / 1e3

    prob.run = run
    return prob, bench


def test_sweep_checks_before_timing_and_keeps_the_winner(device):
    prob, bench = _sweep_problem(device, slow={2048: 40.0, 4096: 30.0}, broken={8192},
                                 raising={4096})
    res = at.tune_problem(prob, bench)
    assert res["key"] == tn.bucket_key("copy", **prob.sizes)
    assert res["tried"] == len(tn.config_space("copy", **prob.sizes)) == 16
    assert res["rejected"] == 8 and res["checked"] == 8 and not res["cut"]
    # the fast 4 KiB configs raised and were never timed; the broken 8 KiB ones failed the check
    assert res["winner"] == {"block_bytes": 2048, "programs_per_sm": 1}
    assert res["us"] == pytest.approx(40.001) and res["default_us"] == pytest.approx(100.004)
    assert res["speedup"] == pytest.approx(100.004 / 40.001)
    for r in res["rejects"]:
        want = "out of resources" if r["config"]["block_bytes"] == 4096 else "bitwise"
        assert want in r["reason"]


def test_sweep_default_red_noise_and_time_budget(device):
    prob, bench = _sweep_problem(device, raising={16384})
    res = at.tune_problem(prob, bench)
    assert res["winner"] is None and res["tried"] == 1  # a red baseline publishes nothing
    prob, bench = _sweep_problem(device, slow={2048: 99.0})  # 1% < MIN_GAIN: timing noise
    res = at.tune_problem(prob, bench)
    assert res["winner"] == prob.default and res["speedup"] == 1.0
    res = at.tune_problem(prob, bench, deadline=0.0)  # already past: only the default runs
    assert res["cut"] and res["tried"] == 1 and res["winner"] == prob.default


def test_sweep_writes_checked_winners_and_a_summary(tmp_path, device, monkeypatch):
    calls = []

    def bench(fn):
        fn()
        calls.append(1)
        return 0.1 / len(calls)  # each config timed beats every one before it
    shapes = [dict(pages=3, page_size=16, hkv=2, d=32), dict(pages=700, page_size=1, hkv=1, d=8)]
    path = tmp_path / "fake-gpu.json"
    result = at._sweep("copy", shapes, device, bench, "Fake GPU", path, deadline=None,
                       progress=False)
    table = tn.load_tuned(path)
    assert result["path"] == str(path) and not result["cut"] and table["gpu"] == "Fake GPU"
    assert set(table["entries"]["copy"]) == set(result["keys"]) and len(result["keys"]) == 2
    for key, entry in table["entries"]["copy"].items():
        assert entry["checked"] and entry["config"] == result["keys"][key]["winner"]
        assert entry["us"] < entry["default_us"] * (1 - at.MIN_GAIN)
    monkeypatch.setenv(tn.ENV_VAR, str(path))
    key = next(iter(result["keys"]))
    assert tn.tuned_config("copy", key, gpu_name="Fake GPU") == result["keys"][key]["winner"]
    text = at.format_summary(result)
    assert key in text and str(path) in text and "x " in text


def test_autotune_without_cuda_raises_a_typed_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KernelUnsupportedError, match="CUDA"):
        at.autotune("decode")
    with pytest.raises(KernelInputError, match="kernel="):
        at.autotune("attention")


def test_packaged_tables_are_valid():
    for path in sorted(tn.TUNED_DIR.glob("*.json")):
        table = tn.load_tuned(path)
        assert tn.tuned_path(table["gpu"]) == path, f"{path.name} holds {table['gpu']!r}"
