"""Heartbeats and progress are append-only rows (``attempt_progress``) in the ring slot that
holds their attempt, reclaimed by that ring's prune.

* readers (``load_job``, the claimed body after a retry, callback reads, stale rescue) take
  the attempt's latest row; a report that sets only the heartbeat or only the progress keeps
  the other;
* a previous release's writes to ``attempt_state`` (a rolling deploy) are read too;
* under a pinned MVCC horizon, heartbeating jobs leave no dead tuple in ``attempt_progress``;
* the prune gate is exact: a slot is truncated only when no live attempt is in it, so a long
  attempt heartbeating across ring turns keeps its progress, while prunes race heartbeats.

Every test runs on an install with receipts (rows in the claim ring) and one without (rows
in the lease ring).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from jobtools import claim, count, running
from sqlalchemy import text

from qstore.types import JobState

SMALL = {"queue_slot_count": 4, "lease_slot_count": 4, "claim_slot_count": 4}


@pytest.fixture(params=[True, False], ids=["receipts", "leases"])
def st(request, make_storage):
    return make_storage(lease_claim_receipts=request.param, **SMALL)


def ring_of(s) -> str:
    """The ring that holds the attempts, and so their progress rows."""
    return "claim" if s.lease_claim_receipts() else "lease"


def rotate(s, engine) -> Any:
    return s.rotate_claims(engine) if s.lease_claim_receipts() else s.rotate_leases(engine)


def prune(s, engine) -> Any:
    return s.prune_oldest_claims(engine) if s.lease_claim_receipts() else s.prune_oldest_leases(engine)


def short_job(engine, s) -> int:
    """A job claimed, heartbeated with progress and completed (its rows in the current slot)."""
    c = running(engine, s)
    s.heartbeat_progress_batch(engine, [(c.job.id, c.job.run_lease, {"short": True})])
    assert s.complete_job_batch_by_id(engine, [(c.job.id, c.job.run_lease)])
    return c.job.id


def turn(s, engine) -> None:
    """One upkeep tick of the ring that holds the attempts: prune, then rotate."""
    prune(s, engine)
    rotate(s, engine)


def slot_of(engine, s, job_id: int) -> int:
    """The ring slot holding the job's live attempt (receipt or lease)."""
    table, col = ("lease_claims", "claim_slot") if s.lease_claim_receipts() else ("leases", "lease_slot")
    with engine.connect() as c:
        return c.execute(text(f'SELECT {col} FROM "{s.schema()}".{table} WHERE job_id = {job_id}')).scalar_one()


def progress_rows(engine, s, job_id: int) -> list[tuple[int, Any]]:
    """``(ring_slot, progress)`` of the job's progress rows, oldest first."""
    with engine.connect() as c:
        return [tuple(r) for r in c.execute(text(
            f'SELECT ring_slot, progress FROM "{s.schema()}".attempt_progress '
            f'WHERE job_id = {job_id} ORDER BY seq'))]


def current_slot(engine, s) -> int:
    with engine.connect() as c:
        return c.execute(text(f'SELECT current_slot FROM "{s.schema()}".{ring_of(s)}_ring_state')).scalar_one()


# -- readers take the latest row ------------------------------------------------------------


def test_load_job_reads_the_latest_of_many_progress_reports(engine, st):
    c = running(engine, st)
    for pct in (10, 20, 30):
        assert st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": pct})]) == 1
    row = st.load_job(engine, c.job.id)
    assert row.progress == {"pct": 30}
    assert count(engine, st, "attempt_progress") == 3


def test_a_heartbeat_without_progress_keeps_the_reported_progress(engine, st):
    c = running(engine, st)
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 40})])
    before = st.load_job(engine, c.job.id).heartbeat_at
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    row = st.load_job(engine, c.job.id)
    assert row.progress == {"pct": 40}
    assert row.heartbeat_at > before


def test_progress_without_a_heartbeat_keeps_the_last_heartbeat(engine, st):
    c = running(engine, st)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    beat = st.load_job(engine, c.job.id).heartbeat_at
    st.flush_progress(engine, c.job.id, 1, {"pct": 70})
    row = st.load_job(engine, c.job.id)
    assert (row.heartbeat_at, row.progress) == (beat, {"pct": 70})


def test_the_claimed_body_after_a_retry_carries_the_latest_progress(engine, st):
    c = running(engine, st)
    for pct in (1, 2, 3):
        st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": pct})])
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    assert st.retry_after(engine, c.job.id, 1, 0).progress == {"pct": 3}
    st.promote_due(engine, JobState.RETRYABLE, 10)
    again = claim(engine, st)
    assert (again.job.run_lease, again.job.progress) == (2, {"pct": 3})


