"""Small helpers shared by the attempt-lifecycle test modules: enqueue one job, claim it,
read a job's state, count rows of a table, count the relation locks a session holds, take
a census of every table family, and run a test in both receipt modes."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event, text

from qstore import InsertOpts, InsertParams
from qstore.config import CLOSURE_BLOCK, READY_SLOT_SEEN
from qstore.types import ClaimedRuntimeJob, JobState

#: The pseudo-table of the live deferred backlog for :func:`relation`: overflow rows
#: (``deferred_jobs``) and the deferred wheel's entries without a mark.
BACKLOG = "deferred_backlog"
#: The pseudo-table of the owned unique keys for :func:`relation`: claims that no release
#: names (a released claim stays a row until the maintainer purges it).
LIVE_KEYS = "live_unique_claims"
#: The pseudo-table of every closed attempt for :func:`relation`: the rows of
#: ``lease_claim_closures`` and the members of ``lease_claim_closure_batches`` (the fast
#: completion's form), with ``claim_slot``, ``job_id``, ``run_lease`` and ``outcome``.
CLOSED = "closed_attempts"
_SNAPSHOT = ("job_id, kind, queue, args, state, priority, attempt, run_lease, max_attempts, run_at, "
             "attempted_at, finalized_at, created_at, unique_key, unique_states, payload")


def relation(schema: str, table: str) -> str:
    """``"schema".table`` as SQL, for :data:`BACKLOG` the live deferred backlog as a
    subquery with the overflow's columns, for :data:`LIVE_KEYS` the owned keys, for
    :data:`CLOSED` every closed attempt."""
    if table == LIVE_KEYS:
        return (f'(SELECT c.* FROM "{schema}".job_unique_claims c WHERE NOT EXISTS (SELECT 1 FROM '
                f'"{schema}".job_unique_releases r WHERE r.claim_id = c.claim_id)) AS {LIVE_KEYS}')
    if table == CLOSED:
        return closed_attempts(schema)
    if table != BACKLOG:
        return f'"{schema}".{table}'
    return (f'(SELECT {_SNAPSHOT} FROM "{schema}".deferred_jobs UNION ALL SELECT {_SNAPSHOT} '
            f'FROM "{schema}".deferred_wheel w WHERE NOT EXISTS (SELECT 1 FROM "{schema}".deferred_wheel_marks m '
            f'WHERE m.entry_id = w.entry_id AND m.wheel_slot = w.wheel_slot)) AS {BACKLOG}')


def closed_attempts(schema: str) -> str:
    """:data:`CLOSED` as a subquery of install ``schema``."""
    return (f'(SELECT claim_slot, job_id, run_lease, outcome FROM "{schema}".lease_claim_closures UNION ALL '
            f"SELECT b.claim_slot, m.job_id, m.run_lease, 'completed' FROM \"{schema}\".lease_claim_closure_batches b "
            f"CROSS JOIN LATERAL unnest(b.job_ids, b.run_leases) AS m(job_id, run_lease)) AS {CLOSED}")


def both_receipt_modes(fixture: str = "st") -> pytest.MarkDecorator:
    """Run the test twice: ``fixture`` (a module's install fixture built with
    :func:`install_in_mode`) is an install with receipts on, then one with receipts off,
    where every claim writes a lease."""
    return pytest.mark.parametrize(fixture, [True, False], ids=["receipts", "leases"], indirect=True)


def install_in_mode(request: pytest.FixtureRequest, make_storage: Any) -> Any:
    """``make_storage(lease_claim_receipts=...)``: the mode :func:`both_receipt_modes` gave
    the test, receipts on when it gave none."""
    return make_storage(lease_claim_receipts=getattr(request, "param", True))


def attempt_table(s) -> str:
    """The table a claim records its attempt in: receipts (``lease_claims``), or ``leases``
    on an install without receipts."""
    return "lease_claims" if s.lease_claim_receipts() else "leases"


def params(kind: str = "k", args: object = None, **opts: object) -> InsertParams:
    opts.setdefault("queue", "q")
    return InsertParams(kind, {"n": 1} if args is None else args, InsertOpts(**opts))


def add(engine, s, **opts: object) -> int:
    """Enqueue one job and return its id."""
    args = opts.pop("args", None)
    (job_id,) = s.enqueue_many(engine, [params(args=args, **opts)])
    return job_id


def claim(engine, s, queue: str = "q", deadline: float | None = None) -> ClaimedRuntimeJob:
    got = s.claim_runtime_batch(engine, queue, 1, deadline)
    assert len(got) == 1, got
    return got[0]


def running(engine, s, deadline: float | None = None, **opts: object) -> ClaimedRuntimeJob:
    add(engine, s, **opts)
    return claim(engine, s, str(opts.get("queue", "q")), deadline)


def materialise(engine, s, job: ClaimedRuntimeJob) -> None:
    """Mark ``job``'s receipt materialised, as a callback (or a previous release's heartbeat)
    does since its claim: its completion then needs the general path."""
    with engine.begin() as c:
        n = c.execute(text(f"UPDATE {relation(s.schema(), 'lease_claims')} SET materialized_at = clock_timestamp() "
                           "WHERE job_id = :j AND run_lease = :r"), {"j": job.job.id, "r": job.job.run_lease}).rowcount
    assert n == 1


def count(engine, s, table: str, where: str = "true") -> int:
    with engine.connect() as c:
        return c.execute(text(f'SELECT count(*) FROM {relation(s.schema(), table)} WHERE {where}')).scalar_one()


def state(engine, s, job_id: int) -> JobState:
    row = s.load_job(engine, job_id)
    assert row is not None
    return row.state


def census(engine, s) -> dict[str, int]:
    return {t: count(engine, s, t) for t in (
        "ready_entries", "ready_tombstones", BACKLOG, "done_entries", "done_batches", "dlq_entries",
        "leases", "lease_claims", "lease_claim_closures", "lease_claim_closure_batches", "attempt_state")}


def requeue(engine, s, claimed: ClaimedRuntimeJob) -> None:
    """End the claimed attempt as retryable and promote it at once, so the next claim of
    its queue starts the job's next attempt (run_lease + 1)."""
    job = claimed.job
    assert s.retry_after(engine, job.id, job.run_lease, 0) is not None
    assert s.promote_due(engine, JobState.RETRYABLE, 100) >= 1


