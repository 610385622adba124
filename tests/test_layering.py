"""The planes stay apart: import-linter checks the contracts in pyproject.toml.

No plane imports another's internals; what two planes share (block hashing, engine
protocol helpers, process plumbing, the gRPC API) lives in a neutral package that
imports no plane. A new cross-plane import makes this test fail with the import chain.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is a test dependency (pyproject [test] extra)"
    proc = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout
