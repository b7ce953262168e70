"""The deferred wheel: waits are appended to time buckets and resolved by appended marks;
promotion claims entries exactly once; a past slot whose entries are all resolved is
truncated; waits due beyond the span wait in the overflow (``deferred_jobs``) and move in."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from jobtools import BACKLOG, blocked_by, count, params, race
from sqlalchemy import event, text

from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig, RetryFromDlqOpts
from qstore.config import WHEEL_BUCKET_SECONDS, WHEEL_GUARD_SLOTS, WHEEL_SLOTS
from qstore.runtime.maintainer import Maintainer, MaintenanceSchedule
from qstore.types import JobRow, JobState

UTC = timezone.utc
FAR = timedelta(hours=2)  # beyond the wheel's span: a wait in the overflow
NEAR = timedelta(minutes=5)  # within the span: a wheel entry


def now() -> datetime:
    return datetime.now(UTC)


def defer(engine, st, run_at: datetime, **opts: object) -> int:
    (job_id,) = st.enqueue_many(engine, [params(run_at=run_at, **opts)])
    return job_id


def where_waiting(engine, st, job_id: int) -> str | None:
    """``wheel`` / ``overflow`` for the job's live wait, None when it has none."""
    s = st.schema()
    with engine.connect() as c:
        wheel = c.execute(text(
            f'SELECT count(*) FROM "{s}".deferred_wheel w WHERE w.job_id = :j AND NOT EXISTS '
            f'(SELECT 1 FROM "{s}".deferred_wheel_marks m WHERE m.entry_id = w.entry_id '
            f'AND m.wheel_slot = w.wheel_slot)'), {"j": job_id}).scalar_one()
        overflow = c.execute(text(f'SELECT count(*) FROM "{s}".deferred_jobs WHERE job_id = :j'),
                             {"j": job_id}).scalar_one()
    assert wheel + overflow <= 1, (wheel, overflow)
    return "wheel" if wheel else "overflow" if overflow else None


def wheel_rows(engine, st) -> int:
    with engine.connect() as c:
        return int(c.execute(text(f'SELECT (SELECT count(*) FROM "{st.schema()}".deferred_wheel) '
                                  f'+ (SELECT count(*) FROM "{st.schema()}".deferred_wheel_marks)')).scalar_one())


def ready_copies(engine, st) -> dict[int, int]:
    with engine.connect() as c:
        return {int(j): int(n) for j, n in c.execute(text(
            f'SELECT job_id, count(*) FROM "{st.schema()}".ready_entries GROUP BY job_id'))}


# -- routing ----------------------------------------------------------------------------------
def test_a_wait_within_the_span_is_a_wheel_entry_and_a_far_one_an_overflow_row(engine, st):
    near, far = defer(engine, st, now() + NEAR), defer(engine, st, now() + FAR)
    assert (where_waiting(engine, st, near), where_waiting(engine, st, far)) == ("wheel", "overflow")
    assert [st.load_job(engine, j).state for j in (near, far)] == [JobState.SCHEDULED] * 2  # type: ignore[union-attr]
    assert st.scheduled_count(engine, "q") == 2


def test_a_past_run_at_goes_to_the_current_bucket(engine, st):
    job_id = defer(engine, st, now() - timedelta(hours=1))
    with engine.connect() as c:
        bucket, current = c.execute(text(
            f'SELECT bucket, floor(extract(epoch FROM clock_timestamp()) / {WHEEL_BUCKET_SECONDS})::bigint '
            f'FROM "{st.schema()}".deferred_wheel WHERE job_id = :j'), {"j": job_id}).one()
    assert current - 1 <= bucket <= current  # a bucket boundary may pass between the two reads


def test_a_retry_waits_in_the_wheel(engine, st):
    st.enqueue_many(engine, [params()])
    (c,) = st.claim_runtime_batch(engine, "q", 1)
    assert st.retry_after(engine, c.job.id, c.job.run_lease, 60) is not None
    assert where_waiting(engine, st, c.job.id) == "wheel"
    assert st.load_job(engine, c.job.id).state is JobState.RETRYABLE  # type: ignore[union-attr]


