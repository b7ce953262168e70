"""Reads: exact and fast queue counts across lifecycle phases, and ``load_job`` in every plane."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest
from jobtools import BACKLOG, relation
from sqlalchemy import text

from qstore import InsertOpts, InsertParams, JobState, QueueCounts, ValidationError
from qstore.storage.admin import _reads as admin_reads
from qstore.storage.read import _statements as read_statements

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


# -- available: the rows no claim range covers ---------------------------------------------------

UNCOVERED = """SELECT count(*) FROM {r} r WHERE r.queue = ANY(:queues)
  AND NOT EXISTS (SELECT 1 FROM {t} t
                  WHERE (t.ready_slot, t.queue, t.priority, t.enqueue_shard, t.lane_seq)
                      = (r.ready_slot, r.queue, r.priority, r.enqueue_shard, r.lane_seq))
  AND NOT EXISTS (SELECT 1 FROM {cr} c
                  WHERE (c.queue, c.priority, c.enqueue_shard) = (r.queue, r.priority, r.enqueue_shard)
                    AND c.first_seq <= r.lane_seq AND c.last_seq >= r.lane_seq)"""


def uncovered(engine, storage, *queues: str) -> int:
    """The available count by its definition, one range lookup per row (the oracle)."""
    s = storage.schema()
    sql = UNCOVERED.format(r=relation(s, "ready_entries"), t=relation(s, "ready_tombstones"),
                           cr=relation(s, "ready_claim_ranges"))
    with engine.connect() as c:
        return c.execute(text(sql), {"queues": list(queues)}).scalar_one()


def range_lookups(conn, stmt, **params: object) -> list[str]:
    """The nodes of ``stmt``'s plan that compare claim-range positions (a lookup per row)."""
    expanded = stmt.compile(conn).construct_expanded_state(params)
    plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {expanded.statement}", expanded.parameters).scalar_one()
    found: list[str] = []

    def walk(node: dict) -> None:
        for key in ("Join Filter", "Hash Cond", "Merge Cond", "Index Cond", "Filter"):
            if "first_seq" in node.get(key, "") or "last_seq" in node.get(key, ""):
                found.append(f"{node['Node Type']}: {node[key]}")
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    return found


def test_claim_ranges_cover_positions_of_their_own_lane_only(engine, storage):
    storage.set_queue_options(engine, "q", enqueue_shards=1)
    storage.set_queue_options(engine, "other", enqueue_shards=1)
    # three lanes whose positions are the same 1..6: (q, 1), (q, 2) and (other, 1)
    storage.enqueue_params_batch(engine, [job({"i": i}, priority=1) for i in range(6)])
    storage.enqueue_params_batch(engine, [job({"i": i}, priority=2) for i in range(6)])
    storage.enqueue_params_batch(engine, [job({"i": i}, queue="other", priority=1) for i in range(6)])
    assert len(storage.claim_runtime_batch(engine, "other", 5)) == 5
    assert len(storage.claim_runtime_batch(engine, "q", 2)) == 2  # (q, 1): positions 1-2
    assert len(storage.claim_runtime_batch(engine, "q", 1)) == 1  # a range that starts at its row
    assert storage.queue_counts(engine, "q") == QueueCounts(available=9, running=3, terminal=0)
    assert storage.queue_counts(engine, "other") == QueueCounts(available=1, running=5, terminal=0)
    assert uncovered(engine, storage, "q") == 9


def test_a_range_covers_its_lanes_positions_whatever_slot_it_lives_in(engine, storage):
    storage.set_queue_options(engine, "q", enqueue_shards=1)
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(6)])  # slot 0, positions 1-6
    assert storage.rotate(engine).kind == "rotated"
    lane = {"queue": "q", "priority": storage.load_job(engine, 1).priority}
    with engine.begin() as c:  # a range in slot 1 over positions 2-3 of slot 0's rows
        c.execute(text(f"INSERT INTO {relation(storage.schema(), 'ready_claim_ranges')} "
                       "(ready_slot, ready_generation, queue, priority, enqueue_shard, first_seq, last_seq) "
                       "SELECT 1, 1, :queue, :priority, enqueue_shard, 2, 3 FROM "
                       f"{relation(storage.schema(), 'ready_entries')} WHERE job_id = 1"), lane)
    assert storage.queue_counts(engine, "q").available == uncovered(engine, storage, "q") == 4


def test_available_is_the_uncovered_untombstoned_rows_through_claims_cancels_and_turns(engine, storage):
    rng = random.Random(29)
    queues = ("q", "other")
    turned = 0
    for step in range(40):
        q = rng.choice(queues)
        action = rng.random()
        if action < 0.35:
            storage.enqueue_params_batch(engine, [job({"i": i}, queue=q, priority=rng.randint(1, 3))
                                                  for i in range(rng.randint(1, 6))])
        elif action < 0.7:
            got = storage.claim_runtime_batch(engine, q, rng.randint(1, 4))
            if got and rng.random() < 0.5:
                storage.complete_runtime_batch(engine, got)
        elif action < 0.85:
            with engine.connect() as c:
                ids = c.execute(text(f"SELECT job_id FROM {relation(storage.schema(), 'ready_entries')}"))
                ids = ids.scalars().all()
            if ids:
                storage.cancel_job(engine, rng.choice(ids))  # available: a tombstone; else nothing new
        else:  # later rows and ranges in the next queue slot
            turned += storage.rotate(engine).kind == "rotated"
        for name in queues:
            assert storage.queue_counts(engine, name).available == uncovered(engine, storage, name), step
    assert turned >= 2  # the rows and ranges compared lie in several slots


def test_the_counts_and_aging_read_claim_ranges_once_not_per_row(engine, storage):
    storage.enqueue_params_batch(engine, [job({"i": i}, priority=3) for i in range(20)])
    for _ in range(5):
        storage.claim_runtime_batch(engine, "q", 1)
    with engine.connect() as conn:
        assert range_lookups(conn, read_statements(storage.tables).counts, queues=["q"]) == []
        assert range_lookups(conn, admin_reads(storage.tables).aging_candidates,
                             interval=timedelta(0), limit=10) == []


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
