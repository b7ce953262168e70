"""qstore.status: per-queue counts, ring cursors and slots, and table health by family."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest
from jobtools import add, claim, params, running
from sqlalchemy import Engine, text

from qstore import QueueStorage, status
from qstore.config import WHEEL_SLOTS
from qstore.status import FAMILIES, SchemaHealth

UTC = timezone.utc


def _flush_stats(engine: Engine) -> None:
    """Ask every pooled session of ``engine`` to flush its table statistics when it goes
    idle (instead of up to a second later)."""
    conns = [engine.connect() for _ in range(3)]
    for c in conns:
        c.execute(text("SELECT pg_stat_force_next_flush()"))
        c.commit()
    for c in conns:
        c.close()


def _health_until(engine: Engine, s: QueueStorage, done: Callable[[SchemaHealth], bool],
                  timeout: float = 10.0) -> SchemaHealth:
    """``schema_health`` polled until ``done`` holds (statistics arrive asynchronously)."""
    _flush_stats(engine)
    deadline = time.monotonic() + timeout
    while True:
        health = status.schema_health(engine, s)
        if done(health) or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def _queue(engine: Engine, s: QueueStorage, name: str, **kw: object) -> status.QueueStatus:
    (only,) = status.queue_status(engine, s, [name], **kw)  # type: ignore[arg-type]
    return only


# -- queues --------------------------------------------------------------------------------


def test_queue_status_counts_every_state_of_a_queue(engine, st):
    add(engine, st)                                                   # available
    running(engine, st)                                               # running
    c = running(engine, st)
    token = st.register_callback(engine, c.job.id, c.job.run_lease, 60)
    assert st.enter_callback_wait(engine, c.job.id, c.job.run_lease, token)  # waiting_external
    add(engine, st, run_at=datetime.now(UTC) + timedelta(hours=1))    # scheduled
    c = running(engine, st)
    st.fail_retryable(engine, c.job.id, c.job.run_lease, "transient")  # retryable
    st.complete_runtime_batch(engine, [running(engine, st)])           # completed
    c = running(engine, st)
    st.cancel_running(engine, c.job.id, c.job.run_lease, "stop")        # cancelled
    for _ in range(2):
        c = running(engine, st)
        st.fail_terminal(engine, c.job.id, c.job.run_lease, "fatal")    # failed
    c = running(engine, st)
    st.fail_to_dlq(engine, c.job.id, c.job.run_lease, "poison", "bad")  # dlq

    q = _queue(engine, st, "q")
    assert (q.available, q.running, q.waiting_external, q.scheduled, q.retryable) == (1, 1, 1, 1, 1)
    assert (q.terminal, q.completed, q.cancelled, q.failed, q.dlq) == (4, 1, 1, 2, 1)
    assert q.waiting == 2
    assert (q.paused, q.lanes) == (False, 8)  # eight lanes by default, enqueues go round-robin


def test_queue_status_lists_every_queue_sorted_including_backlog_only_ones(engine, st):
    add(engine, st, queue="b")
    add(engine, st, queue="later", run_at=datetime.now(UTC) + timedelta(hours=1))
    c = running(engine, st, queue="a")
    st.fail_to_dlq(engine, c.job.id, c.job.run_lease, "poison", "bad")
    st.set_queue_options(engine, "idle", paused=True)
    assert [q.queue for q in status.queue_status(engine, st)] == ["a", "b", "idle", "later"]
    assert status.queue_names(engine, st) == ["a", "b", "idle", "later"]


def test_queue_names_include_a_queue_known_only_by_its_terminal_rows(engine, st):
    job_id = add(engine, st, queue="later", run_at=datetime.now(UTC) + timedelta(hours=1))
    st.cancel_job(engine, job_id)
    assert status.queue_names(engine, st) == ["later"]
    assert _queue(engine, st, "later").cancelled == 1


def test_queue_status_shows_a_paused_queue(engine, st):
    add(engine, st)
    st.set_queue_options(engine, "q", paused=True)
    assert _queue(engine, st, "q").paused is True


def test_queue_status_folds_stripes_into_their_logical_queue(engine, make_storage):
    s = make_storage(queue_stripe_count=3)
    s.enqueue_params_batch(engine, [params(queue="q") for _ in range(6)])
    got = s.claim_runtime_batch(engine, "q", 2, None)
    s.fail_terminal(engine, got[0].job.id, got[0].job.run_lease, "fatal")
    q = _queue(engine, s, "q")
    assert [x.queue for x in status.queue_status(engine, s)] == ["q"]
    assert (q.available, q.running, q.failed, q.terminal) == (4, 1, 1, 1)
    assert q.lanes > 1


def test_fast_queue_status_reads_the_lane_heads_and_leaves_retained_states_unknown(engine, st):
    st.complete_runtime_batch(engine, [running(engine, st)])
    add(engine, st)
    q = _queue(engine, st, "q", exact=False)
    assert q.available >= 1
    assert (q.completed, q.cancelled, q.failed) == (None, None, None)
    assert q.terminal == st.queue_counts_fast(engine, "q").terminal


def test_queue_status_of_a_connection_joins_its_transaction(engine, st):
    with engine.connect() as conn:
        st.enqueue_params_batch(conn, [params()])
        assert _queue(conn, st, "q").available == 1
        conn.rollback()
    assert status.queue_status(engine, st) == []


# -- rings ---------------------------------------------------------------------------------


def test_ring_status_reports_each_rings_cursor_and_the_generation_of_each_slot(engine, make_storage):
    s = make_storage(queue_slot_count=4, lease_slot_count=2, claim_slot_count=2)
    add(engine, s)
    assert s.rotate(engine).kind == "rotated"
    queue_ring, lease_ring, claim_ring = status.ring_status(engine, s)
    assert (queue_ring.name, queue_ring.current_slot, queue_ring.generation, queue_ring.slot_count) == \
        ("queue", 1, 1, 4)
    assert [(x.slot, x.generation, x.current) for x in queue_ring.slots] == \
        [(0, 0, False), (1, 1, True), (2, None, False), (3, None, False)]
    assert (lease_ring.name, lease_ring.generation, lease_ring.slot_count) == ("lease", 0, 2)
    assert (claim_ring.name, claim_ring.generation, claim_ring.slot_count) == ("claim", 0, 2)


def test_ring_status_counts_slots_written_since_their_last_reclaim(engine, make_storage):
    s = make_storage(queue_slot_count=4, lease_slot_count=2, claim_slot_count=2)
    assert status.ring_status(engine, s)[0].slots_holding_data == 0
    s.complete_runtime_batch(engine, [running(engine, s)])
    queue_ring = status.ring_status(engine, s)[0]
    assert queue_ring.slots_holding_data == 1
    assert queue_ring.slots[0].heap_bytes > 0
    for _ in range(3):  # slots 1, 2 and 3 written in turn: slot 0 is next, so prune takes it
        assert s.rotate(engine).kind == "rotated"
        s.complete_runtime_batch(engine, [running(engine, s)])
    pruned = s.prune_oldest(engine)
    assert (pruned.kind, pruned.slot) == ("pruned", 0)
    queue_ring = status.ring_status(engine, s)[0]
    assert queue_ring.slots[0].heap_bytes == 0
    assert queue_ring.slots_holding_data == 3


# -- health --------------------------------------------------------------------------------


def test_health_puts_every_table_of_the_schema_in_one_family(engine, make_storage):
    s = make_storage(queue_slot_count=4, lease_slot_count=2, claim_slot_count=3)
    health = status.schema_health(engine, s)
    with engine.connect() as conn:
        names = set(conn.execute(text(  # plain tables and ring children; parents hold nothing
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = :s AND c.relkind = 'r'"), {"s": s.schema()}).scalars())
    assert {t.name for t in health.tables} == names
    tables = {f.name: f.tables for f in health.families}
    assert [f.name for f in health.families] == list(FAMILIES)
    assert {k: tables[k] for k in ("queue_ready", "queue_done", "lease_ring", "claim_ring")} == \
        {"queue_ready": 3 * 4, "queue_done": 3 * 4, "lease_ring": 2, "claim_ring": 3 * 4}  # + progress rows
    assert (tables["hot"], tables["counters"], tables["backlog"]) == (6, 4, 4)
    assert tables["deferred_wheel"] == 2 * WHEEL_SLOTS
    assert health.family("other").tables == len(names) - sum(
        tables[k] for k in FAMILIES if k != "other")


def test_health_reports_bytes_for_every_family_and_their_total(engine, st):
    health = status.schema_health(engine, st)
    assert all(f.bytes > 0 for f in health.families)
    assert health.bytes == sum(t.bytes for t in health.tables)


def test_health_reads_only_the_install_schema(engine, st):
    with engine.begin() as conn:
        conn.execute(text('CREATE SCHEMA IF NOT EXISTS "status_elsewhere"'))
        conn.execute(text('CREATE TABLE IF NOT EXISTS "status_elsewhere".attempt_state (x int)'))
    try:
        health = status.schema_health(engine, st)
        assert health.family("hot").tables == 6
        assert all(t.name != "x" for t in health.tables)
    finally:
        with engine.begin() as conn:
            conn.execute(text('DROP SCHEMA "status_elsewhere" CASCADE'))


def _resume(engine: Engine, s: QueueStorage) -> None:
    """Updates of ``attempt_state`` (a hot table): a resumed callback's result is stored,
    then its expressions are cleared."""
    c = running(engine, s)
    token = s.register_callback(engine, c.job.id, c.job.run_lease, 60)
    s.complete_external(engine, token, {"ok": 1}, resume=True)


def _cancel_far(engine: Engine, s: QueueStorage) -> None:
    """Deletes from ``deferred_jobs`` (the backlog: the deferred overflow)."""
    job_id = add(engine, s, run_at=datetime.now(UTC) + timedelta(hours=2))
    assert s.cancel_job(engine, job_id) is not None


def _retry_failed(engine: Engine, s: QueueStorage) -> None:
    """Deletes a done row (the queue ring's done side)."""
    c = running(engine, s)
    s.fail_terminal(engine, c.job.id, c.job.run_lease, "fatal")
    assert s.retry_job(engine, c.job.id) is not None


@pytest.mark.parametrize(("family", "make_dead_tuples"), [
    ("hot", _resume), ("backlog", _cancel_far), ("queue_done", _retry_failed)])
def test_dead_tuples_of_updated_rows_appear_in_their_family(engine, st, family, make_dead_tuples):
    before = _health_until(engine, st, lambda h: True).family(family).dead_tuples
    make_dead_tuples(engine, st)
    after = _health_until(engine, st, lambda h: h.family(family).dead_tuples > before)
    assert after.family(family).dead_tuples > before
    assert after.dead_tuples >= after.family(family).dead_tuples


# -- the whole report ----------------------------------------------------------------------


def test_status_report_as_dict_has_stable_keys(engine, st):
    add(engine, st)
    claim(engine, st)
    report = status.status_report(engine, st).as_dict()
    assert set(report) == {"schema", "exact", "counters_trusted", "shape", "queues", "rings", "health",
                           "handed_back"}
    assert set(report["shape"]) == {"queue_slot_count", "lease_slot_count", "claim_slot_count",
                                    "queue_stripe_count", "lease_claim_receipts"}
    assert set(report["queues"][0]) == {
        "queue", "available", "running", "waiting_external", "scheduled", "retryable", "waiting",
        "terminal", "completed", "cancelled", "failed", "dlq", "paused", "lanes"}
    assert [r["name"] for r in report["rings"]] == ["queue", "lease", "claim"]
    assert set(report["rings"][0]) == {"name", "current_slot", "generation", "slot_count",
                                       "slots_holding_data", "bytes", "slots"}
    assert set(report["rings"][0]["slots"][0]) == {"slot", "generation", "current", "heap_bytes", "bytes"}
    assert set(report["health"]) == {"schema", "families", "total"}
    assert list(report["health"]["families"]) == list(FAMILIES)
    assert set(report["health"]["total"]) == {"tables", "live_tuples", "dead_tuples", "bytes"}
    assert (report["schema"], report["exact"], report["counters_trusted"]) == (st.schema(), True, True)