# -- promotion --------------------------------------------------------------------------------
def test_promotion_takes_due_entries_by_run_at_then_priority(engine, st):
    t = now() - timedelta(seconds=10)
    late = defer(engine, st, t + timedelta(seconds=5), priority=1)
    low = defer(engine, st, t, priority=4)
    high = defer(engine, st, t, priority=2)
    defer(engine, st, now() + NEAR)  # not due
    assert st.promote_due(engine, JobState.SCHEDULED, 2) == 2
    states = {j: st.load_job(engine, j).state for j in (high, low, late)}  # type: ignore[union-attr]
    assert states == {high: JobState.AVAILABLE, low: JobState.AVAILABLE, late: JobState.SCHEDULED}
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 0


def test_promoting_both_states_takes_the_batch_due_first_across_both(engine, st):
    """Three schedules due ten seconds ago and two retries due now, batches of two: the
    schedules go first, then the third schedule with the first retry, then the other retry;
    no call takes a wait due later than one it leaves, whatever their states."""
    t = now() - timedelta(seconds=10)
    scheduled = [defer(engine, st, t + timedelta(seconds=i)) for i in range(3)]
    st.enqueue_many(engine, [params(), params()])
    retried = []
    for c in sorted(st.claim_runtime_batch(engine, "q", 2), key=lambda c: c.job.id):
        assert st.retry_after(engine, c.job.id, c.job.run_lease, 0) is not None
        retried.append(c.job.id)

    def waiting() -> set[int]:
        return {j for j in scheduled + retried
                if st.load_job(engine, j).state in (JobState.SCHEDULED, JobState.RETRYABLE)}  # type: ignore[union-attr]

    assert st.promote_all_due(engine, 2) == {JobState.SCHEDULED: 2, JobState.RETRYABLE: 0}
    assert waiting() == {scheduled[2], *retried}
    assert st.promote_all_due(engine, 2) == {JobState.SCHEDULED: 1, JobState.RETRYABLE: 1}
    assert waiting() == {retried[1]}
    assert st.promote_all_due(engine, 2) == {JobState.SCHEDULED: 0, JobState.RETRYABLE: 1}
    assert st.promote_all_due(engine, 2) == {JobState.SCHEDULED: 0, JobState.RETRYABLE: 0}


def test_waits_another_transaction_holds_do_not_keep_a_promotion_from_the_rest(engine, st):
    """A caller's transaction is cancelling the two waits due first; a promotion of both
    states in batches of two promotes the next two instead of stopping at the held ones."""
    t = now() - timedelta(seconds=10)
    held = [defer(engine, st, t + timedelta(seconds=i)) for i in range(2)]
    later = defer(engine, st, t + timedelta(seconds=2))
    st.enqueue_many(engine, [params()])
    (c,) = st.claim_runtime_batch(engine, "q", 1)
    assert st.retry_after(engine, c.job.id, c.job.run_lease, 0) is not None
    with engine.connect() as cancelling:
        assert len(st.cancel_jobs_by_ids(cancelling, held)) == 2
        assert st.promote_all_due(engine, 2) == {JobState.SCHEDULED: 1, JobState.RETRYABLE: 1}
        cancelling.commit()
    states = {j: st.load_job(engine, j).state for j in (*held, later, c.job.id)}  # type: ignore[union-attr]
    assert states == {**dict.fromkeys(held, JobState.CANCELLED), later: JobState.AVAILABLE,
                      c.job.id: JobState.AVAILABLE}


def test_promoting_both_states_orders_overflow_rows_with_wheel_entries(engine, st):
    """A due overflow row (one the maintainer has not moved into the wheel) takes its turn
    by its due time among the wheel's entries of the other state."""
    late = defer(engine, st, now() + FAR)
    with engine.begin() as c:
        c.execute(text(f'UPDATE "{st.schema()}".deferred_jobs SET run_at = clock_timestamp() - interval \'20 seconds\''))
    st.enqueue_many(engine, [params()])
    (c,) = st.claim_runtime_batch(engine, "q", 1)
    assert st.retry_after(engine, c.job.id, c.job.run_lease, 0) is not None
    assert st.promote_all_due(engine, 1) == {JobState.SCHEDULED: 1, JobState.RETRYABLE: 0}
    assert st.load_job(engine, late).state is JobState.AVAILABLE  # type: ignore[union-attr]
    assert st.promote_all_due(engine, 1) == {JobState.SCHEDULED: 0, JobState.RETRYABLE: 1}


