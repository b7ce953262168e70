"""Releasing a unique key appends a row; nothing is updated or deleted while the horizon is
pinned.

* a released key (cancel, the prune that truncates its job's terminal row, a transition the
  job's mask does not hold the key in) is free at once, and taken over in place: at most
  one dead tuple per reuse, none per release;
* concurrent takers of one released key: exactly one wins, the others get the usual
  conflict naming the winner;
* every reader of ownership (conflicts and their owner, retries of the job itself) treats a
  released key as free, and a key taken again is owned again;
* the maintainer's purge deletes released claims and their release rows, only while the
  horizon is not pinned;
* a previous release's writes (it re-takes its own job's key by updating the row, releases
  by deleting it) keep their meaning.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from jobtools import LIVE_KEYS, claim, count, state
from sqlalchemy import text

from qstore import InsertOpts, InsertParams, UniqueConflictError, UniqueOpts
from qstore.types import JobState

SMALL = {"queue_slot_count": 4, "lease_slot_count": 2, "claim_slot_count": 2}
#: A pinned horizon makes the purge stand down; no test holds a snapshot for an hour.
NOT_PINNED = timedelta(hours=1)
#: held while scheduled, available or running; given up once the job completed
UNTIL_COMPLETED = UniqueOpts(states=0b0000_0111)


@pytest.fixture
def st(make_storage):
    return make_storage(**SMALL)


def unique(key: str = "K", unique_opts: UniqueOpts | None = None, **opts: Any) -> InsertParams:
    return InsertParams("k", {"key": key}, InsertOpts(queue="q", unique=unique_opts or UniqueOpts(), **opts))


def enqueue(engine, st, key: str = "K", unique_opts: UniqueOpts | None = None, **opts: Any) -> int:
    return st.enqueue_many(engine, [unique(key, unique_opts, **opts)])[0]


def released(engine, st) -> int:
    """Claim rows a release names (still rows, free keys)."""
    return count(engine, st, "job_unique_claims") - count(engine, st, LIVE_KEYS)


def owner(engine, st, key_job: int) -> int | None:
    """The job owning the key of job ``key_job`` (None: the key is free)."""
    s = st.schema()
    with engine.connect() as c:
        return c.execute(text(
            f'SELECT o.job_id FROM "{s}".job_unique_claims o WHERE o.unique_key = ('
            f'  SELECT k.unique_key FROM "{s}".job_unique_claims k WHERE k.job_id = :j)'
            f'  AND NOT EXISTS (SELECT 1 FROM "{s}".job_unique_releases r WHERE r.claim_id = o.claim_id)'),
            {"j": key_job}).scalar()


def pgstattuple(engine) -> None:
    with engine.begin() as c:
        try:
            c.execute(text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))
        except Exception:  # pragma: no cover - a server without the contrib module
            pytest.skip("needs pgstattuple")


def dead_tuples(engine, st, table: str) -> int:
    with engine.connect() as c:
        return c.execute(text(f"SELECT dead_tuple_count FROM pgstattuple('\"{st.schema()}\".{table}')")).scalar_one()


class Pin:
    """A session holding a snapshot and an xid (REPEATABLE READ + a read): nothing deleted
    or updated after it began can be vacuumed while it lasts."""

    def __init__(self, engine) -> None:
        self.conn = engine.connect()

    def __enter__(self) -> Pin:
        self.conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        self.conn.execute(text("SELECT txid_current()"))
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.rollback()
        self.conn.close()


def prune_slot_of_completed(engine, st) -> None:
    """Rotate the queue ring past the current slot and prune it (its jobs are finished)."""
    assert st.rotate(engine).kind == "rotated"
    assert st.prune_oldest(engine).kind == "pruned"


# -- a released key is free at once ---------------------------------------------------------------


def test_a_key_released_by_cancel_is_reusable_at_once(engine, st):
    a = enqueue(engine, st)
    assert st.cancel_job(engine, a).state == JobState.CANCELLED
    b = enqueue(engine, st)
    assert b != a and state(engine, st, b) == JobState.AVAILABLE
    assert owner(engine, st, b) == b


def test_a_key_released_by_the_prune_is_reusable_at_once(engine, st):
    a = enqueue(engine, st)  # the default mask holds the key once completed, until prune
    assert st.complete_runtime_batch(engine, [claim(engine, st)]) == [(a, 1)]
    with pytest.raises(UniqueConflictError, match=f"owned by job {a}"):
        enqueue(engine, st)
    prune_slot_of_completed(engine, st)
    assert released(engine, st) == 1  # released by an appended row, not deleted
    b = enqueue(engine, st)
    assert owner(engine, st, b) == b


def test_a_key_released_by_a_transition_is_reusable_at_once(engine, st):
    a = enqueue(engine, st, unique_opts=UNTIL_COMPLETED)
    assert st.complete_runtime_batch(engine, [claim(engine, st)]) == [(a, 1)]  # the general path
    assert released(engine, st) == 1
    b = enqueue(engine, st, unique_opts=UNTIL_COMPLETED)
    assert owner(engine, st, b) == b


def test_a_key_taken_over_is_owned_by_its_new_job(engine, st):
    a = enqueue(engine, st)
    st.cancel_job(engine, a)
    b = enqueue(engine, st)
    with pytest.raises(UniqueConflictError, match=f"owned by job {b}"):
        enqueue(engine, st)
    with pytest.raises(UniqueConflictError, match=f"owned by job {b}"):  # the batch branch
        st.enqueue_many(engine, [unique("other"), unique()])
    assert count(engine, st, "job_unique_claims") == 1  # the batch's own claim went


def test_a_batch_takes_a_released_key_and_a_new_one(engine, st):
    a = enqueue(engine, st)
    st.cancel_job(engine, a)
    b, c = st.enqueue_many(engine, [unique(), unique("other")])
    assert (owner(engine, st, b), owner(engine, st, c)) == (b, c)
    assert released(engine, st) == 0


def test_a_job_retried_after_its_release_owns_its_key_again(engine, st):
    a = enqueue(engine, st)
    st.cancel_job(engine, a)
    assert st.retry_job(engine, a).state == JobState.AVAILABLE  # takes its released key back
    assert owner(engine, st, a) == a
    with pytest.raises(UniqueConflictError, match=f"owned by job {a}"):
        enqueue(engine, st)


def test_a_job_cannot_take_back_its_key_once_another_job_took_it(engine, st):
    a = enqueue(engine, st)
    st.cancel_job(engine, a)
    b = enqueue(engine, st)
    with pytest.raises(UniqueConflictError, match=f"owned by job {b}"):
        st.retry_job(engine, a)
    assert state(engine, st, a) == JobState.CANCELLED


# -- concurrent takers ---------------------------------------------------------------------------------


def test_concurrent_takers_of_a_released_key_exactly_one_wins(engine, st):
    st.cancel_job(engine, enqueue(engine, st))
    n = 8
    barrier = threading.Barrier(n)
    won: list[int] = []
    lost: list[str] = []

    def take() -> None:
        barrier.wait()
        try:
            won.append(enqueue(engine, st))
        except UniqueConflictError as err:
            lost.append(str(err))

    threads = [threading.Thread(target=take) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == n - 1
    assert all(f"owned by job {won[0]}" in msg for msg in lost), lost
    assert owner(engine, st, won[0]) == won[0]


# -- dead tuples under a pinned horizon ----------------------------------------------------------


def test_releasing_keys_under_a_pinned_horizon_leaves_no_dead_tuple(engine, st):
    pgstattuple(engine)
    before = {t: dead_tuples(engine, st, t) for t in ("job_unique_claims", "job_unique_releases")}
    with Pin(engine):
        cancelled = [enqueue(engine, st, f"c{i}") for i in range(10)]
        for job_id in cancelled:
            st.cancel_job(engine, job_id)
        done = [enqueue(engine, st, f"d{i}") for i in range(10)]
        assert len(st.complete_runtime_batch(engine, st.claim_runtime_batch(engine, "q", 10))) == 10
        prune_slot_of_completed(engine, st)
        assert released(engine, st) == 20 and count(engine, st, LIVE_KEYS) == 0
        # what a reset of the reused install left before the pin aside, none
        assert {t: dead_tuples(engine, st, t) for t in before} == before
        assert len(done) == 10


def test_a_reused_key_leaves_one_dead_tuple_under_a_pinned_horizon(engine, st):
    pgstattuple(engine)
    before = dead_tuples(engine, st, "job_unique_claims")
    with Pin(engine):
        a = enqueue(engine, st)
        st.cancel_job(engine, a)
        enqueue(engine, st)
        assert dead_tuples(engine, st, "job_unique_claims") == before + 1  # the row taken over


# -- the purge -------------------------------------------------------------------------------------


def test_purge_deletes_released_claims_and_their_releases_and_keeps_owned_keys(engine, st):
    kept = enqueue(engine, st, "kept")
    st.cancel_job(engine, enqueue(engine, st, "gone"))
    assert st.purge_released_keys(engine, pinned_after=NOT_PINNED) == 1
    assert count(engine, st, "job_unique_claims") == 1 and count(engine, st, "job_unique_releases") == 0
    assert owner(engine, st, kept) == kept
    enqueue(engine, st, "gone")  # still free


def test_purge_keeps_a_key_taken_over_after_its_release(engine, st):
    st.cancel_job(engine, enqueue(engine, st))
    b = enqueue(engine, st)
    assert st.purge_released_keys(engine, pinned_after=NOT_PINNED) == 0
    assert count(engine, st, "job_unique_releases") == 0  # the release of the old claim went
    assert owner(engine, st, b) == b


def test_purge_stands_down_while_the_horizon_is_pinned(engine, st):
    st.cancel_job(engine, enqueue(engine, st))
    with Pin(engine):
        time.sleep(0.3)
        assert st.purge_released_keys(engine, pinned_after=timedelta(seconds=0.2)) == 0
        assert released(engine, st) == 1
    assert st.purge_released_keys(engine, pinned_after=NOT_PINNED) == 1


def test_the_maintainer_purges_released_keys(engine, st):
    from qstore import Maintainer

    st.cancel_job(engine, enqueue(engine, st))
    maintainer = Maintainer(st, engine)
    assert "unique_keys" in maintainer.task_names
    report = next(r for r in maintainer.run_all() if r.task == "unique_keys")
    assert report.error is None and report.result == {"purged": 1}
    assert count(engine, st, "job_unique_claims") == 0


# -- a previous release's writes --------------------------------------------------------------------


def key_of(engine, st, job_id: int) -> bytes:
    with engine.connect() as c:
        return c.execute(text(f'SELECT unique_key FROM "{st.schema()}".job_unique_claims WHERE job_id = :j'),
                         {"j": job_id}).scalar_one()


def previous_release_takes(engine, st, key: bytes, job_id: int) -> bool:
    """The statement a previous release takes a key with: a new row, or the key's row
    updated in place when it is already the job's."""
    with engine.begin() as c:
        return c.execute(text(
            f'INSERT INTO "{st.schema()}".job_unique_claims (unique_key, job_id) VALUES (:k, :j) '
            f"ON CONFLICT (unique_key) DO UPDATE SET job_id = excluded.job_id "
            f"WHERE job_unique_claims.job_id = excluded.job_id RETURNING unique_key"),
            {"k": key, "j": job_id}).first() is not None


def test_a_previous_release_taking_back_its_own_released_key_owns_it_again(engine, st):
    a = enqueue(engine, st)
    st.cancel_job(engine, a)
    assert previous_release_takes(engine, st, key_of(engine, st, a), a)  # updates the released row
    assert owner(engine, st, a) == a  # the update renewed the claim: the release no longer applies
    with pytest.raises(UniqueConflictError, match=f"owned by job {a}"):
        enqueue(engine, st)


def test_a_previous_release_sees_a_released_key_as_owned_until_the_purge(engine, st):
    a = enqueue(engine, st)
    key = key_of(engine, st, a)
    st.cancel_job(engine, a)
    assert not previous_release_takes(engine, st, key, a + 1000)  # the degraded window
    assert st.purge_released_keys(engine, pinned_after=NOT_PINNED) == 1
    assert previous_release_takes(engine, st, key, a + 1000)


def test_a_key_a_previous_release_released_by_deleting_it_is_free(engine, st):
    a = enqueue(engine, st)
    with engine.begin() as c:
        c.execute(text(f'DELETE FROM "{st.schema()}".job_unique_claims WHERE job_id = :j'), {"j": a})
    b = enqueue(engine, st)
    assert owner(engine, st, b) == b
