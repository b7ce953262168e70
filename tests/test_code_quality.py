"""The published package (it ships ``py.typed``) and the benchmark scripts type-check, and the
sources are lint-clean.

Both gates run the tools' Python entry points on the repository checkout, so CI enforces
them through the same test command as everything else.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mypy import api as mypy_api

ROOT = Path(__file__).resolve().parent.parent


def test_package_and_benchmark_scripts_type_check_clean_under_mypy() -> None:
    out, err, status = mypy_api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                     "--no-incremental", str(ROOT / "qstore"), str(ROOT / "scripts")])
    assert status == 0, out + err


def test_sources_are_ruff_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "qstore", "tests",
                           "scripts", "alembic"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
