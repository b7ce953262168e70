"""Enqueue: batch INSERT and COPY paths, deferred routing, uniqueness, bad input, the app's
transaction (rollback, NOTIFY on commit), the lane reservation lock (held to commit),
striping and enqueue shards (set on the logical queue)."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from jobtools import BACKLOG, relation
from sqlalchemy import event, make_url, text

from qstore import (
    InsertOpts,
    InsertParams,
    QueueStorage,
    UniqueConflictError,
    UniqueOpts,
    ValidationError,
)
from qstore.storage.jobs import shard_for_ordering_key

UTC = timezone.utc
READY_COLS = ("ready_slot", "ready_generation", "job_id", "kind", "queue", "args", "priority",
              "attempt", "run_lease", "max_attempts", "lane_seq", "enqueue_shard", "unique_key",
              "unique_states", "payload", "attempted_at")
DEFERRED_COLS = ("job_id", "kind", "queue", "args", "state", "priority", "attempt", "run_lease",
                 "max_attempts", "run_at", "unique_key", "unique_states", "payload")
# Unique states mask without "completed": scheduled | available | running | retryable.
STATES_WITHOUT_COMPLETED = 0b0001_0111


def job(kind: str = "k", args: object = None, **opts: object) -> InsertParams:
    opts.setdefault("queue", "q")
    return InsertParams(kind, {} if args is None else args, InsertOpts(**opts))


def rows(engine, storage, table: str, cols: tuple[str, ...], where: str = "true") -> list[tuple]:
    sql = f'SELECT {", ".join(cols)} FROM {relation(storage.schema(), table)} WHERE {where} ORDER BY job_id'
    with engine.connect() as c:
        return [tuple(r) for r in c.execute(text(sql))]


def census(engine, storage) -> dict[str, int]:
    """Row counts of every table an enqueue writes to."""
    s = storage.schema()
    with engine.connect() as c:
        return {
            t: c.execute(text(f'SELECT count(*) FROM {relation(s, t)}')).scalar_one()
            for t in ("ready_entries", BACKLOG, "job_unique_claims", "queue_claim_heads")
        }


def drain(engine, storage, queue: str = "q", batch: int = 10) -> list:
    """Claim until a claim returns nothing; returns every claimed job (in claim order)."""
    out = []
    while True:
        got = storage.claim_runtime_batch(engine, queue, batch)
        if not got:
            return out
        out += got


def listener(db_url: str, channel: str) -> psycopg.Connection:
    conninfo = make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg.connect(conninfo, autocommit=True)
    conn.execute(f'LISTEN "{channel}"')
    return conn


def pending_notifies(conn: psycopg.Connection, timeout: float) -> list:
    return list(conn.notifies(timeout=timeout))


# -- COPY and INSERT parity ---------------------------------------------------------------

PARITY_BATCH = [
    job("a", {"i": 1}),
    job("a", {"i": 2}, priority=1),
    job("b", {"nested": {"x": [1, 2.5, None, True]}, "s": "ünïcode"}, queue="other", priority=4,
        max_attempts=3, metadata={"m": 1}, tags=["t1", "t2"]),
    job("c", {"u": 1}, unique=UniqueOpts()),
    job("c", {"u": 2}, unique=UniqueOpts(by_queue=True, states=STATES_WITHOUT_COMPLETED)),
    job("d", {"o": 1}, ordering_key=b"key-1"),
    job("d", {"o": 2}, ordering_key=b"key-2"),
    job("e", {"later": True}, run_at=datetime.now(UTC) + timedelta(hours=1), tags=["x"]),
    job("a", {"i": 3}),
]


@pytest.mark.parametrize("stripes", [1, 3])
def test_copy_and_insert_write_identical_rows_into_identical_lanes(engine, make_storage, stripes):
    by_insert = make_storage(queue_stripe_count=stripes)
    by_copy = make_storage(queue_stripe_count=stripes)
    for st in (by_insert, by_copy):
        with engine.begin() as c:
            c.execute(text(f'INSERT INTO "{st.schema()}".queue_meta (queue, enqueue_shards) '
                           "VALUES ('q', 4)"))

    # A second call (without the unique rows) exercises the rotor and lane reuse.
    for batch in (PARITY_BATCH, [j for j in PARITY_BATCH if j.opts.unique is None]):
        assert by_insert.enqueue_params_batch(engine, batch) == len(batch)
        assert by_copy.enqueue_params_copy(engine, batch) == len(batch)

    ready_insert = rows(engine, by_insert, "ready_entries", READY_COLS)
    ready_copy = rows(engine, by_copy, "ready_entries", READY_COLS)
    assert len(ready_insert) == 2 * len(PARITY_BATCH) - 4  # two deferred, two unique once
    assert ready_copy == ready_insert
    assert len(rows(engine, by_insert, BACKLOG, DEFERRED_COLS)) == 2
    assert rows(engine, by_copy, BACKLOG, DEFERRED_COLS) \
        == rows(engine, by_insert, BACKLOG, DEFERRED_COLS)
    with engine.connect() as c:
        keys = [sorted(c.execute(text(f'SELECT unique_key, job_id FROM "{st.schema()}".job_unique_claims')).all())
                for st in (by_insert, by_copy)]
    assert keys[0] == keys[1]


@pytest.mark.parametrize("stripes", [1, 3])
def test_single_job_enqueues_write_what_copy_writes_job_by_job(engine, make_storage, stripes):
    # enqueue_job (the single-job function) against the COPY path, one call per job on
    # both sides: the same rotor values, so the same lanes and lane positions
    by_single = make_storage(queue_stripe_count=stripes)
    by_copy = make_storage(queue_stripe_count=stripes)
    in_wheel = job("f", {"soon": True}, run_at=datetime.now(UTC) + timedelta(minutes=2))
    for j in [*PARITY_BATCH, in_wheel, *(j for j in PARITY_BATCH if j.opts.unique is None)]:
        by_single.enqueue(engine, j)
        by_copy.enqueue_params_copy(engine, [j])

    ready = [rows(engine, st, "ready_entries", READY_COLS) for st in (by_single, by_copy)]
    assert len(ready[0]) == 2 * len(PARITY_BATCH) - 4 and ready[0] == ready[1]
    waiting = [rows(engine, st, BACKLOG, DEFERRED_COLS) for st in (by_single, by_copy)]
    assert len(waiting[0]) == 3 and waiting[0] == waiting[1]
    with engine.connect() as c:
        keys = [sorted(c.execute(text(f'SELECT unique_key, job_id FROM "{st.schema()}".job_unique_claims')).all())
                for st in (by_single, by_copy)]
    assert len(keys[0]) == 2 and keys[0] == keys[1]


def test_copy_rows_get_server_timestamps(engine, storage):
    before = datetime.now(UTC)
    storage.enqueue_params_copy(engine, [job()])
    (run_at, created_at), = rows(engine, storage, "ready_entries", ("run_at", "created_at"))
    assert before - timedelta(seconds=5) < run_at < datetime.now(UTC) + timedelta(seconds=5)
    assert before - timedelta(seconds=5) < created_at < datetime.now(UTC) + timedelta(seconds=5)


def test_job_ids_come_from_the_installs_own_sequence(engine, make_storage):
    first, second = make_storage(), make_storage()
    first.enqueue_params_batch(engine, [job(), job(), job()])
    second.enqueue_params_batch(engine, [job()])
    with engine.begin() as c:  # the first install goes away; the second must not care
        c.execute(text(f'DROP SCHEMA "{first.schema()}" CASCADE'))

    second.enqueue_params_copy(engine, [job()])

    assert [r[0] for r in rows(engine, second, "ready_entries", ("job_id",))] == [1, 2]


# -- deferred -----------------------------------------------------------------------------

def test_future_run_at_goes_to_deferred_backlog_not_ready(engine, storage):
    when = datetime.now(UTC) + timedelta(hours=2)
    assert storage.enqueue_params_batch(engine, [job(args={"d": 1}, run_at=when)]) == 1

    (job_id, state, run_at), = rows(engine, storage, BACKLOG, ("job_id", "state", "run_at"))
    assert state == "scheduled"
    assert run_at == when
    assert census(engine, storage)["ready_entries"] == 0
    assert storage.claim_runtime_batch(engine, "q", 10) == []
    loaded = storage.load_job(engine, job_id)
    assert loaded is not None and loaded.state.value == "scheduled"


def test_mixed_batch_splits_ready_and_deferred(engine, storage):
    when = datetime.now(UTC) + timedelta(minutes=5)
    storage.enqueue_params_copy(engine, [job(args={"n": 1}), job(args={"n": 2}, run_at=when),
                                         job(args={"n": 3})])
    assert [r[0] for r in rows(engine, storage, "ready_entries", ("args",))] == [{"n": 1}, {"n": 3}]
    assert [r[0] for r in rows(engine, storage, BACKLOG, ("args",))] == [{"n": 2}]


# -- uniqueness ---------------------------------------------------------------------------

def test_unique_conflict_raises_and_writes_nothing(engine, storage):
    storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=UniqueOpts())])
    before = census(engine, storage)

    with pytest.raises(UniqueConflictError):
        storage.enqueue_params_batch(engine, [
            job(args={"fresh": 1}),  # a good row in the same batch is not written either
            job(args={"u": 1}, unique=UniqueOpts()),
        ])

    assert census(engine, storage) == before
    assert [j.job.args for j in drain(engine, storage)] == [{"u": 1}]


def test_unique_conflict_with_copy_writes_nothing(engine, storage):
    storage.enqueue_params_copy(engine, [job(args={"u": 1}, unique=UniqueOpts())])
    before = census(engine, storage)
    with pytest.raises(UniqueConflictError):
        storage.enqueue_params_copy(engine, [job(args={"fresh": 1}),
                                             job(args={"u": 1}, unique=UniqueOpts())])
    assert census(engine, storage) == before


def test_unique_conflict_in_caller_transaction_keeps_callers_earlier_writes(engine, storage):
    storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=UniqueOpts())])
    before = census(engine, storage)
    s = storage.schema()

    with engine.connect() as conn:
        conn.begin()
        conn.execute(text(f"INSERT INTO \"{s}\".queue_meta (queue, paused) VALUES ('caller', false)"))
        with pytest.raises(UniqueConflictError):
            storage.enqueue_params_batch(conn, [job(args={"fresh": 1}),
                                                job(args={"u": 1}, unique=UniqueOpts())])
        # The transaction is still usable and commits the caller's own write.
        conn.commit()

    with engine.connect() as c:
        assert c.execute(text(f"SELECT count(*) FROM \"{s}\".queue_meta WHERE queue = 'caller'")).scalar_one() == 1
    assert census(engine, storage) == before


def test_duplicate_unique_keys_inside_one_batch_conflict(engine, storage):
    with pytest.raises(UniqueConflictError):
        storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=UniqueOpts()),
                                              job(args={"u": 1}, unique=UniqueOpts())])
    assert census(engine, storage) == dict.fromkeys(census(engine, storage), 0)


def test_scheduled_job_holds_its_unique_key(engine, storage):
    later = datetime.now(UTC) + timedelta(hours=1)
    storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=UniqueOpts(), run_at=later)])
    with pytest.raises(UniqueConflictError):
        storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=UniqueOpts())])


def test_unique_by_queue_separates_queues(engine, storage):
    by_queue = UniqueOpts(by_queue=True)
    storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=by_queue, queue="q1")])
    storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=by_queue, queue="q2")])
    with pytest.raises(UniqueConflictError):
        storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=by_queue, queue="q1")])
    # Without by_queue the key ignores the queue.
    storage.enqueue_params_batch(engine, [job("other", {"u": 1}, unique=UniqueOpts(), queue="q1")])
    with pytest.raises(UniqueConflictError):
        storage.enqueue_params_batch(engine, [job("other", {"u": 1}, unique=UniqueOpts(), queue="q2")])


def test_completed_job_keeps_its_unique_key_with_default_states(engine, storage):
    storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=UniqueOpts())])
    claimed = storage.claim_runtime_batch(engine, "q", 1)
    assert len(storage.complete_runtime_batch(engine, claimed)) == 1

    with pytest.raises(UniqueConflictError):
        storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=UniqueOpts())])


def test_unique_key_is_released_on_completion_when_mask_excludes_completed(engine, storage):
    opts = UniqueOpts(states=STATES_WITHOUT_COMPLETED)
    storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=opts)])
    claimed = storage.claim_runtime_batch(engine, "q", 1)
    # While running the key is held.
    with pytest.raises(UniqueConflictError):
        storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=opts)])
    assert len(storage.complete_runtime_batch(engine, claimed)) == 1

    assert storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=opts)]) == 1
    again = storage.claim_runtime_batch(engine, "q", 5)
    assert [j.job.args for j in again] == [{"u": 1}]
    assert again[0].job.id != claimed[0].job.id


# -- bad input ----------------------------------------------------------------------------

NAIVE = datetime(2030, 1, 1, 12, 0)


class Opaque:
    def __repr__(self) -> str:
        return "<Opaque marker>"


BAD_ROWS = {
    "empty queue": (job(queue=""), "queue", "''"),
    "201-char queue": (job(queue="x" * 201), "queue", "'" + "x" * 201 + "'"),
    "priority 0": (job(priority=0), "priority", "=0"),
    "priority 5": (job(priority=5), "priority", "=5"),
    "max_attempts 0": (job(max_attempts=0), "max_attempts", "=0"),
    "set args": (job(args={"s": {1, 2}}), "args.s", "{1, 2}"),
    "object args": (job(args=Opaque()), "args", "<Opaque marker>"),
    "NaN args": (job(args={"f": math.nan}), "args.f", "nan"),
    "infinite args": (job(args=[1.0, math.inf]), "args[1]", "inf"),
    "NUL in args string": (job(args={"s": "a\x00b"}), "args.s", "a\\x00b"),
    "metadata not a dict": (job(metadata=["m"]), "metadata", "['m']"),
    "naive run_at": (job(run_at=NAIVE), "run_at", repr(NAIVE)),
}


@pytest.fixture(scope="module")
def untouched_storage(installed):
    """One install shared by the bad-input cases: none of them may write anything, so each
    case asserts the install is still completely empty."""
    return QueueStorage(installed)


@pytest.mark.parametrize("use_copy", [False, True], ids=["insert", "copy"])
@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_row_at_index_3_raises_validation_error_and_writes_nothing(engine, untouched_storage, case, use_copy):
    storage = untouched_storage
    bad, field, shown = BAD_ROWS[case]
    batch = [job(args={"good": i}) for i in range(3)] + [bad] + [job(args={"good": 4})]
    enqueue = storage.enqueue_params_copy if use_copy else storage.enqueue_params_batch

    with pytest.raises(ValidationError) as err:
        enqueue(engine, batch)

    assert err.value.field == f"jobs[3].{field}"
    assert shown in str(err.value)
    assert census(engine, storage) == dict.fromkeys(census(engine, storage), 0)


def test_validation_error_in_caller_transaction_leaves_transaction_usable(engine, storage):
    with engine.connect() as conn:
        conn.begin()
        storage.enqueue_params_batch(conn, [job(args={"first": 1})])
        with pytest.raises(ValidationError):
            storage.enqueue_params_batch(conn, [job(args={"x": 1}), job(priority=9)])
        conn.commit()
    assert [j.job.args for j in drain(engine, storage)] == [{"first": 1}]


@pytest.mark.parametrize(("queue", "priority", "count", "field"), [
    ("q", 2, 0, "count"),
    ("q", 2, -3, "count"),
    ("q", 0, 5, "priority"),
    ("q", 5, 5, "priority"),
    ("", 2, 5, "queue"),
])
def test_enqueue_batch_rejects_bad_arguments(engine, untouched_storage, queue, priority, count, field):
    with pytest.raises(ValidationError) as err:
        untouched_storage.enqueue_batch(engine, queue, priority, count)
    assert err.value.field == field
    assert repr(count if field == "count" else priority if field == "priority" else queue) \
        in str(err.value)
    assert census(engine, untouched_storage) == dict.fromkeys(census(engine, untouched_storage), 0)


def test_enqueue_batch_writes_count_bench_jobs(engine, storage):
    assert storage.enqueue_batch(engine, "q", 3, 5) == 5
    claimed = drain(engine, storage)
    assert [(j.job.kind, j.job.args, j.job.priority) for j in claimed] \
        == [("bench_job", {"seq": i}, 3) for i in range(5)]


def test_unknown_queue_is_created_on_first_use(engine, storage):
    storage.enqueue_params_batch(engine, [job(queue="never-seen-before")])
    assert len(storage.claim_runtime_batch(engine, "never-seen-before", 5)) == 1


# -- the app's transaction ----------------------------------------------------------------

def test_rolled_back_enqueue_leaves_no_job_and_no_stranded_lane(engine, storage):
    storage.set_queue_options(engine, "q", enqueue_shards=1)  # one lane: FIFO across calls
    storage.enqueue_params_batch(engine, [job(args={"before": 1})])
    with engine.connect() as conn:
        conn.begin()
        assert storage.enqueue_params_batch(conn, [job(args={"rolled": i}) for i in range(3)]) == 3
        conn.rollback()
    assert census(engine, storage)["ready_entries"] == 1

    storage.enqueue_params_batch(engine, [job(args={"after": i}) for i in range(2)])

    claimed = drain(engine, storage, batch=2)
    assert [j.job.args for j in claimed] == [{"before": 1}, {"after": 0}, {"after": 1}]
    assert storage.queue_counts(engine, "q").available == 0


def test_rolled_back_copy_enqueue_leaves_no_job_and_no_stranded_lane(engine, storage):
    with engine.connect() as conn:
        conn.begin()
        storage.enqueue_params_copy(conn, [job(args={"rolled": i}) for i in range(3)])
        conn.rollback()
    storage.enqueue_params_copy(engine, [job(args={"after": 1})])
    assert [j.job.args for j in drain(engine, storage)] == [{"after": 1}]


def test_enqueue_on_connection_is_invisible_until_caller_commits(engine, storage):
    with engine.connect() as conn:
        conn.begin()
        storage.enqueue_params_batch(conn, [job(args={"x": 1})])
        assert storage.claim_runtime_batch(engine, "q", 5) == []
        conn.commit()
    assert [j.job.args for j in storage.claim_runtime_batch(engine, "q", 5)] == [{"x": 1}]


def test_notify_is_delivered_only_after_commit(engine, db_url, storage):
    channel = storage.config.notify_channel("q")
    with listener(db_url, channel) as lis, engine.connect() as conn:
        conn.begin()
        storage.enqueue_params_batch(conn, [job(args={"i": i}) for i in range(3)])
        assert pending_notifies(lis, 0.3) == []

        conn.commit()

        got = list(lis.notifies(timeout=5, stop_after=1))
        assert [n.channel for n in got] == [channel]
        assert pending_notifies(lis, 0.3) == []  # one NOTIFY per queue per transaction


def test_rolled_back_enqueue_does_not_notify(engine, db_url, storage):
    channel = storage.config.notify_channel("q")
    with listener(db_url, channel) as lis:
        with engine.connect() as conn:
            conn.begin()
            storage.enqueue_params_batch(conn, [job()])
            conn.rollback()
        assert pending_notifies(lis, 0.3) == []
        storage.enqueue_params_batch(engine, [job()])  # the listener does hear commits
        assert len(list(lis.notifies(timeout=5, stop_after=1))) == 1


def test_deferred_only_batch_does_not_notify(engine, db_url, storage):
    channel = storage.config.notify_channel("q")
    later = datetime.now(UTC) + timedelta(hours=1)
    with listener(db_url, channel) as lis:
        storage.enqueue_params_batch(engine, [job(run_at=later), job(run_at=later)])
        assert pending_notifies(lis, 0.3) == []
        storage.enqueue_params_batch(engine, [job()])  # control: a ready job does notify
        assert [n.channel for n in lis.notifies(timeout=5, stop_after=1)] == [channel]


def test_notify_channel_of_striped_queue_is_the_logical_queue(engine, db_url, make_storage):
    storage = make_storage(queue_stripe_count=3)
    channel = storage.config.notify_channel("q")
    with listener(db_url, channel) as lis:
        storage.enqueue_params_batch(engine, [job(args={"i": i}) for i in range(6)])
        assert [n.channel for n in lis.notifies(timeout=5, stop_after=1)] == [channel]
        assert pending_notifies(lis, 0.3) == []


# -- lane reservation lock, held to commit ------------------------------------------------------

class Producer(threading.Thread):
    """Enqueue on the engine in a background thread; records completion and errors."""

    def __init__(self, storage, engine, jobs):
        super().__init__(daemon=True)
        self.storage, self.engine, self.jobs = storage, engine, jobs
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.storage.enqueue_params_batch(self.engine, self.jobs)
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.done.set()


def _warm_lane(engine, storage) -> int:
    """Create lane q/priority 2 and consume its first position, so later enqueues only
    contend on the reservation lock (not on lane creation). One lane per priority, so
    every producer of the queue meets the same lane."""
    storage.set_queue_options(engine, "q", enqueue_shards=1)
    storage.enqueue_params_batch(engine, [job(args={"warm": 1})])
    warm = storage.claim_runtime_batch(engine, "q", 1)
    storage.complete_runtime_batch(engine, warm)
    return warm[0].job.id


def test_second_producer_waits_for_first_producers_commit_on_same_lane(engine, storage):
    _warm_lane(engine, storage)
    with engine.connect() as a:
        a.begin()
        storage.enqueue_params_batch(a, [job(args={"job": "a"})])
        b = Producer(storage, engine, [job(args={"job": "b"})])
        b.start()
        assert not b.done.wait(0.4), "B reserved a lane position while A's reservation was open"

        a.commit()
        assert b.done.wait(10)
    assert b.error is None

    assert [j.job.args for j in drain(engine, storage)] == [{"job": "a"}, {"job": "b"}]


def test_second_producer_is_not_stranded_when_first_producer_rolls_back(engine, storage):
    _warm_lane(engine, storage)
    with engine.connect() as a:
        a.begin()
        storage.enqueue_params_batch(a, [job(args={"job": "a"})])
        b = Producer(storage, engine, [job(args={"job": "b"})])
        b.start()
        assert not b.done.wait(0.4)

        a.rollback()
        assert b.done.wait(10)
    assert b.error is None

    assert [j.job.args for j in drain(engine, storage)] == [{"job": "b"}]
    assert storage.queue_counts(engine, "q").available == 0


@pytest.mark.parametrize("first, second", [(1, 2), (2, 1)], ids=["single_then_batch", "batch_then_single"])
def test_single_and_batch_producers_share_the_lane_reservation_lock(engine, storage, first, second):
    # enqueue_job and enqueue_jobs (through reserve_lanes) take one lock per lane
    _warm_lane(engine, storage)
    with engine.connect() as a:
        a.begin()
        storage.enqueue_params_batch(a, [job(args={"job": f"a{i}"}) for i in range(first)])
        b = Producer(storage, engine, [job(args={"job": f"b{i}"}) for i in range(second)])
        b.start()
        assert not b.done.wait(0.4), "B reserved a lane position while A's reservation was open"
        a.commit()
        assert b.done.wait(10)
    assert b.error is None
    expected = [{"job": f"a{i}"} for i in range(first)] + [{"job": f"b{i}"} for i in range(second)]
    assert [j.job.args for j in drain(engine, storage)] == expected


def _functions_called(conn, schema: str) -> dict[str, int]:
    """The schema's functions called so far in ``conn``'s transaction (``track_functions``
    set in it), by name."""
    got = conn.execute(text("SELECT funcname, calls FROM pg_stat_xact_user_functions WHERE schemaname = :s"),
                       {"s": schema})
    return {name: calls for name, calls in got}


def test_single_job_enqueue_into_an_existing_lane_calls_no_lane_function(engine, storage):
    storage.set_queue_options(engine, "q", enqueue_shards=1)
    storage.enqueue(engine, job())  # the lane exists
    with engine.connect() as conn, conn.begin():
        conn.execute(text("SET LOCAL track_functions = 'pl'"))
        storage.enqueue(conn, job())
        assert _functions_called(conn, storage.schema()) == {"enqueue_job": 1}


def test_single_job_enqueue_creates_a_missing_lane_once(engine, storage):
    with engine.connect() as conn, conn.begin():
        conn.execute(text("SET LOCAL track_functions = 'pl'"))
        storage.enqueue(conn, job(queue="fresh", priority=3))
        assert _functions_called(conn, storage.schema()) == {"enqueue_job": 1, "ensure_lane": 1}
    assert [j.job.queue for j in storage.claim_runtime_batch(engine, "fresh", 5)] == ["fresh"]


def test_producer_on_another_priority_lane_is_not_blocked(engine, storage):
    _warm_lane(engine, storage)
    storage.enqueue_params_batch(engine, [job(priority=3)])  # lane exists
    with engine.connect() as a:
        a.begin()
        storage.enqueue_params_batch(a, [job(args={"job": "a"})])
        b = Producer(storage, engine, [job(args={"job": "b"}, priority=3)])
        b.start()
        assert b.done.wait(5), "a different lane must not wait for A's reservation"
        a.commit()
    assert b.error is None


def test_claim_does_not_skip_an_uncommitted_lower_position(engine, storage):
    _warm_lane(engine, storage)
    with engine.connect() as a:
        a.begin()
        storage.enqueue_params_batch(a, [job(args={"job": "a"})])

        assert storage.claim_runtime_batch(engine, "q", 5) == []
        assert storage.claim_runtime_batch(engine, "q", 5) == []  # repeated claims too

        a.commit()

    assert [j.job.args for j in storage.claim_runtime_batch(engine, "q", 5)] == [{"job": "a"}]


def test_uncommitted_lower_lane_is_not_stranded_behind_committed_higher_priority_lane(engine, storage):
    # A holds priority 2 open while priority 1 is enqueued, claimed and committed.
    _warm_lane(engine, storage)
    with engine.connect() as a:
        a.begin()
        storage.enqueue_params_batch(a, [job(args={"job": "a"})])
        storage.enqueue_params_batch(engine, [job(args={"job": "hi"}, priority=1)])
        assert [j.job.args for j in storage.claim_runtime_batch(engine, "q", 5)] == [{"job": "hi"}]
        a.commit()
    assert [j.job.args for j in storage.claim_runtime_batch(engine, "q", 5)] == [{"job": "a"}]


# -- striping and shards ------------------------------------------------------------------

def test_striping_spreads_jobs_over_every_stripe(engine, make_storage):
    storage = make_storage(queue_stripe_count=3)
    storage.enqueue_params_batch(engine, [job(args={"i": i}) for i in range(30)])

    per_stripe = Counter(q for (q,) in rows(engine, storage, "ready_entries", ("queue",)))
    assert set(per_stripe) == {"q#0", "q#1", "q#2"}
    assert all(n > 0 for n in per_stripe.values())


@pytest.mark.parametrize("how", ["enqueue", "enqueue_many", "enqueue_params_copy"])
def test_one_job_enqueues_go_round_robin_over_the_stripes(engine, make_storage, how):
    storage = make_storage(queue_stripe_count=3)
    for i in range(6):
        if how == "enqueue":
            storage.enqueue(engine, job(args={"i": i}))
        else:
            getattr(storage, how)(engine, [job(args={"i": i})])

    per_stripe = Counter(q for (q,) in rows(engine, storage, "ready_entries", ("queue",)))
    assert per_stripe == {"q#0": 2, "q#1": 2, "q#2": 2}


def test_each_batch_starts_its_round_robin_one_stripe_further(engine, make_storage):
    storage = make_storage(queue_stripe_count=3)
    for b in range(3):
        storage.enqueue_many(engine, [job(args={"b": b, "i": i}) for i in range(2)])

    placed = {(a["b"], a["i"]): q for q, a in rows(engine, storage, "ready_entries", ("queue", "args"))}
    assert placed == {(0, 0): "q#0", (0, 1): "q#1", (1, 0): "q#1", (1, 1): "q#2", (2, 0): "q#2", (2, 1): "q#0"}


def test_a_job_sent_to_a_named_stripe_stays_on_it(engine, make_storage):
    storage = make_storage(queue_stripe_count=3)
    for _ in range(3):
        storage.enqueue(engine, job(queue="q#2"))
    assert Counter(q for (q,) in rows(engine, storage, "ready_entries", ("queue",))) == {"q#2": 3}


def test_claiming_the_logical_queue_drains_all_stripes_exactly_once(engine, make_storage):
    storage = make_storage(queue_stripe_count=3)
    storage.enqueue_params_batch(engine, [job(args={"i": i}) for i in range(30)])

    claimed = drain(engine, storage, batch=4)
    assert sorted(j.job.args["i"] for j in claimed) == list(range(30))
    assert {j.job.queue for j in claimed} == {"q#0", "q#1", "q#2"}
    assert storage.queue_counts(engine, "q").available == 0


def test_unique_rows_co_locate_on_one_stripe(engine, make_storage):
    storage = make_storage(queue_stripe_count=4)
    storage.enqueue_params_batch(engine, [job(args={"u": 1}, unique=UniqueOpts())])
    claimed = storage.claim_runtime_batch(engine, "q", 1)
    storage.complete_runtime_batch(engine, claimed)
    # Same key from a different batch index still conflicts (same key → same stripe/claim).
    with pytest.raises(UniqueConflictError):
        storage.enqueue_params_batch(engine, [job(), job(), job(args={"u": 1}, unique=UniqueOpts())])


def _set_shards(engine, storage, queue: str, shards: int) -> None:
    with engine.begin() as c:
        c.execute(text(f'INSERT INTO "{storage.schema()}".queue_meta (queue, enqueue_shards) '
                       "VALUES (:q, :n)"), {"q": queue, "n": shards})


def test_enqueue_shards_spread_separate_batches_across_shards(engine, storage):
    _set_shards(engine, storage, "q", 4)
    for b in range(8):
        storage.enqueue_params_batch(engine, [job(args={"b": b, "i": i}) for i in range(3)])

    shards = Counter(s for (s,) in rows(engine, storage, "ready_entries", ("enqueue_shard",)))
    assert set(shards) == {0, 1, 2, 3}
    # One batch shares one lane: each batch lands on a single shard.
    per_batch = {}
    for args, shard in rows(engine, storage, "ready_entries", ("args", "enqueue_shard")):
        per_batch.setdefault(args["b"], set()).add(shard)
    assert all(len(s) == 1 for s in per_batch.values())


def test_enqueue_shards_still_drain_everything(engine, storage):
    _set_shards(engine, storage, "q", 4)
    for b in range(8):
        storage.enqueue_params_batch(engine, [job(args={"b": b, "i": i}) for i in range(3)])

    claimed = drain(engine, storage, batch=5)
    assert sorted((j.job.args["b"], j.job.args["i"]) for j in claimed) \
        == [(b, i) for b in range(8) for i in range(3)]
    assert {j.claim.enqueue_shard for j in claimed} == {0, 1, 2, 3}
    # FIFO holds within each shard.
    for shard in range(4):
        seqs = [j.claim.lane_seq for j in claimed if j.claim.enqueue_shard == shard]
        assert seqs == sorted(seqs)


def test_enqueue_shards_are_looked_up_by_logical_queue_with_striping(engine, make_storage):
    storage = make_storage(queue_stripe_count=2)
    _set_shards(engine, storage, "q", 4)  # logical name only, never a stripe's
    for b in range(8):
        storage.enqueue_params_batch(engine, [job(args={"b": b})])
    shards = {s for (s,) in rows(engine, storage, "ready_entries", ("enqueue_shard",))}
    assert shards == {0, 1, 2, 3}
    assert len(drain(engine, storage)) == 8


def test_ordering_key_pins_a_stable_shard(engine, storage):
    _set_shards(engine, storage, "q", 4)
    keys = [b"alpha", b"beta", b"gamma", b"delta"]
    for round_ in range(3):
        storage.enqueue_params_batch(engine, [job(args={"k": k.decode(), "r": round_}, ordering_key=k)
                                              for k in keys])
        storage.enqueue_params_copy(engine, [job(args={"k": k.decode(), "r": round_ + 10}, ordering_key=k)
                                             for k in keys])

    by_key: dict[str, set[int]] = {}
    for args, shard in rows(engine, storage, "ready_entries", ("args", "enqueue_shard")):
        by_key.setdefault(args["k"], set()).add(shard)
    assert by_key == {k.decode(): {shard_for_ordering_key(k, 4)} for k in keys}
    assert len({shard_for_ordering_key(k, 4) for k in keys}) > 1  # the keys really differ


def test_ordering_key_keeps_fifo_for_its_key(engine, storage):
    _set_shards(engine, storage, "q", 4)
    for i in range(6):
        storage.enqueue_params_batch(engine, [job(args={"i": i}, ordering_key=b"acct-7"),
                                              job(args={"noise": i})])
    claimed = drain(engine, storage, batch=3)
    assert [j.job.args["i"] for j in claimed if "i" in j.job.args] == list(range(6))


def test_slow_enqueue_does_not_block_other_queues(engine, storage):
    with engine.connect() as a:
        a.begin()
        storage.enqueue_params_batch(a, [job(queue="slow")])
        start = time.monotonic()
        storage.enqueue_params_batch(engine, [job(queue="fast")])
        assert time.monotonic() - start < 2
        a.commit()


# -- single-job enqueue and enqueue with ids --------------------------------------------------


def test_enqueue_returns_the_new_jobs_id(engine, storage):
    job_id = storage.enqueue(engine, job("one", {"n": 1}))
    loaded = storage.load_job(engine, job_id)
    assert loaded is not None and loaded.kind == "one" and loaded.args == {"n": 1}


def test_enqueue_many_returns_ids_in_batch_order(engine, storage):
    ids = storage.enqueue_many(engine, [job("a", {"i": i}) for i in range(5)])
    assert [storage.load_job(engine, i).args for i in ids] == [{"i": i} for i in range(5)]


def test_enqueue_names_the_bad_field_of_the_single_job_and_writes_nothing(engine, storage):
    before = census(engine, storage)
    with pytest.raises(ValidationError) as info:
        storage.enqueue(engine, job("", {}))
    assert info.value.field == "job.kind"
    assert census(engine, storage) == before


def test_enqueue_in_a_rolled_back_caller_transaction_leaves_nothing(engine, storage):
    with engine.connect() as conn:
        job_id = storage.enqueue(conn, job())
        conn.rollback()
    assert storage.load_job(engine, job_id) is None


# -- one statement per enqueue, lanes by default ----------------------------------------------

class StatementLog:
    """Every statement an Engine sends, with the driver connection's autocommit flag."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.sent: list[tuple[str, bool]] = []

    def __enter__(self) -> StatementLog:
        event.listen(self.engine, "before_cursor_execute", self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._record)

    def _record(self, conn, cursor, statement, parameters, context, executemany) -> None:
        self.sent.append((statement, conn.connection.driver_connection.autocommit))


