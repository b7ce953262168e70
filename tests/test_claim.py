"""Claim: FIFO per lane, strict priority, aging (the effective priority kept apart from the
lane's), attempt bookkeeping (``attempted_at`` always set), deadlines, pause gates (looked up
by the logical queue), receipts vs materialised leases, bad input and the caller's
transaction."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from jobtools import (
    attempt_table,
    both_receipt_modes,
    forget_seen_slot,
    install_in_mode,
    relation_locks,
    requeue,
    seen_slot,
    set_seen_slot,
)
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from qstore import ClaimedEntry, InsertOpts, InsertParams, JobRow, JobState, ValidationError
from qstore.storage.columns import field_names
from qstore.types import ClaimedRuntimeJob

UTC = timezone.utc
ORIGINAL_PRIORITY = "_qstore_original_priority"
AGING = timedelta(milliseconds=20)


def job(args: object = None, **opts: object) -> InsertParams:
    opts.setdefault("queue", "q")
    return InsertParams("k", {} if args is None else args, InsertOpts(**opts))


def count_rows(engine, storage, table: str, where: str = "true", **params) -> int:
    with engine.connect() as c:
        return c.execute(text(f'SELECT count(*) FROM "{storage.schema()}".{table} WHERE {where}'),
                         params).scalar_one()


@pytest.fixture
def storage(request, make_storage):
    """A default install; in tests marked ``both_receipt_modes("storage")``, one with
    receipts on, then one with receipts off (every attempt a lease)."""
    return install_in_mode(request, make_storage)


def pause(engine, storage, queue: str, paused: bool = True) -> None:
    with engine.begin() as c:
        c.execute(text(f'INSERT INTO "{storage.schema()}".queue_meta (queue, paused) VALUES (:q, :p) '
                       "ON CONFLICT (queue) DO UPDATE SET paused = excluded.paused"),
                  {"q": queue, "p": paused})




# -- order ----------------------------------------------------------------------------------

def test_claims_within_a_lane_are_fifo(engine, storage):
    storage.set_queue_options(engine, "q", enqueue_shards=1)  # every batch in one lane
    for b in range(4):
        storage.enqueue_params_batch(engine, [job({"n": b * 5 + i}) for i in range(5)])

    seen: list[int] = []
    while batch := storage.claim_runtime_batch(engine, "q", 3):
        assert len(batch) <= 3
        seen += [j.job.args["n"] for j in batch]

    assert seen == list(range(20))


def test_claim_returns_lane_positions_in_order_with_ids(engine, storage):
    storage.enqueue_params_copy(engine, [job({"n": i}) for i in range(6)])
    claimed = storage.claim_runtime_batch(engine, "q", 6)
    assert [j.claim.lane_seq for j in claimed] == [1, 2, 3, 4, 5, 6]
    assert [j.job.id for j in claimed] == sorted(j.job.id for j in claimed)
    assert all(j.claim.job_id == j.job.id and j.claim.run_lease == j.job.run_lease for j in claimed)


def test_claim_takes_at_most_max_batch(engine, storage):
    storage.enqueue_params_batch(engine, [job({"n": i}) for i in range(10)])
    assert len(storage.claim_runtime_batch(engine, "q", 4)) == 4
    assert len(storage.claim_runtime_batch(engine, "q", 4)) == 4
    assert len(storage.claim_runtime_batch(engine, "q", 4)) == 2
    assert storage.claim_runtime_batch(engine, "q", 4) == []


def test_strict_priority_order_without_aging(engine, storage):
    storage.enqueue_params_batch(engine, [job({"p": 4, "i": i}, priority=4) for i in range(4)])
    storage.enqueue_params_batch(engine, [job({"p": 3, "i": i}, priority=3) for i in range(2)])
    storage.enqueue_params_batch(engine, [job({"p": 1, "i": i}, priority=1) for i in range(4)])

    order: list[tuple[int, int]] = []
    while batch := storage.claim_runtime_batch(engine, "q", 3):
        order += [(j.job.priority, j.job.args["i"]) for j in batch]

    assert order == [(1, 0), (1, 1), (1, 2), (1, 3), (3, 0), (3, 1), (4, 0), (4, 1), (4, 2), (4, 3)]


def test_one_claim_can_span_several_priority_lanes(engine, storage):
    storage.enqueue_params_batch(engine, [job({"p": 2}, priority=2), job({"p": 1}, priority=1)])
    claimed = storage.claim_runtime_batch(engine, "q", 10)
    assert [j.job.args["p"] for j in claimed] == [1, 2]


# -- aging: effective priority apart from the lane's --------------------------------------------------------------------------

@pytest.fixture
def aged_pair(engine, storage):
    """An old priority-4 job (aged past three AGING intervals) and a fresh priority-1 job."""
    storage.enqueue_params_batch(engine, [job({"who": "old"}, priority=4, metadata={"m": "x"})])
    time.sleep(5 * AGING.total_seconds())
    storage.enqueue_params_batch(engine, [job({"who": "new"}, priority=1)])
    return storage


@both_receipt_modes("storage")
def test_aging_promotes_old_low_priority_work(engine, aged_pair):
    storage = aged_pair
    first = storage.claim_runtime_batch_with_aging(engine, "q", 1, None, AGING)
    second = storage.claim_runtime_batch_with_aging(engine, "q", 1, None, AGING)

    assert [j.job.args["who"] for j in first + second] == ["old", "new"]


@both_receipt_modes("storage")
def test_aged_claim_reports_effective_priority_and_original_in_metadata(engine, aged_pair):
    (old,) = aged_pair.claim_runtime_batch_with_aging(engine, "q", 1, None, AGING)

    assert old.job.priority == 1  # effective
    assert old.job.metadata == {"m": "x", ORIGINAL_PRIORITY: 4}
    assert old.claim.priority == 4  # the lane priority, the join key back to the ready row
    s = aged_pair.schema()
    table = attempt_table(aged_pair)  # the receipt, or the lease when receipts are off
    with engine.connect() as c:
        assert c.execute(text(f'SELECT priority, effective_priority FROM "{s}".{table} '
                              "WHERE job_id = :j"), {"j": old.job.id}).one() == (4, 1)


@both_receipt_modes("storage")
def test_unaged_claim_has_no_original_priority_marker(engine, aged_pair):
    aged_pair.claim_runtime_batch_with_aging(engine, "q", 1, None, AGING)
    (new,) = aged_pair.claim_runtime_batch_with_aging(engine, "q", 1, None, AGING)
    assert new.job.priority == 1
    assert ORIGINAL_PRIORITY not in new.job.metadata


@both_receipt_modes("storage")
def test_load_job_of_aged_running_attempt_shows_effective_priority(engine, aged_pair):
    (old,) = aged_pair.claim_runtime_batch_with_aging(engine, "q", 1, None, AGING)
    loaded = aged_pair.load_job(engine, old.job.id)
    assert loaded.state is JobState.RUNNING
    assert loaded.priority == 1
    assert loaded.metadata[ORIGINAL_PRIORITY] == 4


@both_receipt_modes("storage")
def test_completed_aged_job_carries_its_lane_priority(engine, storage):
    storage.enqueue_params_batch(engine, [job({"who": "fast"}, priority=4),
                                          job({"who": "by_id"}, priority=4)])
    time.sleep(5 * AGING.total_seconds())
    fast, by_id = storage.claim_runtime_batch_with_aging(engine, "q", 2, None, AGING)
    assert fast.job.priority == by_id.job.priority == 1

    assert storage.complete_runtime_batch(engine, [fast]) == [(fast.job.id, 1)]
    assert storage.complete_job_batch_by_id(engine, [(by_id.job.id, 1)]) == [(by_id.job.id, 1)]

    for c in (fast, by_id):
        loaded = storage.load_job(engine, c.job.id)
        assert (loaded.state, loaded.priority, loaded.args) \
            == (JobState.COMPLETED, 4, {"who": c.job.args["who"]})
        assert count_rows(engine, storage, "terminal_jobs", "job_id = :j AND priority = 4", j=c.job.id) == 1


@both_receipt_modes("storage")
def test_without_aging_the_old_low_priority_job_waits(engine, aged_pair):
    first = aged_pair.claim_runtime_batch(engine, "q", 1)
    assert [j.job.args["who"] for j in first] == ["new"]


# -- attempt bookkeeping ----------------------------------------------------------------------

def test_first_claim_starts_attempt_one_with_run_lease_one(engine, storage):
    storage.enqueue_params_batch(engine, [job({"x": 1}, max_attempts=7)])
    (c,) = storage.claim_runtime_batch(engine, "q", 1)
    assert (c.job.state, c.job.attempt, c.job.run_lease, c.job.max_attempts) \
        == (JobState.RUNNING, 1, 1, 7)
    assert c.unique_states is None and c.job.args == {"x": 1} and c.job.kind == "k"


def test_every_claim_increments_run_lease_and_attempt(engine, storage):
    storage.enqueue_params_batch(engine, [job()])
    (first,) = storage.claim_runtime_batch(engine, "q", 1)
    requeue(engine, storage, first)

    (second,) = storage.claim_runtime_batch(engine, "q", 1)

    assert second.job.id == first.job.id
    assert (second.job.attempt, second.job.run_lease) == (2, 2)


def test_attempted_at_is_set_without_deadline(engine, storage):
    storage.enqueue_params_batch(engine, [job()])
    before = datetime.now(UTC)
    (c,) = storage.claim_runtime_batch(engine, "q", 1)
    assert c.job.deadline_at is None
    assert c.job.attempted_at is not None
    assert before - timedelta(seconds=5) < c.job.attempted_at < datetime.now(UTC) + timedelta(seconds=5)
    loaded = storage.load_job(engine, c.job.id)
    assert loaded.attempted_at == c.job.attempted_at


def test_attempted_at_is_set_on_materialised_leases_too(engine, make_storage):
    storage = make_storage(lease_claim_receipts=False)
    storage.enqueue_params_batch(engine, [job()])
    (c,) = storage.claim_runtime_batch(engine, "q", 1)
    assert c.job.attempted_at is not None
    assert storage.load_job(engine, c.job.id).attempted_at == c.job.attempted_at


def test_deadline_duration_sets_deadline_at(engine, storage):
    storage.enqueue_params_batch(engine, [job(), job(), job()])
    for deadline in (timedelta(seconds=30), 30, 30.0):  # timedelta or seconds
        (c,) = storage.claim_runtime_batch(engine, "q", 1, deadline)
        assert c.job.deadline_at - c.job.attempted_at == timedelta(seconds=30)
        assert abs(c.job.deadline_at - (datetime.now(UTC) + timedelta(seconds=30))) < timedelta(seconds=10)
        s = storage.schema()
        with engine.connect() as conn:
            stored = conn.execute(text(f'SELECT deadline_at FROM "{s}".lease_claims WHERE job_id = :j'),
                                  {"j": c.job.id}).scalar_one()
        assert stored == c.job.deadline_at


def test_deadline_is_stamped_on_materialised_leases(engine, make_storage):
    storage = make_storage(lease_claim_receipts=False)
    storage.enqueue_params_batch(engine, [job()])
    (c,) = storage.claim_runtime_batch(engine, "q", 1, timedelta(seconds=10))
    with engine.connect() as conn:
        stored = conn.execute(text(f'SELECT deadline_at FROM "{storage.schema()}".leases')).scalar_one()
    assert stored == c.job.deadline_at == c.job.attempted_at + timedelta(seconds=10)


# -- pause ------------------------------------------------------------------------------------

def test_paused_queue_is_not_claimed(engine, storage):
    storage.enqueue_params_batch(engine, [job()])
    pause(engine, storage, "q")
    assert storage.claim_runtime_batch(engine, "q", 10) == []
    pause(engine, storage, "q", paused=False)
    assert len(storage.claim_runtime_batch(engine, "q", 10)) == 1


def test_pausing_one_queue_leaves_others_claimable(engine, storage):
    storage.enqueue_params_batch(engine, [job(queue="q"), job(queue="other")])
    pause(engine, storage, "q")
    assert len(storage.claim_runtime_batch(engine, "other", 10)) == 1


def test_pausing_logical_queue_blocks_every_stripe(engine, make_storage):
    storage = make_storage(queue_stripe_count=2)
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(4)])
    pause(engine, storage, "q")  # the logical name only, never a stripe's

    assert storage.claim_runtime_batch(engine, "q", 10) == []
    assert storage.claim_runtime_batch(engine, "q#0", 10) == []
    assert storage.claim_runtime_batch(engine, "q#1", 10) == []
    assert storage.claim_batch(engine, "q", 10) == []

    pause(engine, storage, "q", paused=False)
    assert len(storage.claim_runtime_batch(engine, "q", 10)) == 4


# -- empty / unknown --------------------------------------------------------------------------

def test_claim_on_unknown_queue_returns_nothing(engine, storage):
    assert storage.claim_runtime_batch(engine, "nobody-ever-used-this", 5) == []
    assert storage.claim_batch(engine, "nobody-ever-used-this", 5) == []


def test_claim_on_drained_queue_returns_nothing(engine, storage):
    storage.enqueue_params_batch(engine, [job()])
    assert len(storage.claim_runtime_batch(engine, "q", 5)) == 1
    assert storage.claim_runtime_batch(engine, "q", 5) == []


def test_claim_ignores_deferred_jobs(engine, storage):
    storage.enqueue_params_batch(engine, [job(run_at=datetime.now(UTC) - timedelta(seconds=1))])
    assert storage.claim_runtime_batch(engine, "q", 5) == []  # promotion is the maintainer's job


# -- receipts vs leases -----------------------------------------------------------------------

def test_receipt_claims_write_receipts_and_no_leases(engine, storage):
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(3)])
    claimed = storage.claim_runtime_batch(engine, "q", 3)

    assert all(j.claim.lease_claim_receipt for j in claimed)
    assert count_rows(engine, storage, "lease_claims") == 3
    assert count_rows(engine, storage, "leases") == 0
    assert count_rows(engine, storage, "attempt_state") == 0


def test_claims_without_receipts_materialise_leases(engine, make_storage):
    storage = make_storage(lease_claim_receipts=False)
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(3)])
    claimed = storage.claim_runtime_batch(engine, "q", 3)

    assert [j.claim.lease_claim_receipt for j in claimed] == [False] * 3
    assert [j.claim.claim_slot for j in claimed] == [0] * 3
    assert count_rows(engine, storage, "leases", "state = 'running' AND run_lease = 1") == 3
    assert count_rows(engine, storage, "lease_claims") == 0
    assert storage.queue_counts(engine, "q").running == 3


# -- variants ---------------------------------------------------------------------------------

def test_claimed_rows_are_whole_dataclasses_equal_to_normally_built_ones(engine, storage):
    # the claim path fills the frozen dataclasses' __dict__ directly (model.assemble)
    storage.enqueue_params_batch(engine, [job({"i": 1}, tags=["t"], metadata={"m": 1})])
    (c,) = storage.claim_runtime_batch(engine, "q", 1)
    for obj, cls in ((c, ClaimedRuntimeJob), (c.claim, ClaimedEntry), (c.job, JobRow)):
        assert set(vars(obj)) == field_names(cls)
        assert dataclasses.replace(obj) == obj  # replace() goes through __init__
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.__setattr__("job_id" if cls is ClaimedEntry else "unique_states", 5)
    assert hash(dataclasses.replace(c.claim)) == hash(c.claim)


def test_claim_job_batch_returns_running_job_rows(engine, storage):
    storage.enqueue_params_batch(engine, [job({"i": 1}, tags=["t"])])
    (row,) = storage.claim_job_batch(engine, "q", 5)
    assert isinstance(row, JobRow)
    assert (row.state, row.args, row.tags, row.run_lease) == (JobState.RUNNING, {"i": 1}, ["t"], 1)


def test_claim_batch_returns_entries_across_stripes(engine, make_storage):
    storage = make_storage(queue_stripe_count=3)
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(9)])
    entries = storage.claim_batch(engine, "q", 9)
    assert all(isinstance(e, ClaimedEntry) for e in entries)
    assert len({e.job_id for e in entries}) == 9
    assert {e.queue for e in entries} == {"q#0", "q#1", "q#2"}
    assert storage.queue_counts(engine, "q").available == 0


def test_claim_on_logical_queue_visits_all_stripes_in_one_call(engine, make_storage):
    storage = make_storage(queue_stripe_count=4)
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(8)])
    assert len(storage.claim_runtime_batch(engine, "q", 8)) == 8


# -- bad input --------------------------------------------------------------------------------

def test_claim_rejects_non_positive_or_non_integer_max_batch(engine, storage):
    storage.enqueue_params_batch(engine, [job()])
    for max_batch in (0, -1, True, 2.0, "3"):
        for claim in (storage.claim_runtime_batch, storage.claim_batch, storage.claim_job_batch):
            with pytest.raises(ValidationError) as err:
                claim(engine, "q", max_batch)
            assert err.value.field == "max_batch"
            assert repr(max_batch) in str(err.value)
    assert storage.queue_counts(engine, "q").available == 1  # nothing was claimed


def test_claim_rejects_bad_queue_names(engine, storage):
    for queue in ("", "x" * 201, None, "nul\x00byte"):
        with pytest.raises(ValidationError) as err:
            storage.claim_runtime_batch(engine, queue, 1)
        assert err.value.field == "queue"
        assert repr(queue) in str(err.value)


def test_claim_rejects_bad_durations(engine, storage):
    storage.enqueue_params_batch(engine, [job()])
    for deadline, aging, field in ((timedelta(seconds=-1), None, "deadline_duration"),
                                   ("soon", None, "deadline_duration"),
                                   (None, -5, "aging_interval")):
        with pytest.raises(ValidationError) as err:
            storage.claim_runtime_batch_with_aging(engine, "q", 1, deadline, aging)
        assert err.value.field == field
    assert storage.queue_counts(engine, "q").available == 1


# -- the caller's transaction -----------------------------------------------------------------

def test_claim_rolled_back_with_callers_transaction_leaves_no_trace(engine, storage):
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(3)])
    with engine.connect() as conn:
        conn.begin()
        assert len(storage.claim_runtime_batch(conn, "q", 2)) == 2
        conn.rollback()

    assert count_rows(engine, storage, "lease_claims") == 0
    assert count_rows(engine, storage, "ready_claim_ranges") == 0
    again = storage.claim_runtime_batch(engine, "q", 5)
    assert [j.job.args["i"] for j in again] == [0, 1, 2]
    assert [j.job.run_lease for j in again] == [1, 1, 1]


def test_claim_in_session_is_committed_by_the_session(engine, storage):
    storage.enqueue_params_batch(engine, [job()])
    with Session(engine) as session:
        (c,) = storage.claim_runtime_batch(session, "q", 1)
        assert storage.queue_counts(engine, "q").running == 0  # not yet committed
        session.commit()
    assert storage.queue_counts(engine, "q").running == 1
    assert storage.load_job(engine, c.job.id).state is JobState.RUNNING


def test_concurrent_claim_skips_a_lane_locked_by_an_open_claim(engine, storage):
    storage.enqueue_params_batch(engine, [job({"p": 2}, priority=2), job({"p": 3}, priority=3)])
    with engine.connect() as conn:
        conn.begin()
        assert [j.job.args["p"] for j in storage.claim_runtime_batch(conn, "q", 1)] == [2]
        start = time.monotonic()
        other = storage.claim_runtime_batch(engine, "q", 5)
        assert time.monotonic() - start < 2  # SKIP LOCKED: no waiting on the open claim
        assert [j.job.args["p"] for j in other] == [3]
        conn.commit()
    assert storage.claim_runtime_batch(engine, "q", 5) == []


def test_claim_queues_on_the_only_busy_lane_instead_of_returning_empty(engine, storage):
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(4)])
    got: dict[str, list] = {}
    with engine.connect() as conn:
        conn.begin()
        assert [j.job.args["i"] for j in storage.claim_runtime_batch(conn, "q", 2)] == [0, 1]
        other = threading.Thread(
            target=lambda: got.update(jobs=storage.claim_runtime_batch(engine, "q", 5)))
        other.start()
        time.sleep(0.05)  # well inside the claim's bounded wait
        conn.commit()
        other.join(5)
    assert [j.job.args["i"] for j in got["jobs"]] == [2, 3]


def test_claim_gives_up_on_a_lane_held_past_the_wait_bound(engine, storage):
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(2)])
    with engine.connect() as conn:
        conn.begin()
        assert len(storage.claim_runtime_batch(conn, "q", 1)) == 1
        start = time.monotonic()
        assert storage.claim_runtime_batch(engine, "q", 5) == []
        waited = time.monotonic() - start
        conn.commit()
    assert 0.1 <= waited < 2  # queued for the bound (200 ms), then returned empty, no error
    assert [j.job.args["i"] for j in storage.claim_runtime_batch(engine, "q", 5)] == [1]


def test_claim_wait_bound_does_not_leak_into_the_callers_transaction(engine, storage):
    storage.enqueue_params_batch(engine, [job()])
    with engine.connect() as conn:
        conn.begin()
        conn.execute(text("SET LOCAL lock_timeout = '7s'"))
        assert len(storage.claim_runtime_batch(conn, "q", 1)) == 1
        assert conn.execute(text("SHOW lock_timeout")).scalar_one() == "7s"
        conn.rollback()


def test_claim_fills_its_batch_past_cancelled_positions(engine, storage):
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(4)])
    ids = [storage.load_job(engine, n).id for n in (1, 2, 3, 4)]
    for job_id in ids[:3]:
        assert storage.cancel_job(engine, job_id) is not None
    claimed = storage.claim_job_batch(engine, "q", 1)
    assert [j.id for j in claimed] == [ids[3]]


def test_rolled_back_multi_pass_claim_strands_nothing(engine, storage):
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(3)])
    assert storage.cancel_job(engine, 1) is not None
    with engine.connect() as conn:
        tx = conn.begin()
        assert [j.id for j in storage.claim_job_batch(conn, "q", 2)] == [2, 3]
        tx.rollback()
    assert [j.id for j in storage.claim_job_batch(engine, "q", 5)] == [2, 3]


def test_claim_continues_after_prune_removed_the_start_of_the_claim_chain(engine, make_storage):
    storage = make_storage(queue_slot_count=4)
    storage.enqueue_params_batch(engine, [job({"who": "a"})])  # position 1, queue slot 0
    assert storage.cancel_job(engine, 1) is not None  # tombstoned
    assert storage.rotate(engine).kind == "rotated"  # queue ring now writes slot 1
    storage.enqueue_params_batch(engine, [job({"who": "b"})])  # position 2, slot 1
    # One claim call records two ranges ([1,1] in slot 0, [2,2] in slot 1) and leaves the
    # cursor hint at 1: the chain now starts in slot 0.
    (b,) = storage.claim_runtime_batch(engine, "q", 1)
    assert b.job.args == {"who": "b"}
    assert storage.complete_runtime_batch(engine, [b]) == [(b.job.id, b.job.run_lease)]
    assert storage.prune_oldest(engine).kind == "pruned"  # slot 0 and range [1,1] are gone
    storage.enqueue_params_batch(engine, [job({"who": "c"})])  # position 3
    claimed = storage.claim_runtime_batch(engine, "q", 5)
    assert [j.job.args["who"] for j in claimed] == ["c"]


def test_claim_follows_a_lane_from_an_older_ring_slot_into_the_current_one(engine, make_storage):
    storage = make_storage(queue_slot_count=4)
    storage.set_queue_options(engine, "q", enqueue_shards=1)  # both batches in one lane
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(3)])  # slot 0
    assert storage.rotate(engine).kind == "rotated"  # the current slot is 1 from here on
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(3, 6)])  # slot 1
    # The first probe looks for the head position in the current slot and misses; the
    # claim must still start at the oldest position and cross into slot 1 in order.
    claimed = storage.claim_runtime_batch(engine, "q", 10)
    assert [c.job.args["i"] for c in claimed] == [0, 1, 2, 3, 4, 5]
    assert sorted({c.claim.ready_slot for c in claimed}) == [0, 1]
    assert len(storage.complete_runtime_batch(engine, claimed)) == 6
    assert storage.claim_runtime_batch(engine, "q", 10) == []


def test_a_claim_keeps_for_its_session_the_ring_slot_it_found_a_backlog_in(engine, make_storage):
    storage = make_storage(queue_slot_count=4)
    storage.set_queue_options(engine, "q", enqueue_shards=1)
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(4)])  # slot 0
    assert storage.rotate(engine).kind == "rotated"  # the current slot is 1: the backlog is older
    with engine.connect() as conn:
        # (a pooled connection may keep a hint from an earlier install of this schema name)
        (first,) = storage.claim_runtime_batch(forget_seen_slot(conn, storage), "q", 1)
        conn.commit()
        assert seen_slot(conn, storage) == "0"  # the next claim looks in slot 0 first
        (second,) = storage.claim_runtime_batch(conn, "q", 1)
        conn.commit()
    assert [first.job.args["i"], second.job.args["i"]] == [0, 1]


def test_claims_on_an_engine_keep_the_slot_on_the_pooled_connection(db_url, make_storage):
    # an Engine's claim is an autocommitted statement on a pooled connection: the setting
    # stays on that connection for the next claim that checks it out
    storage = make_storage(queue_slot_count=4)
    one = create_engine(db_url, pool_size=1, max_overflow=0)
    try:
        storage.set_queue_options(one, "q", enqueue_shards=1)
        storage.enqueue_params_batch(one, [job({"i": i}) for i in range(4)])  # slot 0
        assert storage.rotate(one).kind == "rotated"
        with one.connect() as conn:
            forget_seen_slot(conn, storage)
            conn.commit()
        assert [c.job.args["i"] for c in storage.claim_runtime_batch(one, "q", 1)] == [0]
        with one.connect() as conn:
            assert seen_slot(conn, storage) == "0"
        assert [c.job.args["i"] for c in storage.claim_runtime_batch(one, "q", 3)] == [1, 2, 3]
    finally:
        one.dispose()


@pytest.mark.parametrize("hint", ["3", "99"], ids=["a slot without the rows", "no such slot"])
def test_a_claim_with_a_wrong_slot_hint_still_claims_every_job_in_order(engine, make_storage, hint):
    storage = make_storage(queue_slot_count=4)
    storage.set_queue_options(engine, "q", enqueue_shards=1)
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(3)])  # slot 0
    assert storage.rotate(engine).kind == "rotated"
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(3, 6)])  # slot 1
    with engine.connect() as conn:
        claimed = storage.claim_runtime_batch(set_seen_slot(conn, storage, hint), "q", 10)
        conn.commit()
        assert seen_slot(conn, storage) == "1"  # where the last row was found
    assert [c.job.args["i"] for c in claimed] == [0, 1, 2, 3, 4, 5]
    assert storage.claim_runtime_batch(engine, "q", 10) == []


def test_claim_after_a_partial_claim_resumes_in_the_slot_the_lane_left_off(engine, make_storage):
    storage = make_storage(queue_slot_count=4)
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(4)])  # slot 0
    assert [c.job.args["i"] for c in storage.claim_runtime_batch(engine, "q", 2)] == [0, 1]
    assert storage.rotate(engine).kind == "rotated"
    # the chain's next position is in slot 0 while the ring writes slot 1
    assert [c.job.args["i"] for c in storage.claim_runtime_batch(engine, "q", 5)] == [2, 3]


def test_a_claim_locks_its_ring_children_not_every_child_of_the_ring(engine, storage):
    # A generic plan over a partitioned parent would lock all 16 ready children (and their
    # indexes) in every transaction; the claim names the one child it reads.
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(4)])
    with engine.connect() as conn, conn.begin():
        baseline = relation_locks(forget_seen_slot(conn, storage))
        assert len(storage.claim_runtime_batch(conn, "q", 4)) == 4
        taken = relation_locks(conn) - baseline
    assert taken <= 40, taken


def ready_children_locked(conn, storage) -> list[str]:
    """The ``ready_entries`` children (tables, not indexes) ``conn``'s backend holds a lock on."""
    return sorted(conn.execute(text(
        "SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation' AND n.nspname = :s "
        "AND c.relkind = 'r' AND c.relname LIKE 'ready\\_entries\\_%'"), {"s": storage.schema()}).scalars())


