"""Ring maintenance: rotate / prune outcomes of the queue, lease and claim rings, the prune
gates (never truncate live work), lock-timeout ``Blocked``, unique-key release at prune,
prunability judged by evidence (not by done rows) and late writers into retired slots."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from operation_cases import (
    NOT_PINNED,
    prunable_claim_slot,
    prunable_lease_slot,
    prunable_queue_slot,
    rollable_deltas,
)
from sqlalchemy import Engine, create_engine, event, func, select, text

from qstore import InsertOpts, InsertParams, QueueStorage, UniqueOpts
from qstore.errors import UniqueConflictError, ValidationError
from qstore.storage.planes.rings import pristine, pristine_slots, slot_generation
from qstore.storage.upkeep.rings import TAIL_PROBE
from qstore.types import BusyCounts, PruneOutcome, RotateOutcome, SkipReason

SMALL = {"queue_slot_count": 4, "lease_slot_count": 2, "claim_slot_count": 2}
Q = "rq"


def jobs(n: int, queue: str = Q, **opts: Any) -> list[InsertParams]:
    return [InsertParams("ring_job", {"i": i}, InsertOpts(queue=queue, **opts)) for i in range(n)]


def enqueue(st: QueueStorage, engine: Engine, n: int = 1) -> None:
    assert st.enqueue_params_batch(engine, jobs(n)) == n


def drain(st: QueueStorage, engine: Engine, queue: str = Q) -> int:
    """Claim and complete everything available; returns jobs completed."""
    done = 0
    while claimed := st.claim_runtime_batch(engine, queue, 100):
        done += len(st.complete_runtime_batch(engine, claimed))
    return done


def qualified(st: QueueStorage, name: str) -> str:
    return f'"{st.schema()}"."{name}"'


def ring_gens(st: QueueStorage, engine: Engine) -> dict[int, int]:
    """Each queue slot's last generation (derived from the ring's: -1 never initialised),
    or -1 for a sealed slot a prune emptied."""
    ring = st.tables.queue_ring
    with engine.connect() as conn:
        gen = conn.execute(select(ring.state.c.generation)).scalar_one()
    out = {}
    for k in range(ring.slot_count):
        g = slot_generation(gen, k, ring.slot_count)
        empty = all(rows_in(st, engine, t.name) == 0 for t in ring.children(k))
        out[k] = -1 if g < 0 or (k != gen % ring.slot_count and empty) else g
    return out


def set_queue_generation(conn, st: QueueStorage, generation: int) -> None:
    """Move the queue ring's cursor by hand (as a writer with a stale read would see it)."""
    conn.execute(text(f"SELECT setval('{st.schema()}.queue_ring_generation', {generation}, true)"))