def test_promoting_both_states_with_no_batch_moves_nothing(engine, st):
    defer(engine, st, now() - timedelta(seconds=1))
    assert st.promote_all_due(engine, 0) == {JobState.SCHEDULED: 0, JobState.RETRYABLE: 0}
    assert st.promote_all_due(engine, 1) == {JobState.SCHEDULED: 1, JobState.RETRYABLE: 0}


def test_promotion_skips_a_paused_queues_entries(engine, st):
    job_id = defer(engine, st, now() - timedelta(seconds=1))
    st.set_queue_options(engine, "q", paused=True)
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 0
    st.set_queue_options(engine, "q", paused=False)
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    assert st.load_job(engine, job_id).state is JobState.AVAILABLE  # type: ignore[union-attr]


def test_concurrent_promoters_promote_each_entry_exactly_once(engine, st):
    st.enqueue_many(engine, [params(args={"n": i}, run_at=now() - timedelta(seconds=1)) for i in range(300)])
    promoted: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def promoter() -> None:
        try:
            start.wait()
            while (n := st.promote_due(engine, JobState.SCHEDULED, 7)) > 0:
                promoted.append(n)
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=promoter) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert sum(promoted) == 300
    copies = ready_copies(engine, st)
    assert len(copies) == 300 and set(copies.values()) == {1}
    assert st.queue_counts(engine, "q").available == 300


PID = text("SELECT pg_backend_pid()")


def test_a_promotion_between_two_cancels_of_one_transaction_neither_waits_nor_deadlocks(engine, st):
    """A caller's transaction cancels a due retryable job, then a due scheduled one; a
    promotion of both states runs between the two cancels. The promotion skips the entry the
    caller's transaction holds instead of waiting for it (waiting while it holds the other
    entry's mark would deadlock with the caller's second cancel), promotes the scheduled
    job, and the caller's second cancel then finds that job available and cancels it."""
    st.enqueue_many(engine, [params()])
    (c,) = st.claim_runtime_batch(engine, "q", 1)
    assert st.retry_after(engine, c.job.id, c.job.run_lease, 0) is not None
    retried, scheduled = c.job.id, defer(engine, st, now() - timedelta(seconds=1))
    outcome: list[object] = []
    done = threading.Event()

    def promote() -> None:
        try:
            outcome.append(st.promote_all_due(engine, 100))
        except BaseException as err:  # reported below
            outcome.append(err)
        finally:
            done.set()

    promoter = threading.Thread(target=promote)
    with engine.connect() as conn:
        holder = conn.execute(PID).scalar_one()
        assert st.cancel_job(conn, retried) is not None
        promoter.start()
        blocked_by(engine, holder, done)  # (the fixed promotion does not wait: done first)
        try:
            second = st.cancel_job(conn, scheduled)
        finally:
            conn.commit()
            promoter.join()
    assert outcome == [{JobState.SCHEDULED: 1, JobState.RETRYABLE: 0}]
    assert second is not None and second.state is JobState.CANCELLED
    assert {j: st.load_job(engine, j).state for j in (retried, scheduled)} == dict.fromkeys(  # type: ignore[union-attr]
        (retried, scheduled), JobState.CANCELLED)


def test_a_due_job_is_promoted_by_one_promote_tick(engine, st):
    job_id = defer(engine, st, now() - timedelta(milliseconds=1))
    m = Maintainer(st, engine, MaintenanceSchedule())
    (report,) = [r for r in m.run_all() if r.task == "promote"]
    assert report.error is None and report.result["scheduled"] == 1
    assert st.load_job(engine, job_id).state is JobState.AVAILABLE  # type: ignore[union-attr]


