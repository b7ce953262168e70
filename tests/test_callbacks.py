"""External callbacks: register / wait / resolve / resume / retry,
timeouts and their rescue, unknown and stale tokens, and the complete-vs-timeout race."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta, timezone

import pytest
from jobtools import BACKLOG, census, claim, count, running, state

from qstore import CallbackNotFoundError, ValidationError
from qstore.types import CallbackConfig, ClaimedRuntimeJob, JobState

UTC = timezone.utc


# -- helpers ----------------------------------------------------------------------------------
















def waiting(engine, s, timeout: float = 60, **opts: object) -> tuple[ClaimedRuntimeJob, uuid.UUID]:
    """A claimed job parked on a fresh callback token."""
    c = running(engine, s, **opts)
    token = s.register_callback(engine, c.job.id, c.job.run_lease, timeout)
    assert s.enter_callback_wait(engine, c.job.id, c.job.run_lease, token) is True
    return c, token


# -- register / wait -------------------------------------------------------------------------


def test_register_callback_returns_a_random_uuid4_and_materialises_the_lease(engine, st):
    c = running(engine, st)
    token = st.register_callback(engine, c.job.id, 1, 60)
    assert isinstance(token, uuid.UUID) and token.version == 4
    assert count(engine, st, "leases", f"job_id = {c.job.id} AND run_lease = 1 AND state = 'running'") == 1
    assert count(engine, st, "lease_claims", f"job_id = {c.job.id} AND materialized_at IS NOT NULL") == 1
    row = st.load_job(engine, c.job.id)
    assert (row.state, row.callback_id) == (JobState.RUNNING, token)
    assert row.callback_timeout_at is not None


def test_a_newer_registration_replaces_the_token(engine, st):
    c = running(engine, st)
    old = st.register_callback(engine, c.job.id, 1, 60)
    new = st.register_callback(engine, c.job.id, 1, 60)
    assert old != new
    assert count(engine, st, "leases") == 1
    with pytest.raises(CallbackNotFoundError):
        st.complete_external(engine, old, {})
    assert st.complete_external(engine, new, {}).state == JobState.COMPLETED


def test_register_callback_on_a_finished_attempt_raises_validation_error(engine, st):
    c = running(engine, st)
    st.complete_runtime_batch(engine, [c])
    with pytest.raises(ValidationError, match="not in running state"):
        st.register_callback(engine, c.job.id, 1, 60)
    assert count(engine, st, "leases") == 0


def test_register_callback_on_a_finished_attempt_is_refused_as_a_stale_attempt(engine, st):
    from qstore import StaleAttemptError

    c = running(engine, st)
    st.complete_runtime_batch(engine, [c])
    with pytest.raises(StaleAttemptError) as err:
        st.register_callback(engine, c.job.id, 1, 60)
    assert isinstance(err.value, ValidationError)
    assert (err.value.field, err.value.value) == ("job", (c.job.id, 1))
    assert (err.value.job_id, err.value.run_lease) == (c.job.id, 1)


def test_register_callback_with_a_wrong_run_lease_raises_validation_error(engine, st):
    c = running(engine, st)
    with pytest.raises(ValidationError):
        st.register_callback(engine, c.job.id, 2, 60)
    assert count(engine, st, "leases") == 0


@pytest.mark.parametrize("field", ["filter", "on_complete", "on_fail", "transform"])
def test_register_callback_with_a_cel_expression_raises_validation_error(engine, st, field):
    c = running(engine, st)
    with pytest.raises(ValidationError, match="CEL"):
        st.register_callback_with_config(engine, c.job.id, 1, 60, CallbackConfig(**{field: "payload.ok"}))
    assert count(engine, st, "leases") == 0
    assert state(engine, st, c.job.id) == JobState.RUNNING


def test_register_callback_with_an_empty_config_registers(engine, st):
    c = running(engine, st)
    token = st.register_callback_with_config(engine, c.job.id, 1, 60, CallbackConfig(filter="  "))
    assert st.callback_job(engine, token).id == c.job.id


def test_enter_callback_wait_moves_running_to_waiting_external(engine, st):
    c = running(engine, st, deadline=None)
    token = st.register_callback(engine, c.job.id, 1, 60)
    assert st.enter_callback_wait(engine, c.job.id, 1, token) is True
    row = st.load_job(engine, c.job.id)
    assert (row.state, row.callback_id, row.deadline_at) == (JobState.WAITING_EXTERNAL, token, None)


def test_wait_for_callback_registers_a_token_and_parks_the_attempt_in_one_call(engine, st):
    c = running(engine, st, deadline=None)
    token = st.wait_for_callback(engine, c.job.id, 1, 60)
    assert isinstance(token, uuid.UUID) and token.version == 4
    row = st.load_job(engine, c.job.id)
    assert (row.state, row.callback_id) == (JobState.WAITING_EXTERNAL, token)
    assert st.complete_external(engine, token, {"ok": 1}).state == JobState.COMPLETED


def test_wait_for_callback_parks_the_attempt_on_the_token_it_registered_before(engine, st):
    c = running(engine, st)
    token = st.register_callback(engine, c.job.id, 1, 60)
    assert st.wait_for_callback(engine, c.job.id, 1, 60, callback_id=token) == token
    assert st.load_job(engine, c.job.id).state == JobState.WAITING_EXTERNAL
    assert count(engine, st, "leases") == 1


def test_wait_for_callback_on_another_token_or_a_finished_attempt_is_none_and_writes_nothing(engine, st):
    c = running(engine, st)
    st.register_callback(engine, c.job.id, 1, 60)
    assert st.wait_for_callback(engine, c.job.id, 1, 60, callback_id=uuid.uuid4()) is None
    assert state(engine, st, c.job.id) == JobState.RUNNING
    done = running(engine, st)
    st.complete_runtime_batch(engine, [done])
    assert st.wait_for_callback(engine, done.job.id, 1, 60) is None
    assert count(engine, st, "leases", f"job_id = {done.job.id}") == 0


def test_wait_for_callback_on_a_callers_connection_is_kept_or_undone_with_it(engine, st):
    c = running(engine, st)
    with engine.connect() as conn:
        assert st.wait_for_callback(conn, c.job.id, 1, 60) is not None
        conn.rollback()
    assert (state(engine, st, c.job.id), count(engine, st, "leases")) == (JobState.RUNNING, 0)
    with engine.connect() as conn:
        token = st.wait_for_callback(conn, c.job.id, 1, 60)
        conn.commit()
    assert st.load_job(engine, c.job.id).callback_id == token


def test_enter_callback_wait_with_another_token_returns_false(engine, st):
    c = running(engine, st)
    st.register_callback(engine, c.job.id, 1, 60)
    assert st.enter_callback_wait(engine, c.job.id, 1, uuid.uuid4()) is False
    assert state(engine, st, c.job.id) == JobState.RUNNING


def test_cancel_callback_clears_the_token(engine, st):
    c = running(engine, st)
    token = st.register_callback(engine, c.job.id, 1, 60)
    assert st.cancel_callback(engine, c.job.id, 1) is True
    assert st.cancel_callback(engine, c.job.id, 1) is False
    with pytest.raises(CallbackNotFoundError):
        st.complete_external(engine, token, {})
    assert state(engine, st, c.job.id) == JobState.RUNNING


def test_callback_job_and_load_active_lease_find_the_waiting_attempt(engine, st):
    c, token = waiting(engine, st)
    assert st.callback_job(engine, token).id == c.job.id
    assert st.callback_job(engine, token, run_lease=1, for_update=True).id == c.job.id
    assert st.callback_job(engine, token, run_lease=2) is None
    assert st.callback_job(engine, uuid.uuid4()) is None
    lease = st.load_active_lease_in_tx(engine, c.job.id, 1)
    assert (lease.state, lease.callback_id) == (JobState.WAITING_EXTERNAL, token)
    assert st.load_active_lease_in_tx(engine, c.job.id, 2) is None


# -- resolution ------------------------------------------------------------------------------


def test_complete_external_moves_waiting_external_to_completed(engine, st):
    c, token = waiting(engine, st)
    row = st.complete_external(engine, token, {"ok": True})
    assert row.state == JobState.COMPLETED
    assert state(engine, st, c.job.id) == JobState.COMPLETED
    assert count(engine, st, "leases") == 0


def test_complete_external_accepts_a_callback_that_arrives_before_the_wait(engine, st):
    c = running(engine, st)
    token = st.register_callback(engine, c.job.id, 1, 60)
    assert st.complete_external(engine, token, {}).state == JobState.COMPLETED
    assert st.enter_callback_wait(engine, c.job.id, 1, token) is False


def test_complete_external_twice_raises_callback_not_found(engine, st):
    _, token = waiting(engine, st)
    st.complete_external(engine, token, {})
    with pytest.raises(CallbackNotFoundError):
        st.complete_external(engine, token, {})


def test_complete_external_with_another_run_lease_raises_callback_not_found(engine, st):
    c, token = waiting(engine, st)
    with pytest.raises(CallbackNotFoundError):
        st.complete_external(engine, token, {}, run_lease=2)
    assert state(engine, st, c.job.id) == JobState.WAITING_EXTERNAL


def test_resume_hands_the_payload_back_to_the_same_running_attempt(engine, st):
    c, token = waiting(engine, st)
    row = st.complete_external(engine, token, {"answer": 42}, resume=True)
    assert (row.state, row.run_lease, row.attempt) == (JobState.RUNNING, 1, 1)
    assert row.metadata["_qstore_callback_result"] == {"answer": 42}
    assert row.callback_id is None
    assert state(engine, st, c.job.id) == JobState.RUNNING


def test_check_callback_state_reports_a_resumed_result_once(engine, st):
    c, token = waiting(engine, st)
    assert st.check_callback_state(engine, c.job.id, token).kind == "pending"
    st.complete_external(engine, token, {"answer": 42}, resume=True)
    first = st.check_callback_state(engine, c.job.id, token)
    assert (first.kind, first.payload) == ("resolved", {"answer": 42})
    assert st.check_callback_state(engine, c.job.id, token).kind != "resolved"


def test_resumed_attempt_is_completed_by_its_worker(engine, st):
    c, token = waiting(engine, st)
    st.complete_external(engine, token, {"answer": 42}, resume=True)
    assert st.complete_job_batch_by_id(engine, [(c.job.id, 1)]) == [(c.job.id, 1)]
    assert state(engine, st, c.job.id) == JobState.COMPLETED
    assert count(engine, st, "leases") == 0
    assert count(engine, st, "attempt_state") == 0


def test_check_callback_state_reports_stale_for_a_replaced_token(engine, st):
    c = running(engine, st)
    old = st.register_callback(engine, c.job.id, 1, 60)
    new = st.register_callback(engine, c.job.id, 1, 60)
    poll = st.check_callback_state(engine, c.job.id, old)
    assert (poll.kind, poll.current) == ("stale", new)


def test_check_callback_state_of_an_unknown_job_is_not_found(engine, st):
    assert st.check_callback_state(engine, 424242, uuid.uuid4()).kind == "not_found"


def test_a_callback_poll_kind_is_a_member_that_reads_as_its_string(engine, st):
    from qstore.types import CallbackPollKind, CallbackPollResult

    c, token = waiting(engine, st)
    kind = st.check_callback_state(engine, c.job.id, token).kind
    assert kind is CallbackPollKind.PENDING
    assert (kind, str(kind), f"{kind}", {"pending": 1}[kind]) == ("pending", "pending", "pending", 1)
    assert CallbackPollResult("resolved", payload=1).kind is CallbackPollKind.RESOLVED
    with pytest.raises(ValueError):
        CallbackPollResult("resolvd")


def test_fail_external_moves_waiting_external_to_failed_with_a_terminal_error(engine, st):
    c, token = waiting(engine, st)
    row = st.fail_external(engine, token, "upstream said no")
    assert row.state == JobState.FAILED
    entry = row.errors[-1]
    assert (entry["error"], entry["attempt"], entry["terminal"]) == ("upstream said no", 1, True)
    assert "at" in entry
    assert state(engine, st, c.job.id) == JobState.FAILED


def test_fail_external_with_error_entry_keeps_the_callers_fields(engine, st):
    c, token = waiting(engine, st)
    row = st.fail_external_with_error_entry(engine, token, {"error": "e", "code": 7, "terminal": False})
    entry = row.errors[-1]
    assert (entry["code"], entry["terminal"], entry["attempt"]) == (7, False, 1)
    assert st.load_job(engine, c.job.id).errors[-1]["code"] == 7


def test_retry_external_moves_waiting_external_to_available_with_attempt_zero(engine, st):
    c, token = waiting(engine, st)
    row = st.retry_external(engine, token)
    assert (row.state, row.attempt, row.run_lease) == (JobState.AVAILABLE, 0, 1)
    assert state(engine, st, c.job.id) == JobState.AVAILABLE
    again = claim(engine, st)
    assert (again.job.id, again.job.attempt, again.job.run_lease) == (c.job.id, 1, 2)


def test_retry_external_on_a_running_attempt_raises_callback_not_found_and_changes_nothing(engine, st):
    c = running(engine, st)
    token = st.register_callback(engine, c.job.id, 1, 60)
    before = census(engine, st)
    with pytest.raises(CallbackNotFoundError):
        st.retry_external(engine, token)
    assert census(engine, st) == before
    assert state(engine, st, c.job.id) == JobState.RUNNING


@pytest.mark.parametrize("call", ["complete", "resume", "fail", "retry", "heartbeat"])
def test_an_unknown_token_raises_callback_not_found(engine, st, call):
    waiting(engine, st)
    before = census(engine, st)
    token = uuid.uuid4()
    with pytest.raises(CallbackNotFoundError):
        {"complete": lambda: st.complete_external(engine, token, {}),
         "resume": lambda: st.complete_external(engine, token, {}, resume=True),
         "fail": lambda: st.fail_external(engine, token, "x"),
         "retry": lambda: st.retry_external(engine, token),
         "heartbeat": lambda: st.heartbeat_callback(engine, token, 60)}[call]()
    assert census(engine, st) == before


def test_worker_outcome_on_a_waiting_attempt_is_stale(engine, st):
    c, _ = waiting(engine, st)
    assert st.fail_retryable(engine, c.job.id, 1, "x") is None
    assert st.complete_job_batch_by_id(engine, [(c.job.id, 1)]) == []
    assert state(engine, st, c.job.id) == JobState.WAITING_EXTERNAL


# -- timeouts ---------------------------------------------------------------------------------


def test_heartbeat_callback_extends_the_timeout(engine, st):
    c, token = waiting(engine, st, timeout=1)
    before = st.load_job(engine, c.job.id).callback_timeout_at
    row = st.heartbeat_callback(engine, token, 3600)
    assert row.callback_timeout_at - before > timedelta(minutes=50)
    time.sleep(1.1)
    assert st.rescue_expired_callbacks(engine) == []


def test_rescue_expired_callbacks_moves_a_timed_out_wait_to_retryable(engine, st):
    c, token = waiting(engine, st, timeout=0.05)
    time.sleep(0.1)
    [row] = st.rescue_expired_callbacks(engine)
    assert (row.id, row.state) == (c.job.id, JobState.RETRYABLE)
    assert row.errors[-1]["error"] == "callback timed out"
    assert state(engine, st, c.job.id) == JobState.RETRYABLE
    with pytest.raises(CallbackNotFoundError):
        st.complete_external(engine, token, {})


def test_rescue_expired_callbacks_leaves_unexpired_waits_alone(engine, st):
    c, _ = waiting(engine, st, timeout=60)
    assert st.rescue_expired_callbacks(engine) == []
    assert state(engine, st, c.job.id) == JobState.WAITING_EXTERNAL


def test_rescue_expired_callbacks_fails_an_exhausted_attempt(engine, st):
    c, _ = waiting(engine, st, timeout=0.05, max_attempts=1)
    time.sleep(0.1)
    [row] = st.rescue_expired_callbacks(engine)
    assert row.state == JobState.FAILED
    assert state(engine, st, c.job.id) == JobState.FAILED
    assert count(engine, st, BACKLOG) == 0


def test_rescue_expired_callbacks_moves_an_exhausted_attempt_to_the_dlq_when_enabled(engine, st):
    st.set_queue_options(engine, "q", dlq_enabled=True)
    c, _ = waiting(engine, st, timeout=0.05, max_attempts=1)
    time.sleep(0.1)
    st.rescue_expired_callbacks(engine)
    assert count(engine, st, "dlq_entries", f"job_id = {c.job.id}") == 1
    assert state(engine, st, c.job.id) == JobState.FAILED


# -- admin on waiting attempts ------------------------------------------------------------------


def test_cancel_job_moves_waiting_external_to_cancelled(engine, st):
    c, token = waiting(engine, st)
    assert st.cancel_job(engine, c.job.id).state == JobState.CANCELLED
    assert state(engine, st, c.job.id) == JobState.CANCELLED
    with pytest.raises(CallbackNotFoundError):
        st.complete_external(engine, token, {})


def test_retry_job_moves_waiting_external_to_available_with_attempt_zero(engine, st):
    c, token = waiting(engine, st)
    row = st.retry_job(engine, c.job.id)
    assert (row.state, row.attempt, row.run_lease) == (JobState.AVAILABLE, 0, 1)
    with pytest.raises(CallbackNotFoundError):
        st.complete_external(engine, token, {})


# -- complete vs timeout race ----------------------------------------------------------------------


def race_complete_against_timeout(engine, s) -> tuple[int, object, list]:
    """Park a job on an already expired callback, then start complete_external and
    rescue_expired_callbacks together. Returns (job_id, complete result or error, rescued rows)."""
    c, token = waiting(engine, s, timeout=0.02)
    time.sleep(0.05)  # the timeout has passed: both sides are entitled to act
    barrier = threading.Barrier(2)
    result: dict[str, object] = {}

    def complete() -> None:
        barrier.wait()
        try:
            result["complete"] = s.complete_external(engine, token, {"ok": True})
        except CallbackNotFoundError as err:
            result["complete"] = err

    def rescue() -> None:
        barrier.wait()
        result["rescue"] = [r for r in s.rescue_expired_callbacks(engine) if r.id == c.job.id]

    threads = [threading.Thread(target=complete), threading.Thread(target=rescue)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return c.job.id, result["complete"], result["rescue"]


def test_complete_external_racing_the_timeout_rescue_has_exactly_one_winner(engine, st):
    for _ in range(10):
        job_id, completed, rescued = race_complete_against_timeout(engine, st)
        complete_won = not isinstance(completed, CallbackNotFoundError)
        assert complete_won != bool(rescued), (completed, rescued)
        final = st.load_job(engine, job_id)
        if complete_won:
            assert completed.state == final.state == JobState.COMPLETED
        else:
            assert [r.state for r in rescued] == [JobState.RETRYABLE]
            assert final.state == JobState.RETRYABLE
        assert count(engine, st, "leases", f"job_id = {job_id}") == 0
        # exactly one outcome was written for the attempt
        assert (count(engine, st, "done_entries", f"job_id = {job_id}")
                + count(engine, st, BACKLOG, f"job_id = {job_id}")) == 1
