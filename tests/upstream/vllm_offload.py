"""vLLM's own offloading tests, from the pinned release's source archive, run against tierattn.

    python tests/upstream/vllm_offload.py [--out results.json] [-- extra pytest args]

Downloads ``vllm-0.32.0.tar.gz`` from PyPI once (sha256 checked; cached under
``$TIERATTN_CACHE_DIR`` or ``~/.cache/tierattn/upstream``), extracts vLLM's offloading manager
tests (``tests/v1/kv_offload/cpu/test_manager.py``) and offloading connector unit tests
(``tests/v1/kv_connector/unit/offloading_connector/``), and runs them unedited with
``vllm_plugin.py``: vLLM's ``CPUOffloadingManager`` is tierattn's ``TieredBlockManager`` over one
DDR tier, vLLM's ``OffloadingConnector`` is tierattn's connector. The tests that fail for a
documented difference of policy are listed in :data:`EXPECTED_DIFFERENCES` with the reason and
marked ``xfail(strict=True)``: the run fails if any other test fails, or if a listed one passes
(the list must stay true). Needs vLLM 0.32 (CI's ``.venv-vllm``).
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the per-test outcomes here (JSON)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    root = extract(archive())
    report = root / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(root), os.environ.get("PYTHONPATH", "")]),
        "TIERATTN_UPSTREAM_EXPECTED": json.dumps(EXPECTED_DIFFERENCES),
        "TIERATTN_UPSTREAM_REPORT": str(report)}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "vllm_plugin", "-q",
           "-rfxX", "--rootdir", str(root), *TESTS, *args.pytest_args]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=root, env=env)
    if args.out and report.exists():
        outcomes = json.loads(report.read_text())
        result = {"archive": URL, "sha256": SHA256, "tests": list(TESTS),
                  "expected_differences": EXPECTED_DIFFERENCES, "outcomes": outcomes,
                  "counts": {k: sum(v == k for v in outcomes.values())
                             for k in sorted(set(outcomes.values()))}}
        Path(args.out).write_text(json.dumps(result, indent=1))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