def test_promotion_serves_a_due_overflow_row(engine, st):
    job_id = defer(engine, st, now() + FAR)
    with engine.begin() as c:  # the time passed (an overflow row the maintainer did not move in)
        c.execute(text(f'UPDATE "{st.schema()}".deferred_jobs SET run_at = clock_timestamp()'))
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    assert st.load_job(engine, job_id).state is JobState.AVAILABLE  # type: ignore[union-attr]
    assert count(engine, st, "deferred_jobs") == 0


# -- the overflow -----------------------------------------------------------------------------
def test_an_overflow_row_moves_into_the_wheel_once_within_the_span(engine, st):
    job_id = defer(engine, st, now() + FAR)
    assert st.advance_overflow(engine, 100) == 0
    with engine.begin() as c:  # the time passed: the wait is now due within the span
        c.execute(text(f'UPDATE "{st.schema()}".deferred_jobs SET run_at = clock_timestamp() + interval \'1 minute\''))
    before = st.load_job(engine, job_id)
    assert st.advance_overflow(engine, 100) == 1
    assert where_waiting(engine, st, job_id) == "wheel"
    after = st.load_job(engine, job_id)
    assert after == before  # the same wait: state, run_at, body


def test_the_maintainers_wheel_task_moves_overflow_rows_in(engine, st):
    job_id = defer(engine, st, now() + FAR)
    with engine.begin() as c:
        c.execute(text(f'UPDATE "{st.schema()}".deferred_jobs SET run_at = clock_timestamp() + interval \'1 minute\''))
    m = Maintainer(st, engine, MaintenanceSchedule())
    (report,) = [r for r in m.run_all() if r.task == "wheel"]
    assert report.error is None and report.result["overflow_moved"] == 1
    assert where_waiting(engine, st, job_id) == "wheel"


# -- truncation -------------------------------------------------------------------------------
def ahead(buckets: int) -> datetime:
    """A moment ``buckets`` buckets from now: what prune_wheel judges the slots' age by."""
    return now() + timedelta(seconds=buckets * WHEEL_BUCKET_SECONDS)


def test_prune_truncates_a_past_slot_once_every_entry_is_resolved(engine, st):
    for _ in range(3):
        defer(engine, st, now() - timedelta(seconds=1))
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 3
    assert wheel_rows(engine, st) == 6  # three entries, three marks
    assert st.prune_wheel(engine).pruned == ()  # the current bucket's slot is not past
    out = st.prune_wheel(engine, ahead(2))
    assert len(out.pruned) == 1 and not out.waiting and not out.blocked
    assert wheel_rows(engine, st) == 0
    assert st.queue_counts(engine, "q").available == 3


def test_prune_leaves_a_slot_with_an_unresolved_entry(engine, st):
    st.set_queue_options(engine, "q", paused=True)
    job_id = defer(engine, st, now() - timedelta(seconds=1))
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 0
    out = st.prune_wheel(engine, ahead(2))
    assert out.pruned == () and len(out.waiting) == 1
    assert where_waiting(engine, st, job_id) == "wheel"
    st.set_queue_options(engine, "q", paused=False)
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    assert len(st.prune_wheel(engine, ahead(2)).pruned) == 1


def test_prune_gives_up_quietly_on_a_held_slot(engine, st):
    defer(engine, st, now() - timedelta(seconds=1))
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    with engine.connect() as reader:  # a reader holding the wheel (ACCESS SHARE) until it ends
        reader.execute(text(f'SELECT count(*) FROM "{st.schema()}".deferred_wheel'))
        started = time.monotonic()
        out = st.prune_wheel(engine, ahead(2))
        assert len(out.blocked) == 1 and out.pruned == ()
        assert time.monotonic() - started < 2
        reader.rollback()
    assert len(st.prune_wheel(engine, ahead(2)).pruned) == 1


def test_prune_looks_only_at_the_guard_slots_behind_the_current_bucket(engine, st):
    defer(engine, st, now() - timedelta(seconds=1))
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    assert st.prune_wheel(engine, ahead(WHEEL_GUARD_SLOTS + 2)).pruned == ()
    assert WHEEL_GUARD_SLOTS < WHEEL_SLOTS
    assert wheel_rows(engine, st) == 2