def test_a_callback_read_shows_the_latest_progress(engine, st):
    c = running(engine, st)
    token = st.register_callback(engine, c.job.id, 1, 60)
    st.flush_progress(engine, c.job.id, 1, {"pct": 5})
    st.flush_progress(engine, c.job.id, 1, {"pct": 6})
    assert st.enter_callback_wait(engine, c.job.id, 1, token)
    st.flush_progress(engine, c.job.id, 1, {"pct": 7})
    assert st.callback_job(engine, token).progress == {"pct": 7}
    assert st.load_job(engine, c.job.id).progress == {"pct": 7}


def test_progress_rows_land_in_the_slot_holding_the_attempt(engine, st):
    c = running(engine, st)
    home = slot_of(engine, st, c.job.id)
    rotate(st, engine)  # the ring moved on; the attempt stays where it was claimed
    assert current_slot(engine, st) != home
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 1})])
    assert progress_rows(engine, st, c.job.id) == [(home, {"pct": 1})]


# -- stale rescue ---------------------------------------------------------------------------


def test_stale_rescue_takes_an_attempt_whose_latest_heartbeat_is_old(engine, st):
    fresh, old = running(engine, st), running(engine, st)
    st.heartbeat_batch(engine, [(old.job.id, 1)])
    time.sleep(0.6)
    st.heartbeat_batch(engine, [(fresh.job.id, 1)])
    assert [r.id for r in st.rescue_stale_heartbeats(engine, 0.5)] == [old.job.id]
    assert st.load_job(engine, fresh.job.id).state == JobState.RUNNING


def test_stale_rescue_leaves_an_attempt_whose_latest_heartbeat_is_fresh(engine, st):
    c = running(engine, st)
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 1})])
    time.sleep(1.1)
    st.flush_progress(engine, c.job.id, 1, {"pct": 2})  # progress alone is no heartbeat ...
    st.heartbeat_batch(engine, [(c.job.id, 1)])  # ... this is
    # (a second of staleness: the fresh heartbeat stays fresh through a stall of the host)
    assert st.rescue_stale_heartbeats(engine, 1.0) == []


# -- a previous release's writes (rolling deploy) ---------------------------------------------


def write_as_previous_release(engine, s, job_id: int, run_lease: int, progress: Any) -> None:
    """What a previous release's heartbeat with progress writes: an ``attempt_state`` upsert."""
    with engine.begin() as c:
        c.execute(text(
            f'INSERT INTO "{s.schema()}".attempt_state (job_id, run_lease, heartbeat_at, progress) '
            "VALUES (:j, :r, clock_timestamp(), CAST(:p AS jsonb)) ON CONFLICT (job_id, run_lease) DO UPDATE "
            "SET heartbeat_at = excluded.heartbeat_at, progress = excluded.progress"),
            {"j": job_id, "r": run_lease, "p": __import__("json").dumps(progress)})


def test_progress_a_previous_release_wrote_to_attempt_state_is_read(engine, st):
    c = running(engine, st)
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 10})])
    write_as_previous_release(engine, st, c.job.id, 1, {"pct": 11})
    row = st.load_job(engine, c.job.id)
    assert row.progress == {"pct": 11}
    with engine.connect() as conn:
        beat = conn.execute(text(f'SELECT heartbeat_at FROM "{st.schema()}".attempt_state')).scalar_one()
    assert row.heartbeat_at == beat  # the later of the two heartbeats


def test_a_previous_release_heartbeat_protects_an_attempt_from_stale_rescue(engine, st):
    c = running(engine, st)
    st.heartbeat_batch(engine, [(c.job.id, 1)])
    time.sleep(1.1)
    write_as_previous_release(engine, st, c.job.id, 1, {"pct": 1})
    # (a second of staleness: the fresh heartbeat stays fresh through a stall of the host)
    assert st.rescue_stale_heartbeats(engine, 1.0) == []


def test_a_previous_release_progress_is_kept_into_the_retry_and_its_row_deleted(engine, st):
    c = running(engine, st)
    write_as_previous_release(engine, st, c.job.id, 1, {"pct": 12})
    assert st.retry_after(engine, c.job.id, 1, 0).progress == {"pct": 12}
    assert count(engine, st, "attempt_state") == 0


# -- append-only under a pinned horizon -----------------------------------------------------


def dead_tuples(engine, s) -> int:
    """Dead tuples in every child of ``attempt_progress`` (``pgstattuple``, exact)."""
    with engine.connect() as c:
        names = c.execute(text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace n ON n.oid = p.relnamespace "
            "WHERE n.nspname = :s AND p.relname = 'attempt_progress'"), {"s": s.schema()}).scalars().all()
        return sum(c.execute(text(f"SELECT dead_tuple_count FROM pgstattuple('\"{s.schema()}\".{n}')"))
                   .scalar_one() for n in names)


