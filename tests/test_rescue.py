"""Rescue: stale heartbeats and expired deadlines close the old attempt (its lease and its
receipt, in one transaction) before the job can run again, so the rescued worker's late
writes change nothing; exhausted attempts end failed (or in the DLQ) instead of looping."""

from __future__ import annotations

import time
from datetime import timezone

import pytest
from jobtools import (
    BACKLOG,
    both_receipt_modes,
    census,
    claim,
    count,
    install_in_mode,
    running,
    state,
)
from sqlalchemy import text

from qstore import ValidationError
from qstore.types import ClaimedRuntimeJob, JobState

UTC = timezone.utc


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def st(request, make_storage):
    """A default install; in tests marked ``both_receipt_modes()``, one with receipts on,
    then one with receipts off (every attempt a lease)."""
    return install_in_mode(request, make_storage)


def rescue_heartbeat(engine, s, job_id: int) -> list:
    time.sleep(0.02)
    return [r for r in s.rescue_stale_heartbeats(engine, 0.01) if r.id == job_id]


def rescue_deadline(engine, s, job_id: int) -> list:
    time.sleep(0.02)
    return [r for r in s.rescue_expired_deadlines(engine) if r.id == job_id]


RESCUES = {"heartbeat": rescue_heartbeat, "deadline": rescue_deadline}


def doomed(engine, s, kind: str, lease: bool = False, **opts: object) -> ClaimedRuntimeJob:
    """A running attempt that the ``kind`` rescue will pick up (deadline 1 ms for deadline).
    ``lease``: materialise the attempt's lease first (as registering a callback does)."""
    c = running(engine, s, deadline=0.001 if kind == "deadline" else None, **opts)
    if lease:
        s.register_callback(engine, c.job.id, c.job.run_lease, 3600)
    return c


# -- what rescue does ------------------------------------------------------------------------


def test_stale_heartbeat_rescue_moves_a_receipt_only_attempt_to_retryable(engine, st):
    c = doomed(engine, st, "heartbeat")
    [row] = rescue_heartbeat(engine, st, c.job.id)
    assert (row.state, row.attempt, row.run_lease) == (JobState.RETRYABLE, 1, 1)
    assert row.errors[-1]["error"] == "receipt claim stale"
    assert state(engine, st, c.job.id) == JobState.RETRYABLE
    assert count(engine, st, "lease_claim_closures", f"job_id = {c.job.id} AND outcome = 'rescued'") == 1


def test_stale_heartbeat_rescue_moves_a_lease_backed_attempt_to_retryable_closing_lease_and_receipt(engine, st):
    c = doomed(engine, st, "heartbeat", lease=True)
    [row] = rescue_heartbeat(engine, st, c.job.id)
    assert row.state == JobState.RETRYABLE
    assert row.errors[-1]["error"] == "heartbeat stale"
    assert count(engine, st, "leases") == 0
    assert count(engine, st, "lease_claim_closures", f"job_id = {c.job.id}") == 1  # the receipt is closed too


def test_stale_heartbeat_rescue_leaves_a_fresh_attempt_alone(engine, st):
    c = running(engine, st)
    assert st.rescue_stale_heartbeats(engine, 3600) == []
    assert state(engine, st, c.job.id) == JobState.RUNNING


def test_deadline_rescue_moves_an_overdue_attempt_to_retryable(engine, st):
    c = doomed(engine, st, "deadline")
    [row] = rescue_deadline(engine, st, c.job.id)
    assert row.state == JobState.RETRYABLE
    assert row.errors[-1]["error"] == "hard deadline exceeded"
    assert count(engine, st, "lease_claim_closures", f"job_id = {c.job.id} AND outcome = 'deadline_expired'") == 1


def test_deadline_rescue_moves_an_overdue_lease_backed_attempt_to_retryable(engine, st):
    c = doomed(engine, st, "deadline", lease=True)
    [row] = rescue_deadline(engine, st, c.job.id)
    assert row.state == JobState.RETRYABLE
    assert count(engine, st, "leases") == 0


def test_deadline_rescue_leaves_attempts_without_a_deadline_or_within_it_alone(engine, st):
    a = running(engine, st)
    b = running(engine, st, deadline=3600)
    time.sleep(0.02)
    assert st.rescue_expired_deadlines(engine) == []
    assert state(engine, st, a.job.id) == state(engine, st, b.job.id) == JobState.RUNNING


def test_rescue_backoff_makes_the_job_due_later(engine, st):
    c = doomed(engine, st, "heartbeat", max_attempts=5)
    [row] = rescue_heartbeat(engine, st, c.job.id)
    assert 1.9 <= (row.run_at - row.finalized_at).total_seconds() <= 2.6
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 0


# -- stale writers after rescue (I3) ------------------------------------------------------------


