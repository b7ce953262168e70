"""Regressions for faults that once slipped past every other test: each test below pins one
behaviour whose breakage went unnoticed, on a real server and through the public API (raw
SQL only observes state, holds a lock or plays the racing writer).

* fast completion leaves a resumed callback attempt to the general path;
* claim-ring prune keeps a materialised open claim;
* queue-, claim- and lease-ring prune re-check their gates once the exclusive lock is
  granted, so a writer that committed while prune waited keeps its row;
* without receipts, aged claims complete, stale cancels leave the live lease alone and a
  heartbeat row in ``attempt_progress`` protects the lease from stale rescue;
* prune releases a unique key only for the job that still owns it;
* queue-ring prune sees a claim that commits between two of its gate statements;
* with an ``Engine`` every stripe's claim commits on its own, and promotion's pause gate
  reads a stripe's logical queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from jobtools import BACKLOG, LIVE_KEYS, relation
from sqlalchemy import Connection, Engine, create_engine, event, text

from qstore import InsertOpts, InsertParams, QueueStorage, UniqueConflictError, UniqueOpts
from qstore.storage import targets as upkeep
from qstore.types import ClaimedRuntimeJob, JobState, PruneOutcome, SkipReason

MakeStorage = Callable[..., QueueStorage]
UTC = timezone.utc
SMALL = {"queue_slot_count": 4, "lease_slot_count": 2, "claim_slot_count": 2}
#: Prune's exclusive-lock timeout in the tests where prune must outwait a writer.
PATIENT_LOCK_TIMEOUT = "10s"
BIT = {s: 1 << s.bit for s in JobState}


# -- helpers ----------------------------------------------------------------------------------


def job(args: object = None, queue: str = "q", **opts: Any) -> InsertParams:
    return InsertParams("k", {"n": 1} if args is None else args, InsertOpts(queue=queue, **opts))


def claim_one(st: QueueStorage, target: Engine | Connection, queue: str = "q",
              deadline: float | None = None) -> ClaimedRuntimeJob:
    got = st.claim_runtime_batch(target, queue, 1, deadline)
    assert len(got) == 1, got
    return got[0]


def rows(engine: Engine, st: QueueStorage, table: str, where: str = "true", **params: Any) -> int:
    with engine.connect() as c:
        return int(c.execute(text(f'SELECT count(*) FROM {relation(st.schema(), table)} WHERE {where}'),
                             params).scalar_one())


def state(engine: Engine, st: QueueStorage, job_id: int) -> JobState:
    row = st.load_job(engine, job_id)
    assert row is not None
    return row.state


@contextmanager
def held(engine: Engine) -> Iterator[Connection]:
    """A connection in an open transaction, rolled back and closed on exit unless the body
    committed it: the writer (or lock holder) that races the code under test."""
    conn = engine.connect()
    conn.begin()
    try:
        yield conn
    finally:
        if conn.in_transaction():
            conn.rollback()
        conn.close()


def await_exclusive_lock_wait(engine: Engine, st: QueueStorage, pending: Future[Any]) -> None:
    """Return once some session waits for an ACCESS EXCLUSIVE lock on a relation of ``st``
    (the prune running as ``pending``); fail if ``pending`` ends first or nothing waits
    within 5 s."""
    deadline = time.monotonic() + 5
    while True:
        with engine.connect() as c:
            waiting = c.execute(text(
                "SELECT count(*) FROM pg_locks l JOIN pg_class r ON r.oid = l.relation "
                "JOIN pg_namespace n ON n.oid = r.relnamespace "
                "WHERE n.nspname = :s AND NOT l.granted AND l.mode = 'AccessExclusiveLock'"),
                {"s": st.schema()}).scalar_one()
        if waiting:
            return
        assert not pending.done(), f"prune ended without waiting for the writer: {pending.result()}"
        assert time.monotonic() < deadline, "prune never waited for the exclusive lock"
        time.sleep(0.005)


def prune_racing_a_writer(engine: Engine, st: QueueStorage, writer: Connection,
                          prune: Callable[[Engine], PruneOutcome]) -> PruneOutcome:
    """Run ``prune`` while ``writer`` holds its open transaction; commit the writer once
    prune waits for its exclusive lock; return what prune reported."""
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(prune, engine)
        try:
            await_exclusive_lock_wait(engine, st, pending)
        finally:
            writer.commit()
        return pending.result(timeout=10)


@pytest.fixture
def patient_prune(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prune's ``lock_timeout`` (a module constant: neither the config nor a session setting
    reaches it) raised, so a prune outwaits the writer instead of reporting ``blocked``."""
    monkeypatch.setattr(upkeep, "LOCK_TIMEOUT", PATIENT_LOCK_TIMEOUT)


# -- fast completion and callbacks ------------------------------------------------------------


