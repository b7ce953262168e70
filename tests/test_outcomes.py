"""Worker outcomes of a live attempt: every transition out of
``running`` and into / out of the deferred backlog, stale outcomes, and follow-up jobs
committed (or rolled back) together with the outcome on the caller's transaction."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
from jobtools import (
    BACKLOG,
    add,
    both_receipt_modes,
    census,
    claim,
    count,
    install_in_mode,
    params,
    running,
    state,
)
from sqlalchemy import text
from sqlalchemy.orm import Session

from qstore import QueueStorageConfig
from qstore.schema import storage_schema
from qstore.storage.planes import queue as queue_plane
from qstore.types import JobState

UTC = timezone.utc


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def st(request, make_storage):
    """A default install; in tests marked ``both_receipt_modes()``, one with receipts on,
    then one with receipts off (every attempt a lease)."""
    return install_in_mode(request, make_storage)


def seconds(d: timedelta) -> float:
    return d.total_seconds()


# -- insert and promotion --------------------------------------------------------------------


def test_enqueue_without_run_at_makes_the_job_available(engine, st):
    job_id = add(engine, st)
    row = st.load_job(engine, job_id)
    assert row.state == JobState.AVAILABLE
    assert (row.attempt, row.run_lease) == (0, 0)


def test_enqueue_with_future_run_at_makes_the_job_scheduled(engine, st):
    at = datetime.now(UTC) + timedelta(hours=1)
    job_id = add(engine, st, run_at=at)
    row = st.load_job(engine, job_id)
    assert row.state == JobState.SCHEDULED
    assert row.run_at == at
    assert st.claim_runtime_batch(engine, "q", 5) == []


def test_enqueue_with_past_run_at_is_scheduled_until_promoted(engine, st):
    job_id = add(engine, st, run_at=datetime.now(UTC) - timedelta(seconds=1))
    assert state(engine, st, job_id) == JobState.SCHEDULED
    assert st.claim_runtime_batch(engine, "q", 5) == []


def test_promote_due_moves_a_due_scheduled_job_to_available(engine, st):
    job_id = add(engine, st, run_at=datetime.now(UTC) - timedelta(seconds=1))
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    assert state(engine, st, job_id) == JobState.AVAILABLE
    assert count(engine, st, BACKLOG) == 0
    assert claim(engine, st).job.id == job_id


def test_promote_due_leaves_a_future_scheduled_job_deferred(engine, st):
    job_id = add(engine, st, run_at=datetime.now(UTC) + timedelta(hours=1))
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 0
    assert state(engine, st, job_id) == JobState.SCHEDULED


def test_promote_due_only_moves_the_requested_state(engine, st):
    job_id = add(engine, st, run_at=datetime.now(UTC) - timedelta(seconds=1))
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 0
    assert st.promote_due(engine, JobState.AVAILABLE, 10) == 0
    assert state(engine, st, job_id) == JobState.SCHEDULED


def test_promote_due_honours_batch_size(engine, st):
    past = datetime.now(UTC) - timedelta(seconds=1)
    st.enqueue_params_batch(engine, [params(run_at=past, args={"i": i}) for i in range(3)])
    assert st.promote_due(engine, JobState.SCHEDULED, 2) == 2
    assert count(engine, st, BACKLOG) == 1


def test_promote_due_moves_a_due_retryable_job_to_available_keeping_attempt_and_run_lease(engine, st):
    c = running(engine, st)
    st.retry_after(engine, c.job.id, c.job.run_lease, 0)
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 1
    row = st.load_job(engine, c.job.id)
    assert row.state == JobState.AVAILABLE
    assert (row.attempt, row.run_lease) == (1, 1)


@pytest.mark.parametrize("deferred_state", [JobState.SCHEDULED, JobState.RETRYABLE])
def test_promote_due_does_not_promote_jobs_of_a_paused_queue(engine, st, deferred_state):
    if deferred_state == JobState.SCHEDULED:
        job_id = add(engine, st, run_at=datetime.now(UTC) - timedelta(seconds=1))
    else:
        c = running(engine, st)
        job_id = c.job.id
        st.retry_after(engine, job_id, c.job.run_lease, 0)
    st.set_queue_options(engine, "q", paused=True)

    assert st.promote_due(engine, deferred_state, 10) == 0
    assert state(engine, st, job_id) == deferred_state

    st.set_queue_options(engine, "q", paused=False)
    assert st.promote_due(engine, deferred_state, 10) == 1
    assert state(engine, st, job_id) == JobState.AVAILABLE


# -- available -> running -> ... --------------------------------------------------------------


def test_claim_moves_available_to_running_bumping_attempt_and_run_lease(engine, st):
    job_id = add(engine, st)
    c = claim(engine, st)
    assert c.job.id == job_id
    assert c.job.state == JobState.RUNNING
    assert (c.job.attempt, c.job.run_lease) == (1, 1)
    row = st.load_job(engine, job_id)
    assert (row.state, row.attempt, row.run_lease) == (JobState.RUNNING, 1, 1)


def test_complete_moves_running_to_completed(engine, st):
    c = running(engine, st)
    assert st.complete_runtime_batch(engine, [c]) == [(c.job.id, 1)]
    row = st.load_job(engine, c.job.id)
    assert row.state == JobState.COMPLETED
    assert row.finalized_at is not None


@both_receipt_modes()
def test_complete_twice_completes_once(engine, st):
    c = running(engine, st)
    assert st.complete_runtime_batch(engine, [c]) == [(c.job.id, 1)]
    before = census(engine, st)
    assert st.complete_runtime_batch(engine, [c]) == []
    assert st.complete_job_batch_by_id(engine, [(c.job.id, 1)]) == []
    assert census(engine, st) == before


def test_retry_after_moves_running_to_retryable_due_after_the_delay(engine, st):
    c = running(engine, st)
    row = st.retry_after(engine, c.job.id, c.job.run_lease, timedelta(seconds=30))
    assert row.state == JobState.RETRYABLE
    assert (row.attempt, row.run_lease) == (1, 1)
    assert 29 <= seconds(row.run_at - row.finalized_at) <= 31
    loaded = st.load_job(engine, c.job.id)
    assert loaded.state == JobState.RETRYABLE
    assert loaded.run_at == row.run_at
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 0


def test_fail_retryable_moves_running_to_retryable_with_backoff_and_error_entry(engine, st):
    c = running(engine, st, max_attempts=5)
    row = st.fail_retryable(engine, c.job.id, c.job.run_lease, "boom")
    assert row.state == JobState.RETRYABLE
    # backoff after attempt 1: 2^1 s * [1, 1.25]
    assert 1.9 <= seconds(row.run_at - row.finalized_at) <= 2.6
    assert len(row.errors) == 1
    assert row.errors[0]["error"] == "boom"
    assert row.errors[0]["attempt"] == 1
    assert "terminal" not in row.errors[0]
    assert state(engine, st, c.job.id) == JobState.RETRYABLE


def test_fail_retryable_on_the_last_attempt_fails_the_job(engine, st):
    c = running(engine, st, max_attempts=1)
    row = st.fail_retryable(engine, c.job.id, c.job.run_lease, "boom")
    assert row.state == JobState.FAILED
    assert row.errors[-1]["terminal"] is True
    assert state(engine, st, c.job.id) == JobState.FAILED
    assert count(engine, st, BACKLOG) == 0
    assert count(engine, st, "dlq_entries") == 0


def test_fail_retryable_on_the_last_attempt_goes_to_the_dlq_when_the_queue_policy_is_on(engine, st):
    st.set_queue_options(engine, "q", dlq_enabled=True)
    c = running(engine, st, max_attempts=1)
    row = st.fail_retryable(engine, c.job.id, c.job.run_lease, "boom")
    assert row.state == JobState.FAILED
    assert count(engine, st, "dlq_entries", f"job_id = {c.job.id}") == 1
    assert count(engine, st, "done_entries", "state = 'failed'") == 0
    assert state(engine, st, c.job.id) == JobState.FAILED


def test_fail_retryable_before_exhaustion_ignores_the_dlq_policy(engine, st):
    st.set_queue_options(engine, "q", dlq_enabled=True)
    c = running(engine, st, max_attempts=2)
    assert st.fail_retryable(engine, c.job.id, c.job.run_lease, "boom").state == JobState.RETRYABLE
    assert count(engine, st, "dlq_entries") == 0


def test_snooze_moves_running_to_scheduled_giving_back_the_attempt(engine, st):
    c = running(engine, st)
    row = st.snooze(engine, c.job.id, c.job.run_lease, timedelta(seconds=30))
    assert row.state == JobState.SCHEDULED
    assert (row.attempt, row.run_lease) == (0, 1)
    assert row.finalized_at is None
    loaded = st.load_job(engine, c.job.id)
    assert (loaded.state, loaded.attempt) == (JobState.SCHEDULED, 0)


def test_snoozed_job_is_claimed_again_with_the_same_attempt_number(engine, st):
    c = running(engine, st)
    st.snooze(engine, c.job.id, c.job.run_lease, 0)
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    again = claim(engine, st)
    assert (again.job.attempt, again.job.run_lease) == (1, 2)


def test_cancel_running_moves_running_to_cancelled_with_the_reason(engine, st):
    c = running(engine, st)
    row = st.cancel_running(engine, c.job.id, c.job.run_lease, "user asked")
    assert row.state == JobState.CANCELLED
    assert row.errors[-1]["error"] == "cancelled: user asked"
    assert "terminal" not in row.errors[-1]
    assert state(engine, st, c.job.id) == JobState.CANCELLED


def test_fail_terminal_moves_running_to_failed_with_a_terminal_error(engine, st):
    c = running(engine, st, max_attempts=10)
    row = st.fail_terminal(engine, c.job.id, c.job.run_lease, "fatal")
    assert row.state == JobState.FAILED
    assert row.errors[-1]["error"] == "fatal"
    assert row.errors[-1]["terminal"] is True
    assert state(engine, st, c.job.id) == JobState.FAILED


def test_fail_to_dlq_moves_running_into_the_dlq(engine, st):
    c = running(engine, st, max_attempts=10)
    row = st.fail_to_dlq(engine, c.job.id, c.job.run_lease, "poison", "bad input")
    assert row.state == JobState.FAILED
    with engine.connect() as conn:
        dlq = conn.execute(text(
            f'SELECT dlq_reason, original_run_lease, state FROM "{st.schema()}".dlq_entries')).one()
    assert tuple(dlq) == ("poison", 1, "failed")
    assert count(engine, st, "done_entries") == 0
    assert state(engine, st, c.job.id) == JobState.FAILED


@pytest.mark.parametrize("outcome", ["retry_after", "snooze", "cancel_running", "fail_terminal"])
def test_caller_progress_is_persisted_with_the_outcome(engine, st, outcome):
    c = running(engine, st)
    args = {"retry_after": (0,), "snooze": (60,), "cancel_running": ("r",), "fail_terminal": ("e",)}[outcome]
    row = getattr(st, outcome)(engine, c.job.id, c.job.run_lease, *args, progress={"done": 7})
    assert row.progress == {"done": 7}
    assert st.load_job(engine, c.job.id).progress == {"done": 7}


def test_completion_drops_progress(engine, st):
    c = running(engine, st)
    st.flush_progress(engine, c.job.id, c.job.run_lease, {"done": 3})
    st.complete_runtime_batch(engine, [c])
    assert st.load_job(engine, c.job.id).progress is None


# -- stale and illegal outcomes -----------------------------------------------------------------

OUTCOMES = {
    "retry_after": lambda s, e, j, r: s.retry_after(e, j, r, 0),
    "snooze": lambda s, e, j, r: s.snooze(e, j, r, 0),
    "cancel_running": lambda s, e, j, r: s.cancel_running(e, j, r, "x"),
    "fail_terminal": lambda s, e, j, r: s.fail_terminal(e, j, r, "x"),
    "fail_to_dlq": lambda s, e, j, r: s.fail_to_dlq(e, j, r, "x", "y"),
    "fail_retryable": lambda s, e, j, r: s.fail_retryable(e, j, r, "x"),
}


@pytest.mark.parametrize("outcome", sorted(OUTCOMES))
@both_receipt_modes()
def test_outcome_on_a_completed_attempt_returns_none_and_changes_nothing(engine, st, outcome):
    c = running(engine, st)
    st.complete_runtime_batch(engine, [c])
    before = census(engine, st)
    assert OUTCOMES[outcome](st, engine, c.job.id, c.job.run_lease) is None
    assert census(engine, st) == before
    assert state(engine, st, c.job.id) == JobState.COMPLETED


@pytest.mark.parametrize("outcome", sorted(OUTCOMES))
@both_receipt_modes()
def test_outcome_with_a_wrong_run_lease_returns_none_and_changes_nothing(engine, st, outcome):
    c = running(engine, st)
    before = census(engine, st)
    assert OUTCOMES[outcome](st, engine, c.job.id, c.job.run_lease + 1) is None
    assert OUTCOMES[outcome](st, engine, c.job.id, c.job.run_lease - 1) is None
    assert census(engine, st) == before
    assert state(engine, st, c.job.id) == JobState.RUNNING


@pytest.mark.parametrize("outcome", sorted(OUTCOMES))
@both_receipt_modes()
def test_second_outcome_on_the_same_attempt_returns_none(engine, st, outcome):
    c = running(engine, st)
    assert st.retry_after(engine, c.job.id, c.job.run_lease, 3600) is not None
    before = census(engine, st)
    assert OUTCOMES[outcome](st, engine, c.job.id, c.job.run_lease) is None
    assert census(engine, st) == before
    assert state(engine, st, c.job.id) == JobState.RETRYABLE


@both_receipt_modes()
def test_outcome_of_an_unknown_job_returns_none(engine, st):
    assert st.fail_terminal(engine, 987654, 1, "x") is None


# -- follow-up jobs in the same commit ------------------------------------------------------------


def test_completion_and_follow_up_enqueue_on_one_connection_commit_together(engine, st):
    c = running(engine, st)
    with engine.connect() as conn, conn.begin():
        assert st.complete_job_batch_by_id(conn, [(c.job.id, c.job.run_lease)]) == [(c.job.id, 1)]
        assert st.enqueue_params_batch(conn, [params("follow_up", queue="next")]) == 1
    assert state(engine, st, c.job.id) == JobState.COMPLETED
    follow = claim(engine, st, "next")
    assert follow.job.kind == "follow_up"


def test_completion_and_follow_up_enqueue_on_one_connection_roll_back_together(engine, st):
    c = running(engine, st)
    with engine.connect() as conn, pytest.raises(RuntimeError), conn.begin():
        st.complete_job_batch_by_id(conn, [(c.job.id, c.job.run_lease)])
        st.enqueue_params_batch(conn, [params("follow_up", queue="next")])
        raise RuntimeError("handler failed after enqueueing its follow-up")
    assert state(engine, st, c.job.id) == JobState.RUNNING
    assert st.claim_runtime_batch(engine, "next", 5) == []
    # the attempt is still live and can be completed for real
    assert st.complete_runtime_batch(engine, [c]) == [(c.job.id, 1)]


def test_explicit_rollback_discards_completion_and_follow_up(engine, st):
    c = running(engine, st)
    with engine.connect() as conn:
        conn.begin()
        st.complete_job_batch_by_id_in_tx(conn, [(c.job.id, c.job.run_lease)])
        st.enqueue_params_batch(conn, [params("follow_up", queue="next")])
        conn.rollback()
    assert state(engine, st, c.job.id) == JobState.RUNNING
    assert count(engine, st, "ready_entries", "queue = 'next'") == 0


def test_completion_and_follow_up_on_an_orm_session_commit_together(engine, st):
    c = running(engine, st)
    with Session(engine) as session:
        st.complete_job_batch_by_id(session, [(c.job.id, c.job.run_lease)])
        st.enqueue_params_batch(session, [params("follow_up", queue="next")])
        assert state(engine, st, c.job.id) == JobState.RUNNING  # not visible before commit
        session.commit()
    assert state(engine, st, c.job.id) == JobState.COMPLETED
    assert claim(engine, st, "next").job.kind == "follow_up"


def test_completion_and_follow_up_on_an_orm_session_roll_back_together(engine, st):
    c = running(engine, st)
    with Session(engine) as session:
        st.complete_job_batch_by_id(session, [(c.job.id, c.job.run_lease)])
        st.enqueue_params_batch(session, [params("follow_up", queue="next")])
        session.rollback()
    assert state(engine, st, c.job.id) == JobState.RUNNING
    assert st.claim_runtime_batch(engine, "next", 5) == []


@pytest.mark.parametrize("commit", [True, False])
def test_fail_retryable_in_tx_and_follow_up_share_the_callers_fate(engine, st, commit):
    c = running(engine, st)
    with engine.connect() as conn:
        conn.begin()
        row = st.fail_retryable_in_tx(conn, c.job.id, c.job.run_lease, "boom")
        assert row.state == JobState.RETRYABLE
        st.enqueue_params_batch(conn, [params("compensate", queue="next")])
        conn.commit() if commit else conn.rollback()
    if commit:
        assert state(engine, st, c.job.id) == JobState.RETRYABLE
        assert claim(engine, st, "next").job.kind == "compensate"
    else:
        assert state(engine, st, c.job.id) == JobState.RUNNING
        assert count(engine, st, "ready_entries", "queue = 'next'") == 0
        assert count(engine, st, BACKLOG) == 0


@pytest.mark.parametrize("commit", [True, False])
def test_retry_after_in_tx_on_a_session_and_follow_up_share_the_callers_fate(engine, st, commit):
    c = running(engine, st)
    with Session(engine) as session:
        row = st.retry_after_in_tx(session, c.job.id, c.job.run_lease, 60)
        assert row.state == JobState.RETRYABLE
        st.enqueue_params_batch(session, [params("later", queue="next")])
        session.commit() if commit else session.rollback()
    expected = JobState.RETRYABLE if commit else JobState.RUNNING
    assert state(engine, st, c.job.id) == expected
    assert count(engine, st, "ready_entries", "queue = 'next'") == (1 if commit else 0)


@both_receipt_modes()
def test_stale_outcome_in_a_caller_transaction_returns_none_and_leaves_the_transaction_usable(engine, st):
    c = running(engine, st)
    st.complete_runtime_batch(engine, [c])
    with engine.connect() as conn:
        conn.begin()
        assert st.fail_retryable_in_tx(conn, c.job.id, c.job.run_lease, "late") is None
        st.enqueue_params_batch(conn, [params("other", queue="next")])
        conn.commit()
    assert state(engine, st, c.job.id) == JobState.COMPLETED
    assert count(engine, st, "ready_entries", "queue = 'next'") == 1


# -- regressions ---------------------------------------------------------------------------


def test_two_schemas_on_one_engine_draw_job_ids_from_their_own_sequences(engine, st):
    other = QueueStorageConfig(schema=f"t_{uuid.uuid4().hex[:8]}")
    with engine.begin() as c:  # just enough of a second install: its job id sequence
        c.execute(text(f'CREATE SCHEMA "{other.schema}"'))
        c.execute(text(f'CREATE SEQUENCE "{other.schema}".job_id_seq'))
    try:
        assert add(engine, st) == 1
        with engine.begin() as c:
            ids = c.execute(queue_plane.statements(storage_schema(other)).ids, {"n": 1}).scalars().all()
        assert ids == [1]
        assert add(engine, st) == 2
    finally:
        with engine.begin() as c:
            c.execute(text(f'DROP SCHEMA "{other.schema}" CASCADE'))
