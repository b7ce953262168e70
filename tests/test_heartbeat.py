"""Heartbeats and progress: a heartbeat or progress report appends one ``attempt_progress``
row (no mutable per-attempt state is written), an attempt that never reports writes none,
and a heartbeat never rewrites an append-only claim row: a heartbeated attempt completes on
the fast path, and a receipt a previous release materialised on its heartbeat completes on
the general path.

Every test runs twice: on an install with receipts, and on one without, where each claim
writes a lease."""

from __future__ import annotations

import time
from datetime import timezone

import pytest
from jobtools import attempt_table, claim, count, race, running, state
from sqlalchemy import Connection, text

from qstore.types import JobState

UTC = timezone.utc


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture(params=[True, False], ids=["receipts", "leases"])
def st(request, make_storage):
    """An install with receipts on, then one with receipts off (every attempt a lease)."""
    return make_storage(lease_claim_receipts=request.param)


def claim_row(engine, s, job_id: int) -> tuple:
    """``(ctid, xmin, materialized_at)`` of the row the attempt's claim wrote: its receipt,
    or its lease (which has no ``materialized_at``: None) on an install without receipts."""
    materialized = "materialized_at" if s.lease_claim_receipts() else "NULL"
    with engine.connect() as c:
        return tuple(c.execute(text(
            f'SELECT ctid::text, xmin::text, {materialized} FROM "{s.schema()}".{attempt_table(s)} '
            f'WHERE job_id = {job_id}')).one())


def reports(engine, s, job_id: int) -> list[tuple]:
    """``(run_lease, heartbeat_at, progress)`` of the job's latest progress row per attempt."""
    with engine.connect() as c:
        return [tuple(r) for r in c.execute(text(
            f'SELECT DISTINCT ON (run_lease) run_lease, heartbeat_at, progress '
            f'FROM "{s.schema()}".attempt_progress WHERE job_id = {job_id} ORDER BY run_lease, seq DESC'))]


# -- short jobs stay light ------------------------------------------------------------------


def test_short_job_creates_no_attempt_state_and_no_lease_beyond_its_claim(engine, st):
    c = running(engine, st)
    claimed_leases = count(engine, st, "leases")  # without receipts the claim wrote one
    assert st.complete_runtime_batch(engine, [c]) == [(c.job.id, 1)]
    assert count(engine, st, "attempt_state") == 0
    assert count(engine, st, "attempt_progress") == 0
    assert count(engine, st, "leases") == 0
    assert claimed_leases == (0 if st.lease_claim_receipts() else 1)
    if st.lease_claim_receipts():
        assert claim_row(engine, st, c.job.id)[2] is None  # never materialised


# -- heartbeat_batch ---------------------------------------------------------------------------


def test_heartbeat_appends_one_progress_row_per_live_attempt_and_counts_them(engine, st):
    a, b = running(engine, st), running(engine, st)
    leases = count(engine, st, "leases")
    assert st.heartbeat_batch(engine, [(a.job.id, 1), (b.job.id, 1)]) == 2
    assert count(engine, st, "attempt_progress") == 2
    assert count(engine, st, "attempt_state") == 0
    assert reports(engine, st, a.job.id)[0][1] is not None
    assert count(engine, st, "leases") == leases  # a heartbeat does not materialise a lease


def test_heartbeat_is_visible_in_load_job(engine, st):
    c = running(engine, st)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    (_, hb, _), = reports(engine, st, c.job.id)
    assert st.load_job(engine, c.job.id).heartbeat_at == hb


def test_heartbeat_never_writes_the_claim_row(engine, st):
    c = running(engine, st)
    first = claim_row(engine, st, c.job.id)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"p": 1})])
    assert claim_row(engine, st, c.job.id) == first  # same ctid and xmin: never rewritten
    assert first[2] is None  # a receipt is not materialised by a heartbeat