def test_truncation_racing_inserts_and_promotion_loses_no_wait(engine, st):
    """Enqueues into the current bucket, promoters and a prune that judges the current
    slot past (so it tries to truncate the slot being written) run together: every job is
    promoted exactly once, none is lost with a truncated slot."""
    stop = threading.Event()
    errors: list[BaseException] = []
    enqueued: list[int] = []
    pruned: list[int] = []

    def guard(fn):  # type: ignore[no-untyped-def]
        def run() -> None:
            try:
                fn()
            except BaseException as err:  # pragma: no cover - reported below
                errors.append(err)
                stop.set()
        return run

    @guard
    def producer() -> None:
        while not stop.is_set():
            enqueued.extend(st.enqueue_many(engine, [params(run_at=now() - timedelta(seconds=1)) for _ in range(5)]))
            time.sleep(0.05)  # bursts: promotion catches up, so the slot is all resolved at times

    @guard
    def promoter() -> None:
        while not stop.is_set():
            st.promote_due(engine, JobState.SCHEDULED, 20)

    @guard
    def pruner() -> None:
        while not stop.is_set():
            pruned.extend(st.prune_wheel(engine, ahead(1)).pruned)

    threads = [threading.Thread(target=t) for t in (producer, producer, promoter, promoter, pruner)]
    for th in threads:
        th.start()
    started = time.monotonic()
    while not stop.is_set() and (time.monotonic() - started < 1.5 or not pruned) and time.monotonic() - started < 20:
        time.sleep(0.1)  # at least 1.5 s, and until a slot was truncated under the writers
    stop.set()
    for th in threads:
        th.join()
    assert not errors
    while st.promote_due(engine, JobState.SCHEDULED, 1000):
        pass
    copies = ready_copies(engine, st)
    assert sorted(copies) == sorted(enqueued) and set(copies.values()) == {1}
    assert pruned  # the race was run: slots were truncated while it lasted


# -- operators --------------------------------------------------------------------------------
@pytest.mark.parametrize("delay", [NEAR, FAR], ids=["wheel", "overflow"])
def test_cancel_ends_a_wait(engine, st, delay):
    job_id = defer(engine, st, now() + delay)
    row = st.cancel_job(engine, job_id)
    assert row is not None and row.state is JobState.CANCELLED
    assert where_waiting(engine, st, job_id) is None
    assert st.load_job(engine, job_id).state is JobState.CANCELLED  # type: ignore[union-attr]
    assert st.scheduled_count(engine, "q") == 0


@pytest.mark.parametrize("delay", [NEAR, FAR], ids=["wheel", "overflow"])
def test_set_priority_moves_a_wait_and_keeps_its_time(engine, st, delay):
    job_id = defer(engine, st, now() + delay, priority=3)
    before = st.load_job(engine, job_id)
    assert st.set_priority(engine, job_id, 1) is True
    after = st.load_job(engine, job_id)
    assert (after.state, after.priority, after.run_at) == (JobState.SCHEDULED, 1, before.run_at)  # type: ignore[union-attr]
    assert after.metadata["_qstore_original_priority"] == 3  # type: ignore[union-attr]
    assert where_waiting(engine, st, job_id) == ("wheel" if delay == NEAR else "overflow")
    assert count(engine, st, BACKLOG) == 1
    assert st.set_priority(engine, job_id, 1) is False  # nothing to change


@pytest.mark.parametrize("delay", [NEAR, FAR], ids=["wheel", "overflow"])
def test_move_queue_moves_a_wait(engine, st, delay):
    job_id = defer(engine, st, now() + delay)
    assert st.move_queue(engine, job_id, "other") is True
    row = st.load_job(engine, job_id)
    assert (row.state, row.queue) == (JobState.SCHEDULED, "other")  # type: ignore[union-attr]
    assert (st.scheduled_count(engine, "q"), st.scheduled_count(engine, "other")) == (0, 1)


