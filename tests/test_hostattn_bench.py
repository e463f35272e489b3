"""``tierattn bench --host-attn``: the smoke run through the command line writes its results
folder (every cell with positive rates and ratio, the modeled rows labelled as modeled, the
provenance), the model's arithmetic against a hand computation, a cell over the pool cap listed
as skipped, and the flags it refuses by name. No timing is asserted: the figures are printed."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
from pathlib import Path

import pytest
import torch

from tierattn.eval.bench.kv import HARDWARE_DIR
from tierattn.eval.cli import main
from tierattn.eval.bench.host import (GEOMETRIES, HostAttnSpec, hostattn_summary,
                                          load_profiles, model_rows, run_hostattn_bench)
from tierattn.kernels.host import host_decode_available

CELLS = 2 * 2 * 2 * 2  # smoke: geometries x dtypes x contexts (4K, 16K) x batches (1, 2)


def _needs_kernel() -> None:
    if not host_decode_available():
        pytest.skip("the host kernel could not be compiled here (no C compiler)")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[int, str, Path]:
    """The CLI's smoke run, once for the module: (exit status, stdout, results folder)."""
    _needs_kernel()
    root = tmp_path_factory.mktemp("hostattn")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "host", "--smoke", "--out-root", str(root)])
    folders = list(root.iterdir())
    assert len(folders) == 1, folders
    return rc, out.getvalue(), folders[0]


def test_the_smoke_run_exits_0_and_prints_measured_and_modeled_tables(smoke):
    rc, out, folder = smoke
    assert rc == 0
    assert folder.name.startswith("hostattn-ctx4k_16k-b1_2-t")
    assert "host_decode GB/s" in out and "host_read GB/s" in out and "decode/read" in out
    assert "modeled, not measured" in out and "modeled split us" in out
    assert f"results: {folder}/results.json" in out


