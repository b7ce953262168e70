"""The benchmark scripts still run end to end (tiny workloads, a fresh database each run), and
the storage benchmark's own validity checks and dead-tuple census hold at that scale."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def run_script(name: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def storage_bench(module_fresh_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of the storage benchmark, whose report the tests below read."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = run_script("bench_storage.py", "--url", module_fresh_db_url, "--jobs", "300", "--threads", "3",
                      "--batch", "10", "--rounds", "1", "--idle-exit", "0.5", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_storage_bench_drains_every_job_exactly_once_for_both_systems_and_phases(storage_bench):
    runs = {(r["system"], r["phase"]): r for r in storage_bench["results"]}
    assert set(runs) == {(s, p) for s in ("qstore", "classic") for p in ("clean", "pinned")}
    for r in runs.values():
        assert (r["drain"]["jobs"], r["drain"]["duplicates"], r["problems"]) == (300, 0, [])
    assert storage_bench["problems"] == []
    targets = storage_bench["summary"]["targets"]
    assert set(targets) == {"clean_drain_ratio", "pinned_drain_ratio", "copy_enqueue_jobs_per_s",
                            "pinned_dead_pct"}
    assert {t["result"] for t in targets.values()} <= {"PASS", "FAIL"}


def test_storage_bench_counts_no_dead_tuples_in_qstore_tables_under_a_pinned_horizon(storage_bench):
    if storage_bench["dead_tuple_source"] != "pgstattuple":
        pytest.skip("exact dead-tuple counts need pgstattuple on the server")
    runs = {(r["system"], r["phase"]): r for r in storage_bench["results"]}
    qstore = runs["qstore", "pinned"]["dead_tuples"]
    # the Alembic version row is rewritten by the install's upgrades; nothing else may be dead
    assert {name: f["dead"] for name, f in qstore.items()
            if f["dead"] and name != "qstore_alembic_version"} == {}
    # the classic queue leaves its update and its delete of every job behind the pin
    assert runs["classic", "pinned"]["dead_total"] == 2 * 300


def test_steady_bench_runs_all_three_phases_for_both_systems(fresh_db_url, tmp_path):
    out = tmp_path / "steady.json"
    proc = run_script("bench_steady.py", "--url", fresh_db_url, "--rate", "200", "--duration", "3",
                      "--workers", "2", "--sample", "0.5", "--json", str(out),
                      "--plot", str(tmp_path / "steady.png"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["errors"] == {"qstore": [], "classic": []}
