"""Engine calls that commit in more than one transaction never report failure for work they
committed: the error carries it (completion), or the call returns it (claims across
stripes, claims through a claimer slot)."""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from jobtools import add, materialise, params
from sqlalchemy import create_engine, event, text

from qstore import DatabaseError, PartialCommitError, UniqueOpts
from qstore.types import JobState


@pytest.fixture
def refuse_attempt_state_deletes(engine, st):
    """Make the general completion path fail: it deletes the attempts' ``attempt_state``
    rows (a statement-level trigger fires even when there are none), the fast path never
    does."""
    s = st.schema()
    with engine.begin() as c:
        c.execute(text(f'CREATE FUNCTION "{s}".refuse() RETURNS trigger LANGUAGE plpgsql AS '
                       "$$ BEGIN RAISE EXCEPTION 'refused by test'; END $$"))
        c.execute(text(f'CREATE TRIGGER refuse BEFORE DELETE ON "{s}".attempt_state '
                       f'FOR EACH STATEMENT EXECUTE FUNCTION "{s}".refuse()'))
    yield
    with engine.begin() as c:
        c.execute(text(f'DROP TRIGGER refuse ON "{s}".attempt_state'))
        c.execute(text(f'DROP FUNCTION "{s}".refuse()'))


def test_engine_completion_that_fails_after_its_fast_part_committed_says_what_committed(
        engine, st, refuse_attempt_state_deletes):
    st.enqueue_params_batch(engine, [params(args={"n": i}) for i in range(2)])
    plain, beating = st.claim_runtime_batch(engine, "q", 2)
    materialise(engine, st, beating)
    with pytest.raises(PartialCommitError) as err:
        st.complete_runtime_batch(engine, [plain, beating])
    assert err.value.committed == [(plain.job.id, plain.job.run_lease)]
    assert err.value.pending == [(beating.job.id, beating.job.run_lease)]
    assert st.load_job(engine, plain.job.id).state == JobState.COMPLETED
    assert st.load_job(engine, beating.job.id).state == JobState.RUNNING


def test_engine_completion_pending_after_a_partial_commit_completes_on_retry(engine, st):
    st.enqueue_params_batch(engine, [params(args={"n": i}) for i in range(2)])
    plain, beating = st.claim_runtime_batch(engine, "q", 2)
    materialise(engine, st, beating)
    assert st.complete_runtime_batch(engine, [plain, beating]) == [
        (plain.job.id, plain.job.run_lease), (beating.job.id, beating.job.run_lease)]


def test_engine_completion_needing_the_general_path_from_the_start_is_one_transaction(
        engine, st, refuse_attempt_state_deletes):
    # holds its key while running, not once completed: completing it must release the key,
    # which only the general path does, so this call is not a fast candidate
    keyed = UniqueOpts(states=0b0000_0110)
    st.enqueue_params_batch(engine, [params(args={"n": 1}), params(args={"n": 2}, unique=keyed)])
    plain, unique = st.claim_runtime_batch(engine, "q", 2)
    materialise(engine, st, unique)
    with pytest.raises(DatabaseError) as err:
        st.complete_runtime_batch(engine, [plain, unique])
    assert not isinstance(err.value, PartialCommitError)
    assert st.load_job(engine, plain.job.id).state == JobState.RUNNING  # rolled back together


def test_engine_claim_through_a_claimer_slot_returns_its_jobs_when_the_slot_refresh_fails(engine, st):
    s = st.schema()
    with engine.begin() as c:
        c.execute(text(f'CREATE FUNCTION "{s}".refuse_refresh() RETURNS trigger LANGUAGE plpgsql AS '
                       "$$ BEGIN RAISE EXCEPTION 'refused by test'; END $$"))
        c.execute(text(f'CREATE TRIGGER refuse_refresh BEFORE UPDATE ON "{s}".queue_claimer_leases '
                       f'FOR EACH ROW EXECUTE FUNCTION "{s}".refuse_refresh()'))
    try:
        st.enqueue_params_batch(engine, [params(args={"n": i}) for i in range(3)])
        jobs = st.claim_runtime_batch_with_aging_for_instance(
            engine, "q", 3, None, None, uuid.uuid4(), 4, 60, 0.000_001)
        assert len(jobs) == 3
        assert {st.load_job(engine, j.job.id).state for j in jobs} == {JobState.RUNNING}
    finally:
        with engine.begin() as c:
            c.execute(text(f'DROP TRIGGER refuse_refresh ON "{s}".queue_claimer_leases'))
            c.execute(text(f'DROP FUNCTION "{s}".refuse_refresh()'))


@pytest.fixture
def other_engine(engine):
    """A second engine on the same database, for work committed between two statements."""
    other = create_engine(engine.url.render_as_string(hide_password=False))
    yield other
    other.dispose()


def commit_between(engine, after: str, work) -> list:  # type: ignore[no-untyped-def]
    """Run ``work()`` (committed elsewhere) once, right after the engine's first statement
    whose text contains ``after``; returns what it returned (empty if it never ran)."""
    fired: list = []

    @event.listens_for(engine, "after_cursor_execute")
    def between(conn, cursor, statement, *_):  # type: ignore[no-untyped-def]
        if not fired and after in statement:
            fired.append(work())

    return fired


def test_engine_load_job_reads_one_snapshot(engine, st, other_engine):
    # A promotion committing after the ready rows were read and before the deferred ones
    # must not make a scheduled job read as gone.
    job_id = add(engine, st, run_at=datetime.now(timezone.utc) + timedelta(seconds=0.3))
    time.sleep(0.4)
    fired = commit_between(engine, "ready_entries.ready_slot",  # the ready rows' SELECT
                           lambda: st.promote_due(other_engine, JobState.SCHEDULED, 100))
    row = st.load_job(engine, job_id)
    assert fired == [1], fired
    assert row is not None and row.state == JobState.SCHEDULED
    assert st.load_job(engine, job_id).state == JobState.AVAILABLE


@pytest.mark.parametrize("name", ["queue_counts", "queue_counts_fast"])
def test_engine_queue_counts_read_in_a_read_only_snapshot(engine, st, name):
    seen: list = []

    def probe(conn, cursor, statement, *_):  # type: ignore[no-untyped-def]
        seen.append(cursor.connection.execute(
            "SELECT current_setting('transaction_isolation'), current_setting('transaction_read_only')").fetchone())

    event.listen(engine, "after_cursor_execute", probe)
    try:
        getattr(st, name)(engine, "q")
    finally:
        event.remove(engine, "after_cursor_execute", probe)
    assert seen and set(seen) == {("repeatable read", "on")}, seen
