"""Reads: exact and fast queue counts across lifecycle phases, and ``load_job`` in every plane."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from jobtools import BACKLOG, relation
from sqlalchemy import text

from qstore import InsertOpts, InsertParams, JobState, QueueCounts, ValidationError

UTC = timezone.utc


def job(args: object = None, **opts: object) -> InsertParams:
    opts.setdefault("queue", "q")
    return InsertParams("k", {} if args is None else args, InsertOpts(**opts))


def only_job_id(engine, storage, table: str) -> int:
    with engine.connect() as c:
        return c.execute(text(f'SELECT job_id FROM {relation(storage.schema(), table)}')).scalar_one()


def assert_fast_bounds(engine, storage, queue: str = "q") -> None:
    exact = storage.queue_counts(engine, queue)
    fast = storage.queue_counts_fast(engine, queue)
    assert fast.available >= exact.available
    assert fast.terminal <= exact.terminal
    assert fast.running <= exact.running


@pytest.mark.parametrize("receipts", [True, False], ids=["receipts", "leases"])
def test_exact_counts_follow_enqueue_claim_complete(engine, make_storage, receipts):
    storage = make_storage(lease_claim_receipts=receipts)
    assert storage.queue_counts(engine, "q") == QueueCounts(0, 0, 0)

    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(6)])
    storage.enqueue_params_copy(engine, [job({"i": i}, priority=1) for i in range(4)])
    storage.enqueue_params_batch(engine, [job(run_at=datetime.now(UTC) + timedelta(hours=1))])
    assert storage.queue_counts(engine, "q") == QueueCounts(available=10, running=0, terminal=0)
    assert_fast_bounds(engine, storage)

    claimed = storage.claim_runtime_batch(engine, "q", 7)
    assert storage.queue_counts(engine, "q") == QueueCounts(available=3, running=7, terminal=0)
    assert_fast_bounds(engine, storage)

    storage.complete_runtime_batch(engine, claimed[:5])
    assert storage.queue_counts(engine, "q") == QueueCounts(available=3, running=2, terminal=5)
    assert_fast_bounds(engine, storage)

    storage.complete_runtime_batch(engine, claimed[5:] + storage.claim_runtime_batch(engine, "q", 10))
    assert storage.queue_counts(engine, "q") == QueueCounts(available=0, running=0, terminal=10)
    assert_fast_bounds(engine, storage)


def test_counts_are_per_queue(engine, storage):
    storage.enqueue_params_batch(engine, [job(queue="a"), job(queue="a"), job(queue="b")])
    storage.claim_runtime_batch(engine, "b", 1)
    assert storage.queue_counts(engine, "a") == QueueCounts(2, 0, 0)
    assert storage.queue_counts(engine, "b") == QueueCounts(0, 1, 0)
    assert storage.queue_counts(engine, "unknown") == QueueCounts(0, 0, 0)
    assert storage.queue_counts_fast(engine, "unknown") == QueueCounts(0, 0, 0)


def test_counts_of_striped_queue_cover_all_stripes(engine, make_storage):
    storage = make_storage(queue_stripe_count=3)
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(9)])
    assert storage.queue_counts(engine, "q").available == 9
    storage.complete_runtime_batch(engine, storage.claim_runtime_batch(engine, "q", 4))
    assert storage.queue_counts(engine, "q") == QueueCounts(available=5, running=0, terminal=4)
    assert_fast_bounds(engine, storage)


def test_fast_available_counts_uncommitted_reservations_exact_does_not(engine, storage):
    storage.set_queue_options(engine, "q", enqueue_shards=1)  # the reservation is in the committed lane
    storage.enqueue_params_batch(engine, [job()])
    with engine.connect() as conn:
        conn.begin()
        storage.enqueue_params_batch(conn, [job(), job()])
        assert storage.queue_counts(engine, "q").available == 1
        assert storage.queue_counts_fast(engine, "q").available == 3  # upper bound
        conn.rollback()
    assert storage.queue_counts(engine, "q").available == 1
    assert_fast_bounds(engine, storage)


def test_counts_reject_bad_queue_names(engine, storage):
    for read in (storage.queue_counts, storage.queue_counts_fast):
        with pytest.raises(ValidationError):
            read(engine, "")


# -- load_job ---------------------------------------------------------------------------------

def test_load_job_finds_an_available_job(engine, storage):
    storage.enqueue_params_batch(engine, [job({"a": 1}, priority=3, max_attempts=4,
                                              metadata={"m": True}, tags=["t"])])
    job_id = only_job_id(engine, storage, "ready_entries")
    loaded = storage.load_job(engine, job_id)
    assert (loaded.id, loaded.state, loaded.queue, loaded.args, loaded.priority) \
        == (job_id, JobState.AVAILABLE, "q", {"a": 1}, 3)
    assert (loaded.attempt, loaded.run_lease, loaded.max_attempts) == (0, 0, 4)
    assert (loaded.metadata, loaded.tags) == ({"m": True}, ["t"])


def test_load_job_finds_a_scheduled_job(engine, storage):
    when = datetime.now(UTC) + timedelta(hours=3)
    storage.enqueue_params_batch(engine, [job({"s": 1}, run_at=when)])
    loaded = storage.load_job(engine, only_job_id(engine, storage, BACKLOG))
    assert (loaded.state, loaded.run_at, loaded.args) == (JobState.SCHEDULED, when, {"s": 1})


def test_load_job_finds_a_running_job(engine, storage):
    storage.enqueue_params_batch(engine, [job({"r": 1})])
    (c,) = storage.claim_runtime_batch(engine, "q", 1, timedelta(minutes=1))
    loaded = storage.load_job(engine, c.job.id)
    assert (loaded.state, loaded.run_lease, loaded.attempt) == (JobState.RUNNING, 1, 1)
    assert loaded.deadline_at == c.job.deadline_at
    assert loaded.args == {"r": 1}


def test_load_job_finds_a_running_materialised_lease(engine, make_storage):
    storage = make_storage(lease_claim_receipts=False)
    storage.enqueue_params_batch(engine, [job({"r": 1})])
    (c,) = storage.claim_runtime_batch(engine, "q", 1)
    loaded = storage.load_job(engine, c.job.id)
    assert (loaded.state, loaded.run_lease, loaded.args) == (JobState.RUNNING, 1, {"r": 1})


def test_load_job_finds_a_completed_job(engine, storage):
    storage.enqueue_params_batch(engine, [job({"c": 1})])
    (c,) = storage.claim_runtime_batch(engine, "q", 1)
    storage.complete_runtime_batch(engine, [c])
    loaded = storage.load_job(engine, c.job.id)
    assert (loaded.state, loaded.run_lease, loaded.args) == (JobState.COMPLETED, 1, {"c": 1})
    assert loaded.finalized_at is not None


def test_load_job_returns_none_for_unknown_id(engine, storage):
    storage.enqueue_params_batch(engine, [job()])
    assert storage.load_job(engine, 424242) is None


def test_scheduled_count_is_the_queues_deferred_backlog(engine, st):  # type: ignore[no-untyped-def]
    from datetime import datetime, timedelta, timezone

    from qstore import InsertOpts, InsertParams

    later = datetime.now(timezone.utc) + timedelta(hours=1)
    for queue in ("q", "q", "other"):
        st.enqueue(engine, InsertParams("k", {}, InsertOpts(queue=queue, run_at=later)))
    st.enqueue(engine, InsertParams("k", {}, InsertOpts(queue="q")))  # available, not scheduled
    assert st.scheduled_count(engine, "q") == 2
    assert st.scheduled_count(engine, "other") == 1
    assert st.scheduled_count(engine, "unknown") == 0
