"""Heartbeats and progress (STORAGE.md §7.6): per-attempt mutable state is created only
when an attempt heartbeats or reports progress, removed when the attempt ends, and a
heartbeat never rewrites an append-only claim row (trap T8)."""

from __future__ import annotations

import uuid
from datetime import timezone

import pytest
from sqlalchemy import create_engine, text

from qstore import QueueStorage, QueueStorageConfig
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


def claim_row(engine, s, job_id: int) -> tuple:
    with engine.connect() as c:
        return tuple(c.execute(text(
            f'SELECT ctid::text, xmin::text, materialized_at FROM "{s.schema()}".lease_claims '
            f'WHERE job_id = {job_id}')).one())


def attempt_state(engine, s, job_id: int) -> list[tuple]:
    with engine.connect() as c:
        return [tuple(r) for r in c.execute(text(
            f'SELECT run_lease, heartbeat_at, progress FROM "{s.schema()}".attempt_state '
            f'WHERE job_id = {job_id}'))]


# -- short jobs stay receipt-only ------------------------------------------------------------


def test_receipt_only_short_job_never_creates_attempt_state_or_a_lease(engine, st):
    c = running(engine, st)
    assert st.complete_runtime_batch(engine, [c]) == [(c.job.id, 1)]
    assert count(engine, st, "attempt_state") == 0
    assert count(engine, st, "leases") == 0
    assert claim_row(engine, st, c.job.id)[2] is None  # never materialised


# -- heartbeat_batch ---------------------------------------------------------------------------


def test_heartbeat_creates_attempt_state_and_counts_the_live_attempts(engine, st):
    a, b = running(engine, st), running(engine, st)
    assert st.heartbeat_batch(engine, [(a.job.id, 1), (b.job.id, 1)]) == 2
    assert count(engine, st, "attempt_state") == 2
    assert attempt_state(engine, st, a.job.id)[0][1] is not None
    assert count(engine, st, "leases") == 0  # a heartbeat does not materialise a lease


def test_heartbeat_is_visible_in_load_job(engine, st):
    c = running(engine, st)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    (_, hb, _), = attempt_state(engine, st, c.job.id)
    assert st.load_job(engine, c.job.id).heartbeat_at == hb


def test_heartbeat_sets_materialized_at_once_and_never_rewrites_the_claim_row(engine, st):
    c = running(engine, st)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    first = claim_row(engine, st, c.job.id)
    assert first[2] is not None
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"p": 1})])
    assert claim_row(engine, st, c.job.id) == first  # same ctid, xmin, materialized_at (T8)


def test_second_heartbeat_advances_heartbeat_at(engine, st):
    c = running(engine, st)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    (_, first, _), = attempt_state(engine, st, c.job.id)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    (_, second, _), = attempt_state(engine, st, c.job.id)
    assert second > first


def test_heartbeat_counts_each_attempt_once_even_when_repeated_in_the_batch(engine, st):
    c = running(engine, st)
    assert st.heartbeat_batch(engine, [(c.job.id, 1), (c.job.id, 1)]) == 1


def test_heartbeat_with_a_stale_run_lease_counts_zero_and_writes_nothing(engine, st):
    c = running(engine, st)
    assert st.heartbeat_batch(engine, [(c.job.id, 2), (c.job.id, 0), (999999, 1)]) == 0
    assert count(engine, st, "attempt_state") == 0
    assert claim_row(engine, st, c.job.id)[2] is None


def test_heartbeat_of_a_completed_attempt_counts_zero_and_writes_nothing(engine, st):
    c = running(engine, st)
    st.complete_runtime_batch(engine, [c])
    assert st.heartbeat_batch(engine, [(c.job.id, 1)]) == 0
    assert count(engine, st, "attempt_state") == 0


def test_heartbeat_of_a_lease_backed_attempt_counts_it(engine, st):
    c = running(engine, st)
    st.register_callback(engine, c.job.id, 1, 60)  # materialises the lease
    assert count(engine, st, "leases") == 1
    assert st.heartbeat_batch(engine, [(c.job.id, 1)]) == 1
    assert len(attempt_state(engine, st, c.job.id)) == 1


def test_heartbeat_of_a_waiting_attempt_keeps_it_waiting(engine, st):
    c = running(engine, st)
    token = st.register_callback(engine, c.job.id, 1, 60)
    st.enter_callback_wait(engine, c.job.id, 1, token)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    assert state(engine, st, c.job.id) == JobState.WAITING_EXTERNAL
    assert st.callback_job(engine, token).callback_id == token


def test_recent_heartbeat_protects_an_attempt_from_stale_rescue(engine, st):
    import time

    c = running(engine, st)
    time.sleep(0.4)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    assert [r.id for r in st.rescue_stale_heartbeats(engine, 0.3)] == []
    assert state(engine, st, c.job.id) == JobState.RUNNING


# -- progress ------------------------------------------------------------------------------