def test_heartbeating_jobs_leave_no_dead_tuple_in_attempt_progress_under_a_pinned_horizon(engine, st):
    with engine.begin() as c:
        try:
            c.execute(text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))
        except Exception:  # pragma: no cover - a server without the contrib module
            pytest.skip("needs pgstattuple")
    with engine.connect() as pin:
        pin.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        pin.execute(text("SELECT txid_current()"))  # a snapshot and an xid: the horizon is held
        for _ in range(4):
            jobs = [running(engine, st) for _ in range(10)]
            for pct in (1, 2, 3):
                st.heartbeat_progress_batch(engine, [(j.job.id, j.job.run_lease, {"pct": pct}) for j in jobs])
            done = st.complete_job_batch_by_id(engine, [(j.job.id, j.job.run_lease) for j in jobs])
            assert len(done) == 10
        assert count(engine, st, "attempt_progress") == 120
        assert dead_tuples(engine, st) == 0
        with engine.connect() as c:  # every row of the table is still the one that was inserted
            assert c.execute(text(
                f'SELECT count(*) FROM "{st.schema()}".attempt_progress WHERE xmax::text <> \'0\'')).scalar_one() == 0
        pin.rollback()


# -- the prune gate is exact ------------------------------------------------------------------


def test_prune_reclaims_the_progress_rows_of_ended_attempts(engine, st):
    c = running(engine, st)
    st.heartbeat_progress_batch(engine, [(c.job.id, 1, {"pct": 1})])
    st.complete_job_batch_by_id(engine, [(c.job.id, 1)])
    for _ in range(2 * SMALL["claim_slot_count"]):
        short_job(engine, st)  # every slot is written, so the ring turns through all of them
        turn(st, engine)
    assert progress_rows(engine, st, c.job.id) == []


def test_a_long_attempt_heartbeating_across_ring_turns_keeps_its_latest_progress(engine, st):
    long = running(engine, st)
    home = slot_of(engine, st, long.job.id)
    st.heartbeat_progress_batch(engine, [(long.job.id, 1, {"beat": 0})])
    skipped_busy = 0
    for beat in range(1, 13):  # three times round a ring of four slots
        short_job(engine, st)
        prune(st, engine)
        outcome = rotate(st, engine)
        skipped_busy += outcome.kind == "skipped_busy"
        st.heartbeat_progress_batch(engine, [(long.job.id, 1, {"beat": beat})])
        assert st.load_job(engine, long.job.id).progress == {"beat": beat}
    rows = progress_rows(engine, st, long.job.id)
    assert [p for _, p in rows] == [{"beat": b} for b in range(13)]  # none was truncated
    assert {slot for slot, _ in rows} == {home}
    assert skipped_busy  # the ring came round to the attempt's slot and waited there
    # once it ends, its slot goes with the next prune that reaches it
    st.complete_job_batch_by_id(engine, [(long.job.id, 1)])
    for _ in range(2 * SMALL["claim_slot_count"]):
        short_job(engine, st)
        turn(st, engine)
    assert progress_rows(engine, st, long.job.id) == []


def test_prunes_racing_heartbeats_never_lose_a_live_attempts_progress(engine, st):
    live = [running(engine, st) for _ in range(6)]
    last: dict[int, int] = {}
    stop, errors = threading.Event(), []

    def beat(jobs: list) -> None:
        n = 0
        try:
            while not stop.is_set():
                n += 1
                st.heartbeat_progress_batch(engine, [(j.job.id, j.job.run_lease, {"n": n}) for j in jobs])
                for j in jobs:
                    last[j.job.id] = n
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    def upkeep() -> None:
        try:
            while not stop.is_set():
                short_job(engine, st)
                turn(st, engine)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=beat, args=(live[:3],)), threading.Thread(target=beat, args=(live[3:],)),
               threading.Thread(target=upkeep)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(30)
    assert errors == []
    for j in live:
        assert st.load_job(engine, j.job.id).progress == {"n": last[j.job.id]}
        assert len(progress_rows(engine, st, j.job.id)) == last[j.job.id]  # not one truncated


# -- regressions ----------------------------------------------------------------------------


def test_two_installs_on_one_engine_number_their_progress_rows_from_their_own_sequences(engine, st, make_storage):
    other = make_storage(lease_claim_receipts=st.lease_claim_receipts(), **SMALL)
    assert other.schema() != st.schema()
    for s in (st, other, st):
        c = running(engine, s)
        assert s.heartbeat_progress_batch(engine, [(c.job.id, c.job.run_lease, {"n": 1})]) == 1

    def seqs(s) -> list[int]:
        with engine.connect() as conn:
            return list(conn.execute(text(f'SELECT seq FROM "{s.schema()}".attempt_progress ORDER BY seq')).scalars())

    assert seqs(st) == [1, 2]
    assert seqs(other) == [1]