def test_a_moved_wheel_entry_is_promoted_once_in_its_new_queue(engine, st):
    job_id = defer(engine, st, now() - timedelta(seconds=1))
    st.set_queue_options(engine, "q", paused=True)
    assert st.move_queue(engine, job_id, "other") is True
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    (c,) = st.claim_runtime_batch(engine, "other", 10)
    assert c.job.id == job_id and ready_copies(engine, st) == {job_id: 1}


def test_cancel_of_a_promoted_wait_finds_the_available_job(engine, st):
    job_id = defer(engine, st, now() - timedelta(seconds=1))
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    row = st.cancel_job(engine, job_id)
    assert row is not None and row.state is JobState.CANCELLED
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 0


def test_two_multi_job_cancels_of_the_same_waits_in_opposite_orders_do_not_deadlock(engine, st):
    """A multi-job cancel takes its jobs in ascending id order, whatever order it was given:
    two such calls over the same jobs lock them in the same order, so the second waits for
    the first instead of deadlocking with it. The rows come back in the caller's order."""
    a, b = defer(engine, st, now() + NEAR), defer(engine, st, now() + NEAR)
    outcome: list[object] = []
    done = threading.Event()

    def second() -> None:
        try:
            outcome.append(st.cancel_jobs_by_ids(engine, [a, b]))
        except BaseException as err:  # reported below
            outcome.append(err)
        finally:
            done.set()

    other = threading.Thread(target=second)
    with engine.connect() as first:
        holder = first.execute(PID).scalar_one()

        @event.listens_for(first, "after_cursor_execute")
        def once_a_wait_is_held(conn, cursor, statement, *args) -> None:
            if "deferred_wheel_marks" in statement and "FOR UPDATE" in statement and other.ident is None:
                other.start()  # the first call holds one wait: the second call runs now
                blocked_by(engine, holder, done)

        rows = st.cancel_jobs_by_ids(first, [b, a])
        first.commit()
    other.join()
    assert [r.id for r in rows] == [b, a] and {r.state for r in rows} == {JobState.CANCELLED}
    assert outcome == [[]]  # found both cancelled once the first call committed


def _due_wait(engine, st, place: str) -> int:
    """A scheduled job due a second ago, in the wheel or in an overflow row not yet moved in."""
    job_id = defer(engine, st, now() + (NEAR if place == "wheel" else FAR))
    with engine.begin() as c:
        table = "deferred_wheel" if place == "wheel" else "deferred_jobs"
        c.execute(text(f'UPDATE "{st.schema()}".{table} SET run_at = clock_timestamp() - interval \'1 second\''))
    return job_id


def _behind_a_promotion(engine, st, call) -> object:
    """Run ``call`` while a promotion of the due wait holds its transaction open, check
    that the call waits for it, commit the promotion; what ``call`` returned."""

    def promote(conn) -> None:
        assert st.promote_all_due(conn, 10)[JobState.SCHEDULED] == 1

    return race(engine, promote, call)


@pytest.mark.parametrize("place", ["wheel", "overflow"])
def test_a_cancel_that_waits_for_a_promotion_cancels_the_job_it_made_available(engine, st, place):
    """The cancel looks in the ready ring first, finds nothing, then waits for the wait a
    promotion holds; once the promotion commits, the job is available, and the cancel ends
    it there instead of reporting that nothing was live."""
    job_id = _due_wait(engine, st, place)
    row = _behind_a_promotion(engine, st, lambda: st.cancel_job(engine, job_id))
    assert isinstance(row, JobRow) and row.state is JobState.CANCELLED, row
    assert st.load_job(engine, job_id).state is JobState.CANCELLED  # type: ignore[union-attr]
    assert st.queue_counts(engine, "q").available == 0


@pytest.mark.parametrize("place", ["wheel", "overflow"])
def test_a_priority_change_that_waits_for_a_promotion_moves_the_job_it_made_available(engine, st, place):
    job_id = _due_wait(engine, st, place)
    assert _behind_a_promotion(engine, st, lambda: st.set_priority(engine, job_id, 1)) is True
    row = st.load_job(engine, job_id)
    assert row is not None and (row.state, row.priority) == (JobState.AVAILABLE, 1)
    assert st.queue_counts(engine, "q").available == 1