def test_single_job_enqueue_on_an_engine_is_one_autocommitted_statement(engine, storage):
    storage.enqueue(engine, job())  # warm-up: compiled statement cached, lane created
    with StatementLog(engine) as log:
        job_id = storage.enqueue(engine, job(args={"n": 1}))
    assert len(log.sent) == 1
    statement, autocommit = log.sent[0]
    assert ".enqueue_job(" in statement and autocommit  # the single-job function, not the batch one
    assert storage.load_job(engine, job_id).args == {"n": 1}  # committed: another connection sees it


def test_single_job_enqueue_in_a_callers_transaction_is_one_statement_there(engine, storage):
    with engine.connect() as conn:
        conn.begin()
        with StatementLog(engine) as log:
            job_id = storage.enqueue(conn, job())
        assert [autocommit for _, autocommit in log.sent] == [False]
        assert storage.load_job(engine, job_id) is None  # not yet committed
        conn.commit()
    assert storage.load_job(engine, job_id) is not None


def test_batch_enqueue_is_one_statement(engine, storage):
    with StatementLog(engine) as log:
        ids = storage.enqueue_many(engine, [job(args={"i": i}) for i in range(50)]
                                   + [job(run_at=datetime.now(UTC) + timedelta(hours=1))])
    assert len(ids) == 51 and len(log.sent) == 1