def rows_in(st: QueueStorage, engine: Engine, name: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {qualified(st, name)}")).scalar_one())


@pytest.fixture
def engine(db_url: str) -> Any:
    """A per-test Engine (fresh compiled-statement cache). Works around a cache-key
    collision: SQLAlchemy's ``Sequence.next_value()`` cache key omits the schema, so with
    one shared Engine ``enqueue``'s id allocation can run against an earlier test's schema."""
    eng = create_engine(db_url, pool_size=10, max_overflow=10)
    yield eng
    eng.dispose()


@pytest.fixture
def small(make_storage: Callable[..., QueueStorage]) -> QueueStorage:
    return make_storage(**SMALL)


# -- queue ring ------------------------------------------------------------------------------
def test_fresh_queue_ring_is_idle_and_has_nothing_to_prune(small: QueueStorage, engine: Engine) -> None:
    assert small.rotate(engine) == RotateOutcome.skipped_idle(0, 0)
    assert small.prune_oldest(engine) == PruneOutcome.noop()
    with engine.connect() as conn:  # skipped_idle wrote nothing
        st = small.tables.queue_ring.state
        assert conn.execute(select(st.c.current_slot, st.c.generation)).one() == (0, 0)


def test_rotate_and_prune_kinds_are_members_that_read_as_their_strings(small: QueueStorage, engine: Engine) -> None:
    from qstore.types import PruneKind, RotateKind

    rotated, pruned = small.rotate(engine).kind, small.prune_oldest(engine).kind
    assert (rotated, pruned) == (RotateKind.SKIPPED_IDLE, PruneKind.NOOP)
    assert (rotated, f"{pruned}", str(rotated)) == ("skipped_idle", "noop", "skipped_idle")
    assert RotateOutcome("rotated", 1, 1) == RotateOutcome.rotated(1, 1)
    assert PruneOutcome("blocked", 3).kind is PruneKind.BLOCKED
    with pytest.raises(ValueError):
        PruneOutcome("prunned")


def test_queue_rotation_moves_only_into_empty_slots(small: QueueStorage, engine: Engine) -> None:
    for expected in (1, 2, 3):
        enqueue(small, engine)
        assert small.rotate(engine) == RotateOutcome.rotated(expected, expected)
        assert small.rotate(engine).kind == "skipped_idle"  # nothing written to the new slot
    assert ring_gens(small, engine) == {0: 0, 1: 1, 2: 2, 3: 3}
    enqueue(small, engine, 2)
    out = small.rotate(engine)
    assert out.kind == "skipped_busy" and out.slot == 0
    assert out.busy == BusyCounts(queue_ready=1)
    # claimed + completed rows make every other family of the slot busy as well
    assert drain(small, engine) == 5
    out = small.rotate(engine)
    assert out.kind == "skipped_busy" and out.busy is not None
    assert (out.busy.queue_ready, out.busy.queue_done, out.busy.queue_claim_ranges) == (1, 1, 1)
    assert out.busy.queue_terminal_deltas >= 1


def test_a_slot_holding_batch_done_rows_is_busy_for_rotation(small: QueueStorage, engine: Engine) -> None:
    enqueue(small, engine, 3)  # one call: one lane
    assert drain(small, engine) == 3  # one completion call: one batch done row
    for _ in range(3):  # into slots 1, 2 and 3
        enqueue(small, engine)
        assert small.rotate(engine).kind == "rotated"
    enqueue(small, engine)
    out = small.rotate(engine)
    assert out.kind == "skipped_busy" and out.slot == 0 and out.busy is not None
    assert (out.busy.queue_done_batches, out.busy.queue_done) == (1, 0)


def test_prune_reports_a_backlog_from_the_ends_of_its_lanes(small: QueueStorage, engine: Engine) -> None:
    # a backlog is found among the last TAIL_PROBE rows of its lane, without a full count
    small.set_queue_options(engine, Q, enqueue_shards=1)
    enqueue(small, engine, 3 * TAIL_PROBE)
    assert small.rotate(engine).kind == "rotated"
    out = small.prune_oldest(engine)
    assert out == PruneOutcome.skipped_active(0, SkipReason.QUEUE_PENDING_READY, TAIL_PROBE)
    assert rows_in(small, engine, "ready_entries_0") == 3 * TAIL_PROBE


def test_prune_counts_the_whole_slot_when_the_ends_of_its_lanes_are_spent(
        small: QueueStorage, engine: Engine) -> None:
    # A range covering only a lane's last TAIL_PROBE rows (no claim writes one, as claims
    # consume a lane in order) hides the rest from the tail probe: the full count finds them.
    small.set_queue_options(engine, Q, enqueue_shards=1)
    enqueue(small, engine, 20)
    assert small.rotate(engine).kind == "rotated"
    with engine.begin() as conn:
        conn.execute(text(
            f"INSERT INTO {qualified(small, 'ready_claim_ranges')} (ready_slot, ready_generation, queue, "
            "priority, enqueue_shard, first_seq, last_seq) "
            "SELECT ready_slot, ready_generation, queue, priority, enqueue_shard, min(lane_seq), max(lane_seq) "
            f"FROM (SELECT * FROM {qualified(small, 'ready_entries_0')} ORDER BY lane_seq DESC LIMIT :n) t "
            "GROUP BY ready_slot, ready_generation, queue, priority, enqueue_shard"), {"n": TAIL_PROBE})
    assert small.prune_oldest(engine) == PruneOutcome.skipped_active(
        0, SkipReason.QUEUE_PENDING_READY, 20 - TAIL_PROBE)
    assert rows_in(small, engine, "ready_entries_0") == 20


def row_probes_of_a_prune(st: QueueStorage, engine: Engine) -> tuple[PruneOutcome, list[str]]:
    """``prune_oldest`` and the statements it sent that probe the slot's rows one by one
    (the pending-rows counts, which look up each row's tombstone)."""
    seen: list[str] = []

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("SELECT count(*)") and "ready_tombstones_" in statement:
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", note)
    try:
        return st.prune_oldest(engine), seen
    finally:
        event.remove(engine, "before_cursor_execute", note)


def test_prune_of_a_slot_every_lane_cursor_has_passed_probes_no_row(small: QueueStorage, engine: Engine) -> None:
    enqueue(small, engine, 20)
    assert drain(small, engine) == 20  # its last, empty claim walks every lane's cursor past the slot
    assert small.rotate(engine).kind == "rotated"
    out, probes = row_probes_of_a_prune(small, engine)
    assert out == PruneOutcome.pruned(0)
    assert probes == []
    assert small.queue_counts(engine, Q).terminal == 20


def test_prune_of_a_slot_a_lane_cursor_has_not_passed_counts_its_rows_and_still_prunes(
        small: QueueStorage, engine: Engine) -> None:
    small.set_queue_options(engine, Q, enqueue_shards=1)
    enqueue(small, engine, 5)
    claimed = small.claim_runtime_batch(engine, Q, 5)  # no later claim walks the lane's cursor past them
    assert len(small.complete_runtime_batch(engine, claimed)) == 5
    assert small.rotate(engine).kind == "rotated"
    out, probes = row_probes_of_a_prune(small, engine)
    assert out == PruneOutcome.pruned(0)
    assert probes  # the cursor could not vouch for the rows: each was looked at


def test_prune_of_a_slot_with_a_row_beyond_its_lane_cursor_finds_it_pending(
        small: QueueStorage, engine: Engine) -> None:
    small.set_queue_options(engine, Q, enqueue_shards=1)
    enqueue(small, engine, 6)
    claimed = small.claim_runtime_batch(engine, Q, 5)
    assert len(small.complete_runtime_batch(engine, claimed)) == 5
    assert small.rotate(engine).kind == "rotated"
    out, probes = row_probes_of_a_prune(small, engine)
    assert out == PruneOutcome.skipped_active(0, SkipReason.QUEUE_PENDING_READY, 1)
    assert probes


def test_claim_slot_bytes_on_a_callers_connection_counts_its_own_uncommitted_claims(
        small: QueueStorage, engine: Engine) -> None:
    enqueue(small, engine, 3)
    with engine.connect() as conn, conn.begin():
        assert small.claim_slot_bytes(conn) == 0
        assert len(small.claim_runtime_batch(conn, Q, 3)) == 3
        assert small.claim_slot_bytes(conn) > 0  # sizes count written pages, committed or not
        conn.rollback()
    assert small.claim_slot_bytes(engine) > 0  # rolled-back writes still take their pages


def test_prune_skips_slot_with_unclaimed_ready_row(small: QueueStorage, engine: Engine) -> None:
    enqueue(small, engine, 3)
    assert small.rotate(engine).kind == "rotated"
    out = small.prune_oldest(engine)
    assert out == PruneOutcome.skipped_active(0, SkipReason.QUEUE_PENDING_READY, 3)
    assert rows_in(small, engine, "ready_entries_0") == 3
    # two of the three claimed and completed: still one pending
    claimed = small.claim_runtime_batch(engine, Q, 2)
    small.complete_runtime_batch(engine, claimed)
    assert small.prune_oldest(engine) == PruneOutcome.skipped_active(0, SkipReason.QUEUE_PENDING_READY, 1)
    assert drain(small, engine) == 1
    assert small.prune_oldest(engine) == PruneOutcome.pruned(0)
    assert small.queue_counts(engine, Q).terminal == 3


def test_prune_skips_slot_with_open_claim(small: QueueStorage, engine: Engine) -> None:
    enqueue(small, engine, 2)
    claimed = small.claim_runtime_batch(engine, Q, 2)
    assert len(claimed) == 2
    assert small.rotate(engine).kind == "rotated"
    assert small.prune_oldest(engine) == PruneOutcome.skipped_active(0, SkipReason.QUEUE_OPEN_CLAIMS, 2)
    small.complete_runtime_batch(engine, claimed[:1])
    assert small.prune_oldest(engine) == PruneOutcome.skipped_active(0, SkipReason.QUEUE_OPEN_CLAIMS, 1)
    assert rows_in(small, engine, "ready_entries_0") == 2
    small.complete_runtime_batch(engine, claimed[1:])
    assert small.prune_oldest(engine) == PruneOutcome.pruned(0)
    assert rows_in(small, engine, "ready_entries_0") == 0
    assert rows_in(small, engine, "done_entries_0") == 0
    assert ring_gens(small, engine)[0] == -1
    assert small.prune_oldest(engine) == PruneOutcome.noop()  # emptied: nothing until reused


def test_prune_skips_slot_with_active_lease(make_storage: Callable[..., QueueStorage], engine: Engine) -> None:
    st = make_storage(lease_claim_receipts=False, **SMALL)
    enqueue(st, engine)
    claimed = st.claim_runtime_batch(engine, Q, 1)
    assert len(claimed) == 1 and rows_in(st, engine, "leases") == 1
    assert st.rotate(engine).kind == "rotated"
    assert st.prune_oldest(engine) == PruneOutcome.skipped_active(0, SkipReason.QUEUE_ACTIVE_LEASES, 1)
    assert st.complete_runtime_batch(engine, claimed) == [(claimed[0].job.id, claimed[0].job.run_lease)]
    assert st.prune_oldest(engine) == PruneOutcome.pruned(0)


def test_slot_becomes_prunable_once_every_job_is_spent(small: QueueStorage, engine: Engine) -> None:
    """Jobs claimed from the slot and then retried, dead-lettered or cancelled leave
    neither a done row nor a tombstone of that attempt there; the slot must still prune."""
    enqueue(small, engine, 5)
    claimed = small.claim_runtime_batch(engine, Q, 3)
    assert len(claimed) == 3
    a, b, c = claimed
    assert small.complete_runtime_batch(engine, [a])
    assert small.retry_after(engine, b.job.id, b.job.run_lease, 3600) is not None
    assert small.fail_to_dlq(engine, c.job.id, c.job.run_lease, "test", "boom") is not None
    with engine.connect() as conn:
        r = small.tables.ready.parent
        unclaimed = sorted(conn.execute(select(r.c.job_id)).scalars())[3:]
    for job_id in unclaimed:
        assert small.cancel_job(engine, job_id) is not None
    assert small.rotate(engine).kind == "rotated"
    assert small.prune_oldest(engine) == PruneOutcome.pruned(0)
    counts = small.queue_counts(engine, Q)
    assert (counts.available, counts.running) == (0, 0)
    assert counts.terminal == 3  # one completed + two cancelled (retryable and DLQ are not terminal rows)


def test_rotate_and_prune_lock_step_around_the_ring(small: QueueStorage, engine: Engine) -> None:
    for round_ in range(10):
        enqueue(small, engine, 3)
        assert drain(small, engine) == 3
        out = small.rotate(engine)
        assert out.kind == "rotated", (round_, out)
        assert small.prune_oldest(engine).kind == "pruned"
        assert small.prune_oldest(engine) == PruneOutcome.noop()
    counts = small.queue_counts(engine, Q)
    assert counts.terminal == 30 and counts.available == 0 and counts.running == 0
    assert small.queue_counts_fast(engine, Q).terminal == 30  # all history folded into rollups


def test_prune_returns_blocked_while_a_child_is_locked(small: QueueStorage, engine: Engine) -> None:
    enqueue(small, engine, 2)
    assert drain(small, engine) == 2
    assert small.rotate(engine).kind == "rotated"
    holder = engine.connect()
    try:
        holder.execute(text(f"LOCK TABLE {qualified(small, 'ready_entries_0')} IN ACCESS SHARE MODE"))
        started = time.monotonic()
        out = small.prune_oldest(engine)
        assert out == PruneOutcome.blocked(0)
        assert time.monotonic() - started < 1.0
        # On a caller's transaction: Blocked, and the caller's transaction stays usable with
        # its own lock_timeout untouched.
        with engine.connect() as conn, conn.begin():
            conn.execute(text("SET LOCAL lock_timeout = '7s'"))
            assert small.prune_oldest(conn) == PruneOutcome.blocked(0)
            assert conn.execute(text("SHOW lock_timeout")).scalar_one() == "7s"
            assert conn.execute(select(func.count()).select_from(small.tables.ready.parent)).scalar_one() == 2
        # a plain reader transaction (no explicit lock) blocks it the same way
        holder.rollback()
        holder.execute(text(f"SELECT count(*) FROM {qualified(small, 'done_entries_0')}"))
        assert small.prune_oldest(engine) == PruneOutcome.blocked(0)
    finally:
        holder.rollback()
        holder.close()
    assert small.prune_oldest(engine) == PruneOutcome.pruned(0)
    enqueue(small, engine, 1)  # storage still works afterwards
    assert drain(small, engine) == 1
    assert small.queue_counts(engine, Q).terminal == 3


def test_blocked_prune_does_not_wait_for_long_holders(small: QueueStorage, engine: Engine) -> None:
    """Readers queued behind a Blocked prune are released within ~50 ms."""
    enqueue(small, engine)
    assert drain(small, engine) == 1
    assert small.rotate(engine).kind == "rotated"
    holder = engine.connect()
    holder.execute(text(f"LOCK TABLE {qualified(small, 'done_entries_0')} IN ACCESS SHARE MODE"))
    results: list[PruneOutcome] = []
    t = threading.Thread(target=lambda: results.append(small.prune_oldest(engine)))
    t.start()
    t.join(2.0)
    holder.rollback()
    holder.close()
    assert results == [PruneOutcome.blocked(0)]


def test_unique_key_released_when_history_is_pruned(small: QueueStorage, engine: Engine) -> None:
    """A completed job owns its key while its history is retained; prune frees it."""
    unique_job = [InsertParams("uniq", {"k": 1}, InsertOpts(queue=Q, unique=UniqueOpts()))]
    assert small.enqueue_params_batch(engine, unique_job) == 1
    assert drain(small, engine) == 1
    with pytest.raises(UniqueConflictError):
        small.enqueue_params_batch(engine, unique_job)
    assert small.rotate(engine).kind == "rotated"
    with pytest.raises(UniqueConflictError):  # sealed but retained: still owned
        small.enqueue_params_batch(engine, unique_job)
    assert small.prune_oldest(engine) == PruneOutcome.pruned(0)
    assert small.enqueue_params_batch(engine, unique_job) == 1
    with pytest.raises(UniqueConflictError):  # the new job owns it now
        small.enqueue_params_batch(engine, unique_job)


def test_unique_key_of_live_job_survives_prune_of_other_slot(small: QueueStorage, engine: Engine) -> None:
    unique_job = [InsertParams("uniq", {"k": 2}, InsertOpts(queue=Q, unique=UniqueOpts()))]
    enqueue(small, engine, 1)
    assert drain(small, engine) == 1
    assert small.rotate(engine).kind == "rotated"
    assert small.enqueue_params_batch(engine, unique_job) == 1  # lands in slot 1, stays available
    assert small.prune_oldest(engine) == PruneOutcome.pruned(0)
    with pytest.raises(UniqueConflictError):
        small.enqueue_params_batch(engine, unique_job)


def test_late_writer_into_retired_slot_keeps_ring_live(small: QueueStorage, engine: Engine) -> None:
    """A row written with a stale cursor into a retired slot is never truncated while
    live, and the ring recovers once it is spent."""
    for _ in range(3):  # current 3; slots 0..2 pruned and retired (generation -1)
        enqueue(small, engine)
        assert drain(small, engine) == 1
        assert small.rotate(engine).kind == "rotated"
        assert small.prune_oldest(engine).kind == "pruned"
    assert ring_gens(small, engine) == {0: -1, 1: -1, 2: -1, 3: 3}
    with engine.begin() as conn:  # a writer that read the cursor while slot 0 was current
        set_queue_generation(conn, small, 0)
        small.enqueue_params_batch(conn, jobs(1))
        set_queue_generation(conn, small, 3)
    assert rows_in(small, engine, "ready_entries_0") == 1
    enqueue(small, engine)  # make the current slot non-idle
    out = small.rotate(engine)
    assert out.kind == "skipped_busy" and out.slot == 0 and out.busy == BusyCounts(queue_ready=1)
    assert small.prune_oldest(engine) == PruneOutcome.skipped_active(0, SkipReason.QUEUE_PENDING_READY, 1)
    assert drain(small, engine) == 2
    assert small.prune_oldest(engine) == PruneOutcome.pruned(0)
    assert small.rotate(engine) == RotateOutcome.rotated(0, 4)
    counts = small.queue_counts(engine, Q)
    assert (counts.available, counts.running, counts.terminal) == (0, 0, 5)


# -- lease ring ------------------------------------------------------------------------------
def test_lease_ring_outcomes(make_storage: Callable[..., QueueStorage], engine: Engine) -> None:
    st = make_storage(lease_claim_receipts=False, **SMALL)
    assert st.rotate_leases(engine) == RotateOutcome.skipped_idle(0, 0)
    assert st.prune_oldest_leases(engine) == PruneOutcome.noop()
    enqueue(st, engine, 3)
    first = st.claim_runtime_batch(engine, Q, 1)
    assert first[0].claim.lease_slot == 0
    # only the current slot was ever written: it can be reclaimed only after a rotation
    assert st.prune_oldest_leases(engine) == PruneOutcome.skipped_active(0, SkipReason.LEASE_CURRENT, 0)
    assert st.rotate_leases(engine) == RotateOutcome.rotated(1, 1)
    assert st.prune_oldest_leases(engine) == PruneOutcome.skipped_active(0, SkipReason.LEASE_ACTIVE, 1)
    second = st.claim_runtime_batch(engine, Q, 1)
    assert second[0].claim.lease_slot == 1
    out = st.rotate_leases(engine)
    assert out.kind == "skipped_busy" and out.slot == 0 and out.busy == BusyCounts(leases=1)
    assert st.complete_runtime_batch(engine, first)
    assert rows_in(st, engine, "leases_0") == 0
    assert st.prune_oldest_leases(engine) == PruneOutcome.pruned(0)
    assert st.prune_oldest_leases(engine) == PruneOutcome.noop()  # already truncated
    assert st.rotate_leases(engine) == RotateOutcome.rotated(0, 2)
    assert st.prune_oldest_leases(engine) == PruneOutcome.skipped_active(1, SkipReason.LEASE_ACTIVE, 1)
    assert st.complete_runtime_batch(engine, second)
    assert st.prune_oldest_leases(engine) == PruneOutcome.pruned(1)
    assert st.rotate_leases(engine) == RotateOutcome.skipped_idle(0, 2)  # nothing written since
    third = st.claim_runtime_batch(engine, Q, 1)
    assert third[0].claim.lease_slot == 0 and st.complete_runtime_batch(engine, third)
    # slot 0 now holds only a deleted lease: still "written", so it rotates away and prunes
    assert st.rotate_leases(engine) == RotateOutcome.rotated(1, 3)
    assert st.prune_oldest_leases(engine) == PruneOutcome.pruned(0)
    assert st.queue_counts(engine, Q).terminal == 3


def test_lease_prune_blocked_by_lock(make_storage: Callable[..., QueueStorage], engine: Engine) -> None:
    st = make_storage(lease_claim_receipts=False, **SMALL)
    enqueue(st, engine)
    assert drain(st, engine) == 1
    assert st.rotate_leases(engine).kind == "rotated"
    with engine.connect() as holder:
        holder.execute(text(f"LOCK TABLE {qualified(st, 'leases_0')} IN ACCESS SHARE MODE"))
        assert st.prune_oldest_leases(engine) == PruneOutcome.blocked(0)
        holder.rollback()
    assert st.prune_oldest_leases(engine) == PruneOutcome.pruned(0)


def test_vacuum_leases_needs_an_engine(make_storage: Callable[..., QueueStorage], engine: Engine) -> None:
    st = make_storage(lease_claim_receipts=False, **SMALL)
    enqueue(st, engine, 2)
    assert drain(st, engine) == 2
    st.vacuum_leases(engine)
    with engine.connect() as conn, pytest.raises(ValidationError, match="VACUUM"):
        st.vacuum_leases(conn)


# -- claim ring ------------------------------------------------------------------------------
def test_claim_ring_outcomes(small: QueueStorage, engine: Engine) -> None:
    assert small.rotate_claims(engine) == RotateOutcome.skipped_idle(0, 0)
    assert small.prune_oldest_claims(engine) == PruneOutcome.noop()
    enqueue(small, engine, 3)
    first = small.claim_runtime_batch(engine, Q, 1)
    assert first[0].claim.claim_slot == 0
    assert small.prune_oldest_claims(engine) == PruneOutcome.skipped_active(0, SkipReason.CLAIM_CURRENT, 0)
    assert small.rotate_claims(engine) == RotateOutcome.rotated(1, 1)
    assert small.prune_oldest_claims(engine) == PruneOutcome.skipped_active(0, SkipReason.CLAIM_OPEN, 1)
    second = small.claim_runtime_batch(engine, Q, 2)
    assert {c.claim.claim_slot for c in second} == {1}
    out = small.rotate_claims(engine)
    assert out.kind == "skipped_busy" and out.slot == 0 and out.busy == BusyCounts(claims=1)
    assert small.complete_runtime_batch(engine, first)
    out = small.rotate_claims(engine)
    assert out.kind == "skipped_busy" and out.busy == BusyCounts(claims=1, closures=1)
    assert small.prune_oldest_claims(engine) == PruneOutcome.pruned(0)
    assert rows_in(small, engine, "lease_claims_0") == 0
    assert rows_in(small, engine, "lease_claim_closures_0") == rows_in(small, engine, "lease_claim_closure_batches_0") == 0
    assert small.prune_oldest_claims(engine) == PruneOutcome.noop()
    assert small.rotate_claims(engine) == RotateOutcome.rotated(0, 2)
    assert small.prune_oldest_claims(engine) == PruneOutcome.skipped_active(1, SkipReason.CLAIM_OPEN, 2)
    assert small.complete_runtime_batch(engine, second[:1])
    assert small.prune_oldest_claims(engine) == PruneOutcome.skipped_active(1, SkipReason.CLAIM_OPEN, 1)
    assert small.complete_runtime_batch(engine, second[1:])
    assert small.prune_oldest_claims(engine) == PruneOutcome.pruned(1)
    counts = small.queue_counts(engine, Q)
    assert (counts.available, counts.running, counts.terminal) == (0, 0, 3)


def test_claim_prune_blocked_by_lock(small: QueueStorage, engine: Engine) -> None:
    enqueue(small, engine)
    assert drain(small, engine) == 1
    assert small.rotate_claims(engine).kind == "rotated"
    with engine.connect() as holder:
        holder.execute(text(f"SELECT count(*) FROM {qualified(small, 'lease_claim_closures_0')}"))
        assert small.prune_oldest_claims(engine) == PruneOutcome.blocked(0)
        holder.rollback()
    assert small.prune_oldest_claims(engine) == PruneOutcome.pruned(0)


def test_completion_after_claim_prune_of_other_slot(small: QueueStorage, engine: Engine) -> None:
    """Pruning the claim ring never loses an open receipt: the claim prune refuses, and the
    queue ring refuses while the receipt is open."""
    enqueue(small, engine, 2)
    held = small.claim_runtime_batch(engine, Q, 1)
    assert small.rotate_claims(engine).kind == "rotated"
    assert small.rotate(engine).kind == "rotated"
    assert small.prune_oldest_claims(engine).kind == "skipped_active"
    assert small.prune_oldest(engine).reason in (SkipReason.QUEUE_OPEN_CLAIMS, SkipReason.QUEUE_PENDING_READY)
    assert drain(small, engine) == 1
    assert small.complete_runtime_batch(engine, held) == [(held[0].job.id, held[0].job.run_lease)]
    assert small.prune_oldest_claims(engine) == PruneOutcome.pruned(0)
    assert small.prune_oldest(engine) == PruneOutcome.pruned(0)
    assert small.queue_counts(engine, Q).terminal == 2


def relfilenodes(st: QueueStorage, engine: Engine, *names: str) -> dict[str, int]:
    with engine.connect() as conn:
        return {n: conn.execute(text("SELECT pg_relation_filenode(CAST(:t AS regclass))"),
                                {"t": f'"{st.schema()}"."{n}"'}).scalar_one() for n in names}


def test_prune_truncates_only_the_children_that_were_written(small: QueueStorage, engine: Engine) -> None:
    # a slot of finished jobs with no tombstone: the tombstone child keeps its files (a
    # TRUNCATE would rebuild them, index syncs and all, to reclaim nothing)
    enqueue(small, engine, 3)
    assert small.rotate(engine).kind == "rotated"
    assert drain(small, engine) == 3
    before = relfilenodes(small, engine, "ready_entries_0", "ready_tombstones_0")
    assert small.prune_oldest(engine) == PruneOutcome.pruned(0)
    after = relfilenodes(small, engine, "ready_entries_0", "ready_tombstones_0")
    assert after["ready_tombstones_0"] == before["ready_tombstones_0"]
    assert after["ready_entries_0"] != before["ready_entries_0"]
    assert rows_in(small, engine, "ready_entries_0") == 0
    assert small.prune_oldest(engine).kind == "noop"


def test_the_slots_pristine_state_is_read_in_one_statement_as_slot_by_slot(
        small: QueueStorage, engine: Engine) -> None:
    # slots 0 and 1 written, the rest never; after a drain and a prune, slot 0 pristine
    # again: the prune looks for the oldest written slot with this one read
    ring = small._ctx.schema.queue_ring
    enqueue(small, engine, 2)
    assert small.rotate(engine).kind == "rotated"
    enqueue(small, engine, 1)
    with engine.connect() as conn:
        got = pristine_slots(conn, ring)
        assert got == [pristine(conn, ring, k) for k in range(ring.slot_count)]
    assert got[:3] == [False, False, True] and all(got[2:])
    assert drain(small, engine) == 3
    assert small.prune_oldest(engine) == PruneOutcome.pruned(0)
    with engine.connect() as conn:
        got = pristine_slots(conn, ring)
        assert got == [pristine(conn, ring, k) for k in range(ring.slot_count)]
    assert got[:2] == [True, False]


# -- upkeep in a caller's transaction keeps the caller's lock_timeout --------------------------


def _pending_sealed_slot(engine: Engine, st: QueueStorage) -> dict:
    """Queue slot 0 sealed with an unclaimed job in it: a prune skips it."""
    enqueue(st, engine)
    assert st.rotate(engine).kind == "rotated"
    return {}


GUARDED = {
    "prune_oldest pruned": (prunable_queue_slot, lambda st, c: st.prune_oldest(c).kind, "pruned"),
    "prune_oldest skipped": (_pending_sealed_slot, lambda st, c: st.prune_oldest(c).kind, "skipped_active"),
    "prune_oldest_leases pruned": (prunable_lease_slot, lambda st, c: st.prune_oldest_leases(c).kind, "pruned"),
    "prune_oldest_claims pruned": (prunable_claim_slot, lambda st, c: st.prune_oldest_claims(c).kind, "pruned"),
    "rollup_terminal_count_deltas": (
        rollable_deltas, lambda st, c: st.rollup_terminal_count_deltas(c, 4, pinned_after=NOT_PINNED).rolled_slots, 1),
}


@pytest.mark.parametrize("setting", ["7s", "0"])
@pytest.mark.parametrize("case", sorted(GUARDED))
def test_upkeep_in_a_callers_transaction_leaves_its_lock_timeout_as_it_was(engine, st, case, setting):
    """Upkeep takes its exclusive locks under a 50 ms ``lock_timeout`` set inside a
    savepoint; a setting made there outlives the savepoint's release, so the caller's value
    is put back first."""
    setup, call, expected = GUARDED[case]
    setup(engine, st)
    with engine.connect() as conn, conn.begin():
        conn.execute(text(f"SET LOCAL lock_timeout = '{setting}'"))
        assert call(st, conn) == expected
        assert conn.execute(text("SHOW lock_timeout")).scalar() == setting
