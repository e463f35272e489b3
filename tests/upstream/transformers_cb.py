"""transformers' own continuous-batching tests, run plain and under tierattn's swap.

    .venv/bin/python tests/upstream/transformers_cb.py [--tests-from PATH] [--out FILE]

Steps: (1) download transformers' sdist for the installed release from PyPI into a cache folder
(``$TIERATTN_CACHE_DIR`` or ``~/.cache/tierattn/upstream``) and check its sha256; (2) take the
continuous-batching test files out of it -- or, when the sdist has none, from ``--tests-from``
(a transformers checkout, its ``tests/`` folder, or the file itself; ``$TIERATTN_UPSTREAM_TESTS``);
(3) lay them out in a temporary folder with a conftest that loads ``cb_plugin.py`` (the CPU
adaptations, documented there test by test); (4) run pytest on them twice, each in its own
process: plain, then with ``TIERATTN_CB_SWAP=1`` (``swap_every_model(SwapConfig(policy="swap"))``
entered for the whole session); (5) print a per-test table and the peak RSS of each pytest
process, write ``--out`` JSON, and exit 1 when a test passes plain but not with the swap, unless
:data:`EXPECTED_DIFFERENCES` names it with its reason.

Where the tests come from. transformers' sdists ship only ``tests/test_*_common.py``-style mixins
(22 files at the top of ``tests/``), no ``tests/generation/``; the wheel ships no tests; no other
PyPI artifact carries them. So with PyPI alone (what CI reaches) step 2 finds nothing, the script
says so and exits 3 (0 with ``--allow-missing``). Pass the file with ``--tests-from``: the copy
checked here is :data:`KNOWN_TEST_FILES` (a post-5.25.0 main revision: the v5.25.0 revision was
not obtainable; it imports one name 5.25.0 lacks, stubbed by the plugin), kept unedited in
``tests/upstream/transformers/`` (Apache-2.0, see its NOTICE) and used by default.

Findings (2-core CPU, torch 2.13 CPU, transformers 5.25.0, the default selection, ~6 min):
plain 64 passed / 6 failed / 68 skipped, swap the same 64 / 6 / 68 -- the 6 failing in both are
the version skew (features after 5.25.0). test_continuous_batching_few_blocks and
test_cpu_offloading_disabled_when_zero swap 2 requests out and back, tokens identical, and the
first one's spy on OffloadingManager.offload_requests sees transformers' own loop run (tierattn
decides each victim in _offload_to_cpu). Peak RSS 5,585 MiB plain, 5,604 MiB with the swap
(1.004x: the store lets go of each engine's KV cache with the engine, and the wrappers hold the
engine's objects weakly, so no cycle keeps a cache for the garbage collector).

Exit status: 0 all good; 1 a regression under the swap (or a run that did not finish); 2 the
sdist's checksum is wrong / a download failed; 3 no continuous-batching tests available.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

#: transformers' sdist for the release the project pins (pyproject: transformers[serving]<5.26)
SDIST = {
    "version": "5.25.0",
    "url": "https://files.pythonhosted.org/packages/49/2b/9f972080c2987e490e60d3b00003e88114e4950e"
           "905cff83a53c8b0ea51d/transformers-5.25.0.tar.gz",
    "sha256": "9120226c6bf170d69abc3029036799bb5d48e552f7127646a529a5c9309812e2",
}
#: the upstream tests import `parameterized`, which tierattn's venv does not have: its wheel is
#: fetched here and put on the pytest processes' PYTHONPATH (the venv is left as it is)
PARAMETERIZED = {
    "url": "https://files.pythonhosted.org/packages/00/2f/804f58f0b856ab3bf21617cccf5b39206e6c4c94"
           "c2cd227bde125ea6105f/parameterized-0.9.0-py2.py3-none-any.whl",
    "sha256": "4e0758e3d41bea3bbd05ec14fc2c24736723f243b28d702081aef438c9372b1b",
}
#: continuous-batching test files, as paths inside a transformers source tree
CB_PATTERNS = ("tests/generation/test_continuous_batching*.py",
               "tests/generation/test_continuos_batching*.py",
               "tests/*/continuous_batching*/*.py", "tests/*/test_*continuous_batching*.py")
#: test files whose provenance was checked by hand (sha256 of the bytes -> where they come from)
KNOWN_TEST_FILES = {
    "f6d88e931fdea06cb02a78d1030cb2b0fb7b341886d5f834e041ceb2a8c8ad1c":
        "huggingface/transformers main @ 02166fe6df77c64fd092dfda95b47d002f4c17b5, "
        "tests/generation/test_continuous_batching.py (git blob b7716427; 151,783 characters; "
        "newer than v5.25.0: imports disable_acceleration_for_full_history_processors)",
}

#: deselected by default, with the reason (-k expression built from these); --full keeps all
#: but the first. The whole default selection runs in about 6 minutes (both runs) on 2 cores.
DESELECT = {
    "test_continuous_batching_long_generate":
        "default_compile_level=1: torch.compile of the model on a 2-core CPU takes minutes",
    "test_cpu_offloading_parity":
        "time: needs pinned host memory (a CUDA/XPU allocator), so its plain run fails at once on "
        "a CPU-only torch ('pin_memory=True requires a CUDA or other accelerator backend'); with "
        "the swap it runs the whole 4-block parity (~95 s) and then fails its _offload_to_cpu "
        "spy (see the report)",
    "test_cpu_offloading_parity_async":
        "cannot run on CPU: transformers 5.25 refuses async batching off CUDA/XPU ('Async batching "
        "requires a device type in (cuda, xpu)'), identically in both runs (it also matches -k "
        "'test_cpu_offloading_parity' as a substring)",
    "test_pause_with_several_holders":
        "time (~30 s a run): the same started-manager pause path as test_pause_during_generation",
}
#: tests allowed to pass plain and not under the swap: name -> why (empty: none allowed)
EXPECTED_DIFFERENCES: dict[str, str] = {}


def log(msg: str) -> None:
    print(f"[transformers_cb] {msg}", flush=True)


def cache_dir() -> Path:
    root = os.environ.get("TIERATTN_CACHE_DIR")
    path = Path(root) / "upstream" if root else Path.home() / ".cache" / "tierattn" / "upstream"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(spec: dict, folder: Path) -> Path:
    """``spec``'s file in ``folder`` (downloaded when absent), its sha256 checked."""
    path = folder / spec["url"].rsplit("/", 1)[1]
    if not path.exists():
        log(f"downloading {spec['url']}")
        tmp = path.with_suffix(path.suffix + ".part")
        with urllib.request.urlopen(spec["url"], timeout=120) as r, tmp.open("wb") as f:
            shutil.copyfileobj(r, f)
        tmp.replace(path)
    got = sha256(path)
    if got != spec["sha256"]:
        path.unlink()
        raise SystemExit(f"{path.name}: sha256 {got} != pinned {spec['sha256']} (file removed)")
    return path