def test_the_results_folder_holds_every_cell_and_the_provenance(smoke):
    _, _, folder = smoke
    result = json.loads((folder / "results.json").read_text())
    measured = result["measured"]
    assert len(measured) == CELLS and not any(r.get("skipped") for r in measured)
    for r in measured:
        assert r["kind"] == "measured"
        assert r["kv_bytes"] == r["pages"] * r["page_bytes"] > 0
        for key in ("decode_Bps", "read_Bps", "sdpa_Bps", "ratio"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["ratio"] == pytest.approx(r["decode_Bps"] / r["read_Bps"])
        assert r["decode_Bps"] == pytest.approx(r["kv_bytes"] / r["decode_s"])
    assert {(r["geometry"], r["dtype"], r["context"], r["batch"]) for r in measured} == {
        (g.name, d, c, b) for g in GEOMETRIES for d in ("bf16", "fp32") for c in (4096, 16384)
        for b in (1, 2)}
    assert set(result["host_ratio"]) == {f"{g.name}/{d}" for g in GEOMETRIES
                                         for d in ("bf16", "fp32")}
    assert all(v["median"] > 0 and v["cells"] == 4 for v in result["host_ratio"].values())
    prov = result["provenance"]
    for key in ("commit", "dirty", "versions", "machine", "threads", "command", "date"):
        assert key in prov, key
    assert prov["versions"]["torch"] == torch.__version__
    assert prov["threads"] == torch.get_num_threads()
    assert prov["dirty"] in (True, False, None) and prov["machine"]["cpu_model"] and prov["date"]
    assert result["spec"]["reps"] == 1 and result["cache_flush"]["flush_bytes"] > 0
    assert result.get("plot") is None or Path(result["plot"]).is_file()
    assert result.get("plot") or result.get("plot_note")


def test_modeled_rows_are_labelled_modeled_in_the_json_and_the_csv(smoke):
    _, _, folder = smoke
    result = json.loads((folder / "results.json").read_text())
    modeled = result["modeled"]
    assert len(modeled) == 2 * 2 * 2 * 2  # geometries x dtypes x contexts x hot budgets (h100)
    times = ("offload_us", "topk_us", "split_us", "hot_us")
    for r in modeled:
        assert r["kind"] == "modeled" and r["profile"] == "h100" and r["batch"] == 1
        assert all(r[f"modeled_{t}"] > 0 for t in times), r
        assert not any(k.endswith(("_us", "_Bps")) and not k.startswith("modeled_")
                       for k in r), r  # every modeled figure says so in its name
        ratio = result["host_ratio"][f"{r['geometry']}/{r['dtype']}"]["median"]
        assert r["host_ratio"] == ratio
        assert r["modeled_host_Bps"] == pytest.approx(150e9 * ratio)  # h100's nominal DDR
    with (folder / "rows.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == CELLS + len(modeled)
    assert {r["kind"] for r in rows} == {"measured", "modeled"}
    assert all(r["modeled_split_us"] for r in rows if r["kind"] == "modeled")


def test_the_model_by_hand():
    """One geometry, context and budget on a made-up profile: each formula written out."""
    spec = HostAttnSpec(contexts=(4096,), hot_budgets=(0.25,), geometries=GEOMETRIES[:1],
                        dtypes=("bf16",), recall=0.25)
    prof = {"name": "made up", "hbm_bandwidth_Bps": 2e12, "hbm_efficiency": 0.5,
            "h2d_bandwidth_Bps": 50e9, "d2h_bandwidth_Bps": 25e9, "memcpy_call_s": 5e-6,
            "ddr_bandwidth_Bps": 100e9}
    ratios = {"llama-8b/bf16": {"median": 0.5, "min": 0.5, "max": 0.5, "cells": 1}}
    (row,) = model_rows(spec, {"p": prof}, ratios)
    page = 2 * 16 * 8 * 128 * 2  # K and V x 16 tokens x 8 KV heads x 128 x bf16
    hot, cold = 64, 256 - 64  # 25% of 256 pages
    assert (row["hot_pages"], row["cold_pages"], row["recall_pages"]) == (hot, cold, 48)
    us = 1e6
    assert row["modeled_offload_us"] == pytest.approx(us * (5e-6 + cold * page / 50e9))
    assert row["modeled_topk_us"] == pytest.approx(us * (5e-6 + 48 * page / 50e9))
    query, state = 32 * 128 * 2, 32 * (128 + 1) * 4
    assert row["modeled_split_us"] == pytest.approx(us * (cold * page / (100e9 * 0.5)
                                                          + 5e-6 + query / 50e9
                                                          + 5e-6 + state / 25e9))
    assert row["modeled_hot_us"] == pytest.approx(us * hot * page / (2e12 * 0.5))
    assert row["modeled_split_over_offload"] == pytest.approx(
        row["modeled_split_us"] / row["modeled_offload_us"])
    (unmeasured,) = model_rows(spec, {"p": prof}, {})
    assert unmeasured["modeled_split_us"] is None and unmeasured["host_ratio"] is None
    assert unmeasured["modeled_offload_us"] == row["modeled_offload_us"]


def test_a_cell_over_the_pool_cap_is_skipped_and_says_so():
    _needs_kernel()
    geo = GEOMETRIES[1]
    page = geo.page_bytes(16, 4)
    spec = HostAttnSpec(contexts=(256, 1024), batches=(1,), geometries=(geo,),
                        dtypes=("fp32",), reps=1, sdpa=False, max_pool_bytes=32 * page)
    result = run_hostattn_bench(spec, out_root=None, progress=False)
    small, big = result["measured"]
    assert small["ratio"] > 0 and small["sdpa_Bps"] is None and not small.get("skipped")
    assert big["skipped"].startswith("skipped: pool ") and big.get("ratio") is None
    lines = hostattn_summary(result).splitlines()
    assert lines[4].startswith("smollm2-135m") and lines[4].endswith(big["skipped"])
    assert any(line.startswith("1 cell(s) skipped") for line in lines)


def test_profiles_need_the_host_bandwidth(tmp_path):
    assert load_profiles()["h100"]["ddr_bandwidth_Bps"] > 0
    prof = json.loads((HARDWARE_DIR / "h100.json").read_text())
    del prof["ddr_bandwidth_Bps"]
    path = tmp_path / "noddr.json"
    path.write_text(json.dumps(prof))
    with pytest.raises(ValueError, match="ddr_bandwidth_Bps"):
        load_profiles(("h100",), (str(path),))


@pytest.mark.parametrize("changes,name", [({"dtypes": ("fp16x",)}, "dtypes"),
                                          ({"hot_budgets": (1.0,)}, "hot_budgets"),
                                          ({"contexts": (0,)}, "contexts"),
                                          ({"threads": 0}, "threads"),
                                          ({"recall": 0.0}, "recall")],
                         ids=["dtype", "budget-1", "context-0", "threads-0", "recall-0"])
def test_the_spec_refuses_bad_values_by_name(changes, name):
    with pytest.raises(ValueError, match=name):
        HostAttnSpec(**changes)


def _noddr(tmp_path: Path) -> str:
    prof = json.loads((HARDWARE_DIR / "h100.json").read_text())
    del prof["ddr_bandwidth_Bps"]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(prof))
    return str(path)


@pytest.mark.parametrize("argv,flag", [
    (["--disk"], "--disk"),
    (["--modes", "topk"], "--modes"),
    (["--batch", "2"], "--batch"),
    (["--budgets", "0.1,1.0"], "--budgets"),
    (["--hardware", "NODDR"], "--hardware"),
], ids=["with-disk", "modes", "batch", "budget-1", "profile-without-ddr"])
def test_the_cli_refuses_what_does_not_apply_in_one_line(argv, flag, tmp_path, capsys):
    argv = [_noddr(tmp_path) if a == "NODDR" else a for a in argv]
    try:
        rc = main(["bench", "host", "--smoke", "--out-root", str(tmp_path), *argv])
    except SystemExit as e:  # argparse's own refusals (a flag bench host does not take)
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], err
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # refused before any work