@pytest.mark.parametrize("lease", [False, True], ids=["as_claimed", "callback_lease"])
@pytest.mark.parametrize("kind", sorted(RESCUES))
@both_receipt_modes()
def test_rescued_workers_late_writes_change_nothing(engine, st, kind, lease):
    c = doomed(engine, st, kind, lease=lease)
    assert RESCUES[kind](engine, st, c.job.id)
    before = census(engine, st)
    j, r = c.job.id, c.job.run_lease

    assert st.complete_runtime_batch(engine, [c]) == []
    assert st.complete_job_batch_by_id(engine, [(j, r)]) == []
    assert st.heartbeat_batch(engine, [(j, r)]) == 0
    assert st.heartbeat_progress_batch(engine, [(j, r, {"p": 1})]) == 0
    st.flush_progress(engine, j, r, {"p": 1})
    assert st.fail_retryable(engine, j, r, "late") is None
    assert st.retry_after(engine, j, r, 0) is None
    assert st.snooze(engine, j, r, 0) is None
    assert st.cancel_running(engine, j, r, "late") is None
    assert st.fail_terminal(engine, j, r, "late") is None
    assert st.fail_to_dlq(engine, j, r, "late", "late") is None
    with pytest.raises(ValidationError):
        st.register_callback(engine, j, r, 60)

    assert census(engine, st) == before
    row = st.load_job(engine, j)
    assert (row.state, row.run_lease) == (JobState.RETRYABLE, 1)


@pytest.mark.parametrize("kind", sorted(RESCUES))
@both_receipt_modes()
def test_rescued_job_is_reclaimed_with_the_next_run_lease_and_completed_by_the_new_worker(engine, st, kind):
    old = doomed(engine, st, kind)
    RESCUES[kind](engine, st, old.job.id)
    with engine.begin() as c:  # make the backoff due now
        c.execute(text(f'UPDATE "{st.schema()}".deferred_jobs SET run_at = clock_timestamp()'))
        c.execute(text(f'UPDATE "{st.schema()}".deferred_wheel SET run_at = clock_timestamp()'))
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 1
    new = claim(engine, st)
    assert (new.job.id, new.job.run_lease, new.job.attempt) == (old.job.id, 2, 2)

    assert st.complete_runtime_batch(engine, [old]) == []  # the old worker still loses
    assert st.heartbeat_batch(engine, [(old.job.id, 1)]) == 0
    assert state(engine, st, old.job.id) == JobState.RUNNING

    assert st.complete_runtime_batch(engine, [new]) == [(old.job.id, 2)]
    assert state(engine, st, old.job.id) == JobState.COMPLETED


# -- exhaustion: a rescued attempt that used its last try ends, never loops ----------------------------


@pytest.mark.parametrize("lease", [False, True], ids=["as_claimed", "callback_lease"])
@pytest.mark.parametrize("kind", sorted(RESCUES))
def test_rescue_of_an_exhausted_attempt_fails_the_job(engine, st, kind, lease):
    c = doomed(engine, st, kind, lease=lease, max_attempts=1)
    [row] = RESCUES[kind](engine, st, c.job.id)
    assert row.state == JobState.FAILED
    assert row.errors[-1]["terminal"] is True
    assert state(engine, st, c.job.id) == JobState.FAILED
    assert count(engine, st, BACKLOG) == 0
    assert count(engine, st, "leases") == 0


@pytest.mark.parametrize("kind", sorted(RESCUES))
def test_rescue_of_an_exhausted_attempt_moves_it_to_the_dlq_when_the_queue_policy_is_on(engine, st, kind):
    st.set_queue_options(engine, "q", dlq_enabled=True)
    c = doomed(engine, st, kind, max_attempts=1)
    [row] = RESCUES[kind](engine, st, c.job.id)
    assert row.state == JobState.FAILED
    assert count(engine, st, "dlq_entries", f"job_id = {c.job.id}") == 1
    assert count(engine, st, "done_entries", f"job_id = {c.job.id}") == 0
    assert count(engine, st, BACKLOG) == 0


def test_rescue_does_not_loop_an_exhausted_job(engine, st):
    c = doomed(engine, st, "heartbeat", max_attempts=1)
    rescue_heartbeat(engine, st, c.job.id)
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 0
    assert st.claim_runtime_batch(engine, "q", 5) == []
    assert rescue_heartbeat(engine, st, c.job.id) == []


@pytest.mark.parametrize(("statement", "bound"), [
    ("overdue_leases", "deadline_at < statement_timestamp()"),
    ("timed_out", "callback_timeout_at < statement_timestamp()"),
])
def test_rescue_finds_overdue_attempts_through_an_index(engine, st, statement: str, bound: str) -> None:
    """The deadline and timeout bounds are index conditions (a stable clock), so a rescue
    tick reads the overdue attempts, not every live one."""
    from qstore.storage.upkeep.rescue import _statements

    compiled = getattr(_statements(st.tables), statement).compile(engine)
    with engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")
        plan = "\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + str(compiled), {**compiled.params, "limit": 10}))
    assert any("Index Cond" in line and bound in line for line in plan.splitlines()), plan