@pytest.mark.parametrize("delay", [NEAR, FAR], ids=["wheel", "overflow"])
def test_retry_from_dlq_at_a_time_waits_in_the_backlog(engine, st, delay):
    st.set_queue_options(engine, "q", dlq_enabled=True)
    st.enqueue_many(engine, [params()])
    (c,) = st.claim_runtime_batch(engine, "q", 1)
    st.fail_terminal(engine, c.job.id, c.job.run_lease, "fatal")
    assert st.move_failed_to_dlq(engine, c.job.id, "why") is not None or True
    row = st.retry_from_dlq(engine, c.job.id, RetryFromDlqOpts(run_at=now() + delay))
    assert row is not None and row.state is JobState.SCHEDULED
    assert where_waiting(engine, st, c.job.id) == ("wheel" if delay == NEAR else "overflow")


# -- reads ------------------------------------------------------------------------------------
def test_status_counts_wheel_and_overflow_waits(engine, st):
    from qstore.status import queue_status

    defer(engine, st, now() + NEAR)
    defer(engine, st, now() + FAR)
    promoted = defer(engine, st, now() - timedelta(seconds=1))
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    (q,) = [x for x in queue_status(engine, st) if x.queue == "q"]
    assert (q.scheduled, q.retryable, q.available) == (2, 0, 1)
    assert st.load_job(engine, promoted).state is JobState.AVAILABLE  # type: ignore[union-attr]


def test_unique_key_of_a_wheel_entry_is_held_until_it_ends(engine, st):
    from qstore import UniqueConflictError, UniqueOpts

    unique = UniqueOpts(by_args=True)
    job = InsertParams("k", {"u": 1}, InsertOpts(queue="q", unique=unique, run_at=now() + NEAR))
    (job_id,) = st.enqueue_many(engine, [job])
    with pytest.raises(UniqueConflictError):
        st.enqueue_many(engine, [job])
    assert st.cancel_job(engine, job_id) is not None
    assert len(st.enqueue_many(engine, [job])) == 1


# -- dead tuples ------------------------------------------------------------------------------
def test_waits_leave_no_dead_tuple_in_the_backlog_under_a_pinned_horizon(fresh_engine):
    """Delayed, retried and snoozed jobs wait, are promoted and complete while another
    transaction pins the MVCC horizon: the wheel, its marks and the overflow hold no dead
    tuple (``pgstattuple``, exact), and the wheel's past slot is still truncated. (A database
    of its own: the pin would stand down other tests' counter rollups.)"""
    engine = fresh_engine
    st = QueueStorage(QueueStorageConfig(schema="pinned", queue_slot_count=4, lease_slot_count=2,
                                         claim_slot_count=2))
    st.prepare_schema(engine)
    try:
        with engine.begin() as c:
            c.execute(text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))
    except Exception:  # pragma: no cover - a server without contrib
        pytest.skip("pgstattuple is not available on the server")
    s = st.schema()
    with engine.connect() as pin:
        pin.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        pin.execute(text("SELECT txid_current()"))  # an xid and a snapshot: the horizon stays here

        def run_all() -> list:
            while st.promote_due(engine, JobState.SCHEDULED, 100) or st.promote_due(engine, JobState.RETRYABLE, 100):
                pass
            got = st.claim_runtime_batch(engine, "q", 100)
            return got

        st.enqueue_many(engine, [params(args={"n": i}, run_at=now() - timedelta(seconds=1)) for i in range(30)])
        first = run_all()
        assert len(first) == 30
        for c in first[:10]:
            assert st.retry_after(engine, c.job.id, c.job.run_lease, 0) is not None
        for c in first[10:20]:
            assert st.snooze(engine, c.job.id, c.job.run_lease, 0) is not None
        st.complete_runtime_batch(engine, first[20:])
        second = run_all()
        assert len(second) == 20
        st.complete_runtime_batch(engine, second)
        assert st.queue_counts(engine, "q").terminal == 30
        with engine.connect() as c:
            dead = {name: int(n) for name, n in c.execute(text(
                "SELECT c.relname, (pgstattuple(c.oid)).dead_tuple_count FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s AND c.relkind = 'r' "
                "AND (c.relname LIKE 'deferred\\_wheel%' OR c.relname = 'deferred_jobs')"), {"s": s})}
            written = c.execute(text(f'SELECT count(*) FROM "{s}".deferred_wheel')).scalar_one()
        assert written == 50 and len(dead) == 2 * WHEEL_SLOTS + 1
        assert sum(dead.values()) == 0, {k: v for k, v in dead.items() if v}
        assert len(st.prune_wheel(engine, ahead(2)).pruned) >= 1  # TRUNCATE needs no horizon
        assert wheel_rows(engine, st) == 0
        pin.rollback()



