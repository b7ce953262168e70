"""Automatic paths (promotion, rescue) never stall on a unique-key conflict.

A job whose ``unique_states`` mask does not hold its key while it waits (retryable, or
running) gives the key up; another job may take it meanwhile. When the first job comes
back, it cannot take the key: it ends ``failed`` with an error entry naming the key's
owner, counted as terminal, and every other job of the batch moves on. User-initiated calls
(``retry_job``, ``retry_from_dlq``) keep raising ``UniqueConflictError``.
"""

from __future__ import annotations

import time

import pytest
from jobtools import claim
from sqlalchemy import text

from qstore import InsertOpts, InsertParams, UniqueConflictError, UniqueOpts
from qstore.types import JobState

BIT = {s: 1 << i for i, s in enumerate(
    ("scheduled", "available", "running", "completed", "retryable", "failed", "cancelled",
     "waiting_external"))}
#: holds the key while available, running or completed, gives it up while retryable
NOT_WHILE_RETRYABLE = UniqueOpts(states=BIT["available"] | BIT["running"] | BIT["completed"])


def enqueue(engine, st, queue: str = "q", unique: UniqueOpts | None = None, args: object = None,
            **opts: object) -> int:
    st.enqueue_params_batch(engine, [InsertParams("k", {"key": 1} if args is None else args,
                                                  InsertOpts(queue=queue, unique=unique, **opts))])
    with engine.connect() as c:
        return c.execute(text(f'SELECT max(job_id) FROM (SELECT job_id FROM "{st.schema()}".ready_entries '
                              f'UNION ALL SELECT job_id FROM "{st.schema()}".deferred_jobs '
            f'UNION ALL SELECT job_id FROM "{st.schema()}".deferred_wheel) j')).scalar_one()


def retried_without_key(engine, st, queue: str = "q", args: object = None) -> int:
    """A unique job that is now retryable (due at once) and no longer holds its key."""
    job_id = enqueue(engine, st, queue, NOT_WHILE_RETRYABLE, args)
    c = claim(engine, st, queue)
    assert c.job.id == job_id
    assert st.retry_after(engine, job_id, c.job.run_lease, 0) is not None
    return job_id


def test_promotion_fails_only_the_job_whose_key_another_job_took(engine, st):
    loser = retried_without_key(engine, st)
    owner = enqueue(engine, st, unique=NOT_WHILE_RETRYABLE)  # takes the freed key
    other = retried_without_key(engine, st, queue="elsewhere", args={"key": 2})
    promoted = st.promote_due(engine, JobState.RETRYABLE, 100)
    assert promoted == 1
    assert st.load_job(engine, other).state == JobState.AVAILABLE
    lost = st.load_job(engine, loser)
    assert lost.state == JobState.FAILED
    assert lost.errors[-1]["unique_owner"] == owner
    assert f"job {owner}" in lost.errors[-1]["error"] and lost.errors[-1]["terminal"] is True
    assert st.load_job(engine, owner).state == JobState.AVAILABLE


def test_promotion_after_a_conflict_keeps_promoting_later_passes(engine, st):
    retried_without_key(engine, st)
    enqueue(engine, st, unique=NOT_WHILE_RETRYABLE)
    st.promote_due(engine, JobState.RETRYABLE, 100)
    later = retried_without_key(engine, st, queue="later", args={"key": 2})
    assert st.promote_due(engine, JobState.RETRYABLE, 100) == 1
    assert st.load_job(engine, later).state == JobState.AVAILABLE


def test_promotion_of_two_due_jobs_with_one_key_lets_the_first_win(engine, st):
    first = retried_without_key(engine, st)
    time.sleep(0.01)
    second = retried_without_key(engine, st)  # took the key first released, then gave it up
    assert st.promote_due(engine, JobState.RETRYABLE, 100) == 1
    assert st.load_job(engine, first).state == JobState.AVAILABLE
    lost = st.load_job(engine, second)
    assert lost.state == JobState.FAILED and lost.errors[-1]["unique_owner"] == first


def test_a_job_failed_by_a_promotion_conflict_is_counted_terminal(engine, st):
    retried_without_key(engine, st)
    enqueue(engine, st, unique=NOT_WHILE_RETRYABLE)
    before = st.queue_counts(engine, "q").terminal
    st.promote_due(engine, JobState.RETRYABLE, 100)
    assert st.queue_counts(engine, "q").terminal == before + 1


def test_promotion_of_scheduled_jobs_is_not_held_back_by_a_retryable_conflict(engine, st):
    retried_without_key(engine, st)
    enqueue(engine, st, unique=NOT_WHILE_RETRYABLE)
    st.promote_due(engine, JobState.RETRYABLE, 100)
    from datetime import datetime, timedelta, timezone
    soon = datetime.now(timezone.utc) + timedelta(milliseconds=1)
    scheduled = enqueue(engine, st, queue="sched", run_at=soon)
    time.sleep(0.01)
    assert st.promote_due(engine, JobState.SCHEDULED, 100) == 1
    assert st.load_job(engine, scheduled).state == JobState.AVAILABLE


def test_user_retry_of_a_job_whose_key_is_owned_still_raises(engine, st):
    job = enqueue(engine, st, unique=UniqueOpts(states=BIT["available"] | BIT["running"]))
    c = claim(engine, st)
    st.fail_terminal(engine, job, c.job.run_lease, "boom")
    enqueue(engine, st, unique=UniqueOpts(states=BIT["available"] | BIT["running"]))
    with pytest.raises(UniqueConflictError):
        st.retry_job(engine, job)
    assert st.load_job(engine, job).state == JobState.FAILED


def test_stale_rescue_fails_only_the_attempt_whose_key_another_job_took(engine, st):
    only_failed = UniqueOpts(states=BIT["failed"])  # the key is held by failed history only
    owner = enqueue(engine, st, unique=only_failed)
    o = claim(engine, st)
    st.fail_terminal(engine, owner, o.job.run_lease, "first failure")  # takes the key
    loser = enqueue(engine, st, unique=only_failed, max_attempts=1)
    claim(engine, st)
    bystander = enqueue(engine, st, queue="bystander", args={"b": 1})
    claim(engine, st, "bystander")
    time.sleep(0.02)
    rescued = {r.id: r for r in st.rescue_stale_heartbeats(engine, 0.01)}
    assert set(rescued) == {loser, bystander}
    assert rescued[bystander].state == JobState.RETRYABLE
    lost = st.load_job(engine, loser)
    assert lost.state == JobState.FAILED and lost.errors[-1]["unique_owner"] == owner