def cb_members(names: list[str], strip: str = "") -> list[str]:
    out = []
    for name in names:
        rel = name[len(strip):] if strip and name.startswith(strip) else name
        if any(fnmatch.fnmatch(rel, p) for p in CB_PATTERNS):
            out.append(name)
    return sorted(out)


def from_sdist(sdist: Path, dest: Path) -> tuple[list[dict], dict]:
    """Extract the sdist's continuous-batching test files under ``dest``; also report what
    ``tests/`` holds."""
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0] + "/"
        tests = sorted(n[len(top):] for n in names if n.startswith(top + "tests/") and
                       n.endswith(".py"))
        found = cb_members(names, top)
        files = []
        for name in found:
            rel = name[len(top):]
            data = tar.extractfile(name).read()
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(data)
            files.append({"path": rel, "from": f"sdist:{name}",
                          "sha256": hashlib.sha256(data).hexdigest()})
    return files, {"tests_py_files": len(tests), "has_tests_generation":
                   any(t.startswith("tests/generation/") for t in tests)}


def from_path(src: Path, dest: Path) -> list[dict]:
    """Copy continuous-batching test files from a checkout, its tests/ folder, or one file."""
    if src.is_file():
        pairs = [(src, "tests/generation/" + src.name)]
    else:
        root = src.parent if src.name == "tests" else src
        rels = [str(p.relative_to(root)) for p in root.rglob("*.py")]
        pairs = [(root / r, r) for r in cb_members(rels)]
    files = []
    for path, rel in pairs:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest / rel)
        digest = sha256(path)
        files.append({"path": rel, "from": str(path), "sha256": digest,
                      "known_as": KNOWN_TEST_FILES.get(digest, "unknown revision")})
    return files