@pytest.mark.parametrize("statement", ["take_due_entries", "take_due_overflow", "due_bound"])
def test_promotion_reads_only_due_waits_through_the_due_index(engine, st, statement: str) -> None:
    """The due bound is an index condition, so a promotion reads the due waits, not every
    wait of the state (a volatile clock in the bound would make it a filter over all)."""
    from qstore.storage.planes.queue import NO_DUE_BOUND, deferred_statements

    compiled = getattr(deferred_statements(st.tables), statement).compile(engine)
    run_at, priority, job = NO_DUE_BOUND
    params = {**compiled.params, "state": "scheduled", "limit": 10, "skip": 9, "upto_run_at": run_at,
              "upto_priority": priority, "upto_job": job}
    with engine.connect() as conn:
        plan = "\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + str(compiled), params))
    conds = [line for line in plan.splitlines() if "Index Cond" in line and "state =" in line]
    assert conds and all("run_at <= statement_timestamp()" in line for line in conds), plan


@pytest.mark.parametrize("state", ["scheduled", "retryable"])
def test_the_due_probe_is_one_parameterless_statement_over_the_due_indexes(engine, st, state: str) -> None:
    """A promotion pass first asks whether anything is due: a statement without parameters
    (prepared, so the server plans it once per connection) that reads the wheel and the
    overflow through their due indexes, bounded by the due time."""
    from qstore.storage.planes.queue import deferred_statements

    sql, binds = deferred_statements(st.tables).due_probes[state].compiled(engine.dialect)
    assert binds == ()
    with engine.connect() as conn:
        plan = "\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + sql, ()))
    conds = [line for line in plan.splitlines() if "Index Cond" in line and "state =" in line]
    assert conds and all("run_at <= statement_timestamp()" in line and f"'{state}'" in line for line in conds), plan
    assert "deferred_jobs_due_idx" in plan and "deferred_wheel_marks" in plan, plan


@pytest.mark.parametrize("place", ["wheel", "overflow"])
@pytest.mark.parametrize("state", [JobState.SCHEDULED, JobState.RETRYABLE])
def test_the_due_probe_finds_a_due_wait_of_its_state_until_it_is_promoted(engine, st, state, place) -> None:
    from qstore.storage.targets import Policy, run
    from qstore.storage.upkeep.rescue import any_due

    def due(s: JobState) -> bool:
        return run(Policy.STATEMENT, engine, lambda r: any_due(r, st.tables, s))

    other = JobState.RETRYABLE if state is JobState.SCHEDULED else JobState.SCHEDULED
    job_id = defer(engine, st, now() + (FAR if place == "overflow" else NEAR))
    assert where_waiting(engine, st, job_id) == place and not due(state) and not due(other)
    table = "deferred_jobs" if place == "overflow" else "deferred_wheel"
    with engine.begin() as c:  # the time passed (and the wait is of the state under test)
        c.execute(text(f'UPDATE "{st.schema()}".{table} SET run_at = clock_timestamp(), state = :s '
                       'WHERE job_id = :j'), {"s": state.value, "j": job_id})
    assert due(state) and not due(other)
    st.set_queue_options(engine, "q", paused=True)
    assert not due(state)
    st.set_queue_options(engine, "q", paused=False)
    assert st.promote_due(engine, state, 10) == 1
    assert not due(state) and where_waiting(engine, st, job_id) is None
