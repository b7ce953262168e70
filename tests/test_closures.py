"""An attempt is closed at most once, by a narrow closure or as a member of a batch closure.

The completion fast path closes the attempts it completes with batch closures
(``lease_claim_closure_batches``: one row per call, claim slot and block of
``CLOSURE_BLOCK`` job ids that holds two or more of them) and a lone attempt of a block
with a narrow ``lease_claim_closures`` row; every other way of ending an attempt writes a
narrow row. A batch member has no key of its own, so exactly-once rests on the closers'
protocol: each locks the receipt, then checks both forms in a later statement. Checked
here: the two forms never name one attempt twice when closers race for one attempt in each
order (``tests/test_done_rows.py`` checks it after every operation of the API); every reader of open receipts (counts,
``load_job``, rescue, the prune gates) sees a batch member as closed and its neighbours in
the block as open; the lookup goes by the block index.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from jobtools import (
    CLOSED,
    add,
    assert_closures_sound,
    batch_rows,
    claim,
    closures,
    count,
    race,
    relation,
    running,
    state,
)
from sqlalchemy import Engine, literal, select, text

from qstore import IsolationLevelError, PruneOutcome, QueueStorage, RotateOutcome, SkipReason
from qstore.config import CLOSURE_BLOCK
from qstore.schema import storage_schema
from qstore.storage.statements import receipt_open
from qstore.types import ClaimedRuntimeJob, JobState

#: a staleness every attempt claimed before the rescue exceeds (claims take longer than this)
STALE = 0.001


def forms(engine: Engine, s: QueueStorage) -> dict[int, str]:
    return {r.job_id: r.form for r in closures(engine, s)}


def claimed(engine: Engine, s: QueueStorage, n: int) -> list[ClaimedRuntimeJob]:
    """``n`` new jobs claimed in one batch (consecutive job ids)."""
    for _ in range(n):
        add(engine, s)
    got = s.claim_runtime_batch(engine, "q", n)
    assert len(got) == n
    return got


def pairs(jobs: list[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
    return [(c.job.id, c.job.run_lease) for c in jobs]


# -- what the fast path writes -------------------------------------------------------------


def test_a_fast_completion_writes_a_batch_closure_per_block_holding_two_or_more(engine, st):
    jobs = claimed(engine, st, 3)
    assert st.complete_runtime_batch(engine, jobs) == pairs(jobs)
    [row] = batch_rows(engine, st)
    assert (row.job_ids, row.run_leases) == (sorted(c.job.id for c in jobs), [1, 1, 1])
    assert row.job_block == jobs[0].job.id // CLOSURE_BLOCK
    assert count(engine, st, "lease_claim_closures") == 0
    assert_closures_sound(engine, st)


def test_a_lone_attempt_of_its_block_gets_a_narrow_closure(engine, st):
    (c,) = claimed(engine, st, 1)
    assert st.complete_runtime_batch(engine, [c]) == pairs([c])
    assert forms(engine, st) == {c.job.id: "narrow"}
    assert batch_rows(engine, st) == []


def test_attempts_in_two_blocks_of_job_ids_make_a_row_per_block(engine, st):
    """Job ids 1..CLOSURE_BLOCK+1 completed in one call: a row for the first block's
    CLOSURE_BLOCK - 1 members (ids start at 1) and a row for the next block's two."""
    jobs = claimed(engine, st, CLOSURE_BLOCK + 1)
    assert sorted(st.complete_runtime_batch(engine, jobs)) == sorted(pairs(jobs))
    rows = batch_rows(engine, st)
    assert [(r.job_block, len(r.job_ids)) for r in rows] == [(0, CLOSURE_BLOCK - 1), (1, 2)]
    assert count(engine, st, "lease_claim_closures") == 0
    assert st.queue_counts(engine, "q").running == 0
    assert_closures_sound(engine, st)


def test_completing_the_same_attempts_again_closes_nothing(engine, st):
    jobs = claimed(engine, st, 4)
    assert st.complete_runtime_batch(engine, jobs) == pairs(jobs)
    before = batch_rows(engine, st)
    assert st.complete_runtime_batch(engine, jobs) == []
    assert st.complete_job_batch_by_id(engine, pairs(jobs)) == []
    assert batch_rows(engine, st) == before
    assert count(engine, st, CLOSED) == 4


# -- readers of open receipts --------------------------------------------------------------


