"""The dead-letter queue: moving failed jobs in, listing them, retrying them
out (args kept, run_lease never reset), bulk operations, unique conflicts, discard and purge."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from jobtools import LIVE_KEYS, census, claim, count, params, running, state
from sqlalchemy import text

from qstore import UniqueConflictError, UniqueOpts, ValidationError
from qstore.storage.jobs import logical_queue
from qstore.types import ClaimedRuntimeJob, JobState, ListDlqFilter, RetryFromDlqOpts

UTC = timezone.utc


# -- helpers ----------------------------------------------------------------------------------
















def dead(engine, s, progress: object = None, **opts: object) -> ClaimedRuntimeJob:
    """A job moved to the DLQ by its worker (fail_to_dlq)."""
    c = running(engine, s, **opts)
    assert s.fail_to_dlq(engine, c.job.id, c.job.run_lease, "poison", "bad", progress=progress)
    return c


def failed(engine, s, **opts: object) -> int:
    c = running(engine, s, **opts)
    s.fail_terminal(engine, c.job.id, c.job.run_lease, "fatal")
    return c.job.id


# -- into the DLQ ----------------------------------------------------------------------------------


def test_move_failed_to_dlq_moves_the_failed_job_out_of_terminal_history(engine, st):
    job_id = failed(engine, st)
    row = st.move_failed_to_dlq(engine, job_id, "triage")
    assert (row.id, row.state) == (job_id, JobState.FAILED)
    assert count(engine, st, "done_entries", f"job_id = {job_id}") == 0
    assert count(engine, st, "dlq_entries", f"job_id = {job_id} AND dlq_reason = 'triage'") == 1
    assert state(engine, st, job_id) == JobState.FAILED


@pytest.mark.parametrize("where", ["completed", "cancelled", "running", "dlq"])
def test_move_failed_to_dlq_of_a_job_that_is_not_failed_returns_none(engine, st, where):
    c = running(engine, st)
    if where == "completed":
        st.complete_runtime_batch(engine, [c])
    elif where == "cancelled":
        st.cancel_running(engine, c.job.id, 1, "r")
    elif where == "dlq":
        st.fail_to_dlq(engine, c.job.id, 1, "r", "e")
    before = census(engine, st)
    assert st.move_failed_to_dlq(engine, c.job.id, "triage") is None
    assert census(engine, st) == before


def test_bulk_move_failed_to_dlq_filters_by_kind_and_queue(engine, st):
    failed(engine, st, kind="a", queue="q1")
    failed(engine, st, kind="a", queue="q2")
    failed(engine, st, kind="b", queue="q1")
    c = running(engine, st, kind="a", queue="q1")
    st.complete_runtime_batch(engine, [c])
    assert st.bulk_move_failed_to_dlq(engine, "a", "q1", "bulk") == 1
    assert st.bulk_move_failed_to_dlq(engine, "a", None, "bulk") == 1
    assert st.bulk_move_failed_to_dlq(engine, None, None, "bulk") == 1
    assert st.bulk_move_failed_to_dlq(engine, None, None, "bulk") == 0
    assert count(engine, st, "dlq_entries") == 3
    assert count(engine, st, "done_entries", "state = 'failed'") == 0


# -- out of the DLQ ----------------------------------------------------------------------------------


def test_dlq_round_trip_keeps_args_and_bumps_run_lease(engine, st):
    c = dead(engine, st, args={"order": 17, "items": ["a", "b"]}, progress={"step": 3})
    row = st.retry_from_dlq(engine, c.job.id, RetryFromDlqOpts())
    assert (row.state, row.attempt, row.run_lease) == (JobState.AVAILABLE, 0, 1)
    assert row.progress is None
    assert count(engine, st, "dlq_entries") == 0
    again = claim(engine, st)
    assert again.job.id == c.job.id
    assert again.job.args == {"order": 17, "items": ["a", "b"]}
    assert (again.job.attempt, again.job.run_lease) == (1, c.job.run_lease + 1)
    assert again.job.progress is None


def test_repeated_dlq_round_trips_never_reset_run_lease(engine, st):
    c = running(engine, st)
    leases = [c.job.run_lease]
    for _ in range(3):
        st.fail_to_dlq(engine, c.job.id, c.job.run_lease, "r", "e")
        st.retry_from_dlq(engine, c.job.id)
        c = claim(engine, st)
        leases.append(c.job.run_lease)
    assert leases == [1, 2, 3, 4]


def test_retry_from_dlq_with_a_future_run_at_schedules_the_job(engine, st):
    c = dead(engine, st)
    at = datetime.now(UTC) + timedelta(hours=1)
    row = st.retry_from_dlq(engine, c.job.id, RetryFromDlqOpts(run_at=at))
    assert row.state == JobState.SCHEDULED
    loaded = st.load_job(engine, c.job.id)
    assert loaded.state == JobState.SCHEDULED
    assert abs((loaded.run_at - at).total_seconds()) < 1
    assert st.claim_runtime_batch(engine, "q", 5) == []


def test_retry_from_dlq_with_a_past_run_at_makes_the_job_available(engine, st):
    c = dead(engine, st)
    row = st.retry_from_dlq(engine, c.job.id, RetryFromDlqOpts(run_at=datetime.now(UTC) - timedelta(hours=1)))
    assert row.state == JobState.AVAILABLE


def test_retry_from_dlq_with_queue_and_priority_overrides(engine, st):
    c = dead(engine, st, priority=4)
    st.retry_from_dlq(engine, c.job.id, RetryFromDlqOpts(queue="rescue", priority=1))
    assert st.claim_runtime_batch(engine, "q", 5) == []
    got = claim(engine, st, "rescue")
    assert (got.job.id, got.job.priority) == (c.job.id, 1)


def test_retry_from_dlq_of_an_unknown_job_returns_none(engine, st):
    assert st.retry_from_dlq(engine, 4242) is None


def test_retry_from_dlq_unique_conflict_raises_and_keeps_the_dlq_row(engine, st):
    unique = UniqueOpts()
    c = dead(engine, st, args={"u": 1}, unique=unique)
    st.enqueue_params_batch(engine, [params(args={"u": 1}, unique=unique)])  # the key is free again
    with pytest.raises(UniqueConflictError):
        st.retry_from_dlq(engine, c.job.id)
    assert count(engine, st, "dlq_entries", f"job_id = {c.job.id}") == 1
    assert state(engine, st, c.job.id) == JobState.FAILED


def test_bulk_retry_from_dlq_without_a_filter_raises_validation_error(engine, st):
    dead(engine, st)
    with pytest.raises(ValidationError):
        st.bulk_retry_from_dlq(engine, ListDlqFilter())
    with pytest.raises(ValidationError):
        st.bulk_retry_from_dlq(engine, ListDlqFilter(limit=5))
    assert count(engine, st, "dlq_entries") == 1


def test_bulk_retry_from_dlq_retries_the_matching_rows(engine, st):
    a, b = dead(engine, st, kind="a"), dead(engine, st, kind="a")
    other = dead(engine, st, kind="b")
    assert st.bulk_retry_from_dlq(engine, ListDlqFilter(kind="a")) == 2
    assert state(engine, st, a.job.id) == state(engine, st, b.job.id) == JobState.AVAILABLE
    assert state(engine, st, other.job.id) == JobState.FAILED


def test_bulk_retry_from_dlq_honours_the_limit_oldest_first(engine, st):
    jobs = [dead(engine, st, kind="a").job.id for _ in range(3)]
    assert st.bulk_retry_from_dlq(engine, ListDlqFilter(kind="a", limit=2)) == 2
    assert [state(engine, st, j) for j in jobs] == [JobState.AVAILABLE, JobState.AVAILABLE, JobState.FAILED]


def test_bulk_retry_from_dlq_by_queue_and_before_id(engine, st):
    a = dead(engine, st, queue="x")
    b = dead(engine, st, queue="x")
    assert st.bulk_retry_from_dlq(engine, ListDlqFilter(queue="x", before_id=b.job.id)) == 1
    assert state(engine, st, a.job.id) == JobState.AVAILABLE
    assert state(engine, st, b.job.id) == JobState.FAILED


# -- listing ----------------------------------------------------------------------------------------


def test_list_dlq_returns_every_entry_newest_first_with_its_reason(engine, st):
    first, second = dead(engine, st, kind="a"), dead(engine, st, kind="b")
    entries = st.list_dlq(engine)
    assert [e.job.id for e in entries] == [second.job.id, first.job.id]
    assert [(e.dlq_reason, e.original_run_lease, e.job.state) for e in entries] == \
        [("poison", 1, JobState.FAILED)] * 2
    assert entries[0].dlq_at >= entries[1].dlq_at
    assert entries[0].job.errors[-1]["error"] == "bad"


def test_list_dlq_filters_by_kind_queue_and_limit(engine, st):
    dead(engine, st, kind="a", queue="x")
    b = dead(engine, st, kind="b", queue="x")
    c = dead(engine, st, kind="a", queue="y")
    assert [e.job.id for e in st.list_dlq(engine, ListDlqFilter(kind="b"))] == [b.job.id]
    assert [e.job.id for e in st.list_dlq(engine, ListDlqFilter(kind="a", queue="y"))] == [c.job.id]
    assert [e.job.id for e in st.list_dlq(engine, ListDlqFilter(limit=1))] == [c.job.id]


def test_list_dlq_pages_backwards_from_the_last_entry_seen(engine, st):
    ids = [dead(engine, st).job.id for _ in range(3)]
    page = st.list_dlq(engine, ListDlqFilter(limit=2))
    last = page[-1]
    rest = st.list_dlq(engine, ListDlqFilter(before_id=last.job.id, before_dlq_at=last.dlq_at))
    assert [e.job.id for e in page + rest] == ids[::-1]


def test_list_dlq_of_a_striped_queue_lists_every_stripe(engine, make_storage):
    s = make_storage(queue_stripe_count=2)
    s.enqueue_params_batch(engine, [params(queue="q") for _ in range(2)])
    for c in s.claim_runtime_batch(engine, "q", 2):
        s.fail_to_dlq(engine, c.job.id, c.job.run_lease, "poison", "bad")
    assert len(s.list_dlq(engine, ListDlqFilter(queue="q"))) == 2


def test_load_dlq_entry_is_the_entry_of_a_dead_lettered_job_only(engine, st):
    c = dead(engine, st)
    entry = st.load_dlq_entry(engine, c.job.id)
    assert (entry.job.id, entry.job.kind, entry.dlq_reason) == (c.job.id, c.job.kind, "poison")
    assert st.load_dlq_entry(engine, failed(engine, st)) is None


# -- purge ------------------------------------------------------------------------------------------


def test_purge_dlq_deletes_the_entries_of_a_kind_and_leaves_the_rest(engine, st):
    a, other = dead(engine, st, kind="a"), dead(engine, st, kind="b")
    assert st.purge_dlq(engine, kind="a") == 1
    assert [e.job.id for e in st.list_dlq(engine)] == [other.job.id]
    assert st.load_job(engine, a.job.id) is None


def test_purge_dlq_by_queue_takes_every_stripe_of_that_queue(engine, make_storage):
    s = make_storage(queue_stripe_count=2)
    s.enqueue_params_batch(engine, [params(queue="q") for _ in range(2)] + [params(queue="r")])
    for queue in ("q", "r"):
        for c in s.claim_runtime_batch(engine, queue, 2):
            s.fail_to_dlq(engine, c.job.id, c.job.run_lease, "poison", "bad")
    assert s.purge_dlq(engine, queue="q") == 2
    assert [logical_queue(e.job.queue) for e in s.list_dlq(engine)] == ["r"]


def test_purge_dlq_without_a_criterion_empties_the_dlq(engine, st):
    for kind in ("a", "b"):
        dead(engine, st, kind=kind)
    assert st.purge_dlq(engine) == 2
    assert count(engine, st, "dlq_entries") == 0


def test_purge_dlq_leaves_terminal_counts_alone(engine, st):
    st.complete_runtime_batch(engine, [running(engine, st)])
    failed(engine, st)
    dead(engine, st)
    before = st.queue_counts(engine, "q")
    st.purge_dlq(engine)
    assert st.queue_counts(engine, "q") == before


def test_purge_dlq_releases_unique_keys(engine, st):
    holds_failed = UniqueOpts(states=0b0011_1111)  # … plus failed
    dead(engine, st, args={"u": 1}, unique=holds_failed)
    with pytest.raises(UniqueConflictError):
        st.enqueue_params_batch(engine, [params(args={"u": 1}, unique=holds_failed)])
    st.purge_dlq(engine)
    assert st.enqueue_params_batch(engine, [params(args={"u": 1}, unique=holds_failed)]) == 1


def test_a_purged_job_reads_none_while_its_claimed_ready_row_waits_for_prune(engine, st):
    c = dead(engine, st)
    st.purge_dlq(engine)
    assert count(engine, st, "ready_entries", f"job_id = {c.job.id}") == 1
    assert st.load_job(engine, c.job.id) is None
    assert st.queue_counts(engine, "q").available == 0


# -- discard ----------------------------------------------------------------------------------------


def test_discard_failed_by_kind_counts_terminal_and_dlq_rows(engine, st):
    failed(engine, st, kind="a")
    dead(engine, st, kind="a")
    failed(engine, st, kind="b")
    c = running(engine, st, kind="a")
    st.complete_runtime_batch(engine, [c])
    assert st.discard_failed_by_kind(engine, "a") == 2
    assert count(engine, st, "dlq_entries") == 0
    assert count(engine, st, "done_entries", "state = 'failed'") == 1
    assert state(engine, st, c.job.id) == JobState.COMPLETED


def test_discard_failed_by_kind_releases_unique_keys(engine, st):
    holds_failed = UniqueOpts(states=0b0011_1111)  # … plus failed
    failed(engine, st, kind="a", args={"u": 1}, unique=holds_failed)
    dead(engine, st, kind="a", args={"u": 2}, unique=holds_failed, queue="q")
    with pytest.raises(UniqueConflictError):
        st.enqueue_params_batch(engine, [params("a", {"u": 1}, unique=holds_failed)])
    assert st.discard_failed_by_kind(engine, "a") == 2
    assert count(engine, st, LIVE_KEYS) == 0
    assert st.enqueue_params_batch(engine, [params("a", {"u": 1}, unique=holds_failed),
                                            params("a", {"u": 2}, unique=holds_failed)]) == 2


def test_a_discarded_failed_job_reads_none(engine, st):
    job_id = failed(engine, st, kind="a")
    st.discard_failed_by_kind(engine, "a")
    assert st.load_job(engine, job_id) is None


def test_dlq_and_terminal_history_are_disjoint(engine, st):
    c = dead(engine, st)
    job_id = failed(engine, st)
    st.move_failed_to_dlq(engine, job_id, "r")
    with engine.connect() as conn:
        both = conn.execute(text(
            f'SELECT count(*) FROM "{st.schema()}".dlq_entries q JOIN "{st.schema()}".done_entries d '
            f'USING (job_id)')).scalar_one()
    assert both == 0
    assert {c.job.id, job_id} == {r for (r,) in _dlq_ids(engine, st)}


def _dlq_ids(engine, s) -> list[tuple[int]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(f'SELECT job_id FROM "{s.schema()}".dlq_entries'))]
