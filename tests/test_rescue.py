"""Rescue (STORAGE.md §7.7, traps T2 and T9): stale heartbeats and expired deadlines close
the old attempt before the job can run again, so the rescued worker's late writes change
nothing; exhausted attempts end failed (or in the DLQ) instead of looping."""

from __future__ import annotations

import time
import uuid
from datetime import timezone

import pytest
from sqlalchemy import create_engine, text

from qstore import QueueStorage, QueueStorageConfig, ValidationError
from qstore.model import ClaimedRuntimeJob, JobState
from qstore.schema import seed_rows, storage_schema
from qstore.storage import lifecycle
from qstore.storage.jobs import InsertOpts, InsertParams

UTC = timezone.utc


# -- harness ----------------------------------------------------------------------------------
# One schema per module, reset to its freshly installed state before every test (DELETE every
# table, drop the runtime lane sequences, re-seed the rings): a fresh install per test costs
# 1-4 s here, the reset ~30 ms. The module gets its own engine, so no compiled statement of
# another module's (dropped) schema can leak in through the engine's compiled cache (this bit
# once: ``Sequence.next_value()`` was cached without its schema — regression test
# ``test_two_schemas_on_one_engine_draw_job_ids_from_their_own_sequences``).


@pytest.fixture(scope="module")
def engine(db_url):
    eng = create_engine(db_url, pool_size=5, max_overflow=20)
    yield eng
    eng.dispose()


@pytest.fixture(scope="module")
def installed(engine):
    config = QueueStorageConfig(schema=f"t_{uuid.uuid4().hex[:8]}")
    with engine.begin() as c:
        lifecycle.create_all(c, config)
    yield config
    with engine.begin() as c:
        c.execute(text(f'DROP SCHEMA IF EXISTS "{config.schema}" CASCADE'))


def reset(engine, config: QueueStorageConfig) -> None:
    """Back to a fresh install. The ring-state singletons are ANALYZEd so plans see one row
    each (unanalysed, their cross join in ``claim_ready`` was once estimated at ~3M rows and
    JIT-compiled on every claim)."""
    s = config.schema
    ns = "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s AND "
    with engine.begin() as c:
        for seq in c.execute(text(ns + r"c.relkind = 'S' AND c.relname LIKE 'queue\_%\_seq\_%'"), {"s": s}).scalars().all():
            c.execute(text(f'DROP SEQUENCE "{s}"."{seq}"'))
        for table in c.execute(text(ns + "c.relkind IN ('r', 'p') AND NOT c.relispartition"), {"s": s}).scalars().all():
            c.execute(text(f'DELETE FROM "{s}"."{table}"'))
        c.execute(text(f'ALTER SEQUENCE "{s}".job_id_seq RESTART'))
        seed_rows(c, storage_schema(config))
        c.execute(text(f'ANALYZE "{s}".claim_ring_state, "{s}".lease_ring_state, "{s}".queue_ring_state'))


@pytest.fixture
def st(engine, installed) -> QueueStorage:
    reset(engine, installed)
    return QueueStorage(installed)


# -- helpers ----------------------------------------------------------------------------------


def params(kind: str = "k", args: object = None, **opts: object) -> InsertParams:
    opts.setdefault("queue", "q")
    return InsertParams(kind, {"n": 1} if args is None else args, InsertOpts(**opts))


def add(engine, s, **opts: object) -> int:
    """Enqueue one job and return its id."""
    args = opts.pop("args", None)
    s.enqueue_params_batch(engine, [params(args=args, **opts)])
    sc = s.schema()
    with engine.connect() as c:
        return c.execute(text(
            f'SELECT max(job_id) FROM (SELECT job_id FROM "{sc}".ready_entries '
            f'UNION ALL SELECT job_id FROM "{sc}".deferred_jobs) j')).scalar_one()


def claim(engine, s, queue: str = "q", deadline: float | None = None) -> ClaimedRuntimeJob:
    got = s.claim_runtime_batch(engine, queue, 1, deadline)
    assert len(got) == 1, got
    return got[0]


def running(engine, s, deadline: float | None = None, **opts: object) -> ClaimedRuntimeJob:
    add(engine, s, **opts)
    return claim(engine, s, str(opts.get("queue", "q")), deadline)


