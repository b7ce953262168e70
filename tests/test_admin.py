"""Admin operations: retry, cancel (with the cancel NOTIFY), priority and
queue moves, aging. Ready rows are never updated: changes append tombstones and new rows."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from jobtools import BACKLOG, add, census, claim, count, running, state
from sqlalchemy import make_url, text

from qstore import ValidationError
from qstore.types import JobState

UTC = timezone.utc


# -- helpers ----------------------------------------------------------------------------------
















def ready_versions(engine, s) -> set[tuple]:
    """(ctid, xmin) of every ready row: unchanged unless a row was updated in place."""
    with engine.connect() as c:
        return {tuple(r) for r in c.execute(text(
            f'SELECT ctid::text, xmin::text, job_id FROM "{s.schema()}".ready_entries'))}


def failed_job(engine, s, **opts: object) -> int:
    c = running(engine, s, **opts)
    s.fail_terminal(engine, c.job.id, c.job.run_lease, "fatal")
    return c.job.id


def listener(db_url: str, channel: str) -> psycopg.Connection:
    conninfo = make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg.connect(conninfo, autocommit=True)
    conn.execute(f'LISTEN "{channel}"')
    return conn


# -- retry_job ----------------------------------------------------------------------------------


def test_retry_job_moves_a_failed_job_to_available_with_attempt_zero_keeping_run_lease(engine, st):
    job_id = failed_job(engine, st)
    row = st.retry_job(engine, job_id)
    assert (row.state, row.attempt, row.run_lease) == (JobState.AVAILABLE, 0, 1)
    assert row.errors[-1]["error"] == "fatal"  # history kept
    assert state(engine, st, job_id) == JobState.AVAILABLE
    again = claim(engine, st)
    assert (again.job.id, again.job.attempt, again.job.run_lease) == (job_id, 1, 2)


def test_retry_job_moves_a_cancelled_job_to_available(engine, st):
    c = running(engine, st)
    st.cancel_running(engine, c.job.id, 1, "r")
    assert st.retry_job(engine, c.job.id).state == JobState.AVAILABLE
    assert state(engine, st, c.job.id) == JobState.AVAILABLE


def test_retry_job_on_a_completed_job_returns_none_and_changes_nothing(engine, st):
    c = running(engine, st)
    st.complete_runtime_batch(engine, [c])
    before = census(engine, st)
    assert st.retry_job(engine, c.job.id) is None
    assert census(engine, st) == before
    assert state(engine, st, c.job.id) == JobState.COMPLETED


@pytest.mark.parametrize("where", ["available", "running", "scheduled", "unknown"])
def test_retry_job_on_a_job_that_has_not_ended_returns_none(engine, st, where):
    if where == "available":
        job_id = add(engine, st)
    elif where == "running":
        job_id = running(engine, st).job.id
    elif where == "scheduled":
        job_id = add(engine, st, run_at=datetime.now(UTC) + timedelta(hours=1))
    else:
        job_id = 777777
    before = census(engine, st)
    assert st.retry_job(engine, job_id) is None
    assert census(engine, st) == before


def test_retry_jobs_by_ids_returns_only_the_retried_jobs(engine, st):
    a, b = failed_job(engine, st), failed_job(engine, st)
    c = running(engine, st)
    st.complete_runtime_batch(engine, [c])
    rows = st.retry_jobs_by_ids(engine, [a, c.job.id, b])
    assert sorted(r.id for r in rows) == sorted([a, b])
    assert state(engine, st, c.job.id) == JobState.COMPLETED


# -- cancel_job -------------------------------------------------------------------------------------


def test_cancel_job_cancels_an_available_job_with_a_tombstone_never_updating_the_ready_row(engine, st):
    job_id = add(engine, st)
    before = ready_versions(engine, st)
    row = st.cancel_job(engine, job_id)
    assert row.state == JobState.CANCELLED
    assert ready_versions(engine, st) == before
    assert count(engine, st, "ready_tombstones", f"job_id = {job_id}") == 1
    assert state(engine, st, job_id) == JobState.CANCELLED
    assert st.claim_runtime_batch(engine, "q", 5) == []


def test_cancel_job_cancels_a_running_receipt_only_attempt(engine, st):
    c = running(engine, st)
    assert st.cancel_job(engine, c.job.id).state == JobState.CANCELLED
    assert state(engine, st, c.job.id) == JobState.CANCELLED
    assert st.complete_runtime_batch(engine, [c]) == []
    assert st.heartbeat_batch(engine, [(c.job.id, 1)]) == 0


def test_cancel_job_cancels_a_running_lease_backed_attempt(engine, st):
    c = running(engine, st)
    st.register_callback(engine, c.job.id, 1, 60)
    assert st.cancel_job(engine, c.job.id).state == JobState.CANCELLED
    assert count(engine, st, "leases") == 0
    assert st.fail_retryable(engine, c.job.id, 1, "late") is None


def test_cancel_job_of_a_running_attempt_notifies_the_cancel_channel_after_commit(engine, db_url, st):
    c = running(engine, st)
    with listener(db_url, st.config.cancel_channel) as lis, engine.connect() as conn:
        conn.begin()
        st.cancel_job(conn, c.job.id)
        assert list(lis.notifies(timeout=0.3)) == []
        conn.commit()
        [note] = list(lis.notifies(timeout=5, stop_after=1))
    assert note.channel == st.config.cancel_channel
    assert json.loads(note.payload) == {"job_id": c.job.id, "run_lease": 1}


def test_rolled_back_cancel_job_does_not_notify_and_keeps_the_attempt_running(engine, db_url, st):
    c = running(engine, st)
    with listener(db_url, st.config.cancel_channel) as lis, engine.connect() as conn:
        conn.begin()
        st.cancel_job(conn, c.job.id)
        conn.rollback()
        assert list(lis.notifies(timeout=0.3)) == []
    assert state(engine, st, c.job.id) == JobState.RUNNING


@pytest.mark.parametrize("deferred", [JobState.SCHEDULED, JobState.RETRYABLE])
def test_cancel_job_cancels_a_deferred_job(engine, st, deferred):
    if deferred == JobState.SCHEDULED:
        job_id = add(engine, st, run_at=datetime.now(UTC) + timedelta(hours=1))
    else:
        c = running(engine, st)
        job_id = c.job.id
        st.retry_after(engine, job_id, 1, 3600)
    assert st.cancel_job(engine, job_id).state == JobState.CANCELLED
    assert count(engine, st, BACKLOG) == 0
    assert state(engine, st, job_id) == JobState.CANCELLED


def test_cancel_job_on_a_completed_job_returns_none_and_changes_nothing(engine, st):
    c = running(engine, st)
    st.complete_runtime_batch(engine, [c])
    before = census(engine, st)
    assert st.cancel_job(engine, c.job.id) is None
    assert census(engine, st) == before
    assert state(engine, st, c.job.id) == JobState.COMPLETED


def test_cancel_jobs_by_ids_cancels_each_live_job_once(engine, st):
    a = add(engine, st)
    b = running(engine, st, queue="other").job.id
    c = running(engine, st, queue="third")
    st.complete_runtime_batch(engine, [c])
    rows = st.cancel_jobs_by_ids(engine, [a, b, c.job.id])
    assert sorted(r.id for r in rows) == sorted([a, b])
    assert st.cancel_jobs_by_ids(engine, [a, b]) == []


# -- set_priority / move_queue ----------------------------------------------------------------------


def test_set_priority_of_an_available_job_re_enqueues_it_in_the_new_lane(engine, st):
    job_id = add(engine, st, priority=3)
    before = ready_versions(engine, st)
    assert st.set_priority(engine, job_id, 1) is True
    assert before <= ready_versions(engine, st)  # old rows untouched, one appended
    assert count(engine, st, "ready_tombstones", f"job_id = {job_id}") == 1
    row = st.load_job(engine, job_id)
    assert (row.state, row.priority) == (JobState.AVAILABLE, 1)
    assert row.metadata["_qstore_original_priority"] == 3
    got = claim(engine, st)
    assert (got.job.id, got.job.priority) == (job_id, 1)
    assert st.claim_runtime_batch(engine, "q", 5) == []  # claimed once, not twice


def test_set_priority_lets_the_job_overtake_older_jobs(engine, st):
    older = add(engine, st, priority=2)
    newer = add(engine, st, priority=2)
    st.set_priority(engine, newer, 1)
    assert [j.job.id for j in st.claim_runtime_batch(engine, "q", 2)] == [newer, older]


def test_move_queue_of_an_available_job_moves_claims_to_the_new_queue(engine, st):
    job_id = add(engine, st, queue="old")
    assert st.move_queue(engine, job_id, "new") is True
    row = st.load_job(engine, job_id)
    assert (row.queue, row.metadata["_qstore_original_queue"]) == ("new", "old")
    assert st.claim_runtime_batch(engine, "old", 5) == []
    assert claim(engine, st, "new").job.id == job_id


def test_move_queue_with_priority_changes_both(engine, st):
    job_id = add(engine, st, queue="old", priority=4)
    assert st.move_queue(engine, job_id, "new", 1) is True
    got = claim(engine, st, "new")
    assert (got.job.id, got.job.priority) == (job_id, 1)


def test_set_priority_of_a_scheduled_job_updates_it_in_place(engine, st):
    job_id = add(engine, st, run_at=datetime.now(UTC) + timedelta(hours=1), priority=3)
    assert st.set_priority(engine, job_id, 1) is True
    row = st.load_job(engine, job_id)
    assert (row.state, row.priority, row.metadata["_qstore_original_priority"]) == (JobState.SCHEDULED, 1, 3)
    assert count(engine, st, BACKLOG) == 1
    assert count(engine, st, "ready_tombstones") == 0


def test_move_queue_of_a_scheduled_job_updates_it_in_place_and_it_is_claimed_there(engine, st):
    job_id = add(engine, st, queue="old", run_at=datetime.now(UTC) - timedelta(seconds=1))
    assert st.move_queue(engine, job_id, "new") is True
    row = st.load_job(engine, job_id)
    assert (row.state, row.queue, row.metadata["_qstore_original_queue"]) == (JobState.SCHEDULED, "new", "old")
    st.promote_due(engine, JobState.SCHEDULED, 10)
    assert st.claim_runtime_batch(engine, "old", 5) == []
    assert claim(engine, st, "new").job.id == job_id


def test_original_priority_stamp_keeps_the_first_value(engine, st):
    job_id = add(engine, st, priority=4)
    st.set_priority(engine, job_id, 3)
    st.set_priority(engine, job_id, 1)
    assert st.load_job(engine, job_id).metadata["_qstore_original_priority"] == 4


@pytest.mark.parametrize("op", ["same_priority", "same_queue"])
def test_no_op_move_returns_false_and_writes_no_tombstone(engine, st, op):
    job_id = add(engine, st, priority=2)
    before = census(engine, st)
    if op == "same_priority":
        assert st.set_priority(engine, job_id, 2) is False
    else:
        assert st.move_queue(engine, job_id, "q") is False
    assert census(engine, st) == before


@pytest.mark.parametrize("where", ["running", "retryable", "completed"])
def test_set_priority_of_a_job_that_is_not_waiting_returns_false(engine, st, where):
    c = running(engine, st)
    if where == "retryable":
        st.retry_after(engine, c.job.id, 1, 3600)
    elif where == "completed":
        st.complete_runtime_batch(engine, [c])
    before = census(engine, st)
    assert st.set_priority(engine, c.job.id, 1) is False
    assert st.move_queue(engine, c.job.id, "elsewhere") is False
    assert census(engine, st) == before


def test_set_priority_rejects_an_out_of_range_priority(engine, st):
    job_id = add(engine, st)
    with pytest.raises(ValidationError):
        st.set_priority(engine, job_id, 5)


# -- age_waiting_priorities ---------------------------------------------------------------------------


def test_age_waiting_priorities_lifts_only_old_rows_one_level(engine, st):
    old = add(engine, st, priority=3)
    young = add(engine, st, priority=3)
    top = add(engine, st, priority=1)
    with engine.begin() as c:  # backdate instead of sleeping: immune to a slow machine
        c.execute(text(f'UPDATE "{st.schema()}".ready_entries '
                       "SET run_at = run_at - interval '1 hour' WHERE job_id = :j"), {"j": old})
    assert st.age_waiting_priorities(engine, 60, 10) == [old]
    assert st.load_job(engine, old).priority == 2
    assert st.load_job(engine, old).metadata["_qstore_original_priority"] == 3
    assert st.load_job(engine, young).priority == 3
    assert st.load_job(engine, top).priority == 1
    assert count(engine, st, "ready_tombstones") == 1


def test_age_waiting_priorities_leaves_claimed_rows_and_other_lanes_positions_alone(engine, st):
    st.set_queue_options(engine, "q", enqueue_shards=1)
    first, second, third = (add(engine, st, priority=3) for _ in range(3))  # positions 1-3 of (q, 3)
    higher = [add(engine, st, priority=2) for _ in range(2)]  # positions 1-2 of (q, 2)
    with engine.begin() as c:
        c.execute(text(f'UPDATE "{st.schema()}".ready_entries SET run_at = run_at - interval \'1 hour\''))
    assert [j.job.id for j in st.claim_runtime_batch(engine, "q", 2)] == higher  # (q, 2): 1-2 claimed
    assert [j.job.id for j in st.claim_runtime_batch(engine, "q", 1)] == [first]  # (q, 3): 1 claimed
    # the two oldest unclaimed rows: a claimed candidate would take a place of the two, and
    # (q, 2)'s range over position 2 must not cover second's position 2 in (q, 3)
    assert st.age_waiting_priorities(engine, 60, 2) == [second, third]
    assert st.load_job(engine, first).state == JobState.RUNNING


def test_age_waiting_priorities_honours_the_limit(engine, st):
    a, b = add(engine, st, priority=4), add(engine, st, priority=4)
    time.sleep(0.1)
    assert len(st.age_waiting_priorities(engine, 0.05, 1)) == 1
    assert sorted(st.load_job(engine, j).priority for j in (a, b)) == [3, 4]


def test_aged_job_is_claimed_once(engine, st):
    job_id = add(engine, st, priority=4)
    time.sleep(0.1)
    st.age_waiting_priorities(engine, 0.05, 10)
    assert [j.job.id for j in st.claim_runtime_batch(engine, "q", 10)] == [job_id]