def seen_slot(conn: Any, st: Any) -> str | None:
    """The ring slot the claims of ``conn``'s session last found a ready row in (the session
    setting ``claim_ready`` keeps), None when it has none."""
    value = conn.execute(text("SELECT current_setting(:name, true)"), {"name": _seen_slot_setting(st)}).scalar()
    return value or None


def set_seen_slot(conn: Any, st: Any, slot: str) -> Any:
    """Set that session setting on ``conn`` to ``slot`` ('' clears it); ``conn``."""
    conn.execute(text("SELECT set_config(:name, :slot, false)"), {"name": _seen_slot_setting(st), "slot": slot})
    return conn


def forget_seen_slot(conn: Any, st: Any) -> Any:
    """Clear the session's hint of the ring slot its claims last found ready rows in (a
    session setting, so it outlives a test on a pooled connection), so that a claim on
    ``conn`` looks in the ring's current slot first, as on a new connection; ``conn``."""
    return set_seen_slot(conn, st, "")


def _seen_slot_setting(st: Any) -> str:
    return f"{READY_SLOT_SEEN}.{st.schema()}"


def relation_locks(conn) -> int:
    """Relation locks held by ``conn``'s backend (its transaction's, plus the query's own)."""
    return conn.execute(text(
        "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation'"
    )).scalar_one()


def checkouts_of(pool: Any, thread_prefix: str = "") -> list[int]:
    """Count the checkouts of ``pool`` from now on, by threads whose name starts with
    ``thread_prefix`` (every thread by default); ``[n]``, updated in place. A listener of
    that pool alone: a pool made from it later does not copy it."""
    seen = [0]

    def checkout(*_: Any) -> None:
        if threading.current_thread().name.startswith(thread_prefix):
            seen[0] += 1

    event.listen(pool, "checkout", checkout)
    return seen