def test_fast_completion_of_a_resumed_callback_attempt_ends_its_lease_and_state(
        engine: Engine, make_storage: MakeStorage) -> None:
    st = make_storage()
    st.enqueue_params_batch(engine, [job()])
    c = claim_one(st, engine, deadline=0.05)
    token = st.register_callback(engine, c.job.id, c.job.run_lease, 60)  # materialises the receipt
    assert st.complete_external(engine, token, {"answer": 42}, resume=True).state == JobState.RUNNING

    assert st.complete_runtime_batch(engine, [c]) == [(c.job.id, c.job.run_lease)]

    assert rows(engine, st, "leases", "job_id = :j", j=c.job.id) == 0
    assert rows(engine, st, "attempt_state", "job_id = :j", j=c.job.id) == 0
    time.sleep(0.06)  # past the claim's deadline, and the resume's heartbeat is stale
    assert st.rescue_stale_heartbeats(engine, 0.01) == []
    assert st.rescue_expired_deadlines(engine) == []
    assert state(engine, st, c.job.id) == JobState.COMPLETED
    assert rows(engine, st, "done_entries", "job_id = :j", j=c.job.id) == 1
    assert rows(engine, st, BACKLOG) == 0


# -- claim-ring prune and materialised claims -------------------------------------------------


@pytest.mark.parametrize("materialise", ["heartbeat", "callback"])
def test_claim_ring_prune_skips_a_slot_holding_an_open_heartbeated_or_materialised_claim(
        engine: Engine, make_storage: MakeStorage, materialise: str) -> None:
    st = make_storage(**SMALL)
    st.enqueue_params_batch(engine, [job()])
    c = claim_one(st, engine)
    assert c.claim.claim_slot == 0
    if materialise == "heartbeat":
        assert st.heartbeat_batch(engine, [(c.job.id, c.job.run_lease)]) == 1
    else:
        st.register_callback(engine, c.job.id, c.job.run_lease, 60)
    # a heartbeat appends a progress row and leaves the receipt as it is; a callback materialises it
    assert rows(engine, st, "lease_claims", "materialized_at IS NOT NULL") == (materialise == "callback")
    assert st.rotate_claims(engine).kind == "rotated"  # claim slot 0 is sealed

    assert st.prune_oldest_claims(engine) == PruneOutcome.skipped_active(0, SkipReason.CLAIM_OPEN, 1)

    assert rows(engine, st, "lease_claims", "job_id = :j", j=c.job.id) == 1
    assert st.complete_runtime_batch(engine, [c]) == [(c.job.id, c.job.run_lease)]
    assert state(engine, st, c.job.id) == JobState.COMPLETED


# -- prune re-checks its gates under the exclusive lock ----------------------------------------


@pytest.mark.usefixtures("patient_prune")
def test_queue_ring_prune_keeps_a_ready_row_committed_while_it_waited_for_the_lock(
        engine: Engine, make_storage: MakeStorage) -> None:
    st = make_storage(**SMALL)
    st.enqueue_params_batch(engine, [job({"who": "spent"})])
    done = st.complete_runtime_batch(engine, [claim_one(st, engine)])
    assert len(done) == 1  # slot 0 now holds only spent history: prunable
    with held(engine) as writer:
        # the writer read the ring cursor (slot 0) before the rotation below
        assert st.enqueue_params_batch(writer, [job({"who": "late"})]) == 1
        assert st.rotate(engine).kind == "rotated"

        out = prune_racing_a_writer(engine, st, writer, st.prune_oldest)

    assert out == PruneOutcome.skipped_active(0, SkipReason.QUEUE_PENDING_READY, 1)
    assert rows(engine, st, "ready_entries_0", "args = '{\"who\": \"late\"}'") == 1
    late = claim_one(st, engine)
    assert late.job.args == {"who": "late"}
    assert st.complete_runtime_batch(engine, [late]) == [(late.job.id, late.job.run_lease)]


@pytest.mark.usefixtures("patient_prune")
def test_claim_ring_prune_keeps_a_claim_committed_while_it_waited_for_the_lock(
        engine: Engine, make_storage: MakeStorage) -> None:
    st = make_storage(**SMALL)
    st.enqueue_params_batch(engine, [job({"i": 1}), job({"i": 2})])
    assert len(st.complete_runtime_batch(engine, [claim_one(st, engine)])) == 1
    with held(engine) as writer:
        late = claim_one(st, writer)  # a receipt in claim slot 0, not yet committed
        assert late.claim.claim_slot == 0
        assert st.rotate_claims(engine).kind == "rotated"

        out = prune_racing_a_writer(engine, st, writer, st.prune_oldest_claims)

    assert out == PruneOutcome.skipped_active(0, SkipReason.CLAIM_OPEN, 1)
    assert rows(engine, st, "lease_claims_0", "job_id = :j", j=late.job.id) == 1
    assert st.complete_runtime_batch(engine, [late]) == [(late.job.id, late.job.run_lease)]