def test_second_heartbeat_advances_heartbeat_at(engine, st):
    c = running(engine, st)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    (_, first, _), = reports(engine, st, c.job.id)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    (_, second, _), = reports(engine, st, c.job.id)
    assert second > first


def test_heartbeat_counts_each_attempt_once_even_when_repeated_in_the_batch(engine, st):
    c = running(engine, st)
    assert st.heartbeat_batch(engine, [(c.job.id, 1), (c.job.id, 1)]) == 1


def test_heartbeat_with_a_stale_run_lease_counts_zero_and_writes_nothing(engine, st):
    c = running(engine, st)
    before = claim_row(engine, st, c.job.id)
    assert st.heartbeat_batch(engine, [(c.job.id, 2), (c.job.id, 0), (999999, 1)]) == 0
    assert count(engine, st, "attempt_progress") == 0
    assert claim_row(engine, st, c.job.id) == before


def test_heartbeat_of_a_completed_attempt_counts_zero_and_writes_nothing(engine, st):
    c = running(engine, st)
    st.complete_runtime_batch(engine, [c])
    assert st.heartbeat_batch(engine, [(c.job.id, 1)]) == 0
    assert count(engine, st, "attempt_progress") == 0


def test_heartbeat_of_a_lease_backed_attempt_counts_it(engine, st):
    c = running(engine, st)
    st.register_callback(engine, c.job.id, 1, 60)  # materialises the lease
    assert count(engine, st, "leases") == 1
    assert st.heartbeat_batch(engine, [(c.job.id, 1)]) == 1
    assert len(reports(engine, st, c.job.id)) == 1


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
    time.sleep(1.1)  # the claim alone is now stale for a 1 s staleness ...
    st.heartbeat_batch(engine, [(c.job.id, 1)])  # ... but the heartbeat is fresh
    # (a second of staleness: the fresh heartbeat stays fresh through a stall of the host)
    assert [r.id for r in st.rescue_stale_heartbeats(engine, 1.0)] == []
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
    [(_, hb, progress)] = reports(engine, st, c.job.id)
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
    assert count(engine, st, "attempt_progress") == 0


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


# -- an ended attempt leaves no mutable state -----------------------------------------------

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
def test_an_ended_attempt_leaves_no_attempt_state_and_no_lease(engine, st, ending):
    """Its progress rows stay until the ring's prune truncates their slot (see
    ``tests/test_attempt_progress.py``); nothing of it is left to update or delete."""
    c = running(engine, st)
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 5})])
    assert count(engine, st, "attempt_progress") == 1
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


# -- a heartbeat racing the end of its attempt ------------------------------------------------

BEATS = {
    "heartbeat_batch": lambda s, e, j, r: s.heartbeat_batch(e, [(j, r)]),
    "heartbeat_progress_batch": lambda s, e, j, r: s.heartbeat_progress_batch(e, [(j, r, {"done": 1})]),
    "flush_progress": lambda s, e, j, r: s.flush_progress(e, j, r, {"done": 1}),
}


def _complete(s, conn, c) -> None:
    assert s.complete_job_batch_by_id(conn, [(c.job.id, c.job.run_lease)]) == [(c.job.id, c.job.run_lease)]


def _rescue(s, conn, c) -> None:
    assert [r.id for r in s.rescue_expired_deadlines(conn)] == [c.job.id]


ENDERS = {"completion": (_complete, JobState.COMPLETED), "deadline rescue": (_rescue, JobState.RETRYABLE)}


def overdue(engine, s):
    """A running attempt whose deadline has passed (backdated, not waited for)."""
    c = running(engine, s, deadline=600)
    with engine.begin() as conn:
        conn.execute(text(f'UPDATE "{s.schema()}".{attempt_table(s)} '
                          "SET deadline_at = now() - interval '1 hour'"))
    return c


