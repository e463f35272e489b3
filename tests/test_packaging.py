"""Packaging and hygiene: one namespace, no import side effects, README/CI in step, no pickle."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("kernels", "tierattn", "models", "eval")


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n\s*(.+?)\n\s*```", (ROOT / "README.md").read_text())


def test_readme_quick_start_has_two_commands_and_ci_runs_the_test_one():
    setup_and_main, setup_and_test = _readme_commands()[:2]
    assert setup_and_main.endswith("tierattn eval reasoning")  # the main job: the eval
    ci = (ROOT / ".ci" / "run").read_text()
    # CI performs the README's set-up steps and then its exact test command
    steps = [s.strip() for s in setup_and_test.split("&&")]
    for step in steps:
        assert step in ci, f"README step {step!r} is not in .ci/run"
    assert steps[-1] == ".venv/bin/python -m pytest -n 2"


def test_no_unsafe_deserialisation_in_the_package():
    pattern = re.compile(r"\bpickle\b|torch\.load\(|allow_pickle\s*=\s*True")
    hits = [f"{p.relative_to(ROOT)}:{i}" for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_kernels_never_import_transformers():
    imports = re.compile(r"^\s*(import|from)\s+transformers\b", re.M)
    hits = [p.name for p in (ROOT / "kernels").rglob("*.py") if imports.search(p.read_text())]
    assert hits == []


def test_import_has_no_side_effects():
    code = ("import sys, tierattn, tierattn.models, tierattn.eval; "
            "print(sorted(m for m in ('triton', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_lists_only_working_subcommands():
    # run from the repository root, as a user of the checkout would
    out = subprocess.run([sys.executable, "-m", "tierattn.eval.cli", "--help"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    assert re.search(r"\{(.+)\}", out).group(1) == \
        "demo,loop,eval,bench,train,models,autotune,serve,vllm-args,info"
    info = subprocess.run([sys.executable, "-m", "tierattn.eval.cli", "info"], capture_output=True,
                          text=True, check=True, cwd=ROOT).stdout
    assert json.loads(info)["versions"]["tierattn"] == "0.1.0"


def test_python_started_in_the_checkout_imports_tierattn_and_hugging_face_kernels():
    """The root's kernels/ folder (tierattn.kernels) must not shadow Hugging Face's `kernels`,
    which transformers imports when it is installed; nothing edits sys.path."""
    pytest.importorskip("kernels")  # Hugging Face's: the test extra installs it
    code = ("import sys, tierattn, kernels, tierattn.kernels as ours; "
            "from transformers.integrations import hub_kernels; "
            "assert tierattn.patch and tierattn.TieredKVCache; "
            "print(kernels.__file__); print(ours.__file__); print(sys.path[0])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs, ours, first = done.stdout.split("\n")[:3]
    assert first == "" and Path(ours).resolve() == ROOT / "kernels" / "__init__.py"
    assert not Path(theirs).resolve().is_relative_to(ROOT / "kernels"), theirs


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", minversion="77")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, capture_output=True)
    (whl,) = out.glob("tierattn-*.whl")
    return whl


def test_wheel_installs_one_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"tierattn"}, f"the wheel installs more than tierattn/: {sorted(top)}"
    for sub in ("kernels", "models", "eval"):
        assert f"tierattn/{sub}/__init__.py" in names
    assert "tierattn/py.typed" in names and "tierattn/kernels/README.md" in names
    # the host attention kernel's C source is built on the user's machine: it ships
    assert {"tierattn/kernels/csrc/host_decode.c",
            "tierattn/kernels/csrc/host_decode_body.h"} <= set(names)
    # the benchmarks' hardware profiles are package data
    assert {"tierattn/eval/hardware/h100.json", "tierattn/eval/hardware/h200.json"} <= set(names)


def test_the_installed_wheel_runs_without_the_source_tree(wheel, tmp_path):
    # installed (not editable) into a folder of its own, run from elsewhere: only the wheel's
    # files are importable as tierattn
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = tmp_path / "run"
    run.mkdir()

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "tierattn.eval.cli", *args],
                              capture_output=True, text=True, env=env, cwd=run)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    where = subprocess.run([sys.executable, "-c", "import tierattn; print(tierattn.__file__)"],
                           capture_output=True, text=True, env=env, cwd=run, check=True).stdout
    assert where.strip().startswith(str(site))
    assert '"tierattn": "0.1.0"' in cli("info")
    cli("bench", "--smoke", "--out-root", str(tmp_path / "results"))
    assert list((tmp_path / "results").rglob("*.json"))


def test_vllm_args_prints_vllm_serve_flags_without_vllm():
    # vllm_engine_args imports no vLLM: a launcher writes the flags for a server elsewhere
    out = subprocess.run([sys.executable, "-m", "tierattn.eval.cli", "vllm-args", "--preset",
                          "topk", "--hot-budget", "0.1"], capture_output=True, text=True,
                         check=True, cwd=ROOT.parent).stdout
    flags = shlex.split(out)
    assert flags[:8] == ["--block-size", "32", "--no-enable-prefix-caching",
                         "--long-prefill-token-threshold", "512", "--attention-backend",
                         "CUSTOM", "--kv-transfer-config"]
    kv = json.loads(flags[8])
    assert kv["kv_connector"] == "TierattnHotSetConnector"
    assert kv["kv_connector_extra_config"]["tier"]["hot_budget"] == 0.1
    assert kv["kv_connector_extra_config"]["tier"]["recall_score"] == "quest"


def test_engine_integrations_raise_only_typed_errors():
    # models/ raises tierattn's errors (tierattn/errors.py: each names the argument and the fix)
    untyped = re.compile(r"raise (ValueError|RuntimeError|NotImplementedError|TypeError|"
                         r"KeyError|AssertionError)\(")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "models").rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if untyped.search(line)]
    assert hits == []