@pytest.mark.usefixtures("patient_prune")
def test_lease_ring_prune_keeps_a_lease_committed_while_it_waited_for_the_lock(
        engine: Engine, make_storage: MakeStorage) -> None:
    st = make_storage(lease_claim_receipts=False, **SMALL)
    st.enqueue_params_batch(engine, [job({"i": 1}), job({"i": 2})])
    assert len(st.complete_runtime_batch(engine, [claim_one(st, engine)])) == 1
    with held(engine) as writer:
        late = claim_one(st, writer)  # a lease in lease slot 0, not yet committed
        assert late.claim.lease_slot == 0
        assert st.rotate_leases(engine).kind == "rotated"

        out = prune_racing_a_writer(engine, st, writer, st.prune_oldest_leases)

    assert out == PruneOutcome.skipped_active(0, SkipReason.LEASE_ACTIVE, 1)
    assert rows(engine, st, "leases_0", "job_id = :j", j=late.job.id) == 1
    assert st.complete_runtime_batch(engine, [late]) == [(late.job.id, late.job.run_lease)]


# -- installs without receipts -------------------------------------------------------------------


def test_aged_claim_without_receipts_keeps_the_lane_priority_and_completes(
        engine: Engine, make_storage: MakeStorage) -> None:
    st = make_storage(lease_claim_receipts=False)
    st.enqueue_params_batch(engine, [job({"who": "old"}, priority=4)])
    time.sleep(0.05)  # five aging intervals: the job ages from priority 4 to 1
    (c,) = st.claim_runtime_batch_with_aging(engine, "q", 1, None, 0.01)
    assert (c.job.priority, c.claim.priority) == (1, 4)  # effective, lane
    assert rows(engine, st, "leases", "priority = 4 AND effective_priority = 1") == 1

    assert st.complete_runtime_batch(engine, [c]) == [(c.job.id, c.job.run_lease)]

    row = st.load_job(engine, c.job.id)
    assert row is not None
    assert (row.state, row.priority, row.args) == (JobState.COMPLETED, 4, {"who": "old"})
    assert rows(engine, st, "leases") == 0


def test_stale_cancel_without_receipts_leaves_the_live_lease(
        engine: Engine, make_storage: MakeStorage) -> None:
    st = make_storage(lease_claim_receipts=False)
    st.enqueue_params_batch(engine, [job()])
    old = claim_one(st, engine)
    assert st.retry_after(engine, old.job.id, old.job.run_lease, 0) is not None
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 1
    live = claim_one(st, engine)
    assert (live.job.id, live.job.run_lease) == (old.job.id, old.job.run_lease + 1)

    assert st.cancel_running(engine, old.job.id, old.job.run_lease, "late") is None

    assert rows(engine, st, "leases", "job_id = :j AND run_lease = :r AND state = 'running'",
                j=live.job.id, r=live.job.run_lease) == 1
    assert state(engine, st, live.job.id) == JobState.RUNNING
    assert st.complete_runtime_batch(engine, [live]) == [(live.job.id, live.job.run_lease)]


def test_heartbeat_row_protects_a_lease_from_stale_rescue(
        engine: Engine, make_storage: MakeStorage) -> None:
    st = make_storage(lease_claim_receipts=False)
    st.enqueue_params_batch(engine, [job()])
    c = claim_one(st, engine)
    time.sleep(1.1)  # the lease's own heartbeat (its claim) is now stale for 1 s ...
    assert st.heartbeat_batch(engine, [(c.job.id, c.job.run_lease)]) == 1  # ... this one is fresh
    assert rows(engine, st, "attempt_progress", "job_id = :j AND heartbeat_at IS NOT NULL", j=c.job.id) == 1

    # (a second of staleness: the fresh heartbeat stays fresh through a stall of the host)
    assert st.rescue_stale_heartbeats(engine, 1.0) == []

    assert state(engine, st, c.job.id) == JobState.RUNNING
    assert st.complete_runtime_batch(engine, [c]) == [(c.job.id, c.job.run_lease)]


# -- unique keys and prune ------------------------------------------------------------------------