@pytest.mark.parametrize("beat", sorted(BEATS))
@pytest.mark.parametrize("ender", sorted(ENDERS))
def test_a_heartbeat_waits_for_the_transaction_ending_its_attempt_and_then_writes_nothing(engine, st, ender, beat):
    """While a completion or rescue of the attempt is uncommitted, a heartbeat (or progress)
    of it waits; once the attempt has ended it counts zero and appends no progress row."""
    end, final = ENDERS[ender]
    c = overdue(engine, st)
    pair = (c.job.id, c.job.run_lease)
    result = race(engine, lambda ending: end(st, ending, c), lambda: BEATS[beat](st, engine, *pair))
    assert result == (None if beat == "flush_progress" else 0)
    assert reports(engine, st, c.job.id) == []
    assert state(engine, st, c.job.id) == final


def test_two_heartbeat_batches_of_the_same_attempts_in_opposite_orders_do_not_deadlock(engine, st):
    """Heartbeats lock each attempt's receipt in one order, whatever the batch's order: a
    batch never holds one attempt's receipt while it waits for another's. Without receipts a
    heartbeat only takes a shared key lock on the leases and appends rows, so the second
    batch does not wait at all."""
    a, b = running(engine, st), running(engine, st)
    pa, pb = (a.job.id, a.job.run_lease), (b.job.id, b.job.run_lease)

    def hold_a(first: Connection) -> None:
        assert st.heartbeat_batch(first, [pa]) == 1

    def beat_b(first: Connection) -> None:
        assert st.heartbeat_batch(first, [pb]) == 1  # would close a cycle if the second held b

    if st.lease_claim_receipts():  # the second batch waits for a's receipt (a deadlock would raise)
        result = race(engine, hold_a, lambda: st.heartbeat_batch(engine, [pb, pa]), meanwhile=beat_b)
    else:
        with engine.connect() as first, engine.connect() as second:
            first.begin()
            hold_a(first)
            second.execute(text("SET lock_timeout = '20s'"))  # it must not wait: a wait fails here
            result = st.heartbeat_batch(second, [pb, pa])
            second.commit()
            beat_b(first)
            first.commit()
    assert result == 2


def test_a_heartbeat_in_progress_does_not_hold_up_the_attempts_own_lease_updates(engine, make_storage):
    """The heartbeat's lock on the lease is shared and allows updates of the lease's other
    columns: entering a callback wait does not queue behind an open heartbeat."""
    s = make_storage(lease_claim_receipts=False)
    c = running(engine, s)
    token = s.register_callback(engine, c.job.id, c.job.run_lease, 60)
    with engine.connect() as beating:
        beating.begin()
        assert s.heartbeat_batch(beating, [(c.job.id, c.job.run_lease)]) == 1
        with engine.connect() as other:
            other.execute(text("SET LOCAL lock_timeout = '2s'"))
            assert s.enter_callback_wait(other, c.job.id, c.job.run_lease, token) is True
            other.commit()
        beating.commit()
    assert state(engine, s, c.job.id) == JobState.WAITING_EXTERNAL


# -- heartbeats and the completion fast path ------------------------------------------------------


def dead_tuples(engine, s, table: str) -> int:
    """Dead tuples in every ring child of ``table`` (``pgstattuple``, exact)."""
    with engine.connect() as c:
        return int(c.execute(text(
            "SELECT coalesce(sum((pgstattuple(i.inhrelid::regclass)).dead_tuple_count), 0) FROM pg_inherits i "
            f"WHERE i.inhparent = '\"{s.schema()}\".{table}'::regclass")).scalar_one())


def test_heartbeats_under_a_pinned_horizon_leave_no_dead_tuple_in_the_claim_rows(engine, st):
    with engine.begin() as c:
        try:
            c.execute(text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))
        except Exception:  # pragma: no cover - a server without the contrib module
            pytest.skip("needs pgstattuple")
    table = attempt_table(st)
    before = dead_tuples(engine, st, table)
    with engine.connect() as pin:
        pin.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        pin.execute(text("SELECT txid_current()"))  # a snapshot and an xid: the horizon is held
        jobs = [running(engine, st) for _ in range(10)]
        for pct in (1, 2, 3):
            assert st.heartbeat_progress_batch(engine, [(j.job.id, 1, {"pct": pct}) for j in jobs]) == 10
        assert dead_tuples(engine, st, table) == before
        pin.rollback()


