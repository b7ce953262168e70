"""The published package (it ships ``py.typed``) and the benchmark scripts type-check, and the
sources are lint-clean.

Both gates run the tools' Python entry points on the repository checkout, so CI enforces
them through the same test command as everything else. mypy runs incrementally, with its
cache in the system temp dir under a name keyed by this checkout's path and the mypy and
Python versions: the first run in a checkout takes ~20 s, later ones ~1 s, and mypy
re-checks whatever changed since (its cache records each file's hash and its dependencies).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

from mypy import api as mypy_api
from mypy.version import __version__ as mypy_version

ROOT = Path(__file__).resolve().parent.parent


def mypy_cache_dir() -> Path:
    """A cache directory of this checkout's own (two checkouts never share one) that outlives
    the test run."""
    key = f"{ROOT}|{mypy_version}|{sys.version_info[:3]}"
    return Path(tempfile.gettempdir()) / f"qstore-mypy-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def test_package_and_benchmark_scripts_type_check_clean_under_mypy() -> None:
    out, err, status = mypy_api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                     "--cache-dir", str(mypy_cache_dir()),
                                     str(ROOT / "qstore"), str(ROOT / "scripts")])
    assert status == 0, out + err


def test_sources_are_ruff_clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "qstore", "tests",
                           "scripts", "alembic"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