def test_heartbeat_progress_stores_progress_visible_in_load_job(engine, st):
    c = running(engine, st)
    assert st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 40})]) == 1
    row = st.load_job(engine, c.job.id)
    assert row.progress == {"pct": 40}
    assert row.heartbeat_at is not None


def test_flush_progress_stores_progress_without_a_heartbeat(engine, st):
    c = running(engine, st)
    st.flush_progress(engine, c.job.id, 1, {"pct": 10})
    [(_, hb, progress)] = attempt_state(engine, st, c.job.id)
    assert (hb, progress) == (None, {"pct": 10})
    assert st.load_job(engine, c.job.id).progress == {"pct": 10}


def test_flush_progress_replaces_earlier_progress(engine, st):
    c = running(engine, st)
    st.flush_progress(engine, c.job.id, 1, {"pct": 10})
    st.flush_progress(engine, c.job.id, 1, {"pct": 90})
    assert st.load_job(engine, c.job.id).progress == {"pct": 90}


def test_flush_progress_reaches_a_waiting_attempt(engine, st):
    c = running(engine, st)
    token = st.register_callback(engine, c.job.id, 1, 60)
    st.enter_callback_wait(engine, c.job.id, 1, token)
    st.flush_progress(engine, c.job.id, 1, {"pct": 55})
    row = st.load_job(engine, c.job.id)
    assert (row.state, row.progress) == (JobState.WAITING_EXTERNAL, {"pct": 55})


def test_flush_progress_of_a_stale_attempt_is_a_silent_no_op(engine, st):
    c = running(engine, st)
    st.complete_runtime_batch(engine, [c])
    assert st.flush_progress(engine, c.job.id, 1, {"pct": 1}) is None
    assert st.flush_progress(engine, c.job.id, 7, {"pct": 1}) is None
    assert count(engine, st, "attempt_state") == 0


def test_stored_progress_is_persisted_into_the_retry(engine, st):
    c = running(engine, st)
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 40})])
    row = st.retry_after(engine, c.job.id, 1, 0)
    assert row.progress == {"pct": 40}
    st.promote_due(engine, JobState.RETRYABLE, 10)
    assert claim(engine, st).job.progress == {"pct": 40}


def test_caller_progress_wins_over_stored_progress(engine, st):
    c = running(engine, st)
    st.flush_progress(engine, c.job.id, 1, {"pct": 40})
    row = st.fail_terminal(engine, c.job.id, 1, "x", progress={"pct": 41})
    assert row.progress == {"pct": 41}
    assert st.load_job(engine, c.job.id).progress == {"pct": 41}


def test_progress_is_cleared_on_successful_completion(engine, st):
    c = running(engine, st)
    st.flush_progress(engine, c.job.id, 1, {"pct": 99})
    st.complete_job_batch_by_id(engine, [(c.job.id, 1)])
    assert st.load_job(engine, c.job.id).progress is None


# -- attempt_state lives exactly as long as the attempt ---------------------------------------

ENDINGS = {
    "complete": lambda s, e, j: s.complete_job_batch_by_id(e, [(j, 1)]),
    "retry_after": lambda s, e, j: s.retry_after(e, j, 1, 60),
    "snooze": lambda s, e, j: s.snooze(e, j, 1, 60),
    "cancel_running": lambda s, e, j: s.cancel_running(e, j, 1, "r"),
    "fail_terminal": lambda s, e, j: s.fail_terminal(e, j, 1, "x"),
    "fail_to_dlq": lambda s, e, j: s.fail_to_dlq(e, j, 1, "r", "x"),
    "fail_retryable": lambda s, e, j: s.fail_retryable(e, j, 1, "x"),
    "cancel_job": lambda s, e, j: s.cancel_job(e, j),
    "rescue": lambda s, e, j: s.rescue_stale_heartbeats(e, 0.001),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_attempt_state_is_removed_when_the_attempt_ends(engine, st, ending):
    c = running(engine, st)
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 5})])
    assert count(engine, st, "attempt_state") == 1
    assert ENDINGS[ending](st, engine, c.job.id)
    assert count(engine, st, "attempt_state") == 0
    assert count(engine, st, "leases") == 0


@pytest.mark.parametrize("ending", ["complete_external", "fail_external", "retry_external", "cancel_job"])
def test_attempt_state_and_lease_are_removed_when_a_waiting_attempt_ends(engine, st, ending):
    c = running(engine, st)
    st.flush_progress(engine, c.job.id, 1, {"pct": 5})
    token = st.register_callback(engine, c.job.id, 1, 60)
    st.enter_callback_wait(engine, c.job.id, 1, token)
    if ending == "complete_external":
        st.complete_external(engine, token, {"ok": True})
    elif ending == "fail_external":
        st.fail_external(engine, token, "nope")
    elif ending == "retry_external":
        st.retry_external(engine, token)
    else:
        st.cancel_job(engine, c.job.id)
    assert count(engine, st, "attempt_state") == 0
    assert count(engine, st, "leases") == 0