def test_consecutive_single_job_enqueues_spread_over_eight_lanes_by_default(engine, storage):
    for i in range(16):
        storage.enqueue(engine, job(args={"i": i}))
    shards = Counter(s for (s,) in rows(engine, storage, "ready_entries", ("enqueue_shard",)))
    assert sorted(shards) == list(range(8)) and set(shards.values()) == {2}


def test_one_batch_stays_in_one_lane_in_batch_order(engine, storage):
    storage.enqueue_many(engine, [job(args={"i": i}) for i in range(6)])
    claimed = drain(engine, storage, batch=4)
    assert [j.job.args["i"] for j in claimed] == list(range(6))
    assert len({j.claim.enqueue_shard for j in claimed}) == 1


def test_a_new_queue_meta_row_has_eight_lanes(engine, storage):
    storage.set_queue_options(engine, "q", dlq_enabled=True)
    with engine.connect() as c:
        assert c.execute(text(f'SELECT enqueue_shards FROM "{storage.schema()}".queue_meta '
                              "WHERE queue = 'q'")).scalar_one() == 8


def test_unique_conflict_names_the_owning_job(engine, storage):
    owner = storage.enqueue(engine, job(args={"u": 1}, unique=UniqueOpts()))
    with pytest.raises(UniqueConflictError, match=f"is owned by job {owner}"):
        storage.enqueue(engine, job(args={"u": 1}, unique=UniqueOpts()))


def test_unique_conflict_in_a_batch_releases_the_keys_the_batch_took(engine, storage):
    storage.enqueue(engine, job(args={"u": 2}, unique=UniqueOpts()))
    before = census(engine, storage)
    with pytest.raises(UniqueConflictError):
        storage.enqueue_many(engine, [job(args={"u": 1}, unique=UniqueOpts()),
                                      job(args={"u": 2}, unique=UniqueOpts())])
    assert census(engine, storage) == before
    storage.enqueue(engine, job(args={"u": 1}, unique=UniqueOpts()))  # key 1 is free


def test_concurrent_enqueues_of_one_unique_key_write_one_job(engine, storage):
    barrier = threading.Barrier(8)
    results: list[object] = []

    def one() -> None:
        barrier.wait()
        try:
            results.append(storage.enqueue(engine, job(args={"u": "same"}, unique=UniqueOpts())))
        except UniqueConflictError as exc:
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(r, int) for r in results) == 1
    assert census(engine, storage)["ready_entries"] == 1