def count(engine, s, table: str, where: str = "true") -> int:
    with engine.connect() as c:
        return c.execute(text(f'SELECT count(*) FROM "{s.schema()}".{table} WHERE {where}')).scalar_one()


def state(engine, s, job_id: int) -> JobState:
    row = s.load_job(engine, job_id)
    assert row is not None
    return row.state


def census(engine, s) -> dict[str, int]:
    return {t: count(engine, s, t) for t in (
        "ready_entries", "ready_tombstones", "deferred_jobs", "done_entries", "dlq_entries",
        "leases", "lease_claims", "lease_claim_closures", "attempt_state")}


def rescue_heartbeat(engine, s, job_id: int) -> list:
    time.sleep(0.02)
    return [r for r in s.rescue_stale_heartbeats(engine, 0.01) if r.id == job_id]


def rescue_deadline(engine, s, job_id: int) -> list:
    time.sleep(0.02)
    return [r for r in s.rescue_expired_deadlines(engine) if r.id == job_id]


RESCUES = {"heartbeat": rescue_heartbeat, "deadline": rescue_deadline}


def doomed(engine, s, kind: str, lease: bool = False, **opts: object) -> ClaimedRuntimeJob:
    """A running attempt that the ``kind`` rescue will pick up (deadline 1 ms for deadline).
    ``lease``: materialise the attempt's lease first (as registering a callback does)."""
    c = running(engine, s, deadline=0.001 if kind == "deadline" else None, **opts)
    if lease:
        s.register_callback(engine, c.job.id, c.job.run_lease, 3600)
    return c


# -- what rescue does ------------------------------------------------------------------------


def test_stale_heartbeat_rescue_moves_a_receipt_only_attempt_to_retryable(engine, st):
    c = doomed(engine, st, "heartbeat")
    [row] = rescue_heartbeat(engine, st, c.job.id)
    assert (row.state, row.attempt, row.run_lease) == (JobState.RETRYABLE, 1, 1)
    assert row.errors[-1]["error"] == "receipt claim stale"
    assert state(engine, st, c.job.id) == JobState.RETRYABLE
    assert count(engine, st, "lease_claim_closures", f"job_id = {c.job.id} AND outcome = 'rescued'") == 1


def test_stale_heartbeat_rescue_moves_a_lease_backed_attempt_to_retryable_closing_lease_and_receipt(engine, st):
    c = doomed(engine, st, "heartbeat", lease=True)
    [row] = rescue_heartbeat(engine, st, c.job.id)
    assert row.state == JobState.RETRYABLE
    assert row.errors[-1]["error"] == "heartbeat stale"
    assert count(engine, st, "leases") == 0
    assert count(engine, st, "lease_claim_closures", f"job_id = {c.job.id}") == 1  # T2


def test_stale_heartbeat_rescue_leaves_a_fresh_attempt_alone(engine, st):
    c = running(engine, st)
    assert st.rescue_stale_heartbeats(engine, 3600) == []
    assert state(engine, st, c.job.id) == JobState.RUNNING


def test_deadline_rescue_moves_an_overdue_attempt_to_retryable(engine, st):
    c = doomed(engine, st, "deadline")
    [row] = rescue_deadline(engine, st, c.job.id)
    assert row.state == JobState.RETRYABLE
    assert row.errors[-1]["error"] == "hard deadline exceeded"
    assert count(engine, st, "lease_claim_closures", f"job_id = {c.job.id} AND outcome = 'deadline_expired'") == 1


def test_deadline_rescue_moves_an_overdue_lease_backed_attempt_to_retryable(engine, st):
    c = doomed(engine, st, "deadline", lease=True)
    [row] = rescue_deadline(engine, st, c.job.id)
    assert row.state == JobState.RETRYABLE
    assert count(engine, st, "leases") == 0


def test_deadline_rescue_leaves_attempts_without_a_deadline_or_within_it_alone(engine, st):
    a = running(engine, st)
    b = running(engine, st, deadline=3600)
    time.sleep(0.02)
    assert st.rescue_expired_deadlines(engine) == []
    assert state(engine, st, a.job.id) == state(engine, st, b.job.id) == JobState.RUNNING


def test_rescue_backoff_makes_the_job_due_later(engine, st):
    c = doomed(engine, st, "heartbeat", max_attempts=5)
    [row] = rescue_heartbeat(engine, st, c.job.id)
    assert 1.9 <= (row.run_at - row.finalized_at).total_seconds() <= 2.6
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 0


