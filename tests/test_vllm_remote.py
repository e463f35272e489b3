"""The remote store under vLLM: two engine instances, each in its own process, share a Mooncake
Store started here on 127.0.0.1 (a master and a ``mooncake_client`` lending the pool its
memory). The first serves four conversations and stores their blocks; the second, a fresh
process with empty tiers, finds them in the store and loads them instead of prefilling: its
tokens equal vLLM's own without the connector, and the loads are counted. A master killed
before the second engine asks or while it loads, or values that fail their checksum, turn into
recomputes with the same tokens and the fault counted.

CI runs this file in the vLLM environment (``.venv-vllm``) with Mooncake installed; it is
skipped without either.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")
from mooncake_helpers import LOOPBACK, Master, mooncake_importable  # noqa: E402

pytestmark = pytest.mark.skipif(not mooncake_importable(), reason="needs Mooncake Store (the "
                                "[remote] extra) and libibverbs1; .ci/run installs both")

#: one engine in a process of its own: ``mode`` plain (no connector), remote (the DDR tier over
#: the remote store), corrupt-writer (remote, but every value it puts fails its checksum:
#: a forced fault), kill-first (remote, the master killed once the engine is built),
#: kill-in-load (remote, the master killed as the first load from the store starts)
ENGINE = textwrap.dedent("""
    import json, os, signal, sys
    from vllm_helpers import run_engine
    from tierattn.config import RemoteConfig, SwapConfig
    from tierattn.models.vllm import vllm_kv_transfer_config
    from tierattn.storage import remote as store

    if __name__ == "__main__":
        model, mode, master, metadata, pid = sys.argv[1:6]
        config, before = None, None
        if mode != "plain":
            remote = RemoteConfig(master=master, metadata=metadata, segment_gib=0.0,
                                  buffer_mib=32, deadline_s=1.0, retry_s=60.0)
            config = vllm_kv_transfer_config(SwapConfig(tiers=("ddr",), policy="swap",
                                                        remote=remote), prompt_only=False)
        if mode == "corrupt-writer":  # every header this engine writes has a wrong checksum
            store._checksum = lambda data: 0
        if mode == "kill-first":
            before = lambda: os.kill(int(pid), signal.SIGKILL)
        if mode == "kill-in-load":  # the lookup found the blocks; the master dies under the get
            get = store.RemoteStore.get

            def killed_then_get(self, keys):
                os.kill(int(pid), signal.SIGKILL)
                return get(self, keys)
            store.RemoteStore.get = killed_then_get
        run = run_engine(mode, model, config, rounds=1, before=before)
        print("RESULT" + json.dumps({"tokens": run.tokens[0], "cached": run.cached[0],
                                     "metrics": {f"{n}|{t}": v for (n, t), v
                                                 in run.metrics[-1].items()
                                                 if "tierattn" in n}}))
""")


def _engine(model: str, mode: str, master: Master | None, tmp_path: Path) -> dict:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    where = ["-", "-", "0"]  # the plain engine uses no store
    if master is not None:
        cfg = master.config()
        where = [cfg.master, cfg.metadata, str(master.proc.pid)]
    env = {**LOOPBACK, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run([sys.executable, str(script), model, mode, *where],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT"):])


def _metric(run: dict, name: str, tier: str | None = None) -> float:
    return run["metrics"].get(f"vllm:tierattn_{name}|{tier}", 0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from vllm_helpers import save_tiny_models

    return save_tiny_models(tmp_path_factory.mktemp("models"))["llama"]


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict:
    return _engine(model, "plain", None, tmp_path_factory.mktemp("plain"))


def test_another_instance_loads_what_one_stored(model, reference, tmp_path):
    master = Master(tmp_path / "master.log", pool_mib=256)
    try:
        first = _engine(model, "remote", master, tmp_path)
        second = _engine(model, "remote", master, tmp_path)  # a new process, empty tiers
    finally:
        master.stop()
    assert first["tokens"] == reference["tokens"] and second["tokens"] == reference["tokens"]
    assert _metric(first, "stored_slots", "ddr") > 0
    loaded = _metric(second, "loaded_slots", "remote")
    assert loaded > 0, second["metrics"]
    # the loaded blocks count as cached tokens, which vLLM alone never has on a first run
    assert sum(second["cached"]) > sum(reference["cached"]), (second["cached"],
                                                              reference["cached"])
    assert _metric(second, "load_faults") == 0 and _metric(second, "remote_faults") == 0
    assert second["metrics"]["vllm:tierattn_remote_up|None"] == 1


def test_values_that_fail_their_checksum_are_recomputed(model, reference, tmp_path):
    master = Master(tmp_path / "master.log", pool_mib=256)
    try:
        _engine(model, "corrupt-writer", master, tmp_path)
        second = _engine(model, "remote", master, tmp_path)
    finally:
        master.stop()
    assert second["tokens"] == reference["tokens"]
    assert _metric(second, "load_faults") > 0, second["metrics"]
    assert _metric(second, "loaded_slots", "remote") == 0


def test_a_killed_master_costs_a_recompute_not_a_token(model, reference, tmp_path):
    master = Master(tmp_path / "master.log", pool_mib=256)
    try:
        _engine(model, "remote", master, tmp_path)
        second = _engine(model, "kill-first", master, tmp_path)
    finally:
        master.stop()
    assert master.proc.poll() is not None  # the engine killed it by its PID
    assert second["tokens"] == reference["tokens"]
    assert _metric(second, "loaded_slots", "remote") == 0
    assert _metric(second, "remote_faults") >= 1, second["metrics"]
    assert second["metrics"]["vllm:tierattn_remote_up|None"] == 0  # reported, and down


def test_a_master_killed_during_a_load_costs_a_recompute_not_a_token(model, reference, tmp_path):
    master = Master(tmp_path / "master.log", pool_mib=256)
    try:
        _engine(model, "remote", master, tmp_path)
        second = _engine(model, "kill-in-load", master, tmp_path)
    finally:
        master.stop()
    assert master.proc.poll() is not None  # killed by its PID, after the lookup found blocks
    assert second["tokens"] == reference["tokens"]
    assert _metric(second, "loaded_slots", "remote") == 0
    assert _metric(second, "load_faults") >= 1, second["metrics"]