@both_receipt_modes("storage")
def test_a_claim_that_empties_its_lanes_looks_at_no_other_ring_child(engine, storage):
    # Past the lane's last position the claim would look for the lane's next row in every
    # queue-ring child (share-locking all of them, and waiting behind a prune's exclusive
    # lock); the lane's enqueue sequence says no such row can exist, so it does not look.
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(4)])
    with engine.connect() as conn, conn.begin():
        assert len(storage.claim_runtime_batch(forget_seen_slot(conn, storage), "q", 10)) == 4
        assert storage.claim_runtime_batch(conn, "q", 10) == []
        assert ready_children_locked(conn, storage) == ["ready_entries_0"]


# -- passes over a lane ----------------------------------------------------------------------

def ready_row_scans(conn, storage) -> int:
    """Index scans of ready rows this backend has counted and not yet reported (every
    child): within one transaction, the difference of two readings is what ran between."""
    return conn.execute(text(
        "SELECT coalesce(sum(idx_scan), 0) FROM pg_stat_xact_user_tables "
        "WHERE schemaname = :s AND relname LIKE 'ready\\_entries\\_%'"), {"s": storage.schema()}).scalar_one()


@both_receipt_modes("storage")
def test_a_claim_that_takes_all_its_lane_had_leaves_the_lane_after_one_pass(engine, storage):
    storage.set_queue_options(engine, "q", enqueue_shards=1)
    storage.enqueue_many(engine, [job({"n": i}) for i in range(3)])
    with engine.connect() as conn, conn.begin():
        before = ready_row_scans(conn, storage)
        claimed = storage.claim_runtime_batch(conn, "q", 10)
        # one probe for the lane's first position, one pick of its rows; no probe for a
        # position after the last one the lane had
        assert ready_row_scans(conn, storage) - before == 2
    assert [c.job.args["n"] for c in claimed] == [0, 1, 2]


def test_a_claim_goes_on_past_a_tombstoned_row_in_its_lane(engine, storage):
    storage.set_queue_options(engine, "q", enqueue_shards=1)
    ids = storage.enqueue_many(engine, [job({"n": i}) for i in range(3)])
    storage.cancel_job(engine, ids[1])
    storage.enqueue(engine, job({"n": 3}))
    claimed = storage.claim_runtime_batch(engine, "q", 3)
    assert [c.job.args["n"] for c in claimed] == [0, 2, 3]