def blocked_by(engine, pid: int, done: threading.Event, timeout: float = 20) -> bool:
    """Wait until some backend waits on a lock ``pid`` holds (True) or ``done`` is set
    first (False)."""
    deadline = time.monotonic() + timeout
    with engine.connect() as c:
        while time.monotonic() < deadline and not done.is_set():
            if c.execute(text("SELECT count(*) FROM pg_stat_activity "
                              "WHERE :p = ANY(pg_blocking_pids(pid))"), {"p": pid}).scalar():
                return True
            c.rollback()
            time.sleep(0.01)
    return False


def closures(engine, s) -> list[Any]:
    """Every closure of both forms: its attempt, its form, whether its batch row's block
    and slot are its own, and whether its receipt is in the same claim slot."""
    q = f'"{s.schema()}"'
    with engine.connect() as c:
        return c.execute(text(f"""
            SELECT x.claim_slot, x.job_id, x.run_lease, x.form, x.in_block,
                   EXISTS (SELECT 1 FROM {q}.lease_claims r WHERE r.claim_slot = x.claim_slot
                           AND r.job_id = x.job_id AND r.run_lease = x.run_lease) AS has_receipt
            FROM (SELECT claim_slot, job_id, run_lease, 'narrow' AS form, true AS in_block
                  FROM {q}.lease_claim_closures
                  UNION ALL
                  SELECT b.claim_slot, m.job_id, m.run_lease, 'batch', b.job_block = m.job_id / {CLOSURE_BLOCK}
                  FROM {q}.lease_claim_closure_batches b
                  CROSS JOIN LATERAL unnest(b.job_ids, b.run_leases) AS m(job_id, run_lease)) x""")).all()


def batch_rows(engine, s) -> list[Any]:
    with engine.connect() as c:
        return c.execute(text(f'SELECT claim_slot, job_block, job_ids, run_leases FROM "{s.schema()}".'
                              "lease_claim_closure_batches ORDER BY job_block, claim_slot")).all()


def assert_closures_sound(engine, s) -> list[Any]:
    """No attempt has two closures (of either form); every closure has its receipt in its
    claim slot; every batch member lies in its row's block; a batch row holds two or more
    members in job-id order. Returns the closures."""
    rows = closures(engine, s)
    twice = [k for k, n in Counter((r.job_id, r.run_lease) for r in rows).items() if n > 1]
    assert twice == [], twice
    assert all(r.has_receipt and r.in_block for r in rows), rows
    for b in batch_rows(engine, s):
        assert len(b.job_ids) == len(b.run_leases) >= 2, b
        assert list(zip(b.job_ids, b.run_leases, strict=True)) == sorted(zip(b.job_ids, b.run_leases, strict=True)), b
    return rows


def race(engine, first: Callable[[Any], Any], second: Callable[[], Any],
         meanwhile: Callable[[Any], Any] | None = None) -> Any:
    """Run ``first`` on a connection whose transaction stays open until ``second``, started
    on another thread, waits on a lock it holds; then ``meanwhile`` (if given) on the same
    transaction; commit; return ``second``'s result."""
    with engine.connect() as holder:
        holder.begin()
        first(holder)
        pid = holder.execute(text("SELECT pg_backend_pid()")).scalar_one()
        done, result, errors = threading.Event(), [], []

        def run() -> None:
            try:
                result.append(second())
            except Exception as err:  # surfaces below
                errors.append(err)
            finally:
                done.set()

        thread = threading.Thread(target=run)
        thread.start()
        try:
            assert blocked_by(engine, pid, done), f"the second call did not wait: {result} {errors}"
            if meanwhile is not None:
                meanwhile(holder)
        finally:
            holder.commit()
            thread.join(30)
    assert errors == [], errors
    return result[0]