def test_prune_releases_a_unique_key_only_for_the_job_that_owns_it(
        engine: Engine, make_storage: MakeStorage) -> None:
    st = make_storage(**SMALL)
    # the key is held while the job waits or runs, and given up once it completed
    released_on_completion = UniqueOpts(states=BIT[JobState.SCHEDULED] | BIT[JobState.AVAILABLE]
                                        | BIT[JobState.RUNNING] | BIT[JobState.RETRYABLE])
    keyed = [job({"key": "K"}, unique=released_on_completion)]
    st.enqueue_params_batch(engine, keyed)
    a = claim_one(st, engine)
    assert st.complete_runtime_batch(engine, [a]) == [(a.job.id, a.job.run_lease)]
    assert rows(engine, st, LIVE_KEYS) == 0  # A gave the key up
    assert st.rotate(engine).kind == "rotated"  # A's history stays behind in slot 0
    st.enqueue_params_batch(engine, keyed)  # B takes the key, in slot 1
    with engine.connect() as conn:
        b = conn.execute(text(f'SELECT job_id FROM "{st.schema()}".ready_entries_1')).scalar_one()
    assert rows(engine, st, LIVE_KEYS, "job_id = :b", b=b) == 1

    assert st.prune_oldest(engine) == PruneOutcome.pruned(0)

    assert rows(engine, st, LIVE_KEYS, "job_id = :b", b=b) == 1
    with pytest.raises(UniqueConflictError):
        st.enqueue_params_batch(engine, keyed)
    assert state(engine, st, b) == JobState.AVAILABLE


# -- striped queues ---------------------------------------------------------------------------------


def test_each_stripe_of_an_engine_claim_commits_on_its_own(
        engine: Engine, make_storage: MakeStorage) -> None:
    st = make_storage(queue_stripe_count=2, queue_slot_count=4)
    st.enqueue_params_batch(engine, [job({"stripe": 1}, queue="q#1")])  # queue slot 0
    assert st.rotate(engine).kind == "rotated"
    st.enqueue_params_batch(engine, [job({"stripe": 0}, queue="q#0")])  # queue slot 1
    claimer = QueueStorage(st.config)  # a fresh stripe rotor: q#0 is claimed first, then q#1
    with held(engine) as holder:
        # stripe 1's claim must append its range to slot 0's range child: it waits out its
        # lock_timeout there and fails, after stripe 0's claim committed
        holder.execute(text(f'LOCK TABLE "{st.schema()}".ready_claim_ranges_0 IN SHARE MODE'))
        claimed = claimer.claim_runtime_batch(engine, "q", 10)
        assert [c.job.args for c in claimed] == [{"stripe": 0}]
        # committed: another session sees the attempt running while the lock is still held
        assert state(engine, st, claimed[0].job.id) == JobState.RUNNING
    (first,) = claimed
    assert st.complete_runtime_batch(engine, [first]) == [(first.job.id, first.job.run_lease)]
    assert [c.job.args for c in st.claim_runtime_batch(engine, "q", 10)] == [{"stripe": 1}]


def test_promotion_leaves_due_jobs_of_a_paused_striped_queue_deferred(
        engine: Engine, make_storage: MakeStorage) -> None:
    st = make_storage(queue_stripe_count=2)
    past = datetime.now(UTC) - timedelta(seconds=1)
    st.enqueue_params_batch(engine, [job({"i": i}, run_at=past) for i in range(2)])
    assert rows(engine, st, BACKLOG, "queue IN ('q#0', 'q#1')") == 2
    st.set_queue_options(engine, "q", paused=True)  # the logical queue

    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 0

    assert rows(engine, st, BACKLOG, "state = 'scheduled'") == 2
    st.set_queue_options(engine, "q", paused=False)
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 2


@contextmanager
def once_after_gate(engine: Engine, action: Callable[[], object]) -> Iterator[list[str]]:
    """Run ``action`` (on other connections) right after the first statement of a prune on
    ``engine`` that counts anything (its first gate): the racing writer commits between two
    gate statements."""
    fired: list[str] = []

    def after(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if not fired and "count(" in statement:
            fired.append(statement)
            action()

    event.listen(engine, "after_cursor_execute", after)
    try:
        yield fired
    finally:
        event.remove(engine, "after_cursor_execute", after)


@pytest.mark.parametrize("receipts", [True, False], ids=["receipts", "leases"])
def test_queue_ring_prune_sees_a_claim_that_commits_between_its_gate_statements(
        engine: Engine, make_storage: MakeStorage, db_url: str, receipts: bool) -> None:
    st = make_storage(**SMALL, lease_claim_receipts=receipts)
    st.enqueue_params_batch(engine, [job({"who": "racing"})])  # slot 0
    assert st.rotate(engine).kind == "rotated"
    claimer = create_engine(db_url, pool_size=1)
    claimed: list[ClaimedRuntimeJob] = []
    try:
        with once_after_gate(engine, lambda: claimed.extend(st.claim_runtime_batch(claimer, "q", 1))) as fired:
            out = st.prune_oldest(engine)
        assert fired and len(claimed) == 1  # the claim committed in the middle of the gates
        assert out.kind == "skipped_active", out  # its attempt keeps the slot
        assert st.complete_runtime_batch(engine, claimed) == [(claimed[0].job.id, claimed[0].job.run_lease)]
    finally:
        claimer.dispose()
