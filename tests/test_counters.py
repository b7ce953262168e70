"""Terminal counters: delta rollup (current slot, open work, pinned MVCC horizon, lock
timeout), rebuild, the trust marker, and exact ``terminal`` counts through rollup, prune and
rebuild compared with a full scan of the done rows (+ pruned rollups)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, select, text, update

from qstore import InsertOpts, InsertParams, QueueStorage
from qstore.errors import ValidationError
from qstore.types import PruneOutcome, TerminalDeltaRollupOutcome

SMALL = {"queue_slot_count": 4, "lease_slot_count": 2, "claim_slot_count": 2}
Q = "cq"


@pytest.fixture
def engine(db_url: str) -> Any:
    """Per-test Engine (fresh compiled cache; see tests/test_rings.py::engine for why)."""
    eng = create_engine(db_url, pool_size=10, max_overflow=10)
    yield eng
    eng.dispose()


@pytest.fixture
def st(make_storage: Callable[..., QueueStorage]) -> QueueStorage:
    return make_storage(**SMALL)


def enqueue(st: QueueStorage, engine: Engine, n: int, queue: str = Q, priority: int = 2) -> None:
    assert st.enqueue_params_batch(engine, [
        InsertParams("count_job", {"i": i}, InsertOpts(queue=queue, priority=priority)) for i in range(n)
    ]) == n


def drain(st: QueueStorage, engine: Engine, queue: str = Q) -> int:
    done = 0
    while claimed := st.claim_runtime_batch(engine, queue, 50):
        done += len(st.complete_runtime_batch(engine, claimed))
    return done


def scan_terminal(st: QueueStorage, engine: Engine, queue: str = Q) -> int:
    """Ground truth: pruned history (rollups and the prune ledger) + every retained done row
    and member of a batch done row."""
    t = st.tables
    b = t.done_batches.parent
    with engine.connect() as conn:
        rolled = conn.execute(select(func.coalesce(func.sum(t.rollups.c.pruned_completed_count), 0))
                              .where(t.rollups.c.queue == queue)).scalar_one()
        rolled += conn.execute(select(func.coalesce(func.sum(t.rollup_ledger.c.pruned_count), 0))
                               .where(t.rollup_ledger.c.queue == queue)).scalar_one()
        done = conn.execute(select(func.count()).select_from(t.done.parent)
                            .where(t.done.parent.c.queue == queue)).scalar_one()
        done += conn.execute(select(func.coalesce(func.sum(func.cardinality(b.c.lane_seqs)), 0))
                             .where(b.c.queue == queue)).scalar_one()
    return int(rolled) + int(done)


def counter_parts(st: QueueStorage, engine: Engine) -> tuple[int, int]:
    """(Σ live counts, Σ deltas) over all queues."""
    t = st.tables
    with engine.connect() as conn:
        live = conn.execute(select(func.coalesce(func.sum(t.live_counts.c.live_terminal_count), 0))).scalar_one()
        deltas = conn.execute(select(func.coalesce(func.sum(t.deltas.parent.c.terminal_delta), 0))).scalar_one()
    return int(live), int(deltas)


def delta_rows(st: QueueStorage, engine: Engine, slot: int | None = None) -> int:
    d = st.tables.deltas.parent
    q = select(func.count()).select_from(d)
    if slot is not None:
        q = q.where(d.c.ready_slot == slot)
    with engine.connect() as conn:
        return int(conn.execute(q).scalar_one())


def assert_exact(st: QueueStorage, engine: Engine, queue: str = Q) -> int:
    truth = scan_terminal(st, engine, queue)
    assert st.terminal_counter_trusted(engine)
    assert st.queue_counts(engine, queue).terminal == truth
    return truth


def test_fresh_install_is_trusted_and_rollup_zero_is_default(st: QueueStorage, engine: Engine) -> None:
    assert st.terminal_counter_trusted(engine) is True
    assert st.rollup_terminal_count_deltas(engine, 0) == TerminalDeltaRollupOutcome()
    assert st.rollup_terminal_count_deltas(engine, 5) == TerminalDeltaRollupOutcome()
    with pytest.raises(ValidationError):
        st.rollup_terminal_count_deltas(engine, -1)


def test_rollup_skips_current_slot_and_folds_sealed_ones(st: QueueStorage, engine: Engine) -> None:
    enqueue(st, engine, 12)
    assert drain(st, engine) == 12
    assert delta_rows(st, engine, 0) > 0
    # slot 0 is current: never a candidate
    assert st.rollup_terminal_count_deltas(engine, 4) == TerminalDeltaRollupOutcome()
    assert st.rotate(engine).kind == "rotated"
    out = st.rollup_terminal_count_deltas(engine, 4)
    assert out.rolled_slots == 1 and not out.skipped_mvcc_pinned
    assert out.delta_rows >= 1 and out.grouped_keys == 1  # one lane, one counter bucket
    assert delta_rows(st, engine, 0) == 0
    assert counter_parts(st, engine) == (12, 0)
    assert assert_exact(st, engine) == 12
    # nothing left to roll
    assert st.rollup_terminal_count_deltas(engine, 4) == TerminalDeltaRollupOutcome()
    # a later completion of a job from the sealed slot appends a fresh delta there
    enqueue(st, engine, 3)  # lands in slot 1 (current)
    assert drain(st, engine) == 3
    assert assert_exact(st, engine) == 15


def test_rollup_respects_max_slots_oldest_first(st: QueueStorage, engine: Engine) -> None:
    for _ in range(3):
        enqueue(st, engine, 4)
        assert drain(st, engine) == 4
        assert st.rotate(engine).kind == "rotated"
    out = st.rollup_terminal_count_deltas(engine, 2)
    assert out.rolled_slots == 2
    assert delta_rows(st, engine, 0) == 0 and delta_rows(st, engine, 1) == 0
    assert delta_rows(st, engine, 2) > 0
    assert assert_exact(st, engine) == 12
    assert st.rollup_terminal_count_deltas(engine, 2).rolled_slots == 1
    assert counter_parts(st, engine) == (12, 0)


def test_rollup_skips_slot_with_open_work(st: QueueStorage, engine: Engine) -> None:
    enqueue(st, engine, 4)
    held = st.claim_runtime_batch(engine, Q, 1)
    assert drain(st, engine) == 3
    assert st.rotate(engine).kind == "rotated"
    out = st.rollup_terminal_count_deltas(engine, 4)
    assert out == TerminalDeltaRollupOutcome(skipped_active_slots=1)
    assert delta_rows(st, engine, 0) > 0
    assert assert_exact(st, engine) == 3
    assert st.complete_runtime_batch(engine, held)
    out = st.rollup_terminal_count_deltas(engine, 4)
    assert out.rolled_slots == 1
    assert assert_exact(st, engine) == 4


PIN = timedelta(milliseconds=50)  # a snapshot held longer than this pins the horizon here


def hold_longer_than_pin() -> None:
    time.sleep(PIN.total_seconds() * 3)


def rollup_once_released(st: QueueStorage, engine: Engine) -> TerminalDeltaRollupOutcome:
    """The rollup with ``PIN`` after the test's own holder let go. Other sessions of the
    test's database (the install pool resetting an earlier test's schema in the background)
    can hold a transaction longer than 50 ms for a moment on a loaded host: a rollup that
    stands down for one of those is tried again, for up to 5 s."""
    deadline = time.monotonic() + 5.0
    out = st.rollup_terminal_count_deltas(engine, 4, pinned_after=PIN)
    while out.skipped_mvcc_pinned and time.monotonic() < deadline:
        time.sleep(0.05)
        out = st.rollup_terminal_count_deltas(engine, 4, pinned_after=PIN)
    return out


def test_rollup_stands_down_while_a_snapshot_pins_the_mvcc_horizon(st: QueueStorage, engine: Engine) -> None:
    enqueue(st, engine, 6)
    assert drain(st, engine) == 6
    assert st.rotate(engine).kind == "rotated"
    before = delta_rows(st, engine)
    reader = engine.connect()
    try:
        reader.execute(text("BEGIN ISOLATION LEVEL REPEATABLE READ"))
        assert reader.execute(text("SELECT 1")).scalar_one() == 1  # takes the snapshot
        hold_longer_than_pin()
        out = st.rollup_terminal_count_deltas(engine, 4, pinned_after=PIN)
        assert out == TerminalDeltaRollupOutcome(skipped_mvcc_pinned=True)
        assert delta_rows(st, engine) == before  # touched nothing
        # exact counts stay right meanwhile, also with more traffic
        assert assert_exact(st, engine) == 6
        enqueue(st, engine, 2)
        assert drain(st, engine) == 2
        assert assert_exact(st, engine) == 8
        # the pinned reader's own view is unaffected as well
        assert st.queue_counts(reader, Q).terminal == 6
    finally:
        reader.execute(text("COMMIT"))
        reader.close()
    out = rollup_once_released(st, engine)
    assert out.rolled_slots == 1 and not out.skipped_mvcc_pinned
    assert assert_exact(st, engine) == 8


def test_rollup_stands_down_for_idle_in_transaction_with_xid(st: QueueStorage, engine: Engine) -> None:
    enqueue(st, engine, 2)
    assert drain(st, engine) == 2
    assert st.rotate(engine).kind == "rotated"
    with engine.connect() as holder:
        holder.execute(select(func.txid_current()))  # READ COMMITTED, idle in tx with an xid
        hold_longer_than_pin()
        assert st.rollup_terminal_count_deltas(engine, 4, pinned_after=PIN).skipped_mvcc_pinned
        holder.rollback()
    assert rollup_once_released(st, engine).rolled_slots == 1


def test_rollup_is_not_stopped_by_a_snapshot_younger_than_the_pin_age(st: QueueStorage, engine: Engine) -> None:
    enqueue(st, engine, 2)
    assert drain(st, engine) == 2
    assert st.rotate(engine).kind == "rotated"
    with engine.connect() as reader:
        reader.execute(text("BEGIN ISOLATION LEVEL REPEATABLE READ"))
        reader.execute(text("SELECT 1"))
        out = st.rollup_terminal_count_deltas(engine, 4, pinned_after=timedelta(seconds=30))
        reader.execute(text("COMMIT"))
    assert out.rolled_slots == 1 and not out.skipped_mvcc_pinned


def test_rollup_makes_progress_while_workers_keep_running_short_statements(
        st: QueueStorage, engine: Engine) -> None:
    """Busy workers always have some statement with a snapshot in flight; only a snapshot
    older than the pin age stands the rollup down."""
    enqueue(st, engine, 4)
    assert drain(st, engine) == 4
    assert st.rotate(engine).kind == "rotated"
    stop = threading.Event()

    def busy() -> None:
        with engine.connect() as c:
            while not stop.is_set():
                c.execute(text("SELECT pg_sleep(0.02)"))
                c.commit()

    workers = [threading.Thread(target=busy) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        time.sleep(0.1)
        out = st.rollup_terminal_count_deltas(engine, 4)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert out.rolled_slots == 1 and not out.skipped_mvcc_pinned
    assert assert_exact(st, engine) == 4


def test_rollup_folds_the_prune_ledger_into_the_rollups(st: QueueStorage, engine: Engine) -> None:
    enqueue(st, engine, 3)
    assert drain(st, engine) == 3
    assert st.rotate(engine).kind == "rotated"
    assert st.prune_oldest(engine).kind == "pruned"
    t = st.tables
    with engine.connect() as conn:
        assert conn.execute(select(func.sum(t.rollup_ledger.c.pruned_count))).scalar_one() == 3
    st.rollup_terminal_count_deltas(engine, 4)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(t.rollup_ledger)).scalar_one() == 0
        assert conn.execute(select(t.rollups.c.pruned_completed_count)).scalar_one() == 3
    assert assert_exact(st, engine) == 3


def test_rollup_blocked_by_lock_on_delta_child(st: QueueStorage, engine: Engine) -> None:
    enqueue(st, engine, 3)
    assert drain(st, engine) == 3
    assert st.rotate(engine).kind == "rotated"
    schema = st.schema()
    with engine.connect() as holder:
        # RC transaction holding a lock but no snapshot and no xid: not "pinned"
        holder.execute(text(f'LOCK TABLE "{schema}".queue_terminal_count_deltas_0 IN ACCESS SHARE MODE'))
        out = st.rollup_terminal_count_deltas(engine, 4)
        assert out == TerminalDeltaRollupOutcome(blocked_slots=1)
        holder.rollback()
    assert st.rollup_terminal_count_deltas(engine, 4).rolled_slots == 1
    assert assert_exact(st, engine) == 3


def test_counters_exact_through_rollup_prune_and_rebuild(st: QueueStorage, engine: Engine) -> None:
    """Several queues and priorities over several ring turns; after each maintenance step
    the counters equal a full scan; prune folds history into rollups; rebuild reproduces
    the same numbers from done rows."""
    queues = (Q, "cq_other")
    total = {q: 0 for q in queues}
    for round_ in range(7):
        for i, q in enumerate(queues):
            n = 3 + round_ + i
            enqueue(st, engine, n, queue=q, priority=1 + (round_ + i) % 4)
            total[q] += drain(st, engine, q)
        for q in queues:
            assert assert_exact(st, engine, q) == total[q]
        assert st.rotate(engine).kind == "rotated"
        if round_ % 2:
            st.rollup_terminal_count_deltas(engine, 2)
            for q in queues:
                assert assert_exact(st, engine, q) == total[q]
        assert st.prune_oldest(engine).kind in ("pruned", "noop")
        for q in queues:
            assert assert_exact(st, engine, q) == total[q]
    for q in queues:  # keep some history retained (sealed + current slot)
        enqueue(st, engine, 5, queue=q)
        total[q] += drain(st, engine, q)
    assert st.rotate(engine).kind == "rotated"
    enqueue(st, engine, 2)
    total[Q] += drain(st, engine)
    live, deltas = counter_parts(st, engine)
    t = st.tables
    with engine.connect() as conn:
        retained = conn.execute(select(func.count()).select_from(t.done.parent)).scalar_one()
        retained += conn.execute(select(func.coalesce(func.sum(func.cardinality(t.done_batches.parent.c.lane_seqs)), 0))
                                 ).scalar_one()
        rolled = conn.execute(select(func.coalesce(func.sum(t.rollups.c.pruned_completed_count), 0))).scalar_one()
        rolled += conn.execute(select(func.coalesce(func.sum(t.rollup_ledger.c.pruned_count), 0))).scalar_one()
    assert live + deltas == retained
    assert rolled + retained == sum(total.values())
    assert rolled > 0  # prune did fold history

    written = st.rebuild_terminal_counters(engine)
    assert written > 0
    assert counter_parts(st, engine) == (retained, 0)
    for q in queues:
        assert assert_exact(st, engine, q) == total[q]


def test_untrusted_counters_scan_and_rebuild_restores_trust(st: QueueStorage, engine: Engine) -> None:
    enqueue(st, engine, 5)
    assert drain(st, engine) == 5
    cs = st.tables.counter_state
    with engine.begin() as conn:  # simulate counters damaged and distrusted
        conn.execute(update(cs).values(terminal_counter_trusted_at=None))
        conn.execute(text(f'TRUNCATE "{st.schema()}".queue_terminal_count_deltas'))
    assert st.terminal_counter_trusted(engine) is False
    assert st.queue_counts(engine, Q).terminal == 5  # scan
    assert st.rebuild_terminal_counters(engine) == 1  # one (slot, lane, bucket) key
    assert st.terminal_counter_trusted(engine) is True
    assert counter_parts(st, engine) == (5, 0)
    assert assert_exact(st, engine) == 5


def test_rebuild_on_callers_connection_and_rollup_in_caller_tx(st: QueueStorage, engine: Engine) -> None:
    enqueue(st, engine, 4)
    assert drain(st, engine) == 4
    assert st.rotate(engine).kind == "rotated"
    with engine.connect() as conn:
        out = st.rollup_terminal_count_deltas(conn, 4)
        assert out.rolled_slots == 1
        conn.rollback()  # caller decides: nothing happened
    assert delta_rows(st, engine, 0) > 0
    with engine.begin() as conn:
        assert st.rebuild_terminal_counters(conn) == 1  # one (slot, lane, bucket) key
    assert st.prune_oldest(engine) == PruneOutcome.pruned(0)
    assert counter_parts(st, engine) == (0, 0)
    assert assert_exact(st, engine) == 4