def lay_out(dest: Path) -> None:
    """Packages for the relative imports, the plugin and its conftest, an isolating ini."""
    for pkg in {p.parent for p in dest.rglob("test_*.py")} | {dest / "tests"}:
        while pkg != dest:
            (pkg / "__init__.py").touch()
            pkg = pkg.parent
    shutil.copyfile(HERE / "cb_plugin.py", dest / "tierattn_cb_plugin.py")
    (dest / "conftest.py").write_text('pytest_plugins = ["tierattn_cb_plugin"]\n')
    (dest / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n"
                                     "python_files = test_*.py\n")


def parse_results(path: Path) -> dict[str, dict]:
    """Per test (``Class::test``): outcome, seconds, detail, RSS after it, from the plugin's
    JSON lines. A test with a failing subtest is failed; an error in setup/teardown is error."""
    out: dict[str, dict] = {}
    if not path.exists():
        return out
    rank = {"skipped": 0, "passed": 1, "failed": 3, "error": 4}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        name = r["nodeid"].split("::", 1)[1]
        outcome = r["outcome"]
        if r["when"] != "call" and outcome == "failed":
            outcome = "error"
        cur = out.setdefault(name, {"outcome": "skipped", "detail": "", "seconds": 0.0,
                                    "rss_mib": None})
        if r.get("swap"):
            cur["swap"] = r["swap"]
        if rank[outcome] >= rank[cur["outcome"]] and not (r["subtest"] and outcome == "passed"
                                                          and cur["outcome"] != "skipped"):
            cur["outcome"] = outcome
            cur["detail"] = r["detail"] or cur["detail"]
        cur["seconds"] = round(cur["seconds"] + r["seconds"], 2)
        cur["rss_mib"] = r["rss_mib"] if r["rss_mib"] is not None else cur["rss_mib"]
    return out


def run_pytest(dest: Path, swap: bool, kexpr: str, timeout: float, deps: list[Path],
               workdir: Path, kv_budget_gib: str) -> dict:
    tag = "swap" if swap else "plain"
    results, stats, logf = (workdir / f"{tag}.jsonl", workdir / f"{tag}-stats.json",
                            workdir / f"{tag}.log")
    env = dict(os.environ)
    env.update(TIERATTN_CB_SWAP="1" if swap else "0", TIERATTN_CB_STATS=str(stats),
               TIERATTN_CB_RESULTS=str(results),
               TIERATTN_CB_KV_BUDGET_GIB=kv_budget_gib,
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(dest)] + [str(d) for d in deps] +
                                          ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
    env.pop("RUN_SLOW", None)  # @slow tests stay skipped, as in transformers' own CI by default
    cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-rfE", "-p", "no:randomly"]
    if kexpr:
        cmd += ["-k", kexpr]
    log(f"run {tag}: {' '.join(cmd[2:])}")
    t0 = time.perf_counter()
    # cwd is the temporary folder, never the repository root: there the top-level kernels/ folder
    # would shadow the `kernels` package transformers imports (see tests/conftest.py)
    with logf.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=dest, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline, timed_out = t0 + timeout, False
        while True:
            # wait4 reports this child's own rusage (getrusage(RUSAGE_CHILDREN) would be the max
            # over every child so far, i.e. over both runs)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if not timed_out and time.perf_counter() > deadline:
                timed_out = True
                log(f"run {tag}: over {timeout:.0f} s, stopping it")
                os.killpg(proc.pid, signal.SIGTERM)
                deadline += 15
            elif timed_out and time.perf_counter() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    tests = parse_results(results)
    swap_stats = json.loads(stats.read_text()) if stats.exists() else {}
    killed = proc.returncode == -signal.SIGKILL and not timed_out
    return {"mode": tag, "exit_code": proc.returncode, "timed_out": timed_out,
            "killed_externally": killed,  # SIGKILL this script did not send: the OOM killer?
            "seconds": round(time.perf_counter() - t0, 1),
            # ru_maxrss of this pytest process (Linux: KiB)
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "counts": {o: sum(t["outcome"] == o for t in tests.values())
                       for o in ("passed", "failed", "error", "skipped")},
            "tests": tests, "swap_stats": swap_stats.get("per_test", {}),
            "adaptations": swap_stats.get("adaptations", []),
            "smollm2_load_s": swap_stats.get("smollm2_load_s"),
            "log_tail": logf.read_text(errors="replace").splitlines()[-40:]}