# -- stale writers after rescue (I3) ------------------------------------------------------------


@pytest.mark.parametrize("lease", [False, True], ids=["receipt", "lease"])
@pytest.mark.parametrize("kind", sorted(RESCUES))
def test_rescued_workers_late_writes_change_nothing(engine, st, kind, lease):
    c = doomed(engine, st, kind, lease=lease)
    assert RESCUES[kind](engine, st, c.job.id)
    before = census(engine, st)
    j, r = c.job.id, c.job.run_lease

    assert st.complete_runtime_batch(engine, [c]) == []
    assert st.complete_job_batch_by_id(engine, [(j, r)]) == []
    assert st.heartbeat_batch(engine, [(j, r)]) == 0
    assert st.heartbeat_progress_batch(engine, [(j, r, {"p": 1})]) == 0
    st.flush_progress(engine, j, r, {"p": 1})
    assert st.fail_retryable(engine, j, r, "late") is None
    assert st.retry_after(engine, j, r, 0) is None
    assert st.snooze(engine, j, r, 0) is None
    assert st.cancel_running(engine, j, r, "late") is None
    assert st.fail_terminal(engine, j, r, "late") is None
    assert st.fail_to_dlq(engine, j, r, "late", "late") is None
    with pytest.raises(ValidationError):
        st.register_callback(engine, j, r, 60)

    assert census(engine, st) == before
    row = st.load_job(engine, j)
    assert (row.state, row.run_lease) == (JobState.RETRYABLE, 1)


@pytest.mark.parametrize("kind", sorted(RESCUES))
def test_rescued_job_is_reclaimed_with_the_next_run_lease_and_completed_by_the_new_worker(engine, st, kind):
    old = doomed(engine, st, kind)
    RESCUES[kind](engine, st, old.job.id)
    with engine.begin() as c:  # make the backoff due now
        c.execute(text(f'UPDATE "{st.schema()}".deferred_jobs SET run_at = clock_timestamp()'))
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 1
    new = claim(engine, st)
    assert (new.job.id, new.job.run_lease, new.job.attempt) == (old.job.id, 2, 2)

    assert st.complete_runtime_batch(engine, [old]) == []  # the old worker still loses
    assert st.heartbeat_batch(engine, [(old.job.id, 1)]) == 0
    assert state(engine, st, old.job.id) == JobState.RUNNING

    assert st.complete_runtime_batch(engine, [new]) == [(old.job.id, 2)]
    assert state(engine, st, old.job.id) == JobState.COMPLETED


# -- exhaustion (T9) --------------------------------------------------------------------------------


@pytest.mark.parametrize("lease", [False, True], ids=["receipt", "lease"])
@pytest.mark.parametrize("kind", sorted(RESCUES))
def test_rescue_of_an_exhausted_attempt_fails_the_job(engine, st, kind, lease):
    c = doomed(engine, st, kind, lease=lease, max_attempts=1)
    [row] = RESCUES[kind](engine, st, c.job.id)
    assert row.state == JobState.FAILED
    assert row.errors[-1]["terminal"] is True
    assert state(engine, st, c.job.id) == JobState.FAILED
    assert count(engine, st, "deferred_jobs") == 0
    assert count(engine, st, "leases") == 0


@pytest.mark.parametrize("kind", sorted(RESCUES))
def test_rescue_of_an_exhausted_attempt_moves_it_to_the_dlq_when_the_queue_policy_is_on(engine, st, kind):
    st.set_queue_options(engine, "q", dlq_enabled=True)
    c = doomed(engine, st, kind, max_attempts=1)
    [row] = RESCUES[kind](engine, st, c.job.id)
    assert row.state == JobState.FAILED
    assert count(engine, st, "dlq_entries", f"job_id = {c.job.id}") == 1
    assert count(engine, st, "done_entries", f"job_id = {c.job.id}") == 0
    assert count(engine, st, "deferred_jobs") == 0


def test_rescue_does_not_loop_an_exhausted_job(engine, st):
    c = doomed(engine, st, "heartbeat", max_attempts=1)
    rescue_heartbeat(engine, st, c.job.id)
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 0
    assert st.claim_runtime_batch(engine, "q", 5) == []
    assert rescue_heartbeat(engine, st, c.job.id) == []