def complete_receipts(engine, s, c) -> list[tuple[int, int]]:
    """The fast statement alone (``complete_receipts``) for the claimed attempt ``c``."""
    with engine.begin() as conn:
        return [tuple(r) for r in conn.execute(text(
            f'SELECT * FROM "{s.schema()}".complete_receipts(ARRAY[:slot]::integer[], ARRAY[:job]::bigint[], '
            "ARRAY[:lease]::bigint[], ARRAY[:kind]::text[])"),
            {"slot": c.claim.claim_slot, "job": c.job.id, "lease": c.job.run_lease, "kind": c.job.kind})]


@pytest.fixture
def rst(make_storage):
    """An install with receipts (the fast path completes receipts)."""
    return make_storage(lease_claim_receipts=True)


def test_the_fast_statement_completes_an_attempt_that_never_heartbeated(engine, rst):
    c = running(engine, rst)
    assert complete_receipts(engine, rst, c) == [(c.job.id, 1)]


def test_the_fast_statement_completes_a_heartbeated_attempt_and_drops_its_progress(engine, rst):
    c = running(engine, rst)
    rst.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 50})])
    assert complete_receipts(engine, rst, c) == [(c.job.id, 1)]
    row = rst.load_job(engine, c.job.id)
    assert row.state == JobState.COMPLETED and row.progress is None


def test_the_fast_statement_leaves_a_receipt_a_previous_release_materialised_on_heartbeat(engine, rst):
    c = running(engine, rst)
    with engine.begin() as conn:  # what that release's heartbeat wrote
        conn.execute(text(f'UPDATE "{rst.schema()}".lease_claims SET materialized_at = clock_timestamp() '
                          f"WHERE job_id = {c.job.id}"))
    assert complete_receipts(engine, rst, c) == []
    assert rst.complete_runtime_batch(engine, [c]) == [(c.job.id, 1)]
    assert state(engine, rst, c.job.id) == JobState.COMPLETED


def test_a_fast_completion_waiting_for_a_heartbeat_completes_the_attempt_once_it_commits(engine, rst):
    c = running(engine, rst)
    beats: list[int] = []
    # the heartbeat's transaction holds the receipt's lock; race() checks that the fast
    # completion waits on it, then commits the heartbeat
    got = race(engine, lambda beat: beats.append(rst.heartbeat_batch(beat, [(c.job.id, 1)])),
               lambda: complete_receipts(engine, rst, c))
    assert beats == [1]
    assert got == [(c.job.id, 1)]
    assert state(engine, rst, c.job.id) == JobState.COMPLETED


def test_a_heartbeated_attempt_completes_through_the_general_path_and_keeps_its_progress_rows(engine, st):
    c = running(engine, st)
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 50})])
    assert st.complete_runtime_batch(engine, [c]) == [(c.job.id, 1)]
    assert state(engine, st, c.job.id) == JobState.COMPLETED
    assert reports(engine, st, c.job.id) == [(1, reports(engine, st, c.job.id)[0][1], {"pct": 50})]
    assert st.complete_runtime_batch(engine, [c]) == []


def test_stale_rescue_takes_a_heartbeated_attempt_whose_receipt_was_never_materialised(engine, st):
    c = running(engine, st)
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 5})])
    time.sleep(0.6)
    assert [r.id for r in st.rescue_stale_heartbeats(engine, 0.5)] == [c.job.id]
    row = st.load_job(engine, c.job.id)
    assert row.state == JobState.RETRYABLE and row.progress == {"pct": 5}