def test_a_receipt_beside_batch_members_in_its_block_stays_open(engine, st):
    a, b, c = claimed(engine, st, 3)
    assert st.complete_runtime_batch(engine, [a, c]) == pairs([a, c])
    assert [r.job_ids for r in batch_rows(engine, st)] == [sorted([a.job.id, c.job.id])]
    assert st.queue_counts(engine, "q").running == 1
    assert [state(engine, st, x.job.id) for x in (a, b, c)] == [JobState.COMPLETED, JobState.RUNNING,
                                                                 JobState.COMPLETED]
    assert [r.id for r in st.rescue_stale_heartbeats(engine, STALE)] == [b.job.id]
    assert state(engine, st, b.job.id) == JobState.RETRYABLE
    assert_closures_sound(engine, st)


def test_a_member_closes_its_own_run_lease_only(engine, st):
    """A member names an attempt by job id and run lease: the job's next attempt, claimed
    in the same claim slot, is open although its job id is in a batch row."""
    a, _ = claimed(engine, st, 2)
    assert st.retry_after(engine, a.job.id, a.job.run_lease, 0) is not None
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 1
    again = claim(engine, st)
    assert (again.job.id, again.job.run_lease, again.claim.claim_slot) == (a.job.id, 2, a.claim.claim_slot)
    sch = storage_schema(st.config)
    c = sch.claims.parent
    is_open = receipt_open(sch, c)
    with engine.connect() as conn:
        # no path writes this row (attempt 1 already has its narrow closure): it stands for
        # a batch row that names the job's other attempt
        conn.execute(text(f'INSERT INTO "{st.schema()}".lease_claim_closure_batches '
                          "(claim_slot, job_block, job_ids, run_leases) VALUES (:s, :b, :j, :r)"),
                     {"s": a.claim.claim_slot, "b": a.job.id // CLOSURE_BLOCK, "j": [a.job.id, 0], "r": [1, 1]})
        opened = conn.execute(select(c.c.run_lease).where(c.c.job_id == a.job.id, is_open)).scalars().all()
        conn.rollback()
    assert opened == [2]


def test_the_claim_slot_stays_busy_until_its_last_receipt_closes(engine, small):
    a, b, c = claimed(engine, small, 3)
    assert small.complete_runtime_batch(engine, [a, c]) == pairs([a, c])
    assert forms(engine, small) == {a.job.id: "batch", c.job.id: "batch"}
    assert small.rotate_claims(engine) == RotateOutcome.rotated(1, 1)
    assert small.prune_oldest_claims(engine) == PruneOutcome.skipped_active(0, SkipReason.CLAIM_OPEN, 1)
    assert small.complete_runtime_batch(engine, [b]) == pairs([b])
    assert small.prune_oldest_claims(engine) == PruneOutcome.pruned(0)
    assert count(engine, small, CLOSED) == 0
    assert small.queue_counts(engine, "q").terminal == 3


@pytest.fixture
def small(make_storage: Callable[..., QueueStorage]) -> QueueStorage:
    return make_storage(claim_slot_count=2)


# -- closers racing for one attempt --------------------------------------------------------


def _cancel(s: QueueStorage, conn: Any, c: ClaimedRuntimeJob) -> bool:
    return s.cancel_job(conn, c.job.id) is not None


def _retry(s: QueueStorage, conn: Any, c: ClaimedRuntimeJob) -> bool:
    return s.retry_after(conn, c.job.id, c.job.run_lease, 60) is not None


def _rescue(s: QueueStorage, conn: Any, c: ClaimedRuntimeJob) -> bool:
    return [r.id for r in s.rescue_stale_heartbeats(conn, STALE)] == [c.job.id]


#: the general path's closers, and the state each leaves its job in
GENERAL = {"cancel": (_cancel, JobState.CANCELLED), "retry_after": (_retry, JobState.RETRYABLE),
           "stale rescue": (_rescue, JobState.RETRYABLE)}


@pytest.mark.parametrize("closer", sorted(GENERAL))
def test_a_fast_completion_waiting_for_a_general_closer_leaves_its_attempt_alone(engine, st, closer):
    close, final = GENERAL[closer]
    jobs = claimed(engine, st, 3)
    target = jobs[1]
    if closer == "stale rescue":  # only the target is stale: the others heartbeat now
        assert st.heartbeat_batch(engine, pairs([jobs[0], jobs[2]])) == 2
        with engine.begin() as conn:
            conn.execute(text(f'UPDATE "{st.schema()}".attempt_progress SET heartbeat_at = now() + interval \'1 hour\''))
    completed = race(engine, lambda conn: close(st, conn, target) or pytest.fail("the closer took nothing"),
                     lambda: st.complete_runtime_batch(engine, jobs))
    assert completed == pairs([jobs[0], jobs[2]])
    assert state(engine, st, target.job.id) == final
    assert forms(engine, st) == {jobs[0].job.id: "batch", target.job.id: "narrow", jobs[2].job.id: "batch"}
    assert_closures_sound(engine, st)


@pytest.mark.parametrize("closer", ["cancel", "retry_after"])
def test_a_general_closer_waiting_for_a_fast_completion_takes_nothing(engine, st, closer):
    close, _ = GENERAL[closer]
    jobs = claimed(engine, st, 2)
    took = race(engine, lambda conn: st.complete_runtime_batch(conn, jobs),
                lambda: close(st, engine, jobs[0]))
    assert took is False
    assert [state(engine, st, c.job.id) for c in jobs] == [JobState.COMPLETED] * 2
    assert forms(engine, st) == {c.job.id: "batch" for c in jobs}
    assert st.queue_counts(engine, "q").terminal == 2
    assert_closures_sound(engine, st)


def test_a_rescue_beside_an_uncommitted_fast_completion_skips_its_attempts_and_then_finds_them_closed(engine, st):
    """Rescue selects open receipts with SKIP LOCKED: it passes over attempts a completion
    holds, and once that commits the attempts read as closed."""
    jobs = claimed(engine, st, 2)
    with engine.connect() as holder:
        holder.begin()
        assert st.complete_runtime_batch(holder, jobs) == pairs(jobs)
        assert st.rescue_stale_heartbeats(engine, STALE) == []
        holder.commit()
    assert st.rescue_stale_heartbeats(engine, STALE) == []
    assert [state(engine, st, c.job.id) for c in jobs] == [JobState.COMPLETED] * 2


def test_two_fast_completions_of_the_same_attempts_close_them_once(engine, st):
    jobs = claimed(engine, st, 3)
    again = race(engine, lambda conn: st.complete_runtime_batch(conn, jobs),
                 lambda: st.complete_runtime_batch(engine, jobs))
    assert again == []
    assert len(batch_rows(engine, st)) == 1
    assert st.queue_counts(engine, "q").terminal == 3
    assert_closures_sound(engine, st)


def test_many_threads_completing_overlapping_batches_close_each_attempt_once(engine, st):
    jobs = claimed(engine, st, 40)
    results: list[list[tuple[int, int]]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def complete(part: list[ClaimedRuntimeJob]) -> None:
        try:
            barrier.wait()
            results.append(st.complete_runtime_batch(engine, part))
        except BaseException as err:  # a deadlock or a key violation would land here
            errors.append(err)

    parts = [jobs[i::3] + jobs[:10] for i in range(3)] + [jobs[::-1], jobs[5:25], jobs[20:]]
    threads = [threading.Thread(target=complete, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and not any(t.is_alive() for t in threads), errors
    assert len(results) == len(parts)
    done = [p for r in results for p in r]
    assert sorted(done) == sorted(pairs(jobs))
    assert st.queue_counts(engine, "q").terminal == 40
    assert_closures_sound(engine, st)


# -- the lookup's plan ---------------------------------------------------------------------


def test_the_batch_closure_lookup_of_a_receipt_probes_the_block_index(engine, st):
    jobs = claimed(engine, st, 200)
    assert len(st.complete_runtime_batch(engine, jobs[:-1])) == 199
    sch = storage_schema(st.config)
    c = sch.claims.parent
    stmt = select(literal(1)).select_from(c).where(
        c.c.job_id == jobs[-1].job.id, receipt_open(sch, c))
    with engine.connect() as conn:
        for off in ("seqscan", "bitmapscan"):
            conn.execute(text(f"SET enable_{off} = off"))
        compiled = stmt.compile(conn, compile_kwargs={"literal_binds": True})
        plan = conn.execute(text(f"EXPLAIN (FORMAT JSON) {compiled}")).scalar_one()
    scanned: dict[str, tuple[str, str]] = {}

    def walk(node: dict[str, Any]) -> None:
        if "Relation Name" in node:
            scanned[node["Relation Name"]] = (node["Node Type"], node.get("Index Cond", ""))
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    batches = {name: x for name, x in scanned.items() if name.startswith("lease_claim_closure_batches")}
    assert batches and all(t in ("Index Scan", "Index Only Scan") for t, _ in batches.values()), scanned
    assert all("job_block" in cond for _, cond in batches.values()), scanned


def test_a_heartbeat_of_a_batch_member_counts_nothing(engine, st):
    jobs = claimed(engine, st, 2)
    assert st.complete_runtime_batch(engine, jobs) == pairs(jobs)
    assert st.heartbeat_batch(engine, pairs(jobs)) == 0
    assert count(engine, st, "attempt_progress") == 0


def test_an_open_receipt_is_still_rescued_by_deadline_beside_batch_members(engine, st):
    a = running(engine, st, deadline=600)
    b = running(engine, st, deadline=600)
    c = running(engine, st, deadline=600)
    assert st.complete_runtime_batch(engine, [a, c]) == pairs([a, c])
    with engine.begin() as conn:
        conn.execute(text(f'UPDATE {relation(st.schema(), "lease_claims")} SET deadline_at = now() - interval \'1 hour\''))
    assert [r.id for r in st.rescue_expired_deadlines(engine)] == [b.job.id]
    assert_closures_sound(engine, st)


# -- only in READ COMMITTED ----------------------------------------------------------------


def in_repeatable_read(engine: Engine, act: Callable[[Any], Any]) -> IsolationLevelError:
    """What ``act`` raises on a REPEATABLE READ transaction of a caller (rolled back)."""
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            with pytest.raises(IsolationLevelError) as raised:
                act(conn)
            conn.rollback()
    return raised.value


#: every way of ending an attempt or handing it to a callback, on a caller's connection
REFUSED: dict[str, Callable[[QueueStorage, Any, ClaimedRuntimeJob], Any]] = {
    "fast completion": lambda s, conn, c: s.complete_runtime_batch(conn, [c]),
    "cancel": lambda s, conn, c: s.cancel_job(conn, c.job.id),
    "retry_after": lambda s, conn, c: s.retry_after(conn, c.job.id, c.job.run_lease, 60),
    "fail": lambda s, conn, c: s.fail_terminal(conn, c.job.id, c.job.run_lease, "boom"),
    "register_callback": lambda s, conn, c: s.register_callback(conn, c.job.id, c.job.run_lease, 60),
}


@pytest.mark.parametrize("way", sorted(REFUSED))
def test_ending_an_attempt_outside_read_committed_is_refused_and_writes_nothing(engine, st, way):
    (c,) = claimed(engine, st, 1)
    err = in_repeatable_read(engine, lambda conn: REFUSED[way](st, conn, c))
    assert err.isolation == "repeatable read" and "READ COMMITTED" in str(err)
    assert state(engine, st, c.job.id) == JobState.RUNNING
    assert closures(engine, st) == [] and count(engine, st, "leases") == 0
    assert st.complete_runtime_batch(engine, [c]) == pairs([c])


def test_an_engine_whose_default_is_repeatable_read_still_ends_attempts(engine, st):
    """qstore's own transactions on an Engine are READ COMMITTED whatever the engine's
    default isolation."""
    rr = engine.execution_options(isolation_level="REPEATABLE READ")
    a, b = claimed(engine, st, 2)
    assert st.cancel_job(rr, a.job.id) is not None
    assert st.retry_after(rr, b.job.id, b.job.run_lease, 60) is not None
    assert [state(engine, st, c.job.id) for c in (a, b)] == [JobState.CANCELLED, JobState.RETRYABLE]
    assert_closures_sound(engine, st)


def test_closers_over_two_claim_slots_lock_in_one_order(engine, make_storage):
    """Attempt x (lower job id) in claim slot 1, y in slot 0: a fast completion locks slot
    by slot (y, then x), and a heartbeat of both, which waits for y, holds nothing
    meanwhile, so the completion's later lock on x does not deadlock with it."""
    s = make_storage(claim_slot_count=2)
    (z,) = claimed(engine, s, 1)
    assert s.complete_runtime_batch(engine, [z]) == pairs([z])
    assert s.rotate_claims(engine) == RotateOutcome.rotated(1, 1)
    assert s.prune_oldest_claims(engine) == PruneOutcome.pruned(0)
    (x,) = claimed(engine, s, 1)
    assert s.rotate_claims(engine).kind == "rotated"
    (y,) = claimed(engine, s, 1)
    assert (x.claim.claim_slot, y.claim.claim_slot) == (1, 0) and x.job.id < y.job.id
    def complete_y(holder: Any) -> None:
        assert s.complete_runtime_batch(holder, [y]) == pairs([y])

    def then_x(holder: Any) -> None:  # would deadlock if the heartbeat held x
        assert s.complete_runtime_batch(holder, [x]) == pairs([x])

    beats = race(engine, complete_y, lambda: s.heartbeat_batch(engine, pairs([x, y])), meanwhile=then_x)
    assert beats == 0
    assert_closures_sound(engine, s)
