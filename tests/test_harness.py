"""The test harness itself: a crashing kernel case is attributed to itself, figures are printed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_crashing_case_is_attributed_to_itself(tmp_path):
    # the same runner as the README (xdist): a hard crash (like an out-of-bounds store under the
    # interpreter) kills one worker and is reported against the test that caused it
    (tmp_path / "test_crash.py").write_text(textwrap.dedent("""
        import os
        def test_fine():
            pass
        def test_kernel_that_crashes():
            os.abort()
    """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_crash.py")],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert run.returncode != 0
    assert "test_kernel_that_crashes" in run.stdout
    assert "1 failed, 1 passed" in run.stdout.splitlines()[-1]
