"""A claim that meets maintenance (a prune holding a ring child ``ACCESS EXCLUSIVE``) returns
what it could claim — possibly nothing — and never raises; the caller's transaction stays
usable. Each test holds the lock a prune would take, on another connection."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from jobtools import forget_seen_slot, params
from sqlalchemy import Engine, text

from qstore import QueueStorage

SMALL = {"queue_slot_count": 4, "lease_slot_count": 2, "claim_slot_count": 2}


@pytest.fixture
def small(make_storage) -> QueueStorage:
    return make_storage(**SMALL)


@contextmanager
def pruning(engine: Engine, st: QueueStorage, *children: str) -> Iterator[None]:
    """Hold ``ACCESS EXCLUSIVE`` on ring children, as a queue-ring prune does."""
    with engine.connect() as holder:
        names = ", ".join(f'"{st.schema()}".{c}' for c in children)
        holder.execute(text(f"LOCK TABLE {names} IN ACCESS EXCLUSIVE MODE"))
        yield
        holder.rollback()


def test_aging_claim_returns_nothing_instead_of_raising_while_a_prune_holds_a_child(engine, small):
    small.enqueue_params_batch(engine, [params(args={"n": 1})])
    with pruning(engine, small, "ready_entries_3"):
        assert small.claim_runtime_batch_with_aging(engine, "q", 5, None, 60) == []
    assert len(small.claim_runtime_batch_with_aging(engine, "q", 5, None, 60)) == 1


def test_claim_whose_cursor_lookup_scans_the_ring_returns_nothing_while_a_child_is_held(engine, small):
    small.enqueue_params_batch(engine, [params(args={"n": 1})])
    assert small.rotate(engine).kind == "rotated"  # the job's row is no longer in the current slot
    with engine.connect() as conn:
        with pruning(engine, small, "ready_entries_2"):
            assert small.claim_runtime_batch(forget_seen_slot(conn, small), "q", 5) == []
        conn.commit()
    assert len(small.claim_runtime_batch(engine, "q", 5)) == 1


def test_a_claim_that_knows_the_backlogs_slot_claims_while_another_child_is_held(engine, small):
    small.enqueue_params_batch(engine, [params(args={"n": i}) for i in range(2)])  # one lane, slot 0
    assert small.rotate(engine).kind == "rotated"
    with engine.connect() as conn:
        assert len(small.claim_runtime_batch(forget_seen_slot(conn, small), "q", 1)) == 1  # found in slot 0
        conn.commit()
        with pruning(engine, small, "ready_entries_2"):  # the look at every child would wait for it
            assert [j.job.args for j in small.claim_runtime_batch(conn, "q", 1)] == [{"n": 1}]
        conn.commit()


def test_claim_of_a_segment_whose_tombstones_are_held_returns_nothing(engine, small):
    small.enqueue_params_batch(engine, [params(args={"n": 1})])
    with pruning(engine, small, "ready_tombstones_0"):
        assert small.claim_runtime_batch(engine, "q", 5) == []
    assert len(small.claim_runtime_batch(engine, "q", 5)) == 1


def test_claim_blocked_by_upkeep_leaves_the_callers_transaction_usable(engine, small):
    small.enqueue_params_batch(engine, [params(args={"n": 1})])
    assert small.rotate(engine).kind == "rotated"
    with engine.connect() as conn, conn.begin():
        with pruning(engine, small, "ready_entries_2"):
            assert small.claim_runtime_batch(forget_seen_slot(conn, small), "q", 5) == []
        assert conn.execute(text("SELECT 1")).scalar_one() == 1
        assert len(small.claim_runtime_batch(conn, "q", 5)) == 1


def test_claim_blocked_after_claiming_one_lane_returns_that_lanes_jobs(engine, small):
    small.enqueue_params_batch(engine, [params(args={"n": 1}, priority=1)])
    assert small.rotate(engine).kind == "rotated"
    small.enqueue_params_batch(engine, [params(args={"n": 2}, priority=2)])
    # the priority-1 lane's row sits in slot 0: its claim locks only children of slot 0;
    # the priority-2 lane's row is in the current slot 1, whose tombstone child is held
    with pruning(engine, small, "ready_tombstones_1"):
        got = small.claim_runtime_batch(engine, "q", 5)
    assert [j.job.args for j in got] == [{"n": 1}]