def report(plain: dict, swapped: dict) -> tuple[list[dict], list[str], list[str]]:
    """Rows of the table; the regressions (passed plain, failed or errored with the swap, not
    expected); the tests the swap run never reached."""
    rows, regressions, missing = [], [], []
    for name in sorted(set(plain["tests"]) | set(swapped["tests"])):
        a = plain["tests"].get(name, {}).get("outcome", "-")
        b = swapped["tests"].get(name, {}).get("outcome", "-")
        rows.append({"test": name, "plain": a, "swap": b,
                     "rss_mib": [plain["tests"].get(name, {}).get("rss_mib"),
                                 swapped["tests"].get(name, {}).get("rss_mib")],
                     "seconds": [plain["tests"].get(name, {}).get("seconds"),
                                 swapped["tests"].get(name, {}).get("seconds")],
                     "swap_stats": swapped["tests"].get(name, {}).get("swap")})
        base = name.split("::")[-1]
        expected = name in EXPECTED_DIFFERENCES or base in EXPECTED_DIFFERENCES
        if a == "passed" and b in ("failed", "error") and not expected:
            regressions.append(name)
        elif a != "-" and b == "-":
            missing.append(name)
    return rows, regressions, missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests-from", default=os.environ.get("TIERATTN_UPSTREAM_TESTS")
                    or str(HERE / "transformers" / "test_continuous_batching.py"),
                    help="a transformers checkout, its tests/ folder, or the test file itself, "
                         "used when the sdist has no continuous-batching tests")
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("-k", dest="kexpr", default=None,
                    help="pytest -k expression (default: everything but DESELECT)")
    ap.add_argument("--full", action="store_true",
                    help="deselect only what cannot run here (torch.compile), not the slow ones")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per pytest run")
    ap.add_argument("--only", choices=("plain", "swap"), help="one run only (debugging)")
    ap.add_argument("--kv-budget-gib", default="3",
                    help="memory the engine may plan for when a test sets neither "
                         "max_memory_percent nor num_blocks ('none': transformers' own 0.6 of "
                         "RAM; see cb_plugin.py)")
    ap.add_argument("--allow-missing", action="store_true",
                    help="exit 0 when no continuous-batching tests can be found")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)

    import torch
    import transformers

    versions = {"python": sys.version.split()[0], "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tierattn": importlib.metadata.version("tierattn")}
    if transformers.__version__ != SDIST["version"]:
        log(f"note: transformers {transformers.__version__} installed, sdist pinned is "
            f"{SDIST['version']}")
    cache = cache_dir()
    try:
        sdist = fetch(SDIST, cache)
        wheel = fetch(PARAMETERIZED, cache)
    except (OSError, SystemExit) as e:
        log(f"download/verify failed: {e}")
        return 2
    log(f"sdist ok: {sdist} sha256 {SDIST['sha256']}")

    dest = Path(tempfile.mkdtemp(prefix="tierattn-upstream-cb-"))
    workdir = dest / "_results"
    workdir.mkdir()
    deps = []
    try:
        import parameterized  # noqa: F401
    except ImportError:
        deps.append(wheel)  # a pure-Python wheel is importable as a zip
    files, sdist_info = from_sdist(sdist, dest)
    source = "sdist"
    if not files:
        log(f"the sdist has no continuous-batching tests ({sdist_info['tests_py_files']} .py files "
            f"under tests/, tests/generation/ present: {sdist_info['has_tests_generation']})")
        if args.tests_from:
            files, source = from_path(Path(args.tests_from).expanduser(), dest), "tests-from"
    result = {"sdist": {**SDIST, "file": str(sdist), **sdist_info}, "parameterized": PARAMETERIZED,
              "versions": versions, "test_source": source, "test_files": files,
              "deselected": DESELECT, "expected_differences": EXPECTED_DIFFERENCES}
    if not files:
        msg = ("SKIPPED: no continuous-batching test files: not in the PyPI sdist and no "
               "--tests-from / $TIERATTN_UPSTREAM_TESTS given")
        log(msg)
        result["status"] = msg
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        shutil.rmtree(dest, ignore_errors=True)
        return 0 if args.allow_missing else 3
    for f in files:
        log(f"test file {f['path']} sha256 {f['sha256']} ({f.get('known_as', f['from'])})")
    lay_out(dest)

    deselect = list(DESELECT)[:1] if args.full else list(DESELECT)
    kexpr = args.kexpr if args.kexpr is not None else " and ".join(f"not {n}" for n in deselect)
    result["deselected"] = {} if args.kexpr is not None else {n: DESELECT[n] for n in deselect}
    runs = {}
    for swap in (False, True):
        if args.only and args.only != ("swap" if swap else "plain"):
            continue
        runs["swap" if swap else "plain"] = run_pytest(dest, swap, kexpr, args.timeout, deps,
                                                       workdir, args.kv_budget_gib)
    result["runs"] = runs
    if len(runs) == 2:
        rows, regressions, missing = report(runs["plain"], runs["swap"])
        result["table"], result["regressions"], result["not_run_with_swap"] = \
            rows, regressions, missing
        rp, rs = runs["plain"]["peak_rss_mib"], runs["swap"]["peak_rss_mib"]
        result["peak_rss_ratio_swap_over_plain"] = round(rs / rp, 3) if rp else None
        width = max([len(r["test"]) for r in rows] + [10])
        print(f"\n{'test':<{width}}  {'plain':<8} {'swap':<8} {'s p/s':<12} {'RSS MiB p/s':<12} "
              "swap counters")
        for r in rows:
            if r["plain"] == r["swap"] == "skipped":
                continue
            mark = " <-- REGRESSION" if r["test"] in regressions else ""
            st = r["swap_stats"] or {}
            counters = ", ".join(f"{k}={v}" for k, v in st.items() if v and k != "models")
            rss = "/".join("-" if v is None else f"{v:.0f}" for v in r["rss_mib"])
            secs = "/".join("-" if v is None else f"{v:.0f}" for v in r["seconds"])
            print(f"{r['test']:<{width}}  {r['plain']:<8} {r['swap']:<8} {secs:<12} {rss:<12} "
                  f"{counters}{mark}")
        skipped = sum(r["plain"] == r["swap"] == "skipped" for r in rows)
        print(f"({skipped} tests skipped in both runs not listed)")
        for tag, run in runs.items():
            extra = " TIMED OUT" if run["timed_out"] else ""
            if run["killed_externally"]:
                extra += " KILLED (a SIGKILL this script did not send: out of memory?)"
            print(f"{tag:>5}: {run['counts']}  exit {run['exit_code']}{extra}  {run['seconds']} s"
                  f"  peak RSS {run['peak_rss_mib']} MiB")
        print(f"peak RSS swap/plain: {result['peak_rss_ratio_swap_over_plain']}")
        for name in regressions:
            print(f"\nREGRESSION {name}:\n{runs['swap']['tests'][name]['detail']}")
        if missing:
            print(f"\nnot run with the swap ({len(missing)}): {', '.join(missing)}")
        incomplete = [t for t, r in runs.items() if r["timed_out"] or r["killed_externally"]
                      or not r["tests"]]
        status = 1 if regressions or incomplete or missing else 0
        result["status"] = ("ok" if status == 0 else f"regressions: {regressions}; "
                            f"incomplete runs: {incomplete}; not run with swap: {len(missing)}")
    else:
        run = next(iter(runs.values()))
        print(json.dumps(run["counts"]), f"peak RSS {run['peak_rss_mib']} MiB")
        status = 0 if run["tests"] and not run["timed_out"] else 1
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        log(f"wrote {args.out}")
    if args.keep:
        log(f"kept {dest}")
    else:
        shutil.rmtree(dest, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
