"""Concurrency: exactly-once claiming with threads and processes, producers racing consumers
on one lane, aborted enqueues among committed ones — nothing lost, nothing duplicated, no
deadlock (SQLSTATE 40P01)."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from collections.abc import Callable

from sqlalchemy import create_engine, text

from qstore import DatabaseError, InsertOpts, InsertParams, QueueStorage, QueueStorageConfig

JOBS = 400
EMPTY_ROUNDS = 3  # consecutive empty claims before a consumer believes the queue is drained


def job(args: object, **opts: object) -> InsertParams:
    opts.setdefault("queue", "q")
    return InsertParams("k", args, InsertOpts(**opts))


def consume(storage: QueueStorage, engine, batch: int, keep_going: Callable[[], bool] = lambda: False):
    """Claim + complete until ``keep_going()`` is false and EMPTY_ROUNDS claims in a row came back
    empty. Returns (claimed (job_id, run_lease) pairs, completed pairs, errors)."""
    claimed: list[tuple[int, int]] = []
    completed: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    empty = 0
    while empty < EMPTY_ROUNDS or keep_going():
        try:
            got = storage.claim_runtime_batch(engine, "q", batch)
            if not got:
                empty += 1
                continue
            empty = 0
            claimed += [(j.job.id, j.job.run_lease) for j in got]
            completed += storage.complete_runtime_batch(engine, got)
        except Exception as e:  # collected and asserted on by the test
            errors.append(e)
            if len(errors) > 5:
                break
    return claimed, completed, errors


def deadlocks(errors: list[BaseException]) -> list[BaseException]:
    return [e for e in errors if isinstance(e, DatabaseError) and e.sqlstate == "40P01"]


def run_threads(n: int, target: Callable[[], object]) -> list:
    results: list = [None] * n

    def body(i: int) -> None:
        results[i] = target()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    return results


def assert_exactly_once(storage, engine, enqueued_ids: set[int], claimed: list, completed: list) -> None:
    per_job = Counter(job_id for job_id, _ in claimed)
    assert set(per_job) == enqueued_ids, "lost or phantom jobs"
    assert [j for j, n in per_job.items() if n > 1] == [], "jobs claimed more than once"
    assert all(run_lease == 1 for _, run_lease in claimed)
    assert sorted(completed) == sorted(claimed)
    counts = storage.queue_counts(engine, "q")
    assert (counts.available, counts.running, counts.terminal) == (0, 0, len(enqueued_ids))


def enqueue_ids(engine, storage, n: int, **opts) -> set[int]:
    storage.enqueue_params_copy(engine, [job({"i": i}, **opts) for i in range(n)])
    with engine.connect() as c:
        return set(c.execute(text(f'SELECT job_id FROM "{storage.schema()}".ready_entries')).scalars())


# -- threads ----------------------------------------------------------------------------------

def test_eight_threads_claim_every_job_exactly_once(engine, storage):
    ids = enqueue_ids(engine, storage, JOBS)
    assert len(ids) == JOBS

    results = run_threads(8, lambda: consume(storage, engine, batch=7))

    errors = [e for _, _, errs in results for e in errs]
    assert deadlocks(errors) == []
    assert errors == []
    claimed = [p for c, _, _ in results for p in c]
    completed = [p for _, d, _ in results for p in d]
    assert_exactly_once(storage, engine, ids, claimed, completed)
    assert sum(1 for c, _, _ in results if c) > 1, "work was not shared between threads"


def test_eight_threads_drain_a_striped_sharded_queue_exactly_once(engine, make_storage):
    storage = make_storage(queue_stripe_count=2)
    with engine.begin() as c:
        c.execute(text(f'INSERT INTO "{storage.schema()}".queue_meta (queue, enqueue_shards) VALUES (\'q\', 3)'))
    for b in range(8):  # separate calls spread over shards; priorities over lanes
        storage.enqueue_params_batch(engine, [job({"b": b, "i": i}, priority=1 + b % 4) for i in range(25)])
    with engine.connect() as c:
        ids = set(c.execute(text(f'SELECT job_id FROM "{storage.schema()}".ready_entries')).scalars())
    assert len(ids) == 200

    results = run_threads(8, lambda: consume(storage, engine, batch=7))

    errors = [e for _, _, errs in results for e in errs]
    assert errors == []
    claimed = [p for c, _, _ in results for p in c]
    completed = [p for _, d, _ in results for p in d]
    assert_exactly_once(storage, engine, ids, claimed, completed)


# -- processes --------------------------------------------------------------------------------

def _process_consumer(db_url: str, config: QueueStorageConfig, batch: int):
    """Runs in a spawned process: own engine, own QueueStorage with the same config."""
    engine = create_engine(db_url, pool_size=2)
    try:
        claimed, completed, errors = consume(QueueStorage(config), engine, batch)
        return claimed, completed, [(type(e).__name__, getattr(e, "sqlstate", None), str(e)) for e in errors]
    finally:
        engine.dispose()


def test_four_processes_claim_every_job_exactly_once(engine, db_url, storage):
    ids = enqueue_ids(engine, storage, JOBS)

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(_process_consumer, [(db_url, storage.config, 7)] * 4)

    errors = [e for _, _, errs in results for e in errs]
    assert [e for e in errors if e[1] == "40P01"] == []
    assert errors == []
    claimed = [p for c, _, _ in results for p in c]
    completed = [p for _, d, _ in results for p in d]
    assert_exactly_once(storage, engine, ids, claimed, completed)


# -- producers racing consumers ---------------------------------------------------------------

def _run_producers_and_consumers(engine, storage, produce: Callable[[int], set[int]]):
    """4 producer threads run ``produce(p)`` (returning the committed job ids) while 4
    consumers drain the queue until the producers are done and the queue stays empty."""
    producing = threading.Event()
    producing.set()
    produced: list[set[int]] = [set()] * 4
    producer_errors: list[BaseException] = []

    def producer(p: int) -> None:
        try:
            produced[p] = produce(p)
        except Exception as e:  # asserted on by the test
            producer_errors.append(e)

    producers = [threading.Thread(target=producer, args=(p,), daemon=True) for p in range(4)]
    for t in producers:
        t.start()

    def stop_producing() -> None:
        for t in producers:
            t.join(120)
        producing.clear()

    threading.Thread(target=stop_producing, daemon=True).start()
    results = run_threads(4, lambda: consume(storage, engine, batch=7, keep_going=producing.is_set))
    assert not any(t.is_alive() for t in producers)
    return set().union(*produced), results, producer_errors


def test_concurrent_producers_and_consumers_on_one_lane_lose_and_duplicate_nothing(engine, storage):
    def produce(p: int) -> set[int]:
        for b in range(20):
            storage.enqueue_params_batch(engine, [job({"p": p, "b": b, "i": i}) for i in range(5)])
        return {p}  # ids are collected from the table afterwards

    _, results, producer_errors = _run_producers_and_consumers(engine, storage, produce)

    assert producer_errors == []
    errors = [e for _, _, errs in results for e in errs]
    assert deadlocks(errors) == []
    assert errors == []
    with engine.connect() as c:
        ids = set(c.execute(text(f'SELECT job_id FROM "{storage.schema()}".ready_entries')).scalars())
    assert len(ids) == 400
    claimed = [p for c, _, _ in results for p in c]
    completed = [p for _, d, _ in results for p in d]
    assert_exactly_once(storage, engine, ids, claimed, completed)


def test_aborted_enqueues_among_committed_ones_strand_nothing(engine, storage):
    """Every producer rolls back every third batch on the same lane while consumers drain:
    the gaps must be skipped and every committed job claimed exactly once."""

    def produce(p: int) -> set[int]:
        committed: set[int] = set()
        for b in range(15):
            with engine.connect() as conn:
                conn.begin()
                storage.enqueue_params_batch(conn, [job({"p": p, "b": b, "i": i}) for i in range(5)])
                if b % 3 == 2:
                    conn.rollback()
                else:
                    conn.commit()
                    committed.add((p, b))
        return committed

    committed, results, producer_errors = _run_producers_and_consumers(engine, storage, produce)

    assert producer_errors == []
    errors = [e for _, _, errs in results for e in errs]
    assert errors == []
    with engine.connect() as c:
        rows = c.execute(text(f'SELECT job_id, args FROM "{storage.schema()}".ready_entries')).all()
    assert {(a["p"], a["b"]) for _, a in rows} == committed
    assert len(rows) == 4 * 10 * 5
    claimed = [p for c, _, _ in results for p in c]
    completed = [p for _, d, _ in results for p in d]
    assert_exactly_once(storage, engine, {j for j, _ in rows}, claimed, completed)


def test_threads_claim_exactly_once_with_materialised_leases(engine, make_storage):
    storage = make_storage(lease_claim_receipts=False)
    ids = enqueue_ids(engine, storage, 200)

    results = run_threads(8, lambda: consume(storage, engine, batch=7))

    errors = [e for _, _, errs in results for e in errs]
    assert errors == []
    claimed = [p for c, _, _ in results for p in c]
    completed = [p for _, d, _ in results for p in d]
    assert_exactly_once(storage, engine, ids, claimed, completed)
